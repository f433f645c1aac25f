"""The benchmark arithmetic (testnet/bench_stats.py) on synthetic progress logs.

The logs are what the ``counter`` workload writes: ``<unit> <wall_us>`` per finished
unit, one file per node that ran the job. Every scenario is built by hand so the
expected lost work is known exactly.
"""

import random

import pytest

from testnet.bench_stats import (ProgressLine, lost_work, overlapping_runs, parse_progress_log,
                                 parse_workload_starts, percentile, segments, stale_fence_starts, summary_ms)

UNIT_US = 1000  # the benchmark's counter runs 1 ms units


def run(first_unit: int, last_unit: int, first_us: int, step_us: int = UNIT_US) -> list[ProgressLine]:
    return [ProgressLine(u, first_us + (u - first_unit) * step_us) for u in range(first_unit, last_unit + 1)]


# --- percentiles -----------------------------------------------------------------------------

def test_nearest_rank_percentiles_of_1_to_100():
    values = list(range(1, 101))
    random.Random(7).shuffle(values)
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile(values, 0) == 1


def test_p99_of_few_samples_is_the_max():
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert summary_ms([3.0, 1.0, 2.0]) == {"p50": 2.0, "p99": 3.0, "max": 3.0, "n": 3}


def test_empty_summary_has_no_numbers_and_empty_percentile_raises():
    assert summary_ms([]) == {"p50": None, "p99": None, "max": None, "n": 0}
    with pytest.raises(ValueError):
        percentile([], 50)


# --- parsing and runs ------------------------------------------------------------------------

def test_torn_last_line_and_garbage_are_skipped():
    text = "1 1000\n2 2000\nxx yy\n3"  # each line is one write(2), but a reader may race the writer
    assert parse_progress_log(text) == [ProgressLine(1, 1000), ProgressLine(2, 2000)]
    assert parse_progress_log("1 1000\n2\n\n-3 5\n") == [ProgressLine(1, 1000)]


def test_segments_split_where_the_count_goes_back():
    lines = run(1, 5, 0) + run(3, 4, 10_000)
    found = segments(2, lines)
    assert [(s.node, s.first_unit, s.last_unit) for s in found] == [(2, 1, 5), (2, 3, 4)]
    assert found[1].first_us == 10_000 and found[1].last_us == 11_000


def test_segments_split_after_a_pause_when_asked_a_resumed_run_that_lost_nothing():
    # A preempted run stopped after unit 5 (a final checkpoint) and resumed at unit 6 on
    # the same node 3 s later: one count, two runs (gap_us); without gap_us, one run.
    lines = run(1, 5, 0) + run(6, 8, 3_005_000)
    assert [(s.first_unit, s.last_unit) for s in segments(2, lines, gap_us=1_000_000)] == [(1, 5), (6, 8)]
    assert [(s.first_unit, s.last_unit) for s in segments(2, lines)] == [(1, 8)]
    lost = lost_work({2: lines}, killed_node=2, kill_wall_us=4_000, successor_node=2, unit_ms=1, gap_us=1_000_000)
    assert (lost.restored_unit, lost.lost_units) == (5, 0)


# --- lost work -------------------------------------------------------------------------------

def test_lost_work_is_kill_time_minus_when_the_restored_unit_was_done():
    # node 0 ran units 1..250 (unit u at u ms), was killed at 250.4 ms; node 3 resumed
    # from a checkpoint at unit 180 and logs 181.. from 600 ms on.
    logs = {0: run(1, 250, 1000), 3: run(181, 200, 600_000)}
    lost = lost_work(logs, killed_node=0, kill_wall_us=250_400, successor_node=3, unit_ms=1)
    assert lost.last_unit_before_kill == 250
    assert lost.restored_unit == 180
    assert lost.lost_units == 70
    assert lost.lost_ms == 70.4


def test_lines_logged_after_the_kill_do_not_count_as_done_before_it():
    logs = {0: run(1, 300, 1000), 1: run(201, 210, 900_000)}
    lost = lost_work(logs, killed_node=0, kill_wall_us=250_000, successor_node=1, unit_ms=1)
    assert lost.last_unit_before_kill == 250 and lost.restored_unit == 200 and lost.lost_ms == 50.0


def test_a_successor_that_ran_the_job_before_is_judged_by_its_run_after_the_kill():
    # node 1 ran units 1..100 earlier (then lost the job), node 0 ran 101..400, node 1 resumes at 391.
    logs = {1: run(1, 100, 1000) + run(391, 395, 800_000), 0: run(101, 400, 101_000)}
    lost = lost_work(logs, killed_node=0, kill_wall_us=400_500, successor_node=1, unit_ms=1)
    assert lost.restored_unit == 390 and lost.lost_units == 10 and lost.lost_ms == 10.5


def test_restored_from_scratch_loses_everything_since_the_start():
    logs = {0: run(1, 40, 1000), 2: run(1, 3, 500_000)}
    lost = lost_work(logs, killed_node=0, kill_wall_us=40_000, successor_node=2, unit_ms=1)
    assert lost.restored_unit == 0 and lost.lost_units == 40 and lost.lost_ms == 40.0


def test_no_resumed_run_means_no_answer():
    logs = {0: run(1, 40, 1000), 2: run(1, 3, 500)}  # node 2's run is before the kill
    assert lost_work(logs, 0, 40_000, 2, 1) is None
    assert lost_work(logs, 0, 40_000, 4, 1) is None


# --- double runs -----------------------------------------------------------------------------

def test_a_clean_migration_is_not_a_double_run():
    logs = {0: run(1, 250, 1000), 3: run(181, 300, 600_000)}
    assert overlapping_runs(logs, tolerance_us=5 * UNIT_US) == []


def test_two_nodes_logging_the_job_at_once_are_a_double_run():
    logs = {0: run(1, 250, 1000), 3: run(181, 300, 200_000)}  # node 0 still ran when node 3 started
    pairs = overlapping_runs(logs, tolerance_us=5 * UNIT_US)
    assert [(a.node, b.node) for a, b in pairs] == [(0, 3)]


def test_one_node_restarting_its_own_run_is_not_a_double_run():
    logs = {0: run(1, 50, 1000) + run(41, 60, 51_000)}
    assert overlapping_runs(logs, tolerance_us=5 * UNIT_US) == []


# --- starts under a stale fence --------------------------------------------------------------

NODE0_LOG = """2026-11-20 23:53:23,287 INFO meshnode.node: job_started job_id=787b fence=1 from_seq=0
2026-11-20 23:53:23,999 INFO meshnode.node: checkpoint 787b seq 1 refused by the local store
2026-11-20 23:53:30,217 INFO meshnode.node: job_started job_id=787b fence=1 from_seq=2
"""
NODE1_LOG = "2026-11-20 23:53:24,585 INFO meshnode.node: job_started job_id=787b fence=2 from_seq=2\n"


def test_a_restarted_node_starting_a_job_that_moved_on_is_a_stale_start():
    starts = parse_workload_starts(0, NODE0_LOG) + parse_workload_starts(1, NODE1_LOG)
    assert [(s.node, s.fence) for s in starts] == [(0, 1), (0, 1), (1, 2)]
    assert [(s.node, s.at) for s in stale_fence_starts(starts)] == [(0, "2026-11-20 23:53:30,217")]


def test_migrations_under_rising_fences_are_not_stale():
    starts = parse_workload_starts(0, NODE0_LOG.split("\n")[0]) + parse_workload_starts(1, NODE1_LOG)
    assert stale_fence_starts(starts) == []
