"""`testnet up --netns`, `partition` and `heal` below the processes: names, groups, nft rules,
refusals. No root needed; tests/test_e2e_netns.py runs the real thing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from keys.errors import ConfigError
from testnet import launcher, netns


def test_groups_name_each_node_once_and_the_rest_form_a_group():
    assert netns.parse_groups(["0,1,2", "3,4"], 5) == [[0, 1, 2], [3, 4]]
    assert netns.parse_groups(["2"], 4) == [[2], [0, 1, 3]]
    assert netns.parse_groups(["0", "1"], 3) == [[0], [1], [2]]


@pytest.mark.parametrize("texts, message", [
    (["0,1", "1,2"], "node 1 is named in two partition groups"),
    (["0,9"], "no node 9 in this testnet (0..3)"),
    (["0,a"], "node indices separated by commas"),
    (["0,1,2,3"], "at least two groups"),
])
def test_bad_groups_are_one_line_errors(texts, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        netns.parse_groups(texts, 4)


def test_partition_rules_drop_both_ways_between_every_pair_of_groups_and_replace_the_table():
    plan = netns.plan("ab" * 16, 5)
    script = netns.partition_rules(plan, [[0, 1], [2], [3, 4]])
    lines = script.splitlines()
    # Declared, deleted, defined: one transaction that works whether a partition was in force or not.
    assert lines[:3] == ["table bridge meshnode_partition", "delete table bridge meshnode_partition",
                         "table bridge meshnode_partition {"]
    drops = [line.strip() for line in lines if line.strip().endswith("drop")]
    assert len(drops) == 6  # 3 groups: every ordered pair
    assert "ip saddr { 10.77.0.1, 10.77.0.2 } ip daddr { 10.77.0.3 } drop" in drops
    assert "ip saddr { 10.77.0.3 } ip daddr { 10.77.0.1, 10.77.0.2 } drop" in drops
    assert "ip saddr { 10.77.0.4, 10.77.0.5 } ip daddr { 10.77.0.1, 10.77.0.2 } drop" in drops
    assert not any("10.77.0.1, 10.77.0.2 } ip daddr { 10.77.0.1" in d for d in drops)  # never within a group


def test_plan_names_are_per_mesh_and_recorded_for_added_nodes():
    plan = netns.plan("0123456789abcdef" * 4, 2)
    assert plan["hub"] == "mn01234567-hub" and plan["nodes"] == ["mn01234567-n0", "mn01234567-n1"]
    assert netns.add_node_name(plan) == "mn01234567-n2" and plan["nodes"][-1] == "mn01234567-n2"


def test_netns_is_refused_without_root(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="--netns needs root"):
        netns.check_available()


def test_netns_is_refused_without_ip(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs `ip netns`"):
        netns.check_available()


def test_up_refusing_netns_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError):
        launcher.up(tmp_path / "net", 2, netns=True)
    assert not (tmp_path / "net").exists()


def test_partition_of_a_loopback_testnet_is_a_one_line_error(tmp_path):
    root = tmp_path / "net"
    launcher.create_testnet(root, 2)
    result = subprocess.run([sys.executable, "-m", "meshnode.cli", "testnet", "partition", "0", "1",
                             "--dir", str(root)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "partitions need one started with `meshnode testnet up --netns`" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
