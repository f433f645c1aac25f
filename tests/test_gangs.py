"""Gangs (SPEC.md GA1-GA5): manifests, the topology rule and diameter choice, one decision
placing every rank, and a refusal ending the whole attempt. Cores in a small FIFO Net
(tests/test_mesh_core.py's), an integer clock."""

import argparse
import hashlib
import pathlib
import random
from types import SimpleNamespace

import pytest
from rich.console import Console

from consensus_net import kind_of
from meshnode.cli.job_life import render_job_status
from meshnode.node.api import _gang_fields
from meshnode.tui.tables import job_row, jobs_table
from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.gang_placement import gang_worker_id
from protocol.mesh import MeshCore
from protocol.messages import (Cancel, Gang, GangPlacement, GangReplacement, GangResize, GangWorker, JobManifest,
                               Proposal, decode_message, encode_message, gang_replace_instance_id,
                               gang_resize_instance_id, job_id)
from protocol.policy import LocalCapacity, NodePolicy
from protocol.ready import Ready
from testnet import cli_sim, spec_tables
from testnet.sim import FAULTS, SimConfig, run_simulation
from test_no_overcommit import running
from test_mesh_core import IDS, KEYS, MESH, OWNER, ZONES, Net, make_job

RAILS = ["rail-1", "rail-2", "rail-3", "rail-3"]   # zone-a holds rails 1 and 2, zone-b rail 3


class GangNet(Net):
    def __init__(self, gpus=(2, 2, 2, 2), rails=RAILS):
        super().__init__(gpus=gpus)
        self.restarted_at = {key: 0 for key in KEYS}   # for test_no_overcommit.running: none restarts
        for index, identity in enumerate(IDS):
            self.cores[identity.public_key] = MeshCore(
                identity=identity, genesis=self.cores[identity.public_key].genesis,
                policy=NodePolicy(zone=ZONES[index]), rng=random.Random(index), now_ms=0,
                capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * gpus[index], rail_group=rails[index]))


def make_gang(gang: Gang, nonce=1, gpus=1, backups=1, max_retries=0):
    job, _ = make_job(nonce=nonce, gpus=gpus, backups=backups, max_retries=max_retries)
    job = JobManifest(**{**{f: getattr(job, f) for f in JobManifest.SCHEMA}, "gang": gang})
    return job, encode_message(OWNER, MESH, job)


def workers_of(net, key, job):
    core = net.cores[key]
    return [core.job_table.get(gang_worker_id(job_id(job), rank)) for rank in range(len(KEYS))]


def test_one_decision_places_every_rank_in_one_zone():
    net = GangNet()
    job, envelope = make_gang(Gang(workers=2, topology="zone"))
    net.submit(KEYS[0], envelope)
    net.run(200)
    decided = [net.certified(k, "gang_placement") for k in KEYS]
    assert all(len(d) == 1 for d in decided) and len({d[0].value for d in decided}) == 1
    gang = decided[0][0].value
    nodes = [w.node for w in gang.workers]
    assert len(nodes) == 2 and {ZONES[KEYS.index(n)] for n in nodes} in ({"zone-a"}, {"zone-b"})
    assert gang.backups and not set(gang.backups) & set(nodes)
    for key in KEYS:
        ranks = workers_of(net, key, job)[:2]
        assert [w.primary for w in ranks] == nodes and {w.fence for w in ranks} == {1}
        assert net.cores[key].job_view(job_id(job))["state"] == "placed"
        # Only the two ranks' nodes hold capacity: every bid's reservation elsewhere went back.
        assert net.cores[key].ledger.held_totals()[0] == (1 if key in nodes else 0)
    # Each rank's node is ordered to run it, told its rank and its peer.
    for rank, node in enumerate(nodes):
        runs = [r for d in net.decisions[node] if d.value_kind == "run" for r in d.value]
        assert [(r.gang.rank, r.gang.world_size, [p[0] for p in r.gang.peers]) for r in runs] == [(rank, 2, nodes)]


def test_rail_group_prefers_the_smallest_diameter_and_never_spans_two():
    net = GangNet()
    job, envelope = make_gang(Gang(workers=2, topology="rail_group"))
    net.submit(KEYS[0], envelope)
    net.run(200)
    gang = net.certified(KEYS[1], "gang_placement")[0].value
    assert {w.node for w in gang.workers} == {KEYS[2], KEYS[3]}   # the only rail group with two nodes


def test_a_gang_that_fits_no_rail_group_waits_and_says_why():
    net = GangNet()
    job, envelope = make_gang(Gang(workers=3, topology="rail_group"), gpus=0)
    net.submit(KEYS[0], envelope)
    net.run(200)
    for key in KEYS:   # capability vectors go out (P1), as a node's telemetry loop sends them
        net.emit(key, net.cores[key].update_telemetry((), 0, net.now, simulated=True))
    net.run(50)
    assert not net.certified(KEYS[0], "gang_placement")
    for key in KEYS:   # the round's leader from the bids it holds, the others from capability vectors
        view = net.cores[key].job_view(job_id(job))
        assert view["state"] == "pending"
        assert "gang of 3 needs one rail group: the largest has 2 eligible" in view["hint"]
        assert "zone-b/rail-3" in view["hint"]


def test_an_elastic_gang_takes_the_largest_size_that_fits():
    net = GangNet(gpus=(2, 2, 0, 2))     # three nodes can host a 1-GPU worker
    job, envelope = make_gang(Gang(workers=0, min_workers=2, max_workers=4, multiple_of=1), backups=0)
    net.submit(KEYS[0], envelope)
    net.run(300)
    gang = net.certified(KEYS[1], "gang_placement")[0].value
    assert sorted(w.node for w in gang.workers) == sorted([KEYS[0], KEYS[1], KEYS[3]])


def test_a_refused_rank_ends_the_attempt_and_the_gang_is_placed_afresh():
    """GA4: a rank's node that cannot allocate it refuses it; every rank stops, none runs
    alone, and the next attempt places the whole gang again."""
    net = GangNet(gpus=(1, 1, 1, 1))
    job, envelope = make_gang(Gang(workers=2, topology="none"), backups=0, max_retries=1)
    net.submit(KEYS[0], envelope)
    net.run(200)
    first = net.certified(KEYS[0], "gang_placement")[0].value
    victim = first.workers[1].node
    rank1 = gang_worker_id(job_id(job), 1)
    core = net.cores[victim]
    core.ledger.free(rank1)                 # its GPU is taken by something else meanwhile
    core.ledger.allocate_now(b"x" * 32, job.resources)
    ready = Ready()
    core.lifecycle.refuse(core.job_table.get(rank1), net.now, ready)
    net.emit(victim, ready)
    net.run(400)
    survivor = first.workers[0].node
    assert all(run.fence != 1 for run in running(net, survivor).values())   # rank 0 stopped with it
    decided = net.certified(KEYS[0], "gang_placement")
    assert len(decided) == 2
    second = decided[1].value
    assert victim not in [w.node for w in second.workers]
    for key in KEYS:
        ranks = workers_of(net, key, job)[:2]
        assert [w.primary for w in ranks] == [w.node for w in second.workers]
        assert {w.fence for w in ranks} == {net.cores[key].job_view(job_id(job))["fence"]} and ranks[0].fence > 1


def test_spec_gang_ids_follow_the_stated_formulas():
    """SPEC.md GA4/GA5 vectors, recomputed with hashlib and the formulas alone."""
    spec = (pathlib.Path(__file__).resolve().parent.parent / "SPEC.md").read_text(encoding="utf-8")
    lines = dict(line.split(": ", 1) for line in spec_tables.generated_block(spec, "gang vectors").strip("`\n").splitlines())
    jid = bytes.fromhex(lines["job_id"])
    for rank in (0, 1):
        worker = hashlib.sha256(b"gang-worker" + jid + rank.to_bytes(2, "big")).digest()
        assert lines["gang_worker_id rank=%d" % rank] == worker.hex()
        port = 20000 + int.from_bytes(hashlib.sha256(b"gang-port" + worker + (1).to_bytes(8, "big")).digest()[:4],
                                      "big") % 12000
        assert int(lines["gang_port rank=%d fence=1" % rank]) == port
        assert port < 32768   # below Linux's ephemeral ports: no outgoing connection holds it
    assert lines["zone sizes=[3]"].startswith("ranks n1 n4 n5 diameter 1")   # the smaller diameter beats rank
    rank1 = hashlib.sha256(b"gang-worker" + jid + (1).to_bytes(2, "big")).digest()   # GA7's instance
    assert lines["gang_replace_instance_id rank=1 fence=2"] == hashlib.sha256(
        b"gang-replace" + rank1 + (2).to_bytes(8, "big")).hexdigest()


def test_validators_refuse_a_gang_that_breaks_its_topology():
    """GA3: with the very bids of the decided proposal, a value placing the ranks in two
    zones is refused naming the rule, and a size the job does not allow is refused."""
    net = GangNet()
    proposals = []
    send = net.send
    net.send = lambda src, messages: (proposals.extend(m.data for m in messages if kind_of(m.data) == "proposal"),
                                      send(src, messages))
    job, envelope = make_gang(Gang(workers=2, topology="zone"))
    net.submit(KEYS[0], envelope)
    net.run(200)
    _envelope, proposal = decode_message(proposals[0], MESH, expect=Proposal)
    core = net.cores[KEYS[1]]
    validate = core.gangs.validators(proposal.instance)[0]
    assert validate(proposal.value, proposal.justification) is None
    across = GangPlacement(job=envelope, workers=(GangWorker(node=KEYS[0], gpus=(0,)),
                                                  GangWorker(node=KEYS[2], gpus=(0,))), backups=())
    assert "topology 'zone': workers in zones zone-a, zone-b" in validate(codec.pack(across.to_body()),
                                                                          proposal.justification)
    alone = GangPlacement(job=envelope, workers=(GangWorker(node=KEYS[0], gpus=(0,)),), backups=())
    assert "a gang of 1 workers, which the job does not allow" in validate(codec.pack(alone.to_body()),
                                                                          proposal.justification)


def test_sim_sweep_with_gangs_under_faults_and_byzantine_stake():
    """Simulator (SPEC.md 11) with half the jobs gangs, every fault, 1/5 Byzantine stake,
    exits, failures and cancels: no partial gang, no overcommit, no rank placed twice, no
    topology broken. Seed 21 also caught a restarted leader signing a second proposal: an
    exit replayed at restart started the job's next attempt before its votes were restored
    (the core now restores them before replaying outcomes, as main's e70e7b6 does)."""
    placed = 0
    for seed in (21, 22):
        result = run_simulation(SimConfig(nodes=7, jobs=6, seed=seed, byzantine_milli=200, faults=FAULTS, job_ms=300,
                                          job_fail_per_mille=200, cancel_per_mille=100, gang_per_mille=500))
        assert result.violation_count == 0, [v.line() for v in result.violations]
        assert not result.liveness_missing
        placed += result.counters["gangs_placed"]
    assert placed > 0


def test_tools_show_a_gang_as_one_job_with_its_ranks():
    """GA4: `meshnode jobs` and the TUI show one row per gang (its ranks in it), and `job
    status` lists every rank; a rank's own record says whose rank it is."""
    net = GangNet()
    job, envelope = make_gang(Gang(workers=2, topology="zone"))
    net.submit(KEYS[0], envelope)
    net.run(200)
    jobs = net.cores[KEYS[0]].jobs()
    gang = next(j for j in jobs if j["job_id"] == job_id(job))
    ranks = [j for j in jobs if "gang_of" in j]
    assert [w["rank"] for w in gang["gang"]["workers"]] == [0, 1] and len(ranks) == 2
    assert {r["gang_of"]["gang_id"] for r in ranks} == {job_id(job)}
    row = {"job_id": gang["job_id"].hex(), "name": gang["name"], "owner": gang["owner"].hex(), "state": "placed",
           **_gang_fields(gang)}
    assert job_row(row)[3] == "gang 0/2"
    assert "2 workers, topology zone; ranks 0 " in jobs_table([row]).caption   # `meshnode jobs`: who runs each rank
    console = Console(width=100, record=True)
    console.print(render_job_status(row))
    text = console.export_text()
    assert "2 workers, topology zone" in text and "rank 1" in text


def test_a_dead_ranks_node_is_replaced_by_decision_and_the_others_learn_its_new_peers():
    """GA7: rank 1's node dies: the eviction does not move rank 1 by F5; a gang_replace
    decision puts it on the member that keeps the gang's diameter smallest (rank 0's rail
    group), at the next fence; rank 0's node keeps its workload (no stop, no new run) and is
    told rank 1's new address; the new node resumes rank 1."""
    net = GangNet()
    job, envelope = make_gang(Gang(workers=2, topology="none"), backups=1)
    net.submit(KEYS[0], envelope)
    net.run(200)
    gang = net.certified(KEYS[0], "gang_placement")[0].value
    first, second = [w.node for w in gang.workers]
    rank1 = gang_worker_id(job_id(job), 1)
    # Rank 1 checkpoints (replicated to the gang's backup, P6); the replacement resumes from it.
    net.emit(second, net.cores[second].local_checkpoint(rank1, 7, 7, net.now, b"step 7", net.now))
    net.run(50)
    before = len(net.decisions[first])
    net.down.add(second)
    net.run(1500)
    replaced = net.certified(first, "gang_replace")
    assert len(replaced) == 1 and replaced[0].value.rank == 1 and not replaced[0].value.shrinks
    to_node = replaced[0].value.to_node
    assert to_node not in (first, second)
    later = net.decisions[first][before:]
    assert not [d for d in later if d.value_kind in ("stop", "run")]
    told = [item for d in later if d.value_kind == "gang_peers" for item in d.value]
    assert told and told[-1][0] == gang_worker_id(job_id(job), 0)
    assert [node for node, _port in told[-1][1].peers] == [first, to_node]
    moved = [run for d in net.decisions[to_node] if d.value_kind == "run" for run in d.value]
    assert [(run.gang.rank, run.resume) for run in moved] == [(1, True)]
    held = net.cores[to_node].job_table.get(rank1)
    assert held.last_checkpoint_seq == 7 and held.checkpoint_fence == 1   # handed over unless it was the backup
    for key in set(KEYS) - {second}:
        rank1 = workers_of(net, key, job)[1]
        assert rank1.primary == to_node and rank1.fence == 3   # placed at 1, evicted 2, replaced 3


def test_one_rank_cannot_be_cancelled_alone_but_the_gang_cancels_every_rank():
    """GA4: a cancel naming a rank is refused (the gang would go on partial); the gang's
    cancel stops every rank."""
    net = GangNet()
    job, envelope = make_gang(Gang(workers=2, topology="none"))
    net.submit(KEYS[0], envelope)
    net.run(200)
    rank0 = gang_worker_id(job_id(job), 0)
    with pytest.raises(RemoteProtocolError, match="is a rank of a gang"):
        net.cores[KEYS[0]].cancel(encode_message(OWNER, MESH, Cancel(job_id=rank0, requested_ms=1)), net.now)
    _jid, ready = net.cores[KEYS[0]].cancel(encode_message(OWNER, MESH, Cancel(job_id=job_id(job), requested_ms=2)),
                                            net.now)
    net.emit(KEYS[0], ready)
    net.run(50)
    for key in KEYS:
        assert [w.state for w in workers_of(net, key, job)[:2]] == ["cancelled", "cancelled"]
        assert all(jid not in running(net, key) for jid in (rank0, gang_worker_id(job_id(job), 1)))


def _gang_round(net, key, job):
    core = net.cores[key]
    inst = core.instances.get(core.job_table.get(job_id(job)).instance)
    return None if inst is None else inst.round


def test_an_infeasible_gang_holds_its_round_and_is_placed_when_capacity_frees():
    """P3a for gangs: every member answered and no gang fits the bids (rank 3's node is
    full, and only zone-b's rail group can hold two): the round holds instead of changing
    rounds until it gives up (the demo's gang reached round 26). Once rank 3's node frees
    its GPU it bids to every member, the hold ends and the gang is placed."""
    net = GangNet(gpus=(1, 1, 1, 1))
    occupied = net.cores[KEYS[3]]
    filler, _ = make_job(nonce=99, gpus=1)
    occupied.ledger.allocate_now(b"x" * 32, filler.resources)
    job, envelope = make_gang(Gang(workers=2, topology="rail_group"), backups=0)
    net.submit(KEYS[0], envelope)
    net.run(30_000, step_ms=20)
    assert not net.certified(KEYS[0], "gang_placement")
    assert all(_gang_round(net, key, job) == 0 for key in KEYS)
    occupied.ledger.free(b"x" * 32)
    net.run(2_000, step_ms=20)
    gang = net.certified(KEYS[0], "gang_placement")[0].value
    assert {w.node for w in gang.workers} == {KEYS[2], KEYS[3]}


def test_an_elastic_gang_shrinks_when_no_member_can_replace_a_rank():
    """GA8: an elastic gang of 2..4 holds every node; one dies and no member is left to
    replace it: a decided gang_resize (its number 0, GA9) shrinks it to 3, the survivors
    renumbered in rank order and told the world of 3; none of them is stopped or started again."""
    net = GangNet(gpus=(1, 1, 1, 1))
    job, envelope = make_gang(Gang(workers=0, min_workers=2, max_workers=4, multiple_of=1), backups=0)
    net.submit(KEYS[0], envelope)
    net.run(300)
    gang = net.certified(KEYS[0], "gang_placement")[0].value
    nodes = [w.node for w in gang.workers]
    assert len(nodes) == 4
    lost = nodes[1]
    alive = [n for n in nodes if n != lost]
    before = {n: len(net.decisions[n]) for n in alive}
    net.down.add(lost)
    net.run(1500)
    assert not net.certified(alive[0], "gang_replace")
    decided = net.certified(alive[0], "gang_resize")
    assert len(decided) == 1 and decided[0].value.shrinks and decided[0].value.size == 3
    assert decided[0].value.number == 0
    for rank, node in enumerate(alive):
        later = net.decisions[node][before[node]:]
        assert not [d for d in later if d.value_kind in ("stop", "run")]
        told = [item for d in later if d.value_kind == "gang_peers" for item in d.value][-1][1]
        assert (told.rank, told.world_size, [p[0] for p in told.peers]) == (rank, 3, alive)
    view = net.cores[alive[0]].job_view(job_id(job))
    assert [w["primary"] for w in view["gang"]["workers"]] == alive and view["gang"]["resizes"] == 1


def test_validators_refuse_a_replacement_that_breaks_the_topology():
    """GA7: a gang in one zone loses a rank; a replacement value naming a node of the other
    zone (which has room) is refused naming the rule, and a shrink of a fixed-size gang is
    refused by its binding. No replacement fits, so the gang's attempt ends (GA4) and it is
    placed afresh whole, in the zone that can hold it."""
    net = GangNet(gpus=(1, 1, 1, 1))
    job, envelope = make_gang(Gang(workers=2, topology="zone"), backups=0, max_retries=1)
    net.submit(KEYS[0], envelope)
    net.run(300)
    gang = net.certified(KEYS[0], "gang_placement")[0].value
    first, second = [w.node for w in gang.workers]
    others = [k for k in KEYS if k not in (first, second)]
    for key in KEYS:   # capability vectors go out (P1), as a node's telemetry loop sends them
        net.emit(key, net.cores[key].update_telemetry((), 0, net.now, simulated=True))
    net.down.add(second)
    net.run(400)
    core = net.cores[first]
    record = core.job_table.get(gang_worker_id(job_id(job), 1))
    assert record.state == "replacing"
    iid = gang_replace_instance_id(record.job_id, record.fence)
    vectors = {k: core.capability.signed_vector(k, net.now) for k in (first, *others)}
    across = GangReplacement(job=envelope, rank=1, fence=record.fence, to_node=others[0],
                             capability=vectors[others[0]][0], survivors=(vectors[first][0],), size=2, backups=())
    validate = core.gang_ranks.validators(iid)[0]
    assert "topology 'zone'" in validate(codec.pack(across.to_body()), tuple(vectors[k][0] for k in others))
    shrink = GangReplacement(job=envelope, rank=1, fence=record.fence, to_node=b"", capability=b"",
                             survivors=(vectors[first][0],), size=1, backups=())
    assert "which the job does not allow" in validate(codec.pack(shrink.to_body()), ())
    net.run(20_000, step_ms=20)
    assert not net.certified(first, "gang_replace")
    second_attempt = net.certified(first, "gang_placement")[-1].value
    assert {w.node for w in second_attempt.workers} == set(others)


def test_sim_kills_rank_nodes_and_gangs_are_repaired_or_shrunk_never_restarted():
    """Simulator (SPEC.md 11) with only gangs (fixed and elastic), every fault, 1/5 Byzantine
    stake and two kills of rank nodes: lost ranks are replaced (GA7), elastic gangs shrink
    (GA8) and grow back once the killed nodes return (GA9), with no partial gang, no overcommit, no rank on two nodes, sizes the job allows,
    and no surviving rank started again. Seed 170 also has a replacement decided onto a node
    evicted since (the rank waits again, P5), judged by its own epoch's members."""
    results = [run_simulation(SimConfig(nodes=7, jobs=6, seed=seed, byzantine_milli=200, faults=FAULTS,
                                        gang_per_mille=1000, gang_kills=2)) for seed in (170, 5)]
    for result in results:
        assert result.violation_count == 0, [v.line() for v in result.violations]
        assert not result.liveness_missing
        assert result.counters.get("gang_ranks_restarted", 0) == 0
    assert sum(r.counters["gang_replacements"] for r in results) > 0
    assert sum(r.counters["gang_resizes"] for r in results) > 0   # seed 5's world shrinks a gang
    assert sum(r.counters["gang_grows"] for r in results) > 0     # seed 170's grows one back (GA9)


@pytest.mark.parametrize("argv, message", [
    (["--gang-kills", "-1"], "--gang-kills must be >= 0"),
    (["--driver", "node", "--gang-kills", "2"], "--gang-kills run with --driver core only"),
])
def test_sim_refuses_bad_gang_kills(argv, message):
    parser = argparse.ArgumentParser(prog="meshnode")
    cli_sim.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", *argv])
    with pytest.raises(SystemExit, match=message):
        args.func(args)


def test_validators_refuse_a_shrink_while_a_member_could_replace_the_rank():
    """GA8: an elastic gang of 2..3 loses a rank while a fourth node is free: the decided
    value replaces the rank there, and a shrink carrying that node's vector is refused."""
    net = GangNet(gpus=(1, 1, 1, 1))
    job, envelope = make_gang(Gang(workers=0, min_workers=2, max_workers=3, multiple_of=1), backups=0)
    net.submit(KEYS[0], envelope)
    net.run(300)
    nodes = [w.node for w in net.certified(KEYS[0], "gang_placement")[0].value.workers]
    free = next(k for k in KEYS if k not in nodes)
    for key in KEYS:
        net.emit(key, net.cores[key].update_telemetry((), 0, net.now, simulated=True))
    net.run(20)
    keeper = nodes[0]
    # The vectors as the validators held them when the rank was lost (the free node's shows room).
    vectors = {k: net.cores[keeper].capability.signed_vector(k, net.now)[0] for k in (nodes[0], nodes[2], free)}
    net.down.add(nodes[1])
    net.run(1500)
    decided = net.certified(keeper, "gang_replace")
    assert len(decided) == 1 and decided[0].value.to_node == free
    core = net.cores[keeper]
    record = core.job_table.get(gang_worker_id(job_id(job), 1))
    lost_fence = record.fence - 1   # the replacement's fence is one above the one it was decided at
    record.state, record.fence = "replacing", lost_fence   # as the validators held it then
    survivors = (vectors[nodes[0]], vectors[nodes[2]])
    shrink = GangResize(job=envelope, attempt=0, number=0, size=2, lost=record.job_id, nodes=(), capabilities=(),
                        survivors=survivors)
    validate = core.gang_resizes.validators(gang_resize_instance_id(job_id(job), 0, 0))[0]
    assert "a shrink while a candidate fits" in validate(codec.pack(shrink.to_body()), (vectors[free],))
    assert validate(codec.pack(shrink.to_body()), ()) is None   # with none, the shrink to 2 follows
    # GA9: a shrink is never a rank's replacement value any more.
    old_form = GangReplacement(job=envelope, rank=1, fence=lost_fence, to_node=b"", capability=b"",
                               survivors=survivors, size=2, backups=())
    replace_validate = core.gang_ranks.validators(gang_replace_instance_id(record.job_id, lost_fence))[0]
    assert "decided as a gang_resize" in replace_validate(codec.pack(old_form.to_body()), ())


def _two_rank_gang_placed():
    """A gang of 2 ranks with 1 backup each, placed: (net, job, rank 0's node, rank 1's)."""
    net = GangNet()
    job, envelope = make_gang(Gang(workers=2, topology="none"), backups=1)
    net.submit(KEYS[0], envelope)
    net.run(200)
    first, second = [w.node for w in net.certified(KEYS[0], "gang_placement")[0].value.workers]
    return net, job, first, second


def test_a_replacement_refills_the_ranks_backups_and_resumes_at_once_only_from_the_lost_runs_checkpoint():
    """GA7, found by `bench gang` (BENCHMARKS.md): without the refill each replacement used a
    backup up, and a rank replaced twice had none, so its next node restarted it from step 0;
    and a node that had run the rank before resumed at once from that older run's checkpoint."""
    from types import SimpleNamespace
    from protocol.flows.gang_replace import holds_lost_primarys_checkpoint
    net, job, first, second = _two_rank_gang_placed()
    net.down.add(second)
    net.run(1500)
    value = net.certified(first, "gang_replace")[0].value
    assert len(value.backups) == 1 and not {value.to_node, second} & set(value.backups)
    assert all(net.cores[k].job_table.get(gang_worker_id(job_id(job), 1)).backups == value.backups
               for k in KEYS if k != second)
    older_run = SimpleNamespace(checkpoint_envelope=b"cp", checkpoint_fence=3)
    assert holds_lost_primarys_checkpoint(older_run, replacing_fence=4)
    assert not holds_lost_primarys_checkpoint(older_run, replacing_fence=6)
    assert not holds_lost_primarys_checkpoint(SimpleNamespace(checkpoint_envelope=None, checkpoint_fence=5), 6)


def test_a_replacement_waits_for_the_replaced_runs_checkpoint_not_an_older_runs():
    """GA11, found by `bench gang` seed 17 (BENCHMARKS.md): rank 3 ran at fence 1 on node 1,
    then at fence 5 on node 4 (from fence 1's checkpoint), for 40 s. Node 4 was killed; its
    replacement, node 5, held no fence-5 checkpoint and waited for the hand-off, but a node
    holding only fence 1's newest checkpoint handed it over first: the wait ended, the rank
    resumed from it (step 3,609, the gang was at 6,910) and the ring took every rank back.
    Here the replacement's record also knows an older run of the rank (fence 0, as the
    second replacement's record knows fence 1's run)."""
    from protocol.messages import Checkpoint
    net, job, first, lost = _two_rank_gang_placed()
    net.down.add(lost)
    replaced_at = None
    while replaced_at is None and net.now < 3000:
        net.run(5)
        replaced_at = next((d for d in net.certified(first, "gang_replace")), None)
    target = replaced_at.value.to_node
    core = net.cores[target]
    wid = gang_worker_id(job_id(job), 1)
    record = core.job_table.get(wid)
    assert record.primary == target and record.fence == 3 and wid in core.lifecycle.handoff_waits
    older = next(i for i in IDS if i.public_key not in (lost, target))
    record.primaries[0] = older.public_key   # a run of the rank before the lost one

    def handed(signer, fence, seq):
        state = b"step %d" % seq
        checkpoint = Checkpoint(job_id=wid, fence=fence, seq=seq, progress=seq, taken_ms=net.now, state=state,
                                state_hash=hashlib.sha256(state).digest())
        net.emit(target, core.step(encode_message(signer, MESH, checkpoint), net.now))

    handed(older, 0, 469)
    assert record.checkpoint_fence == 0 and wid in core.lifecycle.handoff_waits   # held, still waiting
    handed(IDS[KEYS.index(lost)], 1, 1100)
    assert record.checkpoint_fence == 1 and record.last_checkpoint_seq == 1100
    assert wid not in core.lifecycle.handoff_waits   # the replaced run's newest: the rank resumes from it


def test_a_replacement_certified_before_its_eviction_here_waits_for_it_and_is_not_dropped():
    """GA7, found by `bench gang` (BENCHMARKS.md, session 11): a node that got a rank's
    replacement before the eviction that starts it dropped it as stale, so its record of the
    rank had no node and the gang's ring never formed again. Now it waits for the eviction."""
    def placed_gang():
        net = GangNet()
        job, envelope = make_gang(Gang(workers=2, topology="none"), backups=1)
        net.submit(KEYS[0], envelope)
        net.run(200)
        return net, job, [w.node for w in net.certified(KEYS[0], "gang_placement")[0].value.workers]

    ahead, job, (first, second) = placed_gang()
    behind, _job, nodes = placed_gang()   # the same world, stopped before the kill
    assert nodes == [first, second]
    ahead.down.add(second)
    ahead.run(1500)
    replaced = ahead.certified(first, "gang_replace")[0]
    eviction = next(d for d in ahead.decisions[first] if getattr(d, "value_kind", None) == "eviction")
    lagging = behind.cores[first]
    rank1 = gang_worker_id(job_id(job), 1)
    out = Ready()
    lagging.gang_ranks.apply(replaced.instance, "gang_replace", replaced.value, replaced.certificate,
                             lagging.epoch + 1, behind.now, out)
    assert lagging.job_table.get(rank1).primary == second   # held, not applied, not dropped
    lagging._apply_certificate_bytes(eviction.certificate, behind.now, out)
    record, truth = lagging.job_table.get(rank1), ahead.cores[first].job_table.get(rank1)
    assert (record.primary, record.fence, record.backups) == (truth.primary, truth.fence, truth.backups)
    assert lagging.counters["gang_replace_stale"] == 0


def _elastic_gang_beside_a_busy_node(max_workers=4):
    """An elastic gang of 2..``max_workers`` placed on the three free nodes (the fourth node is
    busy); the tests then free the fourth node's GPU (a grow, resize 0, GA9) and kill a
    rank's node (a replacement, or a shrink when no member is free, GA8)."""
    net = GangNet(gpus=(1, 1, 1, 1))
    busy = net.cores[KEYS[3]]
    filler, _ = make_job(nonce=99, gpus=1)
    busy.ledger.allocate_now(b"x" * 32, filler.resources)
    job, envelope = make_gang(Gang(workers=0, min_workers=2, max_workers=max_workers, multiple_of=1), backups=0)
    net.submit(KEYS[0], envelope)
    net.run(300)
    return net, job, [w.node for w in net.certified(KEYS[0], "gang_placement")[0].value.workers]


def test_an_elastic_gang_grows_back_when_capacity_appears_and_survivors_are_never_restarted():
    """GA9: the gang runs at 3 of its 4; the busy node frees its GPU and says so in its signed
    vector: resize 0 grows the gang to 4 with a new rank there, at a fresh worker id; the
    three ranks already running are not stopped or started again, only told the new world."""
    net, job, nodes = _elastic_gang_beside_a_busy_node()
    assert len(nodes) == 3 and KEYS[3] not in nodes
    before = {n: len(net.decisions[n]) for n in nodes}
    net.cores[KEYS[3]].ledger.free(b"x" * 32)
    net.emit(KEYS[3], net.cores[KEYS[3]].update_telemetry((), 0, net.now, simulated=True))
    net.run(500)
    decided = net.certified(KEYS[0], "gang_resize")
    assert len(decided) == 1 and not decided[0].value.shrinks
    assert (decided[0].value.number, decided[0].value.size, decided[0].value.nodes) == (0, 4, (KEYS[3],))
    grown = gang_worker_id(job_id(job), 3)   # the attempt's next index: a fresh worker id
    for rank, node in enumerate(nodes):
        later = net.decisions[node][before[node]:]
        assert not [d for d in later if d.value_kind in ("stop", "run")]
        told = [item for d in later if d.value_kind == "gang_peers" for item in d.value][-1][1]
        assert (told.rank, told.world_size, [p[0] for p in told.peers]) == (rank, 4, [*nodes, KEYS[3]])
    runs = [r for d in net.decisions[KEYS[3]] if d.value_kind == "run" for r in d.value]
    assert [(r.job_id, r.gang.rank, r.gang.world_size) for r in runs] == [(grown, 3, 4)]
    for key in KEYS:
        view = net.cores[key].job_view(job_id(job))
        assert [w["primary"] for w in view["gang"]["workers"]] == [*nodes, KEYS[3]]
        assert view["gang"]["resizes"] == 1


def test_a_grow_and_a_shrink_apply_identically_at_every_member_in_any_arrival_order():
    """GA9: resize 0 (a grow) and resize 1 (a shrink), and the eviction between them, reach a
    member that missed them all in the reverse order: it holds the shrink until the grow is
    applied, and ends with the same ranks, nodes, fences and states as the members that saw
    them in order. Without the numbering a shrink applied before the grow dropped other
    ranks than it did at the others."""
    ahead, job, nodes = _elastic_gang_beside_a_busy_node()
    behind, _job, same = _elastic_gang_beside_a_busy_node()
    assert same == nodes
    ahead.cores[KEYS[3]].ledger.free(b"x" * 32)
    ahead.emit(KEYS[3], ahead.cores[KEYS[3]].update_telemetry((), 0, ahead.now, simulated=True))
    ahead.run(500)
    lost = nodes[1]
    ahead.down.add(lost)
    ahead.run(2000)
    keeper = nodes[0]
    resizes = ahead.certified(keeper, "gang_resize")
    assert [(d.value.number, d.value.shrinks, d.value.size) for d in resizes] == [(0, False, 4), (1, True, 3)]
    eviction = next(d for d in ahead.decisions[keeper] if d.value_kind == "eviction")
    lagging = behind.cores[keeper]
    out = Ready()
    for certificate in (resizes[1].certificate, eviction.certificate, resizes[0].certificate):
        lagging._apply_certificate_bytes(certificate, behind.now, out)
    truth = ahead.cores[keeper]
    gang = job_id(job)
    assert lagging.gangs.ranks[gang] == truth.gangs.ranks[gang] and len(truth.gangs.ranks[gang]) == 3
    for wid in set(truth.gangs.ranks[gang]) | {gang_worker_id(gang, r) for r in range(4)}:
        mine, theirs = lagging.job_table.get(wid), truth.job_table.get(wid)
        assert (mine.primary, mine.fence, mine.state) == (theirs.primary, theirs.fence, theirs.state)
    assert lagging.counters["gang_resize_parked"] == 1
    assert lagging.gangs.attempts[gang].number == truth.gangs.attempts[gang].number == 2


def test_spec_gang_resize_vector_follows_the_stated_formula_and_record_rules():
    """SPEC.md GA9's vector: the instance id recomputed with hashlib from the formula alone,
    and the value decodes as a grow whose size is its survivors plus its new nodes."""
    spec = (pathlib.Path(__file__).resolve().parent.parent / "SPEC.md").read_text(encoding="utf-8")
    lines = dict(line.split(": ", 1)
                 for line in spec_tables.generated_block(spec, "gang resize vectors").strip("`\n").splitlines())
    jid = bytes.fromhex(lines["job_id"])
    attempt, number = int(lines["attempt"]), int(lines["number"])
    assert lines["gang_resize_instance_id"] == hashlib.sha256(
        b"gang-resize" + jid + attempt.to_bytes(4, "big") + number.to_bytes(4, "big")).hexdigest()
    data = bytes.fromhex(lines["gang_resize_value"])
    value = GangResize.from_body(codec.unpack(data))
    assert (value.attempt, value.number, value.shrinks) == (attempt, number, False)
    assert value.size == len(value.survivors) + len(value.nodes)
    with pytest.raises(ValueError, match="a shrink adds no nodes"):
        GangResize(**{**{f: getattr(value, f) for f in GangResize.SCHEMA}, "lost": b"w" * 32})


def test_a_gang_lost_whole_is_placed_again_though_its_epoch_is_older_than_the_views_kept(monkeypatch):
    """GA10: a gang's next attempt runs in its job's epoch (P2). A node kept only its newest
    views (8), so once a gang had outlived 8 epoch changes (every kill of `bench gang` is an
    eviction and a rejoin) a lost rank that could be neither replaced nor shrunk ended the
    attempt, and the next one never started anywhere ("its owner must sign it again"): the
    gang stayed pending until the bench gave up. Views of the epochs of gangs not ended are
    kept now. Here the node keeps 1 view, so the one eviction is enough to show it."""
    import protocol.epochs
    monkeypatch.setattr(protocol.epochs, "VIEWS_KEPT", 1)
    net = GangNet(gpus=(1, 1, 1, 1))
    job, envelope = make_gang(Gang(workers=2, topology="zone"), backups=0, max_retries=1)
    net.submit(KEYS[0], envelope)
    net.run(300)
    first, second = [w.node for w in net.certified(KEYS[0], "gang_placement")[0].value.workers]
    others = [k for k in KEYS if k not in (first, second)]
    net.down.add(second)
    net.run(20_000, step_ms=20)
    for key in (first, *others):
        core = net.cores[key]
        assert core.epoch >= 1 and core.epochs.view_for(0) is not None   # the gang's epoch, kept
    placed = net.certified(first, "gang_placement")
    assert len(placed) == 2 and {w.node for w in placed[-1].value.workers} == set(others)
    assert net.cores[first].job_view(job_id(job))["state"] in ("placed", "running")
    # A node evicted since the gang's epoch is no candidate there (P5 would take its rank off
    # again at once): its bid is left out by the leader and by every validator alike.
    gangs = net.cores[first].gangs
    assert gangs.evicted_since(0) == {second} and gangs.evicted_since(1) == set()
    bids = [SimpleNamespace(signer=key) for key in KEYS]
    assert [b.signer for b in gangs._not_evicted_since(bids, 0)] == [k for k in KEYS if k != second]


def test_a_replacement_and_a_shrink_of_one_rank_end_alike_in_either_order():
    """GA9: a rank's replacement (GA7, its own instance) and a shrink dropping it (the gang's
    resize) can both be decided when members' vectors differ. Two worlds that differ only in
    whether a busy node freed its GPU before the kill decide one each; every member ends
    with the same gang whichever of the two it applies first: the shrink drops the rank,
    from its new node too, and a replacement after the shrink changes nothing."""
    def world(free_before_kill):
        net, job, nodes = _elastic_gang_beside_a_busy_node(max_workers=3)
        if free_before_kill:
            net.cores[KEYS[3]].ledger.free(b"x" * 32)
        for key in KEYS:
            net.emit(key, net.cores[key].update_telemetry((), 0, net.now, simulated=True))
        net.run(20)
        net.down.add(nodes[1])
        net.run(2000)
        return net, job, nodes

    shrunk, job, nodes = world(False)
    replaced, _job, same = world(True)
    assert same == nodes and KEYS[3] not in nodes
    keeper = nodes[0]
    shrink = shrunk.certified(keeper, "gang_resize")
    replacement = replaced.certified(keeper, "gang_replace")
    assert len(shrink) == 1 and shrink[0].value.shrinks and shrink[0].value.size == 2
    assert len(replacement) == 1 and replacement[0].value.to_node == KEYS[3]
    shrink_first, replace_first = shrunk.cores[keeper], replaced.cores[keeper]
    out = Ready()
    shrink_first._apply_certificate_bytes(replacement[0].certificate, shrunk.now, out)
    replace_first._apply_certificate_bytes(shrink[0].certificate, replaced.now, out)
    gang = job_id(job)
    assert shrink_first.gangs.ranks[gang] == replace_first.gangs.ranks[gang] and len(replace_first.gangs.ranks[gang]) == 2
    for rank in range(3):
        wid = gang_worker_id(gang, rank)
        mine, theirs = shrink_first.job_table.get(wid), replace_first.job_table.get(wid)
        assert (mine.primary, mine.state) == (theirs.primary, theirs.state)
    assert replace_first.job_table.get(gang_worker_id(gang, 1)).state == "cancelled"   # dropped from its new node


def test_a_restarted_node_never_signs_a_second_proposal_for_a_resize_number():
    """GA9, found by the gang sweep (seed 86): a restart replays the certificates before it
    restores the node's votes (6.9), and the resize instance the replay opened signed a
    proposal afresh, another than the one it had signed before the crash. It now starts on
    the node's first input after the restart, from its restored votes."""
    result = run_simulation(SimConfig(nodes=7, jobs=6, seed=86, byzantine_milli=200, faults=FAULTS,
                                      gang_per_mille=1000, gang_kills=2))
    assert result.violation_count == 0, [v.line() for v in result.violations]
