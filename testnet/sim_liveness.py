"""What the simulator's liveness check owes each job beyond its base deadline: SPEC.md 11,
checker 5, and the known limits of SPEC.md 7 it follows.

The base deadline is ``max(heal_ms, last submit) + liveness_bound_ms``. A job is owed its
placement later, and the check follows SPEC's limits rather than a looser bound, when:

- ``byzantine_led_rounds``: its placement spent rounds after the heal that a Byzantine
  member led (counted in testnet/sim.py, ``Simulation._excuse_byzantine_rounds``);
- ``capacity_wait``: no honest member could hold it (the checker's own accounting of what
  each one runs, ``DecisionChecker.could_host``), until some time after the heal: it is owed
  from then, ``liveness_bound_ms`` later (an unplaceable job waits quietly, P3a); a job
  placed while none could (a Byzantine member's bid) is owed nothing;
- ``quota_wait``: the same, where some honest member could hold it but every honest
  member's job table put it over its owner's quota (SPEC.md Q2; with borrowing, Q6, a
  non-preemptible job cannot borrow and waits for its owner's own jobs to end);
- ``rounds_apart``: after the heal, the honest members that run its instance held no
  quorum of its epoch's stake in any one round (SPEC 7, known limits: honest nodes a round
  apart pass each other at every round boundary; a restarted node does not re-create its
  undecided instances by itself; an epoch's members that still run an instance may hold no
  quorum); that time is credited, outside rounds already credited to a Byzantine leader.

``LivenessTracker`` measures the last two while the run goes on; ``late_reason`` names why
a job still late after all of them is late, for the violation's detail and the sweep's
``stalled_by_reason``.
"""

from __future__ import annotations

CAPACITY_WAIT = "capacity_wait"
QUOTA_WAIT = "quota_wait"
ROUNDS_APART = "rounds_apart"


class LivenessTracker:
    def __init__(self, sim) -> None:
        self.sim = sim
        self.placeable_from_ms: dict[bytes, int] = {}   # job id -> when it last became placeable
        self.unplaceable: set[bytes] = set()            # job ids no honest member can hold now
        self.quota_held: set[bytes] = set()             # job ids whose last unplaceable spell was the quota's
        # Placed while no honest member could hold them (on a Byzantine member's bid): owed
        # nothing, as a job only a Byzantine node could run may rightly stay pending.
        self.placed_unplaceable: set[bytes] = set()
        # instance -> (segment start ms, whether its honest members were apart and no Byzantine
        # round was open then, its job ids); closed at its first honest decision.
        self.segments: dict[bytes, tuple] = {}
        self.closed: set[bytes] = set()

    # --- capacity_wait --------------------------------------------------------------------------
    def note_capacity(self) -> None:
        """After anything that changes what honest members hold (a first decision, an exit, a
        cancel, a refusal) and at the heal: which pending jobs some honest member could take."""
        sim = self.sim
        checker, now = sim.checker, sim.now_ms
        members = [i for i in sim.honest if i in checker.members]
        for spec in sim.world.jobs:
            jid = spec.job_id
            if spec.submit_ms > now or jid in checker.first_placement_of or jid in sim.cancelled:
                continue
            hostable = any(checker.could_host(i, spec.job) for i in members)
            quota_holds = hostable and self._quota_holds(spec.job, members)
            if hostable and not quota_holds:
                if jid in self.unplaceable:
                    self.unplaceable.discard(jid)
                    self.placeable_from_ms[jid] = now
                    sim.longest_excuse_ms = max(sim.longest_excuse_ms, self.capacity_excuse_ms(jid))
            else:
                self.unplaceable.add(jid)
                if quota_holds:
                    self.quota_held.add(jid)
                else:
                    self.quota_held.discard(jid)

    def _quota_holds(self, job, members: list[int]) -> bool:
        """Q2: every honest member's job table puts the job over its owner's quota in its pool,
        so it waits by design (SPEC.md 5.5) until an exit, cancel or refusal frees quota."""
        sim = self.sim
        if not sim.config.quota_gpus:
            return False
        judges = [i for i in members if sim.nodes[i].core is not None]
        return bool(judges) and all(sim._over_quota(i, job) for i in judges)

    def placed(self, jids) -> None:
        """The first placement of these jobs was just decided (before ``note_capacity``)."""
        self.placed_unplaceable.update(jid for jid in jids if jid in self.unplaceable)

    def wait_reason(self, jid: bytes) -> str:
        """Which wait its last unplaceable spell was: ``quota_wait`` or ``capacity_wait``."""
        return QUOTA_WAIT if jid in self.quota_held else CAPACITY_WAIT

    def capacity_excuse_ms(self, jid: bytes) -> int:
        """How much later than the base deadline the job is owed: it became placeable at
        ``placeable_from_ms`` and is owed ``liveness_bound_ms`` from then."""
        since = self.placeable_from_ms.get(jid)
        if since is None:
            return 0
        return max(0, since + self.sim.config.liveness_bound_ms - self.sim.deadline_ms)

    # --- rounds_apart ---------------------------------------------------------------------------
    def note_rounds(self, iid: bytes, jids: tuple) -> None:
        """At a round change of an honest node after the heal: close the instance's current
        segment (crediting it if it was apart) and open the next."""
        if iid in self.closed:
            return
        self._close(iid)
        apart = self.honest_stake_by_round(iid)[0] and iid not in self.sim.open_rounds
        self.segments[iid] = (self.sim.now_ms, apart, jids)

    def decided(self, iid: bytes) -> None:
        """The first honest decision of the instance: nothing more is owed for it."""
        if iid not in self.closed:
            self._close(iid)
            self.closed.add(iid)

    def close_all(self) -> None:
        for iid in list(self.segments):
            self._close(iid)

    def _close(self, iid: bytes) -> None:
        segment = self.segments.pop(iid, None)
        if segment is not None and segment[1]:
            self.sim._credit(segment[2], self.sim.now_ms - segment[0], ROUNDS_APART)

    def honest_stake_by_round(self, iid: bytes) -> tuple[bool, bool]:
        """(apart, no live quorum): whether no round of the instance holds a quorum of honest
        stake now, and whether all honest members running it together hold none either."""
        rounds: dict[int, int] = {}
        view = None
        for index in self.sim.honest:
            node = self.sim.nodes[index]
            inst = node.core.instances.get(iid) if node.up and node.core is not None else None
            if inst is None or inst.decision is not None or inst.gave_up:
                continue
            view = inst.view
            rounds[inst.round] = rounds.get(inst.round, 0) + view.stakes.get(node.public_key, 0)
        if view is None:
            return True, True
        return (not any(view.is_quorum_stake(stake) for stake in rounds.values()),
                not view.is_quorum_stake(sum(rounds.values())))

    # --- classification ---------------------------------------------------------------------------
    def late_reason(self, instance: bytes | None, decided_in_time: bool) -> str:
        """Why a job is late past everything it is owed: ``catch_up`` (an honest node decided
        it in time, others learnt it later: F6), ``no_live_quorum`` (the honest members that
        run its instance hold no quorum together now: SPEC 7), ``rounds_apart`` (they are in
        different rounds now), or ``undecided`` (none of these)."""
        if decided_in_time:
            return "catch_up"
        if instance is not None:
            apart, no_quorum = self.honest_stake_by_round(instance)
            if no_quorum:
                return "no_live_quorum"
            if apart:
                return ROUNDS_APART
        return "undecided"
