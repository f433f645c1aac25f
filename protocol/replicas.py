"""Replicas of a job and the endpoint table (SPEC.md R4). Pure: no clock, no IO.

A job runs as its primary (replica 0: the placement, moves and evictions of P5, R2, F5
move it) and up to ``max_replicas - 1`` further replicas, each a run of the same manifest
on another node, started and retired only by decided replica actions (flows/replica.py).
Every member holds the same replicas, from the same certificates, so every member derives
the same endpoint table: replica -> node, its address, the service port, and its weight
(the share of requests a client sends it, relative to the others').

The rules here are the arithmetic every validator and every applier shares:
- ``clone`` adds replicas of weight REPLICA_WEIGHT (never beyond max_replicas);
- ``reroute P%`` moves P% of every other replica's weight to the newest replica;
- ``decay P%`` lowers one replica's weight by P% (of an ``above`` rule: the oldest, the
  original; of a ``below`` rule: the newest, the excess); a replica decayed to weight 0
  is retired, which is refused for the primary and below min_replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import REPLICA_WEIGHT


@dataclass
class Replica:
    node: bytes
    fence: int    # the number of the action that started it + 1: its run's identity (WorkloadRun.fence)
    weight: int
    # The seq of the node's vector the action that put it there carried: a rule reads only the
    # node's later vectors for it (R4g), taken while the node held the replica.
    since_seq: int = 0


def replica_count(record) -> int:
    """Replicas the job runs, its primary included."""
    return 1 + len(record.replicas)


def weights(record) -> dict[int, int]:
    """Replica index -> endpoint weight, the primary (0) first."""
    return {0: record.primary_weight, **{i: r.weight for i, r in sorted(record.replicas.items())}}


def newest(record) -> int:
    return max(record.replicas, default=0)


def decay_target(record, rule) -> int:
    """R4d: an ``above`` rule decays the original (replica 0) to make room for its clones,
    a ``below`` rule the newest replica (the excess that pressure no longer needs)."""
    return 0 if rule.above is not None else newest(record)


def decayed(weight: int, percent: int) -> int:
    return weight - weight * percent // 100


def clones_wanted(record, rule) -> int:
    """How many replicas a clone (``rule``) or a fill (``rule`` None) adds: a clone its amount
    up to max_replicas, a fill up to min_replicas."""
    service = record.manifest.service
    if rule is None:
        return max(0, service.min_replicas - replica_count(record))
    return max(0, min(rule.amount, service.max_replicas - replica_count(record)))


def action_error(record, rule) -> str | None:
    """R4c's bounds: why ``rule``'s action cannot apply to the job now (None: it can).
    ``rule`` None is a fill."""
    service = record.manifest.service
    if rule is None:
        return None if clones_wanted(record, None) else "the job runs its min_replicas already"
    if rule.action == "clone":
        if replica_count(record) >= service.max_replicas:
            return "the job runs its max_replicas (%d) already" % service.max_replicas
        return None
    if rule.action == "reroute":
        return None if record.replicas else "the job has no replica to reroute to"
    if rule.action == "decay":
        target = decay_target(record, rule)
        if decayed(weights(record)[target], rule.amount) > 0:
            return None
        if target == 0:
            return "decaying the primary to weight 0 would retire it"
        if replica_count(record) - 1 < service.min_replicas:
            return "retiring replica %d would leave fewer than min_replicas (%d)" % (target, service.min_replicas)
        return None
    return "action %r is not a replica action" % rule.action


def weight_changes(record, rule) -> list[tuple[int, int]]:
    """R4d: (replica index, the weight it ends with) for a reroute or decay, by index; a
    decayed replica that ends at 0 is retired."""
    now = weights(record)
    if rule.action == "reroute":
        to = newest(record)
        given = {i: w * rule.amount // 100 for i, w in now.items() if i != to}
        changes = {i: now[i] - give for i, give in given.items() if give}
        changes[to] = now[to] + sum(given.values())
        return sorted(changes.items())
    target = decay_target(record, rule)
    return [(target, decayed(now[target], rule.amount))]


def set_weights(record, changes) -> list[int]:
    """Apply decided (index, weight) pairs; the indices retired (weight 0). A replica no
    longer held (dropped with its evicted node) is passed over."""
    retired = []
    for index, weight in changes:
        if index == 0:
            record.primary_weight = weight
        elif index in record.replicas:
            if weight == 0:
                del record.replicas[index]
                retired.append(index)
            else:
                record.replicas[index].weight = weight
    return retired


def add_replica(record, node: bytes, fence: int, since_seq: int) -> int:
    index = record.next_replica
    record.next_replica += 1
    record.replicas[index] = Replica(node=node, fence=fence, weight=REPLICA_WEIGHT, since_seq=since_seq)
    return index


def holders(record) -> set:
    """The nodes that run the job now (its primary and replicas): a clone goes elsewhere."""
    return {record.primary, *(r.node for r in record.replicas.values())}


def endpoint_table(record, address_of) -> list[dict]:
    """R4e: one row per replica: index, node, the node's address (``address_of(node)``, the
    host of its first member address), the job's service port and the replica's weight."""
    port = record.manifest.service.port
    rows = [{"replica": 0, "node": record.primary, "fence": record.fence, "weight": record.primary_weight}]
    rows += [{"replica": i, "node": r.node, "fence": r.fence, "weight": r.weight}
             for i, r in sorted(record.replicas.items())]
    for row in rows:
        row.update(address=address_of(row["node"]) if row["node"] is not None else "", port=port)
    return rows
