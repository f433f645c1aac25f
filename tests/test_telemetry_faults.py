"""Telemetry faults (SPEC.md 10.3, 10.5): forced simulated readings, a failing GPU reading
that never stops the node, and `meshnode testnet telemetry` against real control sockets.

The drivers run on the in-memory network under trio's autojumping MockClock; the CLI runs
in a thread and talks to the nodes' real control sockets (as tests/test_cli_job.py does).
"""

import json
import sys

import pytest
import trio

from keys.identity import short_id
from keys.keystore import load_identity
from meshnode.cli import main
from meshnode.node.config import GpuProfile
from meshnode.node.telemetry import SimulatedFault, Telemetry, TelemetryError
from protocol.errors import MeshError
from protocol.messages import Constraints, JobManifest, Resources, encode_message
from testnet import launcher
from tests.test_cli_job import cli, one_line_error
from tests.test_job_output import run_mesh   # four real Nodes on the memory network
from tests.test_telemetry import fake_pynvml

NODES = 4


def simulated(seed=3, count=2):
    return Telemetry.open(GpuProfile(source="simulated", model="SIM", count=count, mem_mib=16384, seed=seed))


def test_10_3_forced_readings_replace_the_model_and_leave_the_other_gpus_reproducible():
    forced, plain = simulated(), simulated()
    for telemetry in (forced, plain):
        telemetry.set_load(1, 60_000, 1000)
    assert forced.set_simulated_fault(SimulatedFault(temp_milli_c=88_000, throttle_reasons=0x60, ecc_errors=2),
                                      gpu_index=0) == [0]
    for at in range(0, 5001, 1000):
        hot, twin = forced.sample(at), plain.sample(at)
        assert hot[1] == twin[1]   # the jitter series is unchanged: GPU 1 reads as without the fault
        assert (hot[0].temp_milli_c, hot[0].throttle_reasons, hot[0].ecc_errors) == (88_000, 0x60, 2)
    assert forced.describe_source()["faults"] == {
        "gpu0": {"temp_milli_c": 88_000, "throttle_reasons": 0x60, "ecc_errors": 2}}
    # A forced utilisation drives the temperature model (it heats up with the lag).
    forced.set_simulated_fault(SimulatedFault(util_milli=95_000))
    readings = [forced.sample(at) for at in range(6000, 60_001, 1000)]
    assert {r[1].util_milli for r in readings} == {95_000} and readings[-1][1].temp_milli_c > 70_000
    # Cleared, a GPU forced to 88 C cools from there with the 8 s lag, not at once.
    forced.set_simulated_fault(SimulatedFault(temp_milli_c=88_000))
    forced.sample(61_000)
    forced.set_simulated_fault(None)
    assert 80_000 < forced.sample(62_000)[0].temp_milli_c < 88_000
    assert forced.describe_source()["faults"] == {}


def test_10_3_a_forced_read_error_fails_like_a_lost_gpu_and_bad_values_are_refused():
    telemetry = simulated()
    telemetry.set_simulated_fault(SimulatedFault(read_error=True), gpu_index=1)
    with pytest.raises(TelemetryError, match="GPU 1: simulated read error"):
        telemetry.sample(0)
    with pytest.raises(MeshError, match="no simulated GPU 5"):
        telemetry.set_simulated_fault(SimulatedFault(util_milli=1), gpu_index=5)
    with pytest.raises(MeshError, match="util_milli must be an integer in 0..100000"):
        SimulatedFault(util_milli=100_001)


def test_10_3_a_node_reading_nvml_refuses_forced_readings(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    telemetry = Telemetry.open(GpuProfile(source="nvml"))
    with pytest.raises(MeshError, match="NVML: telemetry faults apply to simulated GPUs only"):
        telemetry.set_simulated_fault(SimulatedFault(temp_milli_c=90_000))
    assert telemetry.sample(0)[0].temp_milli_c == 64_000   # what the (fake) card measures


# --- drivers ------------------------------------------------------------------------------------

@pytest.fixture
def mesh_dir(tmp_path):
    launcher.create_testnet(tmp_path / "net", NODES, run_workloads=False)
    return tmp_path / "net", launcher.load_layout(tmp_path / "net")


def gpu_job(layout, nonce: int) -> bytes:
    owner = load_identity(layout["owners"][0]["key_file"], None)
    job = JobManifest(owner=owner.public_key, name="gpu%d" % nonce, nonce=nonce, entrypoint="counter", args=(),
                      resources=Resources(gpus=1, gpu_mem_mib=1000, cpu_milli=100, mem_mib=64),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=0, backups=1, max_retries=0, created_ms=0, epoch=0)
    return encode_message(owner, bytes.fromhex(layout["mesh_id"]), job)


async def test_10_3_a_failing_gpu_reading_does_not_stop_the_node(mesh_dir, mock_clock):
    """Before, the TelemetryError left the telemetry loop and took the node's nursery down."""
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir

    async def test(nodes):
        sick = nodes[0]   # 8 GPUs: the primary of any GPU job while it is healthy
        events = []
        sick.events.publish = lambda event: events.append(event.kind)
        sick.telemetry.set_simulated_fault(SimulatedFault(read_error=True), gpu_index=3)
        await trio.sleep(5.0)
        assert sick.telemetry_errors >= 4 and "simulated read error" in sick.core.capability.telemetry_fault
        assert events.count("telemetry_failed") == 1
        jid = await nodes[1].submit(gpu_job(layout, 1))
        await trio.sleep(2.0)
        view = nodes[1].core.job_view(jid)
        assert view["state"] == "placed" and view["primary"] != sick.identity.public_key
        assert view["declines"] == {"node_unhealthy": [sick.identity.public_key]}
        assert all(n.core.is_member() for n in nodes) and sick.core.epoch == 0   # nobody evicted it
        sick.telemetry.set_simulated_fault(None)
        await trio.sleep(2.0)
        errors = sick.telemetry_errors
        await trio.sleep(2.0)
        assert sick.telemetry_errors == errors and sick.core.capability.telemetry_fault == ""
        assert events.count("telemetry_recovered") == 1

    await run_mesh(root, test)


async def test_a_node_reading_nvml_samples_in_a_worker_thread_and_signs_what_the_card_reports(
        mesh_dir, mock_clock, monkeypatch):
    """An NVML read took up to 44 ms on an H100 under load (BENCHMARKS.md): it must not run
    in the node's event loop, where it would delay heartbeats and ticks."""
    import threading
    mock_clock.autojump_threshold = 0
    root, _layout = mesh_dir
    nvml = fake_pynvml()
    sampled_in = []
    read_temperature = nvml.nvmlDeviceGetTemperature

    def temperature_noting_the_thread(handle, *args):
        sampled_in.append(threading.current_thread() is threading.main_thread())
        return read_temperature(handle, *args)

    nvml.nvmlDeviceGetTemperature = temperature_noting_the_thread
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    async def test(nodes):
        real = nodes[0]
        real.telemetry = Telemetry.open(GpuProfile(source="nvml"))
        await trio.sleep(3.0)
        assert sampled_in and not any(sampled_in)
        gpus = real.core.capability.telemetry_gpus
        assert [g.model for g in gpus] == ["NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090"]
        assert gpus[0].temp_milli_c == 64_000 and gpus[0].power_mw == 412_345
        assert all(n.core.is_member() for n in nodes)

    await run_mesh(root, test)


async def test_cli_testnet_telemetry_makes_a_node_hot_and_jobs_avoid_it(mesh_dir, mock_clock, capsys):
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir

    async def test(nodes):
        hot = nodes[0]
        code, out, err = await cli(capsys, "testnet", "telemetry", "0", "--temp", "88", "--throttle", "thermal",
                                   "--util", "95", "--dir", root, "--json")
        assert code == 0, err
        assert json.loads(out)["faults"] == {"gpu%d" % i: {"util_milli": 95_000, "temp_milli_c": 88_000,
                                                           "throttle_reasons": 0x60} for i in range(8)}
        await trio.sleep(1.5)   # the next reading is signed into node 0's vector
        jids = [await nodes[1].submit(gpu_job(layout, n)) for n in range(3)]
        await trio.sleep(2.0)
        views = [nodes[1].core.job_view(jid) for jid in jids]
        assert all(v["state"] == "placed" for v in views)
        assert hot.identity.public_key not in {v["primary"] for v in views}
        code, out, err = await cli(capsys, "why", jids[0].hex(), "--node", nodes[1].paths.root, "--json")
        assert code == 0 and json.loads(out)["declines"] == {"node_unhealthy": [short_id(hot.identity.public_key)]}
        code, out, err = await cli(capsys, "testnet", "telemetry", "0", "--clear", "--dir", root)
        assert code == 0 and "node 0: simulated readings" in out
        # Healthy again within a reading or two, but it ranks first only once it has cooled
        # under 60 C (strain 0, like the idle nodes): about 6 s with the model's 8 s lag.
        await trio.sleep(10.0)
        jid = await nodes[1].submit(gpu_job(layout, 9))
        await trio.sleep(2.0)
        assert nodes[1].core.job_view(jid)["primary"] == hot.identity.public_key   # the most free GPUs again
        # Bad input: one line, exit 2.
        for argv, text in ((("--util", "150"), "--util must be in 0..100"),
                           (("--throttle", "hot"), "--throttle 'hot': use none, idle, power_cap"),
                           ((), "name a reading to force"),
                           (("--clear", "--temp", "90"), "--clear takes no readings"),
                           (("--temp", "90", "--gpu", "8"), "no simulated GPU 8 on this node")):
            one_line_error(*(await cli(capsys, "testnet", "telemetry", "0", *argv, "--dir", root))[::2], text)
        one_line_error(*(await cli(capsys, "testnet", "telemetry", "7", "--temp", "90", "--dir", root))[::2],
                       "no node 7 in this testnet")

    await run_mesh(root, test)
