"""The CLI as a user meets it (issue 19): one-line errors for bad input, messages that
name the right thing, and prompts without noise.

Commands that talk to a node run in process against the real ControlServer, served by
trio in a thread from a temporary directory, with the real ControlApi handlers over a
scripted job table where a handler's own behaviour is under test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from rich.console import Console

from keys.identity import SigningIdentity, peer_id_from_public_key, short_id
from keys.keystore import KDF_ENV, PassphraseSource, load_identity
from meshnode.cli import build_parser, main
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
    queue = {"pool": "training", "position": 2, "queue_length": 3, "ahead_with_higher_priority": 1,
             "quota": "pool 'training' quota: gpu_milli 1000 held + 1000 asked > 1000 (over by 1000)",
             "estimate": {"start_ms": 70_000, "in_ms": 12_500, "reason": "quota frees when job abababab ends"}}
    return ControlApi(SimpleNamespace(core=SimpleNamespace(jobs=lambda: jobs, pending_report=lambda jid, now: queue,
                                                   borrowing_report=lambda jid, now: None)))


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
    assert "neither a TOML manifest (it is not UTF-8 text) nor a signed job" in line


# --- why --------------------------------------------------------------------------------------

def test_why_on_a_running_job_says_it_is_running_not_pending(node_dir, capsys):
    code, out, _err = run(capsys, "why", RUNNING_JOB[:8], "--node", node_dir)
    assert code == 0 and "is running, not pending" in out and "is pending" not in out


def test_why_on_a_pending_job_groups_declines_by_reason(node_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")   # one row per line
    code, out, _err = run(capsys, "why", PENDING_JOB[:8], "--node", node_dir)
    assert code == 0 and "why job cdcdcdcd is pending" in out and "2 nodes: labels missing" in out
    # SPEC Q3/Q4: the queue position in its pool, the quota holding it, the estimated start
    assert "2 of 3 in pool 'training' (1 ahead with higher priority)" in out
    assert "over by 1000" in out and "in 12.5 s (quota frees when job abababab ends)" in out


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


# --- help and the README's command lines ----------------------------------------------------------

def all_parsers(parser=None, path=("meshnode",)):
    """(command path, parser) for the top level and every command and subcommand."""
    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_parsers(sub, path + (name,))


def is_leaf(parser) -> bool:
    return not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def test_every_command_says_what_each_flag_does_and_gives_an_example():
    missing = []
    for path, parser in all_parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            if not action.help:
                missing.append("%s %s: no help" % (" ".join(path), "/".join(action.option_strings) or action.dest))
        if not parser.format_usage().startswith("usage: %s " % " ".join(path)):
            missing.append("%s: usage reads %r" % (" ".join(path), parser.format_usage()[:60]))
        if is_leaf(parser) and path != ("meshnode",):
            epilog = parser.epilog or ""
            if "example" not in epilog or " ".join(path) not in epilog:
                missing.append("%s: no example of itself in its --help" % " ".join(path))
    assert not missing, "\n".join(missing)


def test_top_level_help_lists_every_command_under_what_users_do(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for heading in ("operate a node:", "own jobs:", "inspect a node:", "test and try:"):
        assert heading in text
    commands = [name for path, _ in all_parsers() if len(path) == 2 for name in path[1:]]
    assert all(("\n    %s " % name) in text for name in commands), text


def command_lines_in_readme() -> list[str]:
    """Every `meshnode ...` line of the README's sh blocks, continuations joined, comments dropped."""
    lines, in_sh, pending = [], False, ""
    for raw in (REPO / "README.md").read_text().splitlines():
        if raw.startswith("```"):
            in_sh = raw.strip() == "```sh"
            continue
        if not in_sh:
            continue
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("meshnode "):
            lines.append(line.split("  #")[0].split(" # ")[0].strip())
    return lines


def as_argv(command_line: str) -> list[str]:
    """A documented command line as argv: optional parts ``[...]`` dropped, ``<...>`` and
    ``...`` placeholders filled with a value."""
    line = re.sub(r"\[[^\]]*\]", "", command_line)
    line = re.sub(r"<[^>]*>", "VALUE", line)
    return shlex.split(line)[1:]


def test_every_command_line_in_the_readme_parses():
    lines = command_lines_in_readme()
    assert len(lines) > 30
    parser = build_parser()
    for _path, each in all_parsers(parser):
        each.allow_abbrev = False  # the README spells every flag out: a prefix of a real one is no flag
    failures = []
    for line in lines:
        argv = as_argv(line)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                parser.parse_args(argv)
            except SystemExit:
                failures.append("%s\n    %s" % (line, stderr.getvalue().strip().splitlines()[-1]))
    assert not failures, "\n".join(failures)


def command_mentions(text: str) -> list[list[str]]:
    """The command words of each `meshnode ...` quoted in backticks: up to the first flag or placeholder."""
    mentions = []
    for quoted in re.findall(r"`+(meshnode [^`]+)`+", text):
        words = []
        for word in quoted.split()[1:]:
            if not re.fullmatch(r"[a-z][a-z-]*", word):
                break
            words.append(word)
        mentions.append(words)
    return mentions


def names_a_command(words: list[str]) -> bool:
    parser = build_parser()
    for word in words:
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subcommands:
            return True  # the rest are arguments (a FILE, a JOB_ID)
        if word not in subcommands[0].choices:
            return False
        parser = subcommands[0].choices[word]
    return True


def test_readme_and_help_texts_name_only_commands_that_exist():
    texts = [(REPO / "README.md").read_text()]
    for path, parser in all_parsers():
        texts += [parser.description or "", parser.epilog or ""]
        texts += [a.help or "" for a in parser._actions if a.help != argparse.SUPPRESS]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                texts += [choice.help or "" for choice in action._choices_actions]
    for module in (REPO / "meshnode").rglob("*.py"):
        texts.append(module.read_text())
    wrong = sorted({" ".join(words) for text in texts for words in command_mentions(text)
                    if words and not names_a_command(words)})
    assert not wrong, wrong


# --- tables at 80 columns (issue 19 item 4) ---------------------------------------------------------

NODE_KEYS = [SigningIdentity(bytes([i + 1]) * 32).public_key for i in range(4)]
LABELS = [short_id(key) for key in NODE_KEYS]
JOB_IDS = [("%02x" % (0x10 + i)) * 32 for i in range(3)]
MESH_ID_HEX = "ee" * 32
SAMPLE_JOB_NAMES = ("train-resnet-50-imagenet", "eu-only-inference", "counter")
REPRS = ("None", "{'", "['", "True", "False", "b'")


def sample_gpu(index, model="H100-80GB"):
    return {"index": index, "model": model, "mem_total_mib": 81920, "mem_used_mib": 1024, "util_milli": 55_000,
            "temp_milli_c": 61_000, "sm_clock_mhz": 1980, "throttle_reasons": 0x20 | 0x4, "ecc_errors": 0,
            "power_mw": 300_000}


def sample_results() -> dict:
    nodes = [{"key": key.hex(), "short": label, "stake": 100, "zone": "zone-%s" % "ab"[i % 2],
              "health": ("self", "alive", "suspected", "evicted")[i], "rtt_us": None if i == 0 else 84_512 * i,
              "capability": {"gpus": [sample_gpu(g) for g in range(8)], "gpus_free": list(range(i, 8)),
                             "cpu_milli_free": 4000, "mem_mib_free": 8192, "taken_ms": 1, "seq": 3,
                             "simulated": True} if i < 3 else None}
             for i, (key, label) in enumerate(zip(NODE_KEYS, LABELS))]
    jobs = [{"job_id": JOB_IDS[0], "name": "train-resnet-50-imagenet", "owner": "77" * 32, "state": "running",
             "primary": NODE_KEYS[0].hex(), "backups": [NODE_KEYS[1].hex(), NODE_KEYS[2].hex()], "fence": 3,
             "checkpoint_seq": 177, "checkpoint_age_ms": 98, "migrations": 2, "lost_work_ms": 61_000,
             "submitted_ms": 5, "declines": {}, "hint": None},
            {"job_id": JOB_IDS[1], "name": "eu-only-inference", "owner": "77" * 32, "state": "pending",
             "primary": None, "backups": [], "fence": 0, "checkpoint_seq": None, "checkpoint_age_ms": None,
             "migrations": 0, "lost_work_ms": None, "submitted_ms": 5,
             "declines": {"labels_missing": 4, "not_enough_gpu_memory": 2}, "hint": "no eligible bid yet"},
            {"job_id": JOB_IDS[2], "name": "counter", "owner": "77" * 32, "state": "migrating",
             "primary": NODE_KEYS[3].hex(), "backups": [NODE_KEYS[0].hex()], "fence": 9, "checkpoint_seq": 12,
             "checkpoint_age_ms": 1_234_567, "migrations": 1, "lost_work_ms": 40, "submitted_ms": 5,
             "declines": {}, "hint": None}]
    consensus = {"instances": [{"instance": JOB_IDS[0], "kind": "placement", "round": 2, "leader": NODE_KEYS[1].hex(),
                                "decided": True},
                               {"instance": "99" * 32, "kind": "eviction", "round": 0, "leader": None,
                                "decided": False}],
                 "certificates": 1234, "evidence": [{"offender": NODE_KEYS[3].hex(), "kind": "equivocation",
                                                     "at_ms": 123456}]}
    status = {"node": NODE_KEYS[0].hex(), "peer_id": peer_id_from_public_key(NODE_KEYS[0]), "mesh_id": MESH_ID_HEX,
              "epoch": 3, "members": 4, "member": True, "evicted_at_epoch": None, "halted": False, "connected": 3,
              "uptime_ms": 16_000, "running_workloads": 2,
              "dropped": {"bad_signature": 1, "stale_epoch": 12, "unknown_sender": 0},
              "telemetry": {"source": "simulated", "profile": "H100-80GB x8", "nvml": None}}
    return {"status": status, "nodes": {"nodes": nodes}, "jobs": {"jobs": jobs}, "consensus": consensus}


def rendered(draw) -> str:
    out = io.StringIO()
    draw(Console(file=out, width=80, color_system=None, legacy_windows=False))
    return out.getvalue()


def assert_fits_80_columns(name: str, text: str, whole: tuple[str, ...]) -> None:
    lines = text.splitlines()
    assert lines, name
    too_wide = [line for line in lines if len(line) > 80]
    assert not too_wide, "%s: %d columns\n%s" % (name, max(map(len, too_wide)), text)
    cut = [m.group(0) for m in re.finditer(r"(\S+)…", text)
           if not any(job_name.startswith(m.group(1)) for job_name in SAMPLE_JOB_NAMES)]
    assert not cut, "%s: cut short with an ellipsis: %s (only a job's name may be)\n%s" % (name, cut, text)
    leaked = [r for r in REPRS if r in text]
    assert not leaked, "%s: Python repr %s\n%s" % (name, leaked, text)
    split = [item for item in whole if not any(item in line for line in lines)]
    assert not split, "%s: %s not whole on one line\n%s" % (name, split, text)


def table_views():
    """(name, draw(console), strings each of which must appear whole on one line)."""
    from meshnode.cli import cert as cert_cli, job as job_cli, job_life, keys as keys_cli, mesh as mesh_cli
    from meshnode.cli import node as node_cli
    from meshnode.cli.output import key_value_table
    from meshnode.tui.tables import event_line, render_snapshot, status_line
    from testnet import cli_testnet
    results = sample_results()
    labels = tuple(LABELS)
    job_prefixes = tuple(j[:8] for j in JOB_IDS)
    yield "status", lambda c: c.print(node_cli.render_status(results["status"])), \
        (NODE_KEYS[0].hex(), MESH_ID_HEX, results["status"]["peer_id"], LABELS[0])
    yield "nodes", lambda c: c.print(node_cli.render_nodes(results["nodes"])), labels + ("8/8 H100", "pwr+1")
    yield "jobs", lambda c: c.print(node_cli.render_jobs(results["jobs"])), \
        job_prefixes + (LABELS[0], LABELS[3], "98 ms #177", "20 min #12", "4 nodes: labels missing")
    yield "consensus", lambda c: c.print(node_cli.render_consensus(results["consensus"])), \
        (JOB_IDS[0][:8], "99999999", LABELS[1], LABELS[3], "equivocation")
    yield "events", lambda c: [c.print(event_line(e, 1_700_000_000_000)) for e in (
        {"kind": "job_placed", "at_ms": 88_000, "detail": {"job_id": JOB_IDS[0], "primary": NODE_KEYS[2].hex(),
                                                          "fence": 3, "mono_ns": 123456789}},
        {"kind": "suspected", "at_ms": 88_001, "detail": {"suspect": NODE_KEYS[3].hex(), "silent_ms": 250}})], \
        (JOB_IDS[0][:8], LABELS[2], LABELS[3])
    why_pending = {"job_id": JOB_IDS[1], "state": "pending", "declines": {"labels_missing": LABELS,
                                                                          "not_enough_gpu_memory": LABELS[:2]},
                   "hint": "no eligible bid yet (0 bids, 4 declines)"}
    yield "why pending", lambda c: node_cli.render_why(c, why_pending), labels + ("4 nodes: labels missing",)
    yield "why running", lambda c: node_cli.render_why(c, {"job_id": JOB_IDS[0], "state": "running", "declines": {},
                                                            "hint": None}), (JOB_IDS[0][:8],)
    yield "submit --wait placed", lambda c: c.print(node_cli.render_submitted(
        {"job_id": JOB_IDS[0], "state": "placed", "primary": NODE_KEYS[1].hex(),
         "backups": [NODE_KEYS[2].hex()]})), (JOB_IDS[0], LABELS[1], LABELS[2])
    yield "submit --wait pending", lambda c: c.print(node_cli.render_submitted(
        {"job_id": JOB_IDS[1], "state": "pending", "declines": {"labels_missing": 4}, "hint": None})), \
        (JOB_IDS[1], "4 nodes: labels missing")
    testnet_rows = [{"index": i, "node": label, "public_key": key.hex(), "pid": 4_000_000 + i,
                     "process": ("running", "paused", "dead", "running")[i], "port": 40_001 + i, "zone": "zone-a",
                     "connected": None if i == 2 else 3, "epoch": None if i == 2 else 12}
                    for i, (key, label) in enumerate(zip(NODE_KEYS, LABELS))]
    yield "testnet status", lambda c: c.print(cli_testnet.render_rows(testnet_rows)), labels
    yield "cert verify", lambda c: c.print(cert_cli.render_valid_certificate(
        {"instance": JOB_IDS[0], "round": 1, "epoch": 3, "value_kind": "placement", "value_hash": "ab" * 32,
         "stake": 300, "total_stake": 400}, list(LABELS))), (JOB_IDS[0], "ab" * 32) + labels
    job_view = {"job_id": JOB_IDS[0], "mesh_id": MESH_ID_HEX, "any_mesh": False, "owner": NODE_KEYS[0].hex(),
                "owner_peer_id": peer_id_from_public_key(NODE_KEYS[0]), "name": "train", "entrypoint": "train",
                "args": ["--epochs", "90"], "strategy": "spread",
                "resources": {"gpus": 8, "gpu_mem_mib": 40000, "cpu_milli": 4000, "mem_mib": 8192},
                "constraints": {"zones": ["zone-a", "zone-b"], "labels": [["gpu", "h100"]], "attested": []},
                "priority": 5, "backups": 1, "max_retries": 3, "nonce": 1234, "created_ms": 1_700_000_000_000,
                "epoch": 0}
    yield "job verify", lambda c: job_cli.render_job(c, "counter.job: signature OK", job_view), \
        (JOB_IDS[0], MESH_ID_HEX, NODE_KEYS[0].hex(), job_view["owner_peer_id"])
    key_view = dict(keys_cli.identity_view(NODE_KEYS[0]), file="node.key", encrypted=True)
    yield "keys show", lambda c: c.print(key_value_table("node.key", list(key_view.items()))), \
        (NODE_KEYS[0].hex(), key_view["peer_id"], LABELS[0])
    genesis_view = {"mesh_id": MESH_ID_HEX, "name": "lab", "created_ms": 1, "total_stake": 400,
                    "members": [{"public_key": key.hex(), "peer_id": peer_id_from_public_key(key), "short_id": label,
                                 "stake": 100, "zone": "zone-a", "labels": {"gpu": "h100"} if i == 1 else {},
                                 "addrs": ["/ip4/127.0.0.1/tcp/%d" % (4001 + i)] if i < 2 else []}
                                for i, (key, label) in enumerate(zip(NODE_KEYS, LABELS))],
                    "params": {"heartbeat_ms": 50, "detection_bound_ms": 300}, "authorities": ["cc" * 32]}
    yield "mesh show", lambda c: mesh_cli.render_genesis(c, genesis_view), \
        (MESH_ID_HEX, "cc" * 32, "/ip4/127.0.0.1/tcp/4001") + labels + tuple(
            m["peer_id"] for m in genesis_view["members"])
    yield "job list", lambda c: c.print(job_life.render_job_list(results["jobs"])), job_prefixes + (LABELS[0],)
    job_status = dict(results["jobs"]["jobs"][1], attempt=0, max_retries=3, exit_code=None, running_here=False)
    yield "job status", lambda c: c.print(job_life.render_job_status(job_status)), \
        (JOB_IDS[1], "labels_missing: 4")
    yield "tui snapshot", lambda c: render_snapshot(results, c), labels + job_prefixes
    yield "tui status line", lambda c: c.print(status_line(results["status"])), (LABELS[0], MESH_ID_HEX[:8])


@pytest.mark.parametrize("name", [name for name, _draw, _whole in table_views()])
def test_every_table_fits_80_columns_with_whole_ids_and_no_reprs(name):
    _name, draw, whole = next(view for view in table_views() if view[0] == name)
    assert_fits_80_columns(name, rendered(draw), whole)


def test_testnet_add_prints_the_join_command_on_one_line(capsys, monkeypatch, tmp_path):
    from testnet import cli_testnet
    node_dir = str(tmp_path / "a-rather-long-testnet-directory-name" / "node-4")
    bootstrap = "/ip4/127.0.0.1/tcp/40001/p2p/" + peer_id_from_public_key(NODE_KEYS[0])
    monkeypatch.setattr(launcher, "add_node", lambda root, stake: {"index": 4, "dir": node_dir})
    monkeypatch.setattr(launcher, "load_layout", lambda root: {"nodes": [{}]})
    monkeypatch.setattr(launcher, "bootstrap_multiaddr", lambda entry: bootstrap)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["testnet", "add", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "meshnode join --node %s --bootstrap %s\n" % (node_dir, bootstrap) in out


# --- progress (issue 19 item 5) ------------------------------------------------------------------

def test_key_derivation_shows_progress_on_a_terminal_only(capsys, monkeypatch, tmp_path):
    passfile = tmp_path / "pw"
    passfile.write_text("pw\n")
    monkeypatch.setattr("meshnode.cli.output.stderr_is_terminal", lambda: True)
    assert main(["keys", "new", "--out", str(tmp_path / "a.key"), "--passphrase-file", str(passfile)]) == 0
    err = capsys.readouterr().err
    assert "deriving the key of" in err and "a.key (argon2id)" in err
    # --json: a script's output is the JSON document and nothing else, terminal or not.
    assert main(["keys", "new", "--out", str(tmp_path / "b.key"), "--passphrase-file", str(passfile), "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["encrypted"] is True
    monkeypatch.setattr("meshnode.cli.output.stderr_is_terminal", lambda: False)
    assert main(["keys", "new", "--out", str(tmp_path / "c.key"), "--passphrase-file", str(passfile)]) == 0
    assert capsys.readouterr().err == ""


def test_testnet_up_reports_each_step_as_progress(capsys, monkeypatch, tmp_path):
    steps = []

    def fake_up(root, nodes, owners, run_workloads, params, netns, on_step, rail_groups=0, loopback_hosts=False, bid_sample=0):
        for text in ("writing keys", "starting node 1 of 2", "waiting"):
            on_step(text)
        return []

    class Recorder:
        def update(self, text):
            steps.append(text)

    @contextlib.contextmanager
    def recording_progress(args, text):
        steps.append(text)
        yield Recorder()

    from testnet import cli_testnet
    monkeypatch.setattr(launcher, "up", fake_up)
    monkeypatch.setattr(launcher, "load_layout", lambda root: {"mesh_id": "ee" * 32, "owners": []})
    monkeypatch.setattr(cli_testnet, "progress", recording_progress)
    assert main(["testnet", "up", "--nodes", "2", "--dir", str(tmp_path)]) == 0
    assert steps == ["creating the testnet in %s" % tmp_path, "writing keys", "starting node 1 of 2", "waiting"]
