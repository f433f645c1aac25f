"""A halted node freezes its workloads and thaws them when the halt ends (SPEC.md F3b):
four real node drivers on the in-memory network under trio's MockClock, the primary's
runner a simulated one that records what the driver asks of it. A pause long enough for
the peers to suspect the primary halts it (F3); their fresh heartbeats end the halt; the
job's workload is the same process before and after, never stopped and started again."""

import time

import pytest
import trio

from keys.keystore import load_identity
from meshnode.node.clock import now_ms
from protocol.messages import Constraints, JobManifest, Resources, encode_message
from testnet import launcher
from testnet.sim_nodes import SimRunner
from tests.test_failover_node import NODES, memory_mesh


class RecordingRunner(SimRunner):
    """The simulated runner, and every freeze, thaw and stop the driver asks for."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.calls: list[tuple[str, bytes]] = []

    def freeze(self, job_id: bytes) -> bool:
        self.calls.append(("freeze", job_id))
        return job_id in self._jobs

    def thaw(self, job_id: bytes) -> bool:
        self.calls.append(("thaw", job_id))
        return job_id in self._jobs

    async def stop(self, job_id: bytes):
        self.calls.append(("stop", job_id))
        return await super().stop(job_id)


@pytest.fixture
def net(tmp_path):
    launcher.create_testnet(tmp_path / "net", NODES, run_workloads=True)
    return tmp_path / "net", launcher.load_layout(tmp_path / "net")


def counter_job(layout) -> bytes:
    owner = load_identity(layout["owners"][0]["key_file"], None)
    job = JobManifest(owner=owner.public_key, name="held", nonce=3, entrypoint="counter",
                      args=("--units", "10000000", "--unit-ms", "1"),
                      resources=Resources(gpus=0, gpu_mem_mib=0, cpu_milli=100, mem_mib=64),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=0, backups=1, max_retries=0, created_ms=time.time_ns() // 1_000_000, epoch=0)
    return encode_message(owner, bytes.fromhex(layout["mesh_id"]), job)


async def test_a_halt_freezes_the_workload_and_its_end_thaws_the_same_process(net, mock_clock):
    mock_clock.autojump_threshold = 0
    root, layout = net
    async with memory_mesh(root, NODES, run_workloads=True, runner_factory=RecordingRunner) as nodes:
        await trio.sleep(1.0)
        jid = await nodes[0].submit(counter_job(layout))
        await trio.sleep(1.0)
        view = nodes[0].core.job_view(jid)
        primary = next(n for n in nodes if n.identity.public_key == view["primary"])
        assert primary.core.job_view(jid)["state"] == "running"
        pid, fence = primary.runner.running()[jid]["pid"], view["fence"]
        # A pause past min_silence_ms - heartbeat_ms, as the core's clock sees it (F3).
        await primary._handle(primary.core.tick(now_ms() + 300))
        await trio.sleep(0.01)   # the batch is drained in turn (protocol/drain.py)
        assert primary.core.halted
        assert primary.runner.calls == [("freeze", jid)] and jid in primary.frozen_fences
        await trio.sleep(1.0)   # the peers' fresh heartbeats end the halt
        assert not primary.core.halted
        assert primary.runner.calls == [("freeze", jid), ("thaw", jid)]
        assert primary.runner.running()[jid]["pid"] == pid and primary.job_fences[jid] == fence
        assert primary.core.job_view(jid)["state"] == "running" and not primary.frozen_fences
