"""Numbers shared by the testnet benchmarks (DESIGN.md "What is measured").

Pure computations (percentiles, the counter workload's progress logs, lost work and
double runs) are separate from the one function that reads the machine
(:func:`machine_info`), so the computations are unit-tested from synthetic logs.

Progress logs are written by the ``counter`` built-in (meshnode/workload/builtin.py):
one ``<unit> <wall_us>`` line per finished unit, appended with O_APPEND, one file per
node that ran the job (``{workdir}/progress.log``). They are the benchmark's independent
witness of lost work: they do not go through the checkpoint path they measure.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass

MAX_LOG_LINES = 5_000_000  # a progress log longer than this is refused, not read into memory
LINE_MAX_BYTES = 64


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty sequence")
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summary_ms(values) -> dict:
    """{p50, p99, max, n} of millisecond values, rounded to microseconds; None fields if empty."""
    values = list(values)
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    return {"p50": round(percentile(values, 50), 3), "p99": round(percentile(values, 99), 3),
            "max": round(max(values), 3), "n": len(values)}


# --- progress logs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ProgressLine:
    unit: int
    wall_us: int


def parse_progress_log(text: str) -> list[ProgressLine]:
    """Lines of a progress log; a torn or garbled line (a kill mid-write) is skipped."""
    lines = []
    for raw in text.split("\n"):
        parts = raw.split()
        if len(raw) > LINE_MAX_BYTES or len(parts) != 2 or not (parts[0].isdigit() and parts[1].isdigit()):
            continue
        lines.append(ProgressLine(int(parts[0]), int(parts[1])))
        if len(lines) > MAX_LOG_LINES:
            raise ValueError("progress log has more than %d lines" % MAX_LOG_LINES)
    return lines


@dataclass(frozen=True)
class Segment:
    """One uninterrupted run of a workload on one node: consecutive units."""
    node: int
    first_unit: int
    last_unit: int
    first_us: int
    last_us: int


def segments(node: int, lines: list[ProgressLine], gap_us: int | None = None) -> list[Segment]:
    """Split one node's log into runs: a new run starts wherever the unit does not go up by 1,
    or, with ``gap_us``, after a pause longer than that (a run resumed from a checkpoint
    taken as the last one stopped goes on from the next unit: a preemption's final one)."""
    found = []
    start = prev = None
    for line in lines:
        if prev is not None and (line.unit != prev.unit + 1 or (gap_us is not None
                                                                and line.wall_us - prev.wall_us > gap_us)):
            found.append(Segment(node, start.unit, prev.unit, start.wall_us, prev.wall_us))
            start = None
        if start is None:
            start = line
        prev = line
    if start is not None:
        found.append(Segment(node, start.unit, prev.unit, start.wall_us, prev.wall_us))
    return found


@dataclass(frozen=True)
class LostWork:
    last_unit_before_kill: int   # the newest unit the killed primary logged
    restored_unit: int           # the unit count the resumed run started from
    lost_units: int              # units done twice (or, if restored from scratch, all done so far)
    lost_ms: float               # kill time minus the time the restored unit was first finished


def lost_work(logs: dict[int, list[ProgressLine]], killed_node: int, kill_wall_us: int,
              successor_node: int, unit_ms: float, gap_us: int | None = None) -> LostWork | None:
    """Work lost by one kill, from the progress logs alone; None if no resumed run is logged.

    The resumed run is the successor's first segment that starts after the kill; it
    restarted from ``restored_unit = its first unit - 1``. Everything the mesh had
    finished after ``restored_unit`` (up to the kill) is redone, so lost time is
    ``kill - time(restored_unit)`` where ``time(u)`` is when unit ``u`` was last logged
    before the kill (on any node). That includes the partial unit in progress at the
    kill, so it is at least ``time(last_unit) - time(restored_unit)`` (SPEC.md: lost
    work = time between the resumed checkpoint and the failure). Restored from scratch
    (unit 0), the run's start counts as ``first logged unit's time - unit_ms``.
    """
    resumed = [s for s in segments(successor_node, logs.get(successor_node, []), gap_us) if s.first_us > kill_wall_us]
    if not resumed:
        return None
    restored_unit = resumed[0].first_unit - 1
    before = [line for line in logs.get(killed_node, []) if line.wall_us <= kill_wall_us]
    last_unit = before[-1].unit if before else 0
    if restored_unit == 0:
        everything = sorted((line for node_lines in logs.values() for line in node_lines), key=lambda l: l.wall_us)
        start_us = everything[0].wall_us - unit_ms * 1000 if everything else kill_wall_us
        return LostWork(last_unit, 0, last_unit, round((kill_wall_us - start_us) / 1000, 3))
    times = [line.wall_us for node_lines in logs.values() for line in node_lines
             if line.unit == restored_unit and line.wall_us <= kill_wall_us]
    if times:
        restored_us = max(times)
    else:  # the restored unit's line is missing (torn): estimate it from the rate
        restored_us = kill_wall_us - (last_unit - restored_unit) * unit_ms * 1000
    return LostWork(last_unit, restored_unit, max(0, last_unit - restored_unit),
                    round((kill_wall_us - restored_us) / 1000, 3))


def overlapping_runs(logs: dict[int, list[ProgressLine]], tolerance_us: int) -> list[tuple[Segment, Segment]]:
    """Pairs of runs of ONE job on two different nodes whose logged lifetimes overlap.

    Two live copies of a job at once (a double run) log interleaved lines; a correct
    migration logs the old run's last line before the kill and the new run's first
    line after it. ``tolerance_us`` absorbs the gap between two lines of one run
    (a run is alive from ``first_us - tolerance`` to ``last_us + tolerance``).
    """
    runs = sorted((s for node, lines in logs.items() for s in segments(node, lines)), key=lambda s: s.first_us)
    pairs = []
    for i, earlier in enumerate(runs):
        for later in runs[i + 1:]:
            if later.first_us > earlier.last_us:
                break
            if later.node != earlier.node and later.first_us + tolerance_us < earlier.last_us:
                pairs.append((earlier, later))
    return pairs


# --- the machine -----------------------------------------------------------------------------

def machine_info() -> dict:
    """What BENCHMARKS.md records about the machine a run was measured on."""
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    mem_total_mib = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    mem_total_mib = int(line.split()[1]) // 1024
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": model, "mem_total_mib": mem_total_mib,
            "loadavg_before": load, "python": platform.python_version(), "kernel": platform.release(),
            "libp2p": _package_version("libp2p")}


def _package_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# --- starts under a stale fence --------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadStart:
    at: str          # the node log's timestamp ("YYYY-MM-DD HH:MM:SS,mmm": sorts as time)
    node: int
    job_hex: str
    fence: int


def parse_workload_starts(node: int, log_text: str) -> list[WorkloadStart]:
    """The ``job_started job_id=... fence=F`` lines of one node's log (meshnode/node/driver.py)."""
    starts = []
    for line in log_text.split("\n"):
        marker = line.find(" job_started ")
        if marker < 0:
            continue
        fields = dict(part.split("=", 1) for part in line[marker:].split() if "=" in part)
        if "job_id" in fields and fields.get("fence", "").isdigit():
            starts.append(WorkloadStart(line[:23], node, fields["job_id"], int(fields["fence"])))
    return starts


def stale_fence_starts(starts: list[WorkloadStart]) -> list[WorkloadStart]:
    """Starts of a job under a fence older than one another node had already started it under.

    A node that starts a workload the mesh has already moved elsewhere (a higher fence)
    runs it twice at once for as long as it takes to notice: a double run even when
    the process is stopped before it logs any progress.
    """
    newest: dict[str, WorkloadStart] = {}
    stale = []
    for start in sorted(starts, key=lambda s: s.at):
        seen = newest.get(start.job_hex)
        if seen is not None and start.fence < seen.fence and start.node != seen.node:
            stale.append(start)
        if seen is None or start.fence > seen.fence:
            newest[start.job_hex] = start
    return stale
