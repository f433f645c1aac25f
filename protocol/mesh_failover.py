"""MeshCore's failure handling and epochs: heartbeats, suspicion, eviction with migration,
self-fencing, catch-up sync and joins (SPEC.md section 7, rules F1-F7).
A mixin of protocol.mesh.MeshCore; it only uses state MeshCore.__init__ creates.
"""

from __future__ import annotations

import hashlib

from protocol import codec
from protocol.certificate import next_epoch_view
from protocol.errors import RemoteProtocolError
from protocol.messages import (Attestation, Endorsement, Eviction, Heartbeat, Join, Member, MembershipChange,
                               Migration, Suspicion, SyncRequest, decode_message, encode_message)
from protocol.placement import tie_break
from protocol.quorum import EpochView
from protocol.ready import Outbound, PersistRecord, Ready

MAX_SYNC_CERTIFICATES = 16     # epoch changes sent per sync answer
MAX_EPOCH_CERTIFICATES = 64    # epoch-change certificates kept to answer syncs
MAX_FUTURE_CERTIFICATES = 16   # epochs not reached yet whose certificates are held for later
MAX_HELD_PER_EPOCH = 4         # certificates held per such epoch (unverified until it is reached)
SYNC_ANSWER_GAP_MS = 200       # at most one sync answer per peer per this long
MAX_SUSPICION_JUSTIFICATION = 32
MAX_SYNC_DECISIONS = 32        # recent decisions re-sent to a syncing peer
STARTUP_SYNC_PEERS = 3
ANTI_ENTROPY_MS = 1000
REJOIN_RETRY_MS = 1000         # an evicted node asks a member to readmit it this often
LIVE_JOB_STATES = ("placed", "running", "migrating")
VIEWS_KEPT = 8                 # epoch views a core holds (the newest): older epochs' votes are never read
MAX_PENDING_JOINS = 64         # vouched joins waiting for an epoch change that admits them
EPOCH_CHANGE = ("epoch_change",)  # instance_meta of an epoch-change instance
# An epoch-change instance never gives up (rounds up to the wire's limit, one per
# round_timeout_max_ms at most): it is the only one of its epoch, so an instance given up
# would leave the epoch unable to evict or admit anyone, ever.
EPOCH_CHANGE_MAX_ROUNDS = 1 << 20


def epoch_change_instance_id(epoch: int) -> bytes:
    """SPEC F4: the one instance that decides how ``epoch`` ends, with an eviction or a join.
    One id per epoch, so the instance's agreement, not a race between several instances,
    picks the next epoch's membership."""
    return hashlib.sha256(b"epoch-change" + epoch.to_bytes(8, "big")).digest()


class FailoverFlows:
    def _init_failover(self, now_ms: int) -> None:
        self.last_tick_ms = now_ms
        self.heartbeat_seq = 0
        self.heartbeat_sent_ms: int | None = None
        self.suspicions: dict[bytes, dict[bytes, bytes]] = {}   # suspect -> signer -> Suspicion envelope
        self.suspicion_sent_ms: dict[bytes, int] = {}
        self.halted = False
        self.epoch_certificates: list[tuple[int, bytes]] = []   # (epoch it ended, certificate)
        self.future_certificates: dict[int, list[bytes]] = {}
        self.sync_answered_ms: dict[bytes, int] = {}
        self.joins: dict[bytes, tuple] = {}                      # joining key -> (Join, envelope), until admitted
        self.startup_sync_due = True
        self.sync_sent_ms = now_ms
        self.peer_beat_sent_ms: dict[bytes, int] = {}    # member -> sent_ms of its latest heartbeat
        self.fresh_beat_after_ms: dict[bytes, int] = {}  # while halted: member -> sent_ms that proves news
        self.evicted_at_epoch: int | None = None   # the epoch whose certificate evicted us, until readmitted
        self.rejoin_sent_ms: int | None = None
        self.rejoin_unvouched_said = False
        # Since when members never heard from count as unresponsive leaders (SPEC F4): our
        # start or our entry into the current epoch, whichever came last.
        self.unheard_since_ms = now_ms

    def _my_live_jobs(self) -> tuple:
        return tuple(r.job_id for r in self.job_records.values()
                     if r.primary == self.me and r.state in LIVE_JOB_STATES)

    def _hold_restarted_jobs(self, now_ms: int, out: Ready) -> None:
        """SPEC F3/F6: a (re)started node whose history makes it the primary of live jobs may
        have been evicted while it was down, and its jobs may run elsewhere under a higher
        fence. It starts none of them until a member at its epoch has answered its sync
        (the same wait as self-fencing); with no one to ask, it resumes at once."""
        mine = self._my_live_jobs()
        if not mine or not self.is_member():
            return
        if self.heartbeats and self.broadcast_targets():
            self.halted = True
            out.events.append(self._event("restart_sync", now_ms, epoch=self.epoch, jobs=len(mine)))
        else:
            out.decisions.append(self._local_decision("resume", mine))

    def _startup_sync(self, now_ms: int, out: Ready, peers_asked: int = 3) -> None:
        """SPEC F6: a (re)started node asks a few random members for what it missed while down,
        and every ANTI_ENTROPY_MS one random member (a lost certificate is found again); a few,
        not all, so this costs O(n) messages mesh-wide, not O(n^2)."""
        self.startup_sync_due = False
        self.sync_sent_ms = now_ms
        peers = self.broadcast_targets()
        if not self.is_member() or not peers:
            return
        # A silent member answers nothing: ask among the others (all, if none is left).
        unresponsive = self._unresponsive_members(now_ms)
        peers = [peer for peer in peers if peer not in unresponsive] or peers
        data = encode_message(self.identity, self.mesh_id, SyncRequest(epoch=self.epoch))
        out.messages.extend(Outbound(peer, data) for peer in self.rng.sample(peers, min(peers_asked, len(peers))))

    # --- heartbeats, detection, self-fencing (SPEC F1-F3) ------------------------------------------
    def _tick_failover(self, now_ms: int, out: Ready) -> None:
        gap = now_ms - self.last_tick_ms
        self.last_tick_ms = now_ms
        if self.startup_sync_due:
            self._hold_restarted_jobs(now_ms, out)
            self._startup_sync(now_ms, out, STARTUP_SYNC_PEERS)
        elif now_ms - self.sync_sent_ms >= ANTI_ENTROPY_MS:
            self._startup_sync(now_ms, out, 1)
        if self.evicted_at_epoch is not None and not self.is_member():
            self._maybe_rejoin(now_ms, out)
        if not self.heartbeats or not self.is_member():
            return
        if gap >= self.detector.min_silence_ms - self.params.heartbeat_ms and not self.halted:
            # SPEC F3: we were paused long enough for peers to suspect us (our last heartbeat
            # may be a period older than the pause), so we may have been evicted and our
            # workloads may run elsewhere already. Halt them and ask for the epochs we missed.
            self.halted = True
            # Heartbeats sent while we were stopped wait in our sockets and are read now; the
            # ones sent before the others evicted us must not end the halt. A member's
            # heartbeat counts only if sent (by its own clock) about `gap` after the newest
            # one we had seen: i.e. after we resumed and asked for a sync.
            self.fresh_beat_after_ms = {peer: sent + gap - self.params.heartbeat_ms
                                        for peer, sent in self.peer_beat_sent_ms.items()}
            out.decisions.append(self._local_decision("halt", ()))
            out.events.append(self._event("self_fence_check", now_ms, gap_ms=gap, epoch=self.epoch))
            request = SyncRequest(epoch=self.epoch)
            out.messages.append(Outbound(None, encode_message(self.identity, self.mesh_id, request)))
        if self.heartbeat_sent_ms is None or now_ms - self.heartbeat_sent_ms >= self.params.heartbeat_ms:
            self.heartbeat_sent_ms = now_ms
            self.heartbeat_seq += 1
            beat = Heartbeat(epoch=self.epoch, seq=self.heartbeat_seq, sent_ms=now_ms)
            out.messages.append(Outbound(None, encode_message(self.identity, self.mesh_id, beat)))
        if self.halted:
            return  # a node that may be stale suspects nobody
        for peer, silent_ms in self.detector.suspects(now_ms):
            sent = self.suspicion_sent_ms.get(peer)
            if peer not in self.view.stakes or (sent is not None and now_ms - sent < self.params.detection_bound_ms):
                continue
            self.suspicion_sent_ms[peer] = now_ms
            suspicion = Suspicion(suspect=peer, epoch=self.epoch, silent_ms=silent_ms)
            data = encode_message(self.identity, self.mesh_id, suspicion)
            out.messages.append(Outbound(None, data))
            out.events.append(self._event("suspect", now_ms, suspect=peer.hex(), silent_ms=silent_ms))
            self._record_suspicion(self.me, suspicion, data, now_ms, out)
        if any(s in self.view.stakes and self.view.exceeds_one_third(by) for s, by in self.suspicions.items()):
            # A leader holds an eviction back until the suspect was silent for the whole
            # bound and a heartbeat period (_heard_before_eviction): offer it the value again.
            self._start_epoch_change(self.view, now_ms, out)
        self._skip_unresponsive_leaders(now_ms, out)

    def _unresponsive_members(self, now_ms: int) -> set[bytes]:
        """SPEC F4: the members whose rounds we skip: suspected ones, and, once a suspicion
        threshold has passed since we started or entered this epoch, the ones never heard at all
        (not suspected: see F2; a silent node's rounds would otherwise each cost a timeout)."""
        if not self.heartbeats or self.halted or not self.is_member():
            return set()
        # A halted node suspects nobody (F3): after its pause every peer looks silent to it.
        suspected = {peer for peer, _silent in self.detector.suspects(now_ms)}
        unheard = {key for key in self.view.members if key != self.me and not self.detector.is_watched(key)}
        heard_stake = self.view.total_stake - self.view.stake_of(suspected | unheard)
        if not self.view.is_quorum_stake(heard_stake):
            # We hear less than a quorum: most likely we are the one cut off, and skipping
            # rounds would only race us ahead of the members we cannot hear, whose round
            # changes then never meet ours (a partition in the sweep left a node 30 rounds ahead).
            return set()
        if now_ms - self.unheard_since_ms < self.detector.suspect_by_ms:
            return suspected
        return suspected | unheard

    def _skip_unresponsive_leaders(self, now_ms: int, out: Ready) -> None:
        """SPEC F4: waiting for an unresponsive leader's proposal would only cost its round's
        timeout; entering the next round is always safe (it signs nothing), and the
        announcement counts towards the next leader's quorum of round changes (6.5)."""
        unresponsive = self._unresponsive_members(now_ms)
        if self.halted or not self.is_member():
            return
        # An instance still running in an earlier epoch whose round's leader has since left
        # the mesh (evicted): most often dead. (An evicted node that is alive may still vote
        # there, F7; skipping its rounds costs no safety, and it keeps its votes.)
        if not unresponsive and self.epoch == 0:
            return
        skip = [i for i in self.instances.values()
                if i.leader in unresponsive or (i.view.epoch < self.epoch and i.leader not in self.view.stakes)]
        for inst in skip:
            if inst.decision is None and not inst.gave_up and self.instances.get(inst.instance_id) is inst:
                self._drive(inst, inst.enter_round(inst.round + 1, now_ms), now_ms, out)

    def _on_heartbeat(self, envelope, beat: Heartbeat, data, now_ms: int, out: Ready) -> None:
        signer = envelope.signer
        if beat.epoch < self.epoch or signer not in self.view.stakes:
            self.counters["heartbeat_stale"] += 1
            self._answer_sync(signer, beat.epoch, now_ms, out)  # tell it what it missed (maybe its eviction)
            return
        self.detector.heartbeat(signer, now_ms)
        fresh = beat.sent_ms >= self.fresh_beat_after_ms.get(signer, beat.sent_ms)
        # The latest, not the greatest: a restarted peer's clock may start anywhere.
        self.peer_beat_sent_ms[signer] = beat.sent_ms
        if self.halted and fresh and beat.epoch >= self.epoch and self.is_member():
            # SPEC F3: a current peer's heartbeat after catching up: we were not evicted.
            self.halted = False
            self.fresh_beat_after_ms = {}
            out.decisions.append(self._local_decision("resume", self._my_live_jobs()))
            out.events.append(self._event("self_fence_clear", now_ms, epoch=self.epoch))

    def _on_sync_request(self, envelope, request: SyncRequest, data, now_ms: int, out: Ready) -> None:
        self._answer_sync(envelope.signer, request.epoch, now_ms, out)
        if envelope.signer in self.view.stakes and request.epoch >= self.epoch:
            beat = Heartbeat(epoch=self.epoch, seq=self.heartbeat_seq, sent_ms=now_ms)
            out.messages.append(Outbound(envelope.signer, encode_message(self.identity, self.mesh_id, beat)))

    def _answer_sync(self, peer: bytes, since_epoch: int, now_ms: int, out: Ready) -> None:
        last = self.sync_answered_ms.get(peer)
        if last is not None and now_ms - last < SYNC_ANSWER_GAP_MS:
            return
        certificates = [c for e, c in self.epoch_certificates if e >= since_epoch][:MAX_SYNC_CERTIFICATES]
        if peer in self.view.stakes:
            # A member that was down may have missed placements too: the newest certificates we
            # applied, however they reached us (our own instance, a broadcast or a catch-up).
            sent = set(certificates)
            certificates.extend(c for c in list(self.recent_certificates.values())[-MAX_SYNC_DECISIONS:]
                                if c not in sent)
        if not certificates:
            return
        if len(self.sync_answered_ms) > 4096:
            self.sync_answered_ms.clear()
        self.sync_answered_ms[peer] = now_ms
        out.messages.extend(Outbound(peer, c) for c in certificates)

    # --- suspicion and eviction (SPEC F4-F5) -------------------------------------------------------
    def _on_suspicion(self, envelope, suspicion: Suspicion, data, now_ms: int, out: Ready) -> None:
        if envelope.signer not in self.view.stakes or suspicion.epoch != self.epoch:
            self.counters["suspicion_stale"] += 1
            return
        self._record_suspicion(envelope.signer, suspicion, data, now_ms, out)

    def _record_suspicion(self, signer: bytes, suspicion: Suspicion, data: bytes, now_ms: int, out: Ready) -> None:
        suspect = suspicion.suspect
        if suspect not in self.view.stakes:
            return
        by = self.suspicions.setdefault(suspect, {})
        by.setdefault(signer, data)
        # SPEC F4: more than 1/3 of the stake, so one Byzantine node below 1/3 cannot evict alone.
        if self.view.exceeds_one_third(by):
            self._start_epoch_change(self.view, now_ms, out)

    def _start_epoch_change(self, view: EpochView, now_ms: int, out: Ready):
        """Start (or, when it already runs, feed news to) the epoch-change instance of ``view``:
        one per epoch, deciding an eviction or a join (SPEC F4, F5, F7)."""
        iid = epoch_change_instance_id(view.epoch)
        inst = self.instances.get(iid)  # the common case: called again every tick while suspicions stand
        if inst is None:
            inst = self._start_instance(iid, "eviction", view, EPOCH_CHANGE, self._eviction_validator(iid), now_ms,
                                        out, other_kinds={"membership": self._membership_validator(iid)},
                                        max_rounds=EPOCH_CHANGE_MAX_ROUNDS)
        if inst is not None and inst.awaiting_value and iid in self.instances:
            self._propose_epoch_change(inst, EPOCH_CHANGE, now_ms, out)  # a leader that had nothing to propose
        if (inst is not None and iid in self.instances and inst.decision is None
                and inst.leader in self._unresponsive_members(now_ms)):
            # SPEC F4: the round's leader is most often the silent node itself.
            self._drive(inst, inst.enter_round(inst.round + 1, now_ms), now_ms, out)
        return inst

    def _suspicion_justification(self, suspect: bytes) -> tuple:
        by = self.suspicions.get(suspect, {})
        ranked = sorted(by.items(), key=lambda item: (-self.view.stakes.get(item[0], 0), item[0]))
        return tuple(data for _signer, data in ranked[:MAX_SUSPICION_JUSTIFICATION])

    def _eviction_value(self, suspect: bytes, view: EpochView) -> Eviction:
        """SPEC F5: each job whose primary is the suspect moves to its first backup that is a
        member and not suspected by us; its other backups stay, or a deterministic pick."""
        migrations = []
        for record in self.job_records.values():
            if record.primary != suspect or record.state in ("completed", "failed", "cancelled", "pending"):
                continue
            live = [b for b in record.backups if b in view.stakes and b != suspect and b not in self.suspicions]
            if not live:
                continue
            to_node = live[0]
            migrations.append(Migration(job_id=record.job_id, to_node=to_node,
                                        backups=self._new_backups(record, to_node, suspect, view)))
            if len(migrations) == 1024:
                break
        return Eviction(node=suspect, epoch=view.epoch, migrations=tuple(migrations))

    def _new_backups(self, record, to_node: bytes, suspect: bytes, view: EpochView) -> tuple:
        keep = [b for b in record.backups if b not in (to_node, suspect) and b in view.stakes]
        if keep or not record.backups:
            return tuple(keep)
        # The only backup became primary: pick a fresh one by hash so every node agrees.
        others = [k for k in view.members if k not in (to_node, suspect)]
        if not others:
            return ()
        return (min(others, key=lambda k: tie_break(record.job_id, k)),)

    def _propose_epoch_change(self, inst, meta: tuple, now_ms: int, out: Ready) -> None:
        """SPEC F5, F7: the leader proposes evicting the member whose suspicions exceed 1/3 of the
        stake (the most suspected by stake, then the lowest key), else admitting the pending join
        of the lowest key; with neither it waits for news (or the round's timeout)."""
        view = inst.view
        if meta != EPOCH_CHANGE or view.epoch != self.epoch:
            return
        suspects = [s for s, by in self.suspicions.items()
                    if s in view.stakes and view.exceeds_one_third(by) and not self._heard_before_eviction(s, now_ms)]
        joins = [self.joins[k][0] for k in sorted(self.joins) if k not in view.stakes]
        if suspects:
            suspect = min(suspects, key=lambda s: (-view.stake_of(self.suspicions[s]), s))
            value, kind = self._eviction_value(suspect, view), "eviction"
            justification = self._suspicion_justification(suspect)
        elif joins:
            value = MembershipChange(change="join", member=joins[0].member, epoch=view.epoch + 1,
                                     evidence=joins[0].vouchers)
            kind, justification = "membership", ()
        else:
            return
        self._drive(inst, inst.propose(codec.pack(value.to_body()), justification, now_ms, kind), now_ms, out)

    def _heard_recently(self, peer: bytes, now_ms: int) -> bool:
        """SPEC F5: a voter refuses to evict a member it has itself heard from within
        min_silence_ms (the suspicion threshold's floor). A node that was only paused, or
        starved for a moment, and whose heartbeat got through meanwhile, is alive: evicting
        it would cost its workloads."""
        return self.heartbeats and self.detector.heard_within(peer, now_ms, self.detector.min_silence_ms)

    def _heard_before_eviction(self, peer: bytes, now_ms: int) -> bool:
        """SPEC F4: the leader proposes an eviction only after the suspect has been silent
        for the detection bound plus one heartbeat period. A node paused for P < bound is
        silent for P + up to one period (its last heartbeat may be that old) + the delay
        until it runs again; it is heard by the voters before they are asked."""
        window = self.params.detection_bound_ms + self.params.heartbeat_ms
        return self.heartbeats and self.detector.heard_within(peer, now_ms, window)

    def _eviction_validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.get(iid)
            view = inst.view if inst is not None else self.view
            try:
                eviction = Eviction.from_body(codec.unpack(value_bytes))
                signers = set()
                for data in justification:
                    envelope, suspicion = decode_message(data, self.mesh_id, expect=Suspicion)
                    if suspicion.suspect == eviction.node and suspicion.epoch == view.epoch:
                        signers.add(envelope.signer)
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid eviction proposal: %s" % exc
            if epoch_change_instance_id(eviction.epoch) != iid or eviction.epoch != view.epoch:
                return "eviction is for another epoch"
            if eviction.node == self.me:
                return "an honest node does not vote for its own eviction"
            # Not for a value a prevote quorum already accepted (proven): nodes locked on it
            # could then never agree on another value while the suspect stays audible.
            if not proven and self._heard_recently(eviction.node, self.last_tick_ms):
                return "heard from the suspect within the last %d ms: it is alive" % self.detector.min_silence_ms
            if not (view.exceeds_one_third(signers) or view.exceeds_one_third(self.suspicions.get(eviction.node, ()))):
                return "suspicions do not exceed 1/3 of the stake"
            return self._check_migrations(eviction, view)
        return validate

    def _check_migrations(self, eviction: Eviction, view: EpochView) -> str | None:
        seen = set()
        for m in eviction.migrations:
            if m.job_id in seen:
                return "a job migrates twice"
            seen.add(m.job_id)
            if m.to_node not in view.stakes or m.to_node == eviction.node:
                return "migration to a non-member or to the evicted node"
            if len(set(m.backups)) != len(m.backups) or any(
                    b not in view.stakes or b in (m.to_node, eviction.node) for b in m.backups):
                return "migration backups invalid"
            record = self.job_records.get(m.job_id)
            if record is not None and record.primary is not None and (
                    record.primary != eviction.node or m.to_node not in record.backups):
                return "migration does not follow the job's placement"
        return None

    def _eviction_instance_from_value(self, iid: bytes, eviction: Eviction, view: EpochView, now_ms: int, out: Ready):
        if epoch_change_instance_id(view.epoch) != iid:
            raise RemoteProtocolError("eviction proposal under a foreign instance id")
        return self._start_epoch_change(view, now_ms, out)

    def _apply_eviction(self, iid: bytes, eviction: Eviction, certificate: bytes, now_ms: int, out: Ready) -> None:
        if eviction.epoch != self.epoch:
            # One instance decides each epoch's change (SPEC F4), so this is a replayed or
            # relayed certificate of an epoch this node has already left by that same change.
            self.counters["epoch_change_for_old_epoch"] += 1
            return
        following = next_epoch_view(self.view, "eviction", eviction)
        if following is None:  # not a member: validators refuse such a value (a forged quorum)
            self.counters["eviction_of_non_member"] += 1
            return
        evicted_jobs = [r for r in self.job_records.values() if r.primary == eviction.node
                        and r.state not in ("completed", "failed", "cancelled")]
        self._enter_epoch(following, certificate, now_ms, out)
        self._move_jobs_of_evicted(evicted_jobs, eviction, following, now_ms, out)
        if eviction.node == self.me:
            for record in evicted_jobs:
                self.book.free(record.job_id)
            self.evicted_at_epoch = eviction.epoch
            self.rejoin_sent_ms = None
            self.halted, self.fresh_beat_after_ms = False, {}  # nothing left to hold: its jobs moved
            for key in self.detector.peers():  # their silence towards a non-member means nothing
                self.detector.forget(key)
            self._drop_instances(keep=iid)
            out.events.append(self._event("evicted", now_ms, epoch=self.epoch))
        self._after_epoch_change(eviction.epoch + 1, now_ms, out)

    def _move_jobs_of_evicted(self, records, eviction: Eviction, view: EpochView, now_ms: int, out: Ready) -> None:
        """SPEC F5: each of the evicted primary's jobs moves where the eviction's plan says,
        if the plan names one of the job's backups (voters that knew the job checked that;
        those that did not could not), or else to its first backup that is a member of
        ``view`` (the epoch the eviction created). The same rule replays an eviction for a
        placement decided before it but learnt after it (P5), so both end alike."""
        plan = {m.job_id: m for m in eviction.migrations}
        for record in records:
            if record.primary != eviction.node:
                continue
            planned = plan.get(record.job_id)
            if planned is not None and planned.to_node in record.backups and planned.to_node in view.stakes:
                self._migrate(record, planned.to_node, planned.backups, now_ms, out)
                continue
            live = [b for b in record.backups if b in view.stakes]
            if live:
                self._migrate(record, live[0], self._new_backups(record, live[0], eviction.node, view), now_ms, out)

    def _after_epoch_change(self, entered: int, now_ms: int, out: Ready) -> None:
        """Once the change into epoch ``entered`` is wholly applied (migrations included; a
        change applied in the middle of another's would move jobs by a half-updated table):
        the jobs that named that epoch start, that epoch's own change applies if it arrived
        early, and joins still waiting are proposed again."""
        self._start_placements_of_epoch(entered, now_ms, out)
        for waiting in self.future_certificates.pop(entered, ()):
            # Held unverified (its epoch's view was unknown): the first that verifies applies.
            try:
                self._apply_certificate_bytes(waiting, now_ms, out)
            except RemoteProtocolError:
                self.counters["bad_future_certificate"] += 1
                continue
            break
        self._carry_pending_joins(entered, now_ms, out)

    def _drop_instances(self, keep: bytes) -> None:
        """An evicted node drops the open instances only it runs: they would only time out
        and broadcast round changes. It keeps those other members take part in: they run in
        an epoch where its stake still counts, and without its votes and round changes the
        rest may hold no quorum there (the 10,000-seed sweep stalled on exactly that)."""
        for iid in [i for i in self.instances if i != keep]:
            inst = self.instances[iid]
            if self.me in inst.view.stakes and inst.heard_from_others:
                continue
            if self.instance_meta.get(iid, ("?",))[0] == "placement_slot":
                self._release_slot_bids(iid)
            self._forget_instance(iid)
            self.instance_meta.pop(iid, None)
            self.instance_round.pop(iid, None)
            self.book.release(iid)
            self.my_bids.pop(iid, None)
            self.bids_held.pop(iid, None)
            self.windows_open.pop(iid, None)
            self.windows_extended.discard(iid)

    def _migrate(self, record, to_node: bytes, backups: tuple, now_ms: int, out: Ready) -> None:
        record.primary, record.backups = to_node, tuple(backups)
        record.fence += 1
        record.migrations += 1
        record.state = "migrating"
        if to_node == self.me:
            claim = self.book.allocate_now(record.job_id, record.manifest.resources)
            record.gpus = claim.gpus if claim is not None else ()
            if claim is None:
                out.events.append(self._event("capacity_short", now_ms, job_id=record.job_id.hex()))
        out.events.append(self._event("migrated", now_ms, job_id=record.job_id.hex(), to_node=to_node.hex(),
                                      fence=record.fence, from_seq=record.last_checkpoint_seq))

    def _enter_epoch(self, view: EpochView, certificate: bytes, now_ms: int, out: Ready) -> None:
        old = self.view
        self.epoch_certificates.append((old.epoch, certificate))
        del self.epoch_certificates[:-MAX_EPOCH_CERTIFICATES]
        self.view = view
        self.views[view.epoch] = view
        self.unheard_since_ms = now_ms
        for epoch in sorted(self.views)[:-VIEWS_KEPT]:
            del self.views[epoch]
        # A member is watched from its first heartbeat (SPEC F2), a newly admitted one too: it
        # holds no workload yet, and a rejoining node may need a moment to reconnect to all.
        for key in old.members:
            if key not in view.stakes:
                self.detector.forget(key)
                self.peer_beat_sent_ms.pop(key, None)
        self.suspicions.clear()
        self.suspicion_sent_ms.clear()
        out.persist.append(PersistRecord("membership", str(view.epoch), {"epoch": view.epoch,
                                                                         "certificate": certificate}))
        out.events.append(self._event("epoch", now_ms, epoch=view.epoch, members=len(view.members)))

    def _carry_pending_joins(self, entered: int, now_ms: int, out: Ready) -> None:
        """SPEC F7: a join that lost its epoch's change to another one (an eviction, another
        join) is proposed again in the new epoch, while its vouchers still hold there. Called
        once the change is fully applied (migrations too), unless a held certificate has
        already moved this node past the epoch it entered."""
        if self.epoch != entered:
            return
        for key, (join, _data) in list(self.joins.items()):
            if key in self.view.stakes or self._check_vouchers(join.member, join.vouchers, self.view) is not None:
                del self.joins[key]
        if self.joins and self.is_member():
            self._start_epoch_change(self.view, now_ms, out)

    def _hold_future_certificate(self, epoch: int, signer: bytes, data: bytes) -> None:
        """Keep a certificate of an epoch not reached yet (it cannot be verified before): from
        members only, at most MAX_HELD_PER_EPOCH per epoch, so a bad one held first cannot
        shut out the real one."""
        held = self.future_certificates.get(epoch)
        if signer not in self.view.stakes:
            self.counters["future_certificate_from_non_member"] += 1
        elif held is None and len(self.future_certificates) >= MAX_FUTURE_CERTIFICATES:
            self.counters["future_certificates_full"] += 1
        elif held is None:
            self.future_certificates[epoch] = [data]
        elif data not in held and len(held) < MAX_HELD_PER_EPOCH:
            held.append(data)

    # --- joins (SPEC F7) -----------------------------------------------------------------------------
    def _vouched_stake(self) -> int:
        """The stake an authority attestation in this node's policy vouches for (0: none)."""
        stake = 0
        for data in self.policy.attestations:
            try:
                envelope, attestation = decode_message(data, self.mesh_id, expect=Attestation, allow_any_mesh=True)
            except RemoteProtocolError:
                continue
            if envelope.signer in self.authorities and attestation.subject == self.me:
                stake = max(stake, attestation.stake)
        return stake

    def request_join(self, bootstrap_key: bytes, now_ms: int) -> Ready:
        """Ask ``bootstrap_key`` to propose this node as a member. Stake comes only from the
        vouchers: authority attestations in this node's policy."""
        return Ready(messages=[Outbound(bootstrap_key, self._join_envelope(max(1, self._vouched_stake())))])

    def _join_envelope(self, stake: int) -> bytes:
        member = Member(public_key=self.me, stake=stake, zone=self.policy.zone, labels=self.policy.labels,
                        addrs=())
        join = Join(member=member, epoch=self.epoch, vouchers=tuple(self.policy.attestations[:16]))
        return encode_message(self.identity, self.mesh_id, join)

    def _maybe_rejoin(self, now_ms: int, out: Ready) -> None:
        """SPEC F7 rejoin: an honest node evicted while it looked dead (a crash, a long pause
        or partition) asks one member at a time, every REJOIN_RETRY_MS, to readmit it through
        the ordinary join path, with the stake its authority attestation vouches for. It has
        heard the mesh again by then: that is how it learned of its eviction."""
        if self.rejoin_sent_ms is not None and now_ms - self.rejoin_sent_ms < REJOIN_RETRY_MS:
            return
        self.rejoin_sent_ms = now_ms
        peers = self.broadcast_targets()
        stake = self._vouched_stake()
        if stake == 0:
            if not self.rejoin_unvouched_said:
                self.rejoin_unvouched_said = True
                out.events.append(self._event("rejoin_unvouched", now_ms, epoch=self.evicted_at_epoch))
            return
        if not peers:
            return
        peer = self.rng.choice(peers)
        out.messages.append(Outbound(peer, self._join_envelope(stake)))
        out.events.append(self._event("rejoin_requested", now_ms, via=peer.hex(), stake=stake,
                                      evicted_at_epoch=self.evicted_at_epoch))

    def _on_join(self, envelope, join: Join, data, now_ms: int, out: Ready) -> None:
        if envelope.signer != join.member.public_key:
            self.counters["join_not_self_signed"] += 1
            return
        if not self.is_member() or join.member.public_key in self.view.stakes:
            self.counters["join_ignored"] += 1
            return
        reason = self._check_vouchers(join.member, join.vouchers, self.view)
        if reason is not None:
            self.counters["join_unvouched"] += 1
            out.events.append(self._event("join_refused", now_ms, key=join.member.public_key.hex(), reason=reason))
            return
        key = join.member.public_key
        if key in self.joins:
            return  # relayed already; it stays pending, epoch after epoch, until admitted
        if len(self.joins) >= MAX_PENDING_JOINS:
            self.counters["joins_full"] += 1
            return
        self.joins[key] = (join, data)
        out.messages.append(Outbound(None, data))  # relay once, so every member knows it is pending
        self._start_epoch_change(self.view, now_ms, out)

    def _check_vouchers(self, member: Member, vouchers: tuple, view: EpochView) -> str | None:
        """SPEC F7: an authority attestation with at least the stake, or endorsements from
        members of this epoch whose own stake sums to at least it. A key never vouches for itself."""
        endorsers = set()
        for data in vouchers:
            try:
                envelope, message = decode_message(data, self.mesh_id, allow_any_mesh=True)
            except RemoteProtocolError:
                continue
            if envelope.signer == member.public_key:
                continue
            if isinstance(message, Attestation):
                if (envelope.signer in self.authorities and message.subject == member.public_key
                        and message.stake >= member.stake):
                    return None
            elif isinstance(message, Endorsement) and envelope.mesh_id == self.mesh_id:
                if (message.candidate == member.public_key and message.epoch == view.epoch
                        and message.stake == member.stake and envelope.signer in view.stakes):
                    endorsers.add(envelope.signer)
        if view.stake_of(endorsers) >= member.stake:
            return None
        return "stake %d is not vouched for by an authority or by endorsing members" % member.stake

    def _membership_validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.get(iid)
            view = inst.view if inst is not None else self.view
            try:
                change = MembershipChange.from_body(codec.unpack(value_bytes))
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid membership proposal: %s" % exc
            if change.change != "join" or epoch_change_instance_id(view.epoch) != iid:
                return "membership change is for another epoch"
            if change.epoch != view.epoch + 1 or change.member.public_key in view.stakes:
                return "membership change does not extend this epoch"
            return self._check_vouchers(change.member, change.evidence, view)
        return validate

    def _membership_instance_from_value(self, iid: bytes, change: MembershipChange, view: EpochView, now_ms: int,
                                        out: Ready):
        if epoch_change_instance_id(view.epoch) != iid:
            raise RemoteProtocolError("membership proposal under a foreign instance id")
        return self._start_epoch_change(view, now_ms, out)

    def _apply_membership(self, iid: bytes, change: MembershipChange, certificate: bytes, now_ms: int,
                          out: Ready) -> None:
        if change.epoch != self.epoch + 1 or change.change != "join":
            self.counters["epoch_change_for_old_epoch"] += 1
            return
        key = change.member.public_key
        following = next_epoch_view(self.view, "membership", change)
        since = self.epoch
        member, known = change.member, self.member_info.get(key)
        if not member.addrs and known is not None and known.addrs:
            # A rejoining genesis member's join names no address (a node does not know how
            # it is reached); keep the one we know, or a node restarted later never dials it.
            member = Member(public_key=key, stake=member.stake, zone=member.zone, labels=member.labels,
                            addrs=known.addrs)
        self.member_info[key] = member
        pending = self.joins.pop(key, None)  # before entering: the new epoch re-proposes only the others
        self._enter_epoch(following, certificate, now_ms, out)
        if key == self.me and self.evicted_at_epoch is not None:
            out.events.append(self._event("rejoined", now_ms, epoch=self.epoch, evicted_at_epoch=self.evicted_at_epoch))
            self.evicted_at_epoch = None
        if pending is not None:  # we heard the request: bring the new member up to date
            join, _data = pending
            certificates = [c for e, c in self.epoch_certificates if e >= min(join.epoch, since)]
            out.messages.extend(Outbound(key, c) for c in certificates[-MAX_SYNC_CERTIFICATES:])
        out.events.append(self._event("joined", now_ms, key=key.hex(), epoch=self.epoch))
        self._after_epoch_change(change.epoch, now_ms, out)
