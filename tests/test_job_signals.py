"""SPEC.md R3a: a job's own load, reported through the SDK, in its primary's signed vector,
and reflex rules on it (request_rate, request_latency_ms, progress_rate), evaluated and
checked exactly as the GPU signals are."""

import dataclasses

import pytest

from meshnode.workload.manifest import ManifestError, parse_manifest
from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.messages import MAX_RUNNING_LISTED, CapabilityVector, JobSignals, RunningJob, decode_message
from protocol.reflexes import condition_holds
from testnet import spec_tables
from tests.test_mesh_core import KEYS, MESH
from tests.test_reflex import reflex_moves, rule, running_reflex_job
from tests.test_spec_vectors import MESH_ID, SPEC


def signals(jid, latency_ms=0.0, rate=0.0, progress=0.0):
    return JobSignals(job_id=jid, request_rate_milli=int(rate * 1000), latency_p99_us=int(latency_ms * 1000),
                      progress_rate_milli=int(progress * 1000))


def report(net, jid, primary, ms, every_ms=250, **load):
    """Every node reads idle GPUs for ``ms``; the primary carries the job's reported ``load``."""
    for _ in range(ms // every_ms):
        for key, core in net.cores.items():
            reported = (signals(jid, **load),) if key == primary and load else ()
            net.emit(key, core.update_telemetry(core.capability._gpu_states(), 0, net.now, job_signals=reported))
        net.run(every_ms)


def test_r3a_the_spec_vector_decodes_to_the_sample_jobs_report():
    block = dict(line.split(": ", 1) for line in
                 spec_tables.generated_block(SPEC, "job signals vector").strip("`\n").splitlines())
    _envelope, cap = decode_message(bytes.fromhex(block["envelope"]), MESH_ID, expect=CapabilityVector)
    assert cap.job_signals == (JobSignals(job_id=spec_tables.sample_job_id(), request_rate_milli=12_500,
                                          latency_p99_us=40_250, progress_rate_milli=3_000),)
    assert codec.pack(cap.to_body()).hex() == block["body"]


def _body(cap_body, job_signals):
    return {**cap_body, "job_signals": job_signals}


def test_r3a_a_vector_without_reports_keeps_its_encoding_and_bad_reports_are_refused():
    cap_body = spec_tables.sample_body(CapabilityVector)
    assert "job_signals" not in cap_body
    cap = CapabilityVector.from_body(cap_body)
    assert cap.job_signals == () and "job_signals" not in cap.to_body()
    running = cap.running[0].job_id
    one = {"job_id": running, "request_rate_milli": 1, "latency_p99_us": 2, "progress_rate_milli": 3}
    assert CapabilityVector.from_body(_body(cap_body, [one])).job_signals[0].latency_p99_us == 2
    with pytest.raises(RemoteProtocolError, match="job_signals: an empty list is left out"):
        CapabilityVector.from_body(_body(cap_body, []))
    with pytest.raises(RemoteProtocolError, match="each job at most once"):
        CapabilityVector.from_body(_body(cap_body, [one, one]))
    with pytest.raises(RemoteProtocolError, match="only jobs listed in running"):
        CapabilityVector.from_body(_body(cap_body, [dict(one, job_id=b"\x09" * 32)]))
    with pytest.raises(RemoteProtocolError, match="job_signals"):   # a flood: more than running may list
        CapabilityVector.from_body(_body(cap_body, [dict(one, job_id=bytes([i]) * 32)
                                                    for i in range(MAX_RUNNING_LISTED + 1)]))
    with pytest.raises(RemoteProtocolError, match="latency_p99_us"):
        CapabilityVector.from_body(_body(cap_body, [dict(one, latency_p99_us=1 << 41)]))
    with pytest.raises(RemoteProtocolError, match="unknown fields"):
        CapabilityVector.from_body(_body(cap_body, [dict(one, queue_depth=4)]))


def test_r3a_condition_reads_the_rules_job_only_and_never_a_vector_without_its_report():
    cap = CapabilityVector.from_body(spec_tables.sample_body(CapabilityVector))
    jid = cap.running[0].job_id
    with_report = dataclasses.replace(cap, job_signals=(signals(jid, latency_ms=60, rate=120, progress=5),))
    assert condition_holds(rule(signal="request_latency_ms", above=50), with_report, jid)
    assert not condition_holds(rule(signal="request_latency_ms", above=60), with_report, jid)   # > not >=
    assert condition_holds(rule(signal="request_rate", above=100), with_report, jid)
    assert condition_holds(dataclasses.replace(rule(signal="progress_rate", above=0), above=None, below=6),
                           with_report, jid)
    assert not condition_holds(rule(signal="request_latency_ms", above=50), with_report, b"\x09" * 32)
    assert not condition_holds(rule(signal="request_latency_ms", above=50), with_report)    # a target's check
    assert not condition_holds(dataclasses.replace(rule(signal="progress_rate"), above=None, below=1000), cap, jid)


def test_r3a_high_request_latency_for_the_rules_duration_moves_the_job_once():
    net, jid, primary = running_reflex_job(rule(signal="request_latency_ms", above=50, for_ms=2000))
    report(net, jid, primary, 3500, latency_ms=80.0, rate=200.0)
    moves = [reflex_moves(net, k) for k in KEYS]
    assert all(len(m) == 1 and m[0].value == moves[0][0].value for m in moves)
    assert moves[0][0].value.from_node == primary
    moved = [e for e in net.events[KEYS[2]] if e.kind == "moved"]
    assert moved[-1].detail["signal"] == "request_latency_ms" and moved[-1].detail["held_ms"] >= 2000


def test_r3a_latency_just_below_the_threshold_or_no_report_moves_nothing():
    net, jid, primary = running_reflex_job(rule(signal="request_latency_ms", above=50, for_ms=1000))
    report(net, jid, primary, 3000, latency_ms=50.0, rate=200.0)   # at the threshold: not above it
    report(net, jid, primary, 3000)                                # the workload reports nothing
    for _ in range(3):                                             # above, but never for 1 s in a row
        report(net, jid, primary, 750, latency_ms=90.0)
        report(net, jid, primary, 500, latency_ms=10.0)
    assert not any(reflex_moves(net, k) for k in KEYS)
    assert all(c.job_view(jid)["primary"] == primary for c in net.cores.values())


def test_r3a_evidence_of_a_job_signal_is_checked_by_validators():
    net, jid, primary = running_reflex_job(rule(signal="request_rate", above=100, for_ms=1000, cooldown_ms=0))
    for core in net.cores.values():
        core.moves.notice_reflexes = lambda *args: None   # nobody triggers: the test checks the evidence
    report(net, jid, primary, 2000, rate=150.0)
    history = net.cores[primary].capability.history.of(primary)
    busy = [env for env, cap in history if cap.job_signals]
    from protocol.reflexes import evidence_error
    r = net.cores[KEYS[2]].job_table.get(jid).manifest.reflexes[0]
    assert evidence_error(r, tuple(busy), primary, jid, 1, MESH, None) is None
    quiet = dataclasses.replace(r, above=200)   # the same vectors do not prove a higher threshold
    assert "does not show the condition" in evidence_error(quiet, tuple(busy), primary, jid, 1, MESH, None)


def test_r3a_manifest_accepts_job_signals_and_still_refuses_an_unknown_one():
    base = 'name = "svc"\nentrypoint = "serve"\n[resources]\ngpus = 0\ncpu_milli = 100\nmem_mib = 64\n'
    manifest = parse_manifest(base + '[[reflex]]\nsignal = "request_latency_ms"\nabove = 50\nfor_ms = 1000\n'
                                   'action = "migrate"\n', b"\x01" * 32, 0, epoch=0)
    assert manifest.reflexes[0].signal == "request_latency_ms"
    with pytest.raises(ManifestError, match=r"reflex\[0\]\.signal"):
        parse_manifest(base + '[[reflex]]\nsignal = "queue_depth"\nabove = 5\nfor_ms = 1000\naction = "migrate"\n',
                       b"\x01" * 32, 0, epoch=0)


def test_the_driver_carries_fresh_reports_of_the_jobs_it_runs_only():
    """meshnode/node/driver.py: the runner's fresh reports become the JobSignals the next
    vector carries, for the jobs this node runs (a stopped job's last report is not)."""
    from types import SimpleNamespace
    from meshnode.node.driver import SIGNALS_FRESH_MS, Node
    running, stopped = b"\x01" * 32, b"\x02" * 32
    asked = []
    node = object.__new__(Node)
    node.runner = SimpleNamespace(fresh_signals=lambda max_age_s: asked.append(max_age_s) or
                                  {stopped: (1, 2, 3), running: (12_500, 40_250, 3_000)})
    node.job_fences = {running: 1}
    assert node._job_signals() == (JobSignals(job_id=running, request_rate_milli=12_500, latency_p99_us=40_250,
                                              progress_rate_milli=3_000),)
    assert asked == [SIGNALS_FRESH_MS / 1000]
    node.runner = None   # a node that runs no workloads reports none
    assert node._job_signals() == ()
