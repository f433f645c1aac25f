"""An open-loop HTTP load generator: `meshnode load`.

Request k of a run is due at ``start + k / rps``, whether or not earlier requests were
answered (open loop: a slow service meets the same arrival rate, and a request's latency
counts from when it was due, so a queue the generator itself built up is not hidden).
Each request is one ``GET /`` on a fresh connection with ``Connection: close``, to a
target picked by smooth weighted round robin (``HOST:PORT=WEIGHT``; deterministic, so
with weights 3 and 1 exactly 3 of every 4 go to the first). A request is ok when the
answer's status is 200; anything else -- refused connection, timeout, another status, a
malformed answer -- is an error, counted by kind. Requests still due while
``max_in_flight`` are outstanding are not sent and count as ``shed`` errors: the
generator's memory stays bounded when a service stops answering.

``--job JOB`` takes the targets from the node's endpoint table (control API
``endpoints``: [{replica, address, port, weight}]), which nodes with replicas serve, and
follows it: the generator subscribes to the node's events and reads the table again at
each event that changes it (``TABLE_EVENTS``), so a clone gets its share of requests as
soon as the node applied it, and a retired replica gets none; no polling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from protocol.errors import MeshError
from testnet.bench_stats import summary_ms

MAX_RESPONSE_BYTES = 65_536     # an answer longer than this is an error (the serve workload's are tiny)
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_IN_FLIGHT = 1000
MAX_RPS = 100_000
MAX_DURATION_S = 86_400
# The events after which a job's endpoint table may differ (SPEC.md R4e): replicas added,
# re-weighted, retired or dropped, the primary moved or migrated.
TABLE_EVENTS = ("replica_action", "replicas_dropped", "moved", "migrated")


@dataclass
class Target:
    host: str
    port: int
    weight: float = 1.0
    sent: int = 0
    ok: int = 0
    errors: dict = field(default_factory=dict)     # kind -> count
    latencies_ms: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return "%s:%d" % (self.host, self.port)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def report(self) -> dict:
        return {"target": self.name, "weight": self.weight, "sent": self.sent, "ok": self.ok,
                "errors": sum(self.errors.values()), "error_kinds": dict(sorted(self.errors.items())),
                "latency_ms": summary_ms(self.latencies_ms)}


def parse_target(text: str) -> Target:
    """``HOST:PORT`` or ``HOST:PORT=WEIGHT`` (weight > 0); MeshError naming what is wrong."""
    address, _, weight_text = text.partition("=")
    host, _, port_text = address.rpartition(":")
    if not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise MeshError("--target %r: expected HOST:PORT or HOST:PORT=WEIGHT (port 1..65535)" % text)
    weight = 1.0
    if weight_text:
        try:
            weight = float(weight_text)
        except ValueError:
            weight = -1.0
        if not weight > 0 or weight == float("inf"):
            raise MeshError("--target %r: the weight must be a number above 0" % text)
    return Target(host.strip("[]"), int(port_text), weight)


def targets_from_endpoints(rows) -> list[Target]:
    """Targets from the control API's ``endpoints`` answer: [{replica, address, port, weight}]
    (a map holding that list under ``endpoints`` too). Replicas of weight 0 get no requests."""
    if isinstance(rows, dict):
        rows = rows.get("endpoints")
    if not isinstance(rows, list):
        raise MeshError("the node's endpoints answer is not a list of endpoints: %r" % (rows,))
    targets = []
    for row in rows:
        try:
            address, port, weight = str(row["address"]), int(row["port"]), float(row.get("weight", 1))
        except (KeyError, TypeError, ValueError):
            raise MeshError("the node's endpoint %r lacks an address, a port or a numeric weight" % (row,)) from None
        if weight > 0:
            targets.append(Target(address, port, weight))
    if not targets:
        raise MeshError("the job has no endpoint with a weight above 0 (not running, or no service port)")
    return targets


def endpoints_of_job(node_dir, job: str, timeout_s: float = 10.0) -> list[Target]:
    """The job's endpoints as the node at ``node_dir`` knows them; a clear MeshError when the
    node has no ``endpoints`` call (it predates replicas) or refuses."""
    from meshnode.control.client import ControlClient, ControlError
    with ControlClient(node_dir, timeout_s) as client:
        try:
            rows = client.call("endpoints", job_id=job)
        except ControlError as exc:
            if "unknown op" in str(exc):
                raise MeshError("the node at %s does not serve a job's endpoints (no `endpoints` call in its "
                                "control API); give the service's address with --target HOST:PORT" % node_dir) from None
            raise
    return targets_from_endpoints(rows)


class WeightedPicker:
    """Smooth weighted round robin (nginx's): each pick adds every weight to its target's
    credit and takes the target with the most, which then pays the total back."""

    def __init__(self, targets: list[Target]):
        self.targets: list[Target] = []
        self.credit: list[float] = []
        self.total = 0.0
        self.set_targets(targets)

    def set_targets(self, targets: list[Target]) -> None:
        """Pick among ``targets`` from now on (the endpoint table changed); a target picked
        before keeps its credit, so the round robin goes on where it was."""
        credit = {t.name: c for t, c in zip(self.targets, self.credit)}
        self.targets = list(targets)
        self.credit = [credit.get(t.name, 0.0) for t in self.targets]
        self.total = sum(t.weight for t in self.targets)

    def pick(self) -> Target:
        for i, target in enumerate(self.targets):
            self.credit[i] += target.weight
        best = max(range(len(self.targets)), key=lambda i: self.credit[i])
        self.credit[best] -= self.total
        return self.targets[best]


async def follow_endpoints(node_dir, job: str, retarget) -> None:
    """``retarget(targets)`` with the job's endpoint table now and after every event of the
    node (at ``node_dir``) that may change it, until cancelled. A table with no weighted
    endpoint is skipped; a node that goes away ends the following (the last targets stay)."""
    from meshnode.control.client import AsyncControlClient, ControlError

    async def refresh(client) -> None:
        try:
            retarget(targets_from_endpoints(await client.call("endpoints", job_id=job)))
        except MeshError:
            pass   # no weighted endpoint right now (e.g. the primary is moving): keep sending as before

    prefix = job.lower()
    try:
        async with AsyncControlClient(node_dir) as client:
            async with client.subscribe(kinds=list(TABLE_EVENTS)) as events:
                await refresh(client)   # what changed between the first read and the subscription
                async for event in events:
                    if str(event.get("detail", {}).get("job_id", "")).startswith(prefix):
                        await refresh(client)
    except (ControlError, OSError):
        return


async def one_request(target: Target, timeout_s: float) -> str | None:
    """GET / on a fresh connection: None if the answer is 200, else the error's kind."""
    request = ("GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % target.name).encode()
    with trio.move_on_after(timeout_s):
        try:
            stream = await trio.open_tcp_stream(target.host, target.port)
        except OSError:
            return "connect"
        async with stream:
            try:
                await stream.send_all(request)
                answer = b""
                while b"\r\n" not in answer:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return "closed"
                    answer += chunk
                    if len(answer) > MAX_RESPONSE_BYTES:
                        return "too_long"
            except (OSError, trio.BrokenResourceError):
                return "closed"
        status_line = answer.split(b"\r\n", 1)[0].split()
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit():
            return "malformed"
        return None if status_line[1] == b"200" else "status_%s" % status_line[1].decode()
    return "timeout"


async def run_load(targets: list[Target], rps: float, duration_s: float, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                   max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, follow=None) -> dict:
    """Drive ``targets`` open-loop at ``rps`` for ``duration_s``; the report (see module doc).
    ``follow(retarget)``: an async function run meanwhile that calls ``retarget(targets)``
    when the targets change (follow_endpoints); each target ever driven is reported."""
    if not targets:
        raise MeshError("no target: give --target HOST:PORT (or --job JOB)")
    if not 0 < rps <= MAX_RPS:
        raise MeshError("--rps must be above 0 and at most %d" % MAX_RPS)
    if not 0 < duration_s <= MAX_DURATION_S:
        raise MeshError("--duration-s must be above 0 and at most %d" % MAX_DURATION_S)
    if max_in_flight < 1 or not timeout_s > 0:
        raise MeshError("--max-in-flight must be at least 1 and --timeout-s above 0")
    picker = WeightedPicker(targets)
    driven = {t.name: t for t in targets}   # every target ever picked from, for the report
    updates = 0

    def retarget(new_targets: list[Target]) -> None:
        nonlocal updates
        current = []
        for target in new_targets:
            kept = driven.setdefault(target.name, target)
            kept.weight = target.weight
            current.append(kept)
        if current:
            picker.set_targets(current)
            updates += 1

    due_count = int(rps * duration_s)
    in_flight = 0
    started_wall = time.time()

    async def send(target: Target, due: float) -> None:
        nonlocal in_flight
        try:
            kind = await one_request(target, timeout_s)
        finally:
            in_flight -= 1
        if kind is None:
            target.ok += 1
            target.latencies_ms.append((trio.current_time() - due) * 1000)
        else:
            target.error(kind)

    start = trio.current_time()
    async with trio.open_nursery() as following:
        if follow is not None:
            following.start_soon(follow, retarget)
        async with trio.open_nursery() as nursery:
            for k in range(due_count):
                due = start + k / rps
                await trio.sleep_until(due)
                target = picker.pick()
                target.sent += 1
                if in_flight >= max_in_flight:
                    target.error("shed")
                    continue
                in_flight += 1
                nursery.start_soon(send, target, due)
        following.cancel_scope.cancel()
    elapsed_s = trio.current_time() - start
    targets = list(driven.values())
    per_target = [t.report() for t in targets]
    all_latencies = [ms for t in targets for ms in t.latencies_ms]
    return {"rps": rps, "duration_s": duration_s, "elapsed_s": round(elapsed_s, 3), "started_unix_s": started_wall,
            "sent": sum(t.sent for t in targets), "ok": sum(t.ok for t in targets),
            "errors": sum(r["errors"] for r in per_target), "latency_ms": summary_ms(all_latencies),
            "achieved_ok_rps": round(sum(t.ok for t in targets) / elapsed_s, 3) if elapsed_s > 0 else None,
            "endpoint_updates": updates, "targets": per_target}
