"""Reflex rules evaluated from signed telemetry (SPEC.md R3).

A manifest's reflex rule holds when its job's primary signed capability vectors that show
the rule's condition continuously for the rule's duration: consecutive by seq (so no
vector in between could have shown otherwise), each listing the job running at its fence,
from the first to the last at least ``for_ms`` apart by their ``taken_ms``. Every member
holds the same signed vectors, so any one may notice, and every validator checks the
evidence from the vectors alone (``evidence_error``). Pure: no clock, no IO.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from protocol.errors import RemoteProtocolError
from protocol.messages import (JOB_REFLEX_SIGNALS, MAX_EVIDENCE, CapabilityVector, JobSignals, Reflex,
                               decode_message)
from protocol.placement import UNHEALTHY_THROTTLE_MASK


class Readings(NamedTuple):
    """What a rule's condition reads of a vector (condition_holds takes either): a node's
    readings before it signs them, to tell whether they cross a threshold (P1b)."""
    zone: str
    gpus: tuple
    job_signals: tuple


def signal_value(signal: str, cap: CapabilityVector, job_id: bytes = b"") -> list[int]:
    """The signal on each of the vector's GPUs, in milli-units of the rule's unit (percent,
    degrees C, a count x 1000), so a rule's integer threshold x 1000 compares exactly. A job
    signal (R3a) is the one value job ``job_id`` reported in the vector, or none: a vector
    where the job reported nothing (or another node's, for a target) never shows it."""
    if signal in JOB_REFLEX_SIGNALS:
        return [_job_signal(signal, s) for s in cap.job_signals if s.job_id == job_id]
    if signal == "gpu_util":
        return [g.util_milli for g in cap.gpus]
    if signal == "gpu_temp":
        return [g.temp_milli_c for g in cap.gpus]
    if signal == "gpu_mem":
        return [g.mem_used_mib * 100_000 // g.mem_total_mib if g.mem_total_mib else 0 for g in cap.gpus]
    if signal == "throttle":
        return [1000 if g.throttle_reasons & UNHEALTHY_THROTTLE_MASK else 0 for g in cap.gpus]
    if signal == "ecc_errors":
        return [g.ecc_errors * 1000 for g in cap.gpus]
    raise ValueError("unknown reflex signal %r" % signal)


def _job_signal(signal: str, reported: JobSignals) -> int:
    if signal == "request_rate":
        return reported.request_rate_milli
    if signal == "request_latency_ms":
        return reported.latency_p99_us
    return reported.progress_rate_milli


def condition_holds(rule: Reflex, cap: CapabilityVector, job_id: bytes = b"") -> bool:
    """The rule's condition on one vector: some GPU (for a job signal: job ``job_id``'s
    report) above ``above`` (or below ``below``), in the rule's zone. A vector without GPUs
    (or without the job's report) shows no condition."""
    if rule.zone and cap.zone != rule.zone:
        return False
    values = signal_value(rule.signal, cap, job_id)
    if rule.above is not None:
        return any(v > rule.above * 1000 for v in values)
    return any(v < rule.below * 1000 for v in values)


def runs_job(cap: CapabilityVector, job_id: bytes, fence: int) -> bool:
    return any(r.job_id == job_id and r.fence == fence for r in cap.running)


def cooldown_bounds(rule: Reflex, last_reflex: tuple | None, primary: bytes) -> tuple[int, int]:
    """(the least the evidence must span, the least its first taken_ms) for ``rule`` on
    ``primary``, after the job's last reflex move ``last_reflex`` = (node, taken_ms) or None.
    Each node's vectors carry its own clock, and nodes' clocks are not comparable: off the
    node the last reflex moved the job from, the cooldown counts on that node's clock;
    anywhere else the condition must hold for the cooldown too (the job ran there the whole
    evidence long, so it arrived after the last reflex move)."""
    if last_reflex is None:
        return rule.for_ms, 0
    node, at_ms = last_reflex
    if node == primary:
        return rule.for_ms, at_ms + rule.cooldown_ms
    return max(rule.for_ms, rule.cooldown_ms), 0


def shortest_evidence(rule: Reflex, history, job_id: bytes, fence: int, span_ms: int,
                      not_before_ms: int) -> tuple | None:
    """The fewest newest (envelope, vector) pairs of ``history`` (oldest first, one node's)
    that prove ``rule`` held for the job at ``fence`` for ``span_ms``, from ``not_before_ms``
    on; None while they do not (a gap in the seqs: a vector never seen might have broken it)."""
    return newest_chain(history, span_ms, not_before_ms,
                        lambda cap: condition_holds(rule, cap, job_id) and runs_job(cap, job_id, fence))


def holding_run(rule: Reflex, history, job_id: bytes, fence: int) -> list[int]:
    """The ``taken_ms`` of the newest unbroken run of ``history``'s vectors (consecutive seqs)
    that show ``rule``'s condition with the job running at ``fence``, oldest first: where
    the evidence a new vector would complete may start."""
    run = []
    for _envelope, cap in reversed(history):
        if run and cap.seq != run[-1][0] - 1:
            break
        if not (condition_holds(rule, cap, job_id) and runs_job(cap, job_id, fence)):
            break
        run.append((cap.seq, cap.taken_ms))
    return [taken for _seq, taken in reversed(run)]


def evidence_error(rule: Reflex, evidence: tuple, primary: bytes, job_id: bytes, fence: int, mesh_id: bytes,
                   last_reflex: tuple | None, caches=None) -> str | None:
    """Why ``evidence`` (envelopes) does not prove ``rule`` held on ``primary`` for the job
    at ``fence`` after its cooldown (None: it does); ``last_reflex`` as for cooldown_bounds."""
    vectors = []
    for data in evidence:
        try:
            envelope, cap = decode_message(data, mesh_id, expect=CapabilityVector, caches=caches)
        except RemoteProtocolError as exc:
            return "an evidence vector is not valid: %s" % exc
        if envelope.signer != primary or cap.node != primary:
            return "an evidence vector is not the primary's"
        vectors.append(cap)
    if not vectors:
        return "no evidence"
    for before, after in zip(vectors, vectors[1:]):
        if after.seq != before.seq + 1:
            return "the evidence vectors are not consecutive (seq %d then %d)" % (before.seq, after.seq)
    for cap in vectors:
        if not runs_job(cap, job_id, fence):
            return "vector seq %d does not show the job running at fence %d" % (cap.seq, fence)
        if not condition_holds(rule, cap, job_id):
            return "vector seq %d does not show the condition" % cap.seq
    span_ms, not_before_ms = cooldown_bounds(rule, last_reflex, primary)
    held = vectors[-1].taken_ms - vectors[0].taken_ms
    if held < span_ms:
        return "the condition is shown for %d ms, the rule asks %d ms%s" % (
            held, span_ms, "" if span_ms == rule.for_ms else " (its cooldown, on a new node)")
    if vectors[0].taken_ms < not_before_ms:
        return "the job is in its reflex cooldown until %d ms" % not_before_ms
    return None


class VectorHistory:
    """Each node's newest signed vectors, oldest first, as (envelope, vector): what a
    trigger's evidence is taken from."""

    def __init__(self) -> None:
        self.by_node: dict[bytes, deque] = {}

    def add(self, node: bytes, envelope: bytes, cap: CapabilityVector) -> None:
        self.by_node.setdefault(node, deque(maxlen=MAX_EVIDENCE)).append((envelope, cap))

    def of(self, node: bytes) -> tuple:
        return tuple(self.by_node.get(node, ()))

    def forget_except(self, members) -> None:
        for node in [n for n in self.by_node if n not in members]:
            del self.by_node[node]


# --- a replica rule over every replica's node (SPEC.md R4g) ---------------------------------------
def reads_replicas(rule: Reflex) -> bool:
    """R4g: whether the rule reads the mean over every replica's node. A rule that sizes the
    service does: a `clone`, and any `below` rule (the decay-away of excess replicas). An
    `above` rule's `reroute` or `decay` sheds load off the original, so it reads the
    original, the primary, as R3: were it to read the mean, the clone it follows (idle until
    requests are rerouted to it) would keep it from ever holding. A job signal is read only
    in the primary's vectors (R3a: a vector reports only the jobs it lists running)."""
    if rule.signal in JOB_REFLEX_SIGNALS:
        return False
    return rule.action == "clone" or rule.below is not None


def vector_level(rule: Reflex, cap: CapabilityVector, job_id: bytes) -> int | None:
    """One vector's reading for ``rule``, in milli-units: of an ``above`` rule its highest GPU
    value, of a ``below`` rule its lowest (R3's "some GPU" compares exactly these); None when
    the vector has none or is outside the rule's zone."""
    if rule.zone and cap.zone != rule.zone:
        return None
    values = signal_value(rule.signal, cap, job_id)
    if not values:
        return None
    return max(values) if rule.above is not None else min(values)


def chain_level(rule: Reflex, caps, job_id: bytes) -> int | None:
    """What a chain of one node's vectors shows held all along: the lowest reading of an
    ``above`` rule (the highest of a ``below`` one); None if some vector has no reading."""
    levels = [vector_level(rule, cap, job_id) for cap in caps]
    if not levels or None in levels:
        return None
    return min(levels) if rule.above is not None else max(levels)


def mean_holds(rule: Reflex, levels: list) -> bool:
    """R4g: the mean of the chains' levels is beyond the threshold (exact, in integers)."""
    if not levels:
        return False
    if rule.above is not None:
        return sum(levels) > rule.above * 1000 * len(levels)
    return sum(levels) < rule.below * 1000 * len(levels)


def newest_chain(history, span_ms: int, not_before_ms: int, fits) -> tuple | None:
    """The fewest newest (envelope, vector) pairs of ``history`` (one node's, oldest first),
    consecutive by seq, each passing ``fits``, taken from ``not_before_ms`` on and spanning
    at least ``span_ms``; None while there are none (the fewest show the highest level)."""
    chain = []
    for envelope, cap in reversed(history):
        if chain and cap.seq != chain[-1][1].seq - 1:
            return None
        if not fits(cap) or cap.taken_ms < not_before_ms:
            return None
        chain.append((envelope, cap))
        if chain[0][1].taken_ms - cap.taken_ms >= span_ms:
            return tuple(reversed(chain))
        if len(chain) >= MAX_EVIDENCE:
            return None
    return None


def split_chains(caps) -> list:
    """Evidence vectors grouped into chains: each run of one signer's vectors, in order."""
    chains = []
    for cap in caps:
        if chains and chains[-1][0] == cap.node:
            chains[-1][1].append(cap)
        else:
            chains.append((cap.node, [cap]))
    return chains
