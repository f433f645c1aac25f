"""Every message kind of the meshnode protocol (SPEC.md section 4).

Each class is a frozen record whose SCHEMA is the normative field list: names, types
and limits. ``KIND`` is the envelope kind string. Integers carry milli-units where a
fraction is needed (``util_milli`` = percent x 1000), never floats. Nested signed
messages (bids in a proposal, votes in a certificate) travel as the exact envelope
bytes their signer produced, so anyone can re-verify them offline.

The kinds live in one module per concern; this package exports them all, so callers
import from ``protocol.messages`` and never need to know which file holds a record:

- ``fields``: the limits shared across kinds, and the ``record`` decorator;
- ``jobs``: capability vectors, job manifests and job ids, bids, declines, placement
  values (one job, or a slot of them), cancels and job exits;
- ``votes``: proposals, prevotes, precommits, their certificates, round changes and
  syncs, equivocation evidence, ``value_hash``;
- ``liveness``: heartbeats, suspicions, evictions and their migrations, checkpoints,
  checkpoint acks, the epoch catch-up request;
- ``moves``: an owner's request to move a running job, and the move value (SPEC.md R2);
- ``membership``: members, membership changes, attestations, endorsements, joins, leaves;
- ``output``: reading a job's output from its primary (requests and answers);
- ``wire``: the kind registry, signing, decoding (envelope check + strict schema);
- ``slots``: checks of a placement slot's value (SPEC.md P7);
- ``preemption``: the value a preemption instance decides (SPEC.md P8);
- ``quota``: the quota grant a job's quota home signs (SPEC.md Q2b);
- ``replicas``: a job's ``[service]`` table and the replica action value (SPEC.md R4).
"""

from protocol.messages.fields import (DECLINE_REASONS, ENVELOPE, MAX_BIDS_PER_PROPOSAL, MAX_BIDS_PER_SLOT_JOB,
                                      MAX_JUSTIFICATION, MAX_NODES, MAX_SLOT_JOBS, MAX_STATE_BYTES, MILLI_PERCENT,
                                      STRATEGIES, VALUE_KINDS, record)
from protocol.messages.jobs import (GANG_TOPOLOGIES, MAX_GANG_WORKERS, Gang, GangPlacement, GangWorker,
                                    MAX_REFUSALS, MAX_RUNNING_LISTED, Bid, CapabilityVector, Cancel, Constraints,
                                    Decline, GpuState, JobExit, JobManifest, JobRefusal, Placement, PlacementSlot,
                                    REFLEX_ACTIONS, REFLEX_AMOUNTS, REFLEX_SIGNALS, Reflex,
                                    REPLICA_ACTIONS,
                                    Resources, RunningJob, Scheduling, attempt_failures, job_id, next_attempt, placement_attempt,
                                    placement_attempts, placement_binding_error, placement_instance_id,
                                    placement_slot, placement_slot_id, JOB_REFLEX_SIGNALS, JobSignals)
from protocol.messages.gangs import (MAX_GANG_RANK_INDEX, GangReplacement, GangResize, gang_replace_instance_id,
                                     gang_resize_instance_id)
from protocol.messages.liveness import (Checkpoint, CheckpointAck, Eviction, Heartbeat, Migration, Suspicion,
                                        SyncRequest)
from protocol.messages.moves import (MAX_EVIDENCE, MAX_REFLEXES, JobMove, MoveRequest, ReflexTrigger,
                                     RunStopped, move_instance_id)
from protocol.messages.membership import Attestation, Endorsement, Join, Leave, Member, MembershipChange
from protocol.messages.output import (MAX_OUTPUT_CHUNK_BYTES, MAX_OUTPUT_FILES, MAX_OUTPUT_PATH_BYTES,
                                      OUTPUT_TARGETS, OutputData, OutputFile, OutputRead)
from protocol.messages.preemption import (MAX_VICTIMS, Preemption, PreemptionVictim, preemption_binding_error,
                                          preemption_instance_id)
from protocol.messages.quota import QuotaGrant
from protocol.messages.replicas import (MAX_REPLICAS, REPLICA_WEIGHT, ReplicaAction, Service, replica_instance_id,
                                        replica_key)
from protocol.messages.slots import slot_binding_error, slot_placements
from protocol.messages.votes import (CommitCertificate, Evidence, Precommit, Prevote, PrevoteCertificate, Proposal,
                                     RoundChange, RoundSync, value_hash)
from protocol.messages.wire import (MESSAGE_TYPES, decode_heartbeat, decode_message, decode_value, encode_message,
                                   encode_unsigned, is_heartbeat_frame, sign_message)

__all__ = [
    # fields
    "DECLINE_REASONS", "ENVELOPE", "MAX_BIDS_PER_PROPOSAL", "MAX_BIDS_PER_SLOT_JOB", "MAX_JUSTIFICATION",
    "MAX_NODES", "MAX_SLOT_JOBS", "MAX_STATE_BYTES", "MILLI_PERCENT", "STRATEGIES", "VALUE_KINDS", "record",
    # jobs
    "GANG_TOPOLOGIES", "MAX_GANG_WORKERS", "Gang", "GangPlacement", "GangWorker",
    "MAX_REFUSALS", "MAX_RUNNING_LISTED", "Bid", "CapabilityVector", "Cancel", "Constraints", "Decline",
    "GpuState", "JobExit", "JobManifest", "JobRefusal", "Placement", "PlacementSlot", "REFLEX_ACTIONS", "REFLEX_AMOUNTS", "REFLEX_SIGNALS", "Reflex", "REPLICA_ACTIONS",
    "Resources", "RunningJob", "Scheduling",
    "attempt_failures", "job_id", "next_attempt", "placement_attempt", "placement_attempts", "JOB_REFLEX_SIGNALS", "JobSignals",
    "placement_binding_error", "placement_instance_id", "placement_slot", "placement_slot_id",
    # gangs
    "MAX_GANG_RANK_INDEX", "GangReplacement", "GangResize", "gang_replace_instance_id", "gang_resize_instance_id",
    # liveness
    "Checkpoint", "CheckpointAck", "Eviction", "Heartbeat", "Migration", "Suspicion", "SyncRequest",
    # moves
    "MAX_EVIDENCE", "MAX_REFLEXES", "JobMove", "MoveRequest", "ReflexTrigger", "RunStopped", "move_instance_id",
    # replicas
    "MAX_REPLICAS", "REPLICA_WEIGHT", "ReplicaAction", "Service", "replica_instance_id", "replica_key",
    # membership
    "Attestation", "Endorsement", "Join", "Leave", "Member", "MembershipChange",
    # output
    "MAX_OUTPUT_CHUNK_BYTES", "MAX_OUTPUT_FILES", "MAX_OUTPUT_PATH_BYTES", "OUTPUT_TARGETS", "OutputData",
    "OutputFile", "OutputRead",
    # preemption
    "MAX_VICTIMS", "Preemption", "PreemptionVictim", "preemption_binding_error", "preemption_instance_id",
    # quota
    "QuotaGrant",
    # slots
    "slot_binding_error", "slot_placements",
    # votes
    "CommitCertificate", "Evidence", "Precommit", "Prevote", "PrevoteCertificate", "Proposal", "RoundChange",
    "RoundSync", "value_hash",
    # wire
    "MESSAGE_TYPES", "decode_heartbeat", "decode_message", "decode_value", "encode_message", "encode_unsigned",
    "is_heartbeat_frame", "sign_message",
]
