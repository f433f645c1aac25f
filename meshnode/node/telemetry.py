"""GPU telemetry for capability vectors: NVML where a GPU answers, else a simulated profile.

Every value is an integer in the units of ``protocol.messages.GpuState`` (milli-percent,
milli-degrees, milliwatts, MiB), clamped to the schema's ranges so a strange driver
reading can never make this node's own capability vector invalid.

NVML (``pynvml``, from the nvidia-ml-py package) is optional hardware: without a GPU
``nvmlInit`` raises ``pynvml.NVMLError`` in well under a millisecond, and with
``source = "auto"`` the node falls back to the simulated profile of its config. A
field a card does not support (ECC on consumer cards, power on some boards) reads as
0 and is listed by ``describe_source()``, so an operator can tell "0" from "unknown".

The simulated profile is what testnets run on: each GPU's utilisation and memory are
what the driver declares with ``set_load`` when it starts and stops workloads; its
temperature, power and clock follow the utilisation with a first-order lag; jitter
comes from a ``random.Random(seed)``, so a run is reproducible from its seed.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass

from keys.errors import ConfigError
from meshnode.node.config import GpuProfile
from protocol.errors import MeshError
from protocol.messages import GpuState

# NVML clock-event (throttle) reason bit for an idle GPU, from nvml.h; the simulation sets it too.
THROTTLE_GPU_IDLE = 0x1

# Limits of GpuState's schema (protocol/messages.py), repeated to clamp readings.
_UTIL_MILLI_MAX = 100_000
_TEMP_MILLI_C_MAX = 200_000
_POWER_MW_MAX = 10_000_000
_MIB = 1 << 20

# Simulated thermal/power model (per GPU). Integers only, so the series is exact.
SIM_IDLE_TEMP_MILLI_C = 32_000
SIM_FULL_LOAD_TEMP_MILLI_C = 78_000
SIM_THERMAL_TAU_MS = 8_000       # time for about 63% of a temperature step
SIM_IDLE_POWER_MW = 55_000
SIM_MAX_POWER_MW = 350_000
SIM_IDLE_SM_CLOCK_MHZ = 210
SIM_BOOST_SM_CLOCK_MHZ = 1_755
SIM_UTIL_JITTER_MILLI = 1_500    # +-1.5 percent while loaded
SIM_TEMP_JITTER_MILLI_C = 300


class TelemetryError(MeshError):
    """A GPU stopped answering NVML (lost, reset, driver gone): the node is unhealthy."""


def _clamp(value: int, high: int) -> int:
    return max(0, min(int(value), high))


@dataclass(frozen=True)
class SimulatedFault:
    """Readings a tester forces on a simulated GPU (`meshnode testnet telemetry`, README):
    each field set replaces what the model would report; None leaves the model's value.
    ``read_error`` makes sampling fail as a lost GPU does under NVML."""
    util_milli: int | None = None
    temp_milli_c: int | None = None
    throttle_reasons: int | None = None
    ecc_errors: int | None = None
    read_error: bool = False

    def __post_init__(self):
        for name, high in (("util_milli", _UTIL_MILLI_MAX), ("temp_milli_c", _TEMP_MILLI_C_MAX),
                           ("throttle_reasons", (1 << 64) - 1), ("ecc_errors", (1 << 63) - 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= high):
                raise MeshError("simulated telemetry: %s must be an integer in 0..%d, not %r" % (name, high, value))

    def describe(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if value is not None and value is not False}


class _SimulatedGpu:
    def __init__(self, mem_total_mib: int):
        self.mem_total_mib = mem_total_mib
        self.load_util_milli = 0
        self.load_mem_mib = 0
        self.temp_milli_c = SIM_IDLE_TEMP_MILLI_C
        self.fault: SimulatedFault | None = None


class Telemetry:
    """Samples this node's GPUs. Build with ``Telemetry.open(profile)``; call ``close()``."""

    def __init__(self, profile: GpuProfile, nvml=None, fallback_reason: str = ""):
        self.profile = profile
        self._nvml = nvml                  # the pynvml module when the source is NVML
        self._handles: list = []
        self._names: list[str] = []
        self.fallback_reason = fallback_reason
        self.unsupported: set[tuple[int, str]] = set()   # (gpu index, field) NVML cannot report
        self._random = random.Random(profile.seed)
        self._sim = [_SimulatedGpu(profile.mem_mib) for _ in range(profile.count)] if nvml is None else []
        self._last_sample_ms: int | None = None
        if nvml is not None:
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._names = [self._name(h) for h in self._handles]

    @classmethod
    def open(cls, profile: GpuProfile) -> "Telemetry":
        """Pick the source the profile asks for. ``nvml`` without a GPU is a ConfigError."""
        if profile.source == "simulated":
            return cls(profile)
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            return cls._no_nvml(profile, "pynvml is not installed (%s)" % exc)
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return cls._no_nvml(profile, "NVML unavailable: %s" % exc)
        try:
            return cls(profile, nvml=nvml)
        except nvml.NVMLError as exc:
            nvml.nvmlShutdown()
            return cls._no_nvml(profile, "NVML could not list GPUs: %s" % exc)

    @classmethod
    def _no_nvml(cls, profile: GpuProfile, reason: str) -> "Telemetry":
        if profile.source == "nvml":
            raise ConfigError("gpu.source = \"nvml\" but %s" % reason)
        return cls(profile, fallback_reason=reason)

    @property
    def simulated(self) -> bool:
        return self._nvml is None

    @property
    def gpu_count(self) -> int:
        return len(self._handles) if self._nvml is not None else len(self._sim)

    def close(self) -> None:
        if self._nvml is not None:
            nvml, self._nvml = self._nvml, None
            self._handles = []
            nvml.nvmlShutdown()

    def describe_source(self) -> dict:
        """What the telemetry reads, for `meshnode status` and logs (canonical-encodable)."""
        if self._nvml is not None:
            try:
                driver = self._nvml.nvmlSystemGetDriverVersion()
            except self._nvml.NVMLError:
                driver = ""
            if isinstance(driver, bytes):
                driver = driver.decode("utf-8", "replace")
            return {"source": "nvml", "driver": driver,
                    "gpus": len(self._handles), "models": list(self._names),
                    "unsupported": ["gpu%d.%s" % pair for pair in sorted(self.unsupported)]}
        return {"source": "simulated", "gpus": len(self._sim), "models": [self.profile.model] * len(self._sim),
                "seed": self.profile.seed, "fallback_reason": self.fallback_reason, "unsupported": [],
                "faults": {"gpu%d" % i: gpu.fault.describe() for i, gpu in enumerate(self._sim)
                           if gpu.fault is not None}}

    def set_simulated_fault(self, fault: SimulatedFault | None, gpu_index: int | None = None) -> list[int]:
        """Force readings on one simulated GPU, or all (``gpu_index`` None); None clears them.
        Returns the GPU indices changed. A GPU read through NVML reports what it measures:
        forcing it is refused, so a tester cannot make a real node lie in its signed vector."""
        if self._nvml is not None:
            raise MeshError("this node reads its GPUs through NVML: telemetry faults apply to simulated GPUs only")
        if gpu_index is not None and not 0 <= gpu_index < len(self._sim):
            raise MeshError("no simulated GPU %d on this node (it has %d)" % (gpu_index, len(self._sim)))
        indices = list(range(len(self._sim))) if gpu_index is None else [gpu_index]
        for index in indices:
            self._sim[index].fault = fault
        return indices

    def set_load(self, gpu_index: int, util_milli: int, mem_used_mib: int) -> None:
        """Declare the load the workloads on a simulated GPU put on it (the driver calls this on
        start/stop). Real GPUs report their own load through NVML, so there it is ignored."""
        if self._nvml is not None:
            return
        if not 0 <= gpu_index < len(self._sim):
            raise ConfigError("set_load: no simulated GPU %d (profile has %d)" % (gpu_index, len(self._sim)))
        gpu = self._sim[gpu_index]
        gpu.load_util_milli = _clamp(util_milli, _UTIL_MILLI_MAX)
        gpu.load_mem_mib = _clamp(mem_used_mib, gpu.mem_total_mib)

    def sample(self, now_ms: int) -> tuple[GpuState, ...]:
        if self._nvml is not None:
            return tuple(self._sample_nvml(i, h) for i, h in enumerate(self._handles))
        elapsed_ms = 0 if self._last_sample_ms is None else max(0, now_ms - self._last_sample_ms)
        self._last_sample_ms = now_ms
        for index, gpu in enumerate(self._sim):
            if gpu.fault is not None and gpu.fault.read_error:
                raise TelemetryError("GPU %d: simulated read error (meshnode testnet telemetry)" % index)
        return tuple(self._sample_sim(i, gpu, elapsed_ms) for i, gpu in enumerate(self._sim))

    # --- NVML -------------------------------------------------------------------------------

    def _name(self, handle) -> str:
        name = self._nvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):  # older bindings return bytes
            name = name.decode("utf-8", "replace")
        return name[:96]

    def _call_optional(self, index: int, field: str, fn, *args):
        """Call an NVML getter; a field this card does not support reads as None (then 0)."""
        nvml = self._nvml
        try:
            return fn(*args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission):
            self.unsupported.add((index, field))
            return None
        except nvml.NVMLError as exc:
            raise TelemetryError("GPU %d: reading %s failed: %s" % (index, field, exc)) from None

    def _sample_nvml(self, index: int, handle) -> GpuState:
        nvml = self._nvml
        get = self._call_optional
        memory = get(index, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        util = get(index, "utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
        temp_c = get(index, "temperature", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        sm_clock = get(index, "sm_clock", nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
        # Newer NVML renamed "throttle reasons" to "clocks event reasons"; the bits are the same.
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = get(index, "throttle_reasons", reasons_fn, handle)
        # Uncorrected errors since the driver loaded: the count that says this GPU is failing now.
        ecc = get(index, "ecc_errors", nvml.nvmlDeviceGetTotalEccErrors, handle,
                  nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        power_mw = get(index, "power", nvml.nvmlDeviceGetPowerUsage, handle)
        return GpuState(
            index=index, model=self._names[index],
            mem_total_mib=_clamp(memory.total // _MIB, 1 << 24) if memory else 0,
            mem_used_mib=_clamp(memory.used // _MIB, 1 << 24) if memory else 0,
            util_milli=_clamp(util.gpu * 1000, _UTIL_MILLI_MAX) if util else 0,
            temp_milli_c=_clamp((temp_c or 0) * 1000, _TEMP_MILLI_C_MAX),
            sm_clock_mhz=_clamp(sm_clock or 0, 100_000),
            throttle_reasons=_clamp(reasons or 0, (1 << 64) - 1),
            ecc_errors=_clamp(ecc or 0, (1 << 63) - 1),
            power_mw=_clamp(power_mw or 0, _POWER_MW_MAX),
        )

    # --- simulated profile --------------------------------------------------------------------

    def _sample_sim(self, index: int, gpu: _SimulatedGpu, elapsed_ms: int) -> GpuState:
        load = gpu.load_util_milli
        fault = gpu.fault or SimulatedFault()
        # The jitter is drawn whether or not a fault replaces the reading: forcing one GPU
        # leaves the random series, and so every other GPU's readings, as they were.
        jitter = self._random.randint(-SIM_UTIL_JITTER_MILLI, SIM_UTIL_JITTER_MILLI) if load else 0
        util = _clamp(load + jitter, _UTIL_MILLI_MAX) if fault.util_milli is None else fault.util_milli
        target = SIM_IDLE_TEMP_MILLI_C + (SIM_FULL_LOAD_TEMP_MILLI_C - SIM_IDLE_TEMP_MILLI_C) * util // _UTIL_MILLI_MAX
        # Implicit Euler step of dT/dt = (target - T) / tau: stable for any elapsed time.
        gpu.temp_milli_c += (target - gpu.temp_milli_c) * elapsed_ms // (SIM_THERMAL_TAU_MS + elapsed_ms)
        temp = gpu.temp_milli_c + self._random.randint(-SIM_TEMP_JITTER_MILLI_C, SIM_TEMP_JITTER_MILLI_C)
        if fault.temp_milli_c is not None:
            # The model continues from the forced temperature, so a cleared GPU cools with the lag.
            gpu.temp_milli_c = temp = fault.temp_milli_c
        throttle = THROTTLE_GPU_IDLE if util == 0 else 0
        power = SIM_IDLE_POWER_MW + (SIM_MAX_POWER_MW - SIM_IDLE_POWER_MW) * util // _UTIL_MILLI_MAX
        clock = SIM_IDLE_SM_CLOCK_MHZ + (SIM_BOOST_SM_CLOCK_MHZ - SIM_IDLE_SM_CLOCK_MHZ) * util // _UTIL_MILLI_MAX
        return GpuState(index=index, model=self.profile.model, mem_total_mib=gpu.mem_total_mib,
                        mem_used_mib=gpu.load_mem_mib, util_milli=util,
                        temp_milli_c=_clamp(temp, _TEMP_MILLI_C_MAX), sm_clock_mhz=clock,
                        throttle_reasons=throttle if fault.throttle_reasons is None else fault.throttle_reasons,
                        ecc_errors=fault.ecc_errors or 0, power_mw=power)
