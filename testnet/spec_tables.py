"""Generate SPEC.md's field tables and hex test vectors from the code.

The tables are rendered from each record's SCHEMA and the vectors by signing one
deterministic sample of every message kind with a fixed seed, so SPEC.md can be
regenerated instead of hand-edited, and tests/test_spec_vectors.py fails when the
two drift apart.

    python -m testnet.spec_tables --write SPEC.md   # regenerate the generated blocks
    python -m testnet.spec_tables --check SPEC.md   # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import hashlib
import sys

from keys.genesis import Genesis, ProtocolParams
from keys.identity import SigningIdentity
from keys.keystore import KDF_PROFILES, encode_keystore
from protocol import codec
from protocol.envelope import PROTOCOL_VERSION, seal, signing_input
from protocol.messages import (ENVELOPE, MESSAGE_TYPES, Checkpoint, Constraints, GpuState, Member, OutputFile, RunningJob,
                               MembershipChange, Migration, Placement, PlacementSlot, Resources,
                               placement_instance_id, placement_slot_id)
from protocol.schema import Bool, Bytes, Int, List, Nested, Optional, Record, Text, TextMap

VECTOR_SEED = bytes(range(32))
VECTOR_MESH_ID = hashlib.sha256(b"meshnode/v1/test-vector-mesh").digest()
# Records that appear only nested in messages or as decided values / genesis parts.
NESTED_RECORDS = (GpuState, RunningJob, Resources, Constraints, Placement, PlacementSlot, Migration, Member,
                  MembershipChange, ProtocolParams, Genesis, OutputFile)

BEGIN = "<!-- BEGIN GENERATED: %s (python -m testnet.spec_tables --write SPEC.md) -->"
END = "<!-- END GENERATED: %s -->"


def vector_identity() -> SigningIdentity:
    return SigningIdentity(VECTOR_SEED)


# --- deterministic sample values -------------------------------------------------------------

def _sample_envelope() -> bytes:
    """The nested envelope every ENVELOPE field of a sample carries: a signed heartbeat."""
    return seal(vector_identity(), VECTOR_MESH_ID, "heartbeat",
                {"epoch": 1, "seq": 1, "sent_ms": 1_700_000_000_000}).encode()


def sample_value(ftype, field: str):
    """A small, valid, readable value of ``ftype`` (wire form, ready for from_body)."""
    if isinstance(ftype, Optional):
        return sample_value(ftype.inner, field)
    if isinstance(ftype, Int):
        wanted = 1_700_000_000_000 if field.endswith("_ms") else 1
        return min(ftype.high, max(ftype.low, wanted))
    if isinstance(ftype, Bool):
        return False
    if ftype == ENVELOPE:
        return _sample_envelope()
    if isinstance(ftype, Bytes):
        if ftype.min_len == ftype.max_len:
            return hashlib.sha256(field.encode("ascii")).digest()[:ftype.min_len]
        return b"\x01\x02\x03"
    if isinstance(ftype, Text):
        return ftype.choices[0] if ftype.choices else ("zone-a" if ftype.min_len else "")
    if isinstance(ftype, TextMap):
        return {"jurisdiction": "eu"}
    if isinstance(ftype, List):
        return [sample_value(ftype.item, field)]
    if isinstance(ftype, Nested):
        return sample_body(ftype.cls)
    raise TypeError("no sample for %r" % (ftype,))


def sample_body(cls) -> dict:
    body = {name: sample_value(ftype, name) for name, ftype in cls.SCHEMA.items()}
    if cls is Checkpoint:
        body["state_hash"] = hashlib.sha256(body["state"]).digest()
    if "value" in body and "value_kind" in body:  # a proposal/commit carries a real Placement
        body["value"] = codec.pack(sample_body(Placement))
    return body


def sample_message(kind: str) -> Record:
    cls = MESSAGE_TYPES[kind]
    return cls.from_body(sample_body(cls))


# --- rendering -------------------------------------------------------------------------------

def render_field_tables() -> str:
    out = []
    for title, cls in [*((k, c) for k, c in MESSAGE_TYPES.items()),
                       *((None, c) for c in NESTED_RECORDS)]:
        heading = "kind `%s`: %s" % (title, cls.__name__) if title else "record %s" % cls.__name__
        out.append("#### %s\n\n| field | type and limits |\n| --- | --- |" % heading)
        out.extend("| `%s` | %s |" % (name, ftype.describe()) for name, ftype in cls.SCHEMA.items())
        out.append("")
    return "\n".join(out).rstrip("\n")


def vector_for(kind: str) -> dict[str, str]:
    identity = vector_identity()
    body = sample_message(kind).to_body()
    envelope = seal(identity, VECTOR_MESH_ID, kind, body)
    return {
        "kind": kind,
        "body": codec.pack(body).hex(),
        "signing_input": signing_input(PROTOCOL_VERSION, VECTOR_MESH_ID, kind, body).hex(),
        "signature": envelope.signature.hex(),
        "envelope": envelope.encode().hex(),
    }


def render_vectors() -> str:
    identity = vector_identity()
    lines = ["```", "seed: %s" % VECTOR_SEED.hex(), "public_key: %s" % identity.public_key.hex(),
             "mesh_id: %s" % VECTOR_MESH_ID.hex(), "```", ""]
    for kind in MESSAGE_TYPES:
        lines.append("```")
        lines.extend("%s: %s" % item for item in vector_for(kind).items())
        lines.extend(["```", ""])
    return "\n".join(lines).rstrip("\n")


VECTOR_JOB_ID = bytes(range(32))
# (epoch, slot) pairs of the slot instance id vectors: a typical one and a negative slot.
VECTOR_SLOTS = ((0, 34_000_000_000), (3, -1))


def render_instance_ids() -> str:
    """Placement instance ids derived from a job id (P2) and from a slot (P7)."""
    lines = ["```", "job_id: %s" % VECTOR_JOB_ID.hex()]
    for attempt in (1, 2):
        lines.append("retry_instance attempt=%d: %s" % (attempt, placement_instance_id(VECTOR_JOB_ID, attempt).hex()))
    for epoch, slot in VECTOR_SLOTS:
        lines.append("slot_instance epoch=%d slot=%d: %s" % (epoch, slot, placement_slot_id(epoch, slot).hex()))
    lines.append("```")
    return "\n".join(lines)


VECTOR_PASSPHRASE = b"meshnode test vector"
VECTOR_SALT = bytes(range(16))
VECTOR_NONCE = bytes(range(24))


def render_keystore_vector() -> str:
    """A keystore for VECTOR_SEED, with fixed salt and nonce and the cheapest KDF limits."""
    document = encode_keystore(vector_identity(), VECTOR_PASSPHRASE, KDF_PROFILES["insecure-test"],
                               salt=VECTOR_SALT, nonce=VECTOR_NONCE)
    return "passphrase (UTF-8): `%s`\n\n```json\n%s```" % (VECTOR_PASSPHRASE.decode(), document.decode())


GENERATED = {"field tables": render_field_tables, "test vectors": render_vectors,
             "instance ids": render_instance_ids, "keystore vector": render_keystore_vector}


def generated_block(text: str, name: str) -> str:
    """The text between the markers of block ``name`` in SPEC.md."""
    begin, end = BEGIN % name, END % name
    if begin not in text or end not in text:
        raise ValueError("SPEC.md has no generated block %r" % name)
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def regenerate(text: str) -> str:
    for name, render in GENERATED.items():
        generated_block(text, name)  # both markers present
        head, rest = text.split(BEGIN % name, 1)
        tail = rest.split(END % name, 1)[1]
        text = head + BEGIN % name + "\n" + render() + "\n" + END % name + tail
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="SPEC")
    mode.add_argument("--check", metavar="SPEC")
    args = parser.parse_args(argv)
    path = args.write or args.check
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    fresh = regenerate(text)
    if args.check:
        if fresh != text:
            print("%s: generated blocks are stale; run python -m testnet.spec_tables --write %s" % (path, path))
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
