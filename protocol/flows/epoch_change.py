"""The epoch-change flow: how an epoch ends, by an eviction with its migrations or by a
join (SPEC.md F4, F5, F7).

Exactly one instance per epoch, ``epoch_change_instance_id(epoch)``, decides it, so its
agreement, not a race between instances, picks the next epoch's membership. Its leader
proposes evicting the member whose suspicions exceed a third of the stake, else
admitting the pending join of the lowest key. Applying an eviction enters the next
epoch and moves each of the evicted primary's jobs to a live backup with a higher fence.
"""

from __future__ import annotations

import hashlib

from protocol import codec
from protocol.certificate import next_epoch_view
from protocol.errors import RemoteProtocolError
from protocol.flows.base import ValueFlow
from protocol.job_table import TERMINAL
from protocol.liveness import STARTUP_SYNC_PEERS
from protocol.messages import Eviction, Member, MembershipChange, Migration, Suspicion, decode_message
from protocol.placement import tie_break
from protocol.quorum import EpochView
from protocol.ready import Outbound, Ready

MAX_SYNC_CERTIFICATES = 16     # epoch changes a newly admitted member is sent
MAX_MIGRATIONS = 1024          # per eviction value
# An epoch-change instance never gives up (rounds up to the wire's limit, one per
# round_timeout_max_ms at most): it is the only one of its epoch, so an instance given up
# would leave the epoch unable to evict or admit anyone, ever.
EPOCH_CHANGE_MAX_ROUNDS = 1 << 20


def epoch_change_instance_id(epoch: int) -> bytes:
    """SPEC F4: the one instance that decides how ``epoch`` ends, with an eviction or a join."""
    return hashlib.sha256(b"epoch-change" + epoch.to_bytes(8, "big")).digest()


class EpochChangeFlow(ValueFlow):
    value_kind = "eviction"
    value_kinds = ("eviction", "membership")
    max_rounds = EPOCH_CHANGE_MAX_ROUNDS

    def __init__(self, ctx, epochs, jobs, ledger, instances, liveness, joins, apply_certificate_bytes) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.jobs = jobs
        self.ledger = ledger
        self.instances = instances
        self.liveness = liveness
        self.joins = joins
        self.apply_certificate_bytes = apply_certificate_bytes   # the core's: a held future certificate
        self.placement = None   # the PlacementFlow, set by the core: jobs of an epoch entered start
        self.evicted_last_heard_ms: int | None = None   # while an eviction's jobs move: see _apply_eviction
        self.lifecycle = None   # the JobLifecycle, set by the core: a migrated job's new primary admits it (R1)
        self.gang_ranks = None  # the GangReplaceFlow, set by the core: a gang's rank is replaced by decision (GA7)

    def bid_job(self, subject) -> None:
        return None

    def validators(self, iid: bytes) -> tuple:
        return self._eviction_validator(iid), {"membership": self._membership_validator(iid)}

    def start(self, view: EpochView, now_ms: int, out: Ready):
        """Start (or, when it already runs, feed news to) the epoch-change instance of ``view``."""
        iid = epoch_change_instance_id(view.epoch)
        instances = self.instances
        inst = instances.get(iid)  # the common case: called again every tick while suspicions stand
        if inst is None:
            inst = instances.start(iid, self, view.epoch, view, now_ms, out)
        if inst is not None and inst.awaiting_value and iid in instances.instances:
            self._propose(inst, now_ms, out)  # a leader that had nothing to propose
        if (inst is not None and iid in instances.instances and inst.decision is None
                and inst.leader in self.liveness.unresponsive_members(now_ms)):
            # SPEC F4: the round's leader is most often the silent node itself.
            instances.drive(inst, inst.enter_round(inst.round + 1, now_ms), now_ms, out)
        return inst

    def instance_from_proposal(self, proposal, value, view, now_ms: int, out: Ready):
        if epoch_change_instance_id(view.epoch) != proposal.instance:
            raise RemoteProtocolError("%s proposal under a foreign instance id" % proposal.value_kind)
        return self.start(view, now_ms, out)

    def round_on_hold(self, inst, now_ms: int) -> bool:
        """SPEC F4: the current epoch's change, unlocked here, with no member suspected by more
        than 1/3 of the stake (suspicions lapse once not renewed) and no join waiting: there
        is nothing to decide, so its rounds stop changing until there is (before, a suspect
        heard again kept the instance changing rounds for the rest of the epoch)."""
        view = inst.view
        if view.epoch != self.epochs.epoch or inst.locked_round is not None:
            return False
        if any(s in view.stakes and view.exceeds_one_third(by) for s, by in self.liveness.suspicions.items()):
            return False
        return not self.joins.waiting(view)

    # --- the leader's value (SPEC F5, F7) ------------------------------------------------------------
    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        self._propose(inst, now_ms, out)

    def _propose(self, inst, now_ms: int, out: Ready) -> None:
        """Evict the member whose suspicions exceed 1/3 of the stake (the most suspected by
        stake, then the lowest key), else admit the pending join of the lowest key; with
        neither, wait for news (or the round's timeout)."""
        view, liveness = inst.view, self.liveness
        if view.epoch != self.epochs.epoch:
            return
        suspicions = liveness.suspicions
        suspects = [s for s, by in suspicions.items()
                    if s in view.stakes and view.exceeds_one_third(by)
                    and not liveness.heard_before_eviction(s, now_ms)]
        joins = self.joins.waiting(view)
        if suspects:
            suspect = min(suspects, key=lambda s: (-view.stake_of(suspicions[s]), s))
            value, kind = self._eviction_value(suspect, view), "eviction"
            justification = liveness.suspicion_justification(suspect)
        elif joins:
            value = MembershipChange(change="join", member=joins[0].member, epoch=view.epoch + 1,
                                     evidence=joins[0].vouchers)
            kind, justification = "membership", ()
        else:
            return
        self.instances.drive(inst, inst.propose(codec.pack(value.to_body()), justification, now_ms, kind), now_ms,
                             out)

    def _eviction_value(self, suspect: bytes, view: EpochView) -> Eviction:
        """SPEC F5: each job whose primary is the suspect moves to its first backup that is a
        member and not suspected by us; its other backups stay, or a deterministic pick."""
        migrations = []
        suspicions = self.liveness.suspicions
        for record in self.jobs:
            if record.primary != suspect or record.state in TERMINAL + ("pending",):
                continue
            live = [b for b in record.backups if b in view.stakes and b != suspect and b not in suspicions]
            if not live:
                continue
            to_node = live[0]
            migrations.append(Migration(job_id=record.job_id, to_node=to_node,
                                        backups=self._new_backups(record, to_node, suspect, view)))
            if len(migrations) == MAX_MIGRATIONS:
                break
        return Eviction(node=suspect, epoch=view.epoch, migrations=tuple(migrations))

    @staticmethod
    def _new_backups(record, to_node: bytes, suspect: bytes, view: EpochView) -> tuple:
        keep = [b for b in record.backups if b not in (to_node, suspect) and b in view.stakes]
        if keep or not record.backups:
            return tuple(keep)
        # The only backup became primary: pick a fresh one by hash so every node agrees.
        others = [k for k in view.members if k not in (to_node, suspect)]
        if not others:
            return ()
        return (min(others, key=lambda k: tie_break(record.job_id, k)),)

    # --- validators ---------------------------------------------------------------------------------
    def _eviction_validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.get(iid)
            view = inst.view if inst is not None else self.epochs.view
            liveness = self.liveness
            try:
                eviction = Eviction.from_body(codec.unpack(value_bytes))
                signers = set()
                for data in justification:
                    envelope, suspicion = decode_message(data, self.ctx.mesh_id, expect=Suspicion,
                                                         caches=self.ctx.caches)
                    if suspicion.suspect == eviction.node and suspicion.epoch == view.epoch:
                        signers.add(envelope.signer)
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid eviction proposal: %s" % exc
            if epoch_change_instance_id(eviction.epoch) != iid or eviction.epoch != view.epoch:
                return "eviction is for another epoch"
            if eviction.node == self.ctx.me:
                return "an honest node does not vote for its own eviction"
            # Not for a value a prevote quorum already accepted (proven): nodes locked on it
            # could then never agree on another value while the suspect stays audible.
            if not proven and liveness.heard_recently(eviction.node, liveness.last_tick_ms):
                return ("heard from the suspect within the last %d ms: it is alive"
                        % liveness.detector.min_silence_ms)
            if not (view.exceeds_one_third(signers)
                    or view.exceeds_one_third(liveness.suspicions.get(eviction.node, ()))):
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
            record = self.jobs.get(m.job_id)
            if record is not None and record.primary is not None and (
                    record.primary != eviction.node or m.to_node not in record.backups):
                return "migration does not follow the job's placement"
        return None

    def _membership_validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.get(iid)
            view = inst.view if inst is not None else self.epochs.view
            try:
                change = MembershipChange.from_body(codec.unpack(value_bytes))
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid membership proposal: %s" % exc
            if change.change != "join" or epoch_change_instance_id(view.epoch) != iid:
                return "membership change is for another epoch"
            if change.epoch != view.epoch + 1 or change.member.public_key in view.stakes:
                return "membership change does not extend this epoch"
            return self.joins.check_vouchers(change.member, change.evidence, view)
        return validate

    # --- applying a decided change -------------------------------------------------------------------
    def binding_error(self, iid: bytes, value_kind: str, value, epoch: int) -> str | None:
        return self.value_binding_error(iid, value_kind, value, epoch, self.ctx.mesh_id, 0)

    @staticmethod
    def value_binding_error(iid: bytes, value_kind: str, value, epoch: int, mesh_id: bytes,
                            slot_ms: int, caches=None) -> str | None:
        """SPEC F4: an epoch's change is decided by that epoch's one instance, and the value
        names that epoch (an eviction) or the next (a join). Votes sign only the value's
        hash, so this is what binds a certificate's stated kind to what it decided."""
        if iid != epoch_change_instance_id(epoch):
            return "instance is not the change of epoch %d" % epoch
        if value_kind == "eviction" and value.epoch != epoch:
            return "the eviction names epoch %d, not %d" % (value.epoch, epoch)
        if value_kind == "membership" and (value.epoch != epoch + 1 or value.change != "join"):
            return "the membership change does not lead from epoch %d to %d" % (epoch, epoch + 1)
        return None

    def apply(self, iid: bytes, value_kind: str, value, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        if value_kind == "eviction":
            self._apply_eviction(iid, value, certificate, now_ms, out)
        else:
            self._apply_membership(value, certificate, now_ms, out)

    def _enter(self, view: EpochView, certificate: bytes, now_ms: int, out: Ready) -> None:
        old = self.epochs.enter(view, certificate, now_ms, out)
        self.liveness.on_epoch_entered(old, now_ms)

    def _apply_eviction(self, iid: bytes, eviction: Eviction, certificate: bytes, now_ms: int, out: Ready) -> None:
        epochs = self.epochs
        if eviction.epoch != epochs.epoch:
            # One instance decides each epoch's change (SPEC F4), so this is a replayed or
            # relayed certificate of an epoch this node has already left by that same change.
            self.ctx.counters["epoch_change_for_old_epoch"] += 1
            return
        following = next_epoch_view(epochs.view, "eviction", eviction)
        if following is None:  # not a member: validators refuse such a value (a forged quorum)
            self.ctx.counters["eviction_of_non_member"] += 1
            return
        evicted_jobs = [r for r in self.jobs if r.primary == eviction.node and r.state not in TERMINAL]
        completed = [r for r in self.jobs if r.primary == eviction.node and r.state == "completed"]
        # Before entering the new epoch forgets it: when this node last heard the evicted one
        # (the end of the work a job moved here may have lost, P6).
        self.evicted_last_heard_ms = self.liveness.detector.last_heard_ms(eviction.node)
        self._enter(following, certificate, now_ms, out)
        self.move_jobs_of_evicted(evicted_jobs + completed, eviction, following, now_ms, out)
        self.evicted_last_heard_ms = None
        if eviction.node == self.ctx.me:
            for record in evicted_jobs:
                # Only those that moved: a job with no live backup stays ours in every table
                # (F5), and after we rejoin we run it again, so its allocation stays (R1).
                if record.primary != self.ctx.me:
                    self.ledger.free(record.job_id)
            self.joins.evicted_at_epoch = eviction.epoch
            self.joins.rejoin_sent_ms = None
            self.liveness.on_evicted()
            self.instances.drop_all_but(iid)
            out.events.append(self.ctx.event("evicted", now_ms, epoch=epochs.epoch))
        self._after_epoch_change(eviction.epoch + 1, now_ms, out)

    def move_jobs_of_evicted(self, records, eviction: Eviction, view: EpochView, now_ms: int, out: Ready,
                             admit: bool = True) -> None:
        """SPEC F5: each of the evicted primary's jobs moves where the eviction's plan says,
        if the plan names one of the job's backups (voters that knew the job checked that;
        those that did not could not), or else to its first backup that is a member of
        ``view`` (the epoch the eviction created). The same rule replays an eviction for a
        placement decided before it but learnt after it (P5), so both end alike."""
        plan = {m.job_id: m for m in eviction.migrations}
        for record in records:
            if record.primary != eviction.node:
                continue
            if self.gang_ranks is not None and self.gang_ranks.takes(record) and record.state not in TERMINAL:
                self.gang_ranks.await_replacement(record, eviction.node, view, now_ms, out)   # GA7, not F5
                continue
            target = self._migration_target(record, plan.get(record.job_id), eviction.node, view)
            if target is None:
                continue
            if record.state in TERMINAL:
                # A job this node saw complete, that members which missed its exit move: the
                # fence it would get, so the moved run's own exit is recognised (P6).
                self.jobs.remember_primary(record, record.fence + 1, target[0])
            else:
                self._migrate(record, *target, now_ms, out, admit)

    def _migration_target(self, record, planned, evicted: bytes, view: EpochView) -> tuple | None:
        if planned is not None and planned.to_node in record.backups and planned.to_node in view.stakes:
            return planned.to_node, planned.backups
        live = [b for b in record.backups if b in view.stakes]
        return (live[0], self._new_backups(record, live[0], evicted, view)) if live else None

    def _migrate(self, record, to_node: bytes, backups: tuple, now_ms: int, out: Ready, admit: bool = True) -> None:
        """``admit``: the new primary takes the job on now (R1: room now, or it refuses it);
        False while a late placement replays the evictions since (it admits at the end)."""
        self.jobs.assign(record, to_node, backups, fence=record.fence + 1)
        record.migrations += 1
        record.state = "migrating"
        out.events.append(self.ctx.event("migrated", now_ms, job_id=record.job_id.hex(), to_node=to_node.hex(),
                                         fence=record.fence, from_seq=record.last_checkpoint_seq))
        if to_node == self.ctx.me:
            heard, checkpoint = self.evicted_last_heard_ms, record.known_checkpoint
            # At most: it may have worked up to one heartbeat period after it was last heard.
            record.lost_work_ms = (max(0, heard + self.ctx.params.heartbeat_ms - checkpoint[1])
                                   if heard is not None and checkpoint is not None else None)
        if to_node == self.ctx.me and admit:
            record.gpus = ()   # the evicted primary's indices mean nothing here: the ledger picks
            self.lifecycle.admit(record, None, now_ms, out)

    def _apply_membership(self, change: MembershipChange, certificate: bytes, now_ms: int, out: Ready) -> None:
        epochs, joins = self.epochs, self.joins
        if change.epoch != epochs.epoch + 1 or change.change != "join":
            self.ctx.counters["epoch_change_for_old_epoch"] += 1
            return
        key = change.member.public_key
        following = next_epoch_view(epochs.view, "membership", change)
        since = epochs.epoch
        member, known = change.member, epochs.member_info.get(key)
        if not member.addrs and known is not None and known.addrs:
            # A rejoining genesis member's join names no address (a node does not know how
            # it is reached); keep the one we know, or a node restarted later never dials it.
            member = Member(public_key=key, stake=member.stake, zone=member.zone, labels=member.labels,
                            addrs=known.addrs)
        epochs.member_info[key] = member
        pending = joins.pending.pop(key, None)  # before entering: the new epoch re-proposes only the others
        self._enter(following, certificate, now_ms, out)
        if key == self.ctx.me and joins.evicted_at_epoch is not None:
            out.events.append(self.ctx.event("rejoined", now_ms, epoch=epochs.epoch,
                                             evicted_at_epoch=joins.evicted_at_epoch))
            joins.evicted_at_epoch = None
            # What it missed while out (exits above all, F6) it asks for at once, as on a restart.
            self.liveness.sync(now_ms, out, STARTUP_SYNC_PEERS)
        if pending is not None:  # we heard the request: bring the new member up to date
            join, _data = pending
            certificates = epochs.certificates_since(min(join.epoch, since))
            out.messages.extend(Outbound(key, c) for c in certificates[-MAX_SYNC_CERTIFICATES:])
        out.events.append(self.ctx.event("joined", now_ms, key=key.hex(), epoch=epochs.epoch))
        self._after_epoch_change(change.epoch, now_ms, out)

    def _after_epoch_change(self, entered: int, now_ms: int, out: Ready) -> None:
        """Once the change into epoch ``entered`` is wholly applied (migrations included; a
        change applied in the middle of another's would move jobs by a half-updated table):
        the jobs that named that epoch start, that epoch's own change applies if it arrived
        early, and joins still waiting are proposed again."""
        self.placement.start_placements_of_epoch(entered, now_ms, out)
        for waiting in self.epochs.future_certificates.pop(entered, ()):
            # Held unverified (its epoch's view was unknown): the first that verifies applies.
            try:
                self.apply_certificate_bytes(waiting, now_ms, out)
            except RemoteProtocolError:
                self.ctx.counters["bad_future_certificate"] += 1
                continue
            break
        self.joins.carry_pending(entered, now_ms, out)
