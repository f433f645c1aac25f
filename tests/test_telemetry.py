"""GPU telemetry: the NVML path (with a fake pynvml module, as this machine has no GPU),
the fallback to the simulated profile, and the simulated profile's response to load."""

import sys
import types

import pytest

from keys.errors import ConfigError
from meshnode.node.config import GpuProfile
from meshnode.node.telemetry import SIM_FULL_LOAD_TEMP_MILLI_C, SIM_IDLE_TEMP_MILLI_C, Telemetry, TelemetryError
from protocol.messages import GpuState

MIB = 1 << 20


def fake_pynvml(fail_init=False, lost_gpu=False):
    """A pynvml stand-in with two GPUs: an H100 that supports everything and a consumer card
    without ECC or power readings (NVMLError_NotSupported), as real cards behave."""
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_NoPermission(NVMLError):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    module.NVMLError, module.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    module.NVMLError_NoPermission = NVMLError_NoPermission
    module.NVML_TEMPERATURE_GPU, module.NVML_CLOCK_SM = 0, 1
    module.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, module.NVML_VOLATILE_ECC = 1, 0
    module.calls = []
    cards = [
        dict(name="NVIDIA H100 80GB HBM3", total=81559 * MIB, used=10240 * MIB, util=87, temp=64,
             clock=1980, reasons=0x4, ecc=2, power=412_345),
        dict(name=b"NVIDIA GeForce RTX 4090", total=24564 * MIB, used=512 * MIB, util=0, temp=38,
             clock=210, reasons=0x1, ecc=None, power=None),
    ]

    def init():
        module.calls.append("init")
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    def field(name):
        def get(handle, *args):
            if lost_gpu and name == "temp":
                raise NVMLError_GpuIsLost("GPU is lost")
            value = cards[handle][name]
            if value is None:
                raise NVMLError_NotSupported("Not Supported")
            return value
        return get

    module.nvmlInit = init
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    module.nvmlDeviceGetCount = lambda: len(cards)
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetName = field("name")
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=cards[h]["total"], used=cards[h]["used"])
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=cards[h]["util"], memory=0)
    module.nvmlDeviceGetTemperature = field("temp")
    module.nvmlDeviceGetClockInfo = field("clock")
    module.nvmlDeviceGetCurrentClocksEventReasons = field("reasons")
    module.nvmlDeviceGetTotalEccErrors = field("ecc")
    module.nvmlDeviceGetPowerUsage = field("power")
    return module


def test_nvml_path_reads_integers_and_reports_unsupported_fields(monkeypatch):
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    telemetry = Telemetry.open(GpuProfile(source="auto", count=3))
    assert not telemetry.simulated and telemetry.gpu_count == 2
    h100, rtx = telemetry.sample(now_ms=1000)
    assert h100 == GpuState(index=0, model="NVIDIA H100 80GB HBM3", mem_total_mib=81559, mem_used_mib=10240,
                            util_milli=87_000, temp_milli_c=64_000, sm_clock_mhz=1980, throttle_reasons=0x4,
                            ecc_errors=2, power_mw=412_345)
    assert rtx.model == "NVIDIA GeForce RTX 4090" and rtx.ecc_errors == 0 and rtx.power_mw == 0
    assert rtx.throttle_reasons == 0x1 and rtx.mem_total_mib == 24564
    source = telemetry.describe_source()
    assert source["source"] == "nvml" and source["driver"] == "550.54.15" and source["gpus"] == 2
    assert source["unsupported"] == ["gpu1.ecc_errors", "gpu1.power"]
    telemetry.set_load(0, 50_000, 100)  # real GPUs report their own load: ignored
    assert telemetry.sample(now_ms=2000)[0] == h100
    telemetry.close()
    telemetry.close()
    assert nvml.calls == ["init", "shutdown"]


def test_lost_gpu_is_a_telemetry_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(lost_gpu=True))
    telemetry = Telemetry.open(GpuProfile(source="nvml"))
    with pytest.raises(TelemetryError, match="GPU 0: reading temperature failed: GPU is lost"):
        telemetry.sample(now_ms=0)


def test_no_gpu_falls_back_to_the_simulated_profile(monkeypatch):
    nvml = fake_pynvml(fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    telemetry = Telemetry.open(GpuProfile(source="auto", model="H100-SIM", count=2, mem_mib=81920))
    assert telemetry.simulated and telemetry.gpu_count == 2
    source = telemetry.describe_source()
    assert source["source"] == "simulated" and "NVML Shared Library Not Found" in source["fallback_reason"]
    telemetry.close()
    assert nvml.calls == ["init"]  # no shutdown for an init that failed


def test_nvml_required_but_absent_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail_init=True))
    with pytest.raises(ConfigError, match='gpu.source = "nvml" but NVML unavailable'):
        Telemetry.open(GpuProfile(source="nvml"))


def test_real_pynvml_without_gpu_falls_back():
    # This machine has no GPU: the installed nvidia-ml-py raises NVMLError from nvmlInit.
    telemetry = Telemetry.open(GpuProfile(source="auto", count=1))
    if not telemetry.simulated:
        pytest.skip("a GPU answers NVML here")
    assert telemetry.describe_source()["fallback_reason"].startswith("NVML unavailable")


def test_simulated_source_never_touches_nvml(monkeypatch):
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert Telemetry.open(GpuProfile(source="simulated")).simulated and nvml.calls == []


def run_profile(seed):
    telemetry = Telemetry.open(GpuProfile(source="simulated", model="SIM", count=2, mem_mib=16384, seed=seed))
    series = [telemetry.sample(0)]
    telemetry.set_load(1, 95_000, 12_000)
    series += [telemetry.sample(ms) for ms in range(1_000, 60_001, 1_000)]
    telemetry.set_load(1, 0, 0)
    series += [telemetry.sample(ms) for ms in range(61_000, 120_001, 1_000)]
    return series


def test_simulated_gpus_respond_to_load():
    series = run_profile(seed=3)
    idle, loaded, cooled = series[0][1], series[60][1], series[-1][1]
    assert idle.util_milli == 0 and idle.throttle_reasons == 1 and idle.mem_used_mib == 0
    assert abs(idle.temp_milli_c - SIM_IDLE_TEMP_MILLI_C) <= 1_000
    assert 93_000 <= loaded.util_milli <= 97_000 and loaded.mem_used_mib == 12_000 and loaded.throttle_reasons == 0
    assert loaded.power_mw > idle.power_mw and loaded.sm_clock_mhz > idle.sm_clock_mhz
    # After 60 s (7.5 time constants) the temperature has settled near the loaded target.
    target = SIM_IDLE_TEMP_MILLI_C + (SIM_FULL_LOAD_TEMP_MILLI_C - SIM_IDLE_TEMP_MILLI_C) * 95 // 100
    assert abs(loaded.temp_milli_c - target) <= 2_000
    temps = [s[1].temp_milli_c for s in series[1:12]]
    assert temps == sorted(temps)  # heating is gradual, not a jump (jitter << the step)
    assert cooled.util_milli == 0 and abs(cooled.temp_milli_c - SIM_IDLE_TEMP_MILLI_C) <= 2_000
    assert all(s[0].util_milli == 0 for s in series)  # the other GPU stayed idle


def test_simulated_profile_is_deterministic_given_its_seed():
    assert run_profile(seed=11) == run_profile(seed=11)
    assert run_profile(seed=11) != run_profile(seed=12)


def test_set_load_is_clamped_and_checked():
    telemetry = Telemetry.open(GpuProfile(source="simulated", count=1, mem_mib=1000))
    telemetry.set_load(0, 250_000, 5_000)
    state = telemetry.sample(0)[0]
    assert state.util_milli <= 100_000 and state.mem_used_mib == 1000
    with pytest.raises(ConfigError, match="no simulated GPU 1"):
        telemetry.set_load(1, 0, 0)
