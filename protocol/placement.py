"""Deterministic placement scoring (SPEC.md section 8, "Placement").

Every validator recomputes the leader's placement from the bids in the proposal's
justification, so everything here is a pure function of signed data: no clock, no
local state, integers only. Two kinds of checks exist:

* ``policy_check``: the bidder's own sovereignty policy (allowed owners and
  entrypoints). Only the bidder can apply it; nobody else knows its policy.
* ``capability_check``: facts every voter can verify from the bid's signed capability
  vector and its authority-signed attestations (resources, zones, labels, attested
  attributes). ``choose_placement`` filters bids by it, so a leader cannot place a job
  on a node whose own signed facts say it does not fit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

from protocol.caches import CoreCaches
from protocol.errors import RemoteProtocolError
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, Attestation, Bid, CapabilityVector, GpuState,
                               JobManifest, Placement, decode_message)
from protocol.pack_scoring import gpu_milli_free_map, pack_score, pack_share_gpu
from protocol.policy import NodePolicy

MAX_BACKUPS = 4  # Placement.backups holds at most 4 keys (messages/jobs.py)


@dataclass(frozen=True)
class BidFacts:
    """One verified bid, as scoring sees it."""
    signer: bytes
    bid: Bid
    capability: CapabilityVector
    attested: tuple  # sorted (name, value) pairs from valid authority attestations

    @property
    def attested_map(self) -> dict:
        return dict(self.attested)


def attested_attributes(attestation_envelopes: Iterable[bytes], subject: bytes, mesh_id: bytes,
                        authorities: Iterable[bytes], at_ms: int, *, caches: CoreCaches | None = None) -> tuple:
    """Merge the attributes of every attestation that an authority signed about ``subject``
    and that is valid at ``at_ms`` (issued_ms <= at_ms < expires_ms). Invalid ones are
    ignored, not fatal: a node may carry an expired attestation (SPEC.md P4)."""
    trusted = set(authorities)
    merged: dict[str, str] = {}
    for data in attestation_envelopes:
        try:
            envelope, attestation = decode_message(data, mesh_id, expect=Attestation, allow_any_mesh=True,
                                                   caches=caches)
        except RemoteProtocolError:
            continue
        if envelope.signer not in trusted or attestation.subject != subject:
            continue
        if not attestation.issued_ms <= at_ms < attestation.expires_ms:
            continue
        for name, value in attestation.attributes:
            merged.setdefault(name, value)  # first authority listed wins a conflict
    return tuple(sorted(merged.items()))


def policy_check(job: JobManifest, policy: NodePolicy) -> tuple[bool, str | None, str]:
    """The bidder's private sovereignty policy. Returns (ok, decline_reason, detail)."""
    if policy.allowed_owners is not None and job.owner not in policy.allowed_owners:
        return False, "owner_not_allowed", "owner %s is not on this node's list" % job.owner.hex()[:16]
    if job.entrypoint not in policy.allowed_entrypoints:
        return False, "entrypoint_not_allowed", "entrypoint %r is not allowed here" % job.entrypoint
    return True, None, ""


def gpu_free_mem_mib(capability: CapabilityVector) -> dict[int, int]:
    """Free memory per GPU index, from the signed GPU states."""
    return {g.index: max(0, g.mem_total_mib - g.mem_used_mib) for g in capability.gpus}


def model_fits(job: JobManifest, gpu: GpuState) -> bool:
    """SPEC.md P4c: a job naming a GPU model runs only on GPUs of that model."""
    return not job.resources.gpu_model or gpu.model == job.resources.gpu_model


def free_gpus_for(job: JobManifest, capability: CapabilityVector) -> set[int]:
    """The GPUs with room for one of the job's GPUs, of its model: for whole GPUs those in
    ``gpus_free``; for a share (P4c) those with at least its milli free."""
    models_fit = {g.index for g in capability.gpus if model_fits(job, g)}
    share = job.resources.gpu_milli
    if share:
        free = {i for i, milli in gpu_milli_free_map(capability).items() if milli >= share}
    else:
        free = set(capability.gpus_free)
    return free & models_fit


def fitting_gpus(job: JobManifest, capability: CapabilityVector) -> list[int]:
    """GPU indices that are free and have enough memory for one share of the job."""
    free_mem = gpu_free_mem_mib(capability)
    need = job.resources.gpu_mem_mib
    return sorted(i for i in free_gpus_for(job, capability) if free_mem.get(i, -1) >= need)


# --- GPU health (SPEC.md P4, "GPU health") ------------------------------------------------------
# A pure function of one signed GpuState, so the leader and every validator agree on it.

# At 85 C a datacenter GPU is a few degrees from its slowdown temperature (H100 and A100
# slow down at about 87-90 C): new work there would be throttled at once. The simulated
# profile peaks at 78 C under full load (meshnode/node/telemetry.py), so a busy but
# working GPU is never called unhealthy.
UNHEALTHY_TEMP_MILLI_C = 85_000
# nvml.h clock-event reason bits that mean the GPU is being slowed down for its own
# protection: HW slowdown (0x8), SW thermal (0x20), HW thermal (0x40), HW power brake
# (0x80). Idle (0x1), application clocks (0x2), the SW power cap (0x4, normal at full load),
# sync boost (0x10) and display clocks (0x100) are not faults.
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
UNHEALTHY_THROTTLE_MASK = THROTTLE_HW_SLOWDOWN | THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL | THROTTLE_HW_POWER_BRAKE
# Strain (how loaded a healthy GPU is; ranking only, lower first): utilisation in quarter
# bands plus temperature above 60 C in 5 C bands plus 1 at the power cap. Bands, not raw
# readings, so a degree of jitter does not reorder two equally idle nodes.
STRAIN_UTIL_STEP_MILLI = 25_000
STRAIN_TEMP_FLOOR_MILLI_C = 60_000
STRAIN_TEMP_STEP_MILLI_C = 5_000


def gpu_health_faults(gpu: GpuState) -> list[str]:
    """Why one GPU is unhealthy (empty: healthy): any uncorrected ECC error since the driver
    loaded (the memory is failing: NVIDIA advises draining the GPU), a protective throttle
    reason, or a temperature at or above UNHEALTHY_TEMP_MILLI_C."""
    faults = []
    if gpu.ecc_errors > 0:
        faults.append("%d ECC errors" % gpu.ecc_errors)
    if gpu.throttle_reasons & UNHEALTHY_THROTTLE_MASK:
        faults.append("throttled 0x%x" % (gpu.throttle_reasons & UNHEALTHY_THROTTLE_MASK))
    if gpu.temp_milli_c >= UNHEALTHY_TEMP_MILLI_C:
        faults.append("%d C" % (gpu.temp_milli_c // 1000))
    return faults


def gpu_healthy(gpu: GpuState) -> bool:
    return not gpu_health_faults(gpu)


def gpu_strain(gpu: GpuState) -> int:
    """SPEC.md P4: 0 for an idle, cool GPU; at most 4 + 4 + 1 for a healthy one."""
    heat = max(0, gpu.temp_milli_c - STRAIN_TEMP_FLOOR_MILLI_C) // STRAIN_TEMP_STEP_MILLI_C
    power_capped = 1 if gpu.throttle_reasons & THROTTLE_SW_POWER_CAP else 0
    return gpu.util_milli // STRAIN_UTIL_STEP_MILLI + heat + power_capped


def healthy_fitting_gpus(job: JobManifest, capability: CapabilityVector) -> list[int]:
    """The fitting GPUs whose signed readings are healthy: the only ones a bid may name."""
    states = {g.index: g for g in capability.gpus}
    return [i for i in fitting_gpus(job, capability) if gpu_healthy(states[i])]


def reservable_gpu_mem_mib(capability: CapabilityVector, job: JobManifest | None = None) -> dict[int, int]:
    """Free memory per GPU as a node's own reservation sees it (R1): an unhealthy GPU, or one
    not of ``job``'s model (P4c), reads -1, so no share (not even one asking 0 MiB) fits it
    and no bid names it."""
    return {g.index: max(0, g.mem_total_mib - g.mem_used_mib)
            if gpu_healthy(g) and (job is None or model_fits(job, g)) else -1 for g in capability.gpus}


def unhealthy_detail(capability: CapabilityVector, indices: Iterable[int]) -> str:
    states = {g.index: g for g in capability.gpus}
    parts = ["gpu%d %s" % (i, ", ".join(gpu_health_faults(states[i]))) for i in indices
             if i in states and not gpu_healthy(states[i])]
    return "; ".join(parts)


def capability_check(job: JobManifest, capability: CapabilityVector, attested: dict,
                     reserved_gpus: tuple | None = None) -> tuple[bool, str | None, str]:
    """Publicly verifiable fit of a job on a node. ``reserved_gpus``: the GPUs a bid names
    (validators check them); None when the node asks itself before reserving."""
    constraints = job.constraints
    if constraints.zones and capability.zone not in constraints.zones:
        return False, "zone_not_allowed", "zone %s not in %s" % (capability.zone, ",".join(constraints.zones))
    labels = dict(capability.labels)
    for name, value in constraints.labels:
        if labels.get(name) != value:
            return False, "labels_missing", "label %s=%s missing" % (name, value)
    for name, value in constraints.attested:
        if attested.get(name) != value:
            return False, "attestation_missing", "no authority attests %s=%s" % (name, value)
    if job.strategy == "sovereign" and constraints.zones and attested.get("zone") not in constraints.zones:
        # Sovereign placement trusts no self-declared zone: an authority must attest it.
        return False, "attestation_missing", "zone is not attested to be in %s" % ",".join(constraints.zones)
    ok, reason, detail = resource_check(job, capability)
    if not ok:
        return ok, reason, detail
    if reserved_gpus is not None:
        named = tuple(reserved_gpus)
        if len(named) != job.resources.gpus or len(set(named)) != len(named) or not set(named) <= set(
                healthy_fitting_gpus(job, capability)):
            return False, "not_enough_gpus", "bid names GPUs %s that do not fit" % (list(named),)
    return True, None, ""


def resource_check(job: JobManifest, capability: CapabilityVector) -> tuple[bool, str | None, str]:
    """Whether the node's free resources, as its vector states them, hold the job."""
    res = job.resources
    fitting = fitting_gpus(job, capability)
    if res.gpus:
        of_model = sum(1 for g in capability.gpus if model_fits(job, g))
        if res.gpu_model and of_model < res.gpus:
            return False, "gpu_model_missing", "%d GPUs of model %s, %d needed" % (of_model, res.gpu_model, res.gpus)
        free = free_gpus_for(job, capability)
        if res.gpu_milli and not free:
            return False, "not_enough_gpus", "no GPU with %d milli free" % res.gpu_milli
        if len(free) < res.gpus:
            return False, "not_enough_gpus", "%d free, %d needed" % (len(free), res.gpus)
        if len(fitting) < res.gpus:
            return False, "not_enough_gpu_memory", "%d GPUs with %d MiB free, %d needed" % (
                len(fitting), res.gpu_mem_mib, res.gpus)
        healthy = healthy_fitting_gpus(job, capability)
        if len(healthy) < res.gpus:
            return False, "node_unhealthy", "%d of %d fitting GPUs healthy, %d needed: %s" % (
                len(healthy), len(fitting), res.gpus, unhealthy_detail(capability, fitting))
    if capability.cpu_milli_free < res.cpu_milli:
        return False, "not_enough_cpu", "%d milli-CPU free, %d needed" % (capability.cpu_milli_free, res.cpu_milli)
    if capability.mem_mib_free < res.mem_mib:
        return False, "not_enough_memory", "%d MiB free, %d needed" % (capability.mem_mib_free, res.mem_mib)
    return True, None, ""


def eligibility(job: JobManifest, capability: CapabilityVector, policy: NodePolicy,
                attested: dict) -> tuple[bool, str | None, str]:
    """A node asks itself whether to bid: its private policy, then the public facts."""
    ok, reason, detail = policy_check(job, policy)
    if not ok:
        return ok, reason, detail
    return capability_check(job, capability, attested)


def tie_break(instance: bytes, node: bytes) -> bytes:
    """SPEC.md P4: equal scores are ordered by SHA-256(instance || node key), lowest first.
    Per-instance hashing spreads ties over nodes instead of favouring one key forever."""
    return hashlib.sha256(instance + node).digest()


def free_compute(facts: BidFacts) -> tuple[int, int, int]:
    """Free healthy GPUs, their free memory, free CPU: an unhealthy GPU is no capacity."""
    cap = facts.capability
    free_mem = gpu_free_mem_mib(cap)
    gpus_free = {g.index for g in cap.gpus if gpu_healthy(g)} & set(cap.gpus_free)
    return len(gpus_free), sum(free_mem.get(i, 0) for i in gpus_free), cap.cpu_milli_free


def bid_strain(facts: BidFacts) -> int:
    """SPEC.md P4: the highest strain among the GPUs the bid reserves (0 for none)."""
    states = {g.index: g for g in facts.capability.gpus}
    return max((gpu_strain(states[i]) for i in facts.bid.reserved_gpus if i in states), default=0)


def rank_key(strategy: str, instance: bytes, facts: BidFacts) -> tuple:
    """Smaller is better. First the strain of the GPUs the bid reserves (cooler, less busy,
    not power-capped first: SPEC.md P4), then latency: lowest round-trip time, then most
    free compute; throughput and sovereign: most free compute (GPUs, GPU memory, CPU),
    then lowest RTT."""
    gpus, gpu_mem, cpu = free_compute(facts)
    tie = tie_break(instance, facts.signer)
    strain = bid_strain(facts)
    if strategy == "latency":
        return (strain, facts.bid.rtt_us, -gpus, -gpu_mem, -cpu, tie)
    return (strain, -gpus, -gpu_mem, -cpu, facts.bid.rtt_us, tie)


def pack_rank_key(job: JobManifest, instance: bytes, facts: BidFacts) -> tuple:
    """SPEC.md P4c, strategy ``pack``: least fragmentation growth over the mesh's reference
    workload, then least GPU milli and CPU left free (fill a started node, keep whole GPUs
    and nodes free), then strain, RTT and the tie hash."""
    cap = facts.capability
    healthy = {g.index for g in cap.gpus if gpu_healthy(g)}
    score = pack_score(job.resources, cap, healthy, facts.bid.reserved_gpus)
    return score + (bid_strain(facts), facts.bid.rtt_us, tie_break(instance, facts.signer))


def pack_share_choice(job: JobManifest, capability: CapabilityVector) -> tuple[int, ...]:
    """SPEC.md P4c: the GPU a ``pack`` share's bid reserves (replay's pack policy choice among
    the healthy fitting GPUs); () for any other job (the ledger's own choice)."""
    if job.strategy != "pack" or not job.resources.gpu_milli:
        return ()
    healthy = {g.index for g in capability.gpus if gpu_healthy(g)}
    choice = pack_share_gpu(job.resources, capability, healthy, healthy_fitting_gpus(job, capability))
    return () if choice is None else (choice,)


def rank_bids(job: JobManifest, instance: bytes, bids: Iterable[BidFacts]) -> list[BidFacts]:
    """Eligible bids, best first, one per signer (a duplicate signer makes the input invalid)."""
    eligible = []
    seen = set()
    for facts in bids:
        if facts.signer in seen:
            raise RemoteProtocolError("two bids from one signer in one justification")
        seen.add(facts.signer)
        if facts.bid.instance != instance:
            continue
        ok, _reason, _detail = capability_check(job, facts.capability, facts.attested_map, facts.bid.reserved_gpus)
        if ok:
            eligible.append(facts)
    if job.strategy == "pack":
        eligible.sort(key=lambda f: pack_rank_key(job, instance, f))
    else:
        eligible.sort(key=lambda f: rank_key(job.strategy, instance, f))
    return eligible


def wanted_backups(job: JobManifest) -> int:
    # SPEC.md P4: exactly what the owner asked for (manifests default to 1), fewer if fewer bid.
    return min(MAX_BACKUPS, job.backups)


def choose_backups(primary: BidFacts, ranked_others: list[BidFacts], count: int) -> tuple:
    """The best ``count`` other bidders, those in another zone than the primary first."""
    other_zone = [f for f in ranked_others if f.capability.zone != primary.capability.zone]
    same_zone = [f for f in ranked_others if f.capability.zone == primary.capability.zone]
    return tuple(f.signer for f in (other_zone + same_zone)[:count])


def choose_placement(job_envelope: bytes, job: JobManifest, instance: bytes, bids: Iterable[BidFacts], *,
                     caches: CoreCaches | None = None) -> Placement | None:
    """The placement every correct node computes from the same bids, or None if none fits.

    A core recomputes the leader's placement for every proposal of it, from the same
    verified bids (the same BidFacts objects: parse_bid remembers them by bytes), so
    ``caches.placements`` remembers the pure result, keyed by the identities of the facts;
    an entry holds them alive, so no id is reused while it exists."""
    facts = tuple(bids)
    table = caches.placements if caches is not None else None
    if table is not None:
        key = (job_envelope, instance, tuple(map(id, facts)))
        hit = table.lookup(key)
        if hit is not None and (hit[0] is job or hit[0] == job) and all(a is b for a, b in zip(hit[1], facts)):
            return hit[2]
    placement = _choose_placement(job_envelope, job, instance, facts)
    if table is not None:
        table.remember(key, (job, facts, placement))
    return placement


def _choose_placement(job_envelope: bytes, job: JobManifest, instance: bytes,
                      bids: Iterable[BidFacts]) -> Placement | None:
    ranked = rank_bids(job, instance, bids)
    if not ranked:
        return None
    primary, others = ranked[0], ranked[1:]
    backups = choose_backups(primary, others, wanted_backups(job))
    return Placement(job=job_envelope, primary=primary.signer, backups=backups,
                     gpus=tuple(sorted(primary.bid.reserved_gpus)))


def select_justification(job: JobManifest, instance: bytes, bids: Iterable[BidFacts]) -> list[BidFacts]:
    """The leader keeps the best MAX_BIDS_PER_PROPOSAL eligible bids (SPEC.md 6.3): the
    proposal stays O(1) in mesh size and choose_placement over the kept set gives the
    same answer as over all of them."""
    return rank_bids(job, instance, bids)[:MAX_BIDS_PER_PROPOSAL]


def parse_bid(data: bytes, mesh_id: bytes, instance: bytes, epoch: int, members: dict,
              authorities: Iterable[bytes], *, caches: CoreCaches | None = None) -> BidFacts:
    """Verify one bid envelope as a validator does (SPEC.md P3, P4b). Raises RemoteProtocolError.

    ``members``: the epoch's member keys (any mapping or set supporting ``in``).
    A bid is checked by the leader and by every validator of every proposal that carries
    it: the membership-independent part of the check is a pure function of the other
    arguments, so ``caches.bids`` remembers its result (failures are not remembered)."""
    authorities = tuple(authorities)
    table = caches.bids if caches is not None else None
    facts = None
    if table is not None:
        key = (data, mesh_id, instance, epoch, authorities)
        facts = table.lookup(key)
    if facts is None:
        facts = _verify_bid(data, mesh_id, instance, epoch, authorities, caches)
        if table is not None:
            table.remember(key, facts)
    if facts.signer not in members:
        raise RemoteProtocolError("bid from a non-member")
    return facts


def _verify_bid(data: bytes, mesh_id: bytes, instance: bytes, epoch: int, authorities: tuple,
                caches: CoreCaches | None) -> BidFacts:
    envelope, bid = decode_message(data, mesh_id, expect=Bid, caches=caches)
    if bid.instance != instance or bid.epoch != epoch:
        raise RemoteProtocolError("bid for another instance or epoch")
    cap_envelope, capability = decode_message(bid.capability, mesh_id, expect=CapabilityVector, caches=caches)
    if cap_envelope.signer != envelope.signer or capability.node != envelope.signer:
        raise RemoteProtocolError("bid carries another node's capability vector")
    attested = attested_attributes(bid.attestations, envelope.signer, mesh_id, authorities, capability.taken_ms,
                                   caches=caches)
    return BidFacts(envelope.signer, bid, capability, attested)
