"""Replicas of a job (SPEC.md R4): the manifest's ``[service]`` table (a service port and
the replica bounds) and the value a replica action instance decides (clone, reroute,
decay), with the id of that instance."""

from __future__ import annotations

import hashlib
from typing import ClassVar

from protocol.messages.fields import ENVELOPE, record
from protocol.schema import Bytes, Int, Key, List, Record

MAX_REPLICAS = 8                      # replicas of one job, the primary (replica 0) included
REPLICA_ACTION_TAG = b"replica-action"
REPLICA_WEIGHT = 1000                 # a new replica's endpoint weight (R4d)
MAX_WEIGHT = REPLICA_WEIGHT * MAX_REPLICAS   # a reroute gathers at most every replica's weight on one
MAX_REPLICA_INDEX = 65535             # replica indices only grow (a retired one is never reused)


@record
class Service(Record):
    """What a job serves and on how many nodes (SPEC.md 4.2, R4): ``port`` on every replica's
    node (0 = none: no endpoint table), and the replica bounds reflexes keep it within.
    The default (no port, exactly one replica) is left out of the manifest's body."""
    port: int = 0
    min_replicas: int = 1
    max_replicas: int = 1
    SCHEMA: ClassVar = {"port": Int(0, 65535), "min_replicas": Int(1, MAX_REPLICAS),
                        "max_replicas": Int(1, MAX_REPLICAS)}

    def __post_init__(self):
        super().__post_init__()
        if self.min_replicas > self.max_replicas:
            raise ValueError("Service: min_replicas %d is above max_replicas %d"
                             % (self.min_replicas, self.max_replicas))


@record
class ReplicaAction(Record):
    """The value a replica action instance decides (R4c): the job's action number ``seq``
    (one action per number: a second value at the same number is stale), ``anchor`` (the
    seq of the primary's vector it was noticed at: it names the instance), ``trigger`` (a
    ReflexTrigger envelope whose rule's action is clone, reroute or decay; empty: a fill,
    the job runs fewer replicas than its min_replicas), for a clone or a fill the new
    replicas' ``nodes`` with the signed vector of each (``capabilities``) that shows room,
    and for a reroute or decay the weight each changed replica (``replicas``, by index)
    ends with (``weights``; 0 retires it): absolute, so the result does not depend on
    whether a member dropped a replica of an evicted node before or after (R4d)."""
    KIND: ClassVar = "replica_action"
    job_id: bytes
    seq: int
    anchor: int
    trigger: bytes
    nodes: tuple
    capabilities: tuple
    replicas: tuple
    weights: tuple
    SCHEMA: ClassVar = {"job_id": Key(), "seq": Int(), "anchor": Int(), "trigger": Bytes(0, ENVELOPE.max_len),
                        "nodes": List(Key(), MAX_REPLICAS), "capabilities": List(ENVELOPE, MAX_REPLICAS),
                        "replicas": List(Int(0, MAX_REPLICA_INDEX), MAX_REPLICAS),
                        "weights": List(Int(0, MAX_WEIGHT), MAX_REPLICAS)}

    def __post_init__(self):
        super().__post_init__()
        if len(self.nodes) != len(self.capabilities):
            raise ValueError("ReplicaAction: %d nodes but %d capability vectors"
                             % (len(self.nodes), len(self.capabilities)))
        if len(self.replicas) != len(self.weights):
            raise ValueError("ReplicaAction: %d replicas but %d weights" % (len(self.replicas), len(self.weights)))


def replica_instance_id(job_id: bytes, seq: int, anchor: int) -> bytes:
    """R4c: the instance deciding the job's action ``seq``, noticed at the primary's vector ``anchor``."""
    return hashlib.sha256(REPLICA_ACTION_TAG + job_id + seq.to_bytes(8, "big") + anchor.to_bytes(8, "big")).digest()


def replica_key(job_id: bytes, index: int) -> bytes:
    """The ledger and workload key of the job's replica ``index`` >= 1 (replica 0, the
    primary, is keyed by the job id as ever)."""
    return hashlib.sha256(b"replica" + job_id + index.to_bytes(2, "big")).digest()
