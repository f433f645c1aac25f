"""`meshnode bench telemetry`: the node's own GPU reading path, as an operator runs it on a
GPU host (BENCHMARKS.md has an H100's figures). Here: the simulated profile and a fake NVML."""

import sys

import pytest

from keys.errors import ConfigError
from testnet.bench_telemetry import run_telemetry_bench
from tests.test_telemetry import fake_pynvml


def test_the_simulated_profile_is_read_signed_and_decoded_and_said_to_be_simulated(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail_init=True))
    result = run_telemetry_bench("auto", seconds=0.25, period_ms=50)
    assert result["source"] == "simulated" and "NVML unavailable" in result["fallback_reason"]
    assert result["samples"] >= 1 and result["read_errors"] == 0
    assert result["sample_ms"]["n"] == result["sign_verify_ms"]["n"] == result["samples"]
    assert result["gpus"]["gpu0"]["model"] == "SIM-GPU"


def test_a_card_with_ecc_errors_and_a_missing_power_reading_is_reported_as_read(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    result = run_telemetry_bench("nvml", seconds=0.1, period_ms=50)
    assert result["source"] == "nvml" and result["driver"] == "550.54.15"
    h100, consumer = result["gpus"]["gpu0"], result["gpus"]["gpu1"]
    assert h100["ecc_errors_max"] == 2 and h100["temp_milli_c"] == {"min": 64_000, "max": 64_000}
    assert result["health_faults"] == ["gpu0: 2 ECC errors"] and result["unhealthy_samples"] == result["samples"]
    assert "gpu1.power" in result["unsupported"] and consumer["power_mw"] == {"min": 0, "max": 0}


def test_nvml_asked_for_without_a_gpu_and_bad_periods_are_clear_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail_init=True))
    with pytest.raises(ConfigError, match='gpu.source = "nvml" but NVML unavailable'):
        run_telemetry_bench("nvml", seconds=1, period_ms=100)
    with pytest.raises(ConfigError, match="must be positive"):
        run_telemetry_bench("auto", seconds=0, period_ms=100)
