"""`meshnode bench reflex` figures that need no testnet: how false triggers are counted
during the hold, the clone/reroute/decay figures from events, endpoint tables and load
reports, and the hold's bounds."""

import pytest

from protocol.errors import MeshError
from meshnode.workload.manifest import parse_manifest
from testnet.bench_clone import (CLONE_FOR_MS, DECAY_FOR_MS, answered_share, clone_figures, clone_manifest, clone_ms,
                                 reflex_replica_actions_since,
                                 replica_action_after, weight_share)
from testnet.bench_reflex import BELOW_MILLI_C, reflex_moves_since, run_reflex_bench


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


def test_the_hold_is_just_below_the_rule_and_its_bounds_are_checked():
    assert BELOW_MILLI_C < 85_000 <= BELOW_MILLI_C + 1000
    with pytest.raises(MeshError, match="--hold-s"):
        run_reflex_bench(4, 1, hold_s=-1)


def test_clone_ms_counts_from_the_moment_the_condition_has_held_its_duration():
    hot_ns = 5_000_000_000
    assert clone_ms(hot_ns, 1000, hot_ns + 1_750_000_000) == 750.0
    assert clone_ms(hot_ns, 5000, hot_ns + 5_000_000_000) == 0.0


def test_rerouted_share_is_the_clones_part_of_the_answered_requests_and_the_weights_ask_for_it():
    report = {"targets": [{"target": "127.0.0.1:18400", "ok": 45, "sent": 50},
                          {"target": "127.0.0.3:18400", "ok": 255, "sent": 260}]}
    assert answered_share(report, {"127.0.0.3:18400"}) == 0.85
    assert answered_share(report, {"127.0.0.2:18400"}) == 0.0
    assert answered_share({"targets": [{"target": "127.0.0.3:18400", "ok": 0}]}, {"127.0.0.3:18400"}) is None
    # clone 1, reroute 50 %, decay the original 50 %: 250 against 1500 (SPEC.md R4d)
    table = [{"replica": 0, "weight": 250}, {"replica": 1, "weight": 1500}]
    assert weight_share(table, {1}) == 1500 / 1750
    assert weight_share([{"replica": 0, "weight": 0}], {0}) is None


def test_replica_actions_are_matched_by_job_time_and_kind():
    def action(job, mono_ns, **detail):
        return 2, {"kind": "replica_action", "detail": dict(job_id=job, mono_ns=mono_ns, **detail)}
    added = replica_action_after(lambda d: d.get("added"), "ab" * 32, 100)
    assert added(*action("ab" * 32, 150, added=[1]))
    assert not added(*action("ab" * 32, 50, added=[1]))          # before the load
    assert not added(*action("cd" * 32, 150, added=[1]))         # another job
    assert not added(*action("ab" * 32, 150, added=[]))          # a reroute or decay
    assert not added(2, {"kind": "moved", "detail": {"job_id": "ab" * 32, "mono_ns": 150, "added": [1]}})


def test_clone_figures_summarise_the_rounds_and_skip_a_failed_one():
    rounds = [{"clone_ms": 400.0, "clone_decided_ms": 300.0, "rerouted_share": 0.8, "rerouted_share_expected": 0.85,
               "decay_ms": 1900.0},
              {"clone_ms": 600.0, "clone_decided_ms": 500.0, "rerouted_share": 0.9, "rerouted_share_expected": 0.85,
               "decay_ms": 2100.0},
              {"failed": "no clone within 60 s"}]
    figures = clone_figures(rounds)
    assert figures["clone_ms"] == {"p50": 400.0, "p99": 600.0, "max": 600.0, "n": 2}
    assert figures["clone_rounds_failed"] == 1
    assert figures["rerouted_share"] == 0.85 and figures["rerouted_share_expected"] == 0.85
    assert figures["decay_ms"]["n"] == 2 and figures["decay_rule_duration_ms"] == DECAY_FOR_MS
    assert clone_figures([])["clone_ms"]["n"] == 0 and clone_figures([])["rerouted_share"] is None


def test_the_clone_rounds_manifest_is_a_valid_job_with_the_issues_rules():
    job = parse_manifest(clone_manifest(18_400).format(nonce=7), b"\x01" * 32, 0, epoch=0)
    assert job.service.port == 18_400 and job.service.max_replicas == 2
    assert [(r.action, r.amount) for r in job.reflexes] == [("clone", 1), ("reroute", 50), ("decay", 50),
                                                           ("decay", 100)]
    assert job.reflexes[0].for_ms == CLONE_FOR_MS and job.reflexes[3].for_ms == DECAY_FOR_MS


def test_replica_false_triggers_count_each_rule_action_once_and_no_fill():
    def action(index, seq, mono_ns, job="ab" * 32, reflex=True):
        detail = {"job_id": job, "seq": seq, "mono_ns": mono_ns, "action": "clone", "added": [1]}
        if reflex:
            detail.update(reflex=0, signal="gpu_util", held_ms=1000)
        return index, {"kind": "replica_action", "detail": detail}
    events = [action(i, 0, 150) for i in range(4)]       # one clone, reported by 4 nodes
    events += [action(1, 1, 200, reflex=False)]          # a fill (min_replicas): no rule acted
    events += [action(2, 2, 50)]                         # before the hold
    events += [action(0, 3, 300, job="cd" * 32)]         # another job
    assert reflex_replica_actions_since(events, "ab" * 32, 100) == 1
    assert reflex_replica_actions_since(events, "ab" * 32, 400) == 0
