"""A mesh of one member (`meshnode dev`), and the F3 rule that lets it run jobs: a member
halts after a pause only when the others could have evicted it meanwhile (SPEC.md F3).

Driven through MeshCore with an integer clock, as the node driver does: the core is built
when the node starts and its first tick comes after the transport is up, which on a real
node takes far longer than the 200 ms pause that triggers a self-fencing check.
"""

import hashlib
import random

from keys.genesis import DEFAULT_PARAMS, Genesis
from keys.identity import SigningIdentity
from protocol.mesh import MeshCore
from protocol.messages import Constraints, JobManifest, Member, Resources, encode_message, job_id
from protocol.policy import LocalCapacity, NodePolicy

SOLO = SigningIdentity(hashlib.sha256(b"solo-node").digest())
OWNER = SigningIdentity(hashlib.sha256(b"solo-owner").digest())
# Longer than any pause that triggers F3 (min_silence_ms - heartbeat_ms, 200 ms at the defaults).
START_UP_MS = DEFAULT_PARAMS.detection_bound_ms * 3


def genesis_of(*stakes: int) -> tuple[Genesis, list[SigningIdentity]]:
    identities = [SOLO] + [SigningIdentity(hashlib.sha256(b"other-%d" % i).digest()) for i in range(len(stakes) - 1)]
    members = tuple(Member(public_key=i.public_key, stake=s, zone="zone-a", labels=(), addrs=())
                    for i, s in zip(identities, stakes))
    return Genesis(name="solo", created_ms=0, params=DEFAULT_PARAMS, authorities=(), members=members), identities


def core_of(genesis: Genesis, history=()) -> MeshCore:
    return MeshCore(identity=SOLO, genesis=genesis, policy=NodePolicy(zone="zone-a"),
                    capacity=LocalCapacity(gpu_mem_total_mib=(80_000,)), rng=random.Random(7), now_ms=0,
                    history=history)


def signed_job(genesis: Genesis) -> tuple[JobManifest, bytes]:
    job = JobManifest(owner=OWNER.public_key, name="solo-job", nonce=1, entrypoint="counter", args=(),
                      resources=Resources(gpus=1, gpu_mem_mib=1000, cpu_milli=500, mem_mib=512),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=0, backups=0, max_retries=0, created_ms=0, epoch=0)
    return job, encode_message(OWNER, genesis.mesh_id, job)


def kinds(ready) -> list[str]:
    return [d.value_kind for d in ready.decisions]


def test_one_member_started_slowly_places_and_runs_a_job_alone():
    genesis, _ = genesis_of(100)
    core = core_of(genesis)
    first = core.tick(START_UP_MS)
    assert "halt" not in kinds(first) and not core.halted
    job, envelope = signed_job(genesis)
    out = core.submit(envelope, START_UP_MS + 5)
    # Quorum of a one-member epoch is its own stake: its own precommit certifies the placement.
    assert kinds(out) == ["placement", "run"]
    placement = out.decisions[0]
    assert placement.value.primary == SOLO.public_key and placement.certificate
    assert [r.job_id for r in out.decisions[1].value] == [job_id(job)]
    assert core.job_view(job_id(job))["state"] == "placed"


def test_one_member_paused_past_the_bound_keeps_its_job():
    genesis, _ = genesis_of(100)
    core = core_of(genesis)
    core.tick(5)
    job, envelope = signed_job(genesis)
    assert kinds(core.submit(envelope, 10)) == ["placement", "run"]
    core.tick(15)
    after_pause = core.tick(15 + START_UP_MS)
    # Nobody could have evicted it: no halt, no stop order, and nothing to wait for.
    assert kinds(after_pause) == [] and not core.halted
    assert not any(e.kind == "self_fence_check" for e in after_pause.events)


def test_one_member_restarted_with_a_placed_job_resumes_it_at_once():
    genesis, _ = genesis_of(100)
    core = core_of(genesis)
    core.tick(5)
    job, envelope = signed_job(genesis)
    certificate = core.submit(envelope, 10).decisions[0].certificate
    restarted = core_of(genesis, history=(certificate,))
    first = restarted.tick(START_UP_MS)
    assert not restarted.halted
    assert ("resume", (job_id(job),)) in [(d.value_kind, d.value) for d in first.decisions]
    assert [r.job_id for d in first.decisions if d.value_kind == "run" for r in d.value] == [job_id(job)]


def test_who_halts_after_a_pause_follows_the_stake_the_others_hold():
    # Halting waits for a peer's heartbeat; it is needed only if the others could certify an
    # eviction without this node: more than 2/3 of the stake without it (SPEC.md 6.1, F3).
    for stakes, halts in (((100,), False), ((10, 10, 10), False), ((10, 10, 10, 10), True),
                          ((40, 10, 10, 10), False), ((29, 20, 20, 20), True)):
        genesis, _ = genesis_of(*stakes)
        core = core_of(genesis)
        core.tick(5)
        out = core.tick(5 + START_UP_MS)
        assert ("halt" in kinds(out), core.halted) == (halts, halts), stakes
