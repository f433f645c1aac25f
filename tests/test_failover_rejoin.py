"""Failover promises of the core (SPEC.md F3, F5-F7), driven deterministically: 4 cores,
a FIFO router with an integer clock, and real pauses (a paused node neither ticks nor
reads; what is sent to it waits in its socket, as with SIGSTOP, and is read after it
resumes).

* a pause longer than the detection bound: the others evict it and migrate its job; the
  paused node, resumed, fences itself and never resumes the job it lost;
* the evicted node stays quiet and then rejoins through the join path with the stake its
  authority attestation vouches for;
* a restarted node resumes nothing before a member has confirmed it was not evicted.
"""

import hashlib
import random
from collections import deque

import pytest

from keys.attestation import issue_attestation
from keys.genesis import DEFAULT_PARAMS, Genesis
from keys.identity import SigningIdentity
from protocol.errors import LocalProtocolError
from protocol.mesh import MeshCore
from protocol.messages import Constraints, Heartbeat, JobManifest, Member, Resources, encode_message, job_id
from protocol.policy import LocalCapacity, NodePolicy

IDS = [SigningIdentity(hashlib.sha256(b"failover-node-%d" % i).digest()) for i in range(4)]
KEYS = [i.public_key for i in IDS]
AUTHORITY = SigningIdentity(hashlib.sha256(b"failover-authority").digest())
OWNER = SigningIdentity(hashlib.sha256(b"failover-owner").digest())
ZONES = ["zone-a", "zone-a", "zone-b", "zone-b"]
STAKE = 10
GENESIS = Genesis(name="failover", created_ms=0, params=DEFAULT_PARAMS, authorities=(AUTHORITY.public_key,),
                  members=tuple(Member(public_key=k, stake=STAKE, zone=z, labels=(),
                                       addrs=("/ip4/127.0.0.1/tcp/%d" % (4000 + i),))
                                for i, (k, z) in enumerate(zip(KEYS, ZONES))))
MESH = GENESIS.mesh_id
BOUND = DEFAULT_PARAMS.detection_bound_ms


def policy(index: int, vouched_stake: int = STAKE) -> NodePolicy:
    attestation = issue_attestation(AUTHORITY, KEYS[index], {}, vouched_stake, 0, 10**12, MESH)
    return NodePolicy(zone=ZONES[index], attestations=(attestation,))


def make_job():
    job = JobManifest(owner=OWNER.public_key, name="job", nonce=1, entrypoint="counter", args=(),
                      resources=Resources(gpus=1, gpu_mem_mib=1000, cpu_milli=500, mem_mib=512),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=0, backups=1, max_retries=0, created_ms=0)
    return job, encode_message(OWNER, MESH, job)


class Net:
    def __init__(self, histories=None, vouched_stake: int = STAKE):
        self.now = 0
        self.cores = {}
        for index, identity in enumerate(IDS):
            self.cores[identity.public_key] = self.make_core(index, (histories or {}).get(identity.public_key, ()),
                                                             vouched_stake)
        self.queue = deque()
        self.paused: set[bytes] = set()
        self.held: dict[bytes, list[bytes]] = {k: [] for k in KEYS}
        self.decisions = {k: [] for k in KEYS}
        self.events = {k: [] for k in KEYS}
        self.sent = {k: [] for k in KEYS}
        self.certificates = {k: [] for k in KEYS}
        self.lose = lambda src, data: False  # a lossy link: messages it is true for are lost

    def make_core(self, index, history=(), vouched_stake=STAKE):
        return MeshCore(identity=IDS[index], genesis=GENESIS, policy=policy(index, vouched_stake),
                        capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * (4 if index == 0 else 2)),
                        rng=random.Random(index), now_ms=self.now, history=history)

    def emit(self, src, ready):
        for record in ready.persist:
            if record.table == "certificates":
                self.certificates[src].append(record.value["certificate"])
        for message in ready.messages:
            self.sent[src].append(message.data)
            if self.lose(src, message.data):
                continue
            for target in self.cores[src].broadcast_targets() if message.to is None else [message.to]:
                self.queue.append((target, message.data))
        self.decisions[src].extend(ready.decisions)
        self.events[src].extend(ready.events)

    def deliver(self):
        while self.queue:
            target, data = self.queue.popleft()
            if target in self.paused:
                self.held[target].append(data)  # waits in the socket buffer
            else:
                self.emit(target, self.cores[target].step(data, self.now))

    def run(self, ms, step_ms=5):
        for _ in range(ms // step_ms):
            self.deliver()
            self.now += step_ms
            for key, core in self.cores.items():
                if key not in self.paused:
                    self.emit(key, core.tick(self.now))
        self.deliver()

    def resume(self, key):
        """SIGCONT: the tick timer fires first (it is overdue), then the buffered frames are read."""
        self.paused.discard(key)
        self.emit(key, self.cores[key].tick(self.now))
        for data in self.held[key]:
            self.emit(key, self.cores[key].step(data, self.now))
        self.held[key].clear()

    def kinds(self, key, since=0):
        return [d.value_kind for d in self.decisions[key][since:]]

    def placed_job(self):
        job, envelope = make_job()
        self.emit(KEYS[1], self.cores[KEYS[1]].submit(envelope, self.now))
        self.run(100)
        jid = job_id(job)
        view = self.cores[KEYS[1]].job_view(jid)
        return jid, view["primary"], view["backups"][0]


def test_pause_longer_than_the_bound_evicts_migrates_and_the_paused_node_fences_itself():
    net = Net()
    net.run(200)  # heartbeats flow: every member is watched
    jid, primary, backup = net.placed_job()
    net.emit(primary, net.cores[primary].local_checkpoint(jid, 1, 10, net.now, b"state-1", net.now))
    net.deliver()
    stale = net.cores[primary]
    net.paused.add(primary)
    net.run(BOUND + 3 * DEFAULT_PARAMS.round_timeout_ms)
    survivors = [k for k in KEYS if k != primary]
    for key in survivors:
        eviction, = [d.value for d in net.decisions[key] if d.value_kind == "eviction"]
        assert eviction.node == primary and [(m.job_id, m.to_node) for m in eviction.migrations] == [(jid, backup)]
        view = net.cores[key].job_view(jid)
        assert (view["primary"], view["fence"], view["state"]) == (backup, 2, "migrating")
    seen = len(net.decisions[primary])
    net.resume(primary)
    # Its first tick finds the gap: it halts its workloads before reading anything.
    assert net.kinds(primary, seen)[0] == "halt"
    assert any(e.kind == "self_fence_check" for e in net.events[primary])
    net.deliver()  # the buffered frames: old heartbeats, then the eviction's commit certificate
    assert net.kinds(primary, seen) == ["halt", "eviction"]  # the old heartbeats did not resume it
    assert not stale.is_member() and stale.evicted_at_epoch == 0
    assert stale.job_view(jid)["primary"] == backup and stale.job_view(jid)["fence"] == 2
    with pytest.raises(LocalProtocolError):
        stale.local_checkpoint(jid, 2, 20, net.now, b"late", net.now)
    net.run(500)
    # Readmitted (next test), it still never resumes the job it lost.
    assert net.kinds(primary, seen) == ["halt", "eviction", "membership"] and stale.is_member()
    assert stale.job_view(jid)["primary"] == backup


def test_an_evicted_node_stays_quiet_then_rejoins_with_its_vouched_stake():
    net = Net()
    net.run(200)
    jid, primary, backup = net.placed_job()
    net.paused.add(primary)
    net.run(BOUND + 3 * DEFAULT_PARAMS.round_timeout_ms)
    # While paused, a job submitted to it opens an instance it can never finish alone.
    job = JobManifest(owner=OWNER.public_key, name="late", nonce=2, entrypoint="counter", args=(),
                      resources=Resources(gpus=0, gpu_mem_mib=0, cpu_milli=0, mem_mib=0), strategy="throughput",
                      constraints=Constraints(zones=(), labels=(), attested=()), priority=0, backups=0,
                      max_retries=0, created_ms=0)
    net.held[primary].insert(0, encode_message(OWNER, MESH, job))  # read before the eviction
    net.resume(primary)
    net.deliver()
    stale = net.cores[primary]
    assert not stale.is_member() and not stale.instances  # evicted: its open instances are dropped
    assert any(e.kind == "evicted" for e in net.events[primary])
    net.sent[primary].clear()
    # Its first join requests are lost: it is readmitted only a second later, when its
    # peers' last heartbeats are long past.
    lost_until = net.now + 1000
    net.lose = lambda src, data: src == primary and b"join" in data and net.now < lost_until
    net.run(3000)
    # It asked to rejoin (at most once per second, one member at a time) and said nothing else
    # until readmitted; every core now agrees on the 4 members of epoch 2.
    requests = [e for e in net.events[primary] if e.kind == "rejoin_requested"]
    assert 2 <= len(requests) <= 4 and all(e.detail["stake"] == STAKE for e in requests)
    assert any(e.kind == "rejoined" for e in net.events[primary])
    for core in net.cores.values():
        assert core.epoch == 2 and core.view.stakes == {k: STAKE for k in KEYS}
    assert stale.is_member() and stale.evicted_at_epoch is None
    # Its join carries no address; every member keeps the genesis one, so that a node
    # restarted later still dials it.
    assert all(core.member_info[primary].addrs == GENESIS.members[KEYS.index(primary)].addrs
               for core in net.cores.values())
    assert stale.job_view(jid)["primary"] == backup  # the job stays where it moved
    assert "resume" not in net.kinds(primary)
    # Readmitted, it watches its peers afresh: their silence towards a non-member is no
    # sign of death, and no one is suspected or evicted.
    rejoined_at = next(e.at_ms for e in net.events[primary] if e.kind == "rejoined")
    net.run(1000)
    assert not [e for e in net.events[primary] if e.kind == "suspect" and e.at_ms >= rejoined_at]
    assert all(core.epoch == 2 for core in net.cores.values())


def test_an_evicted_node_without_vouched_stake_says_so_and_stays_out():
    net = Net(vouched_stake=0)
    net.run(200)
    _jid, primary, _backup = net.placed_job()
    net.paused.add(primary)
    net.run(BOUND + 3 * DEFAULT_PARAMS.round_timeout_ms)
    net.resume(primary)
    net.run(2000)
    assert [e.kind for e in net.events[primary]].count("rejoin_unvouched") == 1
    assert not any(e.kind == "rejoin_requested" for e in net.events[primary])
    assert not net.cores[primary].is_member()
    assert all(core.epoch == 1 for core in net.cores.values())


def test_a_restarted_primary_resumes_only_after_a_member_confirms_its_epoch():
    net = Net()
    net.run(200)
    jid, primary, _backup = net.placed_job()
    restarted = net.make_core(KEYS.index(primary), net.certificates[primary])
    assert restarted.job_view(jid)["primary"] == primary
    first = restarted.tick(net.now)
    assert not first.decisions and restarted.halted
    assert any(e.kind == "restart_sync" for e in first.events)
    assert sum(b"sync_request" in m.data for m in first.messages) == 3
    beat = encode_message(IDS[KEYS.index(_backup)], MESH, Heartbeat(epoch=0, seq=1, sent_ms=net.now))
    assert [(d.value_kind, d.value) for d in restarted.step(beat, net.now).decisions] == [("resume", (jid,))]


def test_a_primary_restarted_after_its_eviction_learns_it_and_resumes_nothing():
    net = Net()
    net.run(200)
    jid, primary, backup = net.placed_job()
    history = list(net.certificates[primary])
    net.paused.add(primary)  # down: nothing it is sent will be read by this process
    net.run(BOUND + 3 * DEFAULT_PARAMS.round_timeout_ms)
    assert all(net.cores[k].epoch == 1 for k in KEYS if k != primary)
    net.cores[primary] = net.make_core(KEYS.index(primary), history)
    net.paused.discard(primary)
    net.held[primary].clear()
    seen = len(net.decisions[primary])
    net.run(100)
    kinds = net.kinds(primary, seen)
    assert "eviction" in kinds and "resume" not in kinds
    assert net.cores[primary].job_view(jid)["primary"] == backup
