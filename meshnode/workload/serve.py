"""The built-in ``serve`` workload: a small HTTP/1.1 service that reports its own load.

Started as ``python -m meshnode.workload.builtin serve [--port P] [--service-ms MS]
[--cpu-ms MS]``. It listens on ``$MESHNODE_SERVICE_HOST`` (else 127.0.0.1), on
``$MESHNODE_SERVICE_PORT`` when the node sets it (a job's declared service port), else on
``--port`` (0: any free port), and
prints ``listening on HOST:PORT`` to its output (`meshnode job logs` shows it). Every
``GET`` is answered ``200`` with a one-line JSON body {"served": n, "fence": f} after
``--service-ms`` of waiting (an I/O-bound service: requests overlap) and ``--cpu-ms`` of
busy arithmetic (a CPU-bound one: they compete for the core), so a load generator can make
its latency climb. Anything else is ``404`` / ``405``.

Its state is its counters (requests served, errors), checkpointed like ``counter``'s, so
a moved or restarted service goes on counting from its checkpoint. About once a second it
reports its load to its node through the SDK (SPEC.md 9.4a): requests answered per second,
their p99 latency, both over the last ``WINDOW_S`` seconds, and its progress (requests
served) per second, which reflex rules on ``request_rate``, ``request_latency_ms`` and
``progress_rate`` read (SPEC.md R3a).
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from protocol.errors import RemoteProtocolError

SERVICE_PORT_ENV = "MESHNODE_SERVICE_PORT"
SERVICE_HOST_ENV = "MESHNODE_SERVICE_HOST"   # the host the endpoint table names for this node (R4f)
DEFAULT_HOST = "127.0.0.1"
SERVE_STATE = struct.Struct(">QQ")   # requests served, errors
WINDOW_S = 5.0                       # the window request rate and p99 are measured over
MAX_WINDOW_SAMPLES = 65_536          # a flood keeps the newest this many (memory stays bounded)
STATE_PERIOD_S = 0.05                # counters offered as a checkpoint this often
REPORT_PERIOD_S = 1.0                # load reported to the node this often
BIND_RETRY_S = 10.0                  # how long a port still in use is tried again


def decode_serve_state(state: bytes) -> tuple[int, int]:
    if len(state) != SERVE_STATE.size:
        raise RemoteProtocolError("serve state is %d bytes, expected %d" % (len(state), SERVE_STATE.size))
    return SERVE_STATE.unpack(state)


def service_port(argument: int, environ=os.environ) -> int:
    """The port to listen on: the node's ``$MESHNODE_SERVICE_PORT`` when set, else ``argument``."""
    text = environ.get(SERVICE_PORT_ENV, "")
    if not text:
        return argument
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ValueError("%s=%r is not a port number" % (SERVICE_PORT_ENV, text))
    return int(text)


def service_host(environ=os.environ) -> str:
    """The address to listen on: the node's ``$MESHNODE_SERVICE_HOST`` (the host its endpoint
    table row names, SPEC.md R4f) when set, else 127.0.0.1."""
    return environ.get(SERVICE_HOST_ENV, "") or DEFAULT_HOST


def percentile(values, fraction: float) -> float | None:
    """The value at ``fraction`` of the sorted ``values`` (nearest rank, rounded down); None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class LoadWindow:
    """Request accounting over a sliding window. Every method takes the time (seconds, any
    monotonic origin) so tests drive it with their own clock; thread-safe, since the
    server answers each connection in its own thread."""

    def __init__(self, window_s: float = WINDOW_S, served: int = 0, errors: int = 0):
        self.window_s = window_s
        self.served = served
        self.errors = errors
        self.in_flight = 0
        self._finished: deque = deque(maxlen=MAX_WINDOW_SAMPLES)   # (finished_s, latency_s)
        self._lock = threading.Lock()

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, now_s: float, latency_s: float, ok: bool = True) -> None:
        with self._lock:
            self.in_flight -= 1
            if ok:
                self.served += 1
                self._finished.append((now_s, latency_s))
            else:
                self.errors += 1

    def snapshot(self, now_s: float) -> dict:
        """requests/s and p99 latency (ms) of the requests answered in the last window, the
        requests in flight, and the counters."""
        with self._lock:
            while self._finished and self._finished[0][0] <= now_s - self.window_s:
                self._finished.popleft()
            latencies = [latency for _, latency in self._finished]
            in_flight, served, errors = self.in_flight, self.served, self.errors
        p99 = percentile(latencies, 0.99)
        return {"request_rate": len(latencies) / self.window_s, "latency_p99_ms": 0.0 if p99 is None else p99 * 1000,
                "in_flight": in_flight, "served": served, "errors": errors}

    def state(self) -> tuple[bytes, int]:
        """(the checkpoint state, its progress: requests served), read together."""
        with self._lock:
            return SERVE_STATE.pack(self.served, self.errors), self.served


def burn_cpu(ms: float) -> None:
    """Busy arithmetic for ``ms`` of this thread's time (the CPU cost of a request)."""
    deadline = time.perf_counter() + ms / 1000
    value = 1
    while time.perf_counter() < deadline:
        for _ in range(64):
            value = (value * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF


class ServeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: a client may send many requests on one connection
    server_version = "meshnode-serve"

    def do_GET(self) -> None:   # noqa: N802 (the name http.server calls)
        server = self.server
        started = time.monotonic()
        server.load.started()
        ok = False
        try:
            if self.path.split("?", 1)[0] not in ("/", "/serve"):
                self._reply(404, {"error": "no such path %s" % self.path[:100]})
                return
            if server.service_ms:
                time.sleep(server.service_ms / 1000)
            if server.cpu_ms:
                burn_cpu(server.cpu_ms)
            self._reply(200, {"served": server.load.served + 1, "fence": server.fence})
            ok = True
        finally:
            server.load.finished(time.monotonic(), time.monotonic() - started, ok)

    def do_POST(self) -> None:   # noqa: N802
        self._reply(405, {"error": "only GET is served"})

    def _reply(self, status: int, body: dict) -> None:
        data = (json.dumps(body) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:   # noqa: A002 (http.server's signature)
        pass   # one line per request would flood the job's log ring


class ServeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, load: LoadWindow, service_ms: float = 0, cpu_ms: float = 0, fence: int = 0):
        self.load, self.service_ms, self.cpu_ms, self.fence = load, service_ms, cpu_ms, fence
        super().__init__(address, ServeHandler)


def bind_server(address, load: LoadWindow, service_ms: float, cpu_ms: float, fence: int,
                retry_s: float = BIND_RETRY_S) -> ServeServer:
    """The server on ``address``; a port still held is tried again for ``retry_s``: a moved
    service may start here a moment before the run it replaces has let go of its port."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return ServeServer(address, load, service_ms, cpu_ms, fence)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def run_serve(workload, port: int, service_ms: float, cpu_ms: float, host: str = DEFAULT_HOST,
              stop: threading.Event | None = None, on_listening=None) -> int:
    """Serve until ``stop`` is set (never, under a node: the node stops the process);
    ``on_listening(address)`` once it listens (tests learn a free port so)."""
    served, errors = (0, 0) if workload.restored_state is None else decode_serve_state(workload.restored_state)
    load = LoadWindow(served=served, errors=errors)
    server = bind_server((host, port), load, service_ms, cpu_ms, workload.fence)
    print("listening on %s:%d" % server.server_address[:2], flush=True)
    if on_listening is not None:
        on_listening(server.server_address[:2])
    threading.Thread(target=server.serve_forever, name="serve", daemon=True).start()
    stop = stop or threading.Event()
    next_report = time.monotonic()
    last_served, offered = served, None
    try:
        while not stop.wait(STATE_PERIOD_S):   # this thread alone offers state (the SDK's rule)
            state, progress = load.state()
            if state != offered:   # an idle service offers no new checkpoint
                workload.set_state(state, progress)
                offered = state
            now = time.monotonic()
            if now >= next_report:
                snapshot = load.snapshot(now)
                elapsed = REPORT_PERIOD_S + (now - next_report)
                workload.report_load(snapshot["request_rate"], snapshot["latency_p99_ms"],
                                     (snapshot["served"] - last_served) / elapsed)
                last_served, next_report = snapshot["served"], now + REPORT_PERIOD_S
    finally:
        server.shutdown()
        server.server_close()
    return 0
