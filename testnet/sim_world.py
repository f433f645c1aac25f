"""Seeded construction of a simulated mesh (SPEC.md section 11, "World").

Everything is drawn from the one ``random.Random`` the simulator seeds, in a fixed
order: identities (Ed25519 seeds), stakes, zones, labels, policies, capacities, the
attestation authority, job owners and jobs. Same seed, same world, byte for byte.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from keys.genesis import DEFAULT_PARAMS, Genesis, Pool, ProtocolParams, Quota
from keys.identity import SigningIdentity
from protocol.gpu_shares import MILLI_PER_GPU
from protocol.messages import (GANG_TOPOLOGIES, Attestation, Constraints, Gang, JobManifest, Member, Resources,
                               Scheduling, encode_message, job_id)
from protocol.policy import LocalCapacity, NodePolicy

ZONES = ("eu-west", "eu-central", "us-east")
ENTRYPOINTS = ("counter", "train")
GPU_MEM_MIB = 81920
GENESIS_MS = 1_700_000_000_000  # a fixed wall-clock-like origin; virtual time starts at 0

# Shorter timeouts than DEFAULT_PARAMS keep simulated runs short; the liveness bound of
# the simulator is stated in terms of these (SimConfig.liveness_bound_ms).
SIM_PARAMS = ProtocolParams(
    heartbeat_ms=DEFAULT_PARAMS.heartbeat_ms, checkpoint_ms=DEFAULT_PARAMS.checkpoint_ms,
    checkpoint_keep=DEFAULT_PARAMS.checkpoint_keep, detection_bound_ms=DEFAULT_PARAMS.detection_bound_ms,
    round_timeout_ms=DEFAULT_PARAMS.round_timeout_ms, round_timeout_max_ms=1600,
    bid_window_ms=DEFAULT_PARAMS.bid_window_ms, max_rounds=DEFAULT_PARAMS.max_rounds, placement_slot_ms=0,
)


@dataclass
class NodeSpec:
    index: int
    identity: SigningIdentity
    stake: int
    zone: str
    labels: tuple
    policy: NodePolicy
    capacity: LocalCapacity
    attested: tuple  # attributes the authority attested (sorted pairs)


@dataclass
class JobSpec:
    job: JobManifest
    envelope: bytes
    job_id: bytes
    submit_ms: int


@dataclass
class World:
    genesis: Genesis
    nodes: list[NodeSpec]
    authority: SigningIdentity
    owners: list[SigningIdentity]
    jobs: list[JobSpec]
    byzantine: set[int]

    @property
    def mesh_id(self) -> bytes:
        return self.genesis.mesh_id

    def byzantine_stake_fraction(self) -> tuple[int, int]:
        return sum(self.nodes[i].stake for i in self.byzantine), self.genesis.total_stake


def _identity(rng: random.Random) -> SigningIdentity:
    return SigningIdentity(rng.getrandbits(256).to_bytes(32, "big"))


def choose_byzantine(rng: random.Random, stakes: list[int], fraction_milli: int) -> set[int]:
    """Nodes whose stake makes up the requested share of the total.

    Under 1/3 (``3 * share < 1000``) the share is an upper bound that is never reached or
    passed, so a normal run is always strictly under 1/3. At or above 1/3 it is a lower
    bound, so a ``--byzantine 0.34`` run really does hold at least a third.
    """
    total = sum(stakes)
    order = list(range(len(stakes)))
    rng.shuffle(order)
    chosen: set[int] = set()
    held = 0
    at_least = 3 * fraction_milli >= 1000
    for index in order:
        if at_least:
            if held * 1000 >= fraction_milli * total:
                break
        elif (held + stakes[index]) * 1000 >= fraction_milli * total or 3 * (held + stakes[index]) >= total:
            continue
        chosen.add(index)
        held += stakes[index]
    return chosen


def build_world(rng: random.Random, n: int, jobs: int, byzantine_milli: int, submit_window_ms: int,
                params: ProtocolParams = SIM_PARAMS, fractional_per_mille: int = 0, quota_gpus: int = 0,
                reservations: bool = False, preempt: bool = False) -> World:
    """``quota_gpus`` > 0: the default pool limits each owner to that many GPUs (SPEC.md 5.5);
    ``reservations``: Q5 on. Neither draws from ``rng``: a seed's world is the same with them.
    ``preempt``: a preemption workload (``meshnode sim --preempt``): every job asks for
    GPUs, more than fit at once, with mixed priorities, and about half are preemptible."""
    if n < 1:
        raise ValueError("a mesh needs at least one node")
    authority = _identity(rng)
    identities = [_identity(rng) for _ in range(n)]
    stakes = [rng.randint(1, 10) * 100 for _ in range(n)]
    # Round-robin zones (at least two whenever n >= 2), so zone constraints are satisfiable.
    zone_count = min(len(ZONES), max(1, n if n < 3 else 3))
    zones = [ZONES[i % zone_count] for i in range(n)]
    owners = [_identity(rng) for _ in range(3)]
    nodes = []
    for i, identity in enumerate(identities):
        tier = "gold" if rng.randrange(3) == 0 else "std"
        labels = (("tier", tier),)
        attested = (("zone", zones[i]),)
        attestation = encode_message(authority, bytes(32), Attestation(
            subject=identity.public_key, attributes=attested, stake=0, issued_ms=0, expires_ms=1 << 62))
        # Most nodes take any owner; some refuse one, so declines happen and are checked.
        allowed_owners = None
        if rng.randrange(4) == 0:
            allowed_owners = frozenset(o.public_key for o in owners[: rng.randint(1, 2)])
        policy = NodePolicy(allowed_owners=allowed_owners, allowed_entrypoints=frozenset(ENTRYPOINTS),
                            zone=zones[i], labels=labels, attestations=(attestation,))
        capacity = LocalCapacity(gpu_mem_total_mib=(GPU_MEM_MIB,) * rng.choice((2, 4, 8)),
                                 cpu_milli=rng.choice((16000, 32000, 64000)),
                                 mem_mib=rng.choice((65536, 131072, 262144)), gpu_model="sim-h100",
                                 rail_group="rail-%d" % (i % 4))
        nodes.append(NodeSpec(i, identity, stakes[i], zones[i], labels, policy, capacity, attested))
    members = tuple(Member(public_key=s.identity.public_key, stake=s.stake, zone=s.zone, labels=s.labels,
                           addrs=("/sim/%d" % s.index,)) for s in nodes)
    pools = (Pool(name="", default=Quota(gpu_milli=quota_gpus * MILLI_PER_GPU)),) if quota_gpus else ()
    genesis = Genesis(name="sim-%d" % n, created_ms=GENESIS_MS, members=members, params=params,
                      authorities=(authority.public_key,), pools=pools, reservations=reservations)
    byzantine = choose_byzantine(rng, stakes, byzantine_milli) if byzantine_milli else set()
    honest = [s for s in nodes if s.index not in byzantine]
    mesh_id = genesis.mesh_id  # a property that hashes the whole genesis: compute it once
    job_specs = [make_job(rng, mesh_id, owners, nodes, honest, index, jobs, submit_window_ms,
                          stamp_submit_time=params.placement_slot_ms > 0, fractional_per_mille=fractional_per_mille,
                          preempt=preempt)
                 for index in range(jobs)]
    job_specs.sort(key=lambda j: j.submit_ms)
    return World(genesis, nodes, authority, owners, job_specs, byzantine)


def owner_and_constraints_fit(job: JobManifest, policy: NodePolicy, zone: str, labels) -> bool:
    """The job's owner is one the policy accepts, and the node's true zone and labels meet
    the job's constraints (the simulator's truth, not what a node claims)."""
    if policy.allowed_owners is not None and job.owner not in policy.allowed_owners:
        return False
    if job.constraints.zones and zone not in job.constraints.zones:
        return False
    have = dict(labels)
    return all(have.get(key) == wanted for key, wanted in job.constraints.labels)


def honest_fit(job: JobManifest, node: NodeSpec) -> bool:
    """Whether an empty honest node would take this job (its policy and its signed facts)."""
    return (owner_and_constraints_fit(job, node.policy, node.zone, node.labels)
            and len(node.capacity.gpu_mem_total_mib) >= job.resources.gpus)


def make_job(rng: random.Random, mesh_id: bytes, owners: list[SigningIdentity], nodes: list[NodeSpec],
             honest: list[NodeSpec], index: int, total_jobs: int, submit_window_ms: int,
             stamp_submit_time: bool = False, fractional_per_mille: int = 0, preempt: bool = False) -> JobSpec:
    """A signed job that at least one honest node accepts; sized so all jobs fit together.
    ``stamp_submit_time``: its owner stamps ``created_ms`` when it submits the job, as real
    clients do (which slot places it depends on it, SPEC.md P7); otherwise the job's index.

    Constraints are drawn, then dropped if no honest node would take the job: a job that
    only a Byzantine node could run may rightly stay pending, which would blur the
    liveness check.
    """
    job = _draw_job(rng, owners, nodes, index, total_jobs)
    if preempt:
        job = _preemption_job(rng, job)
    if fractional_per_mille and rng.randrange(1000) < fractional_per_mille:
        job = _as_share_job(rng, job, nodes, total_jobs)
    if honest and not any(honest_fit(job, s) for s in honest):
        host = rng.choice(honest)
        owner_key = job.owner
        if host.policy.allowed_owners is not None and owner_key not in host.policy.allowed_owners:
            owner_key = min(host.policy.allowed_owners)
        resources = job.resources
        if len(host.capacity.gpu_mem_total_mib) < resources.gpus:
            resources = Resources(gpus=0, gpu_mem_mib=0, cpu_milli=resources.cpu_milli, mem_mib=resources.mem_mib)
        job = replace(job, owner=owner_key, resources=resources, strategy="throughput",
                      constraints=Constraints(zones=(), labels=(), attested=()))
    owner = next(o for o in owners if o.public_key == job.owner)
    submit_ms = rng.randint(0, submit_window_ms)
    if stamp_submit_time:
        job = replace(job, created_ms=GENESIS_MS + submit_ms)
    return JobSpec(job, encode_message(owner, mesh_id, job), job_id(job), submit_ms)


# Shares a fractional job asks for (SPEC.md P4c): sizes the Alibaba trace's sharing tasks use.
SHARE_SIZES_MILLI = (100, 250, 250, 500, 750)


def _as_share_job(rng: random.Random, job: JobManifest, nodes: list[NodeSpec], total_jobs: int) -> JobManifest:
    """The job asking for a share of one GPU instead, while the mesh's GPUs can hold every
    job at its largest share (so all jobs still fit together); a third of them pack."""
    gpus_total = sum(len(s.capacity.gpu_mem_total_mib) for s in nodes)
    if total_jobs * max(SHARE_SIZES_MILLI) > gpus_total * 1000:
        return job
    resources = replace(job.resources, gpus=1, gpu_milli=rng.choice(SHARE_SIZES_MILLI), gpu_mem_mib=1024,
                        gpu_model=rng.choice(("", "sim-h100")))
    strategy = "pack" if job.strategy != "sovereign" and rng.randrange(3) else job.strategy
    return replace(job, resources=resources, strategy=strategy)


PREEMPT_PRIORITIES = (0, 100, 500, 900)


def _preemption_job(rng: random.Random, job: JobManifest) -> JobManifest:
    """The job with GPUs whatever the mesh holds, a priority from PREEMPT_PRIORITIES and,
    one time in two, preemptible (SPEC.md P8): draws made only with ``--preempt``, so
    the other runs keep their seeds' worlds."""
    resources = replace(job.resources, gpus=rng.choice((1, 1, 2)), gpu_mem_mib=rng.choice((8192, 16384, 40960)))
    return replace(job, resources=resources, priority=rng.choice(PREEMPT_PRIORITIES),
                   scheduling=Scheduling(preemptible=rng.randrange(2) == 0))


def _draw_job(rng: random.Random, owners: list[SigningIdentity], nodes: list[NodeSpec], index: int,
              total_jobs: int) -> JobManifest:
    owner = rng.choice(owners)
    gpus_total = sum(len(s.capacity.gpu_mem_total_mib) for s in nodes)
    # Jobs that need GPUs only while GPUs are plentiful relative to the number of jobs.
    gpus = rng.choice((0, 1, 1, 2)) if total_jobs * 4 <= gpus_total else 0
    resources = Resources(gpus=gpus, gpu_mem_mib=rng.choice((8192, 16384, 40960)) if gpus else 0,
                          cpu_milli=rng.choice((500, 1000, 2000)), mem_mib=rng.choice((1024, 2048, 4096)))
    strategy = rng.choice(("latency", "throughput", "sovereign"))
    zones: tuple = ()
    labels: tuple = ()
    if strategy == "sovereign" or rng.randrange(4) == 0:
        present = sorted({s.zone for s in nodes})
        zones = tuple(rng.sample(present, k=min(len(present), 2)))
    if rng.randrange(8) == 0:
        labels = (("tier", "std"),)
    return JobManifest(owner=owner.public_key, name="job-%d" % index, nonce=rng.getrandbits(32),
                       entrypoint=rng.choice(ENTRYPOINTS), args=("--steps", str(rng.randint(10, 1000))),
                       resources=resources, strategy=strategy,
                       constraints=Constraints(zones=zones, labels=labels, attested=()),
                       priority=rng.randint(0, 10), backups=rng.randint(0, 2), max_retries=3,
                       created_ms=GENESIS_MS + index, epoch=0)


def with_gangs(world: World, rng: random.Random, per_mille: int) -> World:
    """``per_mille`` of the world's jobs become gangs (SPEC.md GA1), drawn from ``rng`` alone
    so a run without gangs keeps its seed's world: 2 or 3 workers, or elastic 2..4, each
    CPU-only (every rank on its own node), any topology, constraints and policy as drawn."""
    jobs = []
    for spec in world.jobs:
        if rng.randrange(1000) >= per_mille:
            jobs.append(spec)
            continue
        if rng.randrange(2):
            gang = Gang(workers=rng.choice((2, 3)), topology=rng.choice(GANG_TOPOLOGIES))
        else:
            gang = Gang(workers=0, min_workers=2, max_workers=4, topology=rng.choice(GANG_TOPOLOGIES))
        resources = Resources(gpus=0, gpu_mem_mib=0, cpu_milli=spec.job.resources.cpu_milli,
                              mem_mib=spec.job.resources.mem_mib)
        job = replace(spec.job, resources=resources, gang=gang, name="gang-" + spec.job.name)
        owner = next(o for o in world.owners if o.public_key == job.owner)
        jobs.append(JobSpec(job, encode_message(owner, world.mesh_id, job), job_id(job), spec.submit_ms))
    return replace(world, jobs=jobs)
