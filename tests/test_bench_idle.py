"""`meshnode bench idle`: what it counts (the measuring itself needs a testnet: BENCHMARKS.md)."""

import pytest

from protocol.errors import MeshError
from testnet.bench_idle import QuietWatch, run_idle_bench


def test_counts_suspicions_and_each_eviction_once():
    watch = QuietWatch()
    for index in range(3):
        watch.on_event(index, {"kind": "suspect", "detail": {"suspect": "ab", "silent_ms": 250}})
        watch.on_event(index, {"kind": "decided", "detail": {"value_kind": "eviction", "instance": "e1"}})
        watch.on_event(index, {"kind": "decided", "detail": {"value_kind": "placement", "instance": "p1"}})
    assert (watch.suspicions, len(watch.evictions)) == (3, 1)


@pytest.mark.parametrize("nodes, seconds", [(0, 60), (65, 60), (4, 0), (4, 4000)])
def test_bad_arguments_are_refused_before_any_testnet_starts(nodes, seconds, tmp_path):
    with pytest.raises(MeshError):
        run_idle_bench(nodes, seconds, root=tmp_path / "net")
    assert not (tmp_path / "net").exists()
