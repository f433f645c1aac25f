#!/bin/bash
# NVML check on a real GPU host (BENCHMARKS.md "NVML on an H100"): run from the repository root.
# The host needs python3 with pynvml (nvidia-ml-py), msgpack and torch (for the load);
# wheels for pynacl, base58, trio and pytest-trio are taken from .devcheck/wheels
# (`pip download ... -d .devcheck/wheels` on a machine with a package index).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/devcheck.log") 2>&1
date -u; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,power.draw,ecc.errors.uncorrected.volatile.total --format=csv
python3 -m pip install -q --no-index --find-links .devcheck/wheels --target /tmp/site pynacl base58 trio pytest-trio 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import pynvml, nacl, msgpack; print('pynvml', getattr(pynvml,'__version__','?'), 'msgpack', msgpack.version)"
echo "== idle, source=nvml, 8 s at 100 ms"
python3 -c "
import json; from testnet.bench_telemetry import run_telemetry_bench
print(json.dumps(run_telemetry_bench('nvml', 8, 100), indent=1, sort_keys=True))" > "$OUT/idle.json"; cat "$OUT/idle.json"
echo "== under load (torch matmul), source=auto, 20 s at 100 ms"
python3 - <<'PY' &
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
keep = torch.empty(int(30e9) // 2, dtype=torch.bfloat16, device="cuda")   # ~30 GB so memory shows
end = time.time() + 22
while time.time() < end:
    for _ in range(50): c = a @ b
    torch.cuda.synchronize()
print("load done", flush=True)
PY
LOADPID=$!
sleep 2
python3 -c "
import json; from testnet.bench_telemetry import run_telemetry_bench
print(json.dumps(run_telemetry_bench('auto', 18, 100), indent=1, sort_keys=True))" > "$OUT/load.json"; cat "$OUT/load.json"
wait $LOADPID
echo "== the node's own telemetry tests with the real pynvml importable"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_telemetry.py tests/test_gpu_health.py tests/test_bench_telemetry.py
echo "== event-loop lateness: NVML reads in the loop vs in a worker thread (torch load restarted)"
python3 -c "import time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a); end = time.time() + 40
while time.time() < end:
    [a @ b for _ in range(50)]; torch.cuda.synchronize()" &
sleep 3; python3 docs/gpu-check/loop_stall.py > "$OUT/stall.json"; cat "$OUT/stall.json"; wait 2>&1 | tail -15
date -u
