"""Adaptive heartbeat failure detector (SPEC.md section 9.1). Pure: time is passed in.

The math (phi-accrual, Hayashibara et al. 2004, with the normal approximation):
for each peer we keep the last ``WINDOW`` inter-arrival times of its heartbeats and
their mean ``mu`` and standard deviation ``sigma``. After ``t`` ms of silence,

    phi(t) = -log10(1 - F(t)),   F = CDF of Normal(mu, sigma)

and a peer is suspected when ``phi(t) >= PHI_THRESHOLD``. Because phi is monotone in
``t`` this is the same as a silence threshold

    T = mu + z * sigma,          z = Phi^-1(1 - 10^-PHI_THRESHOLD)

(PHI_THRESHOLD = 8 gives z ~= 5.61, stored as Z_MILLI = 5612). Evaluating ``T`` once per
heartbeat keeps ``suspects`` a plain comparison per peer (O(n) per tick, no logs or
floats). Two clamps make the detector safe whatever the samples say:

    T_eff = min(suspect_by_ms, max(min_silence_ms, T)),  suspect_by_ms = detection_bound_ms - heartbeat_ms

* ``min_silence_ms``: a peer silent for less is never suspected, so a hiccup (GC pause,
  CPU burst) shorter than it cannot start an eviction, even on a jitter-free network
  where ``sigma`` is tiny.
* ``suspect_by_ms``: a peer silent this long is always suspected, so a crash is detected
  within the bound even after a very jittery history inflated ``sigma``. It is one
  heartbeat period short of the bound because the bound is a promise about time since
  the CRASH, and the measured silence is only part of it: the suspecting node's tick
  (5 ms), the suspicion's delivery and a loaded machine's scheduling delay come on top
  (with the clamp at the bound itself, kill -> suspicion measured up to 305 ms).

``sigma`` is floored at ``heartbeat_ms / 4`` so a few identical samples cannot make the
threshold collapse onto the mean. Until ``MIN_SAMPLES`` intervals are known, T is
``suspect_by_ms`` (be slow rather than wrong about a peer we know nothing about).

Local health (SPEC F2a, after Lifeguard, Dadgar et al. 2018): a node that measures its own
lateness (a tick gap of two heartbeat periods or more: the driver ticks at least once a
period) cannot tell a silent peer from its own stall, so (1) a peer's silence does not
count the node's own lateness since the peer was last heard, and (2) a health score
(0..HEALTH_MAX, up by the periods a tick was late or a heartbeat waited in queues, and by
one per suspicion of this node,
down by one per HEALTH_DECAY_PERIODS punctual periods) adds ``score * heartbeat_ms`` to
every threshold, less a quarter of it per other member's fresh suspicion of that peer
(independent confirmations shrink it back). A node that runs on time keeps score 0 and the
bound above.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from math import isqrt

WINDOW = 64          # inter-arrival samples kept per peer
MIN_SAMPLES = 4
Z_MILLI = 5612       # z for phi = 8, x 1000 (see module docstring)
HEALTH_MAX = 16             # local health score cap: at most 16 periods added to a threshold (F2a)
HEALTH_DECAY_PERIODS = 4    # the score drops by one per this many periods without a late tick
HEALTH_CONFIRMATIONS = 4    # other members' fresh suspicions of a peer that cancel the score's extra


@dataclass
class _PeerHistory:
    last_ms: int
    intervals: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    total: int = 0
    total_sq: int = 0
    threshold_ms: int = 0
    late_at_ms: int = 0   # the node's own lateness total when this peer was last heard (F2a)


class FailureDetector:
    def __init__(self, *, heartbeat_ms: int = 50, detection_bound_ms: int = 300,
                 min_silence_ms: int | None = None):
        suspect_by_ms = max(1, detection_bound_ms - heartbeat_ms)
        if min_silence_ms is None:
            # Default: suspect_by_ms. The design's two bars (a crash detected within the
            # bound; no eviction for a pause shorter than it) leave no room between them, so
            # adaptivity only acts when an operator lowers min_silence_ms (faster detection
            # on a calm network, at the price of evicting long pauses). A pause P is never
            # suspected while P + heartbeat_ms + delivery jitter < min_silence_ms.
            min_silence_ms = suspect_by_ms
        if not 0 < min_silence_ms <= suspect_by_ms:
            raise ValueError("need 0 < min_silence_ms <= detection_bound_ms - heartbeat_ms")
        self.heartbeat_ms = heartbeat_ms
        self.detection_bound_ms = detection_bound_ms
        self.suspect_by_ms = suspect_by_ms
        self.min_silence_ms = min_silence_ms
        self._peers: dict[bytes, _PeerHistory] = {}
        # F2a: this node's own health, measured from its tick gaps.
        self.own_late_ms = 0          # total lateness of its ticks so far
        self.health = 0               # 0 (on time) .. HEALTH_MAX
        self.health_changed_ms = 0
        self._confirmations: dict[bytes, int] = {}   # peer -> other members' fresh suspicions of it
        self._delay_floor: dict[bytes, tuple] = {}   # peer -> (least now - sent_ms seen, its latest seq)

    # --- local health (SPEC F2a) -----------------------------------------------------------------
    def note_tick(self, gap_ms: int, now_ms: int) -> int:
        """A tick ``gap_ms`` after the previous one. Returns the lateness counted (0: on time).
        The driver ticks at least once a heartbeat period (F3a), so a gap of two periods or
        more is time this node was due and did not run: its peers' silences in that time may
        be its own, and its view of them is to be trusted less for a while."""
        if gap_ms < 2 * self.heartbeat_ms:
            decay_ms = HEALTH_DECAY_PERIODS * self.heartbeat_ms
            if self.health == 0:
                self.health_changed_ms = now_ms
            while self.health > 0 and now_ms - self.health_changed_ms >= decay_ms:
                self.health -= 1
                self.health_changed_ms += decay_ms
            return 0
        late_ms = gap_ms - self.heartbeat_ms
        self.own_late_ms += late_ms
        self._raise_health(late_ms // self.heartbeat_ms, now_ms)
        return late_ms

    def note_read_delay(self, peer: bytes, sent_ms: int, seq: int, now_ms: int) -> int:
        """A heartbeat of ``peer`` read at ``now_ms``, stamped ``sent_ms`` by the peer's clock.
        ``now_ms - sent_ms`` is the clocks' offset plus the frame's delay; its least value
        seen since the peer's heartbeats began (its ``seq`` restarting means a new clock) is
        taken as offset plus an unloaded delay, so the excess is how long the heartbeat waited
        in queues (ours, the peer's, the network's) beyond that. Returns the lateness counted
        (an excess of two periods or more, less one period, as for a tick)."""
        delay = now_ms - sent_ms
        floor, last_seq = self._delay_floor.get(peer, (delay, seq))
        if seq <= last_seq and peer in self._delay_floor:
            floor = delay   # restarted (or reordered): start again from this one
        floor = min(floor, delay)
        self._delay_floor[peer] = (floor, seq)
        excess = delay - floor
        if excess < 2 * self.heartbeat_ms:
            return 0
        late_ms = excess - self.heartbeat_ms
        self._raise_health(late_ms // self.heartbeat_ms, now_ms)
        return late_ms

    def note_suspected(self, now_ms: int) -> None:
        """A member suspected this node: it was late to someone (Lifeguard's refute)."""
        self._raise_health(1, now_ms)

    def _raise_health(self, points: int, now_ms: int) -> None:
        self.health = min(HEALTH_MAX, self.health + points)
        self.health_changed_ms = now_ms

    def set_confirmations(self, peer: bytes, count: int) -> None:
        """How many other members' fresh suspicions of ``peer`` this node holds (F2a)."""
        if count:
            self._confirmations[peer] = count
        else:
            self._confirmations.pop(peer, None)

    def clear_confirmations(self) -> None:
        self._confirmations.clear()

    def health_extra_ms(self, peer: bytes) -> int:
        """What the health score adds to ``peer``'s threshold: score periods, less a quarter
        per confirmation."""
        unconfirmed = max(0, HEALTH_CONFIRMATIONS - self._confirmations.get(peer, 0))
        return self.health * self.heartbeat_ms * unconfirmed // HEALTH_CONFIRMATIONS

    def _silence(self, peer: bytes, history: _PeerHistory, now_ms: int) -> int:
        """Silence less this node's own lateness since the peer was last heard (F2a)."""
        return now_ms - history.last_ms - (self.own_late_ms - history.late_at_ms)

    def _flag_after_ms(self, peer: bytes, history: _PeerHistory) -> int:
        return history.threshold_ms + self.health_extra_ms(peer)

    def track(self, peer: bytes, now_ms: int, last_heard_ms: int | None = None,
              threshold_ms: int | None = None) -> None:
        """Start watching ``peer`` as if it had just been heard (it joined, or we started), or,
        with ``last_heard_ms``, as if it had been heard then (a member another one suspects);
        ``threshold_ms``: its silence threshold until its next heartbeat (default suspect_by)."""
        if peer not in self._peers:
            heard = now_ms if last_heard_ms is None else min(now_ms, last_heard_ms)
            self._peers[peer] = _PeerHistory(last_ms=heard, threshold_ms=threshold_ms or self.suspect_by_ms,
                                             late_at_ms=self.own_late_ms)

    def heard_no_earlier_than(self, peer: bytes, heard_ms: int, threshold_ms: int | None = None) -> None:
        """Count ``peer`` as last heard at ``heard_ms`` if that is later than when it was (a
        suspicion re-arms a watch, F4a); its interval history is kept (``threshold_ms``: as
        for ``track``, until its next heartbeat)."""
        history = self._peers.get(peer)
        if history is not None:
            if heard_ms > history.last_ms:
                history.last_ms, history.late_at_ms = heard_ms, self.own_late_ms
            if threshold_ms is not None:
                history.threshold_ms = threshold_ms

    def forget(self, peer: bytes) -> None:
        self._peers.pop(peer, None)
        self._confirmations.pop(peer, None)
        self._delay_floor.pop(peer, None)

    def is_watched(self, peer: bytes) -> bool:
        """Whether ``peer`` was ever heard (or tracked): only those can be suspected."""
        return peer in self._peers

    def peers(self) -> list[bytes]:
        return list(self._peers)

    def heartbeat(self, peer: bytes, now_ms: int) -> None:
        history = self._peers.get(peer)
        if history is None:
            self.track(peer, now_ms)
            return
        interval = now_ms - history.last_ms
        if interval < 0:
            return  # a reordered, older arrival: carries no timing information
        history.last_ms = now_ms
        history.late_at_ms = self.own_late_ms
        if len(history.intervals) == WINDOW:
            old = history.intervals[0]
            history.total -= old
            history.total_sq -= old * old
        history.intervals.append(interval)
        history.total += interval
        history.total_sq += interval * interval
        history.threshold_ms = self._threshold(history)

    def _threshold(self, history: _PeerHistory) -> int:
        n = len(history.intervals)
        if n < MIN_SAMPLES:
            raw = self.suspect_by_ms
        else:
            mean = history.total // n
            variance = max(0, (history.total_sq * n - history.total * history.total) // (n * n))
            sigma = max(isqrt(variance), self.heartbeat_ms // 4)
            raw = mean + (Z_MILLI * sigma) // 1000
        return min(self.suspect_by_ms, max(self.min_silence_ms, raw))

    def threshold_ms(self, peer: bytes) -> int:
        """The silence after which ``peer`` is suspected (always within the two clamps)."""
        return self._peers[peer].threshold_ms

    def silent_ms(self, peer: bytes, now_ms: int) -> int:
        return max(0, now_ms - self._peers[peer].last_ms)

    def last_heard_ms(self, peer: bytes) -> int | None:
        """When ``peer`` was last heard (or started being watched); None if it is not watched."""
        history = self._peers.get(peer)
        return history.last_ms if history is not None else None

    def heard_within(self, peer: bytes, now_ms: int, window_ms: int) -> bool:
        """Whether ``peer`` was heard (or started being watched) less than ``window_ms`` ago."""
        history = self._peers.get(peer)
        return history is not None and now_ms - history.last_ms < window_ms

    def is_suspected(self, peer: bytes, now_ms: int) -> bool:
        history = self._peers.get(peer)
        return history is not None and self._silence(peer, history, now_ms) >= self._flag_after_ms(peer, history)

    def flag_at_ms(self, peer: bytes) -> int:
        """When ``peer``, unheard until then and with this node on time, is suspected."""
        history = self._peers[peer]
        return history.last_ms + (self.own_late_ms - history.late_at_ms) + self._flag_after_ms(peer, history)

    def next_suspicion_ms(self) -> int | None:
        """The first moment a watched peer, unheard until then, is suspected (None: none watched)."""
        return min((self.flag_at_ms(peer) for peer in self._peers), default=None)

    def suspects(self, now_ms: int) -> list[tuple[bytes, int]]:
        """Every peer silent for at least its threshold, with how long it has been silent
        (this node's own lateness since excepted, F2a)."""
        out = []
        for peer, history in self._peers.items():
            silent = self._silence(peer, history, now_ms)
            if silent >= self._flag_after_ms(peer, history):
                out.append((peer, silent))
        return out
