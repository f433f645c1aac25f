"""`meshnode bench hostile` refuses bad input in one line (exit 2) before it touches a node.
The attack itself runs against a live testnet by hand (README "Local testnet"); its
pieces are tested in tests/test_transport_hostile.py."""

import pytest

from meshnode.cli import main
from testnet import launcher


@pytest.mark.parametrize("argv, message", [
    (["--cycles", "-1"], "--cycles must be 0 or more"),
    (["--clients", "0"], "--clients must be at least 1"),
    (["--node", "7"], "no node 7 in this testnet"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    launcher.create_testnet(tmp_path / "net", 2, run_workloads=False)
    assert main(["bench", "hostile", "--dir", str(tmp_path / "net"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_stopped_target_is_a_one_line_error(tmp_path, capsys):
    launcher.create_testnet(tmp_path / "net", 2, run_workloads=False)
    assert main(["bench", "hostile", "--dir", str(tmp_path / "net")]) == 2
    assert "node 0 is not running" in capsys.readouterr().err
