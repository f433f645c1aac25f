"""`meshnode mesh init --pools FILE` (SPEC.md 5.5): the pools file, its errors, and the genesis it makes."""

import json
import textwrap

import pytest

from keys.genesis import UNLIMITED, Quota, load_genesis
from meshnode.cli import main
from meshnode.cli.pools_file import pools_from_toml
from protocol.errors import MeshError
from tests.test_quota import OWNER

REPO_POOLS = "jobs/pools/lab.toml"


def test_the_example_pools_file_makes_a_genesis_with_pools(tmp_path, capsys):
    out = tmp_path / "genesis.bin"
    code = main(["mesh", "init", "--name", "lab", "--member", "11" * 32 + ":100", "--pools", REPO_POOLS,
                 "--created-ms", "1", "--out", str(out), "--json"])
    view = json.loads(capsys.readouterr().out)
    assert code == 0 and view["reservations"] is True
    genesis = load_genesis(out)
    by_name = {pool.name: pool for pool in genesis.pools}
    assert sorted(by_name) == ["", "research", "training"]
    assert by_name["training"].default == Quota(gpu_milli=2000, cpu_milli=16000, mem_mib=65536)
    assert by_name["research"].default == Quota(gpu_milli=1000)
    assert by_name[""].default == Quota()
    assert main(["mesh", "show", str(out)]) == 0
    assert "pools (SPEC 5.5; reservations on)" in capsys.readouterr().out


def test_owner_quotas_and_units():
    pools, reservations = pools_from_toml(textwrap.dedent('''
        [pools.serving]
        default = { gpu_milli = 500 }
        owners."%s" = { gpus = 3, mem_mib = 1024 }
        ''' % OWNER.public_key.hex()))
    assert reservations is False
    (serving,) = pools
    assert serving.default == Quota(gpu_milli=500)
    assert serving.owners[0].owner == OWNER.public_key
    assert serving.owners[0].quota == Quota(gpu_milli=3000, cpu_milli=UNLIMITED, mem_mib=1024)


@pytest.mark.parametrize("text, message", [
    ("[pools.a]\ndefault = { gpu = 1 }", "pools.a.default: unknown field gpu"),
    ("[pools.a]\nlimit = {}", "pools.a: unknown field limit"),
    ("pool = 1", "unknown field pool"),
    ("[pools.a]\ndefault = { gpus = -1 }", "pools.a.default.gpus: expected a whole number >= 0"),
    ("[pools.a]\ndefault = { gpus = 1, gpu_milli = 5 }", "give gpus or gpu_milli, not both"),
    ("reservations = 1", "reservations must be true or false"),
    ("[pools.a]\nowners.nokey = { gpus = 1 }", "is not a public key"),
    ("[pools", "pools file:"),
])
def test_a_bad_pools_file_is_one_clear_error(text, message):
    with pytest.raises(MeshError, match=message):   # the CLI prints it as one line
        pools_from_toml(text)
