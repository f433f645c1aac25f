"""The resource ledger: the one place a node counts its capacity, per GPU in thousandths,
CPU and memory (SPEC.md 7, R1, P4c). Reservations hold capacity for bids, allocations for the
jobs this node is the primary of. A node bids only what it holds free, which is why
concurrent placement instances can never over-commit it.

The capacity rule (R1): reserved + allocated never exceed capacity, the claims' milli on
one GPU never sum past 1000 (a whole-GPU claim holds all 1000 of each GPU it names; a share,
``Resources.gpu_milli``, holds that much of one GPU), and a node runs a job only while it
holds its allocation. The per-GPU counting is protocol/gpu_shares.py's NodeShares, the same
accounting ``meshnode replay`` places the Alibaba trace with. So:

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
reserved + allocated <= capacity, and on every GPU the claims' milli sum to at most 1000.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.gpu_shares import MILLI_PER_GPU, NodeShares, TaskDemand
from protocol.messages import Resources

MAX_CLAIMS = 4096  # outstanding reservations + allocations; a bid beyond it is declined


@dataclass(frozen=True)
class Claim:
    gpus: tuple[int, ...]
    cpu_milli: int
    mem_mib: int
    expires_ms: int | None  # None: held until released (every live bid, every allocation)
    gpu_mem_mib: int = 0    # per GPU, as the job asked (kept so a restored claim asks the same)
    gpu_milli: int = 0      # as Resources.gpu_milli: 0 = the named GPUs whole, 1..999 = that share of one

    @property
    def gpu_milli_each(self) -> int:
        """The thousandths this claim holds on each GPU it names."""
        return self.gpu_milli or MILLI_PER_GPU

    def unexpiring(self) -> "Claim":
        return Claim(self.gpus, self.cpu_milli, self.mem_mib, None, self.gpu_mem_mib, self.gpu_milli)


def demand_of(resources: Resources) -> TaskDemand:
    """A job's resources as the per-GPU accounting's demand (no model: the ledger's caller
    offers only GPUs of the job's model, ``fitting``)."""
    if resources.gpu_milli:
        return TaskDemand.fractional(resources.cpu_milli, resources.mem_mib, resources.gpu_milli)
    return TaskDemand.whole(resources.cpu_milli, resources.mem_mib, resources.gpus)


def claim_demand(claim: Claim) -> TaskDemand:
    return TaskDemand(claim.cpu_milli, claim.mem_mib, len(claim.gpus), claim.gpu_milli_each if claim.gpus else 0)


class ResourceLedger:
    def __init__(self, gpu_mem_total_mib: tuple[int, ...], cpu_milli: int, mem_mib: int, gpu_model: str = ""):
        self.gpu_mem_total_mib = tuple(gpu_mem_total_mib)
        self.gpu_model = gpu_model   # "" when unknown: then a job's model is checked only by its bid (P4c)
        self.cpu_milli = cpu_milli
        self.mem_mib = mem_mib
        self._reserved: dict[bytes, Claim] = {}
        self._allocated: dict[bytes, Claim] = {}
        self._shares = self._fresh_shares()
        self.version = 0  # bumps on every change: tells the core its capability vector is stale
        self.allocations_version = 0   # bumps when a job's allocation comes or goes (workload_orders.py)
        # ... and which jobs' (taken by the workload orders, which recount only those).
        self.allocations_changed: set[bytes] = set()
        # Reservation changes not persisted yet, (key, claim or None when it went), oldest
        # first: the core persists them with the Ready batch that sends the bids (R1).
        self.journal: list[tuple[bytes, Claim | None]] = []

    def _fresh_shares(self) -> NodeShares:
        # Negative capacity (a misconfigured node) holds nothing rather than failing here.
        return NodeShares("ledger", "", len(self.gpu_mem_total_mib), max(0, self.cpu_milli), max(0, self.mem_mib))

    # --- views -------------------------------------------------------------------------------
    def free_gpus(self) -> tuple[int, ...]:
        """The GPUs no claim holds any share of (whole GPUs free)."""
        return tuple(i for i, free in enumerate(self._shares.gpu_milli_free) if free == MILLI_PER_GPU)

    def gpu_milli_free(self) -> tuple[int, ...]:
        """Free thousandths of each GPU, by index (SPEC.md P1: the vector's ``gpu_milli_free``)."""
        return tuple(self._shares.gpu_milli_free)

    def free_cpu_milli(self) -> int:
        return self._shares.cpu_milli_free

    def free_mem_mib(self) -> int:
        return self._shares.memory_mib_free

    def reserved(self, key: bytes) -> Claim | None:
        return self._reserved.get(key)

    def allocated(self, key: bytes) -> Claim | None:
        return self._allocated.get(key)

    def reservations(self) -> dict[bytes, Claim]:
        return dict(self._reserved)

    def allocations(self) -> dict[bytes, Claim]:
        return dict(self._allocated)

    def held_totals(self) -> tuple[int, int, int]:
        """(GPUs held wholly or in part, milli-CPU, MiB) held by reservations and allocations together."""
        shares = self._shares
        return (sum(1 for free in shares.gpu_milli_free if free < MILLI_PER_GPU),
                shares.cpu_milli_total - shares.cpu_milli_free, shares.memory_mib_total - shares.memory_mib_free)

    def held_gpu_milli(self) -> tuple[int, ...]:
        """Thousandths held on each GPU, by index, counted from the claims themselves (not from
        the free counters), so a check of R1 against it tests the accounting."""
        held = [0] * len(self.gpu_mem_total_mib)
        for claim in list(self._reserved.values()) + list(self._allocated.values()):
            for index in claim.gpus:
                held[index] += claim.gpu_milli_each
        return tuple(held)

    # --- transitions -------------------------------------------------------------------------
    def _pick_gpus(self, demand: TaskDemand, gpu_mem_mib: int, free_mem_mib: dict[int, int] | None,
                   prefer: tuple[int, ...] = ()) -> tuple[int, ...] | None:
        """Which GPUs a claim takes: ``prefer`` (the GPUs a committed placement or a persisted
        bid names) when they still fit; else, for whole GPUs, the lowest-index wholly free
        ones, and for a share the fullest GPU it fits (least free milli, then lowest index:
        shares pack onto started GPUs and leave whole ones free, SPEC.md R1). A GPU fits when
        its free memory (``free_mem_mib``, -1 for one the caller rules out) holds the ask."""
        milli_free = self._shares.gpu_milli_free
        need = demand.gpu_milli_each

        def fits(index: int) -> bool:
            memory = self.gpu_mem_total_mib[index] if free_mem_mib is None else free_mem_mib.get(index, -1)
            return 0 <= index < len(milli_free) and milli_free[index] >= need and memory >= gpu_mem_mib

        if prefer and len(prefer) == demand.gpu_count and len(set(prefer)) == len(prefer) \
                and all(0 <= i < len(milli_free) and milli_free[i] >= need for i in prefer):
            return tuple(sorted(prefer))
        candidates = [i for i in range(len(milli_free)) if fits(i)]
        if len(candidates) < demand.gpu_count:
            return None
        if demand.is_fractional:
            return (min(candidates, key=lambda i: (milli_free[i], i)),)
        return tuple(candidates[:demand.gpu_count])  # lowest indices: deterministic, packs GPUs

    def _take(self, key: tuple, resources: Resources, expires_ms: int | None,
              free_mem_mib: dict[int, int] | None, prefer: tuple[int, ...] = ()) -> Claim | None:
        if len(self._reserved) + len(self._allocated) >= MAX_CLAIMS:
            return None
        demand = demand_of(resources)
        if demand.cpu_milli > self.free_cpu_milli() or demand.memory_mib > self.free_mem_mib():
            return None
        if demand.gpu_count and resources.gpu_model and self.gpu_model and resources.gpu_model != self.gpu_model:
            return None
        gpus = self._pick_gpus(demand, resources.gpu_mem_mib, free_mem_mib, prefer)
        if gpus is None:
            return None
        self._shares.allocate(key, demand, gpus)   # refuses (ShareError) anything that overcommits
        self.version += 1
        return Claim(gpus, resources.cpu_milli, resources.mem_mib, expires_ms, resources.gpu_mem_mib,
                     resources.gpu_milli)

    def _give_back(self, key: tuple) -> None:
        self._shares.free(key)
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
        claim = self._take(("reserved", key), resources, expires_ms, free_mem_mib, prefer)
        if claim is not None:
            self._reserved[key] = claim
            self.journal.append((key, claim))
        return claim

    def keep(self, key: bytes) -> None:
        """A restored reservation's instance runs here again (its bid is re-sent): it is held
        until released, like any live bid's."""
        claim = self._reserved.get(key)
        if claim is not None and claim.expires_ms is not None:
            self._reserved[key] = claim.unexpiring()

    def release(self, key: bytes) -> bool:
        """Drop a reservation (another primary decided, instance gave up). True if one was held."""
        claim = self._reserved.pop(key, None)
        if claim is None:
            return False
        self._give_back(("reserved", key))
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
        # The same capacity changes hands: freed and taken again on the same GPUs at once.
        self._shares.free(("reserved", key))
        self._shares.allocate(("allocated", job_key), claim_demand(claim), claim.gpus)
        allocated = claim.unexpiring()
        self._allocated[job_key] = allocated
        self.allocations_version += 1
        self.allocations_changed.add(job_key)
        return allocated

    def allocate_now(self, job_key: bytes, resources: Resources, free_mem_mib: dict[int, int] | None = None,
                     prefer: tuple[int, ...] = ()) -> Claim | None:
        """Allocate without a reservation (a migrated job moving here, a placement whose
        reservation is gone, a job rebuilt after a restart); None if it does not fit now."""
        if job_key in self._allocated:
            return self._allocated[job_key]
        claim = self._take(("allocated", job_key), resources, None, free_mem_mib, prefer)
        if claim is not None:
            self._allocated[job_key] = claim
            self.allocations_version += 1
            self.allocations_changed.add(job_key)
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
        self.allocations_version += 1
        self.allocations_changed.add(job_key)
        self._give_back(("allocated", job_key))
        return True

    def next_expiry_ms(self) -> int | None:
        """When ``expire`` next releases something (None: no claim expires)."""
        return min((c.expires_ms for c in self._reserved.values() if c.expires_ms is not None), default=None)

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
        self.allocations_changed.update(self._allocated)
        self._allocated.clear()
        self.allocations_version += 1
        self._shares = self._fresh_shares()
        self.journal.clear()
        self.version += 1

    def take_allocations_changed(self) -> set[bytes]:
        """The job keys whose allocation came or went since the last call."""
        changed, self.allocations_changed = self.allocations_changed, set()
        return changed

    def take_journal(self) -> list[tuple[bytes, Claim | None]]:
        journal, self.journal = self.journal, []
        return journal
