"""SPEC.md is checked against the code: generated tables, and every hex vector byte for byte (4.4, 5.4)."""

import hashlib
import json
import pathlib
import re

import pytest

from keys.identity import SigningIdentity
from keys.keystore import PassphraseSource, encode_keystore, KdfLimits, load_identity
from protocol import codec
from protocol.envelope import PROTOCOL_VERSION, SIGNATURE_DOMAIN, seal, signing_input
from protocol.messages import MESSAGE_TYPES, decode_message
from testnet import spec_tables

SPEC = (pathlib.Path(__file__).resolve().parent.parent / "SPEC.md").read_text(encoding="utf-8")


def parse_vector_blocks(text: str) -> list[dict[str, str]]:
    """Every fenced block of `name: hex` lines in the test-vector section."""
    section = spec_tables.generated_block(text, "test vectors")
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.S)
    return [dict(line.split(": ", 1) for line in block.strip().splitlines()) for block in blocks]


HEADER, *VECTORS = parse_vector_blocks(SPEC)


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
    assert identity.public_key.hex() == HEADER["public_key"]
    assert HEADER["mesh_id"] == spec_tables.VECTOR_MESH_ID.hex()


def test_kind_index_lists_every_kind():
    index = SPEC.split("### 4.1", 1)[1].split("Cross-field rules", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+)`(?:, `([a-z_]+)`)? \|", index, flags=re.M))
    assert {k for pair in listed for k in pair if k} == set(MESSAGE_TYPES)


def test_one_vector_per_kind():
    assert sorted(v["kind"] for v in VECTORS) == sorted(MESSAGE_TYPES)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["kind"] for v in VECTORS])
def test_vector_signs_and_decodes_byte_for_byte(vector):
    identity = SigningIdentity(bytes.fromhex(HEADER["seed"]))
    mesh_id = bytes.fromhex(HEADER["mesh_id"])
    body_bytes = bytes.fromhex(vector["body"])
    body = codec.unpack(body_bytes)
    assert codec.pack(body) == body_bytes
    signing = signing_input(PROTOCOL_VERSION, mesh_id, vector["kind"], body)
    assert signing.hex() == vector["signing_input"]
    assert signing.startswith(SIGNATURE_DOMAIN)
    assert identity.sign(signing).hex() == vector["signature"]
    assert seal(identity, mesh_id, vector["kind"], body).encode().hex() == vector["envelope"]
    envelope, message = decode_message(bytes.fromhex(vector["envelope"]), mesh_id)
    assert envelope.signer == identity.public_key and envelope.kind == vector["kind"]
    assert codec.pack(message.to_body()) == body_bytes


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
        else:
            epoch, slot = int(values["epoch"]), int(values["slot"])
            expected = hashlib.sha256(b"slot" + epoch.to_bytes(8, "big") + (slot % (1 << 64)).to_bytes(8, "big"))
            expected = expected.digest()
        assert hex_id == expected.hex(), name
