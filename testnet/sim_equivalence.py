"""Seed-for-seed equivalence of the simulator across a code change (a refactor's proof).

``run`` executes a fixed matrix of simulator configurations in this process, through
testnet.sim's Python API, and writes one JSON file holding, per configuration and seed,
what the run did, raw enough that ``compare`` can say WHAT differs, not only that
something does::

    python -m testnet.sim_equivalence run --out before.json [--quick] [--only REGEX]
    python -m testnet.sim_equivalence compare before.json after.json [--subset] [--strict]

To compare two commits, run each from its own checkout (the current directory comes
first on ``sys.path``, so ``cd CHECKOUT && python -m testnet.sim_equivalence run ...``
imports that checkout's packages even where another one is installed in editable mode;
``code.protocol_file`` in the output says which was imported).

What a run records (its "fingerprint"):

- ``decisions``: every Decision any node emitted, in emission order, as
  ``[virtual ms, node, value kind, instance hex, sha256(decided value bytes),
  sha256(commit certificate bytes)]``. Ed25519 signatures are deterministic and the world
  (identities, genesis, jobs) is drawn from the seed, so the certificates' bytes repeat;
- ``summary``: the SimResult's counts (distinct decisions, placements, node decisions,
  point-to-point messages, virtual end time, missing liveness pairs, decision-log digest);
- ``network``: the simulated network's counts (sent, scheduled deliveries, lost,
  partitioned, duplicated, reordered), ``counters``: the simulator's counters;
- ``latencies_ms``, ``violations`` (every kept Violation, and the count);
- ``messages``: per node, the count and SHA-256 of the stream of messages it sent
  (virtual ms, recipient, bytes) and of the stream that arrived for it (virtual ms,
  sender, bytes), and a checkpoint of the global arrival stream every
  ``CHECKPOINT_EVERY`` arrivals, so a divergence is located to a window of virtual time;
- advisory (a difference is printed, and fails only with ``--strict``): ``local_decisions``
  (the uncertified Decisions: a node's orders to its own workloads, halt, resume, cancel,
  which the simulator does not check, as ``[virtual ms, node, kind, instance hex, sha256
  of the job ids]``), ``core_counters`` (each node's MeshCore.counters at the end: drop
  reasons) and ``events`` (Ready.events kinds per node: diagnostics, not protocol output).

Left out on purpose: ``wall_s`` (wall-clock time) and anything keyed by ``id()``. Hash
randomisation (PYTHONHASHSEED) is not pinned: two runs of one commit in two processes
must agree anyway, so that a refactor that starts depending on set order is caught.

Reading decisions and message streams needs no change to the simulator: the tool wraps,
on each Simulation instance, the checker's ``check_decision`` and ``verify_certificate``
and the simulator's ``_send``, ``_deliver`` and ``_emit``; every wrapper only observes (no
random draw, no state change) and then calls the original.

``compare --structural`` ignores what a change of encoding would alter everywhere (mesh
id, instance ids, value, certificate and message digests): instance ids are renamed by
first appearance, so it still checks who decided what kind, when, with what messages
counts and latencies. It is not the no-behaviour-change bar, which is the default.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

FORMAT = "meshnode-sim-equivalence/1"
CHECKPOINT_EVERY = 2048
ALL = "all"
STRICT_SECTIONS = ("config", "world", "decisions", "summary", "network", "counters", "latencies_ms", "violations",
                   "messages")
ADVISORY_SECTIONS = ("local_decisions", "core_counters", "events")
# SimConfig options added after this tool (jobs that exit or are cancelled); the matrix
# never sets them, and a run records them only when set.
LATER_CONFIG_FIELDS = ("job_ms", "job_fail_per_mille", "cancel_per_mille")


# --- the matrix ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    nodes: int
    jobs: int
    faults: str = "none"          # "none", "all", or a comma-separated subset of testnet.sim.FAULTS
    byzantine_milli: int = 0
    slot_ms: int = 0
    heartbeats: bool = True
    bid_sample: int | None = None
    seeds: tuple = (1,)
    quick: tuple = ()             # the seeds of this case that --quick runs

    def key(self) -> str:
        return "n%d-j%d-f%s-b%d-s%d-hb%d-bs%s" % (self.nodes, self.jobs, self.faults.replace(",", "+"),
                                                 self.byzantine_milli, self.slot_ms, int(self.heartbeats),
                                                 "-" if self.bid_sample is None else self.bid_sample)


def matrix() -> list[Case]:
    """The fixed matrix: 65 configurations, 116 (configuration, seed) runs, 14 of them in --quick.
    Never reorder or change a case once a baseline was taken with it (add new ones at the end)."""
    cases: list[Case] = []
    seed = iter(range(1, 10_000))
    # 32 small meshes, each of n in 4 5 7 8 with and without slots, faults and 0.33 Byzantine stake.
    for nodes, jobs in ((4, 4), (5, 6), (7, 6), (8, 8)):
        for slot_ms in (0, 50):
            for faults in ("none", ALL):
                for byzantine in (0, 330):
                    seeds = (next(seed), next(seed))
                    quick = seeds[:1] if (nodes in (4, 7) and (slot_ms == 50) == (faults == ALL)) else ()
                    cases.append(Case(nodes, jobs, faults, byzantine, slot_ms, True, None, seeds, quick))
    # 4 without heartbeats, 5 under single kinds of fault, 2 at 0.34 Byzantine stake (a stall:
    # liveness violations are expected, and must repeat).
    for nodes, slot_ms, byzantine in ((4, 0, 0), (5, 50, 330), (7, 0, 330), (8, 50, 0)):
        seeds = (next(seed), next(seed))
        cases.append(Case(nodes, 6, ALL, byzantine, slot_ms, False, None, seeds, seeds[:1] if nodes == 4 else ()))
    for nodes, faults, byzantine, slot_ms in ((5, "crash", 330, 0), (7, "partition,asym", 0, 50),
                                              (7, "loss,dup,reorder", 330, 0), (5, "delay", 0, 50),
                                              (8, "crash,partition", 330, 50)):
        seeds = (next(seed), next(seed))
        cases.append(Case(nodes, 6, faults, byzantine, slot_ms, True, None, seeds,
                          seeds[:1] if faults == "crash" else ()))
    for slot_ms in (0, 50):
        seeds = (next(seed),)
        cases.append(Case(4, 4, ALL, 340, slot_ms, True, None, seeds, seeds if slot_ms else ()))
    # 10 at 16 nodes: slots x faults x Byzantine, heartbeats on without faults; and bid sampling.
    for slot_ms in (0, 50):
        for faults in ("none", ALL):
            for byzantine in (0, 330):
                seeds = (next(seed), next(seed))
                quick = seeds[:1] if (slot_ms, faults, byzantine) == (50, ALL, 330) else ()
                cases.append(Case(16, 8, faults, byzantine, slot_ms, faults == "none", None, seeds, quick))
    for slot_ms in (0, 50):
        cases.append(Case(16, 8, ALL, 330, slot_ms, False, 4, (next(seed), next(seed))))
    # 6 at 32 nodes.
    for faults, byzantine, slot_ms, heartbeats, bid_sample in (("none", 0, 0, True, None),
                                                               ("none", 0, 50, False, 8),
                                                               (ALL, 330, 0, False, None),
                                                               (ALL, 330, 50, False, 8),
                                                               ("none", 330, 50, False, None),
                                                               (ALL, 0, 0, True, None)):
        seeds = (next(seed),)
        quick = seeds if (faults, slot_ms, bid_sample) == ("none", 50, 8) else ()
        cases.append(Case(32, 8, faults, byzantine, slot_ms, heartbeats, bid_sample, seeds, quick))
    # 6 at 64 nodes.
    for jobs, faults, byzantine, slot_ms, heartbeats, bid_sample in ((8, "none", 0, 0, True, None),
                                                                     (16, "none", 0, 50, False, 8),
                                                                     (8, "none", 330, 0, False, None),
                                                                     (12, ALL, 330, 50, False, 8),
                                                                     (8, ALL, 0, 0, False, None),
                                                                     (8, "none", 0, 50, True, None)):
        seeds = (next(seed),)
        quick = seeds if (faults, slot_ms, bid_sample) == ("none", 50, 8) else ()
        cases.append(Case(64, jobs, faults, byzantine, slot_ms, heartbeats, bid_sample, seeds, quick))
    keys = [c.key() for c in cases]
    assert len(set(keys)) == len(keys), "two cases with one key"
    return cases


def runs_of(cases: list[Case], quick: bool, only: str | None) -> list[tuple[Case, int]]:
    out = []
    for case in cases:
        for s in (case.quick if quick else case.seeds):
            if only is None or re.search(only, "%s#%d" % (case.key(), s)):
                out.append((case, s))
    return out


# --- one run ---------------------------------------------------------------------------------

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _value_digest(value) -> str:
    """A local decision's value is a tuple of job ids (bytes); anything else by its repr."""
    if isinstance(value, (tuple, list)) and all(isinstance(v, bytes) for v in value):
        return _sha(b"".join(struct.pack("<q", len(v)) + v for v in value))
    return _sha(repr(value).encode())


class _Recorder:
    """Observes one Simulation: wraps a few of its callables on the instance, then calls them."""

    def __init__(self, sim):
        self.sim = sim
        n = len(sim.nodes)
        self.decisions: list[list] = []
        self.local_decisions: list[list] = []
        self._value_bytes: bytes | None = None
        self.sent = [hashlib.sha256() for _ in range(n)]
        self.sent_count = [0] * n
        self.arrived = [hashlib.sha256() for _ in range(n)]
        self.arrived_count = [0] * n
        self.arrivals = hashlib.sha256()
        self.arrivals_count = 0
        self.checkpoints: list[list] = []
        self.events = [Counter() for _ in range(n)]
        self.event_streams = [hashlib.sha256() for _ in range(n)]
        checker = sim.checker
        self._check_decision, self._verify = checker.check_decision, checker.verify_certificate
        checker.check_decision = self.check_decision
        checker.verify_certificate = self.verify_certificate
        self._send, self._deliver, self._emit = sim._send, sim._deliver, sim._emit
        sim._send, sim._deliver, sim._emit = self.send, self.deliver, self.emit

    def verify_certificate(self, data, views):
        result = self._verify(data, views)
        self._value_bytes = result[1]
        return result

    def check_decision(self, node, decision, now_ms, views=None):
        self._value_bytes = None
        try:
            return self._check_decision(node, decision, now_ms, views)
        finally:
            value = self._value_bytes
            self.decisions.append([now_ms, node, decision.value_kind, decision.instance.hex(),
                                   _sha(value) if value is not None else None,
                                   _sha(decision.certificate) if decision.certificate else None])

    def send(self, node, outbound):
        index_of, now_ms, i = self.sim.index_of, self.sim.now_ms, node.index
        stream = self.sent[i]
        for message in outbound:
            to = -1 if message.to is None else index_of.get(message.to, -2)
            stream.update(struct.pack("<qqq", now_ms, to, len(message.data)) + hashlib.sha256(message.data).digest())
        self.sent_count[i] += len(outbound)
        return self._send(node, outbound)

    def deliver(self, dst, payload):
        src, data = payload
        entry = struct.pack("<qqq", self.sim.now_ms, src, len(data)) + hashlib.sha256(data).digest()
        self.arrived[dst].update(entry)
        self.arrived_count[dst] += 1
        self.arrivals.update(struct.pack("<q", dst) + entry)
        self.arrivals_count += 1
        if self.arrivals_count % CHECKPOINT_EVERY == 0:
            self.checkpoints.append([self.arrivals_count, self.sim.now_ms, self.arrivals.hexdigest()[:32]])
        return self._deliver(dst, payload)

    def emit(self, node, ready):
        for decision in ready.decisions:
            if not decision.certificate:   # a local workload instruction; the simulator checks no other
                self.local_decisions.append([self.sim.now_ms, node.index, decision.value_kind,
                                             decision.instance.hex(), _value_digest(decision.value)])
        events = getattr(ready, "events", None)
        if events:
            counts, stream = self.events[node.index], self.event_streams[node.index]
            for event in events:
                counts[event.kind] += 1
                stream.update(struct.pack("<q", event.at_ms) + event.kind.encode() + b"\0")
        return self._emit(node, ready)


def _config(case: Case, seed: int):
    from testnet.sim import FAULTS, SimConfig
    if case.faults == "none":
        faults: tuple = ()
    elif case.faults == ALL:
        faults = FAULTS
    else:
        faults = tuple(f for f in FAULTS if f in case.faults.split(","))
    return SimConfig(nodes=case.nodes, jobs=case.jobs, seed=seed, byzantine_milli=case.byzantine_milli,
                     faults=faults, heartbeats=case.heartbeats, bid_sample=case.bid_sample, slot_ms=case.slot_ms)


def fingerprint(case: Case, seed: int) -> dict:
    from testnet.sim import Simulation
    config = _config(case, seed)
    sim = Simulation(config)
    rec = _Recorder(sim)
    result = sim.run()
    stats = sim.network.stats
    config_dict = asdict(config)
    config_dict["faults"] = list(config.faults)
    if config_dict.get("shared_caches") is True:  # the default, a cost not a behaviour (SimConfig)
        del config_dict["shared_caches"]
    for name in LATER_CONFIG_FIELDS:  # recorded only when set: files written before them still compare
        if config_dict.get(name) == 0:
            del config_dict[name]
    return {
        "key": "%s#%d" % (case.key(), seed),
        "reproduce": config.reproduce(),
        "config": config_dict,
        "world": {"mesh_id": sim.mesh_id.hex(), "byzantine": sorted(result.byzantine),
                  "byzantine_stake": list(result.byzantine_stake)},
        "decisions": rec.decisions,
        "local_decisions": rec.local_decisions,
        "summary": {"decisions": result.decisions, "placements": result.placements,
                    "node_decisions": result.node_decisions, "messages": result.messages,
                    "virtual_ms": result.virtual_ms, "liveness_missing": result.liveness_missing,
                    "decision_log_digest": result.decision_log_digest},
        "network": dict(result.network, sent=stats.sent, delivered_scheduled=stats.delivered_scheduled),
        "counters": dict(sorted(result.counters.items())),
        "latencies_ms": list(result.latencies_ms),
        "violations": {"count": result.violation_count,
                       "kept": [[v.check, v.node, v.instance, v.detail] for v in result.violations]},
        "messages": {
            "sent": [[c, h.hexdigest()] for c, h in zip(rec.sent_count, rec.sent)],
            "arrived": [[c, h.hexdigest()] for c, h in zip(rec.arrived_count, rec.arrived)],
            "arrivals": [rec.arrivals_count, rec.arrivals.hexdigest()],
            "checkpoints": rec.checkpoints,
        },
        "core_counters": [None if getattr(node.core, "counters", None) is None
                          else dict(sorted(node.core.counters.items())) for node in sim.nodes],
        "events": {"kinds": dict(sorted(sum(rec.events, Counter()).items())),
                   "per_node": [[sum(c.values()), h.hexdigest()] for c, h in zip(rec.events, rec.event_streams)]},
        "wall_s": round(result.wall_s, 3),   # informational: never compared
    }


# --- run ---------------------------------------------------------------------------------------

def _code_identity() -> dict:
    import protocol
    import testnet.sim
    root = os.path.dirname(os.path.dirname(os.path.abspath(testnet.sim.__file__)))
    digest = hashlib.sha256()
    for package in ("protocol", "keys", "testnet", "meshnode"):
        base = os.path.join(root, package)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                with open(path, "rb") as fh:
                    digest.update(os.path.relpath(path, root).encode() + b"\0" + fh.read() + b"\0")
    head, changed = None, None
    try:   # provenance only; the simulations themselves run in this process
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "-C", root, "status", "--porcelain"], capture_output=True, text=True,
                                 timeout=10).stdout.splitlines()[:50]
    except (OSError, subprocess.SubprocessError):
        pass
    return {"root": root, "protocol_file": os.path.abspath(protocol.__file__), "git_head": head,
            "git_changes": changed, "source_sha256": digest.hexdigest()}


def _fingerprint_star(args):
    return fingerprint(*args)


def run_cases(selected: list[tuple[Case, int]], workers: int = 1, label: str = "custom",
              progress=None) -> dict:
    """Fingerprint every (case, seed) in order; the document ``run`` writes and ``compare`` reads."""
    code = _code_identity()
    started = time.perf_counter()
    runs = []
    if workers > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for fp in pool.imap(_fingerprint_star, selected, chunksize=1):
                runs.append(fp)
                if progress:
                    progress(len(runs), len(selected), fp, started)
    else:
        for case, seed in selected:
            runs.append(fingerprint(case, seed))
            if progress:
                progress(len(runs), len(selected), runs[-1], started)
    return {"format": FORMAT, "matrix": label, "configurations": len({r["key"].split("#")[0] for r in runs}),
            "runs": runs, "code": code, "python": platform.python_version(),
            "pythonhashseed": os.environ.get("PYTHONHASHSEED"), "wall_s": round(time.perf_counter() - started, 1)}


def cmd_run(args: argparse.Namespace) -> int:
    selected = runs_of(matrix(), args.quick, args.only)
    if not selected:
        print("no case matches %r" % args.only, file=sys.stderr)
        return 2
    code = _code_identity()
    print("code: %s (protocol from %s)" % (code["git_head"], code["protocol_file"]), file=sys.stderr)
    label = ("quick" if args.quick else "full") + ("" if args.only is None else " --only %s" % args.only)
    document = run_cases(selected, args.workers, label, lambda *a: _progress(args, *a))
    wall_s = document["wall_s"]
    runs = document["runs"]
    tmp = args.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(document, fh, separators=(",", ":"))
        fh.write("\n")
    os.replace(tmp, args.out)
    violations = sum(r["violations"]["count"] for r in runs)
    print("%d runs of %d configurations in %.1f s (%d violations recorded) -> %s"
          % (len(runs), document["configurations"], wall_s, violations, args.out), file=sys.stderr)
    return 0


def _progress(args: argparse.Namespace, number: int, total: int, fp: dict, started: float) -> None:
    if args.verbose:
        print("[%d/%d %6.1fs] %-44s %5.2fs %5d decisions %7d msgs %d violations"
              % (number, total, time.perf_counter() - started, fp["key"], fp["wall_s"], len(fp["decisions"]),
                 fp["summary"]["messages"], fp["violations"]["count"]), file=sys.stderr)


# --- compare -------------------------------------------------------------------------------------

def _short(value, width: int = 160) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _is_row(value) -> bool:
    return isinstance(value, list) and len(value) <= 8 and all(not isinstance(v, (list, dict)) for v in value)


def first_diff(a, b, path: str = ""):
    """(path, a part, b part) of the first difference, or None; short rows of scalars are shown whole."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return ("%s.%s" % (path, key), a.get(key, "<absent>"), b.get(key, "<absent>"))
            found = first_diff(a[key], b[key], "%s.%s" % (path, key))
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and not (_is_row(a) and _is_row(b)):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_diff(x, y, "%s[%d]" % (path, i))
            if found:
                return found
        if len(a) != len(b):
            return ("%s (length)" % path, len(a), len(b))
        return None
    if a != b or type(a) is not type(b):
        return (path, a, b)
    return None


DECISION_FIELDS = ("virtual_ms", "node", "kind", "instance", "value_sha256", "certificate_sha256")


def _row(row: list) -> str:
    """A decision row for people: digests cut to 12 hex digits."""
    ms, node, kind, instance = row[:4]
    text = "%s ms node %s %s %s" % (ms, node, kind, instance[:12] if isinstance(instance, str) else instance)
    for name, value in zip(("value", "cert"), row[4:]):
        text += " %s %s" % (name, value[:12] if isinstance(value, str) else value)
    return text


def _decision_diff(a: list, b: list, what: str = "decision") -> str | None:
    """Per node first (which node's k-th decision, and which fields), then the global interleaving."""
    nodes = sorted({row[1] for row in a} | {row[1] for row in b})
    for node in nodes:
        mine = [row for row in a if row[1] == node]
        theirs = [row for row in b if row[1] == node]
        for k, (x, y) in enumerate(zip(mine, theirs)):
            if x != y:
                fields = [DECISION_FIELDS[i] for i in range(max(len(x), len(y)))
                          if i >= len(x) or i >= len(y) or x[i] != y[i]]
                return ("node %d's %s #%d (of %d in A, %d in B) differs in %s:\n      A %s\n      B %s"
                        % (node, what, k, len(mine), len(theirs), ", ".join(fields), _row(x), _row(y)))
        if len(mine) != len(theirs):
            k = min(len(mine), len(theirs))
            extra, side = (mine, "A") if len(mine) > len(theirs) else (theirs, "B")
            return ("node %d: %d %ss in A, %d in B; the first %d agree, then only %s has:\n      %s"
                    % (node, len(mine), what, len(theirs), k, side, _row(extra[k])))
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return ("the same %ss per node, interleaved differently from #%d:\n      A %s\n      B %s"
                    % (what, k, _row(x), _row(y)))
    return None


def _list_diff(name: str, a: list, b: list) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return "%s #%d: A %s, B %s (%d vs %d entries)" % (name, i, _short(x), _short(y), len(a), len(b))
    if len(a) != len(b):
        return "%d vs %d entries, the first %d equal; then %s" % (len(a), len(b), min(len(a), len(b)),
                                                                  _short((a if len(a) > len(b) else b)[len(b):]))
    return None


def _messages_diff(a: dict, b: dict) -> str | None:
    parts = []
    for stream in ("sent", "arrived"):
        xs, ys = a.get(stream, []), b.get(stream, [])
        differing = [i for i in range(max(len(xs), len(ys))) if i >= len(xs) or i >= len(ys) or xs[i] != ys[i]]
        if differing:
            i = differing[0]
            counts = ("%s vs %s" % (xs[i][0] if i < len(xs) else "-", ys[i][0] if i < len(ys) else "-"))
            parts.append("the %s streams of nodes %s differ (node %d: %s messages)"
                         % (stream, differing[:16], i, counts))
    if a.get("arrivals") != b.get("arrivals"):
        where, before, located = "", (0, 0), False
        for x, y in zip(a.get("checkpoints", []), b.get("checkpoints", [])):
            if x != y:
                where = ("between arrivals #%d and #%d (virtual %d..%d ms in A, %d..%d ms in B)"
                         % (before[0], x[0], before[1], x[1], before[1], y[1]))
                located = True
                break
            before = (x[0], x[1])
        if not located:
            where = "after arrival #%d (virtual %d ms)" % before
        parts.append("the global arrival stream first diverges %s; %s vs %s arrivals in all"
                     % (where, a.get("arrivals", ["-"])[0], b.get("arrivals", ["-"])[0]))
    elif a.get("checkpoints") != b.get("checkpoints"):
        parts.append("arrival checkpoints differ")
    return "; ".join(parts) or None


def section_diff(section: str, a, b) -> str | None:
    if a == b:
        return None
    if a is None or b is None:
        return "recorded on one side only"
    if section == "decisions":
        return _decision_diff(a, b)
    if section == "local_decisions":
        return _decision_diff(a, b, "local decision")
    if section == "messages":
        return _messages_diff(a, b)
    if section == "latencies_ms":
        return _list_diff("job", a, b)
    found = first_diff(a, b, "")
    if found is None:
        return None
    path, x, y = found
    return "%s: A %s, B %s" % (path.lstrip(".") or "value", _short(x), _short(y))


def structural(run: dict) -> dict:
    """The run with what an encoding change alters everywhere taken out (``compare --structural``)."""
    run = json.loads(json.dumps(run))
    names: dict[str, str] = {}
    for row in run["decisions"]:
        row[3] = names.setdefault(row[3], "#%d" % len(names))
        del row[4:]
    run["world"].pop("mesh_id", None)
    run["summary"].pop("decision_log_digest", None)
    run["violations"]["kept"] = [[check, node, names.get(instance, "?" if instance else ""), None]
                                 for check, node, instance, _detail in run["violations"]["kept"]]
    messages = run["messages"]
    for row in run.get("local_decisions", []):
        del row[4:]
    for stream in ("sent", "arrived"):
        messages[stream] = [[count, None] for count, _digest in messages[stream]]
    messages["arrivals"] = [messages["arrivals"][0], None]
    messages["checkpoints"] = [[count, ms, None] for count, ms, _digest in messages["checkpoints"]]
    run["events"]["per_node"] = [[count, None] for count, _digest in run["events"]["per_node"]]
    return run


def compare_documents(a: dict, b: dict, subset: bool = False, structural_mode: bool = False,
                      strict: bool = False) -> dict:
    """{"identical": bool, "compared": n, "only_a": [...], "only_b": [...], "runs": [(key, reproduce,
    [(section, advisory, message)])]} for every run that differs."""
    for doc in (a, b):
        if doc.get("format") != FORMAT:
            raise ValueError("not a %s file (format %r)" % (FORMAT, doc.get("format")))
    runs_a = {r["key"]: r for r in a["runs"]}
    runs_b = {r["key"]: r for r in b["runs"]}
    only_a = [k for k in runs_a if k not in runs_b]
    only_b = [k for k in runs_b if k not in runs_a]
    differing = []
    compared = 0
    for key, ra in runs_a.items():
        rb = runs_b.get(key)
        if rb is None:
            continue
        compared += 1
        if structural_mode:
            ra, rb = structural(ra), structural(rb)
        found = []
        for section in STRICT_SECTIONS + ADVISORY_SECTIONS:
            message = section_diff(section, ra.get(section), rb.get(section))
            if message:
                found.append((section, section in ADVISORY_SECTIONS, message))
        if found:
            differing.append((key, ra.get("reproduce", ""), found))
    failing = [d for d in differing if strict or any(not advisory for _s, advisory, _m in d[2])]
    identical = not failing and compared > 0 and (subset or not (only_a or only_b))
    return {"identical": identical, "compared": compared, "only_a": only_a, "only_b": only_b,
            "runs": differing, "failing": len(failing)}


def cmd_compare(args: argparse.Namespace) -> int:
    with open(args.a) as fh:
        a = json.load(fh)
    with open(args.b) as fh:
        b = json.load(fh)
    try:
        report = compare_documents(a, b, subset=args.subset, structural_mode=args.structural, strict=args.strict)
    except ValueError as exc:
        print("compare: %s" % exc, file=sys.stderr)
        return 2
    for label, doc in (("A", a), ("B", b)):
        code = doc.get("code", {})
        print("%s: %s  %s matrix, %d runs, code %s (source %s), protocol from %s"
              % (label, getattr(args, label.lower()), doc.get("matrix"), len(doc["runs"]), code.get("git_head"),
                 (code.get("source_sha256") or "")[:12], code.get("protocol_file")))
    if a.get("code", {}).get("source_sha256") == b.get("code", {}).get("source_sha256"):
        print("note: both files come from the same source tree")
    if args.structural:
        print("structural comparison: mesh id, instance ids, value/certificate/message digests ignored")
    for label, keys in (("A", report["only_a"]), ("B", report["only_b"])):
        if keys:
            print("%d runs only in %s%s: %s" % (len(keys), label, " (ignored, --subset)" if args.subset else "",
                                                ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "")))
    shown = 0
    for key, reproduce, found in report["runs"]:
        if shown >= args.max:
            print("... %d more differing runs" % (len(report["runs"]) - shown))
            break
        shown += 1
        print("\n%s  (%s)" % (key, reproduce))
        for section, advisory, message in found:
            print("  %s%s: %s" % (section, " [advisory]" if advisory else "", message))
    advisory_only = len(report["runs"]) - report["failing"]
    sections = Counter(section for _key, _reproduce, found in report["runs"] for section, _a, _m in found)
    if sections:
        print("\nruns differing, by section: %s" % ", ".join("%s %d" % item for item in sorted(sections.items())))
    if report["identical"]:
        print("\nIDENTICAL: %d runs compared, every strict section equal%s"
              % (report["compared"], "" if not advisory_only else
                 " (%d runs differ in advisory sections only)" % advisory_only))
        return 0
    print("\nDIFFERENT: %d of %d compared runs differ%s%s"
          % (report["failing"], report["compared"],
             "" if not advisory_only else " (+%d in advisory sections only)" % advisory_only,
             "" if args.subset or not (report["only_a"] or report["only_b"]) else "; the run sets differ"))
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testnet.sim_equivalence", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the matrix and write its fingerprints")
    run.add_argument("--out", required=True, help="JSON file to write")
    run.add_argument("--quick", action="store_true", help="a subset of the matrix (same keys), well under a minute")
    run.add_argument("--only", metavar="REGEX",
                     help="only runs whose key (see 'list') matches REGEX, e.g. '^n7-' or '-s50-.*#12$'")
    run.add_argument("--workers", type=int, default=1, help="processes running cases in parallel (default 1)")
    run.add_argument("-v", "--verbose", action="store_true", help="one line per run on stderr")
    run.set_defaults(func=cmd_run)
    compare = sub.add_parser("compare", help="compare two fingerprint files; exit 0 when identical, 1 when not")
    compare.add_argument("a")
    compare.add_argument("b")
    compare.add_argument("--subset", action="store_true",
                         help="compare the runs both files hold (e.g. a --quick file against a full one)")
    compare.add_argument("--structural", action="store_true",
                         help="ignore mesh id, instance ids and byte digests (for a deliberate encoding change)")
    compare.add_argument("--strict", action="store_true", help="advisory sections (core counters, events) fail too")
    compare.add_argument("--max", type=int, default=20, help="differing runs shown in full (default 20)")
    compare.set_defaults(func=cmd_compare)
    sub.add_parser("list", help="print the matrix").set_defaults(func=cmd_list)
    args = parser.parse_args(argv)
    return args.func(args)


def cmd_list(args: argparse.Namespace) -> int:
    cases = matrix()
    for case in cases:
        print("%-44s seeds %-12s quick %s" % (case.key(), ",".join(map(str, case.seeds)),
                                              ",".join(map(str, case.quick)) or "-"))
    print("%d configurations, %d runs (%d quick)" % (len(cases), sum(len(c.seeds) for c in cases),
                                                     sum(len(c.quick) for c in cases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
