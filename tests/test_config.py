"""Node config (SPEC.md "Node configuration"): strict reading, errors that name the field,
and write_config/load_config as exact inverses."""

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keys.identity import SigningIdentity
from meshnode.node.config import (BootstrapPeer, GpuProfile, NodeConfig, PassphraseSource, load_config, node_paths,
                             node_policy, read_passphrase, write_config)
from keys.errors import ConfigError

KEY = SigningIdentity(bytes(range(32)))


def write_toml(tmp_path, text):
    (tmp_path / "node.toml").write_text(text)
    return tmp_path


def test_layout_of_the_data_directory(tmp_path):
    paths = node_paths(tmp_path)
    assert [p.name for p in (paths.config, paths.keystore, paths.genesis, paths.database,
                             paths.control_socket, paths.log)] == \
        ["node.toml", "keystore.json", "genesis.bin", "node.sqlite", "control.sock", "node.log"]


def test_full_config_round_trips_and_file_is_private(tmp_path):
    config = NodeConfig(
        listen=("/ip4/127.0.0.1/tcp/4101",),
        bootstrap=(BootstrapPeer(KEY.public_key, "/ip4/127.0.0.1/tcp/4102"),),
        zone="eu-west", rail_group="rail-1", cpu_milli=16000, mem_mib=65536,
        passphrase=PassphraseSource("file", "secret.txt"),
        allowed_owners=(KEY.public_key,), allowed_entrypoints=("counter",),
        labels=(("country", "de"), ("tier", "gold \"1\"")), attestation_files=("att/a.bin",),
        gpu=GpuProfile(source="simulated", model="H100-SIM", count=4, mem_mib=81920, seed=7),
        entrypoints=(("counter", ("python", "-m", "meshnode.workload.builtin", "counter")),),
        log_level="debug")
    write_config(tmp_path, config)
    assert load_config(tmp_path) == config
    assert stat.S_IMODE(os.stat(tmp_path / "node.toml").st_mode) == 0o600


def test_defaults_from_an_empty_file(tmp_path):
    assert load_config(write_toml(tmp_path, "")) == NodeConfig()


def test_bootstrap_accepts_p2p_peer_id_form(tmp_path):
    write_toml(tmp_path, '[node]\nbootstrap = ["/ip4/127.0.0.1/tcp/9000/p2p/%s"]\n' % KEY.peer_id)
    assert load_config(tmp_path).bootstrap == (BootstrapPeer(KEY.public_key, "/ip4/127.0.0.1/tcp/9000"),)


@pytest.mark.parametrize("text, field", [
    ('[node]\nlisten = ["127.0.0.1:4000"]', "node.listen[0]"),
    ('[node]\nlisten = ["/ip4/1.2.3.4/tcp/70000"]', "node.listen[0]"),
    ('[node]\nbootstrap = ["/ip4/1.2.3.4/tcp/1", "zz@/ip4/1.2.3.4/tcp/1"]', "node.bootstrap[0]"),
    ('[node]\nbootstrap = ["%s@/ip4/1.2.3.4/tcp/1", "zz@/ip4/1.2.3.4/tcp/1"]' % KEY.public_key.hex(),
     "node.bootstrap[1]"),
    ('[node]\ncpu_milli = -1', "node.cpu_milli"),
    ('[node]\ncpu_milli = true', "node.cpu_milli"),
    ('[node]\nzoen = "a"', "node.zoen: unknown key"),
    ('[nodes]\n', "nodes: unknown section"),
    ('[policy]\nallowed_owners = ["*", "ab"]', "policy.allowed_owners[0]"),
    ('[policy]\nlabels = { a = 1 }', "policy.labels.a"),
    ('[passphrase]\nenv = "A"\nfile = "b"', "passphrase: set exactly one"),
    ('[passphrase]\ninsecure = false', "passphrase.insecure"),
    ('[gpu]\nsource = "cuda"', "gpu.source"),
    ('[gpu]\ncount = 65', "gpu.count"),
    ('[entrypoints]\ncounter = []', "entrypoints.counter"),
    ('[entrypoints]\n"bad name" = ["x"]', "entrypoints.bad name"),
    ('[node\n', "not valid TOML"),
])
def test_errors_name_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as caught:
        load_config(write_toml(tmp_path, text))
    assert field in str(caught.value)
    assert str(tmp_path / "node.toml") in str(caught.value)


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no node config at"):
        load_config(tmp_path)


def test_passphrase_sources(tmp_path):
    (tmp_path / "pw").write_text("s3cret\n")
    assert read_passphrase(NodeConfig(passphrase=PassphraseSource("file", "pw")), tmp_path) == "s3cret"
    assert read_passphrase(NodeConfig(passphrase=PassphraseSource("env", "PW")), tmp_path, {"PW": "x"}) == "x"
    assert read_passphrase(NodeConfig(passphrase=PassphraseSource("insecure")), tmp_path) == ""
    with pytest.raises(ConfigError, match="passphrase.env: environment variable PW"):
        read_passphrase(NodeConfig(passphrase=PassphraseSource("env", "PW")), tmp_path, {})


def test_node_policy_reads_attestation_files(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x01\x02")
    config = NodeConfig(allowed_owners=(KEY.public_key,), attestation_files=("a.bin",), zone="z1")
    policy = node_policy(config, tmp_path)
    assert policy.allowed_owners == frozenset({KEY.public_key})
    assert policy.attestations == (b"\x01\x02",) and policy.zone == "z1"
    assert node_policy(NodeConfig(), tmp_path).allowed_owners is None
    with pytest.raises(ConfigError, match=r"policy.attestations\[0\]"):
        node_policy(NodeConfig(attestation_files=("missing.bin",)), tmp_path)


_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(labels=st.dictionaries(st.text("abcxyz-_.", min_size=1, max_size=8), st.text(max_size=20), max_size=4),
       argv=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=20), min_size=1, max_size=4),
       zone=_text, model=_text)
def test_any_printable_or_control_text_survives_write_then_load(tmp_path_factory, labels, argv, zone, model):
    directory = tmp_path_factory.mktemp("cfg")
    config = NodeConfig(zone=zone, labels=tuple(sorted(labels.items())), gpu=GpuProfile(model=model),
                        entrypoints=(("run.me", tuple(argv)),))
    write_config(directory, config)
    assert load_config(directory) == config
