"""The node's SQLite store: persist records, certificate history for restart replay,
bounded events, and one transaction per Ready batch."""

import pytest

from keys.identity import SigningIdentity
from meshnode.node.store import NodeStore
from protocol import codec
from protocol.envelope import seal
from protocol.errors import LocalProtocolError
from protocol.ready import Decision, Event, PersistRecord, Ready

SIGNER = SigningIdentity(bytes(32))
MESH = bytes(range(32))


def certificate(instance: bytes, epoch: int) -> bytes:
    # Only the envelope shape and the epoch field matter to the store.
    return seal(SIGNER, MESH, "commit", {"instance": instance, "epoch": epoch, "round": 0}).encode()


def decision(n: int, epoch: int = 1, kind: str = "placement") -> Decision:
    instance = bytes([n]) * 32
    return Decision(kind, instance, None, certificate(instance, epoch))


def test_pragmas_are_wal_and_normal(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite")
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_persist_records_upsert_and_round_trip_after_reopen(tmp_path):
    path = tmp_path / "node.sqlite"
    store = NodeStore(path)
    store.apply([
        PersistRecord("votes", "aa:0:prevote", {"round": 0, "value_hash": b"\x01" * 32, "sent": True}),
        PersistRecord("locks", "aa", {"round": 2, "value": None, "bids": [b"x", b"y"], "meta": {"k": 1}}),
    ])
    store.apply([PersistRecord("locks", "aa", {"round": 3, "value": b"v", "bids": [], "meta": {}})])
    store.close()
    store = NodeStore(path)
    assert store.get("votes", "aa:0:prevote") == {"round": 0, "value_hash": b"\x01" * 32, "sent": True}
    assert store.load("locks") == {"aa": {"round": 3, "value": b"v", "bids": [], "meta": {}}}
    assert store.get("votes", "missing") is None
    assert store.load("evidence") == {}


@pytest.mark.parametrize("record, message", [
    (PersistRecord("sqlite_master", "k", {"a": 1}), "not one of"),
    (PersistRecord("votes", "k", {"Bad-Col": 1}), "bad column name"),
    (PersistRecord("votes", "k", {"key": 1}), "bad column name"),
    (PersistRecord("votes", "k", {"x; DROP TABLE votes": 1}), "bad column name"),
    (PersistRecord("votes", "", {"a": 1}), "key must be"),
    (PersistRecord("votes", "k", {"a": 1 << 63}), "64-bit"),
])
def test_contract_violations_raise_and_write_nothing(tmp_path, record, message):
    store = NodeStore(tmp_path / "node.sqlite")
    with pytest.raises(LocalProtocolError, match=message):
        store.apply([PersistRecord("votes", "first", {"a": 1}), record])
    assert store.load("votes") == {}  # the whole batch rolled back


def test_a_column_keeps_its_kind(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite")
    store.apply([PersistRecord("jobs", "j", {"state": "running"})])
    with pytest.raises(LocalProtocolError, match="column holds plain values"):
        store.apply([PersistRecord("jobs", "j2", {"state": ["a"]})])
    store.apply([PersistRecord("jobs", "j3", {"gpus": [0, 1]})])
    with pytest.raises(LocalProtocolError, match="column holds encoded values"):
        store.apply([PersistRecord("jobs", "j4", {"gpus": 2})])
    assert store.load("jobs") == {"j": {"state": "running", "gpus": None}, "j3": {"state": None, "gpus": [0, 1]}}


def test_rolled_back_batch_forgets_its_column_kinds(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite")
    with pytest.raises(LocalProtocolError):
        store.apply([PersistRecord("jobs", "j", {"tags": ["x"]}), PersistRecord("bogus", "k", {})])
    store.apply([PersistRecord("jobs", "j", {"tags": "plain now"})])  # the kind was never committed
    assert store.load("jobs") == {"j": {"tags": "plain now"}}


def test_certificates_replay_in_decision_order_after_restart(tmp_path):
    path = tmp_path / "node.sqlite"
    store = NodeStore(path)
    order = [decision(5, epoch=1), decision(2, epoch=1, kind="membership"), decision(9, epoch=2, kind="eviction")]
    store.record_ready(Ready(decisions=order[:2]))
    store.record_ready(Ready(decisions=[order[2], order[0]]))  # a repeated decision is not stored twice
    store.close()
    store = NodeStore(path)
    assert store.certificates_in_order() == [d.certificate for d in order]
    rows = store.certificates()
    assert [(r["value_kind"], r["epoch"]) for r in rows] == [("placement", 1), ("membership", 1), ("eviction", 2)]
    assert [r["certificate"] for r in store.certificates("eviction")] == [order[2].certificate]


def test_ready_batch_is_one_transaction(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite")
    bad = Ready(persist=[PersistRecord("votes", "v", {"a": 1})], decisions=[decision(1)],
                events=[Event("decided", 5, {})])
    bad.persist.append(PersistRecord("nope", "k", {}))
    with pytest.raises(LocalProtocolError):
        store.record_ready(bad)
    assert store.certificates_in_order() == [] and store.recent_events() == [] and store.load("votes") == {}


def test_messages_only_batch_touches_no_database(tmp_path):
    """Most Ready batches are heartbeats to send: they must not cost a transaction."""
    from protocol.ready import Outbound

    store = NodeStore(tmp_path / "node.sqlite")
    statements = []
    store._conn.set_trace_callback(statements.append)
    store.record_ready(Ready(messages=[Outbound(None, b"heartbeat")]))
    assert statements == []
    store.record_ready(Ready(events=[Event("decided", 5, {})]))
    assert statements != [] and [e.kind for e in store.recent_events()] == ["decided"]


def test_events_are_bounded_to_the_newest(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite", max_events=5)
    for batch in range(3):
        store.record_ready(Ready(events=[Event("tick", batch * 4 + i, {"i": i}) for i in range(4)]))
    events = store.recent_events(limit=100)
    assert [e.at_ms for e in events] == [7, 8, 9, 10, 11]
    assert events[-1] == Event("tick", 11, {"i": 3})
    assert store.db.execute("SELECT count(*) FROM events").fetchone()[0] == 5


def test_malformed_decision_certificate_is_a_local_error(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite")
    with pytest.raises(LocalProtocolError, match="not an encoded CommitCertificate"):
        store.record_ready(Ready(decisions=[Decision("placement", b"\x01" * 32, None, codec.pack([1, 2]))]))


def test_safety_records_restore_a_consensus_lock_after_reopen(tmp_path):
    # SPEC.md 6.9: what a core persisted (votes, locks) comes back as records that
    # ConsensusInstance.restore turns into the same lock and round.
    from consensus_net import Net, kind_of
    net = Net(4)
    net.block = lambda sender, to, kind: kind in ("commit", "precommit")   # nobody decides
    net.start()
    net.propose_where_asked(lambda key, round: b"value")
    net.deliver()
    key, node = next((k, n) for k, n in net.nodes.items() if n.decision is None and n.lock is not None)
    path = tmp_path / "node.sqlite"
    store = NodeStore(path)
    for ready in net.readies[key]:
        store.record_ready(ready)
    store.close()
    records = NodeStore(path).safety_records()
    assert {r.table for r in records} == {"votes", "locks"}
    fresh = Net(4).nodes[key]
    fresh.restore(records)
    assert (fresh.round, fresh.lock) == (node.round, node.lock)
    assert kind_of(fresh._safety.signed("precommit", 0)[1]) == "precommit"


def vote(instance: bytes, epoch: int, round: int = 0) -> PersistRecord:
    key = "%s:%d:%d:prevote" % (instance.hex(), epoch, round)
    return PersistRecord("votes", key, {"instance": instance, "epoch": epoch, "round": round, "kind": "prevote",
                                        "envelope": b"signed"})


def lock(instance: bytes, epoch: int) -> PersistRecord:
    return PersistRecord("locks", "%s:%d" % (instance.hex(), epoch), {
        "instance": instance, "epoch": epoch, "round": 0, "value_hash": b"h" * 32, "certificate": b"c",
        "proposal": b"p"})


def entered(epoch: int) -> PersistRecord:
    return PersistRecord("membership", str(epoch), {"epoch": epoch, "certificate": b"epoch-change"})


def test_safety_records_of_decided_old_epoch_instances_are_pruned_on_an_epoch_change(tmp_path):
    # SPEC.md 6.9: node.sqlite kept every vote and lock forever. Entering an epoch drops
    # those of instances decided in older epochs, and those of epochs too old for the core
    # to hold a view of; the current epoch's and undecided recent ones stay.
    store = NodeStore(tmp_path / "node.sqlite")
    decided_old, open_old, decided_now = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    store.record_ready(Ready(persist=[vote(decided_old, 0), vote(decided_old, 0, 1), lock(decided_old, 0),
                                      vote(open_old, 0), lock(open_old, 0)],
                             decisions=[Decision("placement", decided_old, None, certificate(decided_old, 0))]))
    store.record_ready(Ready(persist=[entered(1), vote(decided_now, 1)],
                             decisions=[Decision("placement", decided_now, None, certificate(decided_now, 1))]))
    kept = {(r.table, r.value["instance"], r.value["epoch"]) for r in store.safety_records()}
    assert kept == {("votes", open_old, 0), ("locks", open_old, 0), ("votes", decided_now, 1)}
    store.apply([entered(7)])  # the core still holds epoch 0's view (the newest 8: 0..7)
    kept = {(r.table, r.value["instance"], r.value["epoch"]) for r in store.safety_records()}
    assert kept == {("votes", open_old, 0), ("locks", open_old, 0)}
    # Undecided, but from an epoch whose view no core holds any more: it can never be read.
    store.apply([entered(8)])
    assert store.safety_records() == []
    assert len(store.certificates()) == 2  # certificates are history: never pruned


def test_votes_of_an_older_epoch_whose_view_the_core_keeps_are_not_pruned(tmp_path):
    """GA10: a core keeps the view of a gang's epoch past its newest 8 (its next attempt runs
    there); the membership record says which, and the store keeps that epoch's undecided
    votes, so a restarted node never votes twice in the gang's new attempt."""
    store = NodeStore(tmp_path / "node.sqlite")
    gang_attempt, other = b"\x04" * 32, b"\x05" * 32
    store.apply([vote(gang_attempt, 0), lock(gang_attempt, 0), vote(other, 1)])
    store.apply([PersistRecord("membership", "12", {"epoch": 12, "certificate": b"epoch-change",
                                                    "older_views": [0]})])
    kept = {(r.table, r.value["instance"], r.value["epoch"]) for r in store.safety_records()}
    assert kept == {("votes", gang_attempt, 0), ("locks", gang_attempt, 0)}


def test_safety_records_stay_bounded_over_many_epochs(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite")
    for epoch in range(40):
        instances = [bytes([epoch, n]) * 16 for n in range(3)]
        store.record_ready(Ready(
            persist=[entered(epoch)] + [vote(i, epoch, r) for i in instances for r in range(2)],
            decisions=[Decision("placement", i, None, certificate(i, epoch)) for i in instances[:2]]))
    # Per epoch: 2 decided instances (pruned once the epoch is past) and 1 open one (kept
    # for the newest views only), 2 votes each.
    assert len(store.load("votes")) == 2 * 3 + 2 * (8 - 1)


def test_the_newest_exit_or_cancel_per_job_comes_back_after_reopen(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite")
    jid = b"\x07" * 32
    for kind, data in (("exit", b"first exit envelope"), ("cancel", b"then a cancel")):
        store.apply([PersistRecord("jobs", jid.hex(), {"job_id": jid, "outcome": kind, "envelope": data})])
    store.close()
    assert NodeStore(tmp_path / "node.sqlite").job_outcomes() == [b"then a cancel"]


def test_a_held_reservation_comes_back_after_reopen_and_a_released_one_is_gone(tmp_path):
    """SPEC.md R1: a bid's reservation is on disk before the bid is sent, so a restarted node
    never promises the same capacity twice; released or allocated, it leaves the disk."""
    path = tmp_path / "node.sqlite"
    store = NodeStore(path)
    held = {"instance": b"\x01" * 32, "held": 1, "gpus": [0, 1], "gpu_mem_mib": 8192, "cpu_milli": 500,
            "mem_mib": 1024, "bid": b"bid-envelope"}
    store.apply([PersistRecord("reservations", "01" * 32, held),
                 PersistRecord("reservations", "02" * 32, dict(held, instance=b"\x02" * 32))])
    store.apply([PersistRecord("reservations", "02" * 32, {"instance": b"\x02" * 32, "held": 0})])
    store.close()
    reopened = NodeStore(path)
    restored = [r for r in reopened.safety_records() if r.table == "reservations"]
    assert [(r.key, r.value["gpus"], r.value["bid"]) for r in restored] == [("01" * 32, [0, 1], b"bid-envelope")]


def test_a_restart_from_the_store_never_rewinds_the_capability_seq(tmp_path):
    """SPEC P1, issue 15 (stale capability): peers keep a vector only if its seq is higher, so
    the floor a core persists comes back from the store and a core restarted on it signs
    above everything it signed before (the driver passes ``capability_seq_floor()``)."""
    import hashlib
    import random

    from keys.genesis import DEFAULT_PARAMS, Genesis
    from protocol.mesh import MeshCore
    from protocol.messages import Member
    from protocol.policy import LocalCapacity, NodePolicy
    identity = SigningIdentity(hashlib.sha256(b"restarted node").digest())
    genesis = Genesis(name="t", created_ms=0, params=DEFAULT_PARAMS, authorities=(),
                      members=(Member(public_key=identity.public_key, stake=10, zone="z", labels=(), addrs=()),))

    def core(floor: int) -> MeshCore:
        return MeshCore(identity=identity, genesis=genesis, policy=NodePolicy(zone="z"), capacity=LocalCapacity(),
                        rng=random.Random(1), now_ms=0, capability_seq_floor=floor)

    path = tmp_path / "node.sqlite"
    store = NodeStore(path)
    before = core(store.capability_seq_floor())
    for second in range(1, 6):
        store.record_ready(before.update_telemetry((), 0, 1000 * second, simulated=True))
    signed = before.capability.vector.seq
    store.close()
    floor = NodeStore(path).capability_seq_floor()
    assert floor > signed
    after = core(floor)
    after.update_telemetry((), 0, 10, simulated=True)
    assert after.capability.vector.seq > signed


def test_the_events_tail_is_kept_without_reading_its_newest_seq_per_batch(tmp_path):
    # Issue 18: every Ready with events read back max(seq) to trim the tail: one more
    # statement per batch, 3 of a node's 4 batches per placement. The seq is counted here.
    store = NodeStore(tmp_path / "node.sqlite", max_events=5)
    statements = []
    store._conn.set_trace_callback(statements.append)
    for batch in range(4):
        store.record_ready(Ready(events=[Event("tick", batch * 3 + i, {}) for i in range(3)]))
    assert sum("max(seq)" in s for s in statements) == 1
    assert [e.at_ms for e in store.recent_events(limit=100)] == [7, 8, 9, 10, 11]
    store.close()
    reopened = NodeStore(tmp_path / "node.sqlite", max_events=5)   # counts on from the stored tail
    reopened.record_ready(Ready(events=[Event("tick", 12, {})]))
    assert [e.at_ms for e in reopened.recent_events(limit=100)] == [8, 9, 10, 11, 12]


def test_a_failed_batch_leaves_the_events_tail_and_its_count_as_they_were(tmp_path):
    store = NodeStore(tmp_path / "node.sqlite", max_events=3)
    store.record_ready(Ready(events=[Event("tick", i, {}) for i in range(3)]))
    with pytest.raises(LocalProtocolError):
        store.record_ready(Ready(persist=[PersistRecord("no_such_table", "k", {})],
                                 events=[Event("tick", 9, {})]))
    store.record_ready(Ready(events=[Event("tick", 3, {})]))
    assert [e.at_ms for e in store.recent_events(limit=100)] == [1, 2, 3]
