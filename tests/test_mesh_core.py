"""MeshCore end to end, in process: 4 cores, a tiny FIFO router, an integer clock
(SPEC.md section 7, rules P1-P6, F1-F7)."""

import hashlib
import random
from collections import deque

import pytest

from keys.genesis import DEFAULT_PARAMS, Genesis
from keys.identity import SigningIdentity
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.mesh import MeshCore
from protocol.messages import (Cancel, Checkpoint, Heartbeat, Constraints, JobManifest, Member, Resources, encode_message,
                               job_id)
from protocol.policy import LocalCapacity, NodePolicy

IDS = [SigningIdentity(hashlib.sha256(b"mesh-node-%d" % i).digest()) for i in range(4)]
KEYS = [i.public_key for i in IDS]
OWNER = SigningIdentity(hashlib.sha256(b"owner").digest())
ZONES = ["zone-a", "zone-a", "zone-b", "zone-b"]
GENESIS = Genesis(name="test", created_ms=0, params=DEFAULT_PARAMS, authorities=(),
                  members=tuple(Member(public_key=k, stake=10, zone=z, labels=(), addrs=())
                                for k, z in zip(KEYS, ZONES)))
MESH = GENESIS.mesh_id


def make_job(nonce=1, gpus=1, entrypoint="counter", backups=1, strategy="throughput", zones=()):
    job = JobManifest(owner=OWNER.public_key, name="job%d" % nonce, nonce=nonce, entrypoint=entrypoint, args=(),
                      resources=Resources(gpus=gpus, gpu_mem_mib=1000, cpu_milli=500, mem_mib=512),
                      strategy=strategy, constraints=Constraints(zones=zones, labels=(), attested=()),
                      priority=0, backups=backups, max_retries=0, created_ms=0)
    return job, encode_message(OWNER, MESH, job)


class Net:
    """Delivers every message in FIFO order; ``down`` nodes neither send nor receive."""

    def __init__(self, gpus=(2, 2, 2, 2), history=None):
        self.now = 0
        self.cores = {}
        for index, identity in enumerate(IDS):
            self.cores[identity.public_key] = MeshCore(
                identity=identity, genesis=GENESIS, policy=NodePolicy(zone=ZONES[index]),
                capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * gpus[index]), rng=random.Random(index),
                now_ms=0, history=(history or {}).get(identity.public_key, ()))
        self.queue = deque()
        self.down = set()
        self.decisions = {k: [] for k in KEYS}
        self.events = {k: [] for k in KEYS}
        self.certificates = {k: [] for k in KEYS}

    def emit(self, src, ready):
        for record in ready.persist:
            if record.table == "certificates":
                self.certificates[src].append(record.value["certificate"])
        for message in ready.messages:
            targets = self.cores[src].broadcast_targets() if message.to is None else [message.to]
            for target in targets:
                self.queue.append((target, message.data))
        self.decisions[src].extend(ready.decisions)
        self.events[src].extend(ready.events)

    def deliver(self):
        while self.queue:
            target, data = self.queue.popleft()
            if target not in self.down:
                self.emit(target, self.cores[target].step(data, self.now))

    def run(self, ms, step_ms=5):
        for _ in range(ms // step_ms):
            self.deliver()
            self.now += step_ms
            for key, core in self.cores.items():
                if key not in self.down:
                    self.emit(key, core.tick(self.now))
        self.deliver()

    def submit(self, at, envelope):
        self.emit(at, self.cores[at].submit(envelope, self.now))

    def certified(self, key, kind):
        return [d for d in self.decisions[key] if d.value_kind == kind]


def test_every_core_decides_the_same_placement():
    net = Net(gpus=(2, 4, 2, 2))
    job, envelope = make_job(backups=1)
    net.submit(KEYS[0], envelope)
    net.run(100)
    placements = [net.certified(k, "placement") for k in KEYS]
    assert all(len(p) == 1 for p in placements)
    assert len({p[0].value for p in placements}) == 1
    placement = placements[0][0].value
    assert placement.primary == KEYS[1]  # throughput: most free GPUs
    assert placement.backups[0] in (KEYS[2], KEYS[3])  # another zone than the primary's
    for key, core in net.cores.items():
        view = core.job_view(job_id(job))
        assert view["state"] == "placed" and view["fence"] == 1 and view["primary"] == KEYS[1]
        held_gpus = core.book.held_totals()[0]
        assert held_gpus == (1 if key == KEYS[1] else 0)  # losers released their reservations


def test_no_eligible_node_leaves_the_job_pending_with_declines_by_reason():
    net = Net()
    job, envelope = make_job(gpus=3)  # every node has 2 GPUs
    net.submit(KEYS[2], envelope)
    net.run(60)
    for core in net.cores.values():
        view = core.job_view(job_id(job))
        assert view["state"] == "pending"
        assert {r: sorted(v) for r, v in view["declines"].items()} == {"not_enough_gpus": sorted(KEYS)}
    assert not any(net.certified(k, "placement") for k in KEYS)


def test_policy_declines_are_grouped_per_reason():
    net = Net(gpus=(2, 2, 0, 0))
    job, envelope = make_job(gpus=1, entrypoint="train")
    net.cores[KEYS[0]].policy = NodePolicy(zone=ZONES[0], allowed_entrypoints=frozenset({"counter"}))
    net.cores[KEYS[1]].policy = NodePolicy(zone=ZONES[1], allowed_entrypoints=frozenset({"counter"}))
    net.submit(KEYS[0], envelope)
    net.run(60)
    declines = net.cores[KEYS[3]].job_view(job_id(job))["declines"]
    assert sorted(declines["entrypoint_not_allowed"]) == sorted(KEYS[:2])
    assert sorted(declines["not_enough_gpus"]) == sorted(KEYS[2:])


def test_dead_primary_is_evicted_and_its_job_migrates_to_the_backup():
    net = Net(gpus=(4, 2, 2, 2))
    job, envelope = make_job(backups=1)
    jid = job_id(job)
    net.submit(KEYS[1], envelope)
    net.run(50)
    primary, backup = KEYS[0], net.cores[KEYS[1]].job_view(jid)["backups"][0]
    assert net.cores[KEYS[1]].job_view(jid)["primary"] == primary
    net.emit(primary, net.cores[primary].local_checkpoint(jid, 1, 10, net.now, b"state-1", net.now))
    net.deliver()
    assert net.cores[backup].job_view(jid)["last_checkpoint_seq"] == 1
    stale = net.cores[primary]  # keep the dead node's core: it will try to checkpoint later
    killed_at = net.now
    net.down.add(primary)
    net.run(600)
    survivors = [k for k in KEYS if k != primary]
    for key in survivors:
        evictions = net.certified(key, "eviction")
        assert len(evictions) == 1 and evictions[0].value.node == primary
        migration, = evictions[0].value.migrations
        assert (migration.job_id, migration.to_node) == (jid, backup)
        view = net.cores[key].job_view(jid)
        assert view["primary"] == backup and view["fence"] == 2 and view["migrations"] == 1
        assert net.cores[key].epoch == 1 and primary not in net.cores[key].view.stakes
    decided_at = min(e.at_ms for e in net.events[survivors[0]] if e.kind == "epoch")
    assert decided_at - killed_at <= DEFAULT_PARAMS.detection_bound_ms + 2 * DEFAULT_PARAMS.round_timeout_ms
    # The fenced ex-primary's checkpoint (old fence) is refused and counted.
    old = Checkpoint(job_id=jid, fence=1, seq=2, progress=20, taken_ms=net.now, state=b"late",
                     state_hash=hashlib.sha256(b"late").digest())
    before = net.cores[backup].counters["checkpoint_stale_fence"]
    ready = net.cores[backup].step(encode_message(IDS[KEYS.index(primary)], MESH, old), net.now)
    assert net.cores[backup].counters["checkpoint_stale_fence"] == before + 1 and not ready.persist
    # The new primary may checkpoint; the old one learns of its eviction from a heartbeat reply.
    net.emit(backup, net.cores[backup].local_checkpoint(jid, 2, 20, net.now, b"state-2", net.now))
    net.down.discard(primary)
    net.run(20)
    assert stale.epoch == 1 and not stale.is_member()
    assert [d.value.node for d in net.certified(primary, "eviction")] == [primary]
    with pytest.raises(LocalProtocolError):
        stale.local_checkpoint(jid, 3, 30, net.now, b"x", net.now)


def test_hiccup_shorter_than_min_silence_evicts_nobody():
    net = Net()
    net.run(200)
    net.down.add(KEYS[3])
    net.run(DEFAULT_PARAMS.detection_bound_ms - 2 * DEFAULT_PARAMS.heartbeat_ms)
    net.down.discard(KEYS[3])
    net.run(400)
    assert all(core.epoch == 0 for core in net.cores.values())
    assert not any(net.certified(k, "eviction") for k in KEYS)


def test_paused_node_halts_then_resumes_when_not_evicted():
    net = Net(gpus=(4, 2, 2, 2))
    job, envelope = make_job()
    net.submit(KEYS[0], envelope)
    net.run(50)
    paused = net.cores[KEYS[0]]
    later = net.now + DEFAULT_PARAMS.detection_bound_ms + 1
    out = paused.tick(later)
    assert [(d.value_kind, d.value) for d in out.decisions] == [("halt", ())]
    assert any(e.kind == "self_fence_check" for e in out.events)
    assert any(m.to is None and b"sync_request" in m.data for m in out.messages)
    beat = encode_message(IDS[1], MESH, Heartbeat(epoch=0, seq=999, sent_ms=later))
    ready = paused.step(beat, later)
    assert [(d.value_kind, d.value) for d in ready.decisions] == [("resume", (job_id(job),))]
    assert not paused.step(beat, later).decisions  # resumed once


def test_bad_input_is_counted_never_raised():
    net = Net()
    core = net.cores[KEYS[0]]
    for garbage in (b"", b"\xff" * 10, b"\x96" + b"\x00" * 5, encode_message(IDS[1], bytes(32), make_job()[0])[:-1]):
        assert not core.step(garbage, 0)
    assert core.counters["undecodable"] == 4
    with pytest.raises(RemoteProtocolError):
        core.submit(encode_message(IDS[1], MESH, make_job()[0]), 0)  # not signed by the owner


def test_only_the_owner_can_cancel():
    net = Net()
    job, envelope = make_job()
    jid = job_id(job)
    net.submit(KEYS[0], envelope)
    net.run(50)
    primary = net.cores[KEYS[0]].job_view(jid)["primary"]
    with pytest.raises(RemoteProtocolError):
        net.cores[KEYS[0]].cancel(encode_message(IDS[0], MESH, Cancel(job_id=jid, requested_ms=1)), net.now)
    got, ready = net.cores[KEYS[0]].cancel(encode_message(OWNER, MESH, Cancel(job_id=jid, requested_ms=1)), net.now)
    assert got == jid
    net.emit(KEYS[0], ready)
    net.deliver()
    assert all(c.job_view(jid)["state"] == "cancelled" for c in net.cores.values())
    assert [d.value for d in net.decisions[primary] if d.value_kind == "cancel"] == [(jid,)]
    assert net.cores[primary].book.held_totals() == (0, 0, 0)


def test_restart_replays_certificates_into_the_same_job_table():
    net = Net()
    job, envelope = make_job()
    jid = job_id(job)
    net.submit(KEYS[0], envelope)
    net.run(50)
    restarted = Net(history=net.certificates)
    for key in KEYS:
        before, after = net.cores[key].job_view(jid), restarted.cores[key].job_view(jid)
        assert (after["primary"], after["backups"], after["fence"]) == (before["primary"], before["backups"], 1)
    primary = net.cores[KEYS[0]].job_view(jid)["primary"]
    assert restarted.cores[primary].book.allocated(jid) is not None
