"""SPEC.md is checked against the code: generated tables, and every hex vector byte for byte
(2.1, 3.1, 4.1, 4.4, 5.2, 5.4, 6.4, 6.7, F4), both with the node's own functions and, for
the derived ids, with nothing but hashlib and the formulas SPEC.md states."""

import hashlib
import json
import pathlib
import re

import base58
import pytest

from keys.genesis import Genesis
from keys.identity import SigningIdentity
from keys.keystore import PassphraseSource, encode_keystore, KdfLimits, load_identity
from meshnode.cli import main as cli_main
from meshnode.workload.manifest import verify_signed_job
from protocol import codec
from protocol.certificate import decode_prevote_certificate, verify_commit_certificate
from protocol.consensus.checks import proof_of_lock_error, reported_lock
from protocol.envelope import (CHANNEL_AUTHENTICATED_KINDS, PROTOCOL_VERSION, SIGNATURE_DOMAIN, seal, seal_unsigned,
                               signing_input)
from protocol.errors import RemoteProtocolError
from protocol.flows.binding import certificate_binding_error
from protocol.flows.epoch_change import epoch_change_instance_id
from protocol.messages import (ENVELOPE, MESSAGE_TYPES, GangReplacement, GangResize, JobManifest, decode_message, decode_value,
                               job_id, value_hash)
from protocol.placement import parse_bid
from protocol.quorum import EpochView
from protocol.schema import List, Nested, Optional
from protocol.signing import peer_id_from_public_key
from testnet import spec_tables

SPEC = (pathlib.Path(__file__).resolve().parent.parent / "SPEC.md").read_text(encoding="utf-8")


def parse_vector_blocks(text: str) -> list[dict[str, str]]:
    """Every fenced block of `name: hex` lines in the test-vector section."""
    section = spec_tables.generated_block(text, "test vectors")
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.S)
    return [dict(line.split(": ", 1) for line in block.strip().splitlines()) for block in blocks]


HEADER, *VECTORS = parse_vector_blocks(SPEC)
BY_KIND = {v["kind"]: v for v in VECTORS}
DERIVED = dict(line.split(": ", 1)
               for line in spec_tables.generated_block(SPEC, "derived ids").strip("`\n").splitlines())
MESH_ID = bytes.fromhex(HEADER["mesh_id"])
GENESIS = Genesis.decode(bytes.fromhex(DERIVED["genesis"]))


def opened(kind: str):
    """The (envelope, message) of the SPEC.md vector of ``kind``, decoded by the node's code."""
    # A channel-authenticated kind (2.2) as delivered by its signer's own channel.
    return decode_message(bytes.fromhex(BY_KIND[kind]["envelope"]), MESH_ID, channel_sender=bytes.fromhex(
        HEADER["public_key"]))


@pytest.mark.parametrize("name", list(spec_tables.GENERATED))
def test_generated_blocks_match_code(name):
    """Fails when a SCHEMA (or the signing) changed and SPEC.md was not regenerated."""
    assert spec_tables.generated_block(SPEC, name) == spec_tables.GENERATED[name](), (
        "SPEC.md is stale: run python -m testnet.spec_tables --write SPEC.md")


def test_spec_names_the_signature_domain():
    assert SIGNATURE_DOMAIN.hex() in SPEC
    assert len(SIGNATURE_DOMAIN) == 16


def test_vector_key_and_mesh():
    identity = SigningIdentity(bytes.fromhex(HEADER["seed"]))
    assert HEADER["seed"] == bytes(range(32)).hex()
    assert identity.public_key.hex() == HEADER["public_key"] == DERIVED["public_key"]
    assert HEADER["mesh_id"] == DERIVED["mesh_id"] == GENESIS.mesh_id.hex()
    assert [m.public_key for m in GENESIS.members] == [identity.public_key]


def test_kind_index_lists_every_kind():
    index = SPEC.split("### 4.1", 1)[1].split("Cross-field rules", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+)`(?:, `([a-z_]+)`)? \|", index, flags=re.M))
    assert {k for pair in listed for k in pair if k} == set(MESSAGE_TYPES)


def test_one_vector_per_kind():
    assert sorted(v["kind"] for v in VECTORS) == sorted(MESSAGE_TYPES)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["kind"] for v in VECTORS])
def test_vector_signs_and_decodes_byte_for_byte(vector):
    identity = SigningIdentity(bytes.fromhex(HEADER["seed"]))
    body_bytes = bytes.fromhex(vector["body"])
    body = codec.unpack(body_bytes)
    assert codec.pack(body) == body_bytes
    if vector["kind"] in CHANNEL_AUTHENTICATED_KINDS:
        check_channel_authenticated_vector(identity, vector, body)
        return
    signing = signing_input(PROTOCOL_VERSION, MESH_ID, vector["kind"], body)
    assert signing.hex() == vector["signing_input"]
    assert signing.startswith(SIGNATURE_DOMAIN)
    assert identity.sign(signing).hex() == vector["signature"]
    assert seal(identity, MESH_ID, vector["kind"], body).encode().hex() == vector["envelope"]
    envelope, message = decode_message(bytes.fromhex(vector["envelope"]), MESH_ID)
    assert envelope.signer == identity.public_key and envelope.kind == vector["kind"]
    assert codec.pack(message.to_body()) == body_bytes


def check_channel_authenticated_vector(identity, vector, body) -> None:
    """2.2, F1: an empty signature; accepted only from the peer the channel authenticated
    as its signer; a signed one is refused."""
    data = bytes.fromhex(vector["envelope"])
    assert seal_unsigned(identity.public_key, MESH_ID, vector["kind"], body).encode() == data
    assert data.endswith(identity.public_key + b"\xc4\x00")
    envelope, message = decode_message(data, MESH_ID, channel_sender=identity.public_key)
    assert envelope.signer == identity.public_key and envelope.signature == b""
    assert codec.pack(message.to_body()) == bytes.fromhex(vector["body"])
    other = SigningIdentity(bytes(32)).public_key
    for sender in (None, other):
        with pytest.raises(RemoteProtocolError):
            decode_message(data, MESH_ID, channel_sender=sender)
    signed = seal(identity, MESH_ID, vector["kind"], body).encode()
    with pytest.raises(RemoteProtocolError):
        decode_message(signed, MESH_ID, channel_sender=identity.public_key)


def test_vectors_keep_the_cross_field_rules_of_4_1():
    """The job vector once had an owner that was not its signer: every node dropped it."""
    envelope, job = verify_signed_job(bytes.fromhex(BY_KIND["job"]["envelope"]), MESH_ID)
    assert job.owner == envelope.signer
    envelope, join = opened("join")
    assert join.member.public_key == envelope.signer
    envelope, cap = opened("cap")
    assert cap.node == envelope.signer
    for kind in ("proposal", "commit"):
        _envelope, message = opened(kind)
        decode_value(message.value_kind, message.value)


# --- nested envelopes (3.1) ----------------------------------------------------------------

def spec_nested_table() -> dict[tuple[str, str], set[str]]:
    """(record as SPEC.md names it, field) -> the kinds SPEC.md 3.1 says it holds."""
    rows = re.findall(r"^\| (\S+) `([a-z_]+)` \| ([^|]+) \|", spec_tables.generated_block(SPEC, "nested envelopes"),
                      flags=re.M)
    return {(record.strip("`"), field): set(re.findall(r"`([a-z_]+)`", kinds)) for record, field, kinds in rows}


def envelope_fields(cls):
    """The fields of ``cls`` that hold envelopes, by its SCHEMA (the code, not the generator's
    table): typed with the ENVELOPE object itself. (A proposal's ``value`` has an equal
    ``Bytes`` type but holds an unsigned record, 4.1.)"""
    for name, ftype in cls.SCHEMA.items():
        inner = ftype.inner if isinstance(ftype, Optional) else ftype.item if isinstance(ftype, List) else ftype
        if inner is ENVELOPE:
            yield name


def all_records():
    seen, todo = [], list(MESSAGE_TYPES.values()) + list(spec_tables.NESTED_RECORDS)
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            for ftype in cls.SCHEMA.values():
                inner = ftype.item if isinstance(ftype, List) else ftype
                if isinstance(inner, Nested):
                    todo.append(inner.cls)
    return seen


def spec_name(cls) -> str:
    return getattr(cls, "KIND", None) or cls.__name__


def test_every_envelope_field_of_the_code_is_in_spec_3_1():
    table = spec_nested_table()
    in_code = {(spec_name(cls), name) for cls in all_records() for name in envelope_fields(cls)}
    assert in_code == set(table)
    assert all(kinds and kinds <= set(MESSAGE_TYPES) for kinds in table.values())


def nested_kinds_seen(message, seen: list) -> None:
    """Open every nested envelope of ``message`` (and theirs), recording (record, field, kind)."""
    for name in envelope_fields(type(message)):
        value = getattr(message, name)
        for data in value if isinstance(value, tuple) else () if value is None else (value,):
            envelope, inner = decode_message(data, MESH_ID)
            seen.append((spec_name(type(message)), name, envelope.kind))
            nested_kinds_seen(inner, seen)
    for name, ftype in type(message).SCHEMA.items():
        inner_type = ftype.item if isinstance(ftype, List) else ftype
        if isinstance(inner_type, Nested):
            value = getattr(message, name)
            for item in value if isinstance(value, tuple) else (value,):
                nested_kinds_seen(item, seen)
    if getattr(type(message), "KIND", None) in ("proposal", "commit"):
        nested_kinds_seen(decode_value(message.value_kind, message.value), seen)


def test_nested_samples_are_the_kind_their_field_holds():
    table = spec_nested_table()
    seen = []
    for kind in MESSAGE_TYPES:
        nested_kinds_seen(opened(kind)[1], seen)
    nested_kinds_seen(decode_value("job_move", bytes.fromhex(move_vectors()["job_move_value"])), seen)   # R2
    nested_kinds_seen(spec_tables.sample_preemption(), seen)   # the value of P8e's vector
    nested_kinds_seen(decode_value("replica_action", bytes.fromhex(replica_vectors()["replica_action_value"])),
                      seen)   # R4
    nested_kinds_seen(GangReplacement.from_body(spec_tables.sample_body(GangReplacement)), seen)   # GA7's value
    nested_kinds_seen(GangResize.from_body(spec_tables.sample_body(GangResize)), seen)   # GA9's value
    for record, field, kind in seen:
        assert kind in table[(record, field)], (record, field, kind)
    # Every documented field is exercised by some vector, apart from MembershipChange's
    # evidence (no sample value is a membership change; its join twin is covered) and
    # GangPlacement's job (no sample value is a gang placement; Placement's job is covered).
    assert {(r, f) for r, f, _ in seen} == set(table) - {("MembershipChange", "evidence"), ("GangPlacement", "job")}


# --- the samples verify with the node's own checks (6.3, 6.5, 6.7, P4b) ---------------------

def test_consensus_vectors_verify_as_one_placement_of_the_job():
    view = EpochView.from_genesis(GENESIS)
    _envelope, job = verify_signed_job(bytes.fromhex(BY_KIND["job"]["envelope"]), MESH_ID)
    jid = job_id(job)
    commit_bytes = bytes.fromhex(BY_KIND["commit"]["envelope"])
    cert, value = verify_commit_certificate(commit_bytes, MESH_ID, view)
    assert cert.instance == jid
    assert certificate_binding_error(cert.value_kind, cert.instance, value, cert.epoch, MESH_ID,
                                     GENESIS.params.placement_slot_ms) is None
    assert value_hash(value).hex() == DERIVED["value_hash"]
    _envelope, prevote_cert = decode_prevote_certificate(bytes.fromhex(BY_KIND["prevote_cert"]["envelope"]),
                                                         MESH_ID, view)
    assert prevote_cert.value_hash == value_hash(value)
    _envelope, proposal = opened("proposal")
    assert proposal.value == value
    assert proof_of_lock_error(proposal, value_hash(value), instance_id=jid, view=view, mesh_id=MESH_ID) is None
    _envelope, change = opened("round_change")
    lock = reported_lock(change, instance_id=jid, view=view, mesh_id=MESH_ID, value_kinds=("placement",))
    assert lock.value == value
    for bid in (bytes.fromhex(BY_KIND["bid"]["envelope"]), *proposal.justification):
        facts = parse_bid(bid, MESH_ID, jid, job.epoch, view.stakes, GENESIS.authorities)
        assert dict(facts.attested) == {"jurisdiction": "eu"}


def test_commit_vector_passes_cert_verify(tmp_path, capsys):
    (tmp_path / "genesis.bin").write_bytes(bytes.fromhex(DERIVED["genesis"]))
    (tmp_path / "commit.cert").write_bytes(bytes.fromhex(BY_KIND["commit"]["envelope"]))
    assert cli_main(["cert", "verify", str(tmp_path / "commit.cert"), "--genesis", str(tmp_path / "genesis.bin"),
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] is True


# --- derived ids: from SPEC.md's formulas with hashlib alone, and from the code ---------------

def test_derived_ids_follow_their_formulas():
    genesis = bytes.fromhex(DERIVED["genesis"])
    assert DERIVED["mesh_id"] == hashlib.sha256(b"meshnode/v1/genesis\x00" + genesis).hexdigest()
    assert DERIVED["mesh_id"] == Genesis.decode(genesis).mesh_id.hex()
    job_body = bytes.fromhex(DERIVED["job_body"])
    assert DERIVED["job_body"] == BY_KIND["job"]["body"]
    assert DERIVED["job_id"] == hashlib.sha256(job_body).hexdigest()
    assert DERIVED["job_id"] == job_id(JobManifest.from_body(codec.unpack(job_body))).hex()
    value = bytes.fromhex(DERIVED["value"])
    assert value == opened("commit")[1].value == opened("proposal")[1].value
    assert DERIVED["value_hash"] == hashlib.sha256(b"meshnode/v1/value\x00" + value).hexdigest()
    assert DERIVED["value_hash"] == value_hash(value).hex()
    key = bytes.fromhex(DERIVED["public_key"])
    assert DERIVED["peer_id_bytes"] == (bytes.fromhex("0024080112" "20") + key).hex()
    assert DERIVED["peer_id"] == base58.b58encode(bytes.fromhex(DERIVED["peer_id_bytes"])).decode()
    assert DERIVED["peer_id"] == peer_id_from_public_key(key) and DERIVED["peer_id"].startswith("12D3KooW")
    changes = {int(name.split("=")[1]): hex_id for name, hex_id in DERIVED.items() if name.startswith("epoch_change")}
    assert changes
    for epoch, hex_id in changes.items():
        assert hex_id == hashlib.sha256(b"epoch-change" + epoch.to_bytes(8, "big")).hexdigest()
        assert hex_id == epoch_change_instance_id(epoch).hex()


def test_integer_examples_of_2_1_are_the_codecs():
    """2.1's shortest-form examples: the codec writes the first form and refuses the other."""
    section = " ".join(SPEC.split("### 2.1", 1)[1].split("### 2.2", 1)[0].split())
    examples = re.findall(r"(-?\d+(?:\^\d+)?) is `([0-9a-f ]+)`(?: \(never `([0-9a-f ]+)`\))?", section)
    assert len(examples) >= 4
    for number, canonical, never in examples:
        base, _, power = number.partition("^")
        value = int(base) ** int(power) if power else int(base)
        assert codec.pack(value).hex() == canonical.replace(" ", ""), number
        assert codec.unpack(bytes.fromhex(canonical.replace(" ", ""))) == value
        if never:
            with pytest.raises(RemoteProtocolError):
                codec.unpack(bytes.fromhex(never.replace(" ", "")))


def test_keystore_vector_opens_and_reencodes(tmp_path):
    section = spec_tables.generated_block(SPEC, "keystore vector")
    passphrase = re.search(r"passphrase \(UTF-8\): `([^`]*)`", section).group(1).encode("utf-8")
    document_text = re.search(r"```json\n(.*?)```", section, flags=re.S).group(1)
    document = json.loads(document_text)
    path = tmp_path / "vector.json"
    path.write_text(document_text)
    path.chmod(0o600)
    identity = load_identity(path, PassphraseSource.literal(passphrase))
    assert identity.seed == bytes(range(32))
    kdf = document["kdf"]
    again = encode_keystore(identity, passphrase, KdfLimits(kdf["opslimit"], kdf["memlimit"]),
                            salt=bytes.fromhex(kdf["salt"]), nonce=bytes.fromhex(document["nonce"]))
    assert again.decode() == document_text


def move_vectors() -> dict:
    block = spec_tables.generated_block(SPEC, "move vectors").strip("`\n")
    return dict(line.split(": ", 1) for line in block.splitlines())


def test_move_vectors_of_r2_follow_the_formulas_and_hang_together():
    """R2's instance id from the formula with hashlib alone; the JobMove value decodes, its
    request is the owner's for that job and fence, and its hash is 6.4's."""
    vectors = move_vectors()
    jid, fence = bytes.fromhex(vectors["job_id"]), int(vectors["fence"])
    assert jid.hex() == DERIVED["job_id"]
    instance = hashlib.sha256(b"job-move" + jid + fence.to_bytes(8, "big")).digest()
    assert vectors["move_instance"] == instance.hex()
    value = bytes.fromhex(vectors["job_move_value"])
    expected_hash = hashlib.sha256(b"meshnode/v1/value\x00" + value).hexdigest()
    assert vectors["value_hash"] == expected_hash == value_hash(value).hex()
    move = decode_value("job_move", value)
    envelope, request = decode_message(move.request, MESH_ID)
    assert (request.job_id, request.fence, request.to_node) == (jid, fence, b"")
    assert envelope.signer == opened("job")[1].owner


def replica_vectors() -> dict:
    block = spec_tables.generated_block(SPEC, "replica vectors").strip("`\n")
    return dict(line.split(": ", 1) for line in block.splitlines())


def test_replica_vectors_of_r4_follow_the_formulas_and_hang_together():
    """R4c's instance id and R4d's ledger key from the formulas with hashlib alone; the
    ReplicaAction value decodes (a fill: no trigger) and its hash is 6.4's."""
    vectors = replica_vectors()
    jid, seq, anchor = bytes.fromhex(vectors["job_id"]), int(vectors["seq"]), int(vectors["anchor"])
    assert jid.hex() == DERIVED["job_id"]
    instance = hashlib.sha256(b"replica-action" + jid + seq.to_bytes(8, "big") + anchor.to_bytes(8, "big"))
    assert vectors["replica_instance"] == instance.hexdigest()
    key = hashlib.sha256(b"replica" + jid + (1).to_bytes(2, "big")).hexdigest()
    assert vectors["replica_key index=1"] == key
    value = bytes.fromhex(vectors["replica_action_value"])
    assert vectors["value_hash"] == hashlib.sha256(b"meshnode/v1/value\x00" + value).hexdigest()
    action = decode_value("replica_action", value)
    assert (action.job_id, action.seq, action.anchor, action.trigger) == (jid, seq, anchor, b"")
    assert len(action.nodes) == len(action.capabilities) == 1 and (action.replicas, action.weights) == ((), ())
    assert decode_message(action.capabilities[0], MESH_ID)[1].node == action.nodes[0]
    # R4h: a replica's end names its ledger key; its replacement's anchor is 2^48 + the index.
    envelope, end = decode_message(bytes.fromhex(vectors["replica_end"]), MESH_ID)
    assert (envelope.kind, end.job_id.hex(), end.fence, end.exit_code) == ("job_exit", key, 1, 137)
    replacement = hashlib.sha256(b"replica-action" + jid + (0).to_bytes(8, "big") + (2 ** 48 + 1).to_bytes(8, "big"))
    assert vectors["replacement_instance seq=0 replica=1"] == replacement.hexdigest()


def test_instance_id_vectors_follow_the_formulas_of_p2_and_p7():
    """Recomputed from SPEC's formulas with hashlib alone, not with the code that printed them."""
    block = spec_tables.generated_block(SPEC, "instance ids").strip("`\n")
    lines = dict(line.split(": ", 1) for line in block.splitlines())
    jid = bytes.fromhex(lines.pop("job_id"))
    assert lines
    for name, hex_id in lines.items():
        kind, *params = name.split(" ")
        values = dict(p.split("=") for p in params)
        if kind == "retry_instance":
            expected = hashlib.sha256(b"retry" + jid + int(values["attempt"]).to_bytes(2, "big")).digest()
        elif kind == "preemption_instance":   # P8a: of the attempt's placement instance
            attempt = int(values["attempt"])
            placement = jid if attempt == 0 else hashlib.sha256(b"retry" + jid + attempt.to_bytes(2, "big")).digest()
            expected = hashlib.sha256(b"preempt" + placement).digest()
        else:
            epoch, slot = int(values["epoch"]), int(values["slot"])
            expected = hashlib.sha256(b"slot" + epoch.to_bytes(8, "big") + (slot % (1 << 64)).to_bytes(8, "big"))
            expected = expected.digest()
        assert hex_id == expected.hex(), name


def test_subscribe_vector_of_10_6_is_the_clients_frame():
    from meshnode.control.server import subscribed_kinds
    from meshnode.control.wire import encode_frame
    vector = bytes.fromhex(re.search(r"subscribe request frame: ([0-9a-f]+)", SPEC).group(1))
    request = {"id": 1, "op": "subscribe", "args": {"kinds": ["decided", "placed"]}}
    assert encode_frame(request) == vector
    assert codec.unpack(vector[4:]) == request and int.from_bytes(vector[:4], "big") == len(vector) - 4
    assert subscribed_kinds(request["args"]) == {"decided", "placed"}


def test_dial_order_vector_of_8_1_names_the_lower_key():
    from meshnode.net.transport import dials_first
    section = SPEC[SPEC.index("#### 8.1 Dial order"):]
    first, second = re.search(r"are `([0-9a-f]{64})`\s+and `([0-9a-f]{64})`", section).groups()
    assert SigningIdentity(bytes([1]) * 32).public_key.hex() == first
    assert SigningIdentity(bytes([2]) * 32).public_key.hex() == second
    assert "the second dials\n  first" in section
    assert dials_first(bytes.fromhex(second), bytes.fromhex(first))
    assert not dials_first(bytes.fromhex(first), bytes.fromhex(second))
