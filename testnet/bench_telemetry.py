"""`meshnode bench telemetry`: read this machine's GPUs the way a node does, and say what it costs.

An operator's first question on a GPU host is whether the node sees its GPUs through NVML,
what it reads, and whether the readings would make the node decline work. This samples the
GPUs with the node's own Telemetry (``meshnode.node.telemetry``) at the node's busiest
refresh period, puts every sample into a capability vector signed with a throwaway key,
decodes it back through the receive path (schema and signature checks as a peer does), and
applies the placement health rule (SPEC.md P3, ``node_unhealthy``) to each reading.

It starts no testnet and opens no socket. Without a GPU, ``--source auto`` measures the
simulated profile (and says so in ``source``), and ``--source nvml`` is a clear error.
"""

from __future__ import annotations

import os
import time

from keys.errors import ConfigError
from meshnode.node.config import GpuProfile
from meshnode.node.telemetry import Telemetry, TelemetryError
from protocol.messages import CapabilityVector
from protocol.messages.wire import decode_message, encode_message
from protocol.placement import gpu_health_faults
from protocol.signing import SigningIdentity
from testnet.bench_stats import summary_ms

BENCH_MESH_ID = bytes(32)   # a vector signed here is never sent: any mesh id does


def _vector(me: bytes, seq: int, taken_ms: int, gpus: tuple) -> CapabilityVector:
    return CapabilityVector(node=me, epoch=1, seq=seq, taken_ms=taken_ms, zone="bench", rail_group="",
                            gpus=gpus, gpus_free=tuple(g.index for g in gpus), cpu_milli_free=0,
                            mem_mib_free=0, labels=(), simulated=False, running=())


def run_telemetry_bench(source: str = "auto", seconds: float = 10.0, period_ms: int = 100) -> dict:
    """Sample for ``seconds`` every ``period_ms``; one JSON-ready dict. Raises ConfigError when
    ``source`` is "nvml" and NVML cannot be used."""
    if seconds <= 0 or period_ms <= 0:
        raise ConfigError("--seconds and --period-ms must be positive")
    telemetry = Telemetry.open(GpuProfile(source=source))
    identity = SigningIdentity(os.urandom(32))
    sample_ms, sign_verify_ms, errors = [], [], []
    per_gpu: dict[int, dict] = {}
    unhealthy_samples = 0
    faults_seen: set[str] = set()
    try:
        described = telemetry.describe_source()
        deadline = time.monotonic() + seconds
        seq = 0
        while time.monotonic() < deadline:
            started = time.perf_counter()
            now_ms = int(time.monotonic() * 1000)
            try:
                gpus = telemetry.sample(now_ms)
            except TelemetryError as exc:
                errors.append(str(exc)[:200])
                time.sleep(period_ms / 1000)
                continue
            sampled = time.perf_counter()
            sample_ms.append((sampled - started) * 1000)
            seq += 1
            data = encode_message(identity, BENCH_MESH_ID, _vector(identity.public_key, seq, now_ms, gpus))
            _envelope, decoded = decode_message(data, BENCH_MESH_ID, CapabilityVector)
            sign_verify_ms.append((time.perf_counter() - sampled) * 1000)
            if decoded.gpus != gpus:
                raise AssertionError("a capability vector did not survive encode/decode")
            sample_unhealthy = False
            for gpu in decoded.gpus:
                stats = per_gpu.setdefault(gpu.index, {"model": gpu.model, "mem_total_mib": gpu.mem_total_mib,
                                                       "util_milli": [], "temp_milli_c": [], "power_mw": [],
                                                       "sm_clock_mhz": [], "mem_used_mib": [],
                                                       "throttle_reasons_seen": 0, "ecc_errors_max": 0})
                for name in ("util_milli", "temp_milli_c", "power_mw", "sm_clock_mhz", "mem_used_mib"):
                    stats[name].append(getattr(gpu, name))
                stats["throttle_reasons_seen"] |= gpu.throttle_reasons
                stats["ecc_errors_max"] = max(stats["ecc_errors_max"], gpu.ecc_errors)
                faults = gpu_health_faults(gpu)
                faults_seen.update("gpu%d: %s" % (gpu.index, fault) for fault in faults)
                sample_unhealthy = sample_unhealthy or bool(faults)
            unhealthy_samples += sample_unhealthy
            time.sleep(max(0.0, period_ms / 1000 - (time.perf_counter() - started)))
        unsupported = telemetry.describe_source()["unsupported"]
    finally:
        telemetry.close()
    gpus_out = {}
    for index, stats in sorted(per_gpu.items()):
        out = {"model": stats["model"], "mem_total_mib": stats["mem_total_mib"],
               "throttle_reasons_seen": "0x%x" % stats["throttle_reasons_seen"],
               "ecc_errors_max": stats["ecc_errors_max"]}
        for name in ("util_milli", "temp_milli_c", "power_mw", "sm_clock_mhz", "mem_used_mib"):
            values = stats[name]
            out[name] = {"min": min(values), "max": max(values)}
        gpus_out["gpu%d" % index] = out
    return {"source": described["source"], "driver": described.get("driver", ""),
            "fallback_reason": described.get("fallback_reason", ""), "unsupported": unsupported,
            "samples": len(sample_ms), "period_ms": period_ms, "read_errors": len(errors),
            "first_read_error": errors[0] if errors else "",
            "sample_ms": summary_ms(sample_ms), "sign_verify_ms": summary_ms(sign_verify_ms),
            "unhealthy_samples": unhealthy_samples, "health_faults": sorted(faults_seen), "gpus": gpus_out}
