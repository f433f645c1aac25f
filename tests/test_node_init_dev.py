"""`meshnode node init` (a node's data directory that `meshnode run` accepts, SPEC.md 10.2)
and `meshnode dev` (a one-member mesh that runs jobs: one real process on 127.0.0.1)."""

import json
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from keys.genesis import DEFAULT_PARAMS, Genesis
from keys.identity import generate_identity, peer_id_from_public_key
from keys.keystore import KDF_ENV, create_keystore
from meshnode.cli import build_parser, main
from meshnode.node import config as node_config
from meshnode.node.config import BootstrapPeer, NodeConfig, PassphraseSource
from meshnode.node.driver import Node
from protocol.messages import Member

BOOTSTRAP = generate_identity()
BOOTSTRAP_ADDR = "/ip4/127.0.0.1/tcp/4102/p2p/%s" % peer_id_from_public_key(BOOTSTRAP.public_key)
DEADLINE_S = 30


@pytest.fixture(autouse=True)
def fast_kdf(monkeypatch):
    monkeypatch.setenv(KDF_ENV, "insecure-test")


@pytest.fixture
def mesh(tmp_path):
    """A node keystore (unencrypted) and a genesis in which it is a member of zone-b."""
    identity = generate_identity()
    key = tmp_path / "node-a.key"
    create_keystore(key, identity, None)
    genesis = Genesis(name="lab", created_ms=1, params=DEFAULT_PARAMS, authorities=(), members=(
        Member(public_key=identity.public_key, stake=10, zone="zone-b", labels=(), addrs=()),
        Member(public_key=BOOTSTRAP.public_key, stake=10, zone="zone-a", labels=(), addrs=())))
    genesis_path = tmp_path / "genesis.bin"
    genesis_path.write_bytes(genesis.encode())
    return identity, key, genesis_path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def init_argv(node_dir, key, genesis_path, *extra):
    return ["node", "init", "--dir", node_dir, "--genesis", genesis_path, "--key", key,
            "--listen", "/ip4/127.0.0.1/tcp/4101", "--bootstrap", BOOTSTRAP_ADDR, *extra]


def test_node_init_writes_what_the_node_loads(tmp_path, capsys, mesh):
    identity, key, genesis_path = mesh
    node_dir = tmp_path / "node-a"
    code, out, err = run(capsys, *init_argv(node_dir, key, genesis_path, "--metrics-listen", "127.0.0.1:9464",
                                            "--json"))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["genesis_member"] is True and summary["node"] == identity.public_key.hex()
    # The config as config.py loads it is exactly what node init meant to write.
    assert node_config.load_config(node_dir) == NodeConfig(
        listen=("/ip4/127.0.0.1/tcp/4101",),
        bootstrap=(BootstrapPeer(BOOTSTRAP.public_key, "/ip4/127.0.0.1/tcp/4102"),),
        zone="zone-b", passphrase=PassphraseSource("insecure"), metrics_listen="127.0.0.1:9464")
    paths = node_config.node_paths(node_dir)
    assert paths.genesis.read_bytes() == genesis_path.read_bytes()
    assert paths.keystore.read_bytes() == key.read_bytes()
    assert stat.S_IMODE(paths.keystore.stat().st_mode) == 0o600
    # And the driver `meshnode run` uses accepts the directory: config, keystore, genesis.
    node = Node(node_dir)
    try:
        assert node.identity.public_key == identity.public_key
        assert node.genesis.mesh_id.hex() == summary["mesh_id"]
    finally:
        node.close()


def test_node_init_takes_several_peers_after_one_flag_and_run_takes_dir(tmp_path, capsys, mesh):
    _identity, key, genesis_path = mesh
    other = generate_identity()
    node_dir = tmp_path / "node-a"
    argv = init_argv(node_dir, key, genesis_path) + ["%s@/ip4/10.0.0.7/tcp/4001" % other.public_key.hex()]
    assert argv[-3] == "--bootstrap"   # --bootstrap A B
    assert run(capsys, *argv)[0] == 0
    assert [p.public_key for p in node_config.load_config(node_dir).bootstrap] == [BOOTSTRAP.public_key,
                                                                                  other.public_key]
    assert build_parser("run").parse_args(["run", "--dir", str(node_dir)]).node == str(node_dir)


def test_node_init_refuses_to_overwrite_a_config_without_force(tmp_path, capsys, mesh):
    _identity, key, genesis_path = mesh
    node_dir = tmp_path / "node-a"
    assert run(capsys, *init_argv(node_dir, key, genesis_path))[0] == 0
    before = node_config.node_paths(node_dir).config.read_bytes()
    code, out, err = run(capsys, *init_argv(node_dir, key, genesis_path, "--zone", "zone-c"))
    assert code == 2 and err.count("\n") == 1 and "node.toml already exists; pass --force" in err
    assert node_config.node_paths(node_dir).config.read_bytes() == before
    assert run(capsys, *init_argv(node_dir, key, genesis_path, "--zone", "zone-c", "--force"))[0] == 0
    assert node_config.load_config(node_dir).zone == "zone-c"


def test_node_init_an_encrypted_key_reads_its_passphrase_from_the_named_source(tmp_path, capsys, mesh):
    _identity, _key, genesis_path = mesh
    key = tmp_path / "enc.key"
    (tmp_path / "pw").write_text("hunter2\n")
    assert run(capsys, "keys", "new", "--out", key, "--passphrase-file", tmp_path / "pw")[0] == 0
    node_dir = tmp_path / "node-b"
    assert run(capsys, *init_argv(node_dir, key, genesis_path, "--passphrase-env", "NODE_B_PASS"))[0] == 0
    config = node_config.load_config(node_dir)
    assert config.passphrase == PassphraseSource("env", "NODE_B_PASS") and config.zone == "zone-a"


@pytest.mark.parametrize("change, message", [
    (("--listen", "/ip4/127.0.0.1/udp/4101"), "--listen: expected a multiaddr like /ip4/127.0.0.1/tcp/4001"),
    (("--bootstrap", "/ip4/127.0.0.1/tcp/4102"), "--bootstrap: expected PUBKEYHEX@/ip4/HOST/tcp/PORT or"),
    (("--genesis", "missing.bin"), "cannot read genesis missing.bin"),
    (("--genesis", "node-a.key"), "is not a valid genesis document"),
    (("--key", "missing.key"), "keystore missing.key does not exist"),
    (("--metrics-listen", "0.0.0.0:9464"), "--metrics-listen: expected \"127.0.0.1:PORT\""),
    (("--zone", "z" * 65), "node.zone: expected text of 1..64 characters"),
])
def test_node_init_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, mesh, monkeypatch, change, message):
    _identity, key, genesis_path = mesh
    monkeypatch.chdir(tmp_path)
    argv = init_argv(tmp_path / "node-a", key.name, genesis_path.name)
    flag, value = change
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "node-a").exists()


def test_run_without_a_config_names_node_init(tmp_path):
    with pytest.raises(node_config.ConfigError) as error:
        node_config.load_config(tmp_path)
    assert "meshnode node init --dir %s" % tmp_path in str(error.value)
    assert "mesh init" not in str(error.value).replace("node init", "")


def test_dev_runs_a_job_on_one_node_and_removes_its_files_on_ctrl_c(tmp_path):
    env = dict(os.environ, MESHNODE_KEYSTORE_KDF="insecure-test", PYTHONUNBUFFERED="1")
    dev_dir = tmp_path / "dev"
    dev = subprocess.Popen([sys.executable, "-m", "meshnode.cli", "dev", "--dir", str(dev_dir)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        # A reader thread, so a node that never prints cannot block the test past its deadline.
        printed = queue.Queue()
        threading.Thread(target=lambda: [printed.put(line.strip()) for line in iter(dev.stdout.readline, "")],
                         daemon=True).start()
        lines = []
        deadline = time.monotonic() + DEADLINE_S
        while not lines or not lines[-1].startswith("Ctrl-C"):
            try:
                lines.append(printed.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError("dev did not start: %s" % lines) from None
        submit = next(line for line in lines if line.startswith("submit:")).split(":", 1)[1].split()
        assert submit[:2] == ["meshnode", "submit"]
        # The printed command, as a user runs it: the job is placed on the one node and runs.
        result = subprocess.run([sys.executable, "-m", "meshnode.cli", *submit[1:], "--json"], capture_output=True,
                                text=True, timeout=DEADLINE_S + 10, env=env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["state"] == "running"
        dev.send_signal(signal.SIGINT)
        dev.wait(timeout=DEADLINE_S)
        err = dev.stderr.read()
    finally:
        if dev.poll() is None:
            dev.kill()
            dev.wait()
    assert dev.returncode == 0, err
    assert "removed %s" % dev_dir in err and not dev_dir.exists()
