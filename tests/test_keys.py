"""Keystores (SPEC.md 5.4), peer IDs (1.2) and attestations (5.3)."""

import io
import json
import os
import stat

import pytest

from keys.attestation import attested_attributes, issue_attestation, verify_attestation
from keys.identity import SigningIdentity, public_key_from_peer_id
from keys.keystore import (KDF_PROFILES, PassphraseSource, create_keystore, load_identity, read_public_key,
                           write_file_atomic)
from keys.errors import KeystoreError
from protocol.envelope import ANY_MESH
from protocol.errors import RemoteProtocolError
from protocol.messages import decode_message

FAST_KDF = KDF_PROFILES["insecure-test"]
SEED = bytes(range(32))
PASS = PassphraseSource.literal("correct horse")


@pytest.fixture
def keystore(tmp_path):
    path = tmp_path / "node.key"
    create_keystore(path, SigningIdentity(SEED), PASS, limits=FAST_KDF)
    return path


@pytest.mark.parametrize("seed", [bytes(32), SEED, bytes(range(100, 132))])
def test_peer_id_equals_libp2p(seed):
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    key_pair = create_new_key_pair(seed)
    identity = SigningIdentity(seed)
    assert key_pair.public_key.to_bytes() == identity.public_key
    assert identity.peer_id == ID.from_pubkey(key_pair.public_key).to_base58()
    assert public_key_from_peer_id(identity.peer_id) == identity.public_key


def test_keystore_round_trip_mode_and_clear_public_key(keystore):
    assert stat.S_IMODE(os.stat(keystore).st_mode) == 0o600
    document = json.loads(keystore.read_text())
    assert document["format"] == "meshnode-keystore" and document["version"] == 1
    assert SEED.hex() not in keystore.read_text()  # the seed is not stored in clear
    assert read_public_key(keystore) == SigningIdentity(SEED).public_key
    assert load_identity(keystore, PASS).seed == SEED
    assert document["kdf"]["opslimit"] == FAST_KDF.opslimit  # limits recorded in the file


def test_wrong_passphrase(keystore):
    with pytest.raises(KeystoreError, match="wrong passphrase"):
        load_identity(keystore, PassphraseSource.literal("battery staple"))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_group_or_world_readable_refused_with_chmod_hint(keystore, mode):
    keystore.chmod(mode)
    with pytest.raises(KeystoreError, match="chmod 600"):
        load_identity(keystore, PASS)


def test_missing_file(tmp_path):
    with pytest.raises(KeystoreError, match="does not exist"):
        load_identity(tmp_path / "nope.key", PASS)


def test_truncated_file(keystore):
    keystore.write_bytes(keystore.read_bytes()[:50])
    with pytest.raises(KeystoreError, match="not valid JSON"):
        load_identity(keystore, PASS)


@pytest.mark.parametrize("field,value,match", [
    ("ciphertext", "00" * 48, "wrong passphrase"),      # altered ciphertext fails authentication
    ("nonce", "zz", "nonce"),
    ("public_key", SigningIdentity(bytes(32)).public_key.hex(), "does not match"),
    ("version", 2, "version"),
    ("format", "other", "not a meshnode keystore"),
    ("encryption", "rot13", "unknown encryption"),
])
def test_corrupted_fields(keystore, field, value, match):
    document = json.loads(keystore.read_text())
    document[field] = value
    keystore.write_text(json.dumps(document))
    with pytest.raises(KeystoreError, match=match):
        load_identity(keystore, PASS)


def test_hostile_kdf_limits_refused(keystore):
    document = json.loads(keystore.read_text())
    document["kdf"]["memlimit"] = 1 << 40  # would allocate a terabyte
    keystore.write_text(json.dumps(document))
    with pytest.raises(KeystoreError, match="kdf limits"):
        load_identity(keystore, PASS)


def test_refuses_to_overwrite_unless_forced(keystore):
    before = keystore.read_bytes()
    with pytest.raises(KeystoreError, match="already exists"):
        create_keystore(keystore, SigningIdentity(bytes(32)), PASS, limits=FAST_KDF)
    assert keystore.read_bytes() == before
    create_keystore(keystore, SigningIdentity(bytes(32)), PASS, limits=FAST_KDF, overwrite=True)
    assert load_identity(keystore, PASS).seed == bytes(32)
    assert [p.name for p in keystore.parent.iterdir()] == [keystore.name]  # no temp files left


def test_unencrypted_keystore_warns_on_every_load(tmp_path, capsys):
    path = tmp_path / "testnet.key"
    create_keystore(path, SigningIdentity(SEED), None)
    for _ in range(2):
        assert load_identity(path, None).seed == SEED
        assert "NOT encrypted" in capsys.readouterr().err


def test_passphrase_sources(tmp_path, monkeypatch):
    pw_file = tmp_path / "pw"
    pw_file.write_bytes(b"from file\r\nsecond line ignored\n")
    assert PassphraseSource.from_file(pw_file).read("k") == b"from file"
    monkeypatch.setenv("MESH_PW", "from env")
    assert PassphraseSource.from_env("MESH_PW").read("k") == b"from env"
    with pytest.raises(KeystoreError, match="not set"):
        PassphraseSource.from_env("MESH_PW_UNSET").read("k")
    with pytest.raises(KeystoreError, match="cannot read passphrase file"):
        PassphraseSource.from_file(tmp_path / "missing").read("k")
    with pytest.raises(KeystoreError, match="empty"):
        PassphraseSource.literal("").read("k")


def test_prompt_asks_twice_on_create(monkeypatch):
    answers = iter(["one", "two"])
    monkeypatch.setattr("keys.keystore._stdin_is_terminal", lambda: True)
    monkeypatch.setattr("getpass.getpass", lambda prompt: next(answers))
    with pytest.raises(KeystoreError, match="differ"):
        PassphraseSource.prompt().read("k", confirm=True)


def test_prompt_without_a_terminal_reads_piped_lines(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("same\r\nsame\n"))
    assert PassphraseSource.prompt().read("k", confirm=True) == b"same"
    monkeypatch.setattr("sys.stdin", io.StringIO("only one\n"))
    with pytest.raises(KeystoreError, match="stdin closed"):
        PassphraseSource.prompt().read("k", confirm=True)


def test_write_file_atomic_mode(tmp_path):
    path = tmp_path / "genesis.bin"
    write_file_atomic(path, b"abc", mode=0o644)
    assert path.read_bytes() == b"abc" and stat.S_IMODE(os.stat(path).st_mode) == 0o644


# --- attestations (SPEC.md 5.3) --------------------------------------------------------------

AUTHORITY = SigningIdentity(bytes(range(64, 96)))
SUBJECT = SigningIdentity(SEED).public_key
MESH = bytes(range(32))


def test_attestation_valid_only_from_authority_for_subject_in_time():
    data = issue_attestation(AUTHORITY, SUBJECT, {"jurisdiction": "eu"}, 5, issued_ms=1000, expires_ms=2000)
    statement = verify_attestation(data, MESH, [AUTHORITY.public_key], now_ms=1500, subject=SUBJECT)
    assert dict(statement.attributes) == {"jurisdiction": "eu"} and statement.stake == 5
    with pytest.raises(RemoteProtocolError, match="not an authority"):
        verify_attestation(data, MESH, [SUBJECT], now_ms=1500)
    with pytest.raises(RemoteProtocolError, match="another key"):
        verify_attestation(data, MESH, [AUTHORITY.public_key], now_ms=1500, subject=AUTHORITY.public_key)
    for now_ms in (999, 2000):
        with pytest.raises(RemoteProtocolError, match="not valid at"):
            verify_attestation(data, MESH, [AUTHORITY.public_key], now_ms=now_ms)


def test_attested_attributes_drop_conflicts_and_invalid():
    other = SigningIdentity(bytes(range(96, 128)))
    authorities = [AUTHORITY.public_key, other.public_key]
    statements = [
        issue_attestation(AUTHORITY, SUBJECT, {"jurisdiction": "eu", "tier": "gold"}, 0, 0, 10),
        issue_attestation(other, SUBJECT, {"jurisdiction": "us"}, 0, 0, 10),
        issue_attestation(SigningIdentity(bytes(32)), SUBJECT, {"fake": "yes"}, 0, 0, 10),  # not an authority
        b"garbage",
    ]
    assert attested_attributes(statements, MESH, authorities, 5, SUBJECT) == {"tier": "gold"}


def test_attestation_signed_for_any_mesh_by_default():
    data = issue_attestation(AUTHORITY, SUBJECT, {}, 0, 0, 10)
    envelope, _ = decode_message(data, ANY_MESH)
    assert envelope.mesh_id == ANY_MESH
