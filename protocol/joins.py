"""Joins (SPEC.md F7): a node asks a member to propose it; the request is relayed once
and stays pending, epoch after epoch, until an epoch change admits it. Stake must be
vouched for: by an authority's attestation, or by endorsements of current members whose
own stake adds up to it. An evicted node that is alive asks to be readmitted the same way.
"""

from __future__ import annotations

from protocol.errors import RemoteProtocolError
from protocol.messages import Attestation, Endorsement, Join, Member, decode_message
from protocol.ready import Outbound, Ready

REJOIN_RETRY_MS = 1000         # an evicted node asks a member to readmit it this often
MAX_PENDING_JOINS = 64         # vouched joins waiting for an epoch change that admits them


class Joins:
    def __init__(self, ctx, epochs) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.epoch_changes = None   # the EpochChangeFlow, set by the core
        self.pending: dict[bytes, tuple] = {}        # joining key -> (Join, envelope), until admitted
        self.evicted_at_epoch: int | None = None      # the epoch whose certificate evicted us, until readmitted
        self.rejoin_sent_ms: int | None = None
        self.rejoin_unvouched_said = False

    def _vouched_stake(self) -> int:
        """The stake an authority attestation in this node's policy vouches for (0: none)."""
        stake = 0
        for data in self.ctx.policy.attestations:
            try:
                envelope, attestation = decode_message(data, self.ctx.mesh_id, expect=Attestation,
                                                       allow_any_mesh=True, caches=self.ctx.caches)
            except RemoteProtocolError:
                continue
            if envelope.signer in self.ctx.authorities and attestation.subject == self.ctx.me:
                stake = max(stake, attestation.stake)
        return stake

    def request_join(self, bootstrap_key: bytes, now_ms: int) -> Ready:
        """Ask ``bootstrap_key`` to propose this node as a member. Stake comes only from the
        vouchers: authority attestations in this node's policy."""
        return Ready(messages=[Outbound(bootstrap_key, self._join_envelope(max(1, self._vouched_stake())))])

    def _join_envelope(self, stake: int) -> bytes:
        policy = self.ctx.policy
        member = Member(public_key=self.ctx.me, stake=stake, zone=policy.zone, labels=policy.labels, addrs=())
        join = Join(member=member, epoch=self.epochs.epoch, vouchers=tuple(policy.attestations[:16]))
        return self.ctx.sign(join)

    def next_rejoin_ms(self, now_ms: int) -> int:
        """When ``maybe_rejoin`` asks again (the tick schedule, SPEC F3a)."""
        return now_ms if self.rejoin_sent_ms is None else self.rejoin_sent_ms + REJOIN_RETRY_MS

    def maybe_rejoin(self, now_ms: int, out: Ready) -> None:
        """SPEC F7 rejoin: an honest node evicted while it looked dead (a crash, a long pause
        or partition) asks one member at a time, every REJOIN_RETRY_MS, to readmit it through
        the ordinary join path, with the stake its authority attestation vouches for. It has
        heard the mesh again by then: that is how it learned of its eviction."""
        if self.rejoin_sent_ms is not None and now_ms - self.rejoin_sent_ms < REJOIN_RETRY_MS:
            return
        self.rejoin_sent_ms = now_ms
        peers = self.epochs.broadcast_targets()
        stake = self._vouched_stake()
        if stake == 0:
            if not self.rejoin_unvouched_said:
                self.rejoin_unvouched_said = True
                out.events.append(self.ctx.event("rejoin_unvouched", now_ms, epoch=self.evicted_at_epoch))
            return
        if not peers:
            return
        peer = self.ctx.rng.choice(peers)
        out.messages.append(Outbound(peer, self._join_envelope(stake)))
        out.events.append(self.ctx.event("rejoin_requested", now_ms, via=peer.hex(), stake=stake,
                                         evicted_at_epoch=self.evicted_at_epoch))

    def on_join(self, envelope, join: Join, data, now_ms: int, out: Ready) -> None:
        counters, view = self.ctx.counters, self.epochs.view
        if envelope.signer != join.member.public_key:
            counters["join_not_self_signed"] += 1
            return
        if not self.epochs.is_member() or join.member.public_key in view.stakes:
            counters["join_ignored"] += 1
            return
        reason = self.check_vouchers(join.member, join.vouchers, view)
        if reason is not None:
            counters["join_unvouched"] += 1
            out.events.append(self.ctx.event("join_refused", now_ms, key=join.member.public_key.hex(),
                                             reason=reason))
            return
        key = join.member.public_key
        if key in self.pending:
            return  # relayed already; it stays pending, epoch after epoch, until admitted
        if len(self.pending) >= MAX_PENDING_JOINS:
            counters["joins_full"] += 1
            return
        self.pending[key] = (join, data)
        out.messages.append(Outbound(None, data))  # relay once, so every member knows it is pending
        self.epoch_changes.start(view, now_ms, out)

    def check_vouchers(self, member: Member, vouchers: tuple, view) -> str | None:
        """SPEC F7: an authority attestation with at least the stake, or endorsements from
        members of this epoch whose own stake sums to at least it. A key never vouches for itself."""
        endorsers = set()
        for data in vouchers:
            try:
                envelope, message = decode_message(data, self.ctx.mesh_id, allow_any_mesh=True, caches=self.ctx.caches)
            except RemoteProtocolError:
                continue
            if envelope.signer == member.public_key:
                continue
            if isinstance(message, Attestation):
                if (envelope.signer in self.ctx.authorities and message.subject == member.public_key
                        and message.stake >= member.stake):
                    return None
            elif isinstance(message, Endorsement) and envelope.mesh_id == self.ctx.mesh_id:
                if (message.candidate == member.public_key and message.epoch == view.epoch
                        and message.stake == member.stake and envelope.signer in view.stakes):
                    endorsers.add(envelope.signer)
        if view.stake_of(endorsers) >= member.stake:
            return None
        return "stake %d is not vouched for by an authority or by endorsing members" % member.stake

    def waiting(self, view) -> list:
        """Pending joins not admitted in ``view``, lowest key first."""
        return [self.pending[k][0] for k in sorted(self.pending) if k not in view.stakes]

    def carry_pending(self, entered: int, now_ms: int, out: Ready) -> None:
        """SPEC F7: a join that lost its epoch's change to another one (an eviction, another
        join) is proposed again in the new epoch, while its vouchers still hold there. Called
        once the change is fully applied (migrations too), unless a held certificate has
        already moved this node past the epoch it entered."""
        epochs = self.epochs
        if epochs.epoch != entered:
            return
        for key, (join, _data) in list(self.pending.items()):
            if key in epochs.view.stakes or self.check_vouchers(join.member, join.vouchers, epochs.view) is not None:
                del self.pending[key]
        if self.pending and epochs.is_member():
            self.epoch_changes.start(epochs.view, now_ms, out)
