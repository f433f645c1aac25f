"""Where a clone round's ``clone_ms`` goes, read from a `meshnode bench reflex --keep` run.

    python -m testnet.clone_breakdown DIR RESULT.json

DIR is the bench's ``--dir`` (kept with ``--keep``), RESULT.json its ``--json`` output. For
each clone round (testnet/bench_clone.py) the node logs give, on one wall clock (all nodes
run on this host): the leader's ``proposed`` line of the clone's instance, the first
``replica_action`` that added the clone, the clone node's ``started job`` line, and the
moment the replica printed ``listening on`` (its output file's mtime: the line is the
first it writes). The round's ``clone_decided_ms`` (bench clock) places the moment the
condition had held for its duration on that wall clock. Stages, in ms:

- ``to_proposal``: until the leader proposed: the primary's readings and the vector that
  completes the evidence (SPEC.md P1b), its hop, the members noticing;
- ``vote``: proposal -> the first node applied the clone;
- ``to_process``: applied -> the clone node forked the replica's process;
- ``serve_start``: fork -> the replica listens (interpreter, imports, bind);
- ``to_answer``: listening -> the bench's probe got its first answer (probes every 20 ms).

They add up to ``clone_ms`` (to log-timestamp rounding). Prints one JSON object.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

STAGES = ("to_proposal", "vote", "to_process", "serve_start", "to_answer")
CLONE_LINE = re.compile(r"replica_action job_id=(\w+) seq=0 .*added=\[1\]")
DECIDED_LINE = re.compile(r"decided instance=(\w+) .*value_kind=replica_action")
STARTED_LINE = re.compile(r"started job \w+ pid")
START_WINDOW_MS = 2000   # the replica's fork follows its node's apply within this


def log_ms(line: str) -> float:
    """The wall-clock ms of a node log line (``2026-11-26 20:05:03,693 INFO ...``)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1000


def round_stages(logs: dict, root: Path, record: dict, job_hex: str) -> dict:
    applied = []   # (ms, node, line index) of every node's apply of the clone
    for node, lines in logs.items():
        applied += [(log_ms(line), node, i) for i, line in enumerate(lines)
                    if (m := CLONE_LINE.search(line)) and m.group(1) == job_hex]
    decided_ms, node, index = min(applied)
    instance = next((m.group(1) for line in reversed(logs[node][max(0, index - 5):index])
                     if (m := DECIDED_LINE.search(line))), None)
    proposed = [log_ms(line) for lines in logs.values() for line in lines
                if instance and "proposed instance=%s" % instance in line]
    clone_node = "node-%d" % record["clone_node"]
    forks = [log_ms(line) for line in logs[clone_node] if STARTED_LINE.search(line)]
    forked = min((ms for ms in forks if decided_ms - 50 <= ms <= decided_ms + START_WINDOW_MS), default=None)
    listening = None
    if forked is not None:
        outputs = [p.stat().st_mtime * 1000 for p in (root / clone_node / "workloads").glob("*/output.log")]
        listening = min((ms for ms in outputs if forked - 10 <= ms <= forked + 3 * START_WINDOW_MS), default=None)
    held_ms = decided_ms - record["clone_decided_ms"]   # hot + the rule's duration, on the wall clock
    row = {"round": record["round"], "clone_ms": round(record["clone_ms"]), "to_proposal": None, "vote": None,
           "to_process": None, "serve_start": None, "to_answer": None}
    if proposed:
        row["to_proposal"], row["vote"] = round(min(proposed) - held_ms), round(decided_ms - min(proposed))
    if forked is not None:
        row["to_process"] = round(forked - decided_ms)
    if listening is not None:
        row["serve_start"] = round(listening - forked)
        row["to_answer"] = round(record["clone_ms"] - (listening - held_ms))
    return row


def breakdown(root: Path, result: dict) -> dict:
    logs = {p.parent.name: p.read_text().splitlines() for p in sorted(root.glob("node-*/node.log"))}
    first_apply = {}
    for lines in logs.values():
        for line in lines:
            if m := CLONE_LINE.search(line):
                first_apply[m.group(1)] = min(first_apply.get(m.group(1), float("inf")), log_ms(line))
    jobs = sorted(first_apply, key=first_apply.get)     # clone rounds in order
    rounds = [r for r in result["clone_rounds"] if r.get("clone_ms") is not None]
    rows = [round_stages(logs, root, record, job) for record, job in zip(rounds, jobs)]
    medians = {}
    for stage in STAGES + ("clone_ms",):
        values = [row[stage] for row in rows if row[stage] is not None]
        medians[stage] = {"p50": statistics.median(values), "min": min(values), "max": max(values)} if values else None
    return {"rounds": rows, "stages": medians}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    print(json.dumps(breakdown(Path(args[0]), json.loads(Path(args[1]).read_text())), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
