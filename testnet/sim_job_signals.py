"""Reflex rules on a job's own reported load in the simulator (``meshnode sim --reflex F``,
SPEC.md R3a).

Of the jobs ``add_reflexes`` gave the GPU rule (testnet/sim_reflex.py), every other one
gets instead the same rule on its reported p99 request latency. The jobs a node runs
report their load with each of its telemetry readings (as a node carries its workloads'
SDK reports, 9.4a): slow inside the node's hot spells, fast outside, so latency rules hold
and break off exactly as the GPU rules do. ``JobSignalMoves`` counts the reflex moves
decided on such a rule. No draw of its own beyond the reports' jitter.
"""

from __future__ import annotations

from dataclasses import replace

from protocol.flows.move import decode_request
from protocol.messages import JobSignals, ReflexTrigger, encode_message, job_id
from testnet.sim_reflex import SIM_RULE

SIM_LATENCY_RULE = replace(SIM_RULE, signal="request_latency_ms", above=50)
SLOW_LATENCY_US = 80_000   # a hot spell's reported p99: 80..85 ms, jittered so each reading is a new vector
FAST_LATENCY_US = 10_000


def use_latency_rules(world) -> set[bytes]:
    """Every other job with SIM_RULE gets SIM_LATENCY_RULE instead, signed again by its
    owner; the ids of those jobs."""
    owners = {o.public_key: o for o in world.owners}
    changed = set()
    for number, spec in enumerate(s for s in world.jobs if s.job.reflexes == (SIM_RULE,)):
        if number % 2:
            spec.job = replace(spec.job, reflexes=(SIM_LATENCY_RULE,))
            spec.envelope = encode_message(owners[spec.job.owner], world.mesh_id, spec.job)
            spec.job_id = job_id(spec.job)
            changed.add(spec.job_id)
    return changed


def job_signals(running_jobs, hot: bool, rng) -> tuple:
    """What the jobs a node runs report (SPEC.md 9.4a): slow inside its hot spells."""
    base = SLOW_LATENCY_US if hot else FAST_LATENCY_US
    return tuple(JobSignals(job_id=jid, request_rate_milli=100_000, latency_p99_us=base + rng.randint(0, 5000),
                            progress_rate_milli=1000) for jid in sorted(running_jobs))


class JobSignalMoves:
    """The reflex moves decided for jobs whose rule is on a job signal (by instance)."""

    def __init__(self, mesh_id: bytes, jobs: set[bytes]) -> None:
        self.mesh_id = mesh_id
        self.jobs = jobs
        self.moves: set[bytes] = set()

    def note(self, decision) -> None:
        if decision.value_kind != "job_move" or not self.jobs:
            return
        _envelope, request = decode_request(decision.value.request, self.mesh_id)
        if isinstance(request, ReflexTrigger) and request.job_id in self.jobs:
            self.moves.add(decision.instance)
