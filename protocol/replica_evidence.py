"""The evidence of a replica rule (SPEC.md R4c, R4g): one chain of signed capability vectors
per node running the job, the primary's first, checked against the job's cooldowns and
hysteresis, and the mean of what the chains showed all along. Pure: no clock, no IO."""

from __future__ import annotations

from protocol.errors import RemoteProtocolError
from protocol.messages import CapabilityVector, ReflexTrigger, decode_message
from protocol.reflexes import chain_level, cooldown_bounds, mean_holds, reads_replicas, runs_job, split_chains


def related_reflex_at(record, index: int) -> list:
    """R4c's cooldown and hysteresis: the last actions of the rule itself and of every rule
    that pulls the other way (an ``above`` rule against the ``below`` ones)."""
    rules = record.manifest.reflexes
    upward = rules[index].above is not None
    return [at for i, at in sorted(record.replica_reflex_at.items())
            if i == index or (i < len(rules) and (rules[i].above is not None) != upward)]


def chain_holders(record, rule) -> list:
    """R4g: whose vectors the evidence of ``rule`` holds, one chain each, in this order: the
    primary, then (for a GPU signal) each replica's node by index."""
    replicas = [r.node for _i, r in sorted(record.replicas.items())] if reads_replicas(rule) else []
    return [record.primary, *replicas]


def replica_evidence_error(record, trigger: ReflexTrigger, mesh_id: bytes, caches=None) -> str | None:
    """R4g: the evidence holds one chain of consecutive vectors per node running the job (the
    primary's as R3's, against the rule's own cooldown and its opposite rules', R4c; each
    replica's taken since the node took it on, spanning ``for_ms``), and the mean of the
    chains' levels is beyond the threshold."""
    rule = record.manifest.reflexes[trigger.rule]
    caps = []
    for data in trigger.evidence:
        try:
            envelope, cap = decode_message(data, mesh_id, expect=CapabilityVector, caches=caches)
        except RemoteProtocolError as exc:
            return "an evidence vector is not valid: %s" % exc
        if envelope.signer != cap.node:
            return "an evidence vector is signed by another node than it names"
        caps.append(cap)
    chains = split_chains(caps)
    if [node for node, _chain in chains] != chain_holders(record, rule):
        return "the evidence is not one chain of the primary then one of each replica's node, by index"
    for node, chain in chains:
        for before, after in zip(chain, chain[1:]):
            if after.seq != before.seq + 1:
                return "the evidence vectors are not consecutive (seq %d then %d)" % (before.seq, after.seq)
    primary = chains[0][1]
    for cap in primary:
        if not runs_job(cap, record.job_id, record.fence):
            return "vector seq %d does not show the job running at fence %d" % (cap.seq, record.fence)
    held = primary[-1].taken_ms - primary[0].taken_ms
    for last in related_reflex_at(record, trigger.rule) or [None]:
        span_ms, not_before_ms = cooldown_bounds(rule, last, record.primary)
        if held < span_ms:
            return "the condition is shown for %d ms, the rule asks %d ms" % (held, span_ms)
        if primary[0].taken_ms < not_before_ms:
            return "the job is in its reflex cooldown until %d ms" % not_before_ms
    for (_node, chain), (_index, replica) in zip(chains[1:], sorted(record.replicas.items())):
        if chain[0].seq <= replica.since_seq:
            return "a replica's chain starts before its node took the replica on"
        if chain[-1].taken_ms - chain[0].taken_ms < rule.for_ms:
            return "a replica's chain spans %d ms, the rule asks %d ms" % (
                chain[-1].taken_ms - chain[0].taken_ms, rule.for_ms)
    levels = [chain_level(rule, chain, record.job_id) for _node, chain in chains]
    if levels[0] is None:
        return "the primary's vectors do not show the signal"
    if not mean_holds(rule, [level for level in levels if level is not None]):
        return "the mean over the replicas does not show the condition"
    return None


def primary_chain(trigger: ReflexTrigger, mesh_id: bytes, caches=None) -> list:
    """The leading chain of a trigger's evidence: the primary's vectors (R4g), as decoded."""
    caps = [decode_message(data, mesh_id, expect=CapabilityVector, caches=caches)[1] for data in trigger.evidence]
    return split_chains(caps)[0][1] if caps else []
