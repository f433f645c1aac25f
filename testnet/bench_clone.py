"""The clone, reroute and decay figures of `meshnode bench reflex` (SPEC.md R4) on a real testnet.

Each round submits a fresh `serve` job (its own service port, so a cancelled round's
processes never hold the next one's) whose manifest holds the issue's rules: while the
primary's GPUs read above 80 % for ``CLONE_FOR_MS``, clone 1, reroute 50 %, decay the
original 50 %; while they read below 20 % for ``DECAY_FOR_MS``, decay the newest replica
100 % (it retires). The load is the simulated GPU utilisation of the primary (control API
``set_simulated_telemetry``, as `meshnode testnet telemetry I --util 95`): every node reads
``NORMAL_UTIL`` (neither rule), the primary is made hot at ``hot_ns`` and measured (one
system-wide clock, ``mono_ns``):

- ``clone_ms``: from ``hot_ns + CLONE_FOR_MS`` (the condition has held for its duration)
  until the clone answers ``GET /`` at the address its endpoint table row names; the
  primary's reading cadence (100 ms while the job runs there, SPEC.md P1b), the vote and
  the replica's start are inside it.
- ``rerouted_share``: once reroute and decay applied and the primary reads normal again,
  the load generator (testnet/loadgen.py) drives the job through its endpoint table for
  ``LOAD_S``; the share of its answered requests the clone answered (and, from the weights,
  the share the table asks for: ``rerouted_share_expected``).
- ``decay_ms``: the primary and the clone's node drop to ``LOW_UTIL`` at ``drop_ns`` (the
  service's load drops on every replica: the below rule reads their mean, SPEC.md R4g);
  until the first node applied the below rule's decay that retires the clone (its
  ``replica_action`` event). It holds the rule's ``DECAY_FOR_MS``.

The round's job is cancelled at its end. Nodes listen on distinct loopback addresses
(launcher ``loopback_hosts``), so the replicas of one job serve one port (SPEC.md R4f).
"""

from __future__ import annotations

import time

import trio

from meshnode.control.client import ControlError
from protocol.errors import MeshError
from protocol.messages import Cancel, encode_message
from testnet.bench_consensus import sign_jobs
from testnet.bench_stats import summary_ms
from testnet.loadgen import Target, one_request, run_load, targets_from_endpoints

CLONE_FOR_MS = 1000
DECAY_FOR_MS = 1000
HOT_UTIL_MILLI = 95_000
NORMAL_UTIL_MILLI = 50_000
LOW_UTIL_MILLI = 10_000
FIRST_SERVICE_PORT = 18_400     # round k serves on FIRST_SERVICE_PORT + k
LOAD_RPS = 100
LOAD_S = 3.0
STEP_TIMEOUT_S = 60.0
PROBE_S = 0.02
CLONE_JOB = """
name = "bench-clone"
entrypoint = "serve"
args = ["--service-ms", "1"]
strategy = "throughput"
backups = 1
max_retries = 3
nonce = {nonce}
[resources]
gpus = 0
cpu_milli = 100
mem_mib = 64
[service]
port = %d
min_replicas = 1
max_replicas = 2
"""
# The rules, as jobs/serve-replicas.toml: (condition, for_ms, action, amount, cooldown_ms).
CLONE_RULES = (("above = 80", CLONE_FOR_MS, "clone", 1, 60_000),
               ("above = 80", CLONE_FOR_MS, "reroute", 50, 60_000),
               ("above = 80", CLONE_FOR_MS, "decay", 50, 60_000),
               ("below = 20", DECAY_FOR_MS, "decay", 100, 1000))


def clone_manifest(port: int) -> str:
    """The rounds' job serving on ``port`` (``{nonce}`` left for sign_jobs)."""
    rules = "".join('[[reflex]]\nsignal = "gpu_util"\n%s\nfor_ms = %d\naction = "%s"\n%s = %d\ncooldown_ms = %d\n'
                    % (condition, for_ms, action, action, amount, cooldown)
                    for condition, for_ms, action, amount, cooldown in CLONE_RULES)
    return CLONE_JOB % port + rules


def clone_ms(hot_ns: int, for_ms: int, answered_ns: int) -> float:
    """From the moment the condition has held ``for_ms`` (it began at ``hot_ns``) to the
    clone's first answer; negative would mean the clone answered before the rule could hold."""
    return (answered_ns - hot_ns) / 1e6 - for_ms


def answered_share(load_report: dict, targets: set[str]) -> float | None:
    """The share of the load report's answered requests that ``targets`` ("HOST:PORT")
    answered; None when nothing was answered."""
    ok = sum(t["ok"] for t in load_report["targets"])
    if not ok:
        return None
    return sum(t["ok"] for t in load_report["targets"] if t["target"] in targets) / ok


def weight_share(endpoints: list[dict], replicas: set[int]) -> float | None:
    """The share of the requests an endpoint table asks ``replicas`` to answer (R4e)."""
    total = sum(row["weight"] for row in endpoints)
    if not total:
        return None
    return sum(row["weight"] for row in endpoints if row["replica"] in replicas) / total


def replica_action_after(kind_ok, job_hex: str, since_ns: int):
    """An EventLog predicate: a ``replica_action`` of the job from ``since_ns`` on, whose
    detail passes ``kind_ok`` (e.g. it added a replica)."""
    def match(_index, event):
        detail = event.get("detail", {})
        return (event.get("kind") == "replica_action" and detail.get("job_id") == job_hex
                and detail.get("mono_ns", 0) >= since_ns and kind_ok(detail))
    return match


def reflex_replica_actions_since(events, job_hex: str, since_ns: int) -> int:
    """Replica actions of ``job_hex`` a rule caused (their event names a ``reflex``) from
    ``since_ns`` on; every node reports each, so one is counted once per action number."""
    return len({event["detail"].get("seq") for _index, event in events
                if replica_action_after(lambda d: "reflex" in d, job_hex, since_ns)(_index, event)})


def clone_figures(rounds: list[dict]) -> dict:
    """The issue's keys over the rounds (a round missing a figure adds nothing to it)."""
    def values(key):
        return [r[key] for r in rounds if r.get(key) is not None]
    shares = values("rerouted_share")
    expected = values("rerouted_share_expected")
    return {"clone_ms": summary_ms(values("clone_ms")),
            "clone_decided_ms": summary_ms(values("clone_decided_ms")),
            "rerouted_share": round(sum(shares) / len(shares), 4) if shares else None,
            "rerouted_share_expected": round(sum(expected) / len(expected), 4) if expected else None,
            "decay_ms": summary_ms(values("decay_ms")), "decay_rule_duration_ms": DECAY_FOR_MS,
            "clone_rounds_failed": sum(1 for r in rounds if "failed" in r), "clone_rounds": rounds}


class CloneRounds:
    """The rounds, on a running bench (``run``: a MoveRun-like with _call, _alive, events,
    index_of, owner, mesh_id, layout, rng)."""

    def __init__(self, run):
        self.run = run
        self.rounds: list[dict] = []

    async def _set_util(self, index: int, util_milli: int) -> None:
        await self.run._call(index, "set_simulated_telemetry", util_milli=util_milli)

    async def _endpoints(self, job_hex: str) -> dict | None:
        for index in self.run._alive():
            try:
                return await self.run._call(index, "endpoints", job_id=job_hex)
            except (ControlError, MeshError, OSError):
                continue
        return None

    async def _event(self, predicate, what: str) -> dict:
        """The first logged event passing ``predicate``; MeshError naming ``what`` if none comes."""
        found = await self.run.events.first(predicate, STEP_TIMEOUT_S)
        if found is None:
            raise MeshError("no %s within %d s" % (what, STEP_TIMEOUT_S))
        return found[1]

    async def _wait_answers(self, host: str, port: int) -> int:
        """mono_ns of the first 200 answer from host:port (probed every PROBE_S)."""
        target = Target(host, port)
        while await one_request(target, 1.0) is not None:
            await trio.sleep(PROBE_S)
        return time.monotonic_ns()

    async def _wait_serving(self, job_hex: str) -> dict:
        """The endpoint table once the job runs and its primary answers."""
        while True:
            table = await self._endpoints(job_hex)
            if table and table["state"] == "running" and table["endpoints"]:
                primary = table["endpoints"][0]
                await self._wait_answers(primary["address"], primary["port"])
                return table
            await trio.sleep(0.1)

    async def _table_with_weights(self, job_hex: str, weights: list[int]) -> dict:
        """The endpoint table once the node asked has applied the actions that gave ``weights``
        (the first node to report one may be ahead of the one answering)."""
        while True:
            table = await self._endpoints(job_hex)
            if table and [r["weight"] for r in table["endpoints"]] == weights:
                return table
            await trio.sleep(PROBE_S)

    async def _row_of(self, job_hex: str, replica: int) -> dict:
        while True:
            table = await self._endpoints(job_hex)
            row = next((r for r in (table or {}).get("endpoints", ()) if r["replica"] == replica), None)
            if row is not None:
                return row
            await trio.sleep(PROBE_S)

    async def start_held_job(self, number: int) -> str:
        """Submit the rounds' job once more (port of round ``number``) for the false-trigger
        hold; its hex id once it serves."""
        run = self.run
        (job_id, envelope), = sign_jobs(run.layout["owners"][0]["key_file"], run.mesh_id, 1, run.rng,
                                        clone_manifest(FIRST_SERVICE_PORT + number), time.time_ns() // 1_000_000)
        for index in run._alive():
            await self._set_util(index, NORMAL_UTIL_MILLI)
        await run._call(run.rng.choice(run._alive()), "submit", job=envelope)
        with trio.fail_after(STEP_TIMEOUT_S):
            await self._wait_serving(job_id.hex())
        return job_id.hex()

    async def one_round(self, number: int) -> None:
        run = self.run
        port = FIRST_SERVICE_PORT + number
        (job_id, envelope), = sign_jobs(run.layout["owners"][0]["key_file"], run.mesh_id, 1, run.rng,
                                        clone_manifest(port), time.time_ns() // 1_000_000)
        job_hex = job_id.hex()
        record = {"round": number, "port": port}
        self.rounds.append(record)
        for index in run._alive():
            await self._set_util(index, NORMAL_UTIL_MILLI)
        await run._call(run.rng.choice(run._alive()), "submit", job=envelope)
        try:
            with trio.fail_after(STEP_TIMEOUT_S):
                table = await self._wait_serving(job_hex)
            primary = run.index_of[table["endpoints"][0]["node"]]
            record["primary"] = primary
            await trio.sleep(run.rng.uniform(0, 1.0))   # any phase of the readings and the 1 s refresh
            hot_ns = time.monotonic_ns()
            await self._set_util(primary, HOT_UTIL_MILLI)
            with trio.fail_after(STEP_TIMEOUT_S):
                cloned = await self._event(replica_action_after(lambda d: d.get("added"), job_hex, hot_ns),
                                           "clone")
                record["clone_decided_ms"] = clone_ms(hot_ns, CLONE_FOR_MS, cloned["detail"]["mono_ns"])
                clone_index = cloned["detail"]["added"][0]
                row = await self._row_of(job_hex, clone_index)
                record["clone_node"] = run.index_of.get(row["node"])
                record["clone_ms"] = clone_ms(hot_ns, CLONE_FOR_MS, await self._wait_answers(row["address"],
                                                                                               row["port"]))
                for action in ("reroute", "decay"):
                    applied = await self._event(replica_action_after(lambda d, a=action: d.get("action") == a,
                                                                     job_hex, hot_ns), action)
                await self._set_util(primary, NORMAL_UTIL_MILLI)
                table = await self._table_with_weights(job_hex, applied["detail"]["weights"])
            record["weights"] = [r["weight"] for r in table["endpoints"]]
            record["rerouted_share_expected"] = weight_share(table["endpoints"], {clone_index})
            load = await run_load(targets_from_endpoints(table), LOAD_RPS, LOAD_S)
            clone_target = "%s:%d" % (row["address"], row["port"])
            record["rerouted_share"] = answered_share(load, {clone_target})
            record["load"] = {"sent": load["sent"], "ok": load["ok"], "errors": load["errors"]}
            drop_ns = time.monotonic_ns()
            for index in {primary, record.get("clone_node", primary)} - {None}:
                await self._set_util(index, LOW_UTIL_MILLI)   # R4g: the below rule reads the mean
            with trio.fail_after(STEP_TIMEOUT_S):
                decayed = await self._event(
                    replica_action_after(lambda d: clone_index in d.get("retired", ()), job_hex, drop_ns),
                    "decay retiring the clone")
            record["decay_ms"] = (decayed["detail"]["mono_ns"] - drop_ns) / 1e6
        except trio.TooSlowError:
            record["failed"] = "a step took over %d s" % STEP_TIMEOUT_S
        except MeshError as exc:
            record["failed"] = str(exc)
        finally:
            for index in run._alive():
                await self._set_util(index, NORMAL_UTIL_MILLI)
            await self._cancel(job_id)

    async def _cancel(self, job_id: bytes) -> None:
        request = encode_message(self.run.owner, self.run.mesh_id,
                                 Cancel(job_id=job_id, requested_ms=time.time_ns() // 1_000_000))
        for index in self.run._alive():
            try:
                await self.run._call(index, "cancel", request=request)
                return
            except (ControlError, MeshError, OSError):
                continue
