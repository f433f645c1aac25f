"""One epoch's membership as the consensus sees it: stake, quorums, leaders (SPEC.md 6.1-6.2).

Quorum is strictly more than 2/3 of the epoch's total stake, so two quorums always
share more than 1/3 of the stake, i.e. at least one honest member while Byzantine
stake is under 1/3. All arithmetic is on integers: ``3 * stake > 2 * total``.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

LEADER_DOMAIN = b"meshnode/v1/leader\x00"
VIEW_DOMAIN = b"meshnode/v1/view\x00"
LEADER_CACHE_INSTANCES = 4096  # instances whose later rounds' leaders a view remembers
# SPEC.md 6.11: in an epoch of at most this many members every member sends its votes to
# every member and forms the certificates itself, two sequential hops fewer per decision
# for (n - 1)^2 more vote deliveries per phase: cheap while n is small, quadratic beyond.
VOTES_TO_EVERY_MEMBER_MAX_MEMBERS = 4


@dataclass(frozen=True, eq=False)
class EpochView:
    """Immutable membership of one epoch: public key -> stake (every stake >= 1)."""

    epoch: int
    stakes: Mapping[bytes, int]
    total_stake: int = field(init=False)
    digest: bytes = field(init=False)       # names this exact membership (cache keys, logs)
    _members: tuple = field(init=False, repr=False)     # public keys sorted by their bytes
    _cumulative: tuple = field(init=False, repr=False)  # running stake sums in that order
    _leader_cache: dict = field(init=False, repr=False)  # instance -> leaders of rounds 0..k

    def __post_init__(self):
        if not self.stakes:
            raise ValueError("EpochView: an epoch needs at least one member")
        for key, stake in self.stakes.items():
            if not isinstance(key, bytes) or len(key) != 32:
                raise ValueError("EpochView: member keys are 32-byte public keys")
            if isinstance(stake, bool) or not isinstance(stake, int) or stake < 1:
                raise ValueError("EpochView: every stake is a positive integer")
        members = tuple(sorted(self.stakes))
        cumulative, running = [], 0
        for key in members:
            running += self.stakes[key]
            cumulative.append(running)
        digest = hashlib.sha256(VIEW_DOMAIN + self.epoch.to_bytes(8, "big") + b"".join(
            key + self.stakes[key].to_bytes(8, "big") for key in members)).digest()
        object.__setattr__(self, "stakes", MappingProxyType(dict(self.stakes)))
        object.__setattr__(self, "total_stake", running)
        object.__setattr__(self, "digest", digest)
        object.__setattr__(self, "_members", members)
        object.__setattr__(self, "_cumulative", tuple(cumulative))
        object.__setattr__(self, "_leader_cache", {})

    @classmethod
    def from_genesis(cls, genesis, epoch: int = 0) -> "EpochView":
        """The genesis members are epoch 0 (SPEC.md 5); later epochs come from membership decisions.
        A new view each call (O(n log n)): a view remembers the leaders it drew, and a core's
        view is its own."""
        return cls(epoch, {m.public_key: m.stake for m in genesis.members})

    @property
    def members(self) -> tuple[bytes, ...]:
        return self._members

    @property
    def votes_to_every_member(self) -> bool:
        """Whether votes go to every member, not only to the round's leader (SPEC.md 6.11)."""
        return len(self._members) <= VOTES_TO_EVERY_MEMBER_MAX_MEMBERS

    def is_member(self, key: bytes) -> bool:
        return key in self.stakes

    def stake_of(self, signers: Iterable[bytes]) -> int:
        """Stake of the distinct members among ``signers`` (non-members count 0)."""
        stakes = self.stakes
        return sum(stakes.get(key, 0) for key in set(signers))

    def is_quorum_stake(self, stake: int) -> bool:
        return 3 * stake > 2 * self.total_stake

    def has_quorum(self, signers: Iterable[bytes]) -> bool:
        """Strictly more than 2/3 of the total stake (SPEC.md 6.1)."""
        return self.is_quorum_stake(self.stake_of(signers))

    def exceeds_one_third_stake(self, stake: int) -> bool:
        return 3 * stake > self.total_stake

    def exceeds_one_third(self, signers: Iterable[bytes]) -> bool:
        """More stake than any Byzantine coalition (< 1/3) can hold: at least one honest signer."""
        return self.exceeds_one_third_stake(self.stake_of(signers))

    def leader(self, instance_id: bytes, round: int) -> bytes:
        """Stake-weighted, deterministic leader of ``round`` of ``instance_id`` (SPEC.md 6.2):
        round 0 draws from every member in proportion to stake; each later round from the
        members other than the previous round's leader, so no member leads two rounds in a
        row (a silent or equivocating leader cannot waste consecutive round timeouts)."""
        if round == 0 or len(self._members) == 1:
            return self._draw(instance_id, round, None)
        cache = self._leader_cache
        leaders = cache.get(instance_id)
        if leaders is None:
            if len(cache) >= LEADER_CACHE_INSTANCES:
                cache.clear()
            leaders = cache[instance_id] = [self._draw(instance_id, 0, None)]
        while len(leaders) <= round:
            leaders.append(self._draw(instance_id, len(leaders), leaders[-1]))
        return leaders[round]

    def _draw(self, instance_id: bytes, round: int, excluded: bytes | None) -> bytes:
        digest = hashlib.sha256(LEADER_DOMAIN + instance_id + round.to_bytes(8, "big")).digest()
        if excluded is None:
            x = int.from_bytes(digest, "big") % self.total_stake
            # First member whose cumulative stake is strictly greater than x.
            return self._members[bisect.bisect_right(self._cumulative, x)]
        skip = self.stakes[excluded]
        x = int.from_bytes(digest, "big") % (self.total_stake - skip)
        # The same walk over the members without ``excluded``: an x at or past the start of
        # its stake range moves up by its stake, past that range.
        start = self._cumulative[bisect.bisect_left(self._members, excluded)] - skip
        if x >= start:
            x += skip
        return self._members[bisect.bisect_right(self._cumulative, x)]
