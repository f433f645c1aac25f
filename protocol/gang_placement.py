"""Where a gang's workers go (SPEC.md GA2): the topology rule, network distance and
diameter, and the one deterministic choice every validator recomputes from the bids.

A gang is placed all at once: ``choose_gang`` takes the verified bids of its placement
instance and returns every rank's node and GPUs, plus backups, or None when no set of
bidders satisfies the gang's size and topology. Each bid reserves one worker's resources
(the job's ``[resources]``), so every rank runs on its own node.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Iterable

from protocol.messages import GangPlacement, GangWorker, JobManifest
from protocol.placement import BidFacts, rank_bids, wanted_backups

SAME_NODE, SAME_RAIL_GROUP, SAME_ZONE, OTHER_ZONE = 0, 1, 2, 3   # network distance between two nodes (GA2)
# Where a rank listens for its peers (GA5): below Linux's ephemeral ports (32768-60999 by
# default). With a span up to 60000 a rank's port was often some outgoing connection's
# source port on the host, the bind failed (EADDRINUSE) until that connection closed, and
# the ring did not form again within 30 s: the gang was lost (`bench gang` seed 17, kill 10).
GANG_PORT_BASE, GANG_PORT_SPAN = 20000, 12000


def gang_worker_id(gang_id: bytes, rank: int) -> bytes:
    """SPEC.md GA4: the job-table key of a gang's rank (its checkpoints, exits, allocation)."""
    return hashlib.sha256(b"gang-worker" + gang_id + rank.to_bytes(2, "big")).digest()


def gang_port(worker_id: bytes, fence: int) -> int:
    """SPEC.md GA5: the TCP port rank ``worker_id`` listens on for its peers under ``fence``."""
    digest = hashlib.sha256(b"gang-port" + worker_id + fence.to_bytes(8, "big")).digest()
    return GANG_PORT_BASE + int.from_bytes(digest[:4], "big") % GANG_PORT_SPAN


def distance(a, b) -> int:
    """Network distance of two capability vectors' nodes: 0 one node, 1 one rail group
    (in one zone, rail group not empty), 2 one zone, 3 two zones."""
    if a.node == b.node:
        return SAME_NODE
    if a.zone != b.zone:
        return OTHER_ZONE
    return SAME_RAIL_GROUP if a.rail_group and a.rail_group == b.rail_group else SAME_ZONE


def diameter(capabilities) -> int:
    """The largest distance between two of the nodes (0 for one node)."""
    caps = list(capabilities)
    return max((distance(a, b) for i, a in enumerate(caps) for b in caps[i + 1:]), default=SAME_NODE)


def topology_error(topology: str, capabilities) -> str | None:
    """Why nodes with these capability vectors break the gang's topology rule, or None."""
    caps = list(capabilities)
    zones = [c.zone for c in caps]
    if topology == "zone" and len(set(zones)) > 1:
        return "topology 'zone': workers in zones %s" % ", ".join(sorted(set(zones)))
    if topology == "rail_group":
        groups = {(c.zone, c.rail_group) for c in caps}
        if len(groups) > 1 or any(not c.rail_group for c in caps):
            return "topology 'rail_group': workers in rail groups %s" % ", ".join(
                sorted("%s/%s" % (z, r or "-") for z, r in groups))
    if topology == "spread_zones" and len(caps) > 1:
        most = max(zones.count(z) for z in set(zones))
        if most > (len(caps) + 1) // 2:
            return "topology 'spread_zones': %d of %d workers in one zone" % (most, len(caps))
    return None


def _groups(topology: str, ranked: list[BidFacts]) -> list[list[BidFacts]]:
    """The bidder groups one gang may be drawn from, each in rank order."""
    by_zone: dict[str, list] = {}
    by_rail: dict[tuple, list] = {}
    for facts in ranked:
        cap = facts.capability
        by_zone.setdefault(cap.zone, []).append(facts)
        if cap.rail_group:
            by_rail.setdefault((cap.zone, cap.rail_group), []).append(facts)
    if topology == "zone":
        return list(by_zone.values())
    if topology == "rail_group":
        return list(by_rail.values())
    return [*by_rail.values(), *by_zone.values(), ranked]   # "none": the smallest diameter wins


def _spread(ranked: list[BidFacts], size: int) -> list[BidFacts]:
    """The best-ranked ``size`` bidders with no zone holding more than half of them (rounded up)."""
    cap, counts, chosen = (size + 1) // 2, {}, []
    for facts in ranked:
        zone = facts.capability.zone
        if len(chosen) < size and counts.get(zone, 0) < cap:
            counts[zone] = counts.get(zone, 0) + 1
            chosen.append(facts)
    return chosen


def candidate_sets(topology: str, ranked: list[BidFacts], size: int) -> list[list[BidFacts]]:
    """Every set of ``size`` bidders the rule allows that the choice compares (GA2): the
    best-ranked ``size`` of each group (spread_zones: the one greedy set)."""
    if topology == "spread_zones":
        chosen = _spread(ranked, size)
        return [chosen] if len(chosen) == size else []
    return [group[:size] for group in _groups(topology, ranked) if len(group) >= size]


def pick_gang(topology: str, sizes, ranked: list) -> list | None:
    """SPEC.md GA2 over bidders in rank order (anything with ``signer`` and ``capability``):
    the workers in rank order of the gang (ring order), or None when no size fits."""
    position = {facts.signer: i for i, facts in enumerate(ranked)}
    for size in sizes:
        sets = candidate_sets(topology, ranked, size)
        if sets:
            best = min(sets, key=lambda s: (diameter(f.capability for f in s), sum(position[f.signer] for f in s),
                                            sorted(f.signer for f in s)))
            # Ring order: neighbours by zone and rail group, so a ring all-reduce crosses each boundary once.
            return sorted(best, key=lambda f: (f.capability.zone, f.capability.rail_group, position[f.signer]))
    return None


def pick_backups(workers: list, ranked: list, count: int) -> list:
    """The ``count`` other bidders a failed rank may move to: those that keep the gang's
    diameter smallest first (the largest distance to a worker), then by rank."""
    chosen = {f.signer for f in workers}
    position = {facts.signer: i for i, facts in enumerate(ranked)}
    others = [f for f in ranked if f.signer not in chosen]
    others.sort(key=lambda f: (max(distance(f.capability, w.capability) for w in workers), position[f.signer]))
    return others[:count]


def choose_gang(job_envelope: bytes, job: JobManifest, instance: bytes,
                bids: Iterable[BidFacts]) -> GangPlacement | None:
    """SPEC.md GA2: the gang placement every correct node computes from the same bids."""
    ranked = rank_bids(job, instance, bids)
    workers = pick_gang(job.gang.topology, job.gang.sizes(), ranked)
    if workers is None:
        return None
    return GangPlacement(job=job_envelope,
                         workers=tuple(GangWorker(node=f.signer, gpus=tuple(sorted(f.bid.reserved_gpus)))
                                       for f in workers),
                         backups=tuple(f.signer for f in pick_backups(workers, ranked, wanted_backups(job))))


def gang_shortfall(job: JobManifest, instance: bytes, bids: Iterable[BidFacts]) -> str:
    """Why no gang fits the bids (the round's leader, for ``why``)."""
    return shortfall(job, [facts.capability for facts in rank_bids(job, instance, bids)], "bidders")


def shortfall(job: JobManifest, capabilities: list, what: str) -> str:
    """Why no gang of the job's smallest size fits nodes with these capability vectors:
    the most workers its topology rule lets one group (or the zones) hold."""
    size, topology = min(job.gang.sizes()), job.gang.topology
    if topology == "spread_zones":
        per_zone = Counter(c.zone for c in capabilities)
        spread = min(size, sum(min(count, (size + 1) // 2) for count in per_zone.values()))
        return "gang of %d (spread_zones): only %d eligible %s can be spread over zones" % (size, spread, what)
    if topology in ("zone", "rail_group"):
        groups = Counter(c.zone if topology == "zone" else "%s/%s" % (c.zone, c.rail_group)
                         for c in capabilities if topology == "zone" or c.rail_group)
        count, name = max(((n, g) for g, n in groups.items()), default=(0, "none"))
        return "gang of %d needs one %s: the largest has %d eligible %s (%s)" % (
            size, topology.replace("_", " "), count, what, name)
    return "gang of %d: %d eligible %s" % (size, len(capabilities), what)
