"""One node per data directory (meshnode/node/dirlock.py): a second `meshnode run` on a
running node's directory is refused in one line and touches nothing there."""

import os
import subprocess
import sys

import pytest

from keys.errors import ConfigError
from meshnode.node.dirlock import DirectoryLock
from testnet import launcher


def test_a_second_lock_on_one_directory_is_refused_until_the_first_is_released(tmp_path):
    first, second = DirectoryLock(tmp_path), DirectoryLock(tmp_path)
    first.acquire()
    with pytest.raises(ConfigError, match=r"in use by a running node \(pid %d\)" % os.getpid()):
        second.acquire()
    first.release()
    second.acquire()   # released: the next node may start
    second.release()


def test_meshnode_run_on_a_directory_in_use_says_so_in_one_line_and_keeps_the_control_socket(tmp_path):
    launcher.create_testnet(tmp_path / "net", 4, run_workloads=False)
    node_dir = tmp_path / "net" / "node-0"
    socket_path = node_dir / "control.sock"
    socket_path.write_bytes(b"")   # stands for the live node's socket
    running = DirectoryLock(node_dir)
    running.acquire()               # the live node holds its directory
    try:
        done = subprocess.run([sys.executable, "-m", "meshnode.cli", "run", "--node", str(node_dir)],
                              capture_output=True, text=True, timeout=120)
    finally:
        running.release()
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use by a running node (pid %d)" % os.getpid() in lines[0], done.stderr
    assert socket_path.exists()                     # the live node's operator is not cut off
    assert not (node_dir / "node.log").exists() or (node_dir / "node.log").stat().st_size == 0
