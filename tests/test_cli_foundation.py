"""`meshnode keys|mesh|job` end to end, in process (errors: one line, exit 2, no traceback)."""

import json
import os
import stat
import time

import pytest

from keys.attestation import verify_attestation
from keys.genesis import DEFAULT_PARAMS, Genesis
from keys.identity import peer_id_from_public_key
from keys.keystore import KDF_ENV, PassphraseSource, load_identity
from meshnode.cli import main
from meshnode.cli.mesh import parse_member_spec
from protocol.envelope import ANY_MESH


@pytest.fixture(autouse=True)
def fast_kdf(monkeypatch):
    monkeypatch.setenv(KDF_ENV, "insecure-test")


@pytest.fixture
def passfile(tmp_path):
    path = tmp_path / "pass.txt"
    path.write_text("hunter2\n")
    return str(path)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def new_key(capsys, path, passfile) -> dict:
    return run_json(capsys, "keys", "new", "--out", path, "--passphrase-file", passfile)


def test_keys_new_and_show(tmp_path, capsys, passfile):
    path = tmp_path / "a.key"
    made = new_key(capsys, path, passfile)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    shown = run_json(capsys, "keys", "show", path)  # no passphrase asked
    assert shown["public_key"] == made["public_key"] and shown["encrypted"] is True
    assert shown["peer_id"] == peer_id_from_public_key(bytes.fromhex(made["public_key"]))
    identity = load_identity(path, PassphraseSource.literal("hunter2"))
    assert identity.public_key.hex() == made["public_key"]
    code, out, err = run(capsys, "keys", "show", path)  # human table
    assert code == 0 and made["peer_id"][:12] in out


def test_keys_new_refuses_overwrite_without_force(tmp_path, capsys, passfile):
    path = tmp_path / "a.key"
    first = new_key(capsys, path, passfile)
    code, out, err = run(capsys, "keys", "new", "--out", path, "--passphrase-file", passfile)
    assert code == 2 and err.startswith("meshnode: error:") and "--force" in err and len(err.splitlines()) == 1
    assert run_json(capsys, "keys", "show", path)["public_key"] == first["public_key"]
    second = run_json(capsys, "keys", "new", "--out", path, "--passphrase-file", passfile, "--force")
    assert second["public_key"] != first["public_key"]


@pytest.mark.parametrize("problem", ["wrong passphrase", "world readable", "missing", "truncated"])
def test_keystore_failures_are_one_line(tmp_path, capsys, passfile, problem):
    path = tmp_path / "a.key"
    new_key(capsys, path, passfile)
    argv = ["job", "sign", "jobs/counter.toml", "--key", path, "--passphrase-file", passfile,
            "--out", tmp_path / "job.signed"]
    if problem == "wrong passphrase":
        (tmp_path / "pass.txt").write_text("wrong\n")
    elif problem == "world readable":
        path.chmod(0o644)
    elif problem == "missing":
        path.unlink()
    else:
        path.write_text(path.read_text()[:40])
    code, out, err = run(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    expected = {"wrong passphrase": "wrong passphrase", "world readable": "chmod 600",
                "missing": "does not exist", "truncated": "not valid JSON"}[problem]
    assert expected in err
    assert not (tmp_path / "job.signed").exists()


def test_passphrase_env(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NODE_PW", "from-env")
    path = tmp_path / "a.key"
    made = run_json(capsys, "keys", "new", "--out", path, "--passphrase-env", "NODE_PW")
    assert load_identity(path, PassphraseSource.from_env("NODE_PW")).public_key.hex() == made["public_key"]


def test_insecure_keystore_warns(tmp_path, capsys):
    path = tmp_path / "t.key"
    made = run_json(capsys, "keys", "new", "--out", path, "--insecure-no-passphrase")
    assert made["encrypted"] is False
    code, out, err = run(capsys, "job", "sign", "jobs/counter.toml", "--key", path, "--out", tmp_path / "j")
    assert code == 0 and "NOT encrypted" in err


def test_mesh_init_show_job_sign_verify(tmp_path, capsys, passfile):
    a, b, authority = tmp_path / "a.key", tmp_path / "b.key", tmp_path / "auth.key"
    key_a = new_key(capsys, a, passfile)
    key_b = new_key(capsys, b, passfile)
    key_auth = new_key(capsys, authority, passfile)
    genesis_path = tmp_path / "genesis.bin"
    made = run_json(capsys, "mesh", "init", "--name", "lab", "--member", "%s:10" % a,
                    "--member", "%s:20:zone-b" % key_b["public_key"], "--member-label", "1:tier=gold",
                    "--member-addr", "0:/ip4/127.0.0.1/tcp/4001", "--authority", key_auth["public_key"],
                    "--heartbeat-ms", "25", "--created-ms", "1000", "--out", genesis_path)
    genesis = Genesis.decode(genesis_path.read_bytes())
    assert made["mesh_id"] == genesis.mesh_id.hex() and genesis.total_stake == 30
    assert genesis.params.heartbeat_ms == 25 and genesis.params.checkpoint_ms == DEFAULT_PARAMS.checkpoint_ms
    assert [m.public_key.hex() for m in genesis.members] == [key_a["public_key"], key_b["public_key"]]
    assert dict(genesis.members[1].labels) == {"tier": "gold"} and genesis.members[1].zone == "zone-b"
    assert genesis.members[0].addrs == ("/ip4/127.0.0.1/tcp/4001",)
    assert run_json(capsys, "mesh", "show", genesis_path) == made

    signed = tmp_path / "job.signed"
    sign = run_json(capsys, "job", "sign", "jobs/train.toml", "--key", a, "--passphrase-file", passfile,
                    "--genesis", genesis_path, "--out", signed)
    verified = run_json(capsys, "job", "verify", signed, "--genesis", genesis_path)
    assert verified["job_id"] == sign["job_id"] and verified["owner"] == key_a["public_key"]
    assert verified["mesh_id"] == made["mesh_id"] and verified["resources"]["gpus"] == 1

    anywhere = tmp_path / "any.signed"
    run_json(capsys, "job", "sign", "jobs/counter.toml", "--key", a, "--passphrase-file", passfile, "--out", anywhere)
    assert run_json(capsys, "job", "verify", anywhere, "--genesis", genesis_path)["mesh_id"] == ANY_MESH.hex()

    other_genesis = tmp_path / "other.bin"
    run_json(capsys, "mesh", "init", "--name", "other", "--member", "%s:1" % a, "--out", other_genesis)
    code, out, err = run(capsys, "job", "verify", signed, "--genesis", other_genesis)
    assert code == 2 and "another mesh" in err

    attestation = tmp_path / "att.bin"
    code, out, err = run(capsys, "keys", "attest", "--authority", authority, "--passphrase-file", passfile,
                         "--subject", key_a["peer_id"], "--attr", "jurisdiction=eu", "--out", attestation)
    assert code == 0, err
    statement = verify_attestation(attestation.read_bytes(), genesis.mesh_id, genesis.authorities,
                                   now_ms=time.time_ns() // 1_000_000,
                                   subject=bytes.fromhex(key_a["public_key"]))
    assert dict(statement.attributes) == {"jurisdiction": "eu"}


@pytest.mark.parametrize("argv,message", [
    (["--member", "deadbeef:10"], "is not a public key"),   # neither a key nor a file
    (["--member", "%s:zero" % ("ab" * 32)], "integer STAKE"),
    (["--member", "%s:0" % ("ab" * 32)], "stake"),
    (["--member", "%s:1" % ("ab" * 32), "--member", "%s:2" % ("ab" * 32)], "listed twice"),
    (["--member", "%s:1" % ("ab" * 32), "--heartbeat-ms", "0"], "heartbeat_ms"),
    (["--member", "%s:1" % ("ab" * 32), "--member-label", "3:a=b"], "--member-label"),
    (["--member", "%s:1" % ("ab" * 32), "--bid-sample", "5000"], "Genesis.bid_sample"),
])
def test_mesh_init_errors(tmp_path, capsys, argv, message):
    code, out, err = run(capsys, "mesh", "init", "--name", "m", *argv, "--out", tmp_path / "g.bin")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "g.bin").exists()


def test_member_spec_allows_colons_in_paths():
    assert parse_member_spec("dir:with:colons/a.key:10") == ("dir:with:colons/a.key", 10, "zone-a")
    assert parse_member_spec("k:10:1") == ("k", 10, "1")


def test_job_sign_manifest_error_names_field(tmp_path, capsys, passfile):
    path = tmp_path / "a.key"
    new_key(capsys, path, passfile)
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nentrypoint = "counter"\n[resources]\ngpus = "two"\n')
    code, out, err = run(capsys, "job", "sign", bad, "--key", path, "--passphrase-file", passfile,
                         "--out", tmp_path / "s")
    assert code == 2 and "resources.gpus: expected an integer 0..64, got 'two'" in err


def test_job_verify_rejects_tampered_file(tmp_path, capsys, passfile):
    path = tmp_path / "a.key"
    new_key(capsys, path, passfile)
    signed = tmp_path / "s"
    run_json(capsys, "job", "sign", "jobs/counter.toml", "--key", path, "--passphrase-file", passfile, "--out", signed)
    data = bytearray(signed.read_bytes())
    data[-70] ^= 1
    signed.write_bytes(bytes(data))
    code, out, err = run(capsys, "job", "verify", signed)
    assert code == 2 and "does not verify" in err
