"""The consensus instance, one test per rule of SPEC.md section 6.

Instances are driven by the deterministic in-memory network in consensus_net.py:
every Ready's messages are routed to their recipients, time moves only on ``advance``.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from consensus_net import INSTANCE, MESH_ID, Net, identities, kind_of
from protocol.certificate import verify_commit_certificate
from protocol.errors import LocalProtocolError
from protocol.messages import Prevote, Proposal, RoundChange, decode_message, sign_message, value_hash
from protocol.ready import PersistRecord


def decided_values(net: Net) -> set[bytes]:
    return {n.decided_value_bytes for n in net.live()}


def instance_with_two_leaders() -> bytes:
    """An instance id whose rounds 0 and 1 have different leaders (4 equal-stake nodes)."""
    view = Net(4).view
    return next(i for i in (hashlib.sha256(b"%d" % k).digest() for k in range(100))
                if view.leader(i, 0) != view.leader(i, 1))


# --- 6.4 the happy path ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [4, 5, 6, 7])
def test_6_4_all_nodes_decide_the_leaders_value_in_round_0(n):
    net = Net(n)
    net.run(value_of=lambda key, round: b"placement-%d" % round)
    assert decided_values(net) == {b"placement-0"}
    for node in net.live():
        assert node.decision.round == 0
        cert, value = verify_commit_certificate(node.decision_envelope, MESH_ID, net.view)
        assert value == b"placement-0" and cert.instance == INSTANCE
        assert node.dropped == {}
    leader = net.view.leader(INSTANCE, 0)
    assert [e.kind for e in net.events(leader, "proposed")] == ["proposed"]
    assert len(net.events(leader, "prevote_quorum")) == 1
    for key in net.keys:
        assert len(net.events(key, "locked")) == 1 and len(net.events(key, "decided")) == 1


def test_6_4_votes_go_only_to_the_collector_and_certificates_to_everyone():
    net = Net(5)
    leader = net.view.leader(INSTANCE, 0)
    net.run()
    for key in net.keys:
        for ready in net.readies[key]:
            for out in ready.messages:
                kind = kind_of(out.data)
                if kind in ("prevote", "precommit"):
                    assert out.to == leader
                else:
                    assert kind in ("proposal", "prevote_cert", "commit") and out.to is None and key == leader


@pytest.mark.parametrize("n", [5, 16, 64])
def test_6_4_messages_per_decision_grow_linearly(n):
    net = Net(n)
    net.run()
    # Proposal, prevote certificate and commit certificate go to n-1 nodes; n-1 prevotes and
    # n-1 precommits come back: 5 (n-1) deliveries, about 5 per node at every size.
    assert net.delivered == 5 * (n - 1)
    assert 3.5 <= net.delivered / n <= 5


# --- 6.11 votes to every member in a small mesh -----------------------------------------------

def hops_until_every_node_decided(net: Net) -> int:
    """Deliver the network in waves (each wave: every message queued before it): the number
    of sequential message hops until every live node decided."""
    net.start()
    net.propose_where_asked(lambda key, round: b"value")
    hops = 0
    while not all(n.decision is not None for n in net.live()):
        assert net.queue, "the network went quiet undecided"
        net.deliver(limit=len(net.queue))
        hops += 1
    return hops


@pytest.mark.parametrize("n, hops", [(1, 0), (2, 3), (4, 3), (5, 5), (7, 5)])
def test_6_11_a_small_mesh_decides_in_three_hops_a_larger_one_in_five(n, hops):
    # Proposal, prevote, precommit where every member collects (n <= 4); through the leader
    # the two certificates add a hop each.
    assert hops_until_every_node_decided(Net(n)) == hops


def test_6_11_in_a_small_mesh_votes_go_to_everyone_and_each_member_certifies_itself():
    net = Net(4)
    leader = net.view.leader(INSTANCE, 0)
    net.run()
    for key in net.keys:
        kinds = {kind_of(out.data): out.to for ready in net.readies[key] for out in ready.messages}
        assert kinds["prevote"] is None and kinds["precommit"] is None
        assert "prevote_cert" not in kinds   # 6.13: not even the leader sends a non-nil one
        assert ("commit" in kinds) == (key == leader)
        assert len(net.events(key, "prevote_quorum")) == 1 and len(net.events(key, "decided")) == 1
    # Each member's decision is a certificate it built from the precommits it counted.
    for key, node in net.nodes.items():
        envelope, _cert = decode_message(node.decision_envelope, MESH_ID)
        assert envelope.signer == key
        verify_commit_certificate(node.decision_envelope, MESH_ID, net.view)
    # 2 (n-1) for the proposal and the leader's commit certificate, n (n-1) per vote phase.
    assert net.delivered == 2 * 3 + 2 * 4 * 3


@pytest.mark.parametrize("n, delivered", [(2, 2 * 1 + 2 * 2 * 1), (3, 2 * 2 + 2 * 3 * 2), (4, 2 * 3 + 2 * 4 * 3)])
def test_6_13_the_leader_sends_no_prevote_certificate_in_a_small_mesh(n, delivered):
    # Every member formed it from the prevotes; one that missed them decides from the
    # precommits or the leader's commit certificate. 3 deliveries fewer per decision at n = 4
    # (33 before), the hops unchanged (test_6_11_a_small_mesh_decides_in_three_hops...).
    net = Net(n)
    net.run()
    assert decided_values(net) == {b"value"} and all(node.decision.round == 0 for node in net.live())
    sent = [kind_of(out.data) for key in net.keys for ready in net.readies[key] for out in ready.messages]
    assert "prevote_cert" not in sent
    assert net.delivered == delivered


def test_6_13_a_member_that_misses_prevotes_decides_from_the_precommits_without_locking():
    net = Net(4)
    leader = net.view.leader(INSTANCE, 0)
    deaf = next(k for k in net.keys if k != leader)
    net.block = lambda sender, to, kind: to == deaf and kind == "prevote"
    net.run()
    assert decided_values(net) == {b"value"}
    assert net.nodes[deaf].decision.round == 0
    assert net.events(deaf, "locked") == [] and len(net.events(deaf, "decided")) == 1


def test_6_13_a_nil_prevote_certificate_is_still_sent_by_the_leader():
    net = Net(4, max_rounds=1, validate=lambda value, justification, proven=False: "refused everywhere")
    leader = net.view.leader(INSTANCE, 0)
    net.run()
    assert all(node.decision is None for node in net.live())
    sent = [kind_of(out.data) for ready in net.readies[leader] for out in ready.messages]
    assert "prevote_cert" in sent


def test_6_11_a_member_that_misses_every_vote_decides_by_the_leaders_certificates():
    net = Net(4)
    leader = net.view.leader(INSTANCE, 0)
    deaf = next(k for k in net.keys if k != leader)
    net.block = lambda sender, to, kind: to == deaf and kind in ("prevote", "precommit")
    net.run()
    assert decided_values(net) == {b"value"}
    envelope, _cert = decode_message(net.nodes[deaf].decision_envelope, MESH_ID)
    assert envelope.signer == leader
    assert net.nodes[deaf].decision.round == 0


def test_6_11_a_member_counts_only_its_current_round_and_one_vote_per_signer():
    net = Net(4)
    leader = net.view.leader(INSTANCE, 0)
    other = next(i for i, k in enumerate(net.keys) if k != leader)
    member = net.node(other)
    vote = Prevote(INSTANCE, 0, 0, value_hash(b"value"))
    envelopes = [sign_message(net.ids[i], MESH_ID, vote).encode() for i in range(4) if i != other]
    member.start(0)
    member.receive(envelopes[0], 0)
    member.receive(envelopes[0], 0)   # a duplicate counts once
    member.receive(sign_message(net.ids[other], MESH_ID, Prevote(INSTANCE, 1, 0, value_hash(b"value"))).encode(), 0)
    assert member.dropped["duplicate"] == 1 and member.dropped["future_round"] == 1
    assert not [e for r in [member.receive(envelopes[1], 0)] for e in r.events if e.kind == "prevote_quorum"]
    ready = member.receive(envelopes[2], 0)
    assert [e.kind for e in ready.events if e.kind == "prevote_quorum"] == ["prevote_quorum"]
    assert not ready.messages  # no proposal seen here: nothing to lock on, nothing to precommit


# --- 6.1 quorum -----------------------------------------------------------------------------

def test_6_1_exactly_two_thirds_of_stake_cannot_decide_but_just_above_can():
    net = Net(4, stakes=[4, 3, 3, 2])
    leader = net.view.leader(INSTANCE, 0)
    net.down = {next(k for k in net.keys if k != leader and net.view.stakes[k] == 3)}
    net.run()  # 9 of 12 stake live: more than 2/3 -> decides
    assert len(decided_values(net)) == 1

    net = Net(6, stakes=[1, 1, 1, 1, 1, 1], max_rounds=3)
    net.down = set(net.keys[:2])  # 4 of 6 live: exactly 2/3 -> never decides, gives up
    net.run()
    assert all(n.decision is None and n.gave_up for n in net.live())


# --- 6.5 rounds -----------------------------------------------------------------------------

def test_6_5_timeout_doubles_per_round_up_to_the_cap():
    node = Net(4).node(0)
    assert [node.timeout_ms(r) for r in range(6)] == [100, 200, 400, 800, 1000, 1000]
    assert node.timeout_ms(10_000) == 1000


def test_6_5_a_crashed_leader_is_replaced_by_the_next_rounds_leader():
    net = Net(4)
    crashed = net.view.leader(INSTANCE, 0)
    net.down = {crashed}
    net.run(value_of=lambda key, round: b"from-round-%d" % round)
    (value,) = decided_values(net)
    round = net.node(net.keys.index(next(k for k in net.keys if k != crashed))).decision.round
    assert round >= 1 and value == b"from-round-%d" % round
    assert net.view.leader(INSTANCE, round) != crashed
    for key in net.keys:
        if key != crashed:
            assert any(e.detail["reason"] == "timeout" for e in net.events(key, "round_change"))


def test_6_5_a_later_rounds_proposal_waits_until_the_node_enters_that_round():
    net = Net(4)
    node = net.node(0)
    round = next(r for r in range(2, 50) if net.view.leader(INSTANCE, r) != net.keys[0])
    leader = net.ids[net.keys.index(net.view.leader(INSTANCE, round))]
    proposal = Proposal(INSTANCE, round, 0, "placement", b"v", (), None, None)
    ready = node.receive(sign_message(leader, MESH_ID, proposal).encode(), 0)
    # One proposal is no evidence that anyone else is in its round: no jump, no vote yet.
    assert node.round == 0 and not ready.messages and node.dropped["future_proposal"] == 1
    votes = []
    while node.round < round:   # its own timeouts bring it there; then it votes on the proposal
        votes += [m for m in node.tick(node.deadline_ms).messages if kind_of(m.data) == "prevote"]
    (vote,) = votes
    # To the round's leader, or to everyone in a mesh this small (6.11).
    assert vote.to == (None if net.view.votes_to_every_member else leader.public_key)
    assert decode_message(vote.data, MESH_ID)[1].round == round


def test_6_5_a_byzantine_proposal_for_a_last_round_cannot_make_a_node_give_up():
    """Before, a node jumped to any later round it saw a proposal for: one signed by the
    leader of round max_rounds - 1 made every node give up the instance at once."""
    net = Net(4, max_rounds=64)
    node = net.node(0)
    round = next(r for r in range(63, 0, -1) if net.view.leader(INSTANCE, r) != net.keys[0])
    leader = net.ids[net.keys.index(net.view.leader(INSTANCE, round))]
    junk = Proposal(INSTANCE, round, 0, "placement", b"junk", (), None, None)
    node.receive(sign_message(leader, MESH_ID, junk).encode(), 0)
    assert node.round == 0 and not node.gave_up
    assert node.deadline_ms == node.timeout_ms(0)   # round 0 runs its full course


def test_6_5_max_rounds_bounds_the_instance_and_it_gives_up():
    net = Net(4, max_rounds=3)
    net.block = lambda sender, to, kind: True  # total partition
    net.run()
    for key in net.keys:
        node = net.nodes[key]
        assert node.gave_up and node.decision is None and node.round == 2
        assert len(net.events(key, "gave_up")) == 1
        assert node.tick(10**9) .events == [] and node.deadline_ms is None


def test_6_5_propose_is_illegal_unless_awaiting_a_value():
    net = Net(4)
    net.start()
    follower = next(n for k, n in net.nodes.items() if k != net.view.leader(INSTANCE, 0))
    with pytest.raises(LocalProtocolError):
        follower.propose(b"v", (), 0)


# --- 6.6 locking ----------------------------------------------------------------------------

def test_6_6_a_value_committed_in_a_round_is_the_only_value_later_rounds_can_decide():
    """Round 0 commits A at its leader only (the commit broadcast is lost, the leader crashes).
    Every later leader must re-propose A from its lock, never ask for a fresh value."""
    net = Net(4)
    leader0 = net.view.leader(INSTANCE, 0)
    net.block = lambda sender, to, kind: kind == "commit"
    net.start()
    net.propose_where_asked(lambda key, round: b"A")
    net.deliver()
    assert net.nodes[leader0].decided_value_bytes == b"A"
    assert all(n.locked_value == b"A" and n.locked_round == 0 for n in net.nodes.values())
    net.down = {leader0}
    net.block = lambda sender, to, kind: False
    net.run(value_of=lambda key, round: b"B", start=False)  # any fresh value would be B
    assert decided_values(net) == {b"A"}
    assert not any(net.events(k, "awaiting_value") for k in net.keys if k != leader0)


def test_6_6_a_locked_node_prevotes_nil_for_another_value_without_a_newer_proof_of_lock():
    net = Net(4)
    node = net.node(0)
    # Lock every node on A in round 0 by running round 0 with its precommits lost.
    net.block = lambda sender, to, kind: kind in ("precommit", "commit")
    net.start()
    net.propose_where_asked(lambda key, round: b"A")
    net.deliver()
    assert node.locked_value == b"A" and node.locked_round == 0
    round = next(r for r in range(1, 50) if net.view.leader(INSTANCE, r) != node.me)
    leader = net.ids[net.keys.index(net.view.leader(INSTANCE, round))]
    bare = Proposal(INSTANCE, round, 0, "placement", b"B", (), None, None)
    node.receive(sign_message(leader, MESH_ID, bare).encode(), 1000)  # held until it gets there
    readies = []
    while node.round < round:
        readies.append(node.tick(node.deadline_ms))
    (vote,) = [m for r in readies for m in r.messages if kind_of(m.data) == "prevote"]
    assert decode_message(vote.data, MESH_ID)[1].value_hash is None
    rejected = [e for r in readies for e in r.events if e.kind == "proposal_rejected"]
    assert len(rejected) == 1 and "locked on another value" in rejected[0].detail["reason"]
    assert node.locked_value == b"A" and node.locked_round == 0


def test_6_6_a_lock_reported_in_a_round_change_is_re_proposed_with_its_proof():
    """Only node X saw round 0's prevotes, so only X is locked (on the certificate it formed
    itself, 6.11); it tells the round-1 leader, which must re-propose A with X's certificate
    as proof of lock."""
    net = Net(4, instance_id=instance_with_two_leaders())
    leader0 = net.view.leader(net.node(0).instance_id, 0)
    leader1 = net.view.leader(net.node(0).instance_id, 1)
    x = next(k for k in net.keys if k not in (leader0, leader1))
    net.block = lambda sender, to, kind: (kind in ("prevote", "prevote_cert") and to != x) or kind == "precommit"
    net.start()
    net.propose_where_asked(lambda key, round: b"A")
    net.deliver()
    assert net.nodes[x].locked_value == b"A" and net.nodes[leader1].locked_value is None
    net.block = lambda sender, to, kind: False
    net.advance(order=[x] + [k for k in net.keys if k != x])  # X's round change arrives first
    net.deliver()
    assert not net.events(leader1, "awaiting_value")
    (proposed,) = net.events(leader1, "proposed")
    assert proposed.detail["pol_round"] == 0
    net.run(value_of=lambda key, round: b"B", start=False)
    assert decided_values(net) == {b"A"}


# --- 6.8 catch-up ---------------------------------------------------------------------------

def test_6_8_a_node_that_missed_the_decision_gets_it_in_reply_to_its_round_change():
    net = Net(4)
    leader0 = net.view.leader(INSTANCE, 0)
    late = next(k for k in net.keys if k not in (leader0, net.view.leader(INSTANCE, 1)))
    net.block = lambda sender, to, kind: to == late and kind in ("commit", "precommit")
    net.start()
    net.propose_where_asked(lambda key, round: b"value")
    net.deliver()
    assert net.nodes[late].decision is None
    assert sum(n.decision is not None for n in net.nodes.values()) == 3
    net.block = lambda sender, to, kind: False
    net.advance()
    net.deliver()
    assert net.nodes[late].decided_value_bytes == b"value"


# --- 6.9 persistence ------------------------------------------------------------------------

def test_6_9_every_vote_is_persisted_in_the_same_ready_before_it_is_sent():
    net = Net(4)
    net.run()
    for key in net.keys:
        for ready in net.readies[key]:
            persisted = {r.value["envelope"] for r in ready.persist if r.table == "votes"}
            for out in ready.messages:
                if kind_of(out.data) in ("proposal", "prevote", "precommit"):
                    assert out.data in persisted
            assert not ready.messages or [r.table for r in ready.persist].count("locks") <= 1


def test_6_9_a_restarted_node_repeats_its_vote_and_never_signs_a_conflicting_one():
    net = Net(4)
    node = net.node(0)
    round = next(r for r in range(50) if net.view.leader(INSTANCE, r) != node.me)
    leader = net.ids[net.keys.index(net.view.leader(INSTANCE, round))]
    node.start(0)
    first = node.receive(sign_message(leader, MESH_ID, Proposal(INSTANCE, round, 0, "placement", b"A", (), None,
                                                                 None)).encode(), 0)
    records = [r for r in first.persist]
    (sent,) = [m.data for m in first.messages]
    restarted = Net(4).node(0)
    restarted.restore(records + [PersistRecord("votes", "other", {"instance": bytes(32)})])
    restarted.start(0)
    assert restarted.round == round
    conflicting = sign_message(leader, MESH_ID, Proposal(INSTANCE, round, 0, "placement", b"B", (), None, None))
    again = restarted.receive(conflicting.encode(), 1)
    assert [m.data for m in again.messages] == [sent] and again.persist == []


def test_6_9_a_replacement_instance_object_never_signs_a_second_proposal_for_a_round():
    """MeshCore may drop an undecided instance and start it again within one run (an evicted
    node, an instance moved between epochs): the new object takes the old one's safety
    records, as after a restart (the 10,000-seed sweep's seed 7105 caught the double sign)."""
    net = Net(4)
    leader_key = net.view.leader(INSTANCE, 0)
    leader = net.node(net.keys.index(leader_key))
    leader.start(0)
    first = leader.propose(b"A", (), 0)
    (proposal,) = [r.value["envelope"] for r in first.persist if r.value.get("kind") == "proposal"]
    replacement = Net(4).node(net.keys.index(leader_key))
    replacement.restore(leader.safety_records())
    ready = replacement.start(1)
    assert not replacement.awaiting_value and ready.persist == []  # asks for no value: it proposed already
    with pytest.raises(LocalProtocolError):
        replacement.propose(b"B", (), 1)
    assert [r.value["envelope"] for r in replacement.safety_records() if r.value.get("kind") == "proposal"] == [proposal]


# --- 6.10 evidence and drops ----------------------------------------------------------------

def test_6_10_an_equivocating_proposer_leaves_evidence():
    net = Net(4)
    node = net.node(0)
    leader = net.ids[net.keys.index(net.view.leader(INSTANCE, 0))]
    if leader.public_key == node.me:
        node = net.node(1)
    a = sign_message(leader, MESH_ID, Proposal(INSTANCE, 0, 0, "placement", b"A", (), None, None)).encode()
    b = sign_message(leader, MESH_ID, Proposal(INSTANCE, 0, 0, "placement", b"B", (), None, None)).encode()
    node.receive(a, 0)
    ready = node.receive(b, 0)
    (evidence,) = node.evidence
    assert (evidence.offender, evidence.first, evidence.second) == (leader.public_key, a, b)
    assert [e.kind for e in ready.events] == ["evidence"]
    assert [r.table for r in ready.persist] == ["evidence"] and ready.messages == []
    assert node.dropped["equivocation"] == 1
    node.receive(a, 0)
    assert node.dropped["duplicate"] == 1 and len(node.evidence) == 1


def test_6_10_an_equivocating_voter_leaves_evidence_at_the_collector():
    net = Net(4)
    leader_key = net.view.leader(INSTANCE, 0)
    collector = net.nodes[leader_key]
    voter = next(i for i in net.ids if i.public_key != leader_key)
    collector.start(0)
    for value in (b"A", b"B"):
        collector.receive(sign_message(voter, MESH_ID, Prevote(INSTANCE, 0, 0, value_hash(value))).encode(), 0)
    assert [e.offender for e in collector.evidence] == [voter.public_key]
    assert collector.dropped["equivocation"] == 1


def test_6_10_equivocation_arriving_after_the_decision_is_still_evidence():
    net = Net(4)
    net.run()
    leader_key = net.view.leader(INSTANCE, 0)
    leader = net.ids[net.keys.index(leader_key)]
    follower = next(n for k, n in net.nodes.items() if k != leader_key)
    assert follower.decision is not None and follower.evidence == []
    late = sign_message(leader, MESH_ID, Proposal(INSTANCE, 0, 0, "placement", b"other", (), None, None)).encode()
    ready = follower.receive(late, net.now_ms)
    (evidence,) = follower.evidence
    assert evidence.offender == leader_key and evidence.second == late
    assert kind_of(evidence.first) == "proposal" and evidence.first != late
    assert [r.table for r in ready.persist] == ["evidence"] and [e.kind for e in ready.events] == ["evidence"]
    # The collector still holds every prevote it certified: a conflicting one is caught too.
    voter = next(i for i in net.ids if i.public_key != leader_key)
    collector = net.nodes[leader_key]
    collector.receive(sign_message(voter, MESH_ID, Prevote(INSTANCE, 0, 0, None)).encode(), net.now_ms)
    assert [e.offender for e in collector.evidence] == [voter.public_key]


def test_6_10_forged_non_member_and_misaddressed_votes_are_dropped_and_counted():
    net = Net(4)
    leader_key = net.view.leader(INSTANCE, 0)
    collector = net.nodes[leader_key]
    voter = next(i for i in net.ids if i.public_key != leader_key)
    vote = sign_message(voter, MESH_ID, Prevote(INSTANCE, 0, 0, value_hash(b"A"))).encode()
    forged = vote[:-1] + bytes([vote[-1] ^ 1])  # last signature byte flipped
    (outsider,) = identities(1, tag=b"outsider")
    cases = [
        (forged, "undecodable"),
        (sign_message(outsider, MESH_ID, Prevote(INSTANCE, 0, 0, None)).encode(), "non_member"),
        (sign_message(voter, MESH_ID, Prevote(INSTANCE, 0, 7, None)).encode(), "wrong_epoch"),
        (sign_message(voter, MESH_ID, Prevote(bytes(32), 0, 0, None)).encode(), "wrong_instance"),
        (sign_message(voter, MESH_ID, Prevote(INSTANCE, 99, 0, None)).encode(), "round_too_far"),
        (sign_message(voter, MESH_ID, RoundChange(INSTANCE, 1, 0, 0, vote, vote)).encode(), None),
    ]
    for data, reason in cases:
        before = sum(collector.dropped.values())
        ready = collector.receive(data, 0)
        assert not ready.messages and not ready.persist
        if reason is not None:
            assert collector.dropped[reason] == 1
        assert sum(collector.dropped.values()) == before + 1
    assert collector.evidence == []


def test_6_10_a_proposal_not_from_the_rounds_leader_is_dropped():
    net = Net(4)
    impostor = next(i for i in net.ids if i.public_key != net.view.leader(INSTANCE, 0))
    node = next(n for k, n in net.nodes.items() if k != impostor.public_key)
    ready = node.receive(sign_message(impostor, MESH_ID, Proposal(INSTANCE, 0, 0, "placement", b"A", (), None,
                                                                  None)).encode(), 0)
    assert not ready and node.dropped["not_leader"] == 1


def test_6_3_a_value_the_validator_rejects_is_prevoted_nil_and_the_round_moves_on():
    rejected = []

    def validate(value, justification, proven=False):
        if value == b"bad":
            rejected.append(value)
            return "policy says no"
        return None

    net = Net(4, validate=validate)
    net.run(value_of=lambda key, round: b"bad" if round == 0 else b"good")
    assert decided_values(net) == {b"good"} and rejected
    # A quorum of nil prevotes is certified and moves everyone on without waiting for a timeout.
    assert all(any(e.detail["reason"] == "nil_prevote_certificate" for e in net.events(k, "round_change"))
               for k in net.keys)


# --- agreement under loss (a small seeded sweep; the simulator does the big one) ------------

@pytest.mark.parametrize("seed", range(12))
def test_agreement_and_termination_under_random_message_loss(seed):
    rng = random.Random(seed)
    n = rng.choice([4, 5, 7])
    net = Net(n, max_rounds=24)
    net.block = lambda sender, to, kind: rng.random() < 0.3
    net.start()
    for _ in range(6):  # lossy phase: rounds time out, locks form and move
        net.propose_where_asked(lambda key, round: b"value-%d-%d" % (net.keys.index(key), round))
        net.deliver()
        net.advance()
    decided_early = {n.decided_value_bytes for n in net.live() if n.decision is not None}
    net.block = lambda sender, to, kind: False  # healed: everyone must decide the same value
    net.run(value_of=lambda key, round: b"value-%d-%d" % (net.keys.index(key), round), start=False)
    assert len(decided_values(net)) == 1, "reproduce with seed=%d" % seed
    assert decided_early <= decided_values(net)
    assert all(n.decision is not None for n in net.live())


def test_an_instance_tells_whether_other_members_took_part():
    """F7: an evicted node keeps exactly the instances others vote in (its stake still
    counts in their epoch); one that only it ran is dropped."""
    lonely = Net(4)
    lonely.down = set(lonely.keys[1:])
    lonely.start()
    lonely.propose_where_asked(lambda key, round: b"value")
    lonely.deliver()
    lonely.advance()  # its own round change is not someone else's
    assert not lonely.node(0).heard_from_others
    net = Net(4)
    net.start()
    net.propose_where_asked(lambda key, round: b"value")
    net.deliver()
    assert all(node.heard_from_others for node in net.live())
