"""Failover promises of the core (SPEC.md F3, F5-F7), driven deterministically: 4 cores,
a FIFO router with an integer clock, and real pauses (a paused node neither ticks nor
reads; what is sent to it waits in its socket, as with SIGSTOP, and is read after it
resumes).

* a pause longer than the detection bound: the others evict it and migrate its job; the
  paused node, resumed, fences itself and never resumes the job it lost;
* the evicted node stays quiet and then rejoins through the join path with the stake its
  authority attestation vouches for;
* a restarted node resumes nothing before a member has confirmed it was not evicted;
* one epoch ends with one change, however many evictions and joins compete for it (F4).
"""

import hashlib
import random
from collections import deque

import pytest

from keys.attestation import issue_attestation
from keys.genesis import DEFAULT_PARAMS, Genesis
from keys.identity import SigningIdentity
from protocol.errors import LocalProtocolError
from protocol import codec
from protocol.drain import ReadyDrain
from protocol.mesh import MeshCore
from protocol.flows.epoch_change import epoch_change_instance_id
from protocol.messages import (Constraints, Eviction, Heartbeat, Join, JobManifest, Member, Proposal, Resources,
                               Suspicion, decode_message, encode_message, encode_unsigned, job_id)
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
                      priority=0, backups=1, max_retries=0, created_ms=0, epoch=0)
    return job, encode_message(OWNER, MESH, job)


class Net:
    def __init__(self, histories=None, vouched_stake: int = STAKE):
        self.now = 0
        self.cores = {}
        for index, identity in enumerate(IDS):
            self.cores[identity.public_key] = self.make_core(index, (histories or {}).get(identity.public_key, ()),
                                                             vouched_stake)
        self.queue = deque()
        self.drains = {}
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
        """Through the drain every driver uses (protocol/drain.py)."""
        drain = self.drains.get(src)
        if drain is None:
            drain = self.drains[src] = ReadyDrain(persist=lambda r: self.persist(src, r),
                                                  send=lambda messages: self.send(src, messages),
                                                  apply=self.decisions[src].append, publish=self.events[src].extend)
        drain.drain(ready)

    def persist(self, src, ready):
        for record in ready.persist:
            if record.table == "certificates":
                self.certificates[src].append(record.value["certificate"])

    def send(self, src, messages):
        for message in messages:
            self.sent[src].append(message.data)
            if self.lose(src, message.data):
                continue
            for target in self.cores[src].broadcast_targets() if message.to is None else [message.to]:
                self.queue.append((target, message.data, src))

    def deliver(self):
        while self.queue:
            target, data, *sender = self.queue.popleft()   # (the sender, as a channel knows it)
            src = sender[0] if sender else None
            if target not in self.cores:
                continue  # a newly admitted key this net runs no core for
            if target in self.paused:
                self.held[target].append((data, src))  # waits in the socket buffer
            else:
                self.emit(target, self.cores[target].step(data, self.now, src))

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
        for item in self.held[key]:
            data, src = item if isinstance(item, tuple) else (item, None)
            self.emit(key, self.cores[key].step(data, self.now, src))
        self.held[key].clear()

    def kinds(self, key, since=0, orders=False):
        """Decision kinds in order; the workload orders ("run", "stop") only if asked."""
        return [d.value_kind for d in self.decisions[key][since:] if orders or d.value_kind not in ("run", "stop")]

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
    assert net.kinds(primary, seen, orders=True)[:2] == ["halt", "stop"]
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
    # The consensus view names what each epoch change decided (a join is no "eviction").
    from protocol.flows.epoch_change import epoch_change_instance_id
    rows = {r["instance"]: r for r in net.cores[survivors[0]].consensus_view()["instances"]}
    assert [(rows[epoch_change_instance_id(e)]["kind"], rows[epoch_change_instance_id(e)]["applied"])
            for e in (0, 1)] == [("eviction", True), ("membership", True)]


def test_a_pause_that_ends_after_suspicion_but_within_the_bound_evicts_nobody():
    """SPEC F4: the leader proposes an eviction only once the suspect was silent for the
    detection bound plus a heartbeat period, so a node that resumes after being suspected,
    but within the bound, is heard first. (A node starved for a moment after SIGCONT is
    suspected this way.)"""
    net = Net()
    net.run(200)
    jid, primary, _ = net.placed_job()
    net.paused.add(primary)
    survivors = [k for k in KEYS if k != primary]
    paused_at = net.now
    while not any(e.kind == "suspect" for k in survivors for e in net.events[k]):
        net.run(5)
    assert net.now - paused_at < BOUND
    net.run(15)  # still inside the bound
    net.resume(primary)
    net.run(3 * DEFAULT_PARAMS.round_timeout_ms)
    assert all(core.epoch == 0 and core.is_member() for core in net.cores.values())
    assert not any(d.value_kind == "eviction" for k in KEYS for d in net.decisions[k])
    assert net.cores[survivors[0]].job_view(jid)["primary"] == primary


def test_an_epoch_change_led_by_the_silent_node_moves_on_without_waiting_for_a_timeout():
    """SPEC F4: a node that suspects the epoch-change round's leader enters the next round at once."""
    net = Net()
    net.run(200)
    leader = net.cores[KEYS[0]].view.leader(epoch_change_instance_id(0), 0)
    survivors = [k for k in KEYS if k != leader]
    net.paused.add(leader)
    paused_at = net.now
    while not any(d.value_kind == "eviction" for k in survivors for d in net.decisions[k]):
        assert net.now - paused_at < 2000
        net.run(5)
    # Suspected at 250 ms, proposed by round 1's leader after 350 ms of silence (the bound
    # and a heartbeat period): no 200 ms round timeout on the way.
    assert net.now - paused_at < BOUND + DEFAULT_PARAMS.round_timeout_ms // 2
    assert all(net.cores[k].epoch == 1 and leader not in net.cores[k].view.stakes for k in survivors)


def test_a_halted_node_does_not_skip_the_round_of_a_leader_it_only_missed_while_paused():
    """SPEC F3, F4: right after a pause every peer looks silent to the resumed node's own
    detector; halted, it suspects nobody, so it does not take the round's leader for gone."""
    net = Net()
    net.run(200)
    iid = epoch_change_instance_id(0)
    resumed = net.cores[KEYS[1]]
    assert resumed.view.leader(iid, 0) == KEYS[3]
    net.paused.add(KEYS[1])
    net.run(260)
    net.paused.discard(KEYS[1])  # what others sent meanwhile stays held: the tick comes first
    net.emit(KEYS[1], resumed.tick(net.now))
    # Silent past its threshold by the clock, but not by F2a: the silence was our own pause.
    detector = resumed.detector
    assert resumed.halted and net.now - detector.last_heard_ms(KEYS[3]) >= detector.threshold_ms(KEYS[3])
    assert not detector.is_suspected(KEYS[3], net.now)
    for by in (2, 3):  # suspicions of node 0 from more than 1/3 of the stake start the instance
        net.emit(KEYS[1], resumed.step(suspicion(by, 0), net.now))
    assert resumed.instances[iid].round == 0


def test_a_voter_that_still_hears_the_suspect_refuses_its_eviction():
    """SPEC F5: suspicions from more than 1/3 of the stake make an eviction proposal valid only
    to voters that have not heard the suspect within the suspicion threshold themselves."""
    net = Net()
    net.run(200)
    voter = net.cores[KEYS[3]]
    # Nodes 1 and 2 claim node 0 is silent; node 3 has just heard it (heartbeats flow).
    for by in (1, 2):
        voter.step(suspicion(by, 0), net.now)
    iid = epoch_change_instance_id(0)
    validate = voter.epoch_changes._eviction_validator(iid)
    eviction = voter.epoch_changes._eviction_value(KEYS[0], voter.view)
    justification = tuple(suspicion(by, 0) for by in (1, 2))
    assert "alive" in validate(codec.pack(eviction.to_body()), justification)
    # Re-proposed with a proof of lock (a prevote quorum already found node 0 silent), it is
    # accepted: nodes locked on it must not wait for node 0 to go silent again.
    assert validate(codec.pack(eviction.to_body()), justification, True) is None
    # Once node 0 is silent past the threshold at node 3 as well, the same proposal is valid.
    voter.tick(net.now + DEFAULT_PARAMS.detection_bound_ms)  # node 3 hears nothing meanwhile
    assert voter.epoch == 0
    assert validate(codec.pack(eviction.to_body()), justification) is None


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
                      max_retries=0, created_ms=0, epoch=0)
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
    beat = encode_unsigned(_backup, MESH, Heartbeat(epoch=0, seq=1, sent_ms=net.now))
    resume, run = restarted.step(beat, net.now, _backup).decisions
    assert (resume.value_kind, resume.value) == ("resume", (jid,))
    assert (run.value_kind, [r.job_id for r in run.value]) == ("run", [jid])


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


def epoch_changes(net) -> dict:
    """Epoch left -> the distinct (instance, value) epoch changes any core decided for it."""
    changes: dict[int, set] = {}
    for decisions in net.decisions.values():
        for d in decisions:
            if d.value_kind == "eviction":
                changes.setdefault(d.value.epoch, set()).add((d.instance, d.value))
            elif d.value_kind == "membership":
                changes.setdefault(d.value.epoch - 1, set()).add((d.instance, d.value))
    return changes


def assert_one_membership_per_epoch(net):
    for epoch, decided in epoch_changes(net).items():
        assert len(decided) == 1, "epoch %d ended with %d different changes" % (epoch, len(decided))
    for epoch in range(max(core.epoch for core in net.cores.values()) + 1):
        views = {core.views[epoch].digest for core in net.cores.values() if epoch in core.views}
        assert len(views) <= 1


def suspicion(by: int, suspect: int, epoch: int = 0) -> bytes:
    return encode_message(IDS[by], MESH, Suspicion(suspect=KEYS[suspect], epoch=epoch, silent_ms=BOUND))


def test_two_members_suspected_at_once_are_evicted_one_epoch_at_a_time():
    # Nodes 2 and 3 suspect both 0 and 1 (more than 1/3 of the stake each time). Eviction
    # instances per suspect used to decide both for epoch 0: the sweep's "certificate"
    # violations (seed 710), two memberships for epoch 1. One instance per epoch decides one.
    # The heartbeats of 0 and 1 are lost (their votes are not): a voter refuses to evict a
    # member it still hears (SPEC F5).
    net = Net()
    silent = (KEYS[0], KEYS[1])
    net.lose = lambda src, data: src in silent and isinstance(decode_message(data, MESH, channel_sender=src)[1], Heartbeat)
    net.run(200)
    for suspect in (0, 1):
        for by in (2, 3):
            for target in KEYS:
                net.queue.append((target, suspicion(by, suspect)))
    net.run(1000)
    (decided,) = epoch_changes(net)[0]
    assert decided[1].node in KEYS[:2]
    assert_one_membership_per_epoch(net)
    survivors = [k for k in KEYS if k != decided[1].node]
    assert all(net.cores[k].epoch >= 1 and decided[1].node not in net.cores[k].views[1].stakes for k in survivors)


def test_a_join_and_an_eviction_in_one_epoch_are_decided_one_after_the_other():
    # A paused node is evicted while a newcomer asks to join in the same epoch: the join
    # loses epoch 0's change to the eviction and is admitted in the next epoch.
    net = Net()
    net.run(200)
    jid, primary, _backup = net.placed_job()
    newcomer = SigningIdentity(hashlib.sha256(b"failover-newcomer").digest())
    attestation = issue_attestation(AUTHORITY, newcomer.public_key, {}, STAKE, 0, 10**12, MESH)
    join = encode_message(newcomer, MESH, Join(member=Member(public_key=newcomer.public_key, stake=STAKE,
                                                             zone="zone-a", labels=(), addrs=()),
                                               epoch=0, vouchers=(attestation,)))
    bootstrap = next(k for k in KEYS if k != primary)
    net.paused.add(primary)
    survivors = [net.cores[k] for k in KEYS if k != primary]
    epoch_change = epoch_change_instance_id(0).hex()
    while not any(e.kind == "proposed" and e.detail["instance"] == epoch_change
                  for core in survivors for e in net.events[core.me]):
        net.deliver()
        net.now += 5
        for core in survivors:
            net.emit(core.me, core.tick(net.now))
    net.queue.appendleft((bootstrap, join))  # the eviction's proposal is in flight: the join comes second
    net.run(3 * DEFAULT_PARAMS.round_timeout_ms + 1000)
    assert_one_membership_per_epoch(net)
    for core in survivors:
        assert core.epoch == 2 and newcomer.public_key in core.view.stakes and primary not in core.view.stakes
        assert not core.joins.pending  # admitted: nothing pending


def test_an_epoch_change_instance_never_gives_up():
    # It is the only one of its epoch: an instance given up after max_rounds would leave the
    # epoch unable to evict or admit anyone, ever. Here node 0 alone heard the suspicions.
    core = MeshCore(identity=IDS[0], genesis=GENESIS, policy=policy(0), capacity=LocalCapacity(),
                    rng=random.Random(0), now_ms=0, heartbeats=False)
    for by in (1, 2):
        core.step(suspicion(by, 3), 0)
    (inst,) = [i for i in core.instances.values() if i.value_kind == "eviction"]
    rounds_to_give_up = DEFAULT_PARAMS.max_rounds + 2
    for tick in range(1, rounds_to_give_up + 1):
        core.tick(tick * DEFAULT_PARAMS.round_timeout_max_ms)
    assert inst.round >= DEFAULT_PARAMS.max_rounds and not inst.gave_up
    assert core.instances.get(inst.instance_id) is inst


def test_a_restarted_node_never_votes_for_a_second_eviction_in_its_epoch():
    # Evictions of two members now share their epoch's one instance: a node that prevoted
    # evicting one, crashed and came back, must repeat that vote (SPEC.md 6.9), not sign one
    # for the other node's eviction in the same round.
    def core(index, records=()):
        return MeshCore(identity=IDS[index], genesis=GENESIS, policy=policy(index), capacity=LocalCapacity(),
                        rng=random.Random(index), now_ms=0, heartbeats=False, safety_records=records)

    iid = epoch_change_instance_id(0)
    leader = KEYS.index(core(0).view.leader(iid, 0))
    voter = next(i for i in range(4) if i != leader)
    first, second = [i for i in range(4) if i not in (leader, voter)]
    leader_core, voter_core = core(leader), core(voter)
    sent = []
    for by in (leader, voter):
        sent.extend(leader_core.step(suspicion(by, first), 0).messages)
        voter_core.step(suspicion(by, first), 0)
    (proposal,) = [m.data for m in sent if codec.unpack(m.data)[2] == "proposal"]
    out = voter_core.step(proposal, 1)
    (prevote,) = [m.data for m in out.messages if codec.unpack(m.data)[2] == "prevote"]
    records = [r for r in out.persist if r.table in ("votes", "locks")]
    assert records
    restarted = core(voter, records)
    other = Eviction(node=KEYS[second], epoch=0, migrations=())
    justification = tuple(suspicion(by, second) for by in (leader, voter))
    conflicting = encode_message(IDS[leader], MESH, Proposal(iid, 0, 0, "eviction", codec.pack(other.to_body()),
                                                             justification, None, None))
    again = restarted.step(conflicting, 2)
    assert [m.data for m in again.messages if codec.unpack(m.data)[2] == "prevote"] == [prevote]
    assert not [r for r in again.persist if r.table == "votes"]
    assert decode_message(prevote, MESH)[1].value_hash is not None  # it had voted for the first eviction
