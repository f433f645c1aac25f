"""Why a job is pending, and what change would make it placeable (pure; no IO).

Every node that will not bid for a job signs a Decline with one reason from
``protocol.messages.DECLINE_REASONS`` (SPEC.md 6.2). The control API hands those back
grouped by reason, either as node lists (``why``) or counts (``jobs``). This module
turns them into the line a workload owner reads ("3 nodes: not enough GPU memory;
2 nodes: zone not allowed") and into concrete suggestions, each naming the manifest
field to change and by how much, computed from the job and, when known, the
declining nodes' capability vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import DECLINE_REASONS

REASON_TEXT = {
    "owner_not_allowed": "owner key not allowed",
    "entrypoint_not_allowed": "entrypoint not allowed",
    "not_enough_gpus": "not enough free GPUs",
    "not_enough_gpu_memory": "not enough GPU memory",
    "not_enough_cpu": "not enough CPU",
    "not_enough_memory": "not enough memory",
    "zone_not_allowed": "zone not allowed",
    "labels_missing": "labels missing",
    "attestation_missing": "attestation missing",
    "node_unhealthy": "node unhealthy",
    "fenced": "node fenced",
    "over_quota": "owner over its quota in the pool",
    "unknown_pool": "pool unknown to the mesh",
    "reserved": "capacity reserved for a job ahead",
}
MAX_SHOWN_NODES = 8  # node ids listed per reason; the count says how many more


@dataclass(frozen=True)
class DeclineGroup:
    reason: str
    count: int
    nodes: tuple[str, ...]  # short ids, empty when only counts are known

    @property
    def text(self) -> str:
        noun = "node" if self.count == 1 else "nodes"
        return "%d %s: %s" % (self.count, noun, REASON_TEXT.get(self.reason, self.reason.replace("_", " ")))


@dataclass(frozen=True)
class Suggestion:
    field: str      # the manifest field to change, as parse_manifest names it
    change: str     # what to do, with numbers where they are known
    unblocks: int   # declining nodes this change alone would turn into bidders


def group_declines(declines: dict) -> list[DeclineGroup]:
    """Normalise ``{reason: count}`` or ``{reason: [short ids]}``, most common reason first."""
    groups = []
    for reason, value in declines.items():
        if isinstance(value, int):
            nodes, count = (), value
        else:
            nodes = tuple(sorted(str(n) for n in value))
            count = len(nodes)
        if count > 0:
            groups.append(DeclineGroup(str(reason), count, nodes))
    return sorted(groups, key=lambda g: (-g.count, g.reason))


def format_declines(declines: dict) -> str:
    """One line: ``3 nodes: not enough GPU memory; 2 nodes: zone not allowed``."""
    groups = group_declines(declines)
    return "; ".join(g.text for g in groups) if groups else "no declines yet"


def _declining(group: DeclineGroup, nodes_by_short: dict) -> list[dict]:
    return [nodes_by_short[s] for s in group.nodes if s in nodes_by_short]


def _free_gpu_mem_mib(capability: dict) -> list[int]:
    by_index = {g["index"]: g for g in capability.get("gpus", ())}
    return [by_index[i]["mem_total_mib"] - by_index[i]["mem_used_mib"]
            for i in capability.get("gpus_free", ()) if i in by_index]


def _suggest(group: DeclineGroup, job: dict, nodes: list[dict]) -> Suggestion:
    """The smallest change to ``job`` that would let ``group``'s nodes bid."""
    resources = job.get("resources", {})
    constraints = job.get("constraints", {})
    caps = [n["capability"] for n in nodes if n.get("capability")]
    reason, count = group.reason, group.count
    if reason == "not_enough_gpu_memory":
        gpus = max(resources.get("gpus", 1), 1)
        fits = [sorted(_free_gpu_mem_mib(c), reverse=True) for c in caps]
        per_node = [free[gpus - 1] for free in fits if len(free) >= gpus]
        if per_node:
            best = max(per_node)
            return Suggestion("resources.gpu_mem_mib", "lower to <= %d MiB (asked %d)"
                              % (best, resources.get("gpu_mem_mib", 0)), sum(1 for v in per_node if v >= best))
        return Suggestion("resources.gpu_mem_mib", "lower it (asked %d MiB)" % resources.get("gpu_mem_mib", 0), count)
    if reason == "not_enough_gpus":
        free = [len(c.get("gpus_free", ())) for c in caps]
        if free:
            best = max(free)
            return Suggestion("resources.gpus", "lower to <= %d (asked %d)" % (best, resources.get("gpus", 0)),
                              sum(1 for v in free if v >= best))
        return Suggestion("resources.gpus", "lower it (asked %d)" % resources.get("gpus", 0), count)
    if reason in ("not_enough_cpu", "not_enough_memory"):
        key, unit, cap_key = (("cpu_milli", "milli-CPU", "cpu_milli_free") if reason == "not_enough_cpu"
                              else ("mem_mib", "MiB", "mem_mib_free"))
        free = [c.get(cap_key, 0) for c in caps]
        if free:
            best = max(free)
            return Suggestion("resources." + key, "lower to <= %d %s (asked %d)" % (best, unit, resources.get(key, 0)),
                              sum(1 for v in free if v >= best))
        return Suggestion("resources." + key, "lower it (asked %d %s)" % (resources.get(key, 0), unit), count)
    if reason == "zone_not_allowed":
        zones = sorted({n["zone"] for n in nodes if n.get("zone")})
        if zones:
            return Suggestion("constraints.zones", "add %s" % ", ".join(zones), count)
        return Suggestion("constraints.zones", "allow more zones (now %s)"
                          % (", ".join(constraints.get("zones", ())) or "any"), count)
    if reason == "labels_missing":
        labels = dict(constraints.get("labels", ()))
        shown = ", ".join("%s=%s" % kv for kv in sorted(labels.items())) or "label constraints"
        return Suggestion("constraints.labels", "drop %s" % shown, count)
    if reason == "attestation_missing":
        attested = dict(constraints.get("attested", ()))
        shown = ", ".join("%s=%s" % kv for kv in sorted(attested.items())) or "attestation constraints"
        return Suggestion("constraints.attested", "drop %s, or wait for attested nodes" % shown, count)
    if reason == "entrypoint_not_allowed":
        return Suggestion("entrypoint", "use one these nodes allow (not %r)" % job.get("entrypoint", "?"), count)
    if reason == "owner_not_allowed":
        return Suggestion("owner", "ask these operators to allow your key", count)
    if reason == "over_quota":
        return Suggestion("", "wait: your jobs in pool %r hold your quota (see queue)"
                          % job.get("scheduling", {}).get("pool", ""), 0)
    if reason == "unknown_pool":
        return Suggestion("scheduling.pool", "name a pool of the mesh (`meshnode mesh show`)", count)
    if reason == "reserved":
        return Suggestion("scheduling.max_runtime_ms", "declare a runtime short enough to backfill", count)
    # node_unhealthy, fenced and unknown reasons: nothing in the job can change them
    return Suggestion("", "wait: the nodes themselves are not available", 0)


def suggest_changes(declines: dict, job: dict, nodes: list[dict] = ()) -> list[Suggestion]:
    """Suggestions for a pending job, the ones that unblock the most nodes first.

    ``job`` is a manifest body (``JobManifest.to_body()`` or the same keys); ``nodes``
    are rows of the control API's ``nodes`` op, used to put numbers in the suggestion.
    A job the mesh can do nothing about (only unhealthy nodes declined) gets none.
    """
    by_short = {n["short"]: n for n in nodes}
    suggestions = []
    for group in group_declines(declines):
        if group.reason not in DECLINE_REASONS:
            continue
        suggestion = _suggest(group, job, _declining(group, by_short))
        if suggestion.unblocks > 0:
            suggestions.append(suggestion)
    return sorted(suggestions, key=lambda s: (-s.unblocks, s.field))


def placeable_hint(declines: dict, job: dict, nodes: list[dict] = ()) -> str:
    """One sentence for the why-pending view: the change that unblocks the most nodes."""
    if not group_declines(declines):
        return "no node has declined yet: the placement vote is still running"
    suggestions = suggest_changes(declines, job, nodes)
    if not suggestions:
        return "no change to the job helps: wait for declining nodes to recover"
    best = suggestions[0]
    noun = "node" if best.unblocks == 1 else "nodes"
    return "%s: %s (would unblock %d %s)" % (best.field, best.change, best.unblocks, noun)


def queue_rows(queue: dict | None) -> list[tuple[str, str]]:
    """Rows for the why-pending view (SPEC.md Q3, Q4): the job's queue position in its
    pool, the quota that holds it, and its estimated start."""
    if not queue:
        return []
    pool = repr(queue["pool"]) if queue["pool"] else "default"
    position = "%d of %d in pool %s" % (queue["position"], queue["queue_length"], pool)
    if queue.get("ahead_with_higher_priority"):
        position += " (%d ahead with higher priority)" % queue["ahead_with_higher_priority"]
    estimate = queue["estimate"]
    if estimate["start_ms"] is None:
        start = estimate["reason"] if estimate["reason"].startswith(("unknown", "never")) else "unknown: " + estimate["reason"]
    elif estimate["in_ms"] == 0:
        start = "now (%s)" % estimate["reason"]
    else:
        start = "in %.1f s (%s)" % (estimate["in_ms"] / 1000, estimate["reason"])
    return [("queue", position), ("quota", queue.get("quota") or "within quota"), ("estimated start", start)]
