"""The built-in ``allreduce`` workload (SPEC.md GA5): ranks on loopback threads, a ring
all-reduce over real TCP each step, and a restored gang agreeing on one step."""

import socket
import threading

from meshnode.workload.builtin import (ALLREDUCE_STATE, EXIT_RING_BROKEN, EXIT_SUM_WRONG, MAX_ROLLBACK_STEPS,
                                      AllreduceRun, ProgressLog, Ring, run_allreduce)
from meshnode.workload.sdk import GangInfo, gang_environment, multiaddr_host
from protocol.flows.gang import GangRank


class FakeWorkload:
    def __init__(self, restored_step=None):
        self.restored_state = None if restored_step is None else ALLREDUCE_STATE.pack(restored_step)
        self.states = []

    def set_state(self, state, progress):
        self.states.append(progress)


def free_ports(count):
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_gang(world, restored, steps, corrupt_rank=None):
    peers = tuple(("127.0.0.1", port) for port in free_ports(world))
    workloads = [FakeWorkload(restored[rank]) for rank in range(world)]
    codes = [None] * world

    def rank_main(rank):
        gang = GangInfo("g", rank, world, peers)
        ring = Ring(gang, timeout_s=10)
        if rank == corrupt_rank:
            ring.allreduce = lambda vector, real=ring.allreduce: [v + 1 for v in real(vector)]
        codes[rank] = run_allreduce(workloads[rank], gang, 10, steps, 0, ProgressLog(None), ring=ring)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return codes, [w.states for w in workloads]


def start_survivors(peers, peers_file, ranks, steps, timeout_s=10):
    """Ranks of a gang of len(peers) that run on through a break, each in a thread: their
    AllreduceRuns, exit codes and threads (join them)."""
    runs, codes = {}, {}

    def survivor(rank):
        runs[rank] = AllreduceRun(FakeWorkload(), GangInfo("g", rank, len(peers), peers, str(peers_file)), 10, 0,
                                  ProgressLog(None), 0, timeout_s)
        codes[rank] = runs[rank].run(steps)

    threads = [threading.Thread(target=survivor, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    return runs, codes, threads


def test_three_ranks_sum_their_vectors_every_step():
    codes, states = run_gang(3, [None] * 3, steps=4)
    assert codes == [0, 0, 0] and states == [[1, 2, 3, 4]] * 3


def test_a_restored_gang_goes_on_from_the_smallest_step_any_rank_holds():
    codes, states = run_gang(3, [5, 3, 4], steps=6)
    assert codes == [0, 0, 0] and states == [[4, 5, 6]] * 3


def test_a_rank_a_grow_added_joins_at_the_gangs_step_and_takes_no_one_back_to_step_0():
    """GA9: a rank with no state (fresh) offers no step; the gang goes on from the smallest
    step the others hold. Before, the fresh rank's 0 took every rank back to step 0."""
    codes, states = run_gang(3, [5, 7, None], steps=8)
    assert codes == [0, 0, 0] and states == [[6, 7, 8]] * 3


def test_the_ring_refuses_to_go_back_further_than_the_rollback_bound(capsys):
    """GA11: a rank restored from a checkpoint far behind the others (`bench gang` seed 17:
    an older run's, 3,300 steps back, and the ring took every rank back 41.5 s) takes the
    gang's step; one at most MAX_ROLLBACK_STEPS behind still takes the gang back to it."""
    codes, states = run_gang(3, [5000, 5001, 5000 - MAX_ROLLBACK_STEPS - 1], steps=5002)
    assert codes == [0, 0, 0] and states == [[5001, 5002]] * 3
    assert "rank 2: its step 4743 is 258 steps behind the gang's newest 5001" in capsys.readouterr().out
    codes, states = run_gang(3, [300, 300 - MAX_ROLLBACK_STEPS, 300], steps=46)
    assert codes == [0, 0, 0] and states == [[45, 46]] * 3


def test_a_wrong_sum_ends_the_rank_and_breaks_the_ring_for_the_others():
    codes, _ = run_gang(2, [None, None], steps=3, corrupt_rank=1)
    assert codes == [EXIT_RING_BROKEN, EXIT_SUM_WRONG]


def test_gang_environment_round_trips_through_the_sdk():
    rank = GangRank(gang_id=b"\x01" * 32, rank=1, world_size=2, peers=((b"a" * 32, 20001), (b"b" * 32, 20002)))
    env = gang_environment(rank, {b"a" * 32: "10.0.0.1", b"b" * 32: "10.0.0.2"}.get)
    info = GangInfo.from_environment(env)
    assert (info.gang_id, info.rank, info.world_size, info.peers) == (
        "01" * 32, 1, 2, (("10.0.0.1", 20001), ("10.0.0.2", 20002)))
    assert GangInfo.from_environment({}) is None
    assert multiaddr_host("/ip4/10.1.2.3/tcp/4001/p2p/Qm") == "10.1.2.3"


def test_a_moved_rank_rejoins_and_the_others_go_on_without_restarting(tmp_path):
    """GA5: rank 1's process ends after 3 steps (its node died); ranks 0 and 2 keep their
    processes and step, wait for the node to publish rank 1's new address, rebuild the
    ring, and all go on from the step the moved rank's checkpoint holds (2)."""
    ports = free_ports(4)
    first = tuple(("127.0.0.1", port) for port in ports[:3])
    moved = (first[0], ("127.0.0.1", ports[3]), first[2])
    peers_file = tmp_path / "gang_peers"
    peers_file.write_text(",".join("%s:%d" % p for p in first))
    runs, codes, threads = start_survivors(first, peers_file, (0, 2), steps=8)
    gone = run_allreduce(FakeWorkload(), GangInfo("g", 1, 3, first), 10, 3, 0, ProgressLog(None))
    peers_file.write_text(",".join("%s:%d" % p for p in moved))   # the node learnt where rank 1 went
    replacement = FakeWorkload(restored_step=2)
    back = run_allreduce(replacement, GangInfo("g", 1, 3, moved), 10, 8, 0, ProgressLog(None), timeout_s=10)
    for thread in threads:
        thread.join(30)
    assert (gone, back, codes) == (0, 0, {0: 0, 2: 0})
    assert [runs[r].rebuilds for r in (0, 2)] == [1, 1]
    assert runs[0].workload.states == runs[2].workload.states == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert replacement.states == [3, 4, 5, 6, 7, 8]


def test_a_rank_moved_twice_rejoins_without_anyone_waiting_out_the_first_move(tmp_path):
    """GA5, two quick moves (BENCHMARKS.md, gangbench17's "ring rebuild after two moves"):
    rank 1's node dies, the node publishes rank 1 on a node that dies before the rank runs
    there (nobody listens), then on a third node, where it resumes from step 2. The
    survivors, dialling the first new address, switch to the newest peers as soon as they
    are published, and the replacement, started with the newest peers (its node's peers
    file unchanged since), waits for the survivors instead of for yet other peers. Before:
    the survivors dialled the dead address until their timeout, and the replacement gave
    up waiting for peers other than its own (exit 4)."""
    ports = free_ports(5)
    first = tuple(("127.0.0.1", port) for port in ports[:3])
    dead_move = (first[0], ("127.0.0.1", ports[3]), first[2])
    second_move = (first[0], ("127.0.0.1", ports[4]), first[2])
    peers_file = tmp_path / "gang_peers"
    peers_file.write_text(",".join("%s:%d" % p for p in first))
    runs, codes, threads = start_survivors(first, peers_file, (0, 2), steps=8, timeout_s=5)
    gone = run_allreduce(FakeWorkload(), GangInfo("g", 1, 3, first), 10, 3, 0, ProgressLog(None))
    peers_file.write_text(",".join("%s:%d" % p for p in dead_move))
    threading.Event().wait(0.3)
    peers_file.write_text(",".join("%s:%d" % p for p in second_move))
    replacement = FakeWorkload(restored_step=2)
    back = run_allreduce(replacement, GangInfo("g", 1, 3, second_move, str(peers_file)), 10, 8, 0, ProgressLog(None),
                         timeout_s=5)
    for thread in threads:
        thread.join(30)
    assert (gone, back, codes) == (0, 0, {0: 0, 2: 0})
    assert [runs[r].gang.peers for r in (0, 2)] == [second_move, second_move]
    assert runs[0].workload.states == runs[2].workload.states == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert replacement.states == [3, 4, 5, 6, 7, 8]


def test_a_shrunk_gang_renumbers_its_ranks_and_goes_on_with_the_smaller_world(tmp_path):
    """GA8: rank 1 is lost and the gang shrinks to 2: the node publishes the two survivors;
    rank 2 finds its own address at index 1 and becomes rank 1 of 2; both keep their
    processes and step and go on, their sums those of a world of 2. A published list with
    an unreachable rank (its replacement not decided yet) is waited past."""
    ports = free_ports(3)
    first = tuple(("127.0.0.1", port) for port in ports)
    peers_file = tmp_path / "gang_peers"
    peers_file.write_text(",".join("%s:%d" % p for p in first))
    runs, codes, threads = start_survivors(first, peers_file, (0, 2), steps=8)
    gone = run_allreduce(FakeWorkload(), GangInfo("g", 1, 3, first), 10, 3, 0, ProgressLog(None))
    peers_file.write_text("127.0.0.1:%d,0.0.0.0:%d,127.0.0.1:%d" % tuple(ports))   # rank 1 has no node yet
    threading.Event().wait(0.2)
    peers_file.write_text("127.0.0.1:%d,127.0.0.1:%d" % (ports[0], ports[2]))   # the shrink was decided
    for thread in threads:
        thread.join(30)
    assert (gone, codes) == (0, {0: 0, 2: 0})
    assert [(runs[r].gang.rank, runs[r].gang.world_size, runs[r].rebuilds) for r in (0, 2)] == [(0, 2, 1), (1, 2, 1)]
    assert runs[0].workload.states == runs[2].workload.states == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_barrier_returns_once_every_rank_reached_it():
    peers = tuple(("127.0.0.1", port) for port in free_ports(3))
    reached = []

    def rank_main(rank):
        ring = Ring(GangInfo("g", rank, 3, peers), timeout_s=10)
        if rank == 2:
            threading.Event().wait(0.3)   # the last to arrive
        reached.append(("in", rank))
        ring.barrier()
        reached.append(("out", rank))
        ring.close()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [kind for kind, _rank in reached[:3]] == ["in"] * 3 and len(reached) == 6
