"""Round synchronization (SPEC.md 6.5), skipping unresponsive leaders (SPEC F4) and what a
sync answer carries (SPEC F6).

Covered, one rule per group of tests:
  a. a round's leader holding round changes from MORE than 1/3 of the stake broadcasts one
     RoundSync (exactly 1/3 is not enough);
  b. a valid RoundSync pulls a node of an earlier round into its round; one of at most 1/3
     of the stake, with a forged, foreign, repeated or non-member change, or a message of
     another kind inside, is dropped as "bad_round_sync"; one for a round not after ours as
     "stale_round", but one for the round rule 3 moved us into restarts its timer;
  c. a collector answers a stale round change once per (sender, round): with the newest
     RoundSync it knows for a later round, else with its own RoundChange;
  d. a non-collector whose round's leader announced a later round enters the next round
     only ("leader_moved_on");
  e. MeshCore skips, in every undecided instance, the round of a suspected leader, or of one
     never heard once suspect_by_ms has passed; not while it hears less than a quorum,
     when halted or without heartbeats; a never-heard member is never suspected;
  f. a sync answer to a member carries every recently applied certificate, also one that
     arrived as a broadcast for an instance this node never ran.

Consensus instances are driven by hand or through tests/consensus_net.py; MeshCores come
from tests/test_mesh_core.py. Time is an integer passed in: nothing sleeps or reads a clock.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from consensus_net import INSTANCE, MESH_ID, Net, identities, kind_of
from test_mesh_core import GENESIS, IDS, KEYS, MESH, ZONES, Net as MeshNet, make_job
from protocol.mesh import MeshCore
from protocol.flows.epoch_change import epoch_change_instance_id
from protocol.messages import (Heartbeat, Prevote, RoundChange, RoundSync, Suspicion, SyncRequest, decode_message,
                               encode_message, encode_unsigned, job_id, sign_message)
from protocol.policy import LocalCapacity, NodePolicy
from protocol.quorum import EpochView


# --- helpers -----------------------------------------------------------------------------------

def identity_of(net: Net, key: bytes):
    return net.ids[net.keys.index(key)]


def round_change(signer, round: int, *, instance: bytes = INSTANCE, epoch: int = 0) -> bytes:
    """A signed RoundChange carrying no lock, as a node with no lock announces a round."""
    return sign_message(signer, MESH_ID, RoundChange(instance, round, epoch, None, None, None)).encode()


def round_sync(signer, round: int, changes, *, instance: bytes = INSTANCE, epoch: int = 0) -> bytes:
    return sign_message(signer, MESH_ID, RoundSync(instance, round, epoch, tuple(changes))).encode()


def sent(ready, kind: str) -> list:
    return [m for m in ready.messages if kind_of(m.data) == kind]


def round_changes(ready) -> list[tuple[int, str]]:
    """(round, reason) of every round the instance entered in ``ready``."""
    return [(e.detail["round"], e.detail["reason"]) for e in ready.events if e.kind == "round_change"]


def find_instance(n: int, fits):
    """The first instance id (of a fixed list) for which ``fits(view, iid)`` returns roles."""
    view = Net(n).view
    for k in range(2000):
        iid = hashlib.sha256(b"round-sync-%d" % k).digest()
        roles = fits(view, iid)
        if roles:
            return iid, roles
    raise AssertionError("no instance id fits")


def tick_to_round(node, round: int):
    """Time out ``node`` round after round until it is in ``round``; the last tick's Ready."""
    ready = None
    while node.round < round:
        ready = node.tick(node.deadline_ms)
    assert node.round == round
    return ready


# --- a. the leader broadcasts a RoundSync -------------------------------------------------------

def test_6_5_a_a_leader_broadcasts_one_round_sync_once_more_than_a_third_of_the_stake_moved_to_its_round():
    net = Net(6)  # 6 equal stakes: 2 are exactly 1/3, 3 are more
    round = 1
    leader_key = net.view.leader(INSTANCE, round)
    leader = net.nodes[leader_key]
    leader.start(0)
    # Not round 0's leader: its round change would end the collector's round 0 (rule 3).
    movers = [identity_of(net, k) for k in net.keys if k not in (leader_key, net.view.leader(INSTANCE, 0))][:4]
    for mover in movers[:2]:
        ready = leader.receive(round_change(mover, round), 0)
        assert not sent(ready, "round_sync")  # exactly 1/3: could all be Byzantine
    assert leader.round == 0
    ready = leader.receive(round_change(movers[2], round), 0)
    (sync_out,) = sent(ready, "round_sync")
    assert sync_out.to is None  # to every member: the laggards are the ones it cannot know
    envelope, sync = decode_message(sync_out.data, MESH_ID, expect=RoundSync)
    assert envelope.signer == leader_key
    assert (sync.instance, sync.round, sync.epoch) == (INSTANCE, round, 0)
    signers = []
    for item in sync.changes:
        change_envelope, change = decode_message(item, MESH_ID, expect=RoundChange)
        assert (change.instance, change.round, change.epoch) == (INSTANCE, round, 0)
        signers.append(change_envelope.signer)
    assert len(set(signers)) == len(signers) and net.view.exceeds_one_third(signers)
    assert set(signers) <= {m.public_key for m in movers[:3]}
    # The leader follows the same stake into the round itself ...
    assert leader.round == round and (round, "round_change_quorum") in round_changes(ready)
    # ... and sends no second sync for the round as more round changes arrive.
    ready = leader.receive(round_change(movers[3], round), 0)
    assert not sent(ready, "round_sync")


def test_6_5_a_round_sync_from_more_than_a_third_of_the_stake_pulls_a_laggard_forward():
    """Two of four nodes time out into round 1 and tell its leader; the laggard, which has
    not timed out (slow clock, restart), learns of it from the leader's RoundSync and joins
    round 1 before any proposal: the round decides without waiting for its timeout."""
    net = Net(4)
    leader = net.view.leader(INSTANCE, 1)
    laggard, *movers = [k for k in net.keys if k != leader]
    net.start()
    net.advance(order=movers)  # only the movers' round timers fire
    net.deliver()              # nobody proposed yet: only round changes and the sync travel
    assert len(net.events(leader, "proposed")) == 0
    syncs = [m for r in net.readies[leader] for m in sent(r, "round_sync")]
    assert len(syncs) == 1 and syncs[0].to is None
    lag = net.nodes[laggard]
    assert lag.round == 1
    assert [e.detail["reason"] for e in net.events(laggard, "round_change")] == ["round_sync"]
    # It announced round 1 to its leader, which now holds everyone's round change.
    announced = [m for r in net.readies[laggard] for m in sent(r, "round_change")]
    assert [(m.to, decode_message(m.data, MESH_ID)[1].round) for m in announced] == [(leader, 1)]
    net.run(value_of=lambda key, round: b"value-%d" % round, start=False)
    assert {n.decision.round for n in net.live()} == {1}
    assert {n.decided_value_bytes for n in net.live()} == {b"value-1"}


# --- b. receiving a RoundSync -------------------------------------------------------------------

def _started_non_leader(net, round: int):
    """A started node in round 0 that is not ``round``'s leader: (that leader, its key, its instance)."""
    leader = net.view.leader(INSTANCE, round)
    node_key = next(k for k in net.keys if k != leader)
    node = net.nodes[node_key]
    node.start(0)
    return leader, node_key, node


@pytest.mark.parametrize("signers, valid", [(2, False), (3, True)], ids=["exactly_one_third", "more"])
def test_6_5_b_a_round_sync_counts_only_with_more_than_a_third_of_the_stake(signers, valid):
    net, round = Net(6), 2
    leader, node_key, node = _started_non_leader(net, round)
    others = [identity_of(net, k) for k in net.keys if k != node_key]
    data = round_sync(identity_of(net, leader), round, [round_change(i, round) for i in others[:signers]])
    ready = node.receive(data, 0)
    if valid:
        assert node.round == round and round_changes(ready) == [(round, "round_sync")]
        (announced,) = sent(ready, "round_change")
        assert announced.to == leader and decode_message(announced.data, MESH_ID)[1].round == round
        assert node.dropped["bad_round_sync"] == 0
    else:
        assert node.round == 0 and not ready.messages and not ready.events
        assert node.dropped["bad_round_sync"] == 1


def _bad_item(fault: str, round: int, signer, valid: list[bytes]) -> bytes:
    """A third item that would lift two valid changes (exactly 1/3 of 6) above 1/3 if counted."""
    if fault == "wrong_round":
        return round_change(signer, round + 1)
    if fault == "wrong_instance":
        return round_change(signer, round, instance=hashlib.sha256(b"another instance").digest())
    if fault == "wrong_epoch":
        return round_change(signer, round, epoch=1)
    if fault == "repeated_signer":
        return valid[0]
    if fault == "non_member":
        (outsider,) = identities(1, tag=b"outsider")
        return round_change(outsider, round)
    if fault == "forged":
        data = round_change(signer, round)
        return data[:-1] + bytes([data[-1] ^ 1])  # last signature byte flipped
    if fault == "not_a_round_change":
        return sign_message(signer, MESH_ID, Prevote(INSTANCE, round, 0, None)).encode()
    raise AssertionError(fault)


@pytest.mark.parametrize("fault", ["wrong_round", "wrong_instance", "wrong_epoch", "repeated_signer", "non_member",
                                   "forged", "not_a_round_change"])
def test_6_5_b_a_round_sync_with_a_bad_change_inside_is_dropped(fault):
    net, round = Net(6), 2
    leader, node_key, node = _started_non_leader(net, round)
    a, b, c = [identity_of(net, k) for k in net.keys if k != node_key][:3]
    valid = [round_change(a, round), round_change(b, round)]
    data = round_sync(identity_of(net, leader), round, valid + [_bad_item(fault, round, c, valid)])
    ready = node.receive(data, 0)
    assert node.round == 0 and not ready.messages and not ready.events
    assert node.dropped["bad_round_sync"] == 1
    # The same sync with a good third change is accepted: the bad item alone was the reason.
    good = round_sync(identity_of(net, leader), round, valid + [round_change(c, round)])
    assert round_changes(node.receive(good, 0)) == [(round, "round_sync")]


def test_6_5_b_a_round_sync_for_a_round_not_after_ours_is_dropped_as_stale():
    net = Net(4)
    node = net.node(0)
    node.start(0)
    tick_to_round(node, 2)
    others = [i for i in net.ids if i.public_key != node.me]

    def sync_for(round):
        return round_sync(identity_of(net, net.view.leader(INSTANCE, round)), round,
                          [round_change(i, round) for i in others[:2]])

    for round in (2, 1):  # our own round, an earlier one: both valid, both useless
        before = node.dropped["stale_round"]
        ready = node.receive(sync_for(round), 1000)
        assert node.dropped["stale_round"] == before + 1 and not ready.messages and not ready.events
        assert node.round == 2
    assert node.dropped["bad_round_sync"] == 0
    assert round_changes(node.receive(sync_for(3), 1000)) == [(3, "round_sync")]  # a later one counts


# --- c. a collector answers a stale round change -------------------------------------------------

def _collector_led_rounds(view, iid):
    """Rounds 1 <= s1 < s2 < r: s1 and s2 led by one node C, r (the first later one) by another."""
    for s1 in range(1, 6):
        collector = view.leader(iid, s1)
        s2 = next((s for s in range(s1 + 1, 8) if view.leader(iid, s) == collector), None)
        if s2 is None:
            continue
        r = next(r for r in range(s2 + 1, 60) if view.leader(iid, r) != collector)
        return collector, s1, s2, r
    return None


def test_6_5_c_a_stale_round_change_is_answered_with_the_newest_round_sync_once_per_sender_and_round():
    iid, (collector_key, s1, s2, r) = find_instance(4, _collector_led_rounds)
    net = Net(4, instance_id=iid)
    sync_leader = net.view.leader(iid, r)
    sender_key, other_key = [k for k in net.keys if k not in (collector_key, sync_leader)]
    collector = net.nodes[collector_key]
    collector.start(0)
    # The collector learnt of round r from a sync (2 of 4 stakes: more than 1/3).
    sync = round_sync(identity_of(net, sync_leader), r,
                      [round_change(identity_of(net, k), r, instance=iid) for k in (sync_leader, other_key)],
                      instance=iid)
    collector.receive(sync, 0)
    assert collector.round == r
    # A member that missed it times out into round s1 and tells s1's leader, our collector.
    sender = net.nodes[sender_key]
    sender.start(0)
    (stale,) = [m.data for m in sent(tick_to_round(sender, s1), "round_change")]
    dropped = collector.dropped["stale_round"]
    ready = collector.receive(stale, 0)
    assert [(m.to, m.data) for m in ready.messages] == [(sender_key, sync)]
    assert collector.dropped["stale_round"] == dropped + 1  # answered, but counts for nothing
    # Once per (sender, round): the same round change again (a retry, a replay) gets nothing ...
    assert not collector.receive(stale, 0).messages
    # ... while another sender, or the same sender in another stale round, gets its own answer.
    other_stale = round_change(identity_of(net, other_key), s1, instance=iid)
    assert [(m.to, m.data) for m in collector.receive(other_stale, 0).messages] == [(other_key, sync)]
    (later_stale,) = [m.data for m in sent(tick_to_round(sender, s2), "round_change")]
    assert [(m.to, m.data) for m in collector.receive(later_stale, 0).messages] == [(sender_key, sync)]
    assert not collector.receive(later_stale, 0).messages
    # The answer brings the sender to round r at once.
    ready = sender.receive(sync, 0)
    assert sender.round == r and round_changes(ready) == [(r, "round_sync")]


def _collector_then_other_leader(view, iid):
    """A round s >= 1 led by C, followed by a round led by neither C nor a chosen sender."""
    s = 1
    collector, next_leader = view.leader(iid, s), view.leader(iid, s + 1)
    if collector == next_leader:
        return None
    sender = next((k for k in view.members if k not in (collector, next_leader)), None)
    return sender and (collector, sender, s)


def test_6_5_c_without_a_later_round_sync_the_collector_answers_with_its_own_round_change():
    """The collector reached its round by timeouts: no sync to show, so it sends its own
    signed RoundChange, which tells the sender that its round's leader has moved on (d)."""
    iid, (collector_key, sender_key, s) = find_instance(4, _collector_then_other_leader)
    net = Net(4, instance_id=iid)
    collector, sender = net.nodes[collector_key], net.nodes[sender_key]
    collector.start(0)
    sender.start(0)
    tick_to_round(collector, s + 1)
    (stale,) = [m.data for m in sent(tick_to_round(sender, s), "round_change")]
    ready = collector.receive(stale, 10_000)
    (answer,) = ready.messages
    envelope, change = decode_message(answer.data, MESH_ID, expect=RoundChange)
    assert answer.to == sender_key and envelope.signer == collector_key
    assert (change.instance, change.round, change.epoch) == (iid, s + 1, 0)
    assert not collector.receive(stale, 10_000).messages  # once per (sender, round)
    ready = sender.receive(answer.data, 10_000)
    assert sender.round == s + 1 and round_changes(ready) == [(s + 1, "leader_moved_on")]


def test_6_5_c_a_round_sync_not_later_than_the_stale_round_is_not_sent_again():
    """The collector's own sync is for round s; a member re-announcing s (restarted) is
    already there: the sync would be dropped as stale, so the collector's round change goes."""
    iid, (collector_key, sender_key, s) = find_instance(4, _collector_then_other_leader)
    net = Net(4, instance_id=iid)
    collector = net.nodes[collector_key]
    collector.start(0)
    helper = next(k for k in net.keys if k not in (collector_key, sender_key))
    stale = round_change(identity_of(net, sender_key), s, instance=iid)
    collector.receive(round_change(identity_of(net, helper), s, instance=iid), 0)
    assert len(sent(collector.receive(stale, 0), "round_sync")) == 1  # 2 of 4: its own sync for s
    tick_to_round(collector, s + 1)
    (answer,) = collector.receive(stale, 10_000).messages
    assert answer.to == sender_key and kind_of(answer.data) == "round_change"
    assert decode_message(answer.data, MESH_ID)[1].round == s + 1


# --- d. the leader of our round moved on ---------------------------------------------------------

def _moved_on_roles(view, iid):
    """Round 0's leader L, round 1's leader M != L, a node N that leads neither, and a round
    m >= 3 that N does not lead (N is no collector there)."""
    leader0, leader1 = view.leader(iid, 0), view.leader(iid, 1)
    if leader0 == leader1:
        return None
    for node in view.members:
        if node in (leader0, leader1):
            continue
        m = next((m for m in range(3, 20) if view.leader(iid, m) != node), None)
        if m is not None:
            return leader0, leader1, node, m
    return None


def test_6_5_d_a_round_change_from_our_rounds_leader_for_a_later_round_advances_exactly_one_round():
    iid, (leader0, leader1, node_key, m) = find_instance(4, _moved_on_roles)
    net = Net(4, instance_id=iid)
    node = net.nodes[node_key]
    node.start(0)
    bystander = next(k for k in net.keys if k not in (leader0, node_key))
    # Not from our round's leader, or not for a later round: nothing to learn, dropped.
    for signer, round in ((bystander, m), (leader0, 0)):
        before = node.dropped["not_collector"]
        ready = node.receive(round_change(identity_of(net, signer), round, instance=iid), 0)
        assert node.round == 0 and not ready.messages and node.dropped["not_collector"] == before + 1
    moved_on = round_change(identity_of(net, leader0), m, instance=iid)
    ready = node.receive(moved_on, 0)
    # One round only, not to m: a Byzantine leader can cut short its own round, no more.
    assert node.round == 1 and round_changes(ready) == [(1, "leader_moved_on")]
    (announced,) = sent(ready, "round_change")
    assert announced.to == leader1 and decode_message(announced.data, MESH_ID)[1].round == 1
    # Round 1 is another leader's: the same message again moves nothing.
    assert not node.receive(moved_on, 0).events and node.round == 1


def test_6_5_d_the_collector_of_the_announced_round_also_ends_its_round_when_its_leader_moved_on():
    # Round 0's leader announces round m to m's collector, which is itself still in round 0.
    def roles(view, iid):
        leader0 = view.leader(iid, 0)
        m = next((m for m in range(2, 20) if view.leader(iid, m) not in (leader0, view.leader(iid, 1))), None)
        return None if m is None else (leader0, m)
    iid, (leader0, m) = find_instance(6, roles)
    net = Net(6, instance_id=iid)
    collector = net.nodes[net.view.leader(iid, m)]
    collector.start(0)
    ready = collector.receive(round_change(identity_of(net, leader0), m, instance=iid), 0)
    assert collector.round == 1 and round_changes(ready) == [(1, "leader_moved_on")]


@pytest.mark.parametrize("at_collector", [False, True], ids=["bystander", "collector_of_the_announced_round"])
def test_6_5_d_a_round_ended_early_by_its_leader_keeps_the_nodes_round_schedule(at_collector):
    """Rule 3 ends round r early, but round r + 1 then lasts until the time it would have
    ended had r timed out: a Byzantine leader that ends its round early for some honest
    nodes only must not leave them a round ahead of the rest (the 10,000-seed sweep's
    largest class of stalls)."""
    n = 6 if at_collector else 4
    if at_collector:
        def roles(view, iid):
            leader0 = view.leader(iid, 0)
            m = next((m for m in range(2, 20) if view.leader(iid, m) not in (leader0, view.leader(iid, 1))), None)
            return None if m is None else (leader0, view.leader(iid, m), m)
        iid, (leader0, node_key, m) = find_instance(n, roles)
    else:
        iid, (leader0, _leader1, node_key, m) = find_instance(n, _moved_on_roles)
    net = Net(n, instance_id=iid)
    node, other = net.nodes[node_key], net.nodes[next(k for k in net.keys if k not in (leader0, node_key))]
    node.start(0)
    other.start(0)
    round0_ends = node.deadline_ms
    assert round0_ends == node.timeout_ms(0)
    ready = node.receive(round_change(identity_of(net, leader0), m, instance=iid), 40)
    assert node.round == 1 and round_changes(ready) == [(1, "leader_moved_on")]
    # A member that heard nothing times round 0 out and reaches round 1 later, but both
    # leave round 1 at the same moment.
    tick_to_round(other, 1)
    assert other.round == 1 and node.deadline_ms == other.deadline_ms == round0_ends + node.timeout_ms(1)


def test_6_5_b_a_round_sync_for_the_round_rule_3_moved_us_into_restarts_its_timer_with_the_nodes_it_pulls():
    """Rule 3 keeps the deadline of the round it ended; members a RoundSync pulls into that
    round start a full timeout from then. The node rule 3 moved takes that sync as its round's
    start, or it would stay a round behind them (n=4 sweep, seed 167: rounds apart for 3 s)."""
    iid, (leader0, leader1, node_key, m) = find_instance(4, _moved_on_roles)
    net = Net(4, instance_id=iid)
    node = net.nodes[node_key]
    pulled = net.nodes[next(k for k in net.keys if k not in (leader0, leader1, node_key))]
    node.start(0)
    pulled.start(0)
    node.receive(round_change(identity_of(net, leader0), m, instance=iid), 40)
    assert node.round == 1 and node.deadline_ms == node.timeout_ms(0) + node.timeout_ms(1)
    changes = [round_change(identity_of(net, k), 1, instance=iid) for k in (leader0, node_key)]
    sync = round_sync(identity_of(net, leader1), 1, changes, instance=iid)
    assert round_changes(pulled.receive(sync, 60)) == [(1, "round_sync")]
    ready = node.receive(sync, 60)
    assert node.round == 1 and not ready.events and not ready.messages
    assert node.deadline_ms == pulled.deadline_ms == 60 + node.timeout_ms(1)
    before = node.dropped["stale_round"]
    node.receive(sync, 70)                # its timer runs from now on: the same sync is stale
    assert node.dropped["stale_round"] == before + 1 and node.deadline_ms == 60 + node.timeout_ms(1)


def test_6_5_a_message_more_than_max_rounds_ahead_is_dropped_before_any_work():
    """A far-future round would make the node walk the leader schedule (6.2) up to it and
    keep a round change per round it leads: dropped as round_too_far, nothing computed."""
    from protocol.consensus import MAX_ROUNDS_AHEAD
    net = Net(4, max_rounds=1 << 20)
    node_key = net.keys[0]
    node = net.nodes[node_key]
    node.start(0)
    cached = len(net.view._leader_cache.get(INSTANCE, ()))
    far = round_change(net.ids[1], MAX_ROUNDS_AHEAD + 1)
    node.receive(far, 0)
    assert node.dropped["round_too_far"] == 1
    assert len(net.view._leader_cache.get(INSTANCE, ())) == cached   # the schedule was not walked
    # At the window's edge a round change is still read (the collector check walks the schedule).
    node.receive(round_change(net.ids[1], MAX_ROUNDS_AHEAD), 0)
    assert node.dropped["round_too_far"] == 1


def test_6_5_a_round_sync_of_round_changes_too_big_to_relay_is_not_sent(monkeypatch):
    """Round changes carrying a big lock are not kept for a RoundSync (at most
    MAX_SYNC_ITEM_BYTES each): without enough small ones the leader counts
    round_sync_too_large instead of sending, and still enters the round by the usual rule."""
    import protocol.consensus.rounds as consensus
    net = Net(6)
    round = 1
    leader_key = net.view.leader(INSTANCE, round)
    leader = net.nodes[leader_key]
    leader.start(0)
    movers = [identity_of(net, k) for k in net.keys if k not in (leader_key, net.view.leader(INSTANCE, 0))][:3]
    # As if every change carried a big lock: none is small enough to relay.
    monkeypatch.setattr(consensus, "MAX_SYNC_ITEM_BYTES", len(round_change(movers[0], round)) - 1)
    for mover in movers:
        ready = leader.receive(round_change(mover, round), 0)
        assert not sent(ready, "round_sync")
    assert leader.dropped["round_sync_too_large"] == 1 and leader.round == round


# --- e. MeshCore skips unresponsive leaders (SPEC F4) --------------------------------------------

HEARTBEAT_MS = GENESIS.params.heartbeat_ms


def beat(index: int, now_ms: int) -> bytes:
    return encode_unsigned(KEYS[index], MESH, Heartbeat(epoch=0, seq=now_ms + 1, sent_ms=now_ms))


def drive(core: MeshCore, until: int, heard=(), step_ms: int = 5) -> list:
    """Tick ``core`` every ``step_ms`` up to ``until``; members ``heard`` (indexes) send a
    heartbeat every heartbeat period. Returns every Ready of the ticks."""
    readies = []
    now = core.last_tick_ms
    if now == 0:
        for index in heard:
            core.step(beat(index, 0), 0, KEYS[index])
    while now < until:
        now = min(now + step_ms, until)
        if now % HEARTBEAT_MS == 0:
            for index in heard:
                core.step(beat(index, now), now, KEYS[index])
        readies.append(core.tick(now))
    return readies


def job_led_by(key: bytes):
    """A job whose placement's round 0 is led by ``key``: (job id, signed manifest)."""
    view = EpochView.from_genesis(GENESIS)
    job, envelope = next((j, e) for j, e in (make_job(nonce=n) for n in range(1, 500))
                         if view.leader(job_id(j), 0) == key)
    return job_id(job), envelope


def skips(readies) -> list:
    return [e for r in readies for e in r.events if e.kind == "round_change" and e.detail["reason"] == "caught_up"]


def test_f4_a_never_heard_leader_is_skipped_once_suspect_by_ms_has_passed_since_start():
    core = MeshNet().cores[KEYS[0]]
    suspect_by = core.detector.suspect_by_ms
    iid, envelope = job_led_by(KEYS[3])   # node 3 never sent us anything
    drive(core, suspect_by - 10, heard=(1, 2))
    core.submit(envelope, core.last_tick_ms)
    inst = core.instances[iid]
    assert inst.deadline_ms > suspect_by + 5  # round 0's timeout is not what moves it below
    # Before the threshold: it may just be starting up; wait.
    readies = drive(core, suspect_by - 5, heard=(1, 2))
    assert inst.round == 0 and not skips(readies)
    readies = drive(core, suspect_by, heard=(1, 2))
    assert inst.round == 1 and [e.at_ms for e in skips(readies)] == [suspect_by]


def test_f4b_a_leader_flagged_here_alone_keeps_its_round_until_another_member_corroborates():
    # Issue 18: on a loaded host each member flags a different few members whose heartbeats
    # it read late; when each skipped those leaders' rounds on its own flag, members of one
    # instance raced to different rounds and nothing decided (n = 16, jobs in flight).
    core = MeshNet().cores[KEYS[0]]
    drive(core, 100, heard=(1, 2, 3))    # node 3 heard, then silent from 100 on
    suspected_at = 100 + core.detector.threshold_ms(KEYS[3])
    iid, envelope = job_led_by(KEYS[3])
    drive(core, suspected_at - 10, heard=(1, 2))
    core.submit(envelope, core.last_tick_ms)
    inst = core.instances[iid]
    readies = drive(core, suspected_at + 20, heard=(1, 2))
    assert core.detector.is_suspected(KEYS[3], suspected_at)
    # Flagged (and suspected: our suspicion went out) by us alone, 10 of 40 stake: not skipped.
    assert [e.kind for r in readies for e in r.events if e.kind == "suspect"] == ["suspect"]
    assert inst.round == 0 and not skips(readies)
    # Node 1's suspicion makes 20 of 40 (more than 1/3): the leader's round is skipped at once.
    now = core.last_tick_ms
    core.step(encode_message(IDS[1], MESH, Suspicion(suspect=KEYS[3], epoch=0, silent_ms=now - 100)), now)
    readies = drive(core, now + 5, heard=(1, 2))
    assert inst.round == 1 and [e.at_ms for e in skips(readies)] == [now + 5]


def _core_without_heartbeats() -> MeshCore:
    return MeshCore(identity=IDS[0], genesis=GENESIS, policy=NodePolicy(zone=ZONES[0]),
                    capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * 2), rng=random.Random(0), now_ms=0,
                    heartbeats=False)


@pytest.mark.parametrize("case", ["hears_less_than_a_quorum", "halted", "heartbeats_off"])
def test_f4_no_leader_is_skipped_while_hearing_less_than_a_quorum_halted_or_without_heartbeats(case):
    """The tick path. (Halted or without heartbeats, the tick returns before it looks at
    leaders at all; the guards inside _unresponsive_members itself are exercised by the
    epoch-change test below, which reaches the rule through a message.)"""
    core = _core_without_heartbeats() if case == "heartbeats_off" else MeshNet().cores[KEYS[0]]
    suspect_by = core.detector.suspect_by_ms
    # Hearing only node 1 (20 of 40 stake, with ourselves): we are likely the one cut off.
    heard = (1,) if case == "hears_less_than_a_quorum" else (1, 2)
    iid, envelope = job_led_by(KEYS[3])
    drive(core, suspect_by - 15, heard=heard)
    core.submit(envelope, suspect_by - 10)
    inst = core.instances[iid]
    deadline = inst.deadline_ms
    if case == "halted":
        # Our own tick comes a whole suspicion window late (a pause): we halt (F3), and
        # every peer may only look silent to us.
        readies = [core.tick(deadline - 5)]
        assert core.halted
    else:
        readies = drive(core, deadline - 5, heard=heard)
    assert deadline - 5 > suspect_by and not core.detector.is_watched(KEYS[3])
    assert inst.round == 0 and not skips(readies)
    # The round still ends at its timeout.
    core.tick(deadline) if case == "halted" else drive(core, deadline, heard=heard)
    assert inst.round == 1


@pytest.mark.parametrize("case", ["skipped", "hears_less_than_a_quorum", "halted", "heartbeats_off"])
def test_f4_an_epoch_change_started_by_suspicions_skips_a_never_heard_leader_only_when_allowed(case):
    """The other way into the rule: suspicions (a message, not a tick) start the epoch-change
    instance, whose round 0 is led by node 3, never heard. The same guards apply there."""
    core = _core_without_heartbeats() if case == "heartbeats_off" else MeshNet().cores[KEYS[0]]
    iid = epoch_change_instance_id(0)
    assert core.view.leader(iid, 0) == KEYS[3] and core.view.leader(iid, 1) != KEYS[3]
    heard = (1,) if case == "hears_less_than_a_quorum" else (1, 2)
    now = core.detector.suspect_by_ms + 50
    if case == "halted":
        drive(core, 100, heard=heard)
        core.tick(now)  # a late tick: we were paused, so we halt (F3)
        assert core.halted
    else:
        drive(core, now, heard=heard)
    for by in (1, 2):  # more than 1/3 of the stake suspects node 3
        core.step(encode_message(IDS[by], MESH, Suspicion(suspect=KEYS[3], epoch=0, silent_ms=now)), now)
    inst = core.instances[iid]
    assert inst.round == (1 if case == "skipped" else 0)


@pytest.mark.parametrize("heard_once", [False, True], ids=["never_heard", "heard_then_silent"])
def test_f4_a_never_heard_member_is_never_suspected(heard_once):
    """A member that never came up holds no workload: suspecting it would only start an
    eviction of a slow starter (SPEC.md F2). Its rounds are skipped, but no Suspicion goes out."""
    core = MeshNet().cores[KEYS[0]]
    if heard_once:
        core.step(beat(3, 0), 0, KEYS[3])
    readies = drive(core, 4 * GENESIS.params.detection_bound_ms, heard=(1, 2))
    suspicions = [decode_message(m.data, MESH)[1].suspect for r in readies for m in r.messages
                  if kind_of(m.data) == "suspicion"]
    suspect_events = [e for r in readies for e in r.events if e.kind == "suspect"]
    if heard_once:
        assert set(suspicions) == {KEYS[3]} and suspect_events  # the same silence, once heard
    else:
        assert suspicions == [] and suspect_events == [] and KEYS[3] not in core.liveness.suspicions
        assert KEYS[3] in core.liveness.unresponsive_members(core.last_tick_ms)  # yet its rounds are skipped


def test_6_5_a_mesh_core_hands_a_round_sync_to_its_instance():
    core = MeshNet().cores[KEYS[0]]
    iid, envelope = job_led_by(KEYS[1])
    core.submit(envelope, 0)
    r = next(r for r in range(1, 60) if core.view.leader(iid, r) != KEYS[0])
    leader = KEYS.index(core.view.leader(iid, r))
    helper = next(i for i in (1, 2, 3) if i != leader)
    changes = tuple(encode_message(IDS[i], MESH, RoundChange(iid, r, 0, None, None, None)) for i in (leader, helper))
    out = core.step(encode_message(IDS[leader], MESH, RoundSync(iid, r, 0, changes)), 1)  # 20 of 40 stake
    assert core.instances[iid].round == r
    assert [m.to for m in out.messages if kind_of(m.data) == "round_change"] == [KEYS[leader]]


# --- f. sync answers carry every recently applied certificate -----------------------------------

def test_6_5_a_sync_answer_to_a_member_includes_a_certificate_applied_from_a_broadcast():
    net = MeshNet()
    job, envelope = make_job()
    jid = job_id(job)
    net.submit(KEYS[0], envelope)
    net.run(50)
    certificate = net.certificates[KEYS[0]][0]  # the commit certificate its leader broadcast
    # A core that never saw the job (started later, or it was down) gets only that broadcast:
    # it applies the decision without ever running the instance.
    late = MeshNet().cores[KEYS[3]]
    late.step(certificate, 0)
    assert jid in late.instance_table.recent_certificates and jid not in late.decided and jid not in late.instances
    answer = late.step(encode_message(IDS[1], MESH, SyncRequest(epoch=0)), 10)
    assert certificate in [m.data for m in answer.messages if m.to == KEYS[1]]
    # Placements are for members only: a non-member asking gets no placement certificate.
    (outsider,) = identities(1, tag=b"outsider")
    answer = late.step(encode_message(outsider, MESH, SyncRequest(epoch=0)), 20)
    assert certificate not in [m.data for m in answer.messages]
