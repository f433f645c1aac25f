"""Per-GPU accounting with fractional shares (SPEC.md 7, G1).

No IO. A node has G GPUs of one model, each worth ``MILLI_PER_GPU`` (1000) milli; a task
asks for CPU milli, memory MiB and one of three GPU shapes:

* none: ``gpu_count == 0``;
* a share of one GPU: ``gpu_count == 1`` and ``0 < gpu_milli_each < 1000`` (GPU sharing,
  as the Alibaba trace's sharing tasks ask);
* N whole GPUs: ``gpu_count == N >= 1`` and ``gpu_milli_each == 1000``.

An allocation names the GPUs it takes, so two shares of one GPU can be told apart
from shares of two GPUs. Invariant, for every node at every moment (tests check it
with seeded random allocate/free sequences): for each GPU, the milli allocated on it
is at most 1000; allocated CPU and memory are at most the node's; a whole-GPU task's
GPUs hold nothing else.

This module is the accounting only; which node and GPU a task goes to is
protocol/packing.py's decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import LocalProtocolError

MILLI_PER_GPU = 1000
MAX_GPUS_PER_NODE = 64
MAX_TASKS_PER_NODE = 4096  # allocations one node holds at once; beyond it allocate refuses


class ShareError(LocalProtocolError):
    """A demand or an allocation the accounting rules forbid (overcommit, bad shape)."""


@dataclass(frozen=True)
class TaskDemand:
    """What one task asks for. ``gpu_models`` empty means any GPU model will do."""

    cpu_milli: int
    memory_mib: int
    gpu_count: int = 0
    gpu_milli_each: int = 0
    gpu_models: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise ShareError("cpu_milli and memory_mib must be >= 0")
        if self.gpu_count < 0 or self.gpu_count > MAX_GPUS_PER_NODE:
            raise ShareError("gpu_count must be 0..%d, got %d" % (MAX_GPUS_PER_NODE, self.gpu_count))
        if self.gpu_count == 0:
            if self.gpu_milli_each != 0:
                raise ShareError("a task with no GPU asks for 0 gpu milli, got %d" % self.gpu_milli_each)
        elif self.gpu_count == 1:
            if not 0 < self.gpu_milli_each <= MILLI_PER_GPU:
                raise ShareError("a one-GPU task asks for 1..%d gpu milli, got %d"
                                 % (MILLI_PER_GPU, self.gpu_milli_each))
        elif self.gpu_milli_each != MILLI_PER_GPU:
            raise ShareError("a %d-GPU task takes whole GPUs (%d milli each), got %d"
                             % (self.gpu_count, MILLI_PER_GPU, self.gpu_milli_each))

    @classmethod
    def fractional(cls, cpu_milli: int, memory_mib: int, gpu_milli: int,
                   gpu_models: frozenset[str] = frozenset()) -> "TaskDemand":
        return cls(cpu_milli, memory_mib, 1, gpu_milli, gpu_models)

    @classmethod
    def whole(cls, cpu_milli: int, memory_mib: int, gpus: int,
              gpu_models: frozenset[str] = frozenset()) -> "TaskDemand":
        return cls(cpu_milli, memory_mib, gpus, MILLI_PER_GPU if gpus else 0, gpu_models)

    @property
    def is_fractional(self) -> bool:
        return self.gpu_count == 1 and self.gpu_milli_each < MILLI_PER_GPU

    @property
    def gpu_milli_total(self) -> int:
        return self.gpu_count * self.gpu_milli_each

    def allows_model(self, model: str) -> bool:
        return not self.gpu_models or model in self.gpu_models


@dataclass(frozen=True)
class Allocation:
    task_id: object
    gpus: tuple[int, ...]  # GPU indices on the node, ascending
    gpu_milli_each: int
    cpu_milli: int
    memory_mib: int


class NodeShares:
    """The free and allocated resources of one node, per GPU."""

    def __init__(self, name: str, model: str, gpu_count: int, cpu_milli: int, memory_mib: int):
        if not 0 <= gpu_count <= MAX_GPUS_PER_NODE:
            raise ShareError("node %s: gpu count must be 0..%d, got %d" % (name, MAX_GPUS_PER_NODE, gpu_count))
        if cpu_milli < 0 or memory_mib < 0:
            raise ShareError("node %s: cpu_milli and memory_mib must be >= 0" % name)
        self.name = name
        self.model = model
        self.cpu_milli_total = cpu_milli
        self.memory_mib_total = memory_mib
        self.cpu_milli_free = cpu_milli
        self.memory_mib_free = memory_mib
        self.gpu_milli_free = [MILLI_PER_GPU] * gpu_count
        self._allocations: dict[object, Allocation] = {}

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_milli_free)

    @property
    def gpu_milli_free_total(self) -> int:
        return sum(self.gpu_milli_free)

    def allocations(self) -> dict[object, Allocation]:
        return dict(self._allocations)

    def whole_gpus_free(self) -> int:
        return sum(1 for free in self.gpu_milli_free if free == MILLI_PER_GPU)

    def fits(self, demand: TaskDemand) -> bool:
        """Whether some choice of GPUs here can hold ``demand`` now."""
        if demand.cpu_milli > self.cpu_milli_free or demand.memory_mib > self.memory_mib_free:
            return False
        if demand.gpu_count == 0:
            return True
        if not demand.allows_model(self.model):
            return False
        need = demand.gpu_milli_each
        return sum(1 for free in self.gpu_milli_free if free >= need) >= demand.gpu_count

    def default_gpus(self, demand: TaskDemand, gpu_milli_free_of_choice: int | None = None) -> tuple[int, ...]:
        """The GPUs a demand takes here: for a share, the lowest-index GPU whose free milli
        equals ``gpu_milli_free_of_choice`` (the policy's choice; any GPU that fits when
        None); for whole GPUs, the lowest-index wholly free ones. Empty when it fits nowhere."""
        if demand.gpu_count == 0:
            return ()
        need = demand.gpu_milli_each
        if demand.is_fractional:
            for index, free in enumerate(self.gpu_milli_free):
                if free >= need and (gpu_milli_free_of_choice is None or free == gpu_milli_free_of_choice):
                    return (index,)
            return ()
        chosen = tuple(i for i, free in enumerate(self.gpu_milli_free) if free == MILLI_PER_GPU)
        return chosen[:demand.gpu_count] if len(chosen) >= demand.gpu_count else ()

    def allocate(self, task_id: object, demand: TaskDemand, gpus: tuple[int, ...]) -> Allocation:
        """Take ``demand`` on ``gpus`` for ``task_id``; refuses (ShareError) anything that
        would overcommit a GPU, the CPU or the memory, or break the demand's shape."""
        if task_id in self._allocations:
            raise ShareError("node %s: task %r already holds an allocation" % (self.name, task_id))
        if len(self._allocations) >= MAX_TASKS_PER_NODE:
            raise ShareError("node %s: already holds %d tasks" % (self.name, MAX_TASKS_PER_NODE))
        gpus = tuple(sorted(gpus))
        if len(gpus) != demand.gpu_count or len(set(gpus)) != len(gpus):
            raise ShareError("node %s: demand takes %d distinct GPUs, got %r" % (self.name, demand.gpu_count, gpus))
        if gpus and not demand.allows_model(self.model):
            raise ShareError("node %s: model %s is not one of %s" % (self.name, self.model, sorted(demand.gpu_models)))
        if demand.cpu_milli > self.cpu_milli_free or demand.memory_mib > self.memory_mib_free:
            raise ShareError("node %s: not enough CPU or memory for task %r" % (self.name, task_id))
        for index in gpus:
            if not 0 <= index < self.gpu_count:
                raise ShareError("node %s has no GPU %d" % (self.name, index))
            if self.gpu_milli_free[index] < demand.gpu_milli_each:
                raise ShareError("node %s: GPU %d has %d milli free, task %r asks for %d"
                                 % (self.name, index, self.gpu_milli_free[index], task_id, demand.gpu_milli_each))
        for index in gpus:
            self.gpu_milli_free[index] -= demand.gpu_milli_each
        self.cpu_milli_free -= demand.cpu_milli
        self.memory_mib_free -= demand.memory_mib
        allocation = Allocation(task_id, gpus, demand.gpu_milli_each, demand.cpu_milli, demand.memory_mib)
        self._allocations[task_id] = allocation
        return allocation

    def free(self, task_id: object) -> Allocation:
        allocation = self._allocations.pop(task_id, None)
        if allocation is None:
            raise ShareError("node %s holds no allocation for task %r" % (self.name, task_id))
        for index in allocation.gpus:
            self.gpu_milli_free[index] += allocation.gpu_milli_each
        self.cpu_milli_free += allocation.cpu_milli
        self.memory_mib_free += allocation.memory_mib
        return allocation

    def state_key(self) -> tuple:
        """Everything placement scoring may read, with GPUs as a sorted multiset: two nodes
        with equal keys are interchangeable for every policy in protocol/packing.py."""
        return (self.model, self.cpu_milli_total, self.memory_mib_total, self.cpu_milli_free,
                self.memory_mib_free, tuple(sorted(self.gpu_milli_free)))
