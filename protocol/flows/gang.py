"""The gang flow: every worker of a gang placed by one decision (SPEC.md GA1-GA5).

A gang job runs its placement instances like any job (the job's attempts, P2, P3): members
bid one worker's resources each, and the round's leader proposes a ``gang_placement``,
every rank's node and GPUs and the backups, that protocol/gang_placement.py computes from
the bids; every validator recomputes it. Applying it makes one job-table record per rank
(``gang_worker_id``), each run, checkpointed and failed over like a job by its node. A
partial gang never runs on: a rank whose node cannot allocate it refuses it (R1), and the
refusal ends the whole attempt, every rank stopped, and the gang is placed afresh (GA4);
a rank's failed exit ends the attempt too, a gang is done when every rank completed.
A rank whose node is evicted is replaced alone by a decision of its own, or an elastic gang
shrinks (flows/gang_replace.py, GA7, GA8); the other ranks' run orders learn its new
address (``rank_of``, workload_orders.py's "gang_peers") and keep running (GA5).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.flows.placement import PlacementFlow
from protocol.gang_placement import (choose_gang, gang_port, gang_shortfall, gang_worker_id, shortfall,
                                     topology_error)
from protocol.job_table import FENCE_PER_ATTEMPT, TERMINAL
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, CommitCertificate, GangPlacement, JobManifest, decode_message,
                               decode_value,
                               job_id, next_attempt, placement_attempt, placement_binding_error)
from protocol.placement import rank_bids, resource_check, wanted_backups
from protocol.ready import Outbound, Ready


MAX_PORTS_REMEMBERED = 4096


@dataclass
class GangAttempt:
    """A gang's placed attempt here and where its resizes stand (SPEC.md GA9): the number of
    the next resize, the epoch its instance runs in (the last composition decision's), and
    the next unused rank index (a grown rank's worker id)."""
    attempt: int
    number: int
    epoch: int
    next_index: int


@dataclass(frozen=True)
class GangRank:
    """What a rank's workload is told of its gang (SPEC.md GA5): it rides on its run order."""
    gang_id: bytes
    rank: int
    world_size: int
    peers: tuple        # per rank: (node key or None while it has none, TCP port)


class GangFlow(PlacementFlow):
    value_kind = "gang_placement"
    value_kinds = ("gang_placement",)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.worker_of: dict[bytes, tuple[bytes, int]] = {}   # worker record id -> (gang id, rank)
        self.ranks: dict[bytes, tuple[bytes, ...]] = {}        # gang id -> its placed attempt's worker ids
        self.ports: dict[tuple, int] = {}                       # (worker id, fence) -> gang_port
        self.resizes: dict[bytes, int] = {}                     # gang id -> resizes decided (GA8, GA9)
        self.attempts: dict[bytes, GangAttempt] = {}            # gang id -> its placed attempt's resize state
        self.resizer = None                                     # flows/gang_resize.py (GA9), set by the core
        # The signed vectors the bids of a gang's placement carried, by signer: per instance
        # as validated, then per gang once applied, so a replacement (GA7) has the survivors'
        # vectors even where a survivor never sent one since.
        self.bid_vectors: dict[bytes, dict] = {}
        self.worker_vectors: dict[bytes, dict] = {}

    def epochs_needed(self) -> set:
        """GA10: the epochs of the gangs this node holds that are not ended: a gang's next
        attempt runs in its job's epoch (P2), its next resize in its number's (GA9), so
        those epochs' views must stay."""
        live = [record for record in self.jobs
                if record.state not in TERMINAL and record.manifest.gang.is_gang and record.job_id not in self.worker_of]
        return ({record.manifest.epoch for record in live} |
                {self.attempts[r.job_id].epoch for r in live if r.job_id in self.attempts})

    def _not_evicted_since(self, bids: list, epoch: int) -> list:
        """GA10: the bids of nodes this node has not seen evicted since ``epoch``. A gang's
        later attempt runs in its job's (older) epoch, and P5 takes each rank off a node
        evicted since (it waits for a replacement): placing ranks there only burnt the
        attempts (`bench gang` seed 17: 150 attempts in 5 s, every node had been evicted
        and had rejoined since the gang's epoch)."""
        if epoch >= self.epochs.epoch:
            return bids
        evicted = self.evicted_since(epoch)
        return [facts for facts in bids if facts.signer not in evicted]

    def evicted_since(self, epoch: int) -> set:
        """The nodes whose eviction ended an epoch from ``epoch`` on, as this node knows them."""
        evicted = set()
        for ended, certificate in self.epochs.certificates:
            if ended >= epoch:
                cert = decode_message(certificate, self.ctx.mesh_id, expect=CommitCertificate,
                                      caches=self.ctx.caches)[1]
                if cert.value_kind == "eviction":
                    evicted.add(decode_value("eviction", cert.value, caches=self.ctx.caches).node)
        return evicted

    # --- what a gang is made of --------------------------------------------------------------------
    def worker_records(self, gang_id: bytes) -> list:
        return [self.jobs.get(wid) for wid in self.ranks.get(gang_id, ())]

    def rank_of(self, worker_id: bytes) -> GangRank | None:
        """The gang of a worker's run order, its peers at their current nodes and fences. Its
        rank is its place among the gang's ranks now (a shrink renumbers them, GA8)."""
        found = self.worker_of.get(worker_id)
        if found is None or worker_id not in self.ranks.get(found[0], ()):
            return None
        gang_id = found[0]
        peers = tuple((w.primary, self._port(w.job_id, w.fence)) for w in self.worker_records(gang_id))
        return GangRank(gang_id, self.ranks[gang_id].index(worker_id), len(peers), peers)

    def _port(self, worker_id: bytes, fence: int) -> int:
        """gang_port, remembered: run orders ask for every rank's peers after every input."""
        key = (worker_id, fence)
        port = self.ports.get(key)
        if port is None:
            if len(self.ports) >= MAX_PORTS_REMEMBERED:
                self.ports.clear()
            port = self.ports[key] = gang_port(worker_id, fence)
        return port

    def annotate(self, job: dict) -> dict:
        """A job-table dict with its gang added, for tools (``meshnode jobs``, ``why``): a
        gang's ``gang`` (topology, sizes, every rank of its placed attempt) and a rank's
        ``gang_of`` (its gang's id and its rank)."""
        jid = job["job_id"]
        found = self.worker_of.get(jid)
        if found is not None:
            job["gang_of"] = {"gang_id": found[0], "rank": found[1]}
        spec = job["manifest"].gang
        if spec.is_gang and found is None:
            workers = [w for w in self.worker_records(jid) if w is not None]
            job["gang"] = {"topology": spec.topology, "sizes": list(spec.sizes()),
                           "resizes": self.resizes.get(jid, 0), "workers": [
                {"rank": rank, "job_id": w.job_id, "primary": w.primary, "state": w.state, "fence": w.fence}
                for rank, w in enumerate(workers)]}
            if job["state"] == "placed" and workers and all(w.state == "running" for w in workers):
                job["state"] = "running"   # the gang runs once every rank does (its own record runs nowhere)
            if job["state"] == "pending" and not job.get("hint"):
                job["hint"] = self._shortfall_seen_here(job["manifest"])
        return job

    def _shortfall_seen_here(self, job) -> str:
        """For ``why`` at a node that is not the round's leader (it holds no bids): GA2's
        groups counted over the members' newest capability vectors that fit one worker."""
        book = self.bidding.capability
        members = self.epochs.view.stakes
        capabilities = [cap for cap in (book.vector, *book.peers.values())
                        if cap is not None and cap.node in members and resource_check(job, cap)[0]]
        return "by the members' capability vectors: " + shortfall(job, capabilities, "members")

    # --- the leader's proposal (GA3) -----------------------------------------------------------------
    def bids_wanted(self, job) -> int:
        return min(job.gang.sizes()) + wanted_backups(job)   # the smallest gang and its backups (GA3)

    def _maybe_propose(self, inst, now_ms: int, out: Ready, window_closed: bool) -> None:
        """Propose once every member answered, or when the bid window closed (P4), the gang
        of the largest size that fits (GA2); without one the job waits and says why."""
        gathered = self._gathered_bids(inst, now_ms, window_closed)
        if gathered is None:
            return
        iid = inst.instance_id
        record, held, live = gathered
        live = self._not_evicted_since(live, inst.view.epoch)
        chosen = rank_bids(record.manifest, iid, live)[:MAX_BIDS_PER_PROPOSAL]
        gang = choose_gang(record.envelope, record.manifest, iid, chosen)
        if gang is None:
            record.hint = "%s (%d bids, %d declines)" % (gang_shortfall(record.manifest, iid, chosen), len(held),
                                                         len(record.declines))
            return
        justification = tuple(held[facts.signer][1] for facts in chosen)
        if record.outcome is not None and record.attempt > 0:
            out.messages.append(Outbound(None, record.outcome))   # what ended the last attempt (P6)
        self.instances.drive(inst, inst.propose(codec.pack(gang.to_body()), justification, now_ms), now_ms, out)

    # --- a gang no set of members can hold waits (P3a, GA3) ------------------------------------------
    def round_on_hold(self, inst, now_ms: int) -> bool:
        """SPEC.md GA3 with P3a: every member of the instance's epoch answered (this node
        holds its bid or decline: the round's leader forwards them all) and GA2 finds no gang
        in those bids, so no round can place it: it waits in its round, and a member whose
        capacity frees bids to all (reconsider_held), which ends the hold."""
        if inst.locked_round is not None:
            return False
        record = self._pending_record(inst)
        if record is None:
            return False
        held = self.bidding.held.get(inst.instance_id, {})
        if not all(member in held or member in record.declines for member in inst.view.members):
            return False
        return self._gang_from(record, inst.instance_id, held) is None

    def _gang_from(self, record, iid: bytes, held: dict):
        """GA2 over the held bids of live members, as the leader proposes it (None: no gang fits)."""
        live = [facts for facts, _ in held.values() if facts.signer in self.epochs.view.stakes]
        view = self.instances.live_or_decided(iid)
        live = self._not_evicted_since(live, view.view.epoch if view is not None else record.manifest.epoch)
        chosen = rank_bids(record.manifest, iid, live)[:MAX_BIDS_PER_PROPOSAL]
        return choose_gang(record.envelope, record.manifest, iid, chosen)

    def answers_forwarded(self, inst) -> list:
        """P3a for a gang: the held round's leader sends every bid and decline it holds to
        every member (once per round), so all of them hold alike."""
        bids = [data for _facts, data in self.bidding.held.get(inst.instance_id, {}).values()]
        return bids + super().answers_forwarded(inst)

    def _validator(self, iid: bytes):
        mesh_id = self.ctx.mesh_id

        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.live_or_decided(iid)
            view = inst.view if inst is not None else self.epochs.view
            try:
                gang = decode_value("gang_placement", value_bytes, caches=self.ctx.caches)
                problem = self.value_binding_error(iid, "gang_placement", gang, view.epoch, mesh_id, 0,
                                                   caches=self.ctx.caches)
                if problem is not None:
                    return problem
                if len(justification) > MAX_BIDS_PER_PROPOSAL:
                    return "more than %d bids" % MAX_BIDS_PER_PROPOSAL
                _envelope, job = decode_message(gang.job, mesh_id, expect=JobManifest, allow_any_mesh=True,
                                                caches=self.ctx.caches)
                facts = self._not_evicted_since([self.bidding.parse_member_bid(b, iid, view)
                                                 for b in justification], view.epoch)
                by_signer = {f.signer: f for f in facts}
                # The rule itself first, so a bad proposal is refused with the reason (GA2).
                caps = [by_signer[w.node].capability for w in gang.workers if w.node in by_signer]
                if len(caps) == len(gang.workers):
                    broken = topology_error(job.gang.topology, caps)
                    if broken is not None:
                        return broken
                expected = choose_gang(gang.job, job, iid, facts)
                if len(self.bid_vectors) >= MAX_PORTS_REMEMBERED:
                    self.bid_vectors.clear()
                self.bid_vectors[iid] = {f.signer: f.bid.capability for f in facts}
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid gang placement proposal: %s" % exc
            if expected != gang:
                return "gang placement does not follow from its bids"
            return None
        return validate

    def instance_from_proposal(self, proposal, gang: GangPlacement, view, now_ms: int, out: Ready):
        iid = proposal.instance
        if self.value_binding_error(iid, "gang_placement", gang, view.epoch, self.ctx.mesh_id, 0,
                                    caches=self.ctx.caches) is not None:
            self.ctx.counters["gang_placement_unbound"] += 1
            return None
        _envelope, job = decode_message(gang.job, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                        caches=self.ctx.caches)
        jid = job_id(job)
        record = self.jobs.get_or_add(jid, gang.job, job, now_ms)
        if record.state in TERMINAL or (record.instance and record.instance != iid):
            self.ctx.counters["placement_for_other_attempt"] += 1
            return None
        record.instance = iid
        return self.instances.start(iid, self, jid, view, now_ms, out)

    # --- a gang placement is decided (GA3, GA4) -------------------------------------------------------
    @staticmethod
    def value_binding_error(iid: bytes, value_kind: str, gang, epoch: int, mesh_id: bytes,
                            slot_ms: int, caches=None) -> str | None:
        """GA3: a gang placement's instance is its gang job's attempt, in the job's epoch,
        and it places one of the sizes the job allows."""
        envelope, job = decode_message(gang.job, mesh_id, expect=JobManifest, allow_any_mesh=True, caches=caches)
        if envelope.signer != job.owner:
            return "a job that is not signed by its owner"
        if not job.gang.is_gang:
            return "a gang placement of a job that is not a gang"
        if len(gang.workers) not in job.gang.sizes():
            return "a gang of %d workers, which the job does not allow" % len(gang.workers)
        return placement_binding_error(iid, job, epoch)

    def apply(self, iid: bytes, value_kind: str, gang, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        _envelope, job = decode_message(gang.job, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                        caches=self.ctx.caches)
        jid = job_id(job)
        record = self.jobs.get_or_add(jid, gang.job, job, now_ms)
        self.bidding.forget(iid)
        attempt = placement_attempt(iid, job)
        if record.state in TERMINAL or attempt < record.attempt:
            self.ctx.counters["placement_of_earlier_attempt"] += record.state != "cancelled"
            self.ledger.release(iid)
            return
        fence = attempt * FENCE_PER_ATTEMPT + 1
        record.attempt, record.instance, record.outcome = attempt, iid, None
        self.jobs.assign(record, None, gang.backups, (), fence=fence)   # the gang itself runs nowhere
        record.state, record.hint = "placed", None
        workers = []
        for rank, worker in enumerate(gang.workers):
            wid = gang_worker_id(jid, rank)
            w = self.jobs.get_or_add(wid, gang.job, job, now_ms)
            if w.primary == self.ctx.me and w.fence != fence:
                self.ledger.free(wid)   # it ran an earlier attempt here (R1)
            self.worker_of[wid] = (jid, rank)
            w.attempt, w.instance, w.state, w.hint, w.exit_code = attempt, iid, "placed", None, None
            self.jobs.assign(w, worker.node, gang.backups, worker.gpus, fence=fence)
            workers.append(w)
        self.ranks[jid] = tuple(w.job_id for w in workers)
        self.attempts[jid] = GangAttempt(attempt, 0, epoch, len(workers))
        if len(self.worker_vectors) >= MAX_PORTS_REMEMBERED:
            self.worker_vectors.clear()
        self.worker_vectors[jid] = self.bid_vectors.pop(iid, {})
        # P5, once the whole gang is in the table: a rank on a node evicted since waits for
        # its replacement (GA7) as it would had the placement been applied in time.
        for w in workers:
            self._replay_evictions_since(w, epoch, now_ms, out)
        out.events.append(self.ctx.event("gang_placed", now_ms, job_id=jid.hex(), fence=fence,
                                         workers=[w.primary.hex() if w.primary else "" for w in workers]))
        # Each rank's node allocates it from its bid's reservation (R1); one refusal refuses the gang.
        for w in workers:
            if w.primary == self.ctx.me and w.state not in TERMINAL and record.state == "placed":
                if not self.lifecycle.admit(w, iid, now_ms, out):
                    break
        self.ledger.release(iid)
        if self.resizer is not None:
            self.resizer.opened(jid, now_ms, out)   # GA9: its resize number 0, and any decided early

    # --- the end of an attempt (GA4) -----------------------------------------------------------------
    def _stop_workers(self, gang_id: bytes, state: str, now_ms: int, out: Ready) -> None:
        if self.resizer is not None:
            self.resizer.close(gang_id)   # the attempt's resizes end with it (GA9)
        for w in self.worker_records(gang_id):
            if w is not None and w.state not in TERMINAL:
                holder = w.primary
                self.ledger.free(w.job_id)
                self.jobs.assign(w, None, (), ())
                w.state = state
                out.events.append(self.ctx.event("gang_worker_stopped", now_ms, job_id=w.job_id.hex(),
                                                 node=holder.hex() if holder else ""))

    def shrink(self, gang_id: bytes, lost, size: int, now_ms: int, out: Ready) -> None:
        """GA8: the rank ``lost`` could not be replaced: the first ``size`` surviving ranks go
        on, renumbered in rank order (their runs are not stopped, only told); the others stop."""
        survivors = [wid for wid in self.ranks.get(gang_id, ()) if wid != lost.job_id]
        kept, dropped = survivors[:size], [lost.job_id, *survivors[size:]]
        for wid in dropped:
            w = self.jobs.get(wid)
            if w is not None and w.state not in TERMINAL:
                if w.primary == self.ctx.me:
                    self.ledger.free(wid)
                self.jobs.assign(w, None, (), ())
                w.state, w.hint = "cancelled", "left its gang when it shrank (GA8)"
        self.ranks[gang_id] = tuple(kept)
        self.resizes[gang_id] = self.resizes.get(gang_id, 0) + 1
        out.events.append(self.ctx.event("gang_resized", now_ms, job_id=gang_id.hex(), size=size,
                                         dropped=[wid.hex() for wid in dropped]))

    def grow(self, gang_id: bytes, nodes: tuple, vectors: tuple, epoch: int, now_ms: int, out: Ready) -> list:
        """GA9: new ranks on ``nodes`` after the gang's ranks, with fresh worker ids (the
        attempt's next indices), at the attempt's first fence, the gang's backups; the ranks
        already there are only told their new peers. Returns the new ranks' records."""
        gang, state = self.jobs.get(gang_id), self.attempts[gang_id]
        fence = state.attempt * FENCE_PER_ATTEMPT + 1
        added = []
        for node, vector in zip(nodes, vectors):
            wid = gang_worker_id(gang_id, state.next_index)
            self.worker_of[wid] = (gang_id, state.next_index)
            state.next_index += 1
            w = self.jobs.get_or_add(wid, gang.envelope, gang.manifest, now_ms)
            w.attempt, w.instance, w.state, w.hint, w.exit_code = state.attempt, gang.instance, "placed", None, None
            self.jobs.assign(w, node, tuple(b for b in gang.backups if b != node), (), fence=fence)
            self.worker_vectors.setdefault(gang_id, {})[node] = vector
            added.append(w)
        self.ranks[gang_id] = self.ranks.get(gang_id, ()) + tuple(w.job_id for w in added)
        self.resizes[gang_id] = self.resizes.get(gang_id, 0) + 1
        out.events.append(self.ctx.event("gang_resized", now_ms, job_id=gang_id.hex(), size=len(self.ranks[gang_id]),
                                         grown=[w.job_id.hex() for w in added]))
        for w in added:   # P5: a new rank's node evicted since the decision's epoch waits for its replacement
            self._replay_evictions_since(w, epoch, now_ms, out)
        return added

    def end_attempt(self, lost, now_ms: int, out: Ready) -> None:
        """GA7: a rank neither replaced nor shrunk away: the attempt ends as a refusal ends it
        (GA4), and the gang is placed afresh."""
        gang = self.jobs.get(self.worker_of[lost.job_id][0])
        self._stop_workers(gang.job_id, "pending", now_ms, out)
        attempt = next_attempt(gang.attempt, gang.manifest, refused=True)
        if attempt is None:
            gang.state, gang.hint = "failed", "a rank's node was lost and no replacement fits, no retry left"
        else:
            self.lifecycle.place_again(gang, attempt, gang.outcome, now_ms, out)
        out.events.append(self.ctx.event("gang_not_repaired", now_ms, job_id=gang.job_id.hex(), state=gang.state))

    def worker_refused(self, record, data: bytes, now_ms: int, out: Ready) -> bool:
        """A rank's node refused it (R1): the whole attempt ends and the gang is placed afresh.
        False when ``record`` is no gang's worker."""
        found = self.worker_of.get(record.job_id)
        if found is None:
            return False
        gang = self.jobs.get(found[0])
        self._stop_workers(gang.job_id, "pending", now_ms, out)
        attempt = next_attempt(gang.attempt, gang.manifest, refused=True)
        if attempt is None:
            gang.state, gang.hint = "failed", "refused by its workers' nodes for want of capacity, no retry left"
        else:
            self.lifecycle.place_again(gang, attempt, data, now_ms, out)
        out.events.append(self.ctx.event("gang_refused", now_ms, job_id=gang.job_id.hex(), rank=found[1],
                                         attempt=gang.attempt, state=gang.state))
        return True

    def worker_finished(self, record, code: int, data: bytes, now_ms: int, out: Ready) -> bool:
        """A rank exited: done when every rank completed; a failure ends the attempt (P6 for
        the gang). False when ``record`` is no gang's worker."""
        found = self.worker_of.get(record.job_id)
        if found is None:
            return False
        gang = self.jobs.get(found[0])
        record.exit_code = code
        if code == 0:
            record.state = "completed"
            if all(w.state == "completed" for w in self.worker_records(gang.job_id)):
                gang.state, gang.exit_code = "completed", 0
        else:
            record.state = "failed"
            gang.exit_code = code
            attempt = next_attempt(gang.attempt, gang.manifest, refused=False)
            self._stop_workers(gang.job_id, "pending" if attempt is not None else "failed", now_ms, out)
            if attempt is None:
                gang.state = "failed"
            else:
                self.lifecycle.place_again(gang, attempt, data, now_ms, out)
        out.events.append(self.ctx.event("gang_worker_exited", now_ms, job_id=gang.job_id.hex(), rank=found[1],
                                         exit_code=code, state=gang.state))
        return True
