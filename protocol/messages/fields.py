"""What every message module shares: the limits that cross message kinds, and ``record``.

Integers carry milli-units where a fraction is needed (``util_milli`` = percent x 1000),
never floats (SPEC.md 3). Nested signed messages travel as the exact envelope bytes
their signer produced (``ENVELOPE``), so anyone can re-verify them offline.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import codec
from protocol.schema import Bytes, Int, check_schema_matches_fields
from protocol.state_size import MAX_STATE_BYTES  # noqa: F401 (re-exported: one limit, one place)

MAX_NODES = 4096          # members of one mesh epoch
MAX_BIDS_PER_PROPOSAL = 32  # justification kept O(1) per voter (SPEC.md 6.3)
MAX_SLOT_JOBS = 128         # placements one slot decides (SPEC.md P7)
MAX_BIDS_PER_SLOT_JOB = 5   # a slot proposal carries the bids of each primary and its <= 4 backups
MAX_JUSTIFICATION = MAX_SLOT_JOBS * MAX_BIDS_PER_SLOT_JOB
STRATEGIES = ("latency", "throughput", "sovereign", "pack")
DECLINE_REASONS = ("owner_not_allowed", "entrypoint_not_allowed", "not_enough_gpus",
                   "not_enough_gpu_memory", "not_enough_cpu", "not_enough_memory",
                   "zone_not_allowed", "labels_missing", "attestation_missing",
                   "node_unhealthy", "fenced", "gpu_model_missing", "over_quota", "unknown_pool", "reserved")
VALUE_KINDS = ("placement", "eviction", "membership", "placement_slot", "job_move", "preemption", "gang_placement",
               "replica_action", "gang_replace", "gang_resize")
ENVELOPE = Bytes(1, codec.MAX_FRAME_BYTES)  # a nested signed envelope, as its wire bytes
MILLI_PERCENT = Int(0, 100_000)


def record(cls):
    """Class decorator: frozen dataclass + schema/field consistency check."""
    cls = dataclass(frozen=True)(cls)
    check_schema_matches_fields(cls)
    return cls
