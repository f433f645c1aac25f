"""`meshnode bench gang`'s reading of one kill (testnet/bench_gang.py), from synthetic
progress logs: when every rank works again, the work lost, and which healthy ranks
were restarted. The real-testnet run is the benchmark itself (BENCHMARKS.md)."""

from testnet.bench_gang import gang_recovery, read_log_from, restarted_ranks
from testnet.bench_stats import ProgressLine

KILL_US = 1_000_000
VICTIM, SUCCESSOR = 1, 4


def lines(first_step: int, last_step: int, first_us: int, step_us: int = 5_000) -> list[ProgressLine]:
    return [ProgressLine(step, first_us + (step - first_step) * step_us) for step in range(first_step, last_step + 1)]


def two_rank_logs(resumed_us: int, healthy_back_us: int) -> dict:
    """Rank 0 on node 0 stays; rank 1's node (VICTIM) dies at KILL_US after step 20; rank 1
    resumes on SUCCESSOR from its checkpoint at step 18, so both go on from step 19."""
    return {
        0: {0: lines(1, 20, KILL_US - 95_000) + lines(19, 25, healthy_back_us)},
        1: {VICTIM: lines(1, 20, KILL_US - 95_000), SUCCESSOR: lines(19, 25, resumed_us)},
    }


def test_recovery_ends_when_the_last_rank_logs_the_step_after_the_one_the_gang_went_back_to():
    found = gang_recovery(two_rank_logs(KILL_US + 400_000, KILL_US + 420_000), [1], VICTIM, KILL_US, 5)
    assert found.restored_step == 18
    assert found.successors == {1: SUCCESSOR}
    assert found.recovery_ms == 420.0
    # Step 18 was done at KILL_US - 95 ms + 17 * 5 ms = KILL_US - 10 ms: 10 ms of work is done again.
    assert found.lost_work_ms == 10.0


def test_no_recovery_while_a_healthy_rank_has_not_worked_since_the_ring_was_rebuilt():
    logs = two_rank_logs(KILL_US + 400_000, KILL_US + 420_000)
    logs[0][0] = lines(1, 20, KILL_US - 95_000)   # rank 0 never logged step 19 again
    assert gang_recovery(logs, [1], VICTIM, KILL_US, 5) is None


def test_no_recovery_while_the_moved_rank_runs_nowhere_else():
    logs = two_rank_logs(KILL_US + 400_000, KILL_US + 420_000)
    del logs[1][SUCCESSOR]
    assert gang_recovery(logs, [1], VICTIM, KILL_US, 5) is None


def test_a_healthy_rank_counts_as_restarted_when_its_process_changed():
    before = {0: {101}, 2: {102}, 3: {103}}
    assert restarted_ranks(before, {0: {101}, 2: {102}, 3: {103}}) == []
    assert restarted_ranks(before, {0: {101}, 2: {202}, 3: set()}) == [2, 3]
    assert restarted_ranks(before, {0: {101, 301}, 2: {102}, 3: {103}}) == [0]


def test_a_log_read_from_an_offset_drops_the_line_the_offset_cuts(tmp_path):
    path = tmp_path / "progress.log"
    path.write_bytes(b"1234 1000\n1235 2000\n1236 3000\n")
    assert [line.unit for line in read_log_from(path, 2)] == [1235, 1236]   # "34 1000" is not step 34
    assert [line.unit for line in read_log_from(path, 0)] == [1234, 1235, 1236]
    assert read_log_from(tmp_path / "missing.log", 0) == []
