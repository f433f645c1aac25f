"""The simulated network of the deterministic simulator (SPEC.md section 11, "Fault model").

A message from ``src`` to ``dst`` sent at virtual time ``t`` is either dropped or
delivered one or more times, each at ``t + delay``. Every choice is drawn from the
``random.Random`` the simulator passes in, in a fixed order, so one seed gives one
history. Node ids are dense ints ``0..n-1`` (the simulator maps them to public keys).

Faults end at ``heal_ms``: after it there is no loss, duplication, reordering spike or
partition, only the base delay distribution. That is the point where the liveness
phase starts and every job must be decided within a bound (SPEC.md 6.5 timeouts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

PER_MILLE = 1000
MAX_COPIES = 3  # a duplicated message arrives at most this many times


@dataclass(frozen=True)
class DelayModel:
    """Per-message one-way delay: ``base_ms + uniform(0, jitter_ms)``, with a rare spike.

    The spike (``spike_per_mille`` of messages get ``spike_ms`` more) models a slow
    link or a congested queue; it only applies while faults are active.
    """
    base_ms: int = 1
    jitter_ms: int = 4
    spike_per_mille: int = 0
    spike_ms: int = 0

    def draw(self, rng: random.Random, faulty: bool) -> int:
        delay = self.base_ms + (rng.randint(0, self.jitter_ms) if self.jitter_ms else 0)
        if faulty and self.spike_per_mille and rng.randrange(PER_MILLE) < self.spike_per_mille:
            delay += rng.randint(1, self.spike_ms)
        return max(1, delay)


@dataclass(frozen=True)
class Partition:
    """Between ``start_ms`` and ``end_ms`` no message crosses from a group in ``blocked``.

    ``groups[i]`` is node i's side. ``blocked`` holds directed (from_group, to_group)
    pairs: both directions for a symmetric split, one for an asymmetric one (A hears B,
    B does not hear A), which is the case that breaks naive failure detectors.
    """
    start_ms: int
    end_ms: int
    groups: tuple[int, ...]
    blocked: frozenset[tuple[int, int]]

    def cuts(self, src: int, dst: int, now_ms: int) -> bool:
        return (self.start_ms <= now_ms < self.end_ms
                and (self.groups[src], self.groups[dst]) in self.blocked)

    @property
    def symmetric(self) -> bool:
        return all((b, a) in self.blocked for a, b in self.blocked)


@dataclass
class NetworkStats:
    sent: int = 0
    delivered_scheduled: int = 0
    dropped_loss: int = 0
    dropped_partition: int = 0
    duplicated: int = 0
    reordered: int = 0


@dataclass
class SimNetwork:
    """Decides, for each message, when (if ever) it arrives. Holds no messages itself."""
    delay: DelayModel = field(default_factory=DelayModel)
    loss_per_mille: int = 0
    duplicate_per_mille: int = 0
    reorder_per_mille: int = 0
    reorder_ms: int = 0            # a reordered message is held back up to this long
    partitions: tuple[Partition, ...] = ()
    heal_ms: int = 0               # no fault at or after this time
    stats: NetworkStats = field(default_factory=NetworkStats)

    def faulty_at(self, now_ms: int) -> bool:
        return now_ms < self.heal_ms

    def cut(self, src: int, dst: int, now_ms: int) -> bool:
        for partition in self.partitions:
            if partition.cuts(src, dst, now_ms):
                return True
        return False

    def deliveries(self, src: int, dst: int, now_ms: int, rng: random.Random) -> list[int]:
        """Arrival times for one message; empty when it is lost or cut by a partition."""
        self.stats.sent += 1
        faulty = now_ms < self.heal_ms
        if faulty:
            if self.partitions and self.cut(src, dst, now_ms):
                self.stats.dropped_partition += 1
                return []
            if self.loss_per_mille and rng.randrange(PER_MILLE) < self.loss_per_mille:
                self.stats.dropped_loss += 1
                return []
        copies = 1
        if faulty and self.duplicate_per_mille:
            while copies < MAX_COPIES and rng.randrange(PER_MILLE) < self.duplicate_per_mille:
                copies += 1
            self.stats.duplicated += copies - 1
        arrivals = []
        for _ in range(copies):
            at = now_ms + self.delay.draw(rng, faulty)
            if faulty and self.reorder_per_mille and rng.randrange(PER_MILLE) < self.reorder_per_mille:
                # Held back so that later messages on the same link overtake it.
                at += rng.randint(1, max(1, self.reorder_ms))
                self.stats.reordered += 1
            arrivals.append(at)
        self.stats.delivered_scheduled += len(arrivals)
        return arrivals

    def clean_arrivals(self, count: int, now_ms: int, rng: random.Random) -> list[int]:
        """Arrival times of ``count`` messages sent at ``now_ms`` once every fault has healed.

        Exactly what ``count`` calls of ``deliveries`` would return then, drawing the same
        numbers from ``rng`` in the same order (``randint(0, j)`` is ``_randbelow(j + 1)``),
        without their per-message bookkeeping: one broadcast reaches ~n-1 peers.
        """
        if now_ms < self.heal_ms:
            raise ValueError("clean arrivals only once every fault has healed")
        self.stats.sent += count
        self.stats.delivered_scheduled += count
        base, jitter = self.delay.base_ms, self.delay.jitter_ms
        if not jitter:
            return [now_ms + max(1, base)] * count
        draw = rng._randbelow
        return [now_ms + max(1, base + draw(jitter + 1)) for _ in range(count)]


def random_partition(rng: random.Random, n: int, start_ms: int, end_ms: int, symmetric: bool) -> Partition:
    """Split ``0..n-1`` into two non-empty sides; cut both ways, or only side 0 -> side 1."""
    order = list(range(n))
    rng.shuffle(order)
    cut_at = rng.randint(1, n - 1)
    side_one = set(order[cut_at:])
    groups = tuple(1 if i in side_one else 0 for i in range(n))
    blocked = frozenset({(0, 1), (1, 0)}) if symmetric else frozenset({(0, 1)})
    return Partition(start_ms, end_ms, groups, blocked)
