"""Per-core memo tables (protocol/caches.py): bounded, never shared by accident, and never
a change of answer: every function given ``caches`` returns what it returns without."""

from __future__ import annotations

import importlib
import pkgutil
from collections import OrderedDict
from dataclasses import replace
from functools import _lru_cache_wrapper

import pytest

import protocol
from consensus_net import Net, identities
from keys.genesis import DEFAULT_PARAMS, Genesis
from protocol import codec
from protocol.caches import LRU, CoreCaches
from protocol.certificate import verify_commit_certificate
from protocol.errors import RemoteProtocolError
from protocol.messages import (CommitCertificate, Constraints, JobManifest, Member, Placement, PlacementSlot,
                               Prevote, Resources, decode_message, decode_value, encode_message, job_id,
                               sign_message, slot_placements, value_hash)
from protocol.quorum import EpochView
from testnet.sim import SimConfig, run_simulation

MESH = bytes(range(32))


def job(nonce: int = 1, owner=None) -> tuple[JobManifest, bytes]:
    owner = owner or identities(1, tag=b"owner")[0]
    manifest = JobManifest(owner=owner.public_key, name="j", nonce=nonce, entrypoint="counter", args=(),
                           resources=Resources(gpus=0, gpu_mem_mib=0, cpu_milli=100, mem_mib=64),
                           strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                           priority=0, backups=0, max_retries=0, created_ms=0, epoch=0)
    return manifest, encode_message(owner, MESH, manifest)


# --- the tables -------------------------------------------------------------------------------

def test_an_lru_keeps_the_recently_used_within_its_entry_bound():
    table = LRU(2)
    table.remember("a", 1)
    table.remember("b", 2)
    assert table.lookup("a") == 1          # "a" is now the most recently used
    table.remember("c", 3)
    assert "b" not in table and table.lookup("a") == 1 and table.lookup("c") == 3
    assert table.lookup("missing") is None


def test_an_lru_with_a_byte_bound_drops_the_oldest_until_the_new_entry_fits():
    table = LRU(100, max_bytes=10, size_of=len)
    table.remember("aaaa", 1)
    table.remember("bbbb", 2)
    assert table.bytes_held == 8
    table.remember("cccc", 3)              # 12 > 10: "aaaa" goes
    assert list(table) == ["bbbb", "cccc"] and table.bytes_held == 8
    table.remember("bbbb", 4)              # re-remembering replaces, never counts twice
    assert table.bytes_held == 8 and table.lookup("bbbb") == 4
    table.forget("cccc")
    assert table.bytes_held == 4
    table.clear()
    assert table.bytes_held == 0 and not table


def test_core_caches_are_sized_per_table_and_clear_together():
    caches = CoreCaches(signatures=3, decoded=2)
    assert caches.signatures.max_entries == 3 and caches.decoded.max_entries == 2
    assert set(caches.sizes()) == {"signatures", "decoded", "values", "value_hashes", "slot_items",
                                   "certificate_verdicts", "bids", "placements"}
    manifest, data = job()
    decode_message(data, MESH, caches=caches)
    assert caches.sizes()["decoded"] == 1 and caches.sizes()["signatures"] == 1
    caches.clear()
    assert not any(caches.sizes().values())


# --- no sharing -------------------------------------------------------------------------------

def test_two_cores_never_share_an_entry():
    """What one core's caches learned (its own signature, its decodes) is not there for another."""
    signer = identities(1)[0]
    mine, yours = CoreCaches(), CoreCaches()
    vote = Prevote(bytes(32), 0, 0, None)
    data = sign_message(signer, MESH, vote, caches=mine).encode()
    assert len(mine.signatures) == 1 and len(mine.decoded) == 1
    assert not any(yours.sizes().values())
    assert decode_message(data, MESH, caches=mine)[1] is vote          # primed at signing
    decoded = decode_message(data, MESH, caches=yours)[1]
    assert decoded == vote and decoded is not vote                    # decoded (and verified) afresh
    assert len(yours.signatures) == 1 and len(yours.decoded) == 1


def test_without_caches_nothing_is_remembered_anywhere():
    manifest, data = job(nonce=7)
    first = decode_message(data, MESH, allow_any_mesh=True)
    second = decode_message(data, MESH, allow_any_mesh=True)
    assert first == second and first[1] is not second[1]
    value = codec.pack(Placement(job=data, primary=bytes(32), backups=(), gpus=()).to_body())
    assert decode_value("placement", value) is not decode_value("placement", value)


def _module_state() -> dict:
    """The size of every mutable table held at module level in protocol/ (and of any
    functools cache): a simulation must leave them as it found them."""
    state = {}
    for info in pkgutil.walk_packages(protocol.__path__, "protocol."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, _lru_cache_wrapper):
                state[(info.name, name)] = value.cache_info().currsize
            elif isinstance(value, (dict, OrderedDict, set, list)) and not name.startswith("__"):
                state[(info.name, name)] = len(value)
    return state


def test_a_simulation_leaves_no_entry_in_module_level_state():
    """Only per-class metadata (schema's field lists per record class, bounded by the
    classes) may fill in on a first run; a second run of the same kinds adds nothing."""
    configs = (SimConfig(nodes=4, jobs=2, seed=3, faults=(), heartbeats=False),
               SimConfig(nodes=5, jobs=3, seed=4, slot_ms=50, faults=(), heartbeats=False))
    for config in configs:
        run_simulation(config)
    before = _module_state()
    for config in configs:
        run_simulation(replace(config, seed=config.seed + 1))
    assert _module_state() == before


# --- same answers -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def decision():
    members = tuple(Member(i.public_key, 1, "zone-a", (), ()) for i in identities(4))
    genesis = Genesis("caches test", 0, members, DEFAULT_PARAMS, ())
    manifest, _ = job()
    value = codec.pack(Placement(job=encode_message(identities(1, tag=b"owner")[0], genesis.mesh_id, manifest),
                                 primary=identities(4)[1].public_key, backups=(), gpus=()).to_body())
    net = Net(4, mesh_id=genesis.mesh_id, instance_id=job_id(manifest))
    net.run(value_of=lambda key, round: value)
    return genesis, net.node(0).decision_envelope


def test_a_certificate_verifies_alike_with_and_without_caches(decision):
    genesis, data = decision
    view = EpochView.from_genesis(genesis)
    caches = CoreCaches()
    plain = verify_commit_certificate(data, genesis.mesh_id, view)
    assert verify_commit_certificate(data, genesis.mesh_id, view, caches=caches) == plain
    assert len(caches.certificate_verdicts) == 1
    assert verify_commit_certificate(data, genesis.mesh_id, view, caches=caches) == plain  # from the verdict
    other = EpochView(0, {k: 1 for k in list(view.stakes)[:3]} | {identities(1, tag=b"x")[0].public_key: 9})
    for kept in (None, caches):  # another membership: the remembered verdict must not answer for it
        with pytest.raises(RemoteProtocolError):
            verify_commit_certificate(data, genesis.mesh_id, other, caches=kept)
    cert = decode_message(data, genesis.mesh_id, expect=CommitCertificate)[1]
    assert value_hash(cert.value, caches=caches) == value_hash(cert.value)
    assert decode_value(cert.value_kind, cert.value, caches=caches) == decode_value(cert.value_kind, cert.value)


def test_slot_placements_answer_alike_and_are_remembered_per_value_object():
    owner = identities(1, tag=b"owner")[0]
    placements = tuple(Placement(job=job(nonce=n, owner=owner)[1], primary=bytes(32), backups=(), gpus=())
                       for n in range(3))
    value = PlacementSlot(epoch=0, slot=0, placements=placements)
    caches = CoreCaches()
    items = slot_placements(value, MESH, caches=caches)
    assert slot_placements(value, MESH, caches=caches) is items
    assert [jid for _p, _j, jid in slot_placements(value, MESH)] == [jid for _p, _j, jid in items]
    equal = PlacementSlot(epoch=0, slot=0, placements=placements)   # an equal value, another object
    assert slot_placements(equal, MESH, caches=caches) is not items


def test_a_job_id_is_remembered_on_its_manifest():
    manifest, data = job(nonce=11)
    jid = job_id(manifest)
    assert manifest.__dict__["_job_id"] == jid and job_id(manifest) is jid
    decoded = decode_message(data, MESH)[1]
    assert decoded == manifest and "_job_id" not in decoded.__dict__ and job_id(decoded) == jid
