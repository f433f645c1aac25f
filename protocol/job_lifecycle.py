"""A placed job's life (SPEC.md P6): the job becomes its primary's (the ledger's
allocation, or its refusal), the workload starts, checkpoints stream from the primary to
its backups (each acked), and the job ends by an exit (a failed job within its retries is
placed afresh, by a new instance) or by its owner's cancel.

A node that a placement or a migration makes a job's primary takes it only if its ledger
holds it (R1): the bid's reservation, or room now. Otherwise it refuses it: a signed
``job_refusal`` at the job's fence, and every node places the job afresh, by a new
instance that does not use up a retry (messages/jobs.py, ``next_attempt``). The refusing
node never runs it.

Exits, refusals and cancels are no certificates: the newest per job is persisted (table
``jobs``) and replayed after a restart through the same checks as when it arrived.
"""

from __future__ import annotations

import hashlib

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.job_table import FENCE_PER_ATTEMPT, TERMINAL
from protocol.messages import (Cancel, Checkpoint, CheckpointAck, JobExit, JobRefusal, RunStopped,
                               attempt_failures, decode_message, next_attempt)
from protocol.ready import Outbound, PersistRecord, Ready, local_decision

HANDOFF_WAIT_MS = 250   # how long a job's next primary after a refusal waits for a checkpoint (R1)
# How long a node that preempted a victim holds back its hand-over for the final checkpoint
# (P8d): within the HANDOFF_WAIT_MS the victim's next primary waits, so that a node without
# one (no driver reading it) still hands over its newest periodic checkpoint in time.
FINAL_CHECKPOINT_WAIT_MS = 100
# R2a: how often a moved job's old primary sends its hand-over again while the new primary's
# vector does not show the new run (a lost message, or the new primary restarted).
MOVE_HANDOVER_RESEND_MS = 1000
# 6.9a: at most this many of its own replayed outcomes a restarted node broadcasts again.
MAX_OWN_OUTCOMES_RESENT = 16


def same_work(fence: int, attempt: int, job) -> bool:
    """Whether a checkpoint taken under ``fence`` is of the work ``attempt`` continues: an
    attempt at or after the checkpoint's that no failed exit separates from it (a refusal
    starts an attempt that goes on with the same work; a failure starts it afresh, P6)."""
    taken_in = fence // FENCE_PER_ATTEMPT
    return taken_in <= attempt and attempt_failures(taken_in, job) == attempt_failures(attempt, job)


def resumes_from_checkpoint(record) -> bool:
    """The workload order's ``resume`` (workload_orders.py): a migration goes on from the
    node's newest checkpoint; a fresh attempt does only if that checkpoint is of the same
    work (an attempt started by a refusal, R1), never after a failed exit (P6)."""
    if not (record.state == "placed" and record.attempt > 0):
        return True
    return record.checkpoint_fence is not None and same_work(record.checkpoint_fence, record.attempt, record.manifest)


def replaced_run_fence(record) -> int:
    """GA7, GA11: the fence of the run a gang rank's replacement replaces. The eviction took the
    rank one fence up (``replacing``), the replacement one more (``migrating``)."""
    return record.fence - 2


class JobLifecycle:
    def __init__(self, ctx, epochs, jobs, ledger, placement) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.jobs = jobs
        self.ledger = ledger
        self.placement = placement   # a failed job within its retries is placed again
        self.gangs = None            # the GangFlow, set by the core: a gang's ranks end together (GA4)
        self.deferred = False        # True while the core replays its history after a restart
        # Jobs this node was made the primary of after a refusal, holding no checkpoint of
        # their work: job id -> when it stops waiting for one to be handed over (R1). Not run
        # while waiting (workload_orders.py).
        self.handoff_waits: dict[bytes, int] = {}
        # Victims this node refused for a preemption (P8d): job id -> (the fence it ran them
        # under, until when it holds back their R1 hand-over for the final checkpoint its
        # driver reads as it stops the run).
        self.preempted_here: dict[bytes, tuple[int, int]] = {}
        # R2a, the new primary of a moved job: job id -> (fence, node) whose run must be known
        # stopped before this node starts its own (no deadline: the hand-over, or that node
        # leaving the epoch). Not run while waiting (workload_orders.py).
        self.stop_waits: dict[bytes, tuple] = {}   # job id -> (fence, node, the seq its run_stopped names or None)
        # R2a, the old primary: job id -> [fence, the hand-over once its run stopped (None
        # before), when it is sent again]. Set by the core: what the workload orders run here
        # (job id -> fence), and whether a node's newest vector shows a job running at a fence.
        self.handovers: dict[bytes, list] = {}
        self.ordered: dict[bytes, int] = {}
        self.seen_running = lambda node, jid, fence: False
        # 6.9a: the exits, refusals and cancels this node signed, replayed after a restart:
        # broadcast again once its restart sync is sent (the crash may have cut their broadcast).
        self.own_outcomes_replayed: list[bytes] = []

    # --- taking a job on (SPEC.md R1) ------------------------------------------------------------
    def admit(self, record, key: bytes | None, now_ms: int, out: Ready) -> bool:
        """This node is the job's primary now (a placement, ``key`` its placement key, or a
        migration, ``key`` None): allocate it from the bid's reservation or from what is
        free now, or refuse it. While the core rebuilds itself after a restart (``deferred``)
        nothing is allocated: the ledger is rebuilt from the final job table then."""
        if self.deferred:
            return True
        claim = self.ledger.take_on(key, record.job_id, record.manifest.resources, prefer=tuple(record.gpus))
        if claim is not None:
            record.gpus = claim.gpus   # what this node runs it on (a migration's own pick)
            if key is not None and (self._work_done_elsewhere(record) or self._preempted_elsewhere(record)):
                self.handoff_waits[record.job_id] = now_ms + HANDOFF_WAIT_MS
            return True
        self.refuse(record, now_ms, out)
        return False

    @staticmethod
    def _work_done_elsewhere(record) -> bool:
        """R1: this attempt goes on with work an earlier attempt was placed for (it was
        refused since), and this node holds no checkpoint of it."""
        if record.checkpoint_fence is not None and same_work(record.checkpoint_fence, record.attempt, record.manifest):
            return False
        return any(fence // FENCE_PER_ATTEMPT < record.attempt and same_work(fence, record.attempt, record.manifest)
                   for fence in record.primaries)

    def _preempted_elsewhere(self, record) -> bool:
        """P8d: this attempt follows one another node preempted, of the same work: that node
        hands over the final checkpoint it took as it stopped the run, newer than any
        periodic one this node may hold as a backup, so this node waits for it too."""
        preempted = record.preempted_by
        if preempted is None or not record.attempt or preempted[1] // FENCE_PER_ATTEMPT != record.attempt - 1:
            return False
        fence = preempted[1]
        return record.primaries.get(fence) not in (None, self.ctx.me) and same_work(fence, record.attempt,
                                                                                    record.manifest)

    def hand_off_checkpoint(self, record, out: Ready) -> None:
        """R1: a new attempt of a job was placed: the newest checkpoint this node holds of the
        work it goes on with, as its primary signed it, goes to the attempt's primary and
        backups (a backup may become the primary before the new run checkpoints)."""
        data, fence = record.checkpoint_envelope, record.checkpoint_fence
        if record.job_id in self.preempted_here:
            return   # held back for the final checkpoint (P8d): sent when it comes, or in time without
        if data is None or record.primary is None or not same_work(fence, record.attempt, record.manifest):
            return
        for target in (record.primary, *record.backups):
            if target != self.ctx.me:
                self.ctx.counters["checkpoint_handed_off"] += 1
                out.messages.append(Outbound(target, data))

    def next_wait_ms(self) -> int | None:
        """When ``end_handoff_waits`` next has one to end (None: none awaited)."""
        dues = list(self.handoff_waits.values()) + [due for _fence, due in self.preempted_here.values()]
        return min(dues, default=None)

    def end_handoff_waits(self, now_ms: int, out: Ready) -> None:
        """Tick: a hand-off that did not come in time is waited for no longer (the run
        starts from what this node holds, R1)."""
        for jid in [jid for jid, due in self.handoff_waits.items() if due <= now_ms]:
            del self.handoff_waits[jid]
            self.ctx.counters["checkpoint_handoff_timeout"] += 1
            out.events.append(self.ctx.event("checkpoint_handoff_timeout", now_ms, job_id=jid.hex()))
        for jid in [jid for jid, (_fence, due) in self.preempted_here.items() if due <= now_ms]:
            # No final checkpoint came (no driver reads one, or the run had ended): the
            # newest periodic one goes instead, if the victim's next attempt is placed.
            del self.preempted_here[jid]
            record = self.jobs.get(jid)
            if record is not None and record.state not in TERMINAL and record.state != "pending":
                self.hand_off_checkpoint(record, out)

    def refuse(self, record, now_ms: int, out: Ready) -> None:
        """No room here for a job this node became the primary of: tell every node, which
        places it afresh (P6), and never run it."""
        self.ctx.counters["job_refused"] += 1
        data = self.ctx.sign(JobRefusal(job_id=record.job_id, fence=record.fence))
        out.messages.append(Outbound(None, data))
        self._persist_outcome(record.job_id, "refusal", data, out)
        self._refused(record, data, now_ms, out)

    def on_job_refusal(self, envelope, message: JobRefusal, data, now_ms: int, out: Ready) -> None:
        record = self.jobs.get(message.job_id)
        if record is None or envelope.signer != record.primary or message.fence != record.fence:
            self.ctx.counters["job_refusal_stale"] += 1
            return
        if record.state not in TERMINAL:
            self._persist_outcome(record.job_id, "refusal", data, out)
            self._refused(record, data, now_ms, out)

    def _refused(self, record, data: bytes, now_ms: int, out: Ready) -> None:
        refused_by, fence = record.primary, record.fence
        self.ledger.free(record.job_id)
        if self.gangs is not None and self.gangs.worker_refused(record, data, now_ms, out):
            return
        attempt = next_attempt(record.attempt, record.manifest, refused=True)
        if attempt is None:
            record.state = "failed"
            record.hint = "refused by its primaries for want of capacity, with no retry left"
        else:
            self.place_again(record, attempt, data, now_ms, out)
        out.events.append(self.ctx.event("job_refused", now_ms, job_id=record.job_id.hex(), fence=fence,
                                         by=refused_by.hex() if refused_by else "", attempt=record.attempt,
                                         state=record.state))

    def place_again(self, record, attempt: int, data: bytes, now_ms: int, out: Ready) -> None:
        """SPEC P6: the job's next attempt, placed afresh by its own instance. ``data``: the exit
        or refusal that ended the last one (a leader shows it to voters that missed it)."""
        record.attempt = attempt
        self.jobs.assign(record, None, (), ())
        record.declines.clear()
        record.outcome = data
        self.placement.start(record, now_ms, out)

    def _my_job(self, jid: bytes):
        record = self.jobs.get(jid)
        if record is None or record.primary != self.ctx.me or record.state in TERMINAL or not self.epochs.is_member():
            raise LocalProtocolError("this node is not the primary of job %s" % jid.hex()[:12])
        return record

    def workload_started(self, jid: bytes, fence: int, from_seq: int, now_ms: int) -> Ready:
        out = Ready()
        record = self.jobs.get(jid)
        if record is not None and record.primary == self.ctx.me and record.fence == fence:
            record.state = "running"
            out.events.append(self.ctx.event("job_started", now_ms, job_id=jid.hex(), fence=fence, from_seq=from_seq))
        return out

    # --- checkpoints -------------------------------------------------------------------------------
    def local_checkpoint(self, jid: bytes, seq: int, progress: int, taken_ms: int, state: bytes,
                         now_ms: int) -> Ready:
        """The primary's workload took a checkpoint: persist it, stream it to the backups."""
        record = self._my_job(jid)
        checkpoint = Checkpoint(job_id=jid, fence=record.fence, seq=seq, progress=progress, taken_ms=taken_ms,
                                state=state, state_hash=hashlib.sha256(state).digest())
        out = Ready()
        out.persist.append(self._checkpoint_record(checkpoint, self.ctx.me))
        data = self.ctx.sign(checkpoint)
        for backup in record.backups:
            if backup in self.epochs.view.stakes:
                out.messages.append(Outbound(backup, data))
        record.state = "running"
        record.last_checkpoint_seq, record.last_checkpoint_taken_ms = seq, taken_ms
        record.known_checkpoint = (seq, now_ms)
        record.checkpoint_envelope, record.checkpoint_fence = data, record.fence
        return out

    @staticmethod
    def _checkpoint_record(checkpoint: Checkpoint, origin: bytes) -> PersistRecord:
        return PersistRecord("checkpoints", "%s:%d" % (checkpoint.job_id.hex(), checkpoint.seq), {
            "job_id": checkpoint.job_id, "fence": checkpoint.fence, "seq": checkpoint.seq,
            "progress": checkpoint.progress, "taken_ms": checkpoint.taken_ms, "state": checkpoint.state,
            "state_hash": checkpoint.state_hash, "origin": origin})

    def on_checkpoint(self, envelope, checkpoint: Checkpoint, data, now_ms: int, out: Ready) -> None:
        counters = self.ctx.counters
        record = self.jobs.get(checkpoint.job_id)
        if record is None:
            counters["checkpoint_unknown_job"] += 1
            return
        if envelope.signer != record.primary and self._handed_off(envelope.signer, checkpoint, record):
            self._take_handed_off(envelope, checkpoint, data, record, now_ms, out)
            return
        if envelope.signer != record.primary and self._handed_over_after_move(envelope, checkpoint, data, record,
                                                                              now_ms, out):
            return
        if envelope.signer != record.primary and self._handed_to_replacement(envelope.signer, checkpoint, record):
            # GA11: only the replaced run's checkpoint ends the wait. One of an older run (a
            # node that held the rank before that run) came first under load and the rank
            # resumed from it, taking the whole ring back 40 s (`bench gang`, BENCHMARKS.md).
            self._take_handed_off(envelope, checkpoint, data, record, now_ms, out,
                                  ends_wait=checkpoint.fence >= replaced_run_fence(record))
            return
        if envelope.signer != record.primary or checkpoint.fence < record.fence:
            counters["checkpoint_stale_fence"] += 1  # SPEC P6: a fenced primary is ignored
            out.events.append(self.ctx.event("checkpoint_refused", now_ms, job_id=checkpoint.job_id.hex(),
                                             signer=envelope.signer.hex(), fence=checkpoint.fence))
            return
        if checkpoint.fence > record.fence:
            counters["checkpoint_future_fence"] += 1
            return
        if record.last_checkpoint_seq is not None and checkpoint.seq <= record.last_checkpoint_seq:
            counters["checkpoint_old_seq"] += 1
            return
        record.last_checkpoint_seq, record.last_checkpoint_taken_ms = checkpoint.seq, checkpoint.taken_ms
        record.known_checkpoint = (checkpoint.seq, now_ms)
        if record.state in ("placed", "migrating"):
            record.state = "running"
        record.checkpoint_envelope, record.checkpoint_fence = data, checkpoint.fence
        out.persist.append(self._checkpoint_record(checkpoint, envelope.signer))
        ack = CheckpointAck(job_id=checkpoint.job_id, fence=checkpoint.fence, seq=checkpoint.seq)
        out.messages.append(Outbound(envelope.signer, self.ctx.sign(ack)))

    def _handed_off(self, signer: bytes, checkpoint: Checkpoint, record) -> bool:
        """R1: a checkpoint handed to this node, the primary or a backup of a job's attempt
        of which it holds no checkpoint yet: taken in an earlier attempt by the node that was
        the job's primary at its fence (as this node applied it), of the work this attempt
        goes on with, and newer than any of that work this node holds."""
        me = self.ctx.me
        if record.state in TERMINAL or (record.primary != me and me not in record.backups):
            return False
        if checkpoint.fence // FENCE_PER_ATTEMPT >= record.attempt or record.primaries.get(checkpoint.fence) != signer:
            return False
        if not same_work(checkpoint.fence, record.attempt, record.manifest):
            return False
        held = record.checkpoint_fence
        if held is not None and held // FENCE_PER_ATTEMPT >= record.attempt:
            return False
        return (held is None or not same_work(held, record.attempt, record.manifest)
                or (checkpoint.fence, checkpoint.seq) > (held, record.last_checkpoint_seq or 0))

    def _handed_to_replacement(self, signer: bytes, checkpoint: Checkpoint, record) -> bool:
        """GA7: a gang's rank replaced within its attempt: the newest checkpoint of it, taken
        by the node that ran it at that (earlier) fence of this attempt, handed to the
        replacement or a backup of it before the new run took one of its own; taken if newer
        than any held."""
        me = self.ctx.me
        if record.state != "migrating" or not self._gang_rank(record) or (record.primary != me
                                                                          and me not in record.backups):
            return False
        if (checkpoint.fence >= record.fence or checkpoint.fence // FENCE_PER_ATTEMPT != record.attempt
                or record.primaries.get(checkpoint.fence) != signer):
            return False
        held = record.checkpoint_fence
        return held is None or (checkpoint.fence, checkpoint.seq) > (held, record.last_checkpoint_seq or 0)

    def _handed_over_after_move(self, envelope, checkpoint: Checkpoint, data, record, now_ms: int,
                                out: Ready) -> bool:
        """R2: the final checkpoint of the primary a move took the job from, at the fence it
        ran under, to the new primary or a backup, while the new run has not started (after
        that it is a late checkpoint of a fenced primary). Taken if newer than any held; if
        not (a backup holds it already), it still ends the new primary's wait. False: not one."""
        me = self.ctx.me
        if record.moved_from != (checkpoint.fence, envelope.signer) or record.fence != checkpoint.fence + 1:
            return False
        if record.state != "migrating" or (record.primary != me and me not in record.backups):
            return False
        held = record.checkpoint_fence
        if held is None or (checkpoint.fence, checkpoint.seq) > (held, record.last_checkpoint_seq or 0):
            self._take_handed_off(envelope, checkpoint, data, record, now_ms, out)
        elif self.handoff_waits.pop(checkpoint.job_id, None) is not None:
            out.events.append(self.ctx.event("checkpoint_handed_off", now_ms, job_id=checkpoint.job_id.hex(),
                                             fence=checkpoint.fence, seq=checkpoint.seq, held=True))
        if self.stop_waits.get(checkpoint.job_id, ())[:2] == (checkpoint.fence, envelope.signer):
            self._start_if_handed_over(record, now_ms, out)   # R2a: if its run_stopped came first
        return True

    def moved_away(self, record, fence: int, now_ms: int, out: Ready) -> None:
        """R2a: a move took the job off this node at ``fence``. A run ordered here stops by the
        workload orders and the driver reports it (``hand_over_moved``); with none ordered
        here (never started, frozen by a halt, gone with a restart) it is stopped now."""
        self.handovers[record.job_id] = [fence, None, None]
        if self.ordered.get(record.job_id) != fence:
            out.extend(self.hand_over_moved(record.job_id, fence, None, now_ms))

    def hand_over_moved(self, jid: bytes, fence: int | None, final: tuple | None, now_ms: int) -> Ready:
        """R2: this node's run of ``jid`` under ``fence`` (None: the one a move took away)
        stopped because a move took the job away. Its final checkpoint (``final``: seq,
        progress, taken_ms, state, read as the run stopped; None: nothing newer than the last
        one taken) goes to the new primary and its backups; with no checkpoint of that fence
        here, a ``run_stopped`` (R2a). Once per move; nothing for any other stop."""
        out = Ready()
        record = self.jobs.get(jid)
        if record is not None and fence is not None and self.preempted_here.get(jid, (None,))[0] == fence:
            return self._hand_over_preempted(record, fence, final, now_ms)
        owed = self.handovers.get(jid)
        if owed is None or owed[1] is not None or fence not in (None, owed[0]):
            return out
        fence = owed[0]
        if record is None or record.moved_from != (fence, self.ctx.me) or record.primary == self.ctx.me:
            return out
        handed = ()
        if final is not None:
            seq, progress, taken_ms, state = final
            checkpoint = Checkpoint(job_id=jid, fence=fence, seq=seq, progress=progress, taken_ms=taken_ms,
                                    state=state, state_hash=hashlib.sha256(state).digest())
            handed = (self.ctx.sign(checkpoint),)
            out.persist.append(self._checkpoint_record(checkpoint, self.ctx.me))
            record.checkpoint_envelope, record.checkpoint_fence = handed[0], fence
            record.last_checkpoint_seq = seq
        elif record.checkpoint_fence == fence and record.checkpoint_envelope is not None:
            handed = (record.checkpoint_envelope,)
        seq = record.last_checkpoint_seq or 0 if handed else 0
        # The checkpoint (state) first, then that the run stopped (R2a): the new primary starts
        # once it holds both. Replayed after a restart, the Ready is dropped: the first tick sends them.
        data = (*handed, self.ctx.sign(RunStopped(job_id=jid, fence=fence, seq=seq)))
        owed[1], owed[2] = data, now_ms if self.deferred else now_ms + MOVE_HANDOVER_RESEND_MS
        self.ctx.counters["checkpoint_handed_over"] += 1
        out.events.append(self.ctx.event("checkpoint_handed_over", now_ms, job_id=jid.hex(), fence=fence,
                                         final=final is not None, seq=seq))
        for target in (record.primary, *record.backups):
            if target != self.ctx.me:
                out.messages.extend(Outbound(target, message) for message in data)
        return out

    def resend_handovers(self, now_ms: int, out: Ready) -> None:
        """Tick (R2a): each hand-over due goes to the new primary again while its newest vector
        does not show the new run; one whose job moved on (or ended) is forgotten."""
        me = self.ctx.me
        for jid, owed in list(self.handovers.items()):
            fence, data, due = owed
            record = self.jobs.get(jid)
            if (record is None or record.state in TERMINAL or record.moved_from != (fence, me)
                    or record.fence != fence + 1):
                del self.handovers[jid]
            elif data is not None and due <= now_ms:
                owed[2] = now_ms + MOVE_HANDOVER_RESEND_MS
                if not self.seen_running(record.primary, jid, record.fence) and record.primary != me:
                    self.ctx.counters["move_handover_resent"] += 1
                    out.messages.extend(Outbound(record.primary, message) for message in data)

    def on_vector(self, node: bytes, now_ms: int, syncing: bool = False) -> None:
        """R2a: a new vector of ``node``: a hand-over owed to it as a moved job's new primary,
        sent at least a quarter period ago, is due now if the vector does not show the new
        run (it restarted and waits again, or lost the hand-over), not a period later.
        ``syncing``: ``node`` asked for a sync (R2b), so it may have been down when the last
        one came, however recent: due now."""
        for jid, owed in self.handovers.items():
            record = self.jobs.get(jid)
            if (owed[1] is not None and record is not None and record.primary == node
                    and (syncing or now_ms >= owed[2] - MOVE_HANDOVER_RESEND_MS * 3 // 4)
                    and not self.seen_running(node, jid, record.fence)):
                owed[2] = now_ms

    def next_resend_ms(self) -> int | None:
        return min((owed[2] for owed in self.handovers.values() if owed[1] is not None), default=None)

    def await_stop(self, record, fence: int, node: bytes) -> None:
        """R2a, the new primary: the run of ``node`` at ``fence`` must be known stopped first
        (unless ``node`` has left the epoch already: its eviction stopped it, F3)."""
        if node in self.epochs.view.stakes:
            self.stop_waits[record.job_id] = (fence, node, None)

    def on_run_stopped(self, envelope, message: RunStopped, data, now_ms: int, out: Ready) -> None:
        """R2a: the old primary's run stopped; the new run starts once this node holds the
        checkpoint the old primary handed over with it (it may come later: it is sent again)."""
        wait = self.stop_waits.get(message.job_id)
        if wait is None or wait[:2] != (message.fence, envelope.signer):
            self.ctx.counters["run_stopped_stale"] += 1   # early, late, or not ours to wait for
            return
        self.stop_waits[message.job_id] = (message.fence, envelope.signer, message.seq)
        self._start_if_handed_over(self.jobs.get(message.job_id), now_ms, out)

    def _start_if_handed_over(self, record, now_ms: int, out: Ready) -> None:
        fence, node, seq = self.stop_waits[record.job_id]
        held = (record.checkpoint_fence or 0, record.last_checkpoint_seq or 0)
        if seq is None or (seq and held < (fence, seq)):
            return   # the stop not heard yet, or the final checkpoint not here yet
        del self.stop_waits[record.job_id]
        out.events.append(self.ctx.event("move_old_run_stopped", now_ms, job_id=record.job_id.hex(), fence=fence,
                                         node=node.hex(), seq=seq))

    def stop_wait_ended(self) -> bool:
        """Whether ``end_stop_waits`` has one to end now: its old primary left the epoch (F3a:
        an input, the eviction's decision, left this work for the tick)."""
        members = self.epochs.view.stakes
        return any(seq is None and node not in members for _fence, node, seq in self.stop_waits.values())

    def end_stop_waits(self, now_ms: int, out: Ready) -> None:
        """Tick (R2a): a wait whose old primary left the epoch ends (its eviction is the stop,
        F3, F5); one for a job this node no longer holds at that move is dropped."""
        members = self.epochs.view.stakes
        for jid, (fence, node, _seq) in list(self.stop_waits.items()):
            record = self.jobs.get(jid)
            if (record is None or record.state in TERMINAL or record.primary != self.ctx.me
                    or record.fence != fence + 1):
                del self.stop_waits[jid]
            elif node not in members:
                self.ctx.counters["move_old_primary_gone"] += 1
                self.stop_waits[jid] = (fence, node, 0)   # its eviction stopped it: go on from what is held
                self._start_if_handed_over(record, now_ms, out)

    def _hand_over_preempted(self, record, fence: int, final: tuple | None, now_ms: int) -> Ready:
        """P8d: this node stopped the run of a victim it preempted, under ``fence``. Its final
        checkpoint (``final``, as for a move; None: nothing newer than the last one) becomes
        the newest this node holds of the work, and the R1 hand-over it held back goes now
        if the victim's next attempt is placed, else when this node applies that placement."""
        out = Ready()
        del self.preempted_here[record.job_id]
        if final is not None:
            seq, progress, taken_ms, state = final
            checkpoint = Checkpoint(job_id=record.job_id, fence=fence, seq=seq, progress=progress, taken_ms=taken_ms,
                                    state=state, state_hash=hashlib.sha256(state).digest())
            data = self.ctx.sign(checkpoint)
            out.persist.append(self._checkpoint_record(checkpoint, self.ctx.me))
            held = (record.checkpoint_fence, record.last_checkpoint_seq or 0)
            if record.checkpoint_fence is None or (fence, seq) > held:
                record.checkpoint_envelope, record.checkpoint_fence = data, fence
                record.last_checkpoint_seq, record.last_checkpoint_taken_ms = seq, taken_ms
                record.known_checkpoint = (seq, now_ms)
            self.ctx.counters["checkpoint_handed_over"] += 1
            out.events.append(self.ctx.event("checkpoint_handed_over", now_ms, job_id=record.job_id.hex(),
                                             fence=fence, final=True, preempted=True))
        placed_again = record.fence // FENCE_PER_ATTEMPT > fence // FENCE_PER_ATTEMPT
        if placed_again and record.state not in TERMINAL and record.state != "pending":
            self.hand_off_checkpoint(record, out)
        return out

    def _take_handed_off(self, envelope, checkpoint: Checkpoint, data, record, now_ms: int, out: Ready,
                         ends_wait: bool = True) -> None:
        """The first one (``ends_wait``) ends the primary's wait; the run resumes from the
        newest held (no ack: the signer is no primary of this attempt)."""
        if ends_wait:
            self.handoff_waits.pop(checkpoint.job_id, None)
        record.last_checkpoint_seq, record.last_checkpoint_taken_ms = checkpoint.seq, checkpoint.taken_ms
        record.known_checkpoint = (checkpoint.seq, now_ms)
        record.checkpoint_envelope, record.checkpoint_fence = data, checkpoint.fence
        out.persist.append(self._checkpoint_record(checkpoint, envelope.signer))
        out.events.append(self.ctx.event("checkpoint_handed_off", now_ms, job_id=checkpoint.job_id.hex(),
                                         fence=checkpoint.fence, seq=checkpoint.seq))

    def on_checkpoint_ack(self, envelope, ack: CheckpointAck, data, now_ms: int, out: Ready) -> None:
        record = self.jobs.get(ack.job_id)
        if (record is None or record.primary != self.ctx.me or ack.fence != record.fence
                or envelope.signer not in record.backups):
            self.ctx.counters["ack_unexpected"] += 1
            return
        record.acks[envelope.signer] = max(ack.seq, record.acks.get(envelope.signer, 0))

    # --- exits ----------------------------------------------------------------------------------------
    def job_exited(self, jid: bytes, exit_code: int, now_ms: int) -> Ready:
        """The workload exited here. A fenced ex-primary's exit changes nothing (an event says so)."""
        out = Ready()
        record = self.jobs.get(jid)
        if record is None or record.primary != self.ctx.me or record.state in TERMINAL:
            out.events.append(self.ctx.event("exit_ignored", now_ms, job_id=jid.hex(), exit_code=exit_code))
            return out
        code = exit_code if 0 <= exit_code <= 255 else 255
        data = self.ctx.sign(JobExit(job_id=jid, fence=record.fence, exit_code=code))
        out.messages.append(Outbound(None, data))
        self._persist_outcome(jid, "exit", data, out)
        self._finish_job(record, code, data, now_ms, out)
        return out

    def on_job_exit(self, envelope, message: JobExit, data, now_ms: int, out: Ready) -> None:
        record = self.jobs.get(message.job_id)
        if record is None or not self._exit_acceptable(record, envelope.signer, message):
            self.ctx.counters["job_exit_stale"] += 1
            return
        self._persist_outcome(record.job_id, "exit", data, out)
        if message.fence != record.fence or record.state in TERMINAL:
            # The run that completed the job, though this node had moved it on (it applied an
            # eviction before the exit) or had it completed by an older fence's run: every
            # member ends with the same primary and fence, those of the newest completion.
            self.ctx.counters["job_exit_after_move"] += 1
            self.jobs.assign(record, envelope.signer, record.backups, fence=message.fence)
            if record.state in TERMINAL:
                return
        self._finish_job(record, message.exit_code, data, now_ms, out)

    @staticmethod
    def _exit_acceptable(record, signer: bytes, message: JobExit) -> bool:
        """SPEC P6: the exit's signer was the job's primary at the exit's fence. From the
        current run, any exit code; from a run the job has moved on from since (within the
        same attempt), only a completion (its work is done; a failure there changes nothing,
        the work goes on elsewhere); for a completed job, only a completion by a newer fence."""
        if record.primaries.get(message.fence) != signer:   # fences this node has seen assigned only
            return False
        if message.fence // FENCE_PER_ATTEMPT != record.attempt:
            return False
        if record.state in TERMINAL:
            return record.state == "completed" and message.exit_code == 0 and message.fence > record.fence
        if message.fence == record.fence:
            return record.primary == signer
        return message.exit_code == 0

    def _finish_job(self, record, code: int, data: bytes, now_ms: int, out: Ready) -> None:
        self.ledger.free(record.job_id)
        if self.gangs is not None and self.gangs.worker_finished(record, code, data, now_ms, out):
            return
        record.exit_code = code
        attempt = next_attempt(record.attempt, record.manifest, refused=False) if code else None
        if code == 0:
            record.state = "completed"
        elif attempt is not None:
            self.place_again(record, attempt, data, now_ms, out)  # SPEC P6: placed afresh, by a new instance
        else:
            record.state = "failed"
        out.events.append(self.ctx.event("job_exited", now_ms, job_id=record.job_id.hex(), exit_code=code,
                                         state=record.state, attempt=record.attempt))

    # --- cancels --------------------------------------------------------------------------------------
    def cancel(self, request: bytes, now_ms: int) -> tuple[bytes, Ready]:
        """An owner-signed Cancel envelope: stop and forget the job everywhere."""
        out = Ready()
        envelope, message = decode_message(request, self.ctx.mesh_id, expect=Cancel, caches=self.ctx.caches)
        record = self.jobs.get(message.job_id)
        if record is None:
            raise RemoteProtocolError("cancel: unknown job %s" % message.job_id.hex()[:12])
        if envelope.signer != record.manifest.owner:
            raise RemoteProtocolError("cancel: only the job's owner may cancel it")
        if self._gang_rank(record):
            raise RemoteProtocolError("cancel: job %s is a rank of a gang: cancel the gang, whose ranks go together"
                                      % message.job_id.hex()[:12])
        if record.state in TERMINAL:
            # Its recorded outcome (an exit) must stay: a cancel persisted over it would
            # replay as "cancelled" after a restart.
            raise RemoteProtocolError("cancel: job %s already ended (%s)" % (message.job_id.hex()[:12], record.state))
        out.messages.append(Outbound(None, request))
        self._persist_outcome(record.job_id, "cancel", request, out)
        self._apply_cancel(record, now_ms, out)
        return message.job_id, out

    def _gang_rank(self, record) -> bool:
        return self.gangs is not None and record.job_id in self.gangs.worker_of

    def on_cancel(self, envelope, message: Cancel, data, now_ms: int, out: Ready) -> None:
        record = self.jobs.get(message.job_id)
        if record is None or envelope.signer != record.manifest.owner or self._gang_rank(record):
            self.ctx.counters["cancel_refused"] += 1
            return
        if record.state not in TERMINAL:
            self._persist_outcome(record.job_id, "cancel", data, out)
        self._apply_cancel(record, now_ms, out)

    def _apply_cancel(self, record, now_ms: int, out: Ready) -> None:
        if record.state in TERMINAL:
            return
        if record.instance:
            self.ledger.release(record.instance)
        self.ledger.release(record.job_id)  # a slot's bid reserves by job (P7a)
        was_mine = record.primary == self.ctx.me
        self.ledger.free(record.job_id)
        record.state = "cancelled"
        if was_mine:
            out.decisions.append(local_decision("cancel", (record.job_id,)))
        out.events.append(self.ctx.event("job_cancelled", now_ms, job_id=record.job_id.hex()))
        for worker in self.gangs.worker_records(record.job_id) if self.gangs is not None else ():
            self._apply_cancel(worker, now_ms, out)   # a gang's cancel stops every rank

    def resend_own_outcomes(self, out: Ready) -> None:
        """6.9a: a node that crashed just after its workload exited persisted the exit but may
        not have broadcast it; members that missed it showed the job running (simulator seed
        61: the exit and the crash in the same millisecond, two members never heard it)."""
        out.messages.extend(Outbound(None, data) for data in self.own_outcomes_replayed)
        self.own_outcomes_replayed = []

    # --- persisted outcomes (SPEC.md 6.9) ----------------------------------------------------------
    def _persist_outcome(self, jid: bytes, kind: str, data: bytes, out: Ready) -> None:
        """Exits, refusals and cancels are no certificates, so a restart would forget them (a
        completed job would be resumed); the newest per job is kept and replayed, and the
        newest few are re-sent in sync answers (F6)."""
        self.jobs.note_outcome(data)
        out.persist.append(PersistRecord("jobs", jid.hex(), {"job_id": jid, "outcome": kind, "envelope": data}))

    def replay_outcomes(self, envelopes, now_ms: int) -> None:
        """After the certificates: each job's last accepted exit, refusal or cancel, through the
        same checks as when it arrived (the current primary at the current fence; the owner)."""
        for data in envelopes:
            try:
                envelope, message = decode_message(data, self.ctx.mesh_id, caches=self.ctx.caches)
                if envelope.signer == self.ctx.me and len(self.own_outcomes_replayed) < MAX_OWN_OUTCOMES_RESENT:
                    self.own_outcomes_replayed.append(data)
                if isinstance(message, JobExit):
                    self.on_job_exit(envelope, message, data, now_ms, Ready())
                elif isinstance(message, JobRefusal):
                    self.on_job_refusal(envelope, message, data, now_ms, Ready())
                elif isinstance(message, Cancel):
                    self.on_cancel(envelope, message, data, now_ms, Ready())
                else:
                    self.ctx.counters["bad_job_outcome"] += 1
            except RemoteProtocolError:
                self.ctx.counters["bad_job_outcome"] += 1
