"""Commit certificates verify offline, and every kind of tampering is refused (SPEC.md 6.7)."""

from __future__ import annotations

import json

import pytest

from consensus_net import Net, identities
from keys.genesis import DEFAULT_PARAMS, Genesis
from meshnode.cli import main
from protocol import codec
from protocol.certificate import verify_commit_certificate
from protocol.errors import RemoteProtocolError
from protocol.messages import (CommitCertificate, Constraints, JobManifest, Member, Placement, Precommit, Prevote,
                               Resources, decode_message, encode_message, job_id, sign_message, value_hash)
from protocol.quorum import EpochView


def placement_of_a_job(mesh_id: bytes, epoch: int) -> tuple[bytes, bytes]:
    """(instance id, placement value) of a small job naming ``epoch``, placed on node 1."""
    owner = identities(5)[4]
    job = JobManifest(owner=owner.public_key, name="j", nonce=1, entrypoint="counter", args=(),
                      resources=Resources(gpus=0, gpu_mem_mib=0, cpu_milli=100, mem_mib=64), strategy="throughput",
                      constraints=Constraints(zones=(), labels=(), attested=()), priority=0, backups=0,
                      max_retries=0, created_ms=0, epoch=epoch)
    value = Placement(job=encode_message(owner, mesh_id, job), primary=identities(4)[1].public_key, backups=(),
                      gpus=())
    return job_id(job), codec.pack(value.to_body())


@pytest.fixture(scope="module")
def decided():
    """A genesis of 4 equal-stake nodes and the commit certificate of one decision among them."""
    members = tuple(Member(i.public_key, 1, "zone-a", (), ()) for i in identities(4))
    genesis = Genesis("cert test", 0, members, DEFAULT_PARAMS, ())
    iid, value = placement_of_a_job(genesis.mesh_id, 0)
    net = Net(4, mesh_id=genesis.mesh_id, instance_id=iid)
    net.run(value_of=lambda key, round: value)
    return genesis, net


def reseal(net: Net, data: bytes, **changes) -> bytes:
    """Re-sign a certificate with changed fields, as a Byzantine collector could."""
    _, cert = decode_message(data, net.mesh_id, expect=CommitCertificate)
    body = {**cert.to_body(), **changes}
    return sign_message(net.ids[0], net.mesh_id, CommitCertificate.from_body(body)).encode()


def test_a_decided_certificate_verifies_offline(decided):
    genesis, net = decided
    data = net.node(0).decision_envelope
    cert, value = verify_commit_certificate(data, genesis.mesh_id, EpochView.from_genesis(genesis))
    assert value == placement_of_a_job(genesis.mesh_id, 0)[1] and cert.round == 0 and len(cert.precommits) >= 3


def bad_certificates(net: Net, data: bytes):
    _, cert = decode_message(data, net.mesh_id, expect=CommitCertificate)
    votes = list(cert.precommits)
    (outsider,) = identities(1, tag=b"outsider")
    yield "flipped byte", data[:40] + bytes([data[40] ^ 1]) + data[41:]
    yield "truncated", data[:-10]
    yield "other value", reseal(net, data, value=b"another value")
    yield "too few votes", reseal(net, data, precommits=votes[:2])
    yield "duplicate signer", reseal(net, data, precommits=votes[:2] + votes[:1])
    yield "other round", reseal(net, data, round=1)
    yield "prevotes", reseal(net, data, precommits=[
        sign_message(i, net.mesh_id, Prevote(cert.instance, 0, 0, decode_message(votes[0], net.mesh_id)[1].value_hash))
        .encode() for i in net.ids])
    outsider_vote = sign_message(outsider, net.mesh_id, Precommit(
        cert.instance, 0, 0, decode_message(votes[0], net.mesh_id)[1].value_hash)).encode()
    yield "non-member vote", reseal(net, data, precommits=votes[:2] + [outsider_vote])


@pytest.mark.parametrize("case", ["flipped byte", "truncated", "other value", "too few votes", "duplicate signer",
                                  "other round", "prevotes", "non-member vote"])
def test_tampered_short_or_duplicate_signer_certificates_are_rejected(decided, case):
    genesis, net = decided
    data = dict(bad_certificates(net, net.node(0).decision_envelope))[case]
    with pytest.raises(RemoteProtocolError):
        verify_commit_certificate(data, genesis.mesh_id, EpochView.from_genesis(genesis))


def test_a_certificate_is_checked_against_the_membership_it_is_given(decided):
    genesis, net = decided
    data = net.node(0).decision_envelope
    view = EpochView.from_genesis(genesis)
    verify_commit_certificate(data, genesis.mesh_id, view)  # valid, and now cached for this view
    bigger = EpochView(0, {**view.stakes, **{i.public_key: 10 for i in identities(2, tag=b"new")}})
    with pytest.raises(RemoteProtocolError):
        verify_commit_certificate(data, genesis.mesh_id, bigger)
    with pytest.raises(RemoteProtocolError):
        verify_commit_certificate(data, bytes(32), view)  # signed for another mesh


def test_cli_cert_verify_exits_0_for_a_valid_and_2_for_a_tampered_certificate(decided, tmp_path, capsys):
    genesis, net = decided
    genesis_file = tmp_path / "genesis.bin"
    genesis_file.write_bytes(genesis.encode())
    good = tmp_path / "good.cert"
    good.write_bytes(net.node(1).decision_envelope)
    bad = tmp_path / "bad.cert"
    bad.write_bytes(dict(bad_certificates(net, net.node(1).decision_envelope))["too few votes"])

    assert main(["cert", "verify", str(good), "--genesis", str(genesis_file), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["valid"] and result["stake"] * 3 > result["total_stake"] * 2 and result["round"] == 0

    assert main(["cert", "verify", str(bad), "--genesis", str(genesis_file), "--json"]) == 2
    result = json.loads(capsys.readouterr().out)
    assert result == {"valid": False, "reason": result["reason"]} and "2/3" in result["reason"]

    assert main(["cert", "verify", str(bad), "--genesis", str(genesis_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("invalid: ") and err.count("\n") == 1
    assert main(["cert", "verify", str(tmp_path / "missing"), "--genesis", str(genesis_file)]) == 2


def test_cli_cert_verify_refuses_a_placement_decided_in_another_epoch_than_its_job_names(decided, tmp_path,
                                                                                         capsys):
    # SPEC.md P2: one instance id runs in one epoch; only a quorum with more than 1/3
    # Byzantine stake signs such a certificate, and it must not pass for a placement.
    genesis, net = decided
    iid, value = placement_of_a_job(genesis.mesh_id, 1)
    precommits = tuple(encode_message(i, genesis.mesh_id, Precommit(iid, 0, 0, value_hash(value)))
                       for i in net.ids[:3])
    certificate = encode_message(net.ids[0], genesis.mesh_id,
                                 CommitCertificate(iid, 0, 0, "placement", value, precommits))
    genesis_file, cert_file = tmp_path / "genesis.bin", tmp_path / "wrong-epoch.cert"
    genesis_file.write_bytes(genesis.encode())
    cert_file.write_bytes(certificate)
    assert verify_commit_certificate(certificate, genesis.mesh_id, EpochView.from_genesis(genesis))  # the votes hold
    assert main(["cert", "verify", str(cert_file), "--genesis", str(genesis_file), "--json"]) == 2
    result = json.loads(capsys.readouterr().out)
    assert not result["valid"] and "placed in epoch 1, not 0" in result["reason"]


def test_cli_cert_verify_rebuilds_later_epochs_from_the_membership_history(decided, tmp_path, capsys):
    # The issue: a certificate verifies offline from the genesis and membership history
    # alone. Epoch 1 exists once node 3's eviction is decided: a placement certificate of
    # epoch 1 (a job naming epoch 1, SPEC.md P2) needs that history to be checked.
    from meshnode.node.store import NodeStore
    from protocol.flows.epoch_change import epoch_change_instance_id
    from protocol.messages import Eviction
    from protocol.ready import PersistRecord
    genesis, net = decided
    mesh, ids = genesis.mesh_id, net.ids

    def certificate(iid, epoch, kind, value, signers):
        votes = tuple(encode_message(i, mesh, Precommit(iid, 0, epoch, value_hash(value))) for i in signers)
        return encode_message(ids[0], mesh, CommitCertificate(iid, 0, epoch, kind, value, votes))

    eviction = codec.pack(Eviction(node=ids[3].public_key, epoch=0, migrations=()).to_body())
    history = certificate(epoch_change_instance_id(0), 0, "eviction", eviction, ids[:3])
    iid, value = placement_of_a_job(mesh, 1)
    placed = certificate(iid, 1, "placement", value, ids[:3])
    files = {"genesis.bin": genesis.encode(), "placed.cert": placed, "evicted.cert": history,
             "forged.cert": certificate(epoch_change_instance_id(0), 0, "eviction", eviction, ids[:2])}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)

    def verify(*extra):
        code = main(["cert", "verify", str(tmp_path / "placed.cert"), "--genesis", str(tmp_path / "genesis.bin"),
                     "--json", *extra])
        return code, json.loads(capsys.readouterr().out)

    code, result = verify()
    assert code == 2 and "reaches epoch 0" in result["reason"]
    code, result = verify("--history", str(tmp_path / "evicted.cert"))
    assert code == 0 and (result["epoch"], result["stake"], result["total_stake"]) == (1, 3, 3)
    code, result = verify("--history", str(tmp_path / "forged.cert"))   # 2 of 4: no quorum of epoch 0
    assert code == 2 and "2/3" in result["reason"]
    code, result = verify("--history", str(tmp_path / "forged.cert"), str(tmp_path / "evicted.cert"))
    assert code == 0 and result["epoch"] == 1                          # a bad one first shuts out nothing
    node_dir = tmp_path / "node #1?"   # the read-only URI must not cut the path short
    node_dir.mkdir()
    store = NodeStore(node_dir / "node.sqlite")
    store.apply([PersistRecord("certificates", epoch_change_instance_id(0).hex(), {
        "instance": epoch_change_instance_id(0), "value_kind": "eviction", "round": 0, "certificate": history})])
    store.close()
    code, result = verify("--node", str(node_dir))
    assert code == 0 and result["epoch"] == 1
    (tmp_path / "garbage.cert").write_bytes(b"\x93not a certificate")
    code, result = verify("--history", str(tmp_path / "garbage.cert"))
    assert code == 2 and not result["valid"]
    code = main(["cert", "verify", str(tmp_path / "placed.cert"), "--genesis", str(tmp_path / "genesis.bin"),
                 "--node", str(tmp_path / "nowhere")])
    assert code != 0 and "no node store" in capsys.readouterr().err


def test_next_epoch_view_follows_evictions_and_joins_of_its_own_epoch_only():
    from protocol.certificate import next_epoch_view
    from protocol.messages import Eviction, MembershipChange
    keys = [i.public_key for i in identities(5)]
    view = EpochView(3, {k: 10 for k in keys[:4]})
    evicted = next_epoch_view(view, "eviction", Eviction(node=keys[3], epoch=3, migrations=()))
    assert (evicted.epoch, dict(evicted.stakes)) == (4, {k: 10 for k in keys[:3]})
    joiner = Member(keys[4], 30, "zone-b", (), ())
    joined = next_epoch_view(view, "membership", MembershipChange("join", joiner, 4, ()))
    assert (joined.epoch, joined.stakes[keys[4]], joined.total_stake) == (4, 30, 70)
    assert next_epoch_view(view, "eviction", Eviction(node=keys[4], epoch=3, migrations=())) is None  # no member
    assert next_epoch_view(view, "eviction", Eviction(node=keys[0], epoch=2, migrations=())) is None   # old epoch
    assert next_epoch_view(view, "membership", MembershipChange("join", joiner, 5, ())) is None      # skips one
