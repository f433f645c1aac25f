"""`meshnode cert export` and the control op `certificates` (SPEC.md 10.5, 6.7): four real
``Node`` objects on the in-memory network under trio's MockClock place a job, evict its
primary, then place a job of the new epoch. What a node exports for each job, with the
epoch change that leads to its epoch, passes `meshnode cert verify` with only the genesis;
the same certificate relabelled as another kind does not.
"""

import json

import pytest
import trio

from keys.identity import SigningIdentity
from keys.keystore import load_identity
from meshnode.cli import main as cli_main
from meshnode.cli.cert import write_export
from meshnode.net.memory_transport import MemoryNetwork
from meshnode.node.api import ControlApi
from meshnode.node.driver import Node
from protocol import codec
from protocol.envelope import seal
from protocol.errors import MeshError
from protocol.flows.epoch_change import epoch_change_instance_id
from protocol.messages import Constraints, JobManifest, Resources, encode_message, job_id
from testnet import launcher
from tests.test_failover_node import memory_factory

NODES = 4


def signed_job(layout, name: str, epoch: int) -> bytes:
    owner = load_identity(layout["owners"][0]["key_file"], None)
    job = JobManifest(owner=owner.public_key, name=name, nonce=1, entrypoint="counter", args=(),
                      resources=Resources(gpus=0, gpu_mem_mib=0, cpu_milli=100, mem_mib=64),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=0, backups=1, max_retries=2, created_ms=0, epoch=epoch)
    return encode_message(owner, bytes.fromhex(layout["mesh_id"]), job)


def jid_of(envelope: bytes) -> bytes:
    return job_id(JobManifest.from_body(codec.unpack(envelope)[3]))


def verify(path, genesis, history=()) -> int:
    """`meshnode cert verify PATH --genesis GENESIS [--history ...] --json`: its exit status."""
    history_args = ["--history", *map(str, history)] if history else []
    return cli_main(["cert", "verify", str(path), "--genesis", str(genesis), *history_args, "--json"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Run the mesh once; keep what one surviving node's `certificates` op returned."""
    root = tmp_path_factory.mktemp("net")
    launcher.create_testnet(root / "net", NODES, run_workloads=False)
    layout = launcher.load_layout(root / "net")
    results = {}

    async def scenario():
        network = MemoryNetwork()
        nodes = [Node(root / "net" / ("node-%d" % i), transport_factory=memory_factory(network),
                      run_workloads=False) for i in range(NODES)]
        keys = [node.identity.public_key for node in nodes]
        try:
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    await nursery.start(node.run)
                await trio.sleep(1.0)
                first = signed_job(layout, "before", 0)
                await nodes[0].submit(first)
                await trio.sleep(1.0)
                placed = nodes[0].core.job_view(jid_of(first))
                assert placed["state"] == "placed"
                evicted = keys.index(placed["primary"])
                for key in keys:
                    if key != keys[evicted]:
                        network.cut(keys[evicted], key)
                await trio.sleep(2.0)
                survivor = nodes[(evicted + 1) % NODES]
                assert survivor.core.epoch == 1
                second = signed_job(layout, "after", 1)
                await survivor.submit(second)
                await trio.sleep(1.0)
                api = ControlApi(survivor)
                results["first"] = await api.certificates({"job_id": jid_of(first).hex()[:10]})
                results["second"] = await api.certificates({"job_id": jid_of(second).hex()})
                results["eviction"] = await api.certificates({"instance": epoch_change_instance_id(0).hex()})
                for bad, why in (({}, "args must be"), ({"instance": "zz"}, "64 hex digits"),
                                 ({"job_id": "ab", "instance": "00" * 32}, "args must be"),
                                 ({"instance": "00" * 32}, "no certificate of instance"),
                                 ({"job_id": "not hex"}, "must be hex"), ({"job_id": "00" * 32}, "matches 0 jobs")):
                    with pytest.raises(MeshError, match=why):
                        await api.certificates(bad)
                # The CLI, through the node's control socket (a thread: the client blocks).
                results["cli_rc"] = await trio.to_thread.run_sync(cli_main, [
                    "cert", "export", "--job", jid_of(second).hex(), "--node", str(survivor.paths.root),
                    "--out", str(root / "cli-export"), "--json"])
                results["cli_out"] = root / "cli-export"
                results["genesis"] = survivor.genesis.encode()
                results["evicted_key"] = keys[evicted]
                nursery.cancel_scope.cancel()
        finally:
            for node in nodes:
                node.close()

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    return results


def test_a_job_exports_its_placement_and_the_eviction_that_moved_it(exported):
    kinds = [(row["value_kind"], row["epoch"]) for row in exported["first"]["certificates"]]
    assert kinds == [("placement", 0), ("eviction", 0)]
    assert exported["first"]["epoch_changes"] == []    # epoch 0: the genesis view is enough
    assert exported["eviction"]["certificates"] == exported["first"]["certificates"][1:]


def test_exported_certificates_verify_with_the_genesis_and_their_history(exported, tmp_path, capsys):
    second = exported["second"]
    assert [(row["value_kind"], row["epoch"]) for row in second["certificates"]] == [("placement", 1)]
    assert [(row["value_kind"], row["epoch"]) for row in second["epoch_changes"]] == [("eviction", 0)]
    for name in ("first", "second"):
        written = write_export(exported[name], exported["genesis"], tmp_path / name)
        for path in written["certificates"]:
            capsys.readouterr()
            assert verify(path, written["genesis"], written["history"]) == 0
            assert json.loads(capsys.readouterr().out)["valid"] is True
    # Without the history, the epoch-1 placement cannot be checked: its view is unknown.
    written = write_export(second, exported["genesis"], tmp_path / "bare")
    capsys.readouterr()
    assert verify(written["certificates"][0], written["genesis"]) == 2
    assert "reaches epoch 0" in json.loads(capsys.readouterr().out)["reason"]


@pytest.mark.parametrize("label", ["eviction", "membership", "placement_slot"])
def test_an_exported_certificate_relabelled_fails_verify(exported, tmp_path, capsys, label):
    """Votes sign only the value hash: anyone can change value_kind and re-sign the envelope
    (its own signature proves nothing, 6.7). The binding check refuses it."""
    written = write_export(exported["second"], exported["genesis"], tmp_path / "out")
    envelope = codec.unpack(open(written["certificates"][0], "rb").read())
    body = dict(envelope[3], value_kind=label)
    relabelled = tmp_path / "relabelled.cert"
    relabelled.write_bytes(seal(SigningIdentity(bytes(32)), envelope[1], "commit", body).encode())
    capsys.readouterr()
    assert verify(relabelled, written["genesis"], written["history"]) == 2
    reason = json.loads(capsys.readouterr().out)["reason"]
    assert reason.startswith("%s certificate: " % label), reason


def test_the_cli_writes_what_cert_verify_reads(exported, capsys):
    """`meshnode cert export --job ... --node DIR --out OUT` against the running node."""
    assert exported["cli_rc"] == 0
    out = exported["cli_out"]
    certificates = sorted(out.glob("*.cert"))
    history = sorted((out / "history").glob("*.cert"))
    assert [p.name.split("-")[1] for p in certificates] == ["placement"] and len(history) == 1
    capsys.readouterr()
    assert verify(certificates[0], out / "genesis.bin", history) == 0
