"""The resource ledger: the one place a node counts its capacity, per GPU, CPU and
memory (SPEC.md 7, R1). Reservations hold capacity for bids, allocations for the
jobs this node is the primary of. A node bids only what it holds free, which is why
concurrent placement instances can never over-commit it.

The capacity rule (R1): reserved + allocated never exceed capacity, no GPU is held by
two claims, and a node runs a job only while it holds its allocation. So:

- a bid's reservation is held for as long as the bid can still be decided: until this
  node applies its instance's decision (it becomes the allocation, or is released), the
  instance gives up or is dropped here, or the job is cancelled. It has no deadline
  while its instance may run here, and it is persisted (table ``reservations``) before
  the bid is sent, so a restarted node never promises the same capacity twice;
- a job that becomes this node's without a reservation (a migration onto a backup, a
  placement whose reservation is gone) is allocated only if it fits now
  (``allocate_now``); if it does not, the node refuses the job (job_lifecycle.py: a
  signed refusal, and the job is placed afresh) and never runs it;
- a restart rebuilds the ledger from the final job table (``clear``, then the live jobs
  this node is primary of, then the persisted reservations), never from the intermediate
  states of the history it replays.

Lifecycle of one claim, keyed by the placement key (the instance id, or the job id in a
slot): reserve (bid sent) -> release (another primary decided, instance gave up or was
dropped, job cancelled, or ``expire``: only a reservation restored after a restart whose
instance did not run here again within its lifetime) or allocate (our placement
committed; keyed by job id from then on) -> free (job finished, was refused, evicted
from here, or migrated away).

Invariant (tests/test_placement.py checks it with hypothesis): for every resource,
reserved + allocated <= capacity, and no GPU is held by two claims.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Resources

MAX_CLAIMS = 4096  # outstanding reservations + allocations; a bid beyond it is declined


@dataclass(frozen=True)
class Claim:
    gpus: tuple[int, ...]
    cpu_milli: int
    mem_mib: int
    expires_ms: int | None  # None: held until released (every live bid, every allocation)
    gpu_mem_mib: int = 0    # per GPU, as the job asked (kept so a restored claim asks the same)


class ResourceLedger:
    def __init__(self, gpu_mem_total_mib: tuple[int, ...], cpu_milli: int, mem_mib: int):
        self.gpu_mem_total_mib = tuple(gpu_mem_total_mib)
        self.cpu_milli = cpu_milli
        self.mem_mib = mem_mib
        self._reserved: dict[bytes, Claim] = {}
        self._allocated: dict[bytes, Claim] = {}
        self._held_gpus: set[int] = set()
        self._held_cpu_milli = 0
        self._held_mem_mib = 0
        self.version = 0  # bumps on every change: tells the core its capability vector is stale
        # Reservation changes not persisted yet, (key, claim or None when it went), oldest
        # first: the core persists them with the Ready batch that sends the bids (R1).
        self.journal: list[tuple[bytes, Claim | None]] = []

    # --- views -------------------------------------------------------------------------------
    def free_gpus(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.gpu_mem_total_mib)) if i not in self._held_gpus)

    def free_cpu_milli(self) -> int:
        return self.cpu_milli - self._held_cpu_milli

    def free_mem_mib(self) -> int:
        return self.mem_mib - self._held_mem_mib

    def reserved(self, key: bytes) -> Claim | None:
        return self._reserved.get(key)

    def allocated(self, key: bytes) -> Claim | None:
        return self._allocated.get(key)

    def reservations(self) -> dict[bytes, Claim]:
        return dict(self._reserved)

    def allocations(self) -> dict[bytes, Claim]:
        return dict(self._allocated)

    def held_totals(self) -> tuple[int, int, int]:
        """(GPUs, milli-CPU, MiB) held by reservations and allocations together."""
        return len(self._held_gpus), self._held_cpu_milli, self._held_mem_mib

    # --- transitions -------------------------------------------------------------------------
    def _pick_gpus(self, resources: Resources, free_mem_mib: dict[int, int] | None,
                   prefer: tuple[int, ...] = ()) -> tuple[int, ...] | None:
        free = set(self.free_gpus())
        if prefer and len(prefer) == resources.gpus and set(prefer) <= free:
            return tuple(prefer)  # the GPUs a committed placement (or a persisted bid) names, when still free
        candidates = []
        for index in self.free_gpus():
            free = self.gpu_mem_total_mib[index] if free_mem_mib is None else free_mem_mib.get(index, 0)
            if free >= resources.gpu_mem_mib:
                candidates.append(index)
        if len(candidates) < resources.gpus:
            return None
        return tuple(candidates[:resources.gpus])  # lowest indices: deterministic, packs GPUs

    def _take(self, resources: Resources, expires_ms: int | None,
              free_mem_mib: dict[int, int] | None, prefer: tuple[int, ...] = ()) -> Claim | None:
        if len(self._reserved) + len(self._allocated) >= MAX_CLAIMS:
            return None
        if resources.cpu_milli > self.free_cpu_milli() or resources.mem_mib > self.free_mem_mib():
            return None
        gpus = self._pick_gpus(resources, free_mem_mib, prefer)
        if gpus is None:
            return None
        self._held_gpus.update(gpus)
        self._held_cpu_milli += resources.cpu_milli
        self._held_mem_mib += resources.mem_mib
        self.version += 1
        return Claim(gpus, resources.cpu_milli, resources.mem_mib, expires_ms, resources.gpu_mem_mib)

    def _give_back(self, claim: Claim) -> None:
        self._held_gpus.difference_update(claim.gpus)
        self._held_cpu_milli -= claim.cpu_milli
        self._held_mem_mib -= claim.mem_mib
        self.version += 1

    def reserve(self, key: bytes, resources: Resources, expires_ms: int | None = None,
                free_mem_mib: dict[int, int] | None = None, prefer: tuple[int, ...] = ()) -> Claim | None:
        """Hold capacity for a bid; None if it does not fit. ``expires_ms``: None for a bid
        this node sends now (held until released); a deadline only for a claim restored
        after a restart. Re-reserving a key returns the existing claim (a bid re-sent to a
        new round's leader holds the same GPUs), and a bid made again for it clears a
        restored claim's deadline: its instance runs here again."""
        existing = self._reserved.get(key)
        if existing is not None:
            if expires_ms is None:
                self.keep(key)
            return self._reserved[key]
        if key in self._allocated:
            return None
        claim = self._take(resources, expires_ms, free_mem_mib, prefer)
        if claim is not None:
            self._reserved[key] = claim
            self.journal.append((key, claim))
        return claim

    def keep(self, key: bytes) -> None:
        """A restored reservation's instance runs here again (its bid is re-sent): it is held
        until released, like any live bid's."""
        claim = self._reserved.get(key)
        if claim is not None and claim.expires_ms is not None:
            self._reserved[key] = Claim(claim.gpus, claim.cpu_milli, claim.mem_mib, None, claim.gpu_mem_mib)

    def release(self, key: bytes) -> bool:
        """Drop a reservation (another primary decided, instance gave up). True if one was held."""
        claim = self._reserved.pop(key, None)
        if claim is None:
            return False
        self._give_back(claim)
        self.journal.append((key, None))
        return True

    def allocate(self, key: bytes, job_key: bytes) -> Claim | None:
        """Our placement committed: the reservation for ``key`` becomes ``job_key``'s allocation."""
        existing = self._allocated.get(job_key)
        if existing is not None:
            # Already allocated (a replay or a migration got here first): the reservation is
            # surplus, and overwriting the allocation would leak the capacity it holds.
            self.release(key)
            return existing
        claim = self._reserved.pop(key, None)
        if claim is None:
            return None
        self.journal.append((key, None))
        allocated = Claim(claim.gpus, claim.cpu_milli, claim.mem_mib, None, claim.gpu_mem_mib)
        self._allocated[job_key] = allocated
        return allocated

    def allocate_now(self, job_key: bytes, resources: Resources, free_mem_mib: dict[int, int] | None = None,
                     prefer: tuple[int, ...] = ()) -> Claim | None:
        """Allocate without a reservation (a migrated job moving here, a placement whose
        reservation is gone, a job rebuilt after a restart); None if it does not fit now."""
        if job_key in self._allocated:
            return self._allocated[job_key]
        claim = self._take(resources, None, free_mem_mib, prefer)
        if claim is not None:
            self._allocated[job_key] = claim
        return claim

    def take_on(self, key: bytes | None, job_key: bytes, resources: Resources,
                prefer: tuple[int, ...] = ()) -> Claim | None:
        """The capacity rule for a job this node becomes the primary of: its bid's reservation
        (``key``, the placement key) becomes its allocation, or, with none, what is free now
        (on ``prefer`` when free). None: it does not fit, and the node must refuse the job."""
        claim = self.allocate(key, job_key) if key is not None else None
        return claim if claim is not None else self.allocate_now(job_key, resources, prefer=prefer)

    def free(self, job_key: bytes) -> bool:
        """A job finished, failed, was cancelled, refused or moved away: give its capacity back."""
        claim = self._allocated.pop(job_key, None)
        if claim is None:
            return False
        self._give_back(claim)
        return True

    def expire(self, now_ms: int) -> list[bytes]:
        """Release every reservation whose deadline has passed; return their keys. Only a
        claim restored after a restart has one (``reserve``)."""
        gone = [key for key, claim in self._reserved.items()
                if claim.expires_ms is not None and claim.expires_ms <= now_ms]
        for key in gone:
            self.release(key)
        return gone

    def clear(self) -> None:
        """Forget every claim (a restart rebuilds the ledger from its final job table)."""
        self._reserved.clear()
        self._allocated.clear()
        self._held_gpus.clear()
        self._held_cpu_milli = self._held_mem_mib = 0
        self.journal.clear()
        self.version += 1

    def take_journal(self) -> list[tuple[bytes, Claim | None]]:
        journal, self.journal = self.journal, []
        return journal
