"""The built-in `serve` workload (meshnode/workload/serve.py) and the SDK's load report
(SPEC.md 9.4a): request accounting, the SIGNALS frame, the runner reading it."""

import http.client
import re
import socket
import threading
import time
import types

import pytest
import trio
import trio.testing

from meshnode.node.runner import RunningWorkload, WorkloadRunner
from meshnode.workload import sdk
from meshnode.workload.serve import (SERVE_STATE, LoadWindow, decode_serve_state, run_serve, service_port)
from protocol.errors import RemoteProtocolError

SPEC = open(__file__.rsplit("/tests/", 1)[0] + "/SPEC.md", encoding="utf-8").read()


# --- request accounting -----------------------------------------------------------------------

def test_load_window_counts_rate_p99_and_in_flight_over_its_window():
    load = LoadWindow(window_s=5.0)
    for i in range(100):                       # 100 requests answered in [0, 1) s: 1..100 ms each
        load.started()
        load.finished(i / 100, (i + 1) / 1000)
    load.started()                             # one still in flight
    snap = load.snapshot(1.0)
    assert snap["request_rate"] == 100 / 5.0
    assert snap["latency_p99_ms"] == pytest.approx(100.0)
    assert (snap["in_flight"], snap["served"], snap["errors"]) == (1, 100, 0)
    load.finished(1.5, 0.002, ok=False)        # an error counts, but not as an answered request
    snap = load.snapshot(5.495)                 # the first half of the requests left the window
    assert snap["request_rate"] == 50 / 5.0 and snap["latency_p99_ms"] == pytest.approx(100.0)
    assert (snap["in_flight"], snap["errors"]) == (0, 1)
    snap = load.snapshot(100.0)                # all of them gone: no rate, no latency
    assert (snap["request_rate"], snap["latency_p99_ms"], snap["served"]) == (0.0, 0.0, 100)


def test_load_window_state_round_trips_and_a_restore_goes_on_counting():
    load = LoadWindow(served=41, errors=2)
    load.started()
    load.finished(0.0, 0.001)
    state, progress = load.state()
    assert decode_serve_state(state) == (42, 2) and progress == 42
    with pytest.raises(RemoteProtocolError, match="serve state is 3 bytes"):
        decode_serve_state(b"abc")


def test_load_window_keeps_a_bounded_sample_under_a_flood():
    from meshnode.workload import serve
    load = LoadWindow(window_s=1e9)
    for i in range(serve.MAX_WINDOW_SAMPLES + 10):
        load.started()
        load.finished(float(i), 0.001)
    assert len(load._finished) == serve.MAX_WINDOW_SAMPLES and load.served == serve.MAX_WINDOW_SAMPLES + 10


def test_service_port_prefers_the_nodes_variable_and_refuses_a_bad_one():
    assert service_port(8080, {}) == 8080
    assert service_port(8080, {"MESHNODE_SERVICE_PORT": "9001"}) == 9001
    with pytest.raises(ValueError, match="MESHNODE_SERVICE_PORT"):
        service_port(8080, {"MESHNODE_SERVICE_PORT": "http"})


# --- the SIGNALS frame ------------------------------------------------------------------------

def test_9_4a_signals_frame_matches_the_spec_example():
    example = re.search(r"Example, 12.5 requests/s, p99 40.25 ms, 3 units/s:\n`([0-9a-f ]+)`", SPEC).group(1)
    frame = sdk.encode_signals(12.5, 40.25, 3.0)
    assert frame.hex() == example.replace(" ", "")
    length, frame_type = sdk.FRAME_HEADER.unpack_from(frame)
    assert (length, frame_type) == (len(frame) - 4, sdk.SIGNALS)
    assert sdk.decode_signals(frame[5:]) == (12_500, 40_250, 3_000)


def test_signals_are_clamped_and_a_wrong_length_is_refused():
    frame = sdk.encode_signals(-1.0, 1e30, 0.0004)
    assert sdk.decode_signals(frame[5:]) == (0, sdk.MAX_SIGNAL_VALUE, 0)
    over = sdk.SIGNALS_FIELDS.pack(1 << 50, 1, 2)
    assert sdk.decode_signals(over) == (sdk.MAX_SIGNAL_VALUE, 1, 2)
    with pytest.raises(RemoteProtocolError, match="SIGNALS frame body is 3 bytes"):
        sdk.decode_signals(b"abc")


def reading_runner():
    """(a runner with one job, the workload's end of its socket, the job): the runner's side
    of the SDK channel on a memory stream, no process."""
    workload_end, node_end = trio.testing.memory_stream_pair()
    info = RunningWorkload(job_id=b"\x01" * 32, entrypoint="serve", argv=[], pid=1, fence=1, gpus=(),
                           started_ms=0, seq=0, progress=0)
    job = types.SimpleNamespace(info=info, stream=node_end, reports_scope=trio.CancelScope())
    runner = object.__new__(WorkloadRunner)
    runner._jobs = {info.job_id: job}
    return runner, workload_end, job


async def test_runner_keeps_the_newest_report_and_ages_it_out(autojump_clock):
    runner, workload_end, job = reading_runner()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner._read_reports, job)
        frames = sdk.encode_signals(10, 20, 30) + sdk.encode_signals(12.5, 40.25, 3)
        await workload_end.send_all(frames[:7])          # a frame split across reads
        await trio.sleep(0.1)
        assert job.info.signals is None
        await workload_end.send_all(frames[7:])
        await trio.sleep(0.1)
        assert job.info.signals == (12_500, 40_250, 3_000)
        assert runner.fresh_signals(5.0) == {job.info.job_id: (12_500, 40_250, 3_000)}
        await trio.sleep(6)
        assert runner.fresh_signals(5.0) == {}              # stale: no longer the job's load
        await workload_end.aclose()
    assert job.info.reports_refused == ""


async def test_runner_drops_the_reports_of_a_workload_that_breaks_the_frame_rules(autojump_clock):
    runner, workload_end, job = reading_runner()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner._read_reports, job)
        await workload_end.send_all(sdk.encode_signals(1, 2, 3))
        await trio.sleep(0.1)
        assert job.info.signals == (1000, 2000, 3000)
        await workload_end.send_all(sdk.encode_frame(sdk.RESTORE, b"\x00" * 29))   # not the workload's to send
        await trio.sleep(0.1)
        assert job.info.signals is None and "not a SIGNALS frame" in job.info.reports_refused
        for _ in range(100):    # what it sends later is read (it never blocks) and dropped
            await workload_end.send_all(sdk.encode_signals(9, 9, 9))
        await trio.sleep(0.1)
        assert job.info.signals is None and runner.fresh_signals(5.0) == {}
        await workload_end.aclose()


# --- serving over HTTP on 127.0.0.1 -----------------------------------------------------------

class RecordingWorkload:
    """The SDK side a test stands in for: restored state, and what the workload offered."""

    def __init__(self, restored_state=None, fence=3):
        self.restored_state, self.fence = restored_state, fence
        self.states, self.reports = [], []

    def set_state(self, state, progress):
        self.states.append((state, progress))

    def report_load(self, request_rate, latency_p99_ms, progress_rate):
        self.reports.append((request_rate, latency_p99_ms, progress_rate))


def serving(workload, **kwargs):
    """Start run_serve in a thread; (address, stop event, thread)."""
    stop, listening = threading.Event(), []
    ready = threading.Event()
    costs = (kwargs.get("service_ms", 0), kwargs.get("cpu_ms", 0))
    thread = threading.Thread(target=run_serve, args=(workload, 0, *costs),
                              kwargs={"stop": stop, "on_listening": lambda a: (listening.append(a), ready.set())},
                              daemon=True)
    thread.start()
    assert ready.wait(10)
    return listening[0], stop, thread


def test_serve_answers_gets_counts_them_checkpoints_and_reports_its_load():
    workload = RecordingWorkload(restored_state=SERVE_STATE.pack(7, 1))
    (host, port), stop, thread = serving(workload, service_ms=1)
    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        bodies = []
        for _ in range(5):                     # keep-alive: one connection
            conn.request("GET", "/")
            response = conn.getresponse()
            bodies.append((response.status, response.read()))
        conn.request("GET", "/nothing")
        missing = conn.getresponse()
        assert (missing.status, b"no such path" in missing.read()) == (404, True)
        conn.close()
        assert [status for status, _ in bodies] == [200] * 5
        assert b'"served": 12' in bodies[-1][1] and b'"fence": 3' in bodies[-1][1]   # restored at 7
        # A bound, not a timing: until a state counts every request and a report shows the load
        # (the server counts a request just after its answer is sent).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                any(rate > 0 for rate, _, _ in workload.reports)
                and workload.states and decode_serve_state(workload.states[-1][0]) == (12, 2)):
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)
    served, errors = decode_serve_state(workload.states[-1][0])
    assert (served, errors, workload.states[-1][1]) == (12, 2, 12)   # the 404 counts as an error
    rate, p99_ms, progress = next(r for r in workload.reports if r[0] > 0)
    assert p99_ms >= 1.0 and progress > 0    # each waited its service time


def test_a_port_still_held_is_tried_again_until_the_old_run_lets_go():
    from meshnode.workload.serve import bind_server
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    address = holder.getsockname()
    with pytest.raises(OSError):
        bind_server(address, LoadWindow(), 0, 0, 1, retry_s=0)
    threading.Timer(0.2, holder.close).start()   # the run being replaced exits
    server = bind_server(address, LoadWindow(), 0, 0, 1, retry_s=30)
    assert server.server_address[:2] == address
    server.server_close()


def test_the_builtin_entry_point_starts_serve_on_the_nodes_port(monkeypatch):
    from meshnode.workload import builtin
    started = []
    monkeypatch.setattr(builtin.Workload, "connect", classmethod(lambda cls: RecordingWorkload()))
    monkeypatch.setattr(builtin, "run_serve", lambda *args: started.append(args) or 0)
    monkeypatch.setenv("MESHNODE_SERVICE_PORT", "18081")
    monkeypatch.setenv("MESHNODE_SERVICE_HOST", "127.0.0.3")
    assert builtin.main(["serve", "--port", "18080", "--service-ms", "5", "--cpu-ms", "-1"]) == 0
    _workload, port, service_ms, cpu_ms, host = started[0]
    assert (port, service_ms, cpu_ms, host) == (18081, 5.0, 0.0, "127.0.0.3")
