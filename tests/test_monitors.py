"""O(k) failure detection (SPEC.md F1, F1a, F4): who watches whom, what an idle mesh sends,
and that evictions still need suspicion from more than a third of the stake, come for a
crash, and never for a pause shorter than the detection bound. Pure cores, an integer
clock and a FIFO router that knows who sent what (the channel authenticates heartbeats)."""

import hashlib
import random
import re
from collections import deque
from pathlib import Path

import pytest

from keys.genesis import DEFAULT_PARAMS, Genesis
from keys.identity import SigningIdentity
from protocol.drain import ReadyDrain
from protocol.mesh import MeshCore
from protocol.messages import Heartbeat, Member, Suspicion, decode_message, encode_message, is_heartbeat_frame
from protocol.monitors import MONITORS_PER_MEMBER, monitor_assignment, subjects_in
from protocol.policy import LocalCapacity, NodePolicy

SPEC = (Path(__file__).resolve().parent.parent / "SPEC.md").read_text(encoding="utf-8")
BOUND = DEFAULT_PARAMS.detection_bound_ms
PERIOD = DEFAULT_PARAMS.heartbeat_ms


def identities(n: int) -> list:
    return [SigningIdentity(hashlib.sha256(b"monitor-node-%d" % i).digest()) for i in range(n)]


class Mesh:
    """n equal-stake cores. ``down``: crashed (sends and reads nothing); ``paused``: stopped
    (no ticks; what it is sent waits, as in its sockets, and is read on ``resume``)."""

    def __init__(self, n: int, sparse_ticks: bool = False, take_where_read: bool = False):
        # sparse_ticks: tick as the node driver does (meshnode/node/driver.py), only when
        # MeshCore.next_tick_ms says (at least every 5 ms, at most every 50 ms), asking
        # again after every input; otherwise every 5 ms.
        self.sparse_ticks = sparse_ticks
        # take_where_read: offer each heartbeat to MeshCore.take_heartbeat before stepping it,
        # as the node's transport reader does (SPEC F1d).
        self.take_where_read = take_where_read
        self.heartbeats_taken = 0
        self.wake = {}
        self.ticks = {}
        self.ids = identities(n)
        self.keys = [i.public_key for i in self.ids]
        self.genesis = Genesis(name="monitors", created_ms=0, params=DEFAULT_PARAMS, authorities=(),
                               members=tuple(Member(public_key=k, stake=10, zone="z", labels=(), addrs=())
                                             for k in self.keys))
        self.now = 0
        self.cores = {i.public_key: MeshCore(identity=i, genesis=self.genesis, policy=NodePolicy(zone="z"),
                                             capacity=LocalCapacity(gpu_mem_total_mib=(80_000,)),
                                             rng=random.Random(index), now_ms=0)
                      for index, i in enumerate(self.ids)}
        self.queue = deque()
        self.send_lag = {}   # node -> ms its frames take to leave (a loaded host's writers)
        self.lagged = []     # (due_ms, src, target, data) not sent yet
        self.down, self.paused = set(), set()
        self.held = {k: [] for k in self.keys}
        self.decisions = {k: [] for k in self.keys}
        self.events = {k: [] for k in self.keys}
        self.heartbeats_sent = {k: 0 for k in self.keys}
        self.drains = {k: ReadyDrain(persist=lambda r: None, send=lambda m, k=k: self.send(k, m),
                                     apply=self.decisions[k].append, publish=self.events[k].extend)
                       for k in self.keys}

    def send(self, src, messages):
        core = self.cores[src]
        for message in messages:
            targets = core.broadcast_targets() if message.to is None else [message.to]
            if b"heartbeat" in message.data:
                self.heartbeats_sent[src] += len(targets)
            lag = self.send_lag.get(src, 0)
            if lag:
                self.lagged.extend((self.now + lag, src, target, message.data) for target in targets)
            else:
                self.queue.extend((src, target, message.data) for target in targets)

    def deliver(self):
        due = [item for item in self.lagged if item[0] <= self.now]
        self.lagged = [item for item in self.lagged if item[0] > self.now]
        self.queue.extend(item[1:] for item in due)
        while self.queue:
            src, target, data = self.queue.popleft()
            if target in self.down or target not in self.cores:
                continue
            if target in self.paused:
                self.held[target].append((src, data))
            elif (self.take_where_read and is_heartbeat_frame(data)
                  and self.cores[target].take_heartbeat(data, self.now, src)):
                self.heartbeats_taken += 1   # no Ready, and no earlier deadline: the wake stands
            else:
                self.drains[target].drain(self.cores[target].step(data, self.now, src))
                self.wake[target] = min(self.wake.get(target, 0), self._next_wake(target))

    def _next_wake(self, key) -> int:
        due = self.cores[key].next_tick_ms(self.now)
        return self.now + min(max(due - self.now, 5), 50)

    def run(self, ms: int, step_ms: int = 5):
        for _ in range(ms // step_ms):
            self.deliver()
            self.now += step_ms
            for key, core in self.cores.items():
                if key in self.down or key in self.paused:
                    continue
                if self.sparse_ticks and self.now < self.wake.get(key, 0):
                    continue
                self.drains[key].drain(core.tick(self.now))
                self.ticks[key] = self.ticks.get(key, 0) + 1
                self.wake[key] = self._next_wake(key)
        self.deliver()

    def resume(self, key, read_lag_ms: int = 0):
        """SIGCONT: the overdue tick first, then the frames that waited are read, after
        ``read_lag_ms`` (a loaded node's receive path lags its timer: Noise, yamux, trio)."""
        self.paused.discard(key)
        self.drains[key].drain(self.cores[key].tick(self.now))
        if read_lag_ms:
            self.paused.add(key)   # sends what its tick sent; reads nothing yet
            self.run(read_lag_ms)
            self.paused.discard(key)
        for src, data in self.held[key]:
            self.drains[key].drain(self.cores[key].step(data, self.now, src))
        self.held[key].clear()

    def evictions(self, key) -> list:
        return [d.value.node for d in self.decisions[key] if d.value_kind == "eviction"]

    def suspect_events(self, suspect: bytes) -> list:
        return [e for k in self.keys for e in self.events[k] if e.kind == "suspect"
                and e.detail["suspect"] == suspect.hex()]


# --- the assignment (F1a) ----------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8, 16, 33])
def test_every_member_computes_the_same_well_formed_assignment(n):
    keys = [i.public_key for i in identities(n)]
    assignment = monitor_assignment(keys)
    shuffled = list(keys)
    random.Random(n).shuffle(shuffled)
    assert monitor_assignment(shuffled) == assignment   # the membership's order does not matter
    k = min(MONITORS_PER_MEMBER, n - 1)
    for subject, monitors in assignment.items():
        assert len(monitors) == len(set(monitors)) == k and subject not in monitors
        assert set(monitors) <= set(keys)
    for member in keys:   # every member watches someone: it notices silence (F3)
        assert n == 1 or subjects_in(assignment, member)
    if n <= MONITORS_PER_MEMBER + 1:   # small meshes: everyone watches everyone, as before
        assert all(set(m) == set(keys) - {s} for s, m in assignment.items())


def test_one_member_leaving_moves_few_monitors():
    keys = [i.public_key for i in identities(32)]
    before = monitor_assignment(keys)
    after = monitor_assignment(keys[1:])
    changed = [s for s in keys[1:] if before[s] != after[s]]
    assert keys[0] not in {m for monitors in after.values() for m in monitors}
    # Those it watched (k of them), and a few whose later-ring pick it displaced.
    assert len(changed) <= 2 * MONITORS_PER_MEMBER


def _ring_reference(members: list, subject: bytes, k: int) -> list:
    """SPEC.md F1a from its text, with hashlib alone."""
    chosen = []
    for ring in range(k):
        order = sorted(members, key=lambda key: hashlib.sha256(b"meshnode/monitor-ring" + bytes([ring]) + key).digest())
        index = order.index(subject)
        for step in range(1, len(order)):
            candidate = order[(index + step) % len(order)]
            if candidate not in chosen:
                chosen.append(candidate)
                break
    return chosen


def test_spec_vector_of_the_assignment():
    block = re.search(r"```\nmonitor vector\n(.*?)```", SPEC, flags=re.S).group(1)
    lines = dict(line.split(": ", 1) for line in block.strip().splitlines())
    members = [bytes.fromhex(h) for h in lines["members"].split()]
    assert members == [hashlib.sha256(b"monitor-vector-%d" % i).digest() for i in range(len(members))]
    subject = bytes.fromhex(lines["subject"])
    expected = [bytes.fromhex(h) for h in lines["monitors"].split()]
    assert _ring_reference(members, subject, min(MONITORS_PER_MEMBER, len(members) - 1)) == expected
    assert list(monitor_assignment(members)[subject]) == expected


# --- an idle mesh (F1) ----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [4, 16])
def test_an_idle_mesh_sends_k_heartbeats_per_member_and_period_and_suspects_nobody(n):
    mesh = Mesh(n)
    mesh.run(1000)
    k = min(MONITORS_PER_MEMBER, n - 1)
    periods = 1000 // PERIOD
    for key, core in mesh.cores.items():
        assert mesh.heartbeats_sent[key] >= k * periods
        assert set(core.detector.peers()) == set(core.liveness.subjects())
    # Besides those to its monitors, a member answers each sync request with one (F6: 3 at
    # the start and 1 a second per member, mesh-wide): O(k) per member, whatever n is.
    assert sum(mesh.heartbeats_sent.values()) <= n * (k * (periods + 1) + 3 + 1)
    assert not any(e.kind == "suspect" for events in mesh.events.values() for e in events)


def test_an_idle_core_needs_a_tick_per_heartbeat_not_one_per_5_ms():
    """Issue 18: the driver ticks when MeshCore.next_tick_ms says; an idle member's core asks
    for about one tick per heartbeat period (and its syncs), a tenth of the 5 ms loop's."""
    mesh = Mesh(8, sparse_ticks=True)
    mesh.run(2000)
    periods = 2000 // PERIOD
    assert all(periods <= ticks <= periods + 2000 // 1000 * 2 + 4 for ticks in mesh.ticks.values()), mesh.ticks
    assert not any(e.kind == "suspect" for events in mesh.events.values() for e in events)
    dense = Mesh(8)
    dense.run(2000)
    assert sum(mesh.heartbeats_sent.values()) == pytest.approx(sum(dense.heartbeats_sent.values()), rel=0.05)


def test_a_held_suspicion_needs_ticks_at_its_deadlines_not_one_per_5_ms():
    """Issue 18 (SPEC F3a): while a suspicion is held (3 detection bounds after it arrived),
    every member used to tick every 5 ms; on a starved host each suspicion so cost the whole
    mesh 180 ticks per member. Now it ticks at its timers' deadlines (heartbeats, the
    suspect's silence threshold, the suspicion's lapse), and a refuted lie evicts no one."""
    mesh = Mesh(16, sparse_ticks=True)
    mesh.run(500)
    liar, target = mesh.keys[0], mesh.keys[7]
    lie = encode_message(mesh.ids[0], mesh.genesis.mesh_id, Suspicion(suspect=target, epoch=0, silent_ms=10_000))
    mesh.queue.extend((liar, k, lie) for k in mesh.keys if k not in (liar, target))
    mesh.deliver()
    assert all(mesh.cores[k].liveness.suspicions for k in mesh.keys if k not in (liar, target))
    mesh.ticks = {}
    mesh.run(1000)
    periods = 1000 // PERIOD
    assert all(ticks <= 2 * periods for ticks in mesh.ticks.values()), mesh.ticks
    assert not any(mesh.evictions(k) for k in mesh.keys)


# --- crashes, pauses and lone suspicions (F4, F5) ---------------------------------------------

@pytest.mark.parametrize("sparse_ticks", [False, True])
def test_a_crashed_member_is_suspected_within_the_bound_and_evicted_by_more_than_a_third(sparse_ticks):
    mesh = Mesh(16, sparse_ticks=sparse_ticks)
    mesh.run(500)
    victim = mesh.keys[5]
    crashed_ms = mesh.now
    mesh.down.add(victim)
    mesh.run(1500)
    survivors = [k for k in mesh.keys if k != victim]
    assert all(mesh.evictions(k) == [victim] for k in survivors)
    first = min(e.at_ms for e in mesh.suspect_events(victim))
    assert first - crashed_ms <= BOUND
    # Its monitors suspected it first, then members they told found it silent themselves.
    core = mesh.cores[survivors[0]]
    eviction = next(d for d in mesh.decisions[survivors[0]] if d.value_kind == "eviction")
    monitors = set(monitor_assignment(mesh.keys)[victim])
    suspecters = {e_key for e_key in survivors if any(e.kind == "suspect" for e in mesh.events[e_key])}
    assert monitors < suspecters and 3 * len(suspecters) > len(mesh.keys)
    assert core.epoch == 1 and eviction.certificate


@pytest.mark.parametrize("sparse_ticks", [False, True])
@pytest.mark.parametrize("pause_ms, evicted", [(150, False), (280, False), (900, True)])
def test_a_pause_shorter_than_the_bound_evicts_no_one(pause_ms, evicted, sparse_ticks):
    mesh = Mesh(16, sparse_ticks=sparse_ticks)
    mesh.run(500)
    sleeper = mesh.keys[3]
    mesh.paused.add(sleeper)
    mesh.run(pause_ms)
    mesh.resume(sleeper)
    mesh.run(2000)
    others = [k for k in mesh.keys if k != sleeper]
    assert all(mesh.evictions(k) == ([sleeper] if evicted else []) for k in others)
    if not evicted:
        assert all(core.epoch == 0 for core in mesh.cores.values())


@pytest.mark.parametrize("pause_ms, read_lag_ms, send_lag_ms", [(270, 60, 0), (290, 60, 0), (270, 0, 80)])
def test_a_stall_past_the_threshold_is_suspected_by_the_monitors_alone(pause_ms, read_lag_ms, send_lag_ms):
    """Issue 18 (3,790 suspicions in a 5-minute idle soak at n = 16): a member stalled a little
    past the suspicion threshold (shorter than the bound) is suspected by its k monitors, and
    every member their suspicion reached watches it itself (F4). Its answer used to wait until
    it had read the suspicion, behind everything sent to it during the stall: 60 ms later all
    11 other members suspected it too, each suspicion a signed broadcast; it now refutes on
    the tick that measured the stall (F1b). And when its frames then took 80 ms to leave (a
    loaded host's writers), the others flagged it two periods after the suspicion came, and
    evicted it; they now wait two more (F4), while the eviction's own wait is as before."""
    mesh = Mesh(16, sparse_ticks=True)
    mesh.run(500)
    sleeper = mesh.keys[3]
    mesh.paused.add(sleeper)
    mesh.run(pause_ms)
    mesh.send_lag[sleeper] = send_lag_ms
    mesh.resume(sleeper, read_lag_ms=read_lag_ms)
    mesh.run(300)
    mesh.send_lag[sleeper] = 0
    mesh.run(2000)
    suspecters = {key for key in mesh.keys if any(e.kind == "suspect" and e.detail["suspect"] == sleeper.hex()
                                                   for e in mesh.events[key])}
    assert suspecters == set(monitor_assignment(mesh.keys)[sleeper])
    assert len(mesh.suspect_events(sleeper)) == MONITORS_PER_MEMBER
    assert not any(mesh.evictions(key) for key in mesh.keys)


def test_one_members_suspicion_of_a_live_member_evicts_no_one():
    """A Byzantine monitor claims a live member has been silent for 10 s, to everyone but it:
    the others watch it themselves, the suspect hears their suspicions and refutes them."""
    mesh = Mesh(16)
    mesh.run(500)
    liar, target = mesh.keys[0], mesh.keys[7]
    lie = encode_message(mesh.ids[0], mesh.genesis.mesh_id, Suspicion(suspect=target, epoch=0, silent_ms=10_000))
    mesh.queue.extend((liar, k, lie) for k in mesh.keys if k not in (liar, target))
    mesh.run(3000)
    assert not any(mesh.evictions(k) for k in mesh.keys)
    assert all(core.epoch == 0 for core in mesh.cores.values())


def test_a_refuted_suspicion_costs_a_few_periods_of_heartbeats_to_all_and_a_later_crash_is_still_evicted():
    """F4a (issue 18): a live member falsely suspected heartbeats every member for
    REFUTE_PERIODS periods, not for as long as the suspicion counts (3 detection bounds: 18
    periods before), and those who heard it stop timing its silence; but when it really
    crashes later, its monitors' suspicion re-arms them and it is evicted."""
    from protocol.liveness import REFUTE_PERIODS
    n = 16
    mesh = Mesh(n)
    mesh.run(500)
    liar, target = mesh.keys[0], mesh.keys[7]
    lie = encode_message(mesh.ids[0], mesh.genesis.mesh_id, Suspicion(suspect=target, epoch=0, silent_ms=10_000))
    mesh.queue.extend((liar, k, lie) for k in mesh.keys if k not in (liar, target))
    before = mesh.heartbeats_sent[target]
    mesh.run(1000)
    k = min(MONITORS_PER_MEMBER, n - 1)
    refutation = mesh.heartbeats_sent[target] - before - k * (1000 // PERIOD)
    # one round of suspicions (10 suspecters), each refuted at most once a period: 223 before F4a
    assert 0 < refutation <= 2 * (REFUTE_PERIODS + 1) * (n - 1)
    assert all(core.epoch == 0 for core in mesh.cores.values())
    mesh.run(1000)   # the suspicions lapse
    crashed_ms = mesh.now
    mesh.down.add(target)
    mesh.run(1500)
    survivors = [key for key in mesh.keys if key != target]
    assert all(mesh.evictions(key) == [target] for key in survivors)
    assert min(e.at_ms for e in mesh.suspect_events(target) if e.at_ms > crashed_ms) - crashed_ms <= BOUND


def test_a_member_that_hears_less_than_two_thirds_of_the_stake_sends_no_suspicion():
    """F4a: with more than a third of the stake silent to it, no eviction could be decided,
    and the silent one is most likely itself (cut off, starved): it suspects nobody aloud,
    while one dead member of four is still suspected."""
    mesh = Mesh(4)
    mesh.run(500)
    alone = mesh.keys[0]
    mesh.down.update(mesh.keys[1:])   # it hears nobody (nor do they hear it)
    mesh.run(1000)
    assert not any(e.kind == "suspect" for e in mesh.events[alone])
    assert mesh.cores[alone].counters["suspicion_ticks_withheld"] > 0
    mesh = Mesh(4)
    mesh.run(500)
    mesh.down.add(mesh.keys[3])
    mesh.run(1000)
    assert any(e.kind == "suspect" for e in mesh.events[mesh.keys[0]])


def test_after_an_eviction_members_watch_their_new_subjects_and_suspect_no_one_else():
    mesh = Mesh(16)
    mesh.run(500)
    victim = mesh.keys[9]
    mesh.down.add(victim)
    mesh.run(1500)
    mesh.events = {k: [] for k in mesh.keys}
    for key in mesh.keys:
        mesh.drains[key].publish = mesh.events[key].extend
    mesh.run(2000)
    survivors = [k for k in mesh.keys if k != victim]
    assignment = monitor_assignment(survivors)
    for key in survivors:
        core = mesh.cores[key]
        assert core.epoch == 1
        assert set(core.detector.peers()) == set(subjects_in(assignment, key))
    assert not any(e.kind == "suspect" for events in mesh.events.values() for e in events)


def test_a_heartbeat_counts_only_unsigned_and_from_its_sender():
    mesh = Mesh(4)
    a, b, c = mesh.keys[:3]
    core = mesh.cores[a]
    beat = Heartbeat(epoch=0, seq=1, sent_ms=0)
    unsigned = mesh.cores[b].ctx.unsigned(beat)
    signed = encode_message(mesh.ids[1], mesh.genesis.mesh_id, beat)
    core.step(unsigned, 0, c)   # relayed or forged by another peer
    core.step(signed, 0, b)     # signed: refused (2.2)
    assert not core.detector.is_watched(b)
    assert core.counters["undecodable"] == 2
    core.step(unsigned, 0, b)
    assert core.detector.is_watched(b)
    assert decode_message(unsigned, mesh.genesis.mesh_id, channel_sender=b)[0].signature == b""


def test_after_a_pause_a_non_subjects_first_heartbeat_does_not_end_the_halt():
    """F3: a member we watch no heartbeats of may have one waiting in our sockets (an answer
    to our last sync): its first one read after the halt is only the reference."""
    mesh = Mesh(16)
    mesh.run(500)
    sleeper = mesh.keys[2]
    core = mesh.cores[sleeper]
    mesh.paused.add(sleeper)
    mesh.run(400)
    mesh.held[sleeper].clear()   # its subjects' heartbeats sent late in the pause would count (F3)
    mesh.resume(sleeper)
    assert core.halted
    gap = core.liveness.halt_gap_ms
    # A member it never read a heartbeat from (not a subject, and no sync answer came from it).
    stranger = next(k for k in mesh.keys if k != sleeper and k not in core.liveness.subjects()
                    and k not in core.liveness.peer_beat_sent_ms)
    beat = lambda sent_ms: mesh.cores[stranger].ctx.unsigned(Heartbeat(epoch=0, seq=sent_ms, sent_ms=sent_ms))
    core.step(beat(mesh.now), mesh.now, stranger)
    assert core.halted
    later = mesh.now + gap - PERIOD
    ready = core.step(beat(later), later, stranger)
    assert not core.halted and any(d.value_kind == "resume" for d in ready.decisions)
