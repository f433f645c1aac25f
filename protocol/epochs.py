"""Epochs: the membership this node is in, the views of recent epochs, and the
certificates that ended them (SPEC.md 5, F4-F7).

An epoch ends by exactly one decided epoch change (an eviction or a join), so the
certificate that ended each epoch is kept: it answers syncs and lets a placement decided
late in an older epoch replay the evictions since (P5). A certificate of an epoch this
node has not reached cannot be verified yet; a few are held until it gets there.
"""

from __future__ import annotations

from protocol.quorum import EpochView
from protocol.ready import Event, PersistRecord, Ready

MAX_EPOCH_CERTIFICATES = 64    # epoch-change certificates kept to answer syncs
MAX_FUTURE_CERTIFICATES = 16   # epochs not reached yet whose certificates are held for later
MAX_HELD_PER_EPOCH = 4         # certificates held per such epoch (unverified until it is reached)
VIEWS_KEPT = 8                 # epoch views a core holds (the newest): older epochs' votes are never read
MAX_OLDER_VIEWS_KEPT = 16      # older views kept besides, for jobs that may be placed again in them (GA10)


class Epochs:
    def __init__(self, genesis, me: bytes, counters) -> None:
        self.me = me
        self.counters = counters
        self.view = EpochView.from_genesis(genesis)
        self.views: dict[int, EpochView] = {self.view.epoch: self.view}
        self.member_info = {m.public_key: m for m in genesis.members}
        self.certificates: list[tuple[int, bytes]] = []      # (epoch it ended, certificate)
        self.future_certificates: dict[int, list[bytes]] = {}
        # Epochs older than the newest VIEWS_KEPT whose views must stay: a gang that may be
        # placed again names one (its attempts run in its job's epoch, P2; GA10). The core sets it.
        self.views_needed = frozenset

    @property
    def epoch(self) -> int:
        return self.view.epoch

    def view_for(self, epoch: int) -> EpochView | None:
        return self.views.get(epoch)

    def is_member(self) -> bool:
        return self.me in self.view.stakes

    def member_records(self) -> list:
        return [self.member_info[key] for key in self.view.members if key in self.member_info]

    def broadcast_targets(self) -> list[bytes]:
        """Who ``Outbound(to=None)`` means: every other member of the current epoch."""
        return [key for key in self.view.members if key != self.me]

    def certificates_since(self, epoch: int) -> list[bytes]:
        return [c for e, c in self.certificates if e >= epoch]

    def enter(self, view: EpochView, certificate: bytes, now_ms: int, out: Ready) -> EpochView:
        """Move to ``view``, ended by ``certificate``; returns the view left."""
        old = self.view
        self.certificates.append((old.epoch, certificate))
        del self.certificates[:-MAX_EPOCH_CERTIFICATES]
        self.view = view
        self.views[view.epoch] = view
        older = sorted(self.views)[:-VIEWS_KEPT]
        needed = set(sorted(set(older) & set(self.views_needed()))[-MAX_OLDER_VIEWS_KEPT:])
        for epoch in older:
            if epoch not in needed:
                del self.views[epoch]
        # The store keeps the votes of those epochs' undecided instances as well (SPEC 6.9).
        out.persist.append(PersistRecord("membership", str(view.epoch), {"epoch": view.epoch,
                                                                         "certificate": certificate,
                                                                         "older_views": sorted(needed)}))
        out.events.append(Event("epoch", now_ms, {"epoch": view.epoch, "members": len(view.members)}))
        return old

    def hold_future_certificate(self, epoch: int, signer: bytes, data: bytes) -> None:
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
