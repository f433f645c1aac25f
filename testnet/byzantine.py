"""Byzantine behaviours for the simulator (SPEC.md section 11, "Byzantine nodes").

A Byzantine node runs a real MeshCore; a ``ByzantineBehaviour`` rewrites what that core
sends (and may drop what it receives). Rewritten messages are signed with the node's
own key through ``protocol.messages.sign_message``: a Byzantine node can say anything
under its own name, never under another's. Behaviours:

- ``equivocate``: a Proposal it leads goes out in two versions, one to each half of the
  mesh (a different placement, both validly signed);
- ``double_vote``: a Prevote/Precommit for a value also goes out as a vote for nil (or
  for another value) to half of the recipients; a vote to one recipient is sent twice;
- ``bad_signature``: some messages leave with one signature byte flipped;
- ``lying_capability``: bids carry a re-signed capability vector with inflated free
  capacity (and, sometimes, a zone it is not in);
- ``phantom_bid``: a Decline becomes a Bid for capacity it does not have;
- ``silence``: it sends nothing at all (withholding votes: the case that stalls a mesh
  at >= 1/3 Byzantine stake);
- ``rush_rounds``: with each RoundChange it also tells every peer it is ``RUSH_ROUNDS``
  rounds further on, as a RoundChange and as a RoundSync holding only its own change
  (SPEC.md 6.5: one node under 1/3 must not drag honest nodes ahead; as a round's leader
  it may only end that round early);
- ``claim_placed_job`` (meshes with placement slots only): with each slot certificate it
  sends, it proposes the slot's first job again in that job's own instance, offering the
  certificate that lists it as the proof that the slot left it out (SPEC.md P7c: honest
  nodes must neither start that instance nor vote for it).

Conflicting pairs are remembered, so the simulator can tell which honest node received
both halves of an equivocation and must therefore hold evidence of it.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.messages import (Bid, CapabilityVector, CommitCertificate, Decline, GpuState, JobManifest, Placement,
                               Precommit, Prevote, Proposal, RoundChange, RoundSync, decode_message, decode_value,
                               encode_message, job_id)
from protocol.ready import Outbound, Ready

BEHAVIOURS = ("equivocate", "double_vote", "bad_signature", "lying_capability", "phantom_bid", "silence",
              "rush_rounds")
SLOT_BEHAVIOURS = ("claim_placed_job",)  # drawn only in meshes with placement slots (SPEC.md P7)
RUSH_ROUNDS = 8
BAD_SIGNATURE_PER_MILLE = 200
MAX_TRACKED_PAIRS = 100_000  # conflicting-pair bookkeeping per Byzantine node


class ByzantineBehaviour:
    """Rewrites one Byzantine node's outputs. ``peers``: every other node's public key."""

    def __init__(self, index: int, identity, mesh_id: bytes, behaviours: frozenset[str],
                 rng: random.Random, zones: tuple[str, ...]):
        unknown = set(behaviours) - set(BEHAVIOURS) - set(SLOT_BEHAVIOURS)
        if unknown:
            raise ValueError("unknown Byzantine behaviours: %s" % sorted(unknown))
        self.index = index
        self.identity = identity
        self.mesh_id = mesh_id
        self.behaviours = behaviours
        self.rng = rng
        self.zones = zones
        # envelope bytes -> (pair id, side 0|1, instance): an honest node that receives both
        # sides of one pair while that instance is undecided there has seen this key equivocate.
        self.conflicts: dict[bytes, tuple[int, int, bytes]] = {}
        self.equivocations = 0
        self.forged = 0

    # --- outputs --------------------------------------------------------------------------

    def rewrite(self, ready: Ready, peers: list[bytes]) -> list[Outbound]:
        """The messages this node really sends for one Ready batch."""
        if "silence" in self.behaviours:
            return []
        out: list[Outbound] = []
        for message in ready.messages:
            out.extend(self._rewrite_one(message, peers))
        if "bad_signature" in self.behaviours:
            out = [self._maybe_flip(m) for m in out]
        return out

    def _rewrite_one(self, message: Outbound, peers: list[bytes]) -> list[Outbound]:
        try:
            envelope, body = decode_message(message.data, self.mesh_id)
        except RemoteProtocolError:
            return [message]
        if envelope.signer != self.identity.public_key:
            return [message]  # relayed, not ours: re-signing it is impossible
        if isinstance(body, Proposal) and "equivocate" in self.behaviours:
            other = self._conflicting_proposal(body)
            if other is not None:
                return self._split(message, other, peers, body.instance)
        if isinstance(body, (Prevote, Precommit)) and "double_vote" in self.behaviours:
            return self._split(message, self._conflicting_vote(body), peers, body.instance)
        if isinstance(body, Bid) and "lying_capability" in self.behaviours:
            return [Outbound(message.to, self._lying_bid(body))]
        if isinstance(body, Decline) and "phantom_bid" in self.behaviours:
            return [Outbound(message.to, self._phantom_bid(body))]
        if isinstance(body, RoundChange) and "rush_rounds" in self.behaviours:
            return [message] + self._rushed(body, peers)
        if (isinstance(body, CommitCertificate) and body.value_kind == "placement_slot"
                and "claim_placed_job" in self.behaviours):
            return [message] + [Outbound(peer, self._claim_placed_job(body, message.data)) for peer in peers]
        return [message]

    def _claim_placed_job(self, cert: CommitCertificate, data: bytes) -> bytes:
        """A proposal of the slot's first job in its own instance, "proven" by the very
        certificate that placed it."""
        placement = decode_value("placement_slot", cert.value).placements[0]
        _envelope, job = decode_message(placement.job, self.mesh_id, expect=JobManifest, allow_any_mesh=True)
        forged = replace(placement, primary=self.identity.public_key, backups=())
        self.forged += 1
        return self._sign(Proposal(job_id(job), 0, cert.epoch, "placement", codec.pack(forged.to_body()), (data,),
                                   None, None))

    def _rushed(self, change: RoundChange, peers: list[bytes]) -> list[Outbound]:
        ahead = replace(change, round=min(change.round + RUSH_ROUNDS, 1 << 20), locked_round=None,
                        lock_certificate=None, lock_proposal=None)
        ahead_data = self._sign(ahead)
        sync = self._sign(RoundSync(change.instance, ahead.round, change.epoch, (ahead_data,)))
        return [Outbound(peer, data) for peer in peers for data in (ahead_data, sync)]

    def _split(self, message: Outbound, other: bytes, peers: list[bytes], instance: bytes) -> list[Outbound]:
        """Send ``message`` to one half of its recipients and ``other`` to the other half."""
        pair_id = self.equivocations
        self.equivocations += 1
        if len(self.conflicts) < MAX_TRACKED_PAIRS:
            self.conflicts[message.data] = (pair_id, 0, instance)
            self.conflicts[other] = (pair_id, 1, instance)
        if message.to is not None:
            return [message, Outbound(message.to, other)]  # one recipient gets both: a double vote
        out = []
        for position, peer in enumerate(peers):
            out.append(Outbound(peer, message.data if position % 2 == 0 else other))
        return out

    def _sign(self, record) -> bytes:
        self.forged += 1
        return encode_message(self.identity, self.mesh_id, record)

    def _conflicting_proposal(self, proposal: Proposal) -> bytes | None:
        """The same round's proposal with another placement: swap primary and first backup,
        or, without backups, claim other GPUs."""
        if proposal.value_kind not in ("placement", "placement_slot"):
            return None
        try:
            value = decode_value(proposal.value_kind, proposal.value)
        except RemoteProtocolError:
            return None
        placement = value if proposal.value_kind == "placement" else value.placements[0]
        if placement.backups:
            other = replace(placement, primary=placement.backups[0],
                            backups=(placement.primary,) + tuple(placement.backups[1:]))
        else:
            other = Placement(job=placement.job, primary=self.identity.public_key, backups=(),
                              gpus=tuple(placement.gpus))
            if other == placement:
                other = replace(placement, backups=(hashlib.sha256(placement.primary).digest(),))
        if proposal.value_kind == "placement_slot":  # the slot's first placement changed
            other = replace(value, placements=(other,) + tuple(value.placements[1:]))
        return self._sign(replace(proposal, value=codec.pack(other.to_body())))

    def _conflicting_vote(self, vote) -> bytes:
        if vote.value_hash is None:
            other_hash = hashlib.sha256(b"byzantine" + vote.instance + bytes([vote.round % 256])).digest()
        else:
            other_hash = None
        return self._sign(replace(vote, value_hash=other_hash))

    def _inflated_capability(self, capability: CapabilityVector | None, epoch: int, taken_ms: int) -> bytes:
        gpus = capability.gpus if capability is not None else tuple(
            GpuState(index=i, model="sim-h100", mem_total_mib=81920, mem_used_mib=0, util_milli=0,
                     temp_milli_c=40_000, sm_clock_mhz=1980, throttle_reasons=0, ecc_errors=0, power_mw=100_000)
            for i in range(8))
        zone = capability.zone if capability is not None else self.zones[0]
        if self.rng.randrange(4) == 0:
            zone = self.rng.choice(self.zones)  # a zone it may not be in: only attestation exposes it
        lie = CapabilityVector(
            node=self.identity.public_key, epoch=epoch,
            seq=(capability.seq + 1) if capability is not None else 1, taken_ms=taken_ms, zone=zone,
            rail_group=capability.rail_group if capability is not None else "",
            gpus=tuple(replace(g, mem_used_mib=0) for g in gpus), gpus_free=tuple(g.index for g in gpus),
            cpu_milli_free=1 << 20, mem_mib_free=1 << 24,
            labels=capability.labels if capability is not None else (), simulated=True, running=())
        return self._sign(lie)

    def _lying_bid(self, bid: Bid) -> bytes:
        try:
            _, capability = decode_message(bid.capability, self.mesh_id, expect=CapabilityVector)
        except RemoteProtocolError:
            return self._sign(bid)
        return self._sign(replace(bid, capability=self._inflated_capability(capability, bid.epoch,
                                                                            capability.taken_ms)))

    def _phantom_bid(self, decline: Decline) -> bytes:
        capability = self._inflated_capability(None, decline.epoch, 0)
        return self._sign(Bid(instance=decline.instance, epoch=decline.epoch, capability=capability,
                              reserved_gpus=(), rtt_us=1, attestations=()))

    def _maybe_flip(self, message: Outbound) -> Outbound:
        if self.rng.randrange(1000) >= BAD_SIGNATURE_PER_MILLE:
            return message
        data = bytearray(message.data)
        # The signature is the envelope's last field, so the final byte is always in it.
        data[-1] ^= 0x01
        return Outbound(message.to, bytes(data))
