"""`meshnode bench reflex` figures that need no testnet: how false triggers are counted
during the hold, the pending clone figures, and the hold's bounds."""

import pytest

from protocol.errors import MeshError
from testnet.bench_reflex import BELOW_MILLI_C, PENDING_CLONE_FIGURES, reflex_moves_since, run_reflex_bench


def moved(index, fence, mono_ns, reflex=True, job="ab" * 32):
    detail = {"job_id": job, "fence": fence, "mono_ns": mono_ns}
    if reflex:
        detail.update(reflex=0, signal="gpu_temp", held_ms=1000)
    return index, {"kind": "moved", "detail": detail}


def test_each_reflex_move_counts_once_however_many_nodes_report_it():
    events = [moved(i, 3, 150) for i in range(4)]                 # one move, reported by 4 nodes
    events += [moved(i, 4, 250) for i in range(3)]                # a second one
    events += [moved(0, 2, 50)]                                   # before the hold: not counted
    events += [moved(1, 5, 300, reflex=False)]                    # an owner's move: not a reflex
    events += [(2, {"kind": "job_started", "detail": {"mono_ns": 400}})]
    assert reflex_moves_since(events, 100) == 2
    assert reflex_moves_since(events, 1000) == 0
    assert reflex_moves_since([moved(0, 3, 150, job="cd" * 32)] + events, 100) == 3


def test_the_hold_is_just_below_the_rule_and_clone_figures_are_pending():
    assert BELOW_MILLI_C < 85_000 <= BELOW_MILLI_C + 1000
    assert PENDING_CLONE_FIGURES == {"clone_ms": None, "rerouted_share": None, "decay_ms": None, "pending": "clone"}
    with pytest.raises(MeshError, match="--hold-s"):
        run_reflex_bench(4, 1, hold_s=-1)
