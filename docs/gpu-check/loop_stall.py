"""Event-loop lateness while a node samples a real GPU through NVML: in the trio loop vs a worker
thread (meshnode/node/driver.py `_sample_gpus`). Run by docs/gpu-check/nvml_check.sh on a GPU host."""
import json, time
import trio
from meshnode.node.config import GpuProfile
from meshnode.node.telemetry import Telemetry

TICK_S, SAMPLE_S, PHASE_S = 0.005, 0.1, 8.0

async def phase(telemetry, threaded):
    lateness = []
    async def ticker():
        while True:
            start = time.perf_counter(); await trio.sleep(TICK_S)
            lateness.append((time.perf_counter() - start - TICK_S) * 1000)
    async def sampler():
        while True:
            if threaded:
                await trio.to_thread.run_sync(telemetry.sample, 0)
            else:
                telemetry.sample(0)
            await trio.sleep(SAMPLE_S)
    with trio.move_on_after(PHASE_S):
        async with trio.open_nursery() as n:
            n.start_soon(ticker); n.start_soon(sampler)
    lateness.sort()
    return {"ticks": len(lateness), "p50_ms": round(lateness[len(lateness)//2], 3),
            "p99_ms": round(lateness[int(len(lateness)*0.99)], 3), "max_ms": round(lateness[-1], 3)}

async def main():
    telemetry = Telemetry.open(GpuProfile(source="nvml"))
    out = {"in_loop": await phase(telemetry, False), "worker_thread": await phase(telemetry, True),
           "in_loop_again": await phase(telemetry, False), "worker_thread_again": await phase(telemetry, True)}
    telemetry.close()
    print(json.dumps(out, indent=1))

trio.run(main)
