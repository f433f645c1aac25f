"""Rows and rich tables for the owner's views (pure formatting of control-API results).

The interactive TUI and the one-shot ``meshnode tui --snapshot`` print the same cells,
so both take their rows from here. Columns are chosen to fit an 80-column terminal.
"""

from __future__ import annotations

import time

from rich import box
from rich.table import Table

from keys.identity import short_id
from meshnode.tui.why import format_declines

# NVML clock-throttle reason bits (nvmlClocksThrottleReason*) worth an owner's attention;
# idle (0x1) and user-set application clocks (0x2) are normal and not shown.
THROTTLE_BITS = ((0x4, "pwr"), (0x8, "hw"), (0x20, "therm"), (0x40, "hwtherm"), (0x80, "brake"))
HEALTH_STYLE = {"alive": "green", "self": "cyan", "suspected": "yellow", "evicted": "red"}
STATE_STYLE = {"pending": "yellow", "placed": "cyan", "running": "green", "migrating": "magenta",
               "completed": "blue", "failed": "red", "cancelled": "dim"}

MESH_COLUMNS = ("node", "stake", "zone", "health", "rtt", "gpus", "util", "temp", "throttle")
JOB_COLUMNS = ("job", "name", "state", "primary", "backups", "ckpt", "migr", "lost")
CONSENSUS_COLUMNS = ("instance", "kind", "round", "leader", "decided")
EVIDENCE_COLUMNS = ("offender", "kind", "at")
# Event detail fields that hold a node's public key (the rest hold job, instance or hash ids).
NODE_KEY_FIELDS = frozenset(("primary", "to_node", "suspect", "key", "leader", "offender"))
HIDDEN_DETAIL = frozenset(("mono_ns",))  # a host's monotonic clock, for benchmarks: not a time of day


JOB_ID_CHARS = 8  # a job id's prefix in tables; every command that takes a job id accepts a unique prefix
ZONE_CHARS = 10      # a zone in the mesh view (zones are up to 64 characters), so that it fits 80 columns
JOB_NAME_CHARS = 9   # a job's name in the jobs view, so that the view fits 80 columns


def short_hex(value: str | None, width: int = 8) -> str:
    return "-" if not value else value[:width]


def short_job_id(job_id_hex: str | None) -> str:
    """A job (or consensus instance) id as tables show it: a prefix `why` and the TUI accept."""
    return short_hex(job_id_hex, JOB_ID_CHARS)


def node_label(key_hex: str | None) -> str:
    """A node's short label, the same ``short`` the nodes op gives it (keys.identity.short_id).

    A key's own hex prefix would be a different string from the one the mesh view shows,
    so a job's primary could not be found among the nodes by eye.
    """
    if not key_hex:
        return "-"
    try:
        return short_id(bytes.fromhex(key_hex))
    except ValueError:
        return short_hex(key_hex)


def format_ms(value: int | None) -> str:
    if value is None:
        return "-"
    if value < 10_000:
        return "%d ms" % value
    if value < 600_000:
        return "%d s" % (value // 1000)
    return "%d min" % (value // 60_000)


def rtt_text(rtt_us: int) -> str:
    """A round trip in at most 5 characters: ``0.8ms``, ``84ms``, ``1.2s``."""
    if rtt_us < 10_000:
        return "%.1fms" % (rtt_us / 1000)
    if rtt_us < 1_000_000:
        return "%dms" % (rtt_us // 1000)
    return "%.1fs" % (rtt_us / 1_000_000)


def cut(text: str, chars: int) -> str:
    """A name shortened to ``chars`` with a visible "…" (never used on an id)."""
    return text if len(text) <= chars else text[:chars - 1] + "…"


def throttle_text(reasons: int) -> str:
    names = [name for bit, name in THROTTLE_BITS if reasons & bit]
    if len(names) > 1:   # the first and a count: the mesh view must fit 80 columns
        return "%s+%d" % (names[0], len(names) - 1)
    return names[0] if names else "-"


def gpu_free_text(cap: dict) -> str:
    """Free GPUs: whole ones, or in GPUs to two decimals when shares hold part of one
    (``gpu_milli_free``, SPEC.md P4c): ``2`` or ``1.75``."""
    milli = cap.get("gpu_milli_free") or ()
    if not milli or all(m in (0, 1000) for m in milli):
        return str(len(cap.get("gpus_free", ())))
    return ("%d.%02d" % divmod(sum(milli) // 10, 100)).rstrip("0").rstrip(".")


def gpu_shares_caption(jobs: list[dict]) -> str:
    """Each GPU that shares hold, at the node its jobs name as primary: its milli held and
    by how many jobs (``meshnode jobs``: fractional jobs sharing one GPU, SPEC.md P4c)."""
    held: dict[tuple, list[int]] = {}
    for job in jobs:
        if job.get("gpu_milli") and job.get("state") in ("placed", "running", "migrating") and job.get("gpus"):
            held.setdefault((node_label(job.get("primary")), job["gpus"][0]), []).append(job["gpu_milli"])
    return "; ".join("%s gpu%d %d/1000 milli, %d jobs" % (node, gpu, sum(shares), len(shares))
                     for (node, gpu), shares in sorted(held.items())[:4])


def mesh_row(node: dict) -> tuple[str, ...]:
    cap = node.get("capability") or {}
    gpus = cap.get("gpus", ())
    rtt = node.get("rtt_us")
    if gpus:
        models = sorted({g["model"] for g in gpus})
        free = gpu_free_text(cap)
        gpu_cell = "%s/%d %s" % (free, len(gpus), "+".join(models)[:max(3, 10 - len(free) + 1)])
        util = "%d%%" % (sum(g["util_milli"] for g in gpus) // len(gpus) // 1000)
        temp = "%dC" % (max(g["temp_milli_c"] for g in gpus) // 1000)
        throttled = 0
        for g in gpus:
            throttled |= g["throttle_reasons"]
        throttle = throttle_text(throttled)
    else:
        gpu_cell, util, temp, throttle = ("0" if cap else "?"), "-", "-", "-"
    return (node.get("short") or node_label(node.get("key")), str(node.get("stake", "-")), cut(node.get("zone", "-"), ZONE_CHARS),
            node.get("health", "?"), "-" if rtt is None else rtt_text(rtt),
            gpu_cell, util, temp, throttle)


def primary_cell(job: dict) -> str:
    """A job's primary, or for a gang (SPEC.md GA4) how many of its ranks run: "gang 3/4"."""
    gang = job.get("gang")
    if gang is None:
        return node_label(job.get("primary"))
    workers = gang.get("workers", ())
    running = sum(1 for w in workers if w.get("state") == "running")
    return "gang %d/%d" % (running, len(workers) or max(gang.get("sizes") or [0]))


# SPEC.md GA2's topology rules, as `why` and the TUI state them.
TOPOLOGY_RULES = {"zone": "every worker in one zone", "rail_group": "every worker in one zone and one rail group",
                  "spread_zones": "no zone holds more than half of the workers, rounded up",
                  "none": "no rule: the smallest network diameter wins"}
GANGS_IN_CAPTION = 3


def gang_size_text(gang: dict) -> str:
    """"4 workers", or for an elastic gang its range and sizes: "2..6 workers (6/4/2)"."""
    sizes = sorted(gang.get("sizes") or [0])
    if len(sizes) == 1:
        return "%d workers" % sizes[0]
    return "%d..%d workers (%s)" % (sizes[0], sizes[-1], "/".join(map(str, reversed(sizes))))


def gang_summary(gang: dict) -> str:
    return "%s, topology %s" % (gang_size_text(gang), gang.get("topology", "?"))


def gang_workers_text(gang: dict) -> str:
    """Each rank's node and state: "0 n1a2b3c running, 1 n4d5e6f migrating"."""
    return ", ".join("%d %s %s" % (w.get("rank", 0), node_label(w.get("primary")), w.get("state", "?"))
                     for w in gang.get("workers", ())) or "no rank placed"


def gang_lines(gang: dict) -> list[str]:
    """A gang in `why` and the TUI's why screen (plain text): its rule, ranks, the groups
    its rule allows with their nodes and GPUs, and its recovery history."""
    topology = gang.get("topology", "?")
    lines = ["gang: %s (%s)" % (gang_summary(gang), TOPOLOGY_RULES.get(topology, topology)),
             "ranks: " + gang_workers_text(gang)]
    if gang.get("groups"):
        lines.append("groups (nodes fitting one worker / nodes, GPUs free / GPUs):")
        lines += ["  %s: %d/%d nodes, %d/%d GPUs%s" % (
            g["group"], g["fit"], g["nodes"], g["gpus_free"], g["gpus"],
            "" if g.get("allowed", True) else ", no rail group: not allowed") for g in gang["groups"]]
    history = gang.get("history") or []
    lines.append("recovery history:%s" % ("" if history else " none"))
    for entry in history:
        if entry.get("kind") == "rank_moved":
            lines.append("  epoch %s: rank %s moved %s -> %s (its node was evicted)" % (
                entry.get("epoch"), entry.get("rank"), node_label(entry.get("from")), node_label(entry.get("to"))))
        else:
            lines.append("  epoch %s: attempt %s placed ranks on %s" % (
                entry.get("epoch"), entry.get("attempt"), " ".join(node_label(n) for n in entry.get("workers", ()))))
    return lines


def job_row(job: dict) -> tuple[str, ...]:
    ckpt = job.get("checkpoint_age_ms")
    seq = job.get("checkpoint_seq")
    ckpt_cell = "-" if ckpt is None else ("%s #%d" % (format_ms(ckpt), seq) if seq is not None else format_ms(ckpt))
    return (short_job_id(job.get("job_id")), cut(job.get("name", "?"), JOB_NAME_CHARS), job.get("state", "?"),
            primary_cell(job), str(len(job.get("backups", ()))), ckpt_cell,
            str(job.get("migrations", 0)), format_ms(job.get("lost_work_ms")))


def consensus_row(instance: dict) -> tuple[str, ...]:
    return (short_job_id(instance.get("instance")), instance.get("kind", "?"), str(instance.get("round", 0)),
            node_label(instance.get("leader")), decided_cell(instance))


def decided_cell(instance: dict) -> str:
    """An instance this node gave up (max_rounds, SPEC 6.5) will not decide here: say so."""
    if instance.get("decided"):
        return "yes"
    return "gave up" if instance.get("gave_up") else "no"


def evidence_row(item: dict) -> tuple[str, ...]:
    return (node_label(item.get("offender")), item.get("kind", "?"), str(item.get("at_ms", "-")))


def clock_text(wall_ms: int) -> str:
    """Local wall-clock time of day to the millisecond: ``18:07:03.412``."""
    return time.strftime("%H:%M:%S", time.localtime(wall_ms // 1000)) + ".%03d" % (wall_ms % 1000)


def event_line(event: dict, received_ms: int) -> str:
    """One event as a person reads it: when it arrived (wall clock), its kind, its details
    with nodes by label and ids by prefix.

    An event's own ``at_ms`` is the node's monotonic clock and ``detail.mono_ns`` the
    host's, for benchmarks: neither is a time of day, so neither is shown (``--json``
    keeps them)."""
    detail = event.get("detail")
    detail = detail if isinstance(detail, dict) else {}
    shown = " ".join("%s=%s" % (k, _detail_text(k, v)) for k, v in sorted(detail.items()) if k not in HIDDEN_DETAIL)
    return ("%s %-16s %s" % (clock_text(received_ms), event.get("kind", "?"), shown)).rstrip()


def _detail_text(key: str, value) -> str:
    if key in NODE_KEY_FIELDS and isinstance(value, str):
        return node_label(value)
    if isinstance(value, str) and len(value) == 64:
        return short_job_id(value)
    return plain_text(value)


def plain_text(value) -> str:
    """A value as a table cell: never a Python repr (``None``, ``{'a': 1}``, ``[...]``)."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, dict):
        return ", ".join("%s=%s" % (k, plain_text(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) \
            or "-"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) and len(v) == 2
                                                          for v in value):
        return ", ".join("%s=%s" % (plain_text(k), plain_text(v)) for k, v in value)  # pairs, e.g. labels
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(plain_text(v) for v in value) or "-"
    return str(value)


def compact_table(title: str, columns: tuple[str, ...], rows, styles: dict | None = None,
                  style_col: int = 0) -> Table:
    # No borders, two spaces between columns: every view fits 80 columns with its ids
    # whole (tests/test_cli_ux.py renders each at 80). Only a job's name may be cut (…).
    table = Table(title=title, title_justify="left", expand=False, box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, padding=(0, 1, 0, 0))
    for column in columns:
        table.add_column(column, no_wrap=True, overflow="ellipsis")
    for row in rows:
        style = (styles or {}).get(row[style_col]) if styles else None
        table.add_row(*row, style=style)
    return table


def mesh_table(nodes: list[dict]) -> Table:
    return compact_table("mesh: %d nodes" % len(nodes), MESH_COLUMNS, [mesh_row(n) for n in nodes], HEALTH_STYLE, 3)


def jobs_table(jobs: list[dict]) -> Table:
    table = compact_table("jobs: %d" % len(jobs), JOB_COLUMNS, [job_row(j) for j in jobs], STATE_STYLE, 2)
    pending = [j for j in jobs if j.get("state") == "pending" and j.get("declines")]
    captions = []
    if pending:
        captions.append("; ".join("%s %s" % (short_job_id(j["job_id"]), format_declines(j["declines"]))
                                  for j in pending[:3]))
    gangs = [j for j in jobs if j.get("gang")]
    captions += ["gang %s: %s; ranks %s" % (short_job_id(j["job_id"]), gang_summary(j["gang"]),
                                            gang_workers_text(j["gang"])) for j in gangs[:GANGS_IN_CAPTION]]
    shares = gpu_shares_caption(jobs)
    if shares:
        captions.append("shares: " + shares)
    if captions:
        table.caption = "\n".join(captions)
    return table


def consensus_table(consensus: dict) -> Table:
    table = compact_table("consensus: %d certificates" % consensus.get("certificates", 0), CONSENSUS_COLUMNS,
                   [consensus_row(i) for i in consensus.get("instances", ())])
    return table


def evidence_table(consensus: dict) -> Table:
    return compact_table("evidence: %d" % len(consensus.get("evidence", ())), EVIDENCE_COLUMNS,
                  [evidence_row(e) for e in consensus.get("evidence", ())])


def status_line(status: dict | None) -> str:
    if not status:
        return "disconnected"
    return "node %s  mesh %s  epoch %d  peers %d/%d  up %s" % (
        node_label(status.get("node")), short_hex(status.get("mesh_id")), status.get("epoch", 0),
        status.get("connected", 0), status.get("members", 0), format_ms(status.get("uptime_ms")))


def render_snapshot(snapshot: dict, console) -> None:
    """Print the status line and the mesh, job and consensus tables once (``--snapshot``).

    ``snapshot`` maps each polled op (status, nodes, jobs, consensus) to its result.
    """
    console.print(status_line(snapshot.get("status")))
    console.print(mesh_table(snapshot.get("nodes", {}).get("nodes", [])))
    console.print(jobs_table(snapshot.get("jobs", {}).get("jobs", [])))
    consensus = snapshot.get("consensus") or {}
    console.print(consensus_table(consensus))
    if consensus.get("evidence"):
        console.print(evidence_table(consensus))
