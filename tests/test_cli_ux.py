"""The CLI as a user meets it (issue 19): one-line errors for bad input, messages that
name the right thing, and prompts without noise.

Commands that talk to a node run in process against the real ControlServer, served by
trio in a thread from a temporary directory, with the real ControlApi handlers over a
scripted job table where a handler's own behaviour is under test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from keys.keystore import KDF_ENV, PassphraseSource, load_identity
from meshnode.cli import main
from meshnode.control.client import ControlClient, ControlError
from meshnode.control.server import ControlServer
from meshnode.node.api import ControlApi
from protocol.errors import MeshError
from testnet import launcher

REPO = Path(__file__).resolve().parent.parent
RUNNING_JOB = "ab" * 32
PENDING_JOB = "cd" * 32
SERVE_TIMEOUT_S = 10.0


@pytest.fixture(autouse=True)
def fast_kdf(monkeypatch):
    monkeypatch.setenv(KDF_ENV, "insecure-test")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def scripted_node_api() -> ControlApi:
    """The real control handlers over a job table the test writes."""
    jobs = [{"job_id": bytes.fromhex(RUNNING_JOB), "name": "train", "state": "running", "declines": {}},
            {"job_id": bytes.fromhex(PENDING_JOB), "name": "eu-only", "state": "pending",
             "declines": {"labels_missing": [bytes([1]) * 32, bytes([2]) * 32]}, "hint": "no eligible bid yet"}]
    return ControlApi(SimpleNamespace(core=SimpleNamespace(jobs=lambda: jobs)))


async def _status(args):
    return {"node": "11" * 32, "epoch": 0, "members": 1}


async def _submit(args):
    raise MeshError("this scripted node takes no jobs")


@contextlib.contextmanager
def serving(handlers: dict):
    """A real control server on DIR/control.sock in a thread; yields DIR."""
    directory = tempfile.mkdtemp(prefix="cli", dir="/tmp")  # Unix socket paths are short
    os.chmod(directory, 0o700)
    started = threading.Event()
    holder: dict = {}

    async def serve():
        async with trio.open_nursery() as nursery:
            holder["scope"], holder["token"] = nursery.cancel_scope, trio.lowlevel.current_trio_token()
            await nursery.start(ControlServer(Path(directory) / "control.sock", handlers).serve)
            started.set()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    assert started.wait(SERVE_TIMEOUT_S)
    try:
        yield directory
    finally:
        trio.from_thread.run_sync(holder["scope"].cancel, trio_token=holder["token"])
        thread.join(SERVE_TIMEOUT_S)


@pytest.fixture
def node_dir():
    api = scripted_node_api()
    with serving({"status": _status, "submit": _submit, "why": api.why}) as directory:
        yield directory


def one_line_error(code: int, err: str) -> str:
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("meshnode: error: ")
    return err.strip()


# --- submit -----------------------------------------------------------------------------------

def test_submit_of_a_missing_file_is_one_line_and_exit_2(node_dir, capsys):
    code, _out, err = run(capsys, "submit", "missing.toml", "--key", "owner.key", "--node", node_dir)
    assert "cannot read missing.toml: No such file or directory" in one_line_error(code, err)


def test_submit_of_a_binary_toml_says_what_it_is(node_dir, capsys, tmp_path):
    path = tmp_path / "job.toml"
    path.write_bytes(bytes(range(128, 256)))
    code, _out, err = run(capsys, "submit", path, "--node", node_dir)
    line = one_line_error(code, err)
    assert "neither a TOML manifest (it is not UTF-8 text) nor a signed job" in line and "msgpack" not in line.split("(")[0]


# --- why --------------------------------------------------------------------------------------

def test_why_on_a_running_job_says_it_is_running_not_pending(node_dir, capsys):
    code, out, _err = run(capsys, "why", RUNNING_JOB[:8], "--node", node_dir)
    assert code == 0 and "is running, not pending" in out and "is pending" not in out


def test_why_on_a_pending_job_groups_declines_by_reason(node_dir, capsys):
    code, out, _err = run(capsys, "why", PENDING_JOB[:8], "--node", node_dir)
    assert code == 0 and "why job cdcdcdcd is pending" in out and "2 nodes: labels missing" in out


def test_why_on_an_unknown_job_names_the_op_once(node_dir, capsys):
    code, _out, err = run(capsys, "why", "0123", "--node", node_dir)
    line = one_line_error(code, err)
    assert line.count("why:") == 1 and "matches 0 jobs" in line


def test_a_non_text_job_id_is_a_clean_error_reply_not_a_handler_crash(node_dir, caplog):
    with caplog.at_level(logging.ERROR), ControlClient(node_dir) as client:
        with pytest.raises(ControlError) as refused:
            client.call("why", job_id=5)
        assert client.call("status")["epoch"] == 0  # the connection is still good
    assert str(refused.value) == "why: args.job_id: expected text, got int"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_node_flag_naming_no_directory_says_so(capsys):
    code, _out, err = run(capsys, "jobs", "--node", "/nonexist")
    assert one_line_error(code, err) == "meshnode: error: no node directory at /nonexist"


def test_node_directory_without_a_socket_says_not_running(capsys, tmp_path):
    code, _out, err = run(capsys, "jobs", "--node", tmp_path)
    assert "node not running at %s (no control.sock)" % tmp_path in one_line_error(code, err)


# --- keys and passphrases -----------------------------------------------------------------------

def test_keys_new_refuses_an_existing_file_before_asking_for_a_passphrase(capsys, tmp_path, monkeypatch):
    path = tmp_path / "node.key"
    path.write_text("precious")

    def no_prompt(prompt=""):
        raise AssertionError("asked for a passphrase: %s" % prompt)
    monkeypatch.setattr("getpass.getpass", no_prompt)
    monkeypatch.setattr("keys.keystore._stdin_is_terminal", lambda: True)
    code, _out, err = run(capsys, "keys", "new", "--out", path)
    assert "already exists; pass --force" in one_line_error(code, err)
    assert path.read_text() == "precious"


def test_passphrase_piped_without_a_terminal_reads_stdin_without_warnings(tmp_path):
    # A new session has no controlling terminal, so getpass cannot open /dev/tty either:
    # exactly what a script or a CI job sees.
    path = tmp_path / "node.key"
    done = subprocess.run([sys.executable, "-W", "always", "-m", "meshnode.cli", "keys", "new", "--out", str(path)],
                          input=b"pw-1\npw-1\n", capture_output=True, cwd=REPO, timeout=60, start_new_session=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO), **{KDF_ENV: "insecure-test"}))
    assert done.returncode == 0, done.stderr
    assert b"Warning" not in done.stderr and b"echoed" not in done.stderr
    assert load_identity(path, PassphraseSource.literal(b"pw-1"))


# --- testnet ----------------------------------------------------------------------------------

def test_a_node_that_dies_starting_is_explained_from_stdout_log(tmp_path):
    node_dir = tmp_path / "node-0"
    node_dir.mkdir()
    (node_dir / "stdout.log").write_text("starting\nmeshnode: error: cannot listen on 127.0.0.1:4001: in use\n")
    exited = subprocess.Popen(["true"])
    exited.wait()  # reaped: its pid names no process now
    launcher.save_layout(tmp_path, {"nodes": [{"index": 0, "dir": str(node_dir), "public_key": "11" * 32,
                                               "port": 4001, "zone": "zone-a", "pid": exited.pid}]})
    with pytest.raises(MeshError) as failure:
        launcher.wait_control(tmp_path, 0)
    assert str(failure.value) == ("node 0 exited during start-up: meshnode: error: cannot listen on 127.0.0.1:4001: "
                                  "in use (see %s)" % (node_dir / "stdout.log"))
