"""A 6-node testnet with two rail groups (`meshnode testnet up --nodes 6 --rail-groups 2`):
rail-1 = nodes 0, 2, 4 (zone-a), rail-2 = nodes 1, 3, 5 (zone-b). Six real node drivers on
the in-memory network under trio's MockClock (tests/test_failover_node.py's memory_mesh).
A `rail_group` gang of 3 is placed inside one rail group; one of 4 fits in neither, is
never placed across both, and `why` says so: the rule, each group's nodes and GPUs."""

import time

import pytest
import trio
from rich.console import Console

from keys.keystore import load_identity
from meshnode.cli.node import render_why
from meshnode.node.api import ControlApi
from meshnode.workload.manifest import parse_manifest
from protocol.messages import encode_message
from testnet import launcher
from tests.test_failover_node import memory_mesh

NODES = 6
GANG_MANIFEST = """
name = "ring"
entrypoint = "allreduce"
backups = 1
nonce = %d
[resources]
gpus = 1
cpu_milli = 100
mem_mib = 64
[gang]
workers = %d
topology = "rail_group"
"""


@pytest.fixture
def rail_net(tmp_path):
    launcher.create_testnet(tmp_path / "net", NODES, run_workloads=False, rail_groups=2)
    return tmp_path / "net", launcher.load_layout(tmp_path / "net")


def test_the_layout_puts_every_rail_group_in_one_zone(rail_net):
    _root, layout = rail_net
    assert [(n["zone"], n["rail_group"]) for n in layout["nodes"]] == [
        ("zone-a", "rail-1"), ("zone-b", "rail-2")] * 3
    assert launcher.rail_group_of(3, 0) == "rail-4"   # without --rail-groups: the profile's own rail


def gang_job(layout, workers: int, nonce: int) -> bytes:
    owner = load_identity(layout["owners"][0]["key_file"], None)
    job = parse_manifest(GANG_MANIFEST % (nonce, workers), owner.public_key, time.time_ns() // 1_000_000, epoch=0)
    return encode_message(owner, bytes.fromhex(layout["mesh_id"]), job)


async def test_a_rail_group_gang_never_spans_both_groups_and_why_names_them(rail_net, mock_clock):
    mock_clock.autojump_threshold = 0
    root, layout = rail_net
    rail_of = {bytes.fromhex(n["public_key"]): n["rail_group"] for n in layout["nodes"]}
    async with memory_mesh(root, NODES) as nodes:
        await trio.sleep(2.0)   # capability vectors go round
        three = await nodes[0].submit(gang_job(layout, 3, 1))
        four = await nodes[0].submit(gang_job(layout, 4, 2))
        await trio.sleep(3.0)
        for node in nodes:
            placed = node.core.job_view(three)
            workers = placed["gang"]["workers"]
            assert placed["state"] == "placed" and len(workers) == 3
            assert len({rail_of[w["primary"]] for w in workers}) == 1
            waiting = node.core.job_view(four)
            assert waiting["state"] == "pending" and waiting["gang"]["workers"] == []
        placed = await ControlApi(nodes[5]).why({"job_id": three.hex()})
        assert [(h["kind"], len(h["workers"])) for h in placed["gang"]["history"]] == [("placed", 3)]
        assert [w["state"] for w in placed["gang"]["workers"]] == ["placed"] * 3
        why = await ControlApi(nodes[5]).why({"job_id": four.hex()})

        assert why["state"] == "pending" and "rail group" in why["hint"]
        groups = {g["group"]: g for g in why["gang"]["groups"]}
        assert set(groups) == {"zone-a/rail-1", "zone-b/rail-2"}
        # Whatever the 3-worker gang and the 4-worker gang's bids hold, no group has 4 nodes.
        assert all(g["nodes"] == 3 and 0 < g["fit"] <= 3 and g["allowed"] for g in groups.values()), groups
        # Profiles cycle H100 x8, A100 x4, L4 x2, A10 x1: rail-1 holds nodes 0, 2, 4 = 8 + 2 + 8 GPUs.
        assert groups["zone-a/rail-1"]["gpus"] == 18 and groups["zone-b/rail-2"]["gpus"] == 9
        console = Console(width=100, record=True)
        render_why(console, why)
        text = console.export_text()
        assert "topology rail_group (every worker in one zone and one rail group)" in text
        assert "zone-a/rail-1: %d/3 nodes, " % groups["zone-a/rail-1"]["fit"] in text
        assert "zone-b/rail-2: %d/3 nodes, " % groups["zone-b/rail-2"]["fit"] in text
        assert "gang of 4 needs one rail group" in text
