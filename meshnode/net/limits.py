"""Limits against hostile peers (SPEC.md 8 "Limits against hostile peers"), sans-IO.

No sockets, no trio, no clock reads: every method takes ``now_s`` (seconds, any
monotonic origin), so the rules are tested with plain numbers
(tests/test_net_limits.py). ``libp2p_transport`` applies them at its points of entry:

- ``InboundGate``: before the Noise handshake (by remote address) and after it (by
  peer key). Members always pass the key checks; non-members are rate limited and
  capped, and an idle non-member makes room for a new one.
- ``MemoryBudget``: the bytes a peer can make us hold before we act on them (partial
  frames in our decoder, unread yamux stream buffers). Members are bounded per peer;
  non-members per peer and, together, by one shared pool, so they can never take the
  memory members need.
- ``RefusalReport``: refused and dropped traffic, summarised at most once per interval
  for the node's event stream and log.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerLimits:
    """Every knob in one place; the defaults are SPEC.md 8's table."""

    handshakes_max: int = 32
    """Inbound connections in the security handshake at once, all addresses."""
    handshakes_per_address_max: int = 8
    handshake_rate_per_address_per_s: float = 20.0
    handshake_burst_per_address: int = 40
    handshake_rate_per_s: float = 50.0
    """All addresses together: what the handshakes' cryptography may cost the node."""
    handshake_burst: int = 100
    addresses_tracked_max: int = 4096
    handshake_timeout_ms: int = 3000
    """The handshake's time with at most ``handshakes_per_timeout`` in progress; more at
    once share the CPU, so each gets this much per that many (``handshake_timeout_s``)."""
    handshakes_per_timeout: int = 4
    handshake_timeout_max_ms: int = 10_000
    nonmember_connections_max: int = 32
    nonmember_connect_rate_per_peer_per_s: float = 1.0
    nonmember_connect_burst_per_peer: int = 5
    nonmember_idle_evict_ms: int = 5000
    """A non-member silent this long gives its slot to a new non-member when all are taken."""
    nonmember_frame_rate_per_s: float = 20.0
    nonmember_frame_burst: int = 50
    nonmember_incoming_share_divisor: int = 8
    """Non-member frames are queued only while the incoming queue is under 1/divisor full."""
    streams_per_member_connection_max: int = 64
    streams_per_nonmember_connection_max: int = 8
    member_held_bytes_max: int = 4 << 20
    nonmember_held_bytes_max: int = (1 << 20) + 64 * 1024
    nonmember_held_bytes_total_max: int = 8 << 20
    frame_read_timeout_ms: int = 5000
    """A frame whose first byte has arrived must be complete within this time."""
    report_interval_ms: int = 10_000


class TokenBucket:
    """``burst`` tokens, refilled at ``rate_per_s``; one token per admitted event."""

    def __init__(self, rate_per_s: float, burst: int, now_s: float):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._at_s = now_s

    def tokens(self, now_s: float) -> float:
        elapsed = max(0.0, now_s - self._at_s)
        return min(float(self.burst), self._tokens + elapsed * self.rate_per_s)

    def take(self, now_s: float) -> bool:
        self._tokens, self._at_s = self.tokens(now_s), max(self._at_s, now_s)
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def is_full(self, now_s: float) -> bool:
        return self.tokens(now_s) >= self.burst


class KeyedRateLimiter:
    """One TokenBucket per key, at most ``keys_max`` of them.

    When the table is full, buckets that have refilled (their key was idle long
    enough to be forgotten without loss) go first, then the least recently used:
    an attacker cycling through keys can only reset other keys' limits, never grow
    the table.
    """

    def __init__(self, rate_per_s: float, burst: int, keys_max: int):
        self._rate_per_s, self._burst, self._keys_max = rate_per_s, burst, keys_max
        self._buckets: collections.OrderedDict[object, TokenBucket] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: object, now_s: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            self._make_room(now_s)
            bucket = self._buckets[key] = TokenBucket(self._rate_per_s, self._burst, now_s)
        self._buckets.move_to_end(key)
        return bucket.take(now_s)

    def _make_room(self, now_s: float) -> None:
        if len(self._buckets) < self._keys_max:
            return
        for key in [k for k, b in self._buckets.items() if b.is_full(now_s)]:
            del self._buckets[key]
        while len(self._buckets) >= self._keys_max:
            self._buckets.popitem(last=False)


class InboundGate:
    """Who may open an inbound connection; the reasons are counter names."""

    def __init__(self, limits: PeerLimits):
        self.limits = limits
        self._handshakes: collections.Counter[str] = collections.Counter()
        self._handshake_rate = KeyedRateLimiter(limits.handshake_rate_per_address_per_s,
                                                limits.handshake_burst_per_address, limits.addresses_tracked_max)
        self._all_handshakes_rate: TokenBucket | None = None
        self._connect_rate = KeyedRateLimiter(limits.nonmember_connect_rate_per_peer_per_s,
                                              limits.nonmember_connect_burst_per_peer, limits.addresses_tracked_max)

    @property
    def handshakes_in_progress(self) -> int:
        return sum(self._handshakes.values())

    def begin_handshake(self, address: str, now_s: float) -> str | None:
        """None and a handshake slot taken (give it back with ``end_handshake``), or the
        reason the connection is refused before any cryptography is done."""
        if self.handshakes_in_progress >= self.limits.handshakes_max:
            return "refused_handshakes_busy"
        if self._handshakes[address] >= self.limits.handshakes_per_address_max:
            return "refused_address_handshakes"
        if not self._handshake_rate.allow(address, now_s):
            return "refused_address_rate"
        if self._all_handshakes_rate is None:
            self._all_handshakes_rate = TokenBucket(self.limits.handshake_rate_per_s, self.limits.handshake_burst, now_s)
        if not self._all_handshakes_rate.take(now_s):
            return "refused_handshake_rate"
        self._handshakes[address] += 1
        return None

    def handshake_timeout_s(self) -> float:
        """The time a handshake beginning now may take: ``handshake_timeout_ms`` for each
        ``handshakes_per_timeout`` in progress (itself included), at most
        ``handshake_timeout_max_ms``. A fixed 3 s failed 1,202 members' handshakes in a
        32-node start on 2 loaded cores (pure-Python Noise, up to 31 at once per node),
        each one redialled and its work thrown away."""
        share = -(-max(1, self.handshakes_in_progress) // self.limits.handshakes_per_timeout)
        return min(share * self.limits.handshake_timeout_ms, self.limits.handshake_timeout_max_ms) / 1000

    def end_handshake(self, address: str) -> None:
        self._handshakes[address] -= 1
        if self._handshakes[address] <= 0:
            del self._handshakes[address]

    def admit_peer(self, peer_key: bytes, is_member: bool, nonmember_last_active_s: Mapping[bytes, float],
                   now_s: float) -> tuple[str | None, bytes | None]:
        """After the handshake: ``(reason refused or None, non-member to disconnect to
        make room or None)``. ``nonmember_last_active_s`` holds the connected
        non-members (other than ``peer_key``) and when each last sent a frame."""
        if is_member:
            return None, None
        if not self._connect_rate.allow(peer_key, now_s):
            return "refused_peer_rate", None
        if len(nonmember_last_active_s) < self.limits.nonmember_connections_max:
            return None, None
        idlest = min(nonmember_last_active_s, key=lambda key: (nonmember_last_active_s[key], key))
        if now_s - nonmember_last_active_s[idlest] >= self.limits.nonmember_idle_evict_ms / 1000:
            return None, idlest
        return "refused_nonmembers_full", None


class MemoryBudget:
    """Bytes held on behalf of peers, by holder (a stream's decoder, a yamux buffer).

    ``hold`` sets what one holder keeps now; it refuses (and changes nothing) if the
    peer would go over its own limit or, for a non-member, the non-members together
    over their shared pool. A refused holder must drop what it holds and call
    ``release``; so must every holder when it ends.
    """

    def __init__(self, limits: PeerLimits):
        self.limits = limits
        self._held: dict[object, tuple[bytes, bool, int]] = {}  # holder -> (peer, member, bytes)
        self._by_peer: collections.Counter[bytes] = collections.Counter()
        self.nonmember_bytes = 0
        self.member_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self.nonmember_bytes + self.member_bytes

    def held_by(self, peer_key: bytes) -> int:
        return self._by_peer[peer_key]

    def hold(self, holder: object, peer_key: bytes, is_member: bool, size: int) -> bool:
        _, was_member, before = self._held.get(holder, (peer_key, is_member, 0))
        peer_after = self._by_peer[peer_key] - before + size
        if is_member:
            if peer_after > self.limits.member_held_bytes_max:
                return False
        else:
            pool_after = self.nonmember_bytes - (before if not was_member else 0) + size
            if peer_after > self.limits.nonmember_held_bytes_max or pool_after > self.limits.nonmember_held_bytes_total_max:
                return False
        self.release(holder)
        if size:
            self._held[holder] = (peer_key, is_member, size)
            self._by_peer[peer_key] += size
            if is_member:
                self.member_bytes += size
            else:
                self.nonmember_bytes += size
        return True

    def release(self, holder: object) -> None:
        entry = self._held.pop(holder, None)
        if entry is None:
            return
        peer_key, is_member, size = entry
        self._by_peer[peer_key] -= size
        if self._by_peer[peer_key] <= 0:
            del self._by_peer[peer_key]
        if is_member:
            self.member_bytes -= size
        else:
            self.nonmember_bytes -= size


# Counters (transport's and core's) that mean traffic from a peer was refused or
# dropped as invalid; what a node under attack sees grow.
REFUSAL_COUNTERS = (
    "refused_handshakes_busy", "refused_address_handshakes", "refused_address_rate", "refused_handshake_rate",
    "handshake_failed",
    "refused_peer_rate", "refused_nonmembers_full", "evicted_idle_nonmember", "peer_rejected",
    "dropped_oversize", "bad_frame", "dropped_frame_timeout", "dropped_memory_budget",
    "dropped_stream_limit", "dropped_window_exceeded", "dropped_nonmember_rate", "dropped_nonmember_share",
    "undecodable", "unexpected_kind", "capability_not_member", "future_certificate_from_non_member",
    "eviction_of_non_member", "join_not_self_signed",
)


class RefusalReport:
    """At most one summary per ``interval_ms``: the refusal counters that grew since the
    last summary, by reason. Counters are read whole each time (they only grow)."""

    def __init__(self, interval_ms: int, reasons: tuple[str, ...] = REFUSAL_COUNTERS):
        self.interval_ms = interval_ms
        self._reasons = reasons
        self._reported: dict[str, int] = {}
        self._last_ms: int | None = None

    def poll(self, counters: Mapping[str, int], now_ms: int) -> dict[str, int] | None:
        if self._last_ms is not None and now_ms - self._last_ms < self.interval_ms:
            return None
        grown = {reason: counters.get(reason, 0) - self._reported.get(reason, 0) for reason in self._reasons}
        grown = {reason: count for reason, count in grown.items() if count > 0}
        if not grown:
            return None
        self._reported.update({reason: counters.get(reason, 0) for reason in self._reasons})
        self._last_ms = now_ms
        return grown
