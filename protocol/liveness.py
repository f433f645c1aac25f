"""Liveness: heartbeats, failure detection, suspicion, self-fencing and catch-up sync
(SPEC.md 7, rules F1-F4, F6).

Every member heartbeats its k monitors (monitors.py) every heartbeat_ms, unsigned (the
channel authenticates them); the failure detector (failure_detector.py) turns a subject's
silence into suspicion. A member that receives a suspicion of a member it does not watch
watches it from then on, counting it silent since the suspicion said (but for at least
CONFIRM_PERIODS heartbeat periods of its own, and flagging it CONFIRM_GRACE_PERIODS later
still), and the suspect, if alive, answers every
suspicion of itself by heartbeating every member for REFUTE_PERIODS periods (a refutation,
as in SWIM); a member that hears it stops timing its silence until another suspicion of
it arrives (F4a: on a starved host, suspicions no longer feed on themselves). So a suspicion from more than a third of the stake, which starts the epoch's change
(flows/epoch_change.py), still means that much stake found the member silent itself. A
node that was itself paused past the detection bound halts its workloads (F3) until a
current member's fresh heartbeat shows it was not evicted.
"""

from __future__ import annotations

import itertools

from protocol.failure_detector import FailureDetector
from protocol.job_table import LIVE_JOB_STATES
from protocol.messages import Heartbeat, Suspicion, SyncRequest
from protocol.messages.liveness import SYNC_HAVE_MAX, SYNC_HAVE_PREFIX_BYTES
from protocol.monitors import monitor_assignment, subjects_in
from protocol.ready import Outbound, Ready, local_decision

SYNC_ANSWER_GAP_MS = 200       # at most one sync answer per peer per this long
MAX_SUSPICION_JUSTIFICATION = 32
MAX_SYNC_CERTIFICATES = 16     # epoch changes sent per sync answer
MAX_SYNC_DECISIONS = 32        # recent decisions re-sent to a syncing peer, per answer
# A decision a sync answer sent a peer is not sent it again sooner: long enough for a chain
# of continued answers (MAX_DECIDED_KEPT / MAX_SYNC_DECISIONS answers, SYNC_ANSWER_GAP_MS
# apart) to move on, short because an answer lost in flight (a lossy link before a heal)
# is found again only after it: 5000 left members up to 7 s behind after a heal.
SYNC_RESEND_MS = 2000
STARTUP_SYNC_PEERS = 3
MAX_PRIMARIES_SYNCED = 8       # F6c: primaries of its live jobs a restarted node also asks
ANTI_ENTROPY_MS = 1000
SUSPICION_FRESH_BOUNDS = 3     # a suspicion counts for this many detection bounds after it arrived
CONFIRM_PERIODS = 2            # a member told of a suspicion watches the suspect itself this many periods first
# ... and flags it this many periods later still (F4): after a stall a little shorter than the
# bound, the suspect's refutation reaches it only once the suspect is scheduled again and its
# frames are through Noise, yamux and trio at both ends; on a loaded host (load 25 on 2
# cores) that took 60-150 ms, and every member suspected it (issue 18). The eviction wait
# (F4: the bound and a period since last heard) is timed as before.
CONFIRM_GRACE_PERIODS = 2
# A suspected member heartbeats every member for this many periods after each suspicion of it
# (F4a): enough to reach every member the suspicion reached, each of which then stops timing
# its silence until another suspicion says otherwise.
REFUTE_PERIODS = CONFIRM_PERIODS + CONFIRM_GRACE_PERIODS + 1
# F4c: a suspicion that more than 1/3 of the stake does not share is re-sent after 1, 2, 4, 8, 16,
# then every 32 detection bounds while the suspect stays silent to us: a lost link (n = 32 on 2 cores:
# handshakes failed under load and pairs stayed unconnected for minutes) is not a dead member,
# and each re-send cost every member a verification and the suspect a refutation to everyone.
SUSPICION_BACKOFF_MAX_BOUNDS = 32


class Liveness:
    def __init__(self, ctx, epochs, jobs, instances, now_ms: int, min_silence_ms: int | None = None) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.jobs = jobs
        self.instances = instances
        self.epoch_changes = None   # the EpochChangeFlow and the Joins, set by the core
        self.joins = None
        params = ctx.params
        self.detector = FailureDetector(heartbeat_ms=params.heartbeat_ms,
                                        detection_bound_ms=params.detection_bound_ms,
                                        min_silence_ms=min_silence_ms)
        # Members are watched from their first heartbeat on, not from our start: nodes of a
        # mesh start seconds apart, and one that never came up holds no workload (it never
        # bid), so suspecting it would only evict a slow starter (SPEC.md F2).
        self.last_tick_ms = now_ms
        self.ticked_as_member = False   # F2a: whether a tick as a member came before (its gap is then a tick gap)
        self.heartbeat_seq = 0
        self.heartbeat_sent_ms: int | None = None
        self.suspicions: dict[bytes, dict[bytes, bytes]] = {}   # suspect -> signer -> Suspicion envelope
        # suspect -> signer -> when its newest suspicion arrived. A suspecter re-sends every
        # detection_bound_ms while it still suspects, so one not renewed for
        # SUSPICION_FRESH_BOUNDS bounds has heard the suspect again: it counts no more (F4),
        # and an epoch change started on it has nothing left to decide.
        self.suspicion_heard_ms: dict[bytes, dict[bytes, int]] = {}
        self.suspicion_sent_ms: dict[bytes, int] = {}
        self.suspicion_repeats: dict[bytes, int] = {}   # suspect -> our suspicions of it since last heard (F4c)
        self.halted = False
        self.sync_answered_ms: dict[bytes, int] = {}
        # peer -> instance -> when a sync answer last sent it that decision: the next answer
        # sends the next ones, so a member that missed more than one answer holds catches up
        # over a few anti-entropy rounds instead of getting the same newest ones each time.
        self.sync_decisions_sent: dict[bytes, dict[bytes, int]] = {}
        # peer -> (the epoch it synced from, what it said it has, F6d), while its last answer
        # was full (it may lack more): answered again SYNC_ANSWER_GAP_MS later, unasked,
        # until an answer is not full.
        self.sync_continuations: dict[bytes, tuple[int, frozenset]] = {}
        self.startup_sync_due = True
        self.sync_sent_ms = now_ms
        self.peer_beat_sent_ms: dict[bytes, int] = {}    # member -> sent_ms of its latest heartbeat
        self.fresh_beat_after_ms: dict[bytes, int] = {}  # while halted: member -> sent_ms that proves news
        self.halt_gap_ms: int | None = None   # the pause that halted us (None: not halted, or the restart hold)
        # Since when members never heard from count as unresponsive leaders (SPEC F4): our
        # start or our entry into the current epoch, whichever came last.
        self.unheard_since_ms = now_ms
        self.watched_on_suspicion: set[bytes] = set()   # non-subjects watched because a member suspects them
        # Of those, the ones heard since the latest suspicion of them arrived (F4a): not
        # suspected by their silence, and heard for F4's and F5's eviction checks, until
        # another suspicion (a monitor re-sends its own every bound while it suspects).
        self.refuted: set[bytes] = set()
        self.refute_until_ms: int | None = None  # while suspected: heartbeat every member until then (F1)
        self.refuted_ms: int | None = None
        self._monitor_cache: tuple = (None, (), ())   # (view digest, my monitors, my subjects)
        self.skipped_round = False   # the last tick skipped a round (F4): tick again at once
        self.ticked_epoch = None     # the epoch of the last tick: a new one may leave rounds to skip (F4)

    # --- who watches whom (SPEC F1a) --------------------------------------------------------------
    def _monitoring(self) -> tuple:
        view = self.epochs.view
        digest, monitors, subjects = self._monitor_cache
        if digest != view.digest:
            assignment = monitor_assignment(view.members)
            monitors, subjects = assignment.get(self.ctx.me, ()), subjects_in(assignment, self.ctx.me)
            self._monitor_cache = (view.digest, monitors, subjects)
        return monitors, subjects

    def monitors(self) -> tuple:
        """The members our heartbeats go to: they watch us."""
        return self._monitoring()[0]

    def subjects(self) -> tuple:
        """The members whose heartbeats we receive and watch."""
        return self._monitoring()[1]

    def is_suspected(self, key: bytes) -> bool:
        return self.ctx.heartbeats and key not in self.refuted and self.detector.is_suspected(key, self.last_tick_ms)

    def _silent_members(self, now_ms: int) -> list[tuple[bytes, int]]:
        """The detector's suspects, less the members watched on suspicion that refuted it (F4a)."""
        return [(peer, silent) for peer, silent in self.detector.suspects(now_ms) if peer not in self.refuted]

    def _my_live_jobs(self) -> tuple:
        return self.jobs.live_jobs_of(self.ctx.me)

    def others_can_evict_me(self) -> bool:
        """SPEC F3: whether any other member could have moved our jobs while we were paused or
        down. A member alone in its epoch (`meshnode dev`) cannot have been evicted behind its
        back and has no peer whose heartbeat could ever end a halt: it does not halt. Any other
        member may have been, whatever the stake split of the epoch it knows: that view may be
        stale (a join it voted for and never applied can give the others a quorum without
        it; the node-mode simulator found that double run, seeds 55 and 58)."""
        return bool(self.epochs.broadcast_targets())

    def _hold_restarted_jobs(self, now_ms: int, out: Ready) -> None:
        """SPEC F3/F6: a (re)started node whose history makes it the primary of live jobs may
        have been evicted while it was down, and its jobs may run elsewhere under a higher
        fence. It starts none of them until a member at its epoch has answered its sync
        (the same wait as self-fencing); with no one to ask, it resumes at once."""
        mine = self._my_live_jobs()
        if not mine or not self.epochs.is_member():
            return
        if self.ctx.heartbeats and self.others_can_evict_me():
            self.halted = True
            out.events.append(self.ctx.event("restart_sync", now_ms, epoch=self.epochs.epoch, jobs=len(mine)))
        else:
            out.decisions.append(local_decision("resume", mine))

    def _primaries_of_live_jobs(self) -> list[bytes]:
        """SPEC F6c: the other members its table makes primaries of live jobs, lowest key first."""
        members = self.epochs.view.stakes
        primaries = {r.primary for r in self.jobs if r.state in LIVE_JOB_STATES and r.primary in members}
        primaries.discard(self.ctx.me)
        return sorted(primaries)[:MAX_PRIMARIES_SYNCED]

    def sync(self, now_ms: int, out: Ready, peers_asked: int, also: list[bytes] = (),
             anti_entropy: bool = False) -> None:
        """SPEC F6: a (re)started node asks a few random members for what it missed while down,
        and every ANTI_ENTROPY_MS one random member (a lost certificate is found again); a few,
        not all, so this costs O(n) messages mesh-wide, not O(n^2). ``also``: members asked
        besides (F6c: a restarted node's primaries, whose answers carry their vectors, F6a).
        ``anti_entropy``: the periodic one, which names what we have (F6d)."""
        self.sync_sent_ms = now_ms
        peers = self.epochs.broadcast_targets()
        if not self.epochs.is_member() or not peers:
            return
        # A silent member answers nothing: ask among the others (all, if none is left).
        unresponsive = self.unresponsive_members(now_ms)
        peers = [peer for peer in peers if peer not in unresponsive] or peers
        request = self.naming_request() if anti_entropy else SyncRequest(epoch=self.epochs.epoch)
        data = self.ctx.sign(request)
        chosen = self.ctx.rng.sample(peers, min(peers_asked, len(peers)))
        chosen += [peer for peer in also if peer not in chosen and peer in self.epochs.view.stakes]
        out.messages.extend(Outbound(peer, data) for peer in chosen)

    # --- heartbeats, detection, self-fencing (SPEC F1-F3) ------------------------------------------
    def tick(self, now_ms: int, out: Ready) -> None:
        ctx, epochs, params = self.ctx, self.epochs, self.ctx.params
        gap = now_ms - self.last_tick_ms
        self.last_tick_ms = now_ms
        self.skipped_round = False
        self.ticked_epoch = epochs.epoch
        if self.startup_sync_due:
            # Cleared here only: a sync sent before the first tick (a readmission replayed from
            # history asks for one) must not skip the restart's hold (F3; simulator seeds 55, 58).
            self.startup_sync_due = False
            self._hold_restarted_jobs(now_ms, out)
            self.sync(now_ms, out, STARTUP_SYNC_PEERS, also=self._primaries_of_live_jobs())
        elif now_ms - self.sync_sent_ms >= ANTI_ENTROPY_MS:
            self.sync(now_ms, out, 1, anti_entropy=True)
        if self.joins.evicted_at_epoch is not None and not epochs.is_member():
            self.joins.maybe_rejoin(now_ms, out)
        for peer, (since_epoch, have) in list(self.sync_continuations.items()):
            if now_ms - self.sync_answered_ms.get(peer, now_ms) >= SYNC_ANSWER_GAP_MS:
                self.sync_continuations.pop(peer)
                self.answer_sync(peer, since_epoch, now_ms, out, have)
        if not ctx.heartbeats or not epochs.is_member():
            return
        # F2a: our own lateness, not our peers' silence. The first tick after start has no
        # tick before it: its gap is the start itself (1.2 s on a testnet node), not a stall,
        # and counted it raised the score to its cap, slowing the detection of a crash in the
        # next 3 s by up to 16 periods (bench failover: the first kill, 512-582 ms).
        first_tick, self.ticked_as_member = not self.ticked_as_member, True
        if not first_tick and self.detector.note_tick(gap, now_ms):
            ctx.counters["late_ticks"] += 1
        paused = gap >= self.detector.min_silence_ms - params.heartbeat_ms
        if paused and not self.halted and self.others_can_evict_me():
            # SPEC F3: we were paused long enough for peers to suspect us (our last heartbeat
            # may be a period older than the pause), so we may have been evicted and our
            # workloads may run elsewhere already. Halt them and ask for the epochs we missed.
            self.halted = True
            # Heartbeats sent while we were stopped wait in our sockets and are read now; the
            # ones sent before the others evicted us must not end the halt. A member's
            # heartbeat counts only if sent (by its own clock) about `gap` after the newest
            # one we had seen: i.e. after we resumed and asked for a sync.
            self.fresh_beat_after_ms = {peer: sent + gap - params.heartbeat_ms
                                        for peer, sent in self.peer_beat_sent_ms.items()}
            self.halt_gap_ms = gap
            out.decisions.append(local_decision("halt", ()))
            out.events.append(ctx.event("self_fence_check", now_ms, gap_ms=gap, epoch=epochs.epoch))
            # F3: a few members, not all (issue 18): on a starved host every member halted
            # about once a second, and n answers per halt fed the starvation. Each answer
            # carries a heartbeat, and its subjects' heartbeats come anyway.
            self.sync(now_ms, out, STARTUP_SYNC_PEERS)
        if paused and self.others_can_evict_me():
            # F1: refute at once. Our monitors may have suspected us meanwhile, and every member
            # their suspicion reached now gives us two heartbeat periods to answer it (F4). The
            # suspicions wait in our sockets behind everything else sent to us during the pause;
            # on a loaded host reading them took longer than those two periods, so every member
            # suspected us too (issue 18: 11 of 15 at n = 16 after one 270 ms stall).
            self.refute_until_ms = now_ms + REFUTE_PERIODS * params.heartbeat_ms
            self.heartbeat_sent_ms = None
        if self.heartbeat_sent_ms is None or now_ms - self.heartbeat_sent_ms >= params.heartbeat_ms:
            self.heartbeat_sent_ms = now_ms
            self.heartbeat_seq += 1
            refuting = self.refute_until_ms is not None and now_ms < self.refute_until_ms
            self._send_heartbeat(now_ms, out, refuting)
        if self.halted or paused:
            # A node that may be stale suspects nobody; nor does one just back from a pause
            # it need not halt for: the heartbeats that waited in its sockets are not read yet.
            return
        view = epochs.view
        self._forget_stale_suspicions(now_ms)
        silent = [(peer, silent_ms) for peer, silent_ms in self._silent_members(now_ms) if peer in view.stakes]
        if view.exceeds_one_third(peer for peer, _ in silent):
            # F4a: with more than a third of the stake silent, no eviction can be decided (the
            # rest holds no quorum), and most likely this node is the one cut off or starved:
            # its suspicions would only add O(n) messages each to a saturated host.
            ctx.counters["suspicion_ticks_withheld"] += 1
            silent = []
        for peer in [p for p in self.suspicion_repeats if not self.detector.is_suspected(p, now_ms)]:
            del self.suspicion_repeats[peer]   # heard again: its next suspicion is a new one (F4c)
        for peer, silent_ms in silent:
            sent = self.suspicion_sent_ms.get(peer)
            if sent is not None and now_ms - sent < self._resend_after_ms(peer):
                continue
            self.suspicion_sent_ms[peer] = now_ms
            self.suspicion_repeats[peer] = self.suspicion_repeats.get(peer, 0) + 1
            suspicion = Suspicion(suspect=peer, epoch=epochs.epoch, silent_ms=silent_ms)
            data = ctx.sign(suspicion)
            out.messages.append(Outbound(None, data))
            out.events.append(ctx.event("suspect", now_ms, suspect=peer.hex(), silent_ms=silent_ms))
            self._record_suspicion(ctx.me, suspicion, data, now_ms, out)
        if any(s in view.stakes and view.exceeds_one_third(by) for s, by in self.suspicions.items()):
            # A leader holds an eviction back until the suspect was silent for the whole
            # bound and a heartbeat period (heard_before_eviction): offer it the value again.
            self.epoch_changes.start(epochs.view, now_ms, out)
        self._skip_unresponsive_leaders(now_ms, out)

    def next_due_ms(self, now_ms: int) -> int:
        """When ``tick`` must run next (MeshCore.next_tick_ms, SPEC F3a): the earliest of the
        next heartbeat, anti-entropy sync, continued sync answer and rejoin request, the first
        moment a watched member's silence reaches its threshold, a flagged member's next
        suspicion, a fresh suspicion's lapse, the moment a suspect may be proposed for eviction
        (F4: silent for the bound and a period) or a never-heard subject counts unresponsive;
        ``now_ms`` while the restart sync is due, the last tick skipped a round (the next
        round's leader may be unresponsive too) or an epoch was entered since with instances
        open (their leader may have been evicted). Everything else a tick does here follows an
        input (a heartbeat, a suspicion), after which the driver asks again."""
        if self.startup_sync_due or self.skipped_round or (self.instances.instances
                                                           and self.ticked_epoch != self.epochs.epoch):
            return now_ms
        params = self.ctx.params
        due = self.sync_sent_ms + ANTI_ENTROPY_MS
        for peer in self.sync_continuations:
            due = min(due, self.sync_answered_ms.get(peer, now_ms) + SYNC_ANSWER_GAP_MS)
        if self.joins.evicted_at_epoch is not None and not self.epochs.is_member():
            due = min(due, self.joins.next_rejoin_ms(now_ms))
        if not self.ctx.heartbeats or not self.epochs.is_member():
            return max(now_ms, due)
        if self.heartbeat_sent_ms is None:
            return now_ms
        due = min(due, self.heartbeat_sent_ms + params.heartbeat_ms)
        if self.halted:
            return max(now_ms, due)   # it suspects nobody and skips no round until a heartbeat ends the halt
        detector = self.detector
        for peer in detector.peers():
            if peer in self.refuted:
                continue   # F4a: its silence is not timed until another suspicion (an input)
            flagged_at = detector.flag_at_ms(peer)
            if flagged_at > now_ms:
                due = min(due, flagged_at)
            elif peer in self.suspicion_sent_ms:
                # Flagged: its suspicion is sent again a bound after the last (withheld ones,
                # F4a, are looked at again with the next heartbeat).
                due = min(due, max(now_ms + 1, self.suspicion_sent_ms[peer] + self._resend_after_ms(peer)))
        fresh_for = SUSPICION_FRESH_BOUNDS * params.detection_bound_ms
        view = self.epochs.view
        for suspect, heard in self.suspicion_heard_ms.items():
            due = min(due, min(heard.values()) + fresh_for + 1)
            if suspect in view.stakes and suspect not in self.refuted and view.exceeds_one_third(heard):
                last = detector.last_heard_ms(suspect)
                if last is not None:   # F4: the leader offers the eviction once it is silent that long
                    evictable_at = last + params.detection_bound_ms + params.heartbeat_ms
                    if evictable_at > now_ms:
                        due = min(due, evictable_at)
        if self.instances.instances and now_ms < self.unheard_since_ms + detector.suspect_by_ms:
            due = min(due, self.unheard_since_ms + detector.suspect_by_ms)   # F4: never-heard subjects
        return max(now_ms, due)

    def _resend_after_ms(self, peer: bytes) -> int:
        """SPEC F4c: how long after its last suspicion of ``peer`` this member sends the next:
        a bound while more than 1/3 of the stake suspects it (the eviction needs them fresh),
        else 1, 2, 4, ... doubling up to 32 bounds after the 1st, 2nd, 3rd, ... send since it was
        last heard."""
        bound = self.ctx.params.detection_bound_ms
        if self.epochs.view.exceeds_one_third(self.suspicions.get(peer, ())):
            return bound
        repeats = self.suspicion_repeats.get(peer, 1)
        return bound * min(1 << max(0, repeats - 1), SUSPICION_BACKOFF_MAX_BOUNDS)

    def _send_heartbeat(self, now_ms: int, out: Ready, refuting: bool) -> None:
        """SPEC F1: to our monitors; to every member while a suspicion of us is fresh."""
        data = self.ctx.unsigned(Heartbeat(epoch=self.epochs.epoch, seq=self.heartbeat_seq, sent_ms=now_ms))
        monitors = self.monitors()
        if refuting or len(monitors) >= len(self.epochs.view.members) - 1:
            out.messages.append(Outbound(None, data))
        else:
            out.messages.extend(Outbound(monitor, data) for monitor in monitors)

    def unresponsive_members(self, now_ms: int) -> set[bytes]:
        """SPEC F4: the members whose rounds we skip: suspected ones, and, once a suspicion
        threshold has passed since we started or entered this epoch, the ones never heard at all
        (not suspected: see F2; a silent node's rounds would otherwise each cost a timeout)."""
        if not self.ctx.heartbeats or self.halted or not self.epochs.is_member():
            return set()
        # A halted node suspects nobody (F3): after its pause every peer looks silent to it.
        view = self.epochs.view
        flagged = {peer for peer, _silent in self._silent_members(now_ms)}
        # Never heard: a subject (F1a) whose heartbeat never came. Other members send us no
        # heartbeat at all; their silence is their monitors' to notice.
        unheard = {key for key in self.subjects() if not self.detector.is_watched(key)}
        heard_stake = view.total_stake - view.stake_of(flagged | unheard)
        if not view.is_quorum_stake(heard_stake):
            # We hear less than a quorum: most likely we are the one cut off, and skipping
            # rounds would only race us ahead of the members we cannot hear, whose round
            # changes then never meet ours (a partition in the sweep left a node 30 rounds ahead).
            return set()
        # F4b: only a corroborated suspect (fresh suspicions from more than 1/3 of the stake)
        # loses its rounds. On a loaded host each member flags a different few it read late;
        # skipping on its own flag alone sent members of one instance to different rounds
        # (issue 18, n = 16 with jobs in flight: 3,619 skips in 90 s, nothing decided).
        suspected = {peer for peer in flagged if view.exceeds_one_third(self.suspicions.get(peer, ()))}
        if now_ms - self.unheard_since_ms < self.detector.suspect_by_ms:
            return suspected
        return suspected | unheard

    def _skip_unresponsive_leaders(self, now_ms: int, out: Ready) -> None:
        """SPEC F4: waiting for an unresponsive leader's proposal would only cost its round's
        timeout; entering the next round is always safe (it signs nothing), and the
        announcement counts towards the next leader's quorum of round changes (6.5)."""
        if not self.instances.instances:
            return   # no round to skip (an idle node ticked this every heartbeat period)
        unresponsive = self.unresponsive_members(now_ms)
        epochs = self.epochs
        if self.halted or not epochs.is_member():
            return
        # An instance still running in an earlier epoch whose round's leader has since left
        # the mesh (evicted): most often dead. (An evicted node that is alive may still vote
        # there, F7; skipping its rounds costs no safety, and it keeps its votes.)
        if not unresponsive and epochs.epoch == 0:
            return
        skip = [i for i in self.instances.instances.values()
                if (i.leader in unresponsive or (i.view.epoch < epochs.epoch and i.leader not in epochs.view.stakes))
                and not self.instances.roles[i.instance_id].flow.round_on_hold(i, now_ms)]
        self.skipped_round = bool(skip)
        for inst in skip:
            self.instances.skip_round(inst, now_ms, out)

    def on_heartbeat(self, envelope, beat: Heartbeat, data, now_ms: int, out: Ready) -> None:
        signer, epochs = envelope.signer, self.epochs
        if beat.epoch < epochs.epoch or signer not in epochs.view.stakes:
            self.ctx.counters["heartbeat_stale"] += 1
            self.answer_sync(signer, beat.epoch, now_ms, out)  # tell it what it missed (maybe its eviction)
            return
        was_silent = self.ctx.heartbeats and self.detector.is_suspected(signer, now_ms)
        self._note_heartbeat(signer, beat, now_ms)
        if was_silent and epochs.is_member() and not self.halted:
            # SPEC F6: heard again after a silence (a partition healed, a crash ended): what
            # either side missed meanwhile (decisions, exits) is asked for now, not at the
            # next anti-entropy round.
            out.messages.append(Outbound(signer, self.ctx.sign(self.naming_request())))
        fresh = self.halted and self._fresh_after_halt(signer, beat.sent_ms)
        # The latest, not the greatest: a restarted peer's clock may start anywhere.
        self.peer_beat_sent_ms[signer] = beat.sent_ms
        if self.halted and fresh and beat.epoch >= epochs.epoch and epochs.is_member():
            # SPEC F3: a current peer's heartbeat after catching up: we were not evicted.
            self.halted = False
            self.fresh_beat_after_ms = {}
            self.halt_gap_ms = None
            out.decisions.append(local_decision("resume", self._my_live_jobs()))
            out.events.append(self.ctx.event("self_fence_clear", now_ms, epoch=epochs.epoch))

    def _note_heartbeat(self, signer: bytes, beat: Heartbeat, now_ms: int) -> None:
        """What any heartbeat from a current member tells the detector."""
        if self.detector.is_watched(signer) or signer in self.subjects():
            # Only those we watch: another member's heartbeat (a sync answer, a refutation after
            # its suspicions lapsed) would start a watch that its silence then turns into suspicion.
            self.detector.heartbeat(signer, now_ms)
            if self.detector.note_read_delay(signer, beat.sent_ms, beat.seq, now_ms):
                self.ctx.counters["late_heartbeats"] += 1   # F2a: it waited in queues, ours or the host's
            if signer in self.watched_on_suspicion:
                self.refuted.add(signer)   # F4a: alive since the suspicion; its monitors watch on

    def take_quiet_heartbeat(self, signer: bytes, beat: Heartbeat, now_ms: int) -> bool:
        """SPEC F1d: take a heartbeat whose only effect is on the detector, as ``on_heartbeat``
        would, and return True; False (nothing done) when it may have more: a stale sender or
        epoch (answered with a sync), a sender this node suspects (a sync request, F6), or this
        node halted (the heartbeat may end the halt, F3), or a detector whose thresholds adapt
        (min_silence_ms below suspect_by_ms: a new sample may lower one). A heartbeat taken
        here brings no deadline of ``next_tick_ms`` earlier (its sender's flag time moves on by
        the time since it was last heard, its threshold stays suspect_by_ms, the health score
        only rises), so the driver need not ask for the next tick again."""
        epochs, detector = self.epochs, self.detector
        if (self.halted or beat.epoch < epochs.epoch or signer not in epochs.view.stakes
                or detector.min_silence_ms < detector.suspect_by_ms
                or (self.ctx.heartbeats and detector.is_suspected(signer, now_ms))):
            return False
        self._note_heartbeat(signer, beat, now_ms)
        self.peer_beat_sent_ms[signer] = beat.sent_ms
        return True

    def _fresh_after_halt(self, member: bytes, sent_ms: int) -> bool:
        """SPEC F3: whether a heartbeat read while halted was sent after we resumed. A member
        we had no heartbeat from before the pause (not one of our subjects, F1a) may have one
        waiting in our sockets all the same (an answer to our last sync): its first one read
        now is its reference, as if it had been read before the pause."""
        after = self.fresh_beat_after_ms.get(member)
        if after is None:
            if self.halt_gap_ms is None:
                return True   # the restart hold: nothing sent to our previous run reaches this one
            self.fresh_beat_after_ms[member] = sent_ms + self.halt_gap_ms - self.ctx.params.heartbeat_ms
            return False
        return sent_ms >= after

    def on_sync_request(self, envelope, request: SyncRequest, data, now_ms: int, out: Ready) -> None:
        self.answer_sync(envelope.signer, request.epoch, now_ms, out, frozenset(request.have))
        # SPEC F6: no heartbeat to a member this node signed a suspicion of (unrefuted): its
        # eviction may be in flight, and the heartbeat would end a restarted member's hold on
        # its jobs (F3) just before the certificate that moves them arrives.
        evicting = self.ctx.me in self.suspicions.get(envelope.signer, {}) and envelope.signer not in self.refuted
        if envelope.signer in self.epochs.view.stakes and request.epoch >= self.epochs.epoch and not evicting:
            beat = Heartbeat(epoch=self.epochs.epoch, seq=self.heartbeat_seq, sent_ms=now_ms)
            out.messages.append(Outbound(envelope.signer, self.ctx.unsigned(beat)))

    def naming_request(self) -> SyncRequest:
        """The sync request of a live member (anti-entropy, and on hearing a flagged member
        again): our epoch and, F6d, what we applied last, so that an answer brings only what
        we lack. Without it every anti-entropy answer re-sent the answerer's newest 32
        decisions and went on unasked 200 ms later while its answers were full: with decisions
        coming faster than they expire from its resend memory, for ever (n = 16 with jobs in
        flight: 120,000 certificates re-sent to nodes that held them, against 4,000
        broadcast, in 25 s). A restart's, a self-fence's and a rejoin's requests name nothing:
        their answers' heartbeat ends a hold on our jobs (F3) and comes after the
        certificates as before (node-mode simulator seed 34 double-ran when a restart's
        answer was cut short)."""
        recent = self.instances.recent_certificates
        newest = itertools.islice(reversed(recent), SYNC_HAVE_MAX)
        return SyncRequest(epoch=self.epochs.epoch, have=tuple(iid[:SYNC_HAVE_PREFIX_BYTES] for iid in newest))

    def answer_sync(self, peer: bytes, since_epoch: int, now_ms: int, out: Ready,
                    have: frozenset | None = None) -> None:
        """``have``: the instance id prefixes the peer's request says it applied (F6d): not
        sent again. None: an answer nobody asked for (a stale heartbeat's), never continued:
        its peer asks once it is in our epoch, saying what it has."""
        last = self.sync_answered_ms.get(peer)
        if last is not None and now_ms - last < SYNC_ANSWER_GAP_MS:
            return
        # Newest first (SPEC F6b): a node behind holds each as early (F5) until the oldest
        # arrives, then applies them all in that one input, so its workload orders follow only
        # the epoch it ends in, never one a later change in the same answer has left.
        certificates = self.epochs.certificates_since(since_epoch)[:MAX_SYNC_CERTIFICATES][::-1]
        if peer in self.epochs.view.stakes:
            # A member that was down may have missed placements too: the newest certificates we
            # applied, however they reached us (our own instance, a broadcast or a catch-up).
            decisions = self._decisions_to_resend(peer, set(certificates), now_ms, have or frozenset())
            certificates.extend(decisions)
            if len(decisions) == MAX_SYNC_DECISIONS and have is not None:
                self.sync_continuations[peer] = (since_epoch, have)
            else:
                self.sync_continuations.pop(peer, None)
        if peer in self.epochs.member_info:
            # ...and to any node that was ever a member (an evicted one is about to rejoin), the
            # exits, refusals and cancels it accepted last, which are messages sent once (P6).
            certificates.extend(self.jobs.recent_outcomes)
        if not certificates:
            return
        if len(self.sync_answered_ms) > 4096:
            self.sync_answered_ms.clear()
        self.sync_answered_ms[peer] = now_ms
        out.messages.extend(Outbound(peer, c) for c in certificates)

    def _decisions_to_resend(self, peer: bytes, sending: set, now_ms: int, have: frozenset) -> list[bytes]:
        """The newest MAX_SYNC_DECISIONS applied decisions not sent to ``peer`` by a sync
        answer in the last SYNC_RESEND_MS (those in ``sending`` excluded, and those whose
        instance id prefix is in ``have``: it applied them)."""
        if peer not in self.sync_decisions_sent and len(self.sync_decisions_sent) >= 4096:
            self.sync_decisions_sent.clear()
        sent = self.sync_decisions_sent.setdefault(peer, {})
        recent = self.instances.recent_certificates
        for iid in [i for i, at in sent.items() if now_ms - at >= SYNC_RESEND_MS or i not in recent]:
            del sent[iid]
        chosen = []
        for iid in reversed(recent):
            if len(chosen) == MAX_SYNC_DECISIONS:
                break
            certificate = recent[iid]
            if iid not in sent and certificate not in sending and iid[:SYNC_HAVE_PREFIX_BYTES] not in have:
                sent[iid] = now_ms
                chosen.append(certificate)
        return chosen[::-1]

    # --- suspicion (SPEC F4) ---------------------------------------------------------------------
    def on_suspicion(self, envelope, suspicion: Suspicion, data, now_ms: int, out: Ready) -> None:
        if envelope.signer not in self.epochs.view.stakes or suspicion.epoch != self.epochs.epoch:
            self.ctx.counters["suspicion_stale"] += 1
            return
        if self.ctx.heartbeats and self.epochs.is_member():
            if suspicion.suspect == self.ctx.me:
                self.detector.note_suspected(now_ms)   # F2a: we were late to someone
                self._refute(now_ms, out)
            else:
                self._watch_suspect(suspicion, now_ms)
        self._record_suspicion(envelope.signer, suspicion, data, now_ms, out)

    def _refute(self, now_ms: int, out: Ready) -> None:
        """SPEC F1: we are suspected, so we are alive and heard by too few: heartbeat every
        member now (at most once a period) and each period while the suspicion may count."""
        params = self.ctx.params
        self.refute_until_ms = now_ms + REFUTE_PERIODS * params.heartbeat_ms
        if self.refuted_ms is None or now_ms - self.refuted_ms >= params.heartbeat_ms:
            self.refuted_ms = now_ms
            self._send_heartbeat(now_ms, out, refuting=True)

    def _watch_suspect(self, suspicion: Suspicion, now_ms: int) -> None:
        """SPEC F4: a member another one suspects, that we do not watch, we watch from now on,
        as if last heard when the suspicion says, but at least CONFIRM_PERIODS periods from
        now: time for the suspect, if alive, to hear the suspicion and refute it to us."""
        suspect = suspicion.suspect
        confirm_ms = CONFIRM_PERIODS * self.ctx.params.heartbeat_ms
        silent_ms = min(suspicion.silent_ms, max(0, self.detector.suspect_by_ms - confirm_ms))
        flag_after_ms = self.detector.suspect_by_ms + CONFIRM_GRACE_PERIODS * self.ctx.params.heartbeat_ms
        if suspect in self.refuted:
            # F4a: it refuted an earlier suspicion; this one is timed afresh, from its last
            # heartbeat but again with CONFIRM_PERIODS for it to answer.
            self.refuted.discard(suspect)
            self.detector.heard_no_earlier_than(suspect, now_ms - silent_ms, threshold_ms=flag_after_ms)
            return
        if suspect not in self.epochs.view.stakes or self.detector.is_watched(suspect) or suspect in self.subjects():
            return   # a subject we never heard stays unwatched (F2) and counts as never heard (F4)
        self.detector.track(suspect, now_ms, last_heard_ms=now_ms - silent_ms, threshold_ms=flag_after_ms)
        self.watched_on_suspicion.add(suspect)

    def _record_suspicion(self, signer: bytes, suspicion: Suspicion, data: bytes, now_ms: int, out: Ready) -> None:
        suspect, view = suspicion.suspect, self.epochs.view
        if suspect not in view.stakes:
            return
        by = self.suspicions.setdefault(suspect, {})
        by[signer] = data
        self.suspicion_heard_ms.setdefault(suspect, {})[signer] = now_ms
        self._count_confirmations(suspect)
        # SPEC F4: more than 1/3 of the stake, so one Byzantine node below 1/3 cannot evict alone.
        if view.exceeds_one_third(by):
            self.epoch_changes.start(view, now_ms, out)

    def _forget_stale_suspicions(self, now_ms: int) -> None:
        oldest = now_ms - SUSPICION_FRESH_BOUNDS * self.ctx.params.detection_bound_ms
        for suspect, heard in list(self.suspicion_heard_ms.items()):
            for signer in [s for s, at in heard.items() if at < oldest]:
                del heard[signer]
                self.suspicions.get(suspect, {}).pop(signer, None)
                self._count_confirmations(suspect)
            if not heard:
                del self.suspicion_heard_ms[suspect]
                self.suspicions.pop(suspect, None)
                self._unwatch_unless_subject(suspect)

    def _count_confirmations(self, suspect: bytes) -> None:
        """F2a: other members' fresh suspicions of ``suspect`` shrink what our own health adds
        to its threshold (independent confirmations)."""
        others = sum(1 for signer in self.suspicion_heard_ms.get(suspect, ()) if signer != self.ctx.me)
        self.detector.set_confirmations(suspect, others)

    def _unwatch_unless_subject(self, member: bytes) -> None:
        if member in self.watched_on_suspicion:
            self.watched_on_suspicion.discard(member)
            self.refuted.discard(member)
            if member not in self.subjects():
                self.detector.forget(member)

    def suspicion_justification(self, suspect: bytes) -> tuple:
        by = self.suspicions.get(suspect, {})
        stakes = self.epochs.view.stakes
        ranked = sorted(by.items(), key=lambda item: (-stakes.get(item[0], 0), item[0]))
        return tuple(data for _signer, data in ranked[:MAX_SUSPICION_JUSTIFICATION])

    def heard_recently(self, peer: bytes, now_ms: int) -> bool:
        """SPEC F5: a voter refuses to evict a member it has itself heard from within
        min_silence_ms (the suspicion threshold's floor). A node that was only paused, or
        starved for a moment, and whose heartbeat got through meanwhile, is alive: evicting
        it would cost its workloads."""
        return self.ctx.heartbeats and (peer in self.refuted
                                        or self.detector.heard_within(peer, now_ms, self.detector.min_silence_ms))

    def heard_before_eviction(self, peer: bytes, now_ms: int) -> bool:
        """SPEC F4: the leader proposes an eviction only after the suspect has been silent
        for the detection bound plus one heartbeat period. A node paused for P < bound is
        silent for P + up to one period (its last heartbeat may be that old) + the delay
        until it runs again; it is heard by the voters before they are asked."""
        window = self.ctx.params.detection_bound_ms + self.ctx.params.heartbeat_ms
        return self.ctx.heartbeats and (peer in self.refuted or self.detector.heard_within(peer, now_ms, window))

    # --- epochs ----------------------------------------------------------------------------------
    def on_epoch_entered(self, old_view, now_ms: int) -> None:
        self.unheard_since_ms = now_ms
        # A member is watched from its first heartbeat (SPEC F2), a newly admitted one too: it
        # holds no workload yet, and a rejoining node may need a moment to reconnect to all.
        for key in old_view.members:
            if key not in self.epochs.view.stakes:
                self.detector.forget(key)
                self.peer_beat_sent_ms.pop(key, None)
        # F1a: the new membership may give us other subjects; the ones we no longer watch stop
        # heartbeating us, and their silence means nothing now.
        subjects = set(self.subjects())
        for key in self.detector.peers():
            if key not in subjects:
                self.detector.forget(key)
        self.watched_on_suspicion.clear()
        self.refuted.clear()
        self.refute_until_ms = None
        self.suspicions.clear()
        self.suspicion_heard_ms.clear()
        self.suspicion_sent_ms.clear()
        self.suspicion_repeats.clear()
        self.detector.clear_confirmations()

    def on_evicted(self) -> None:
        self.halted, self.fresh_beat_after_ms = False, {}  # nothing left to hold: its jobs moved
        self.halt_gap_ms = None
        for key in self.detector.peers():  # their silence towards a non-member means nothing
            self.detector.forget(key)
