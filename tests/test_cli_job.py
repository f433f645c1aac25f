"""`meshnode job list|status|cancel|move|logs|output` against four real node drivers.

The drivers run on the in-memory network under trio's autojumping MockClock; the CLI runs
as it does from a shell (``meshnode.cli.main``), in a worker thread, over the nodes' real
control sockets. No workload processes: the primary's output ring and the workload's exit
are produced the way the runner produces them.
"""

import itertools
import json
import os

import pytest
import trio

from keys.keystore import load_identity
from meshnode.cli import main
from meshnode.node.output_log import OutputLog, job_workdir
from testnet import launcher
from tests.test_failover_node import memory_mesh
from tests.test_job_output import NODES, owner_job, place


@pytest.fixture
def mesh_dir(tmp_path):
    launcher.create_testnet(tmp_path / "net", NODES, owners=2, run_workloads=False)
    return tmp_path / "net", launcher.load_layout(tmp_path / "net")


async def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await trio.to_thread.run_sync(main, [str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def with_placed_job(root, layout, test):
    owner = load_identity(layout["owners"][0]["key_file"], None)
    async with memory_mesh(root) as nodes:
        await trio.sleep(1.0)
        jid, primary, bystander = await place(nodes, owner_job(owner, bytes.fromhex(layout["mesh_id"])))
        os.makedirs(job_workdir(primary.paths.root, jid))
        await test(jid, primary, bystander)


def one_line_error(code: int, err: str, text: str) -> None:
    lines = [line for line in err.splitlines() if not line.startswith("WARNING: keystore")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("meshnode: error: ") and text in lines[0], err


async def test_list_and_status_name_the_job_everywhere_and_unknown_ids_are_one_line(mesh_dir, mock_clock, capsys):
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir

    async def test(jid, primary, bystander):
        code, out, _ = await cli(capsys, "job", "list", "--node", bystander.paths.root)
        assert code == 0 and jid.hex()[:8] in out and "placed" in out
        code, out, _ = await cli(capsys, "job", "list", "--node", bystander.paths.root, "--json")
        assert [j["job_id"] for j in json.loads(out)["jobs"]] == [jid.hex()]
        code, out, _ = await cli(capsys, "job", "status", jid.hex()[:12], "--node", bystander.paths.root, "--json")
        status = json.loads(out)
        assert code == 0 and status["primary"] == primary.identity.public_key.hex() and status["fence"] == 1
        code, out, _ = await cli(capsys, "job", "status", jid.hex()[:12], "--node", bystander.paths.root)
        assert code == 0 and jid.hex() in out and "placed" in out       # the full id, never cut with "..."
        owner_key = layout["owners"][0]["key_file"]
        for argv in (("status", "0badc0de"), ("cancel", "0badc0de", "--key", owner_key), ("logs", "0badc0de"),
                     ("output", "0badc0de", "--out", root / "out")):
            code, _, err = await cli(capsys, "job", *argv, "--node", bystander.paths.root)
            one_line_error(code, err, "no job 0badc0de")

    await with_placed_job(root, layout, test)


async def test_logs_from_a_node_that_does_not_run_the_job_need_the_owners_key(mesh_dir, mock_clock, capsys):
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir
    owner_key, other_key = layout["owners"][0]["key_file"], layout["owners"][1]["key_file"]

    async def test(jid, primary, bystander):
        log = OutputLog(job_workdir(primary.paths.root, jid))
        log.append(b"epoch 1 loss 0.9\n")
        code, out, _ = await cli(capsys, "job", "logs", jid.hex(), "--node", bystander.paths.root, "--key", owner_key)
        assert (code, out) == (0, "epoch 1 loss 0.9\n")
        code, _, err = await cli(capsys, "job", "logs", jid.hex(), "--node", bystander.paths.root)
        one_line_error(code, err, "needs the owner's key")
        code, _, err = await cli(capsys, "job", "logs", jid.hex(), "--node", bystander.paths.root, "--key", other_key)
        one_line_error(code, err, "refused: only the job's owner or this node's operator may read its output")
        # Its own node's operator needs no key; --offset resumes where a reader stopped.
        code, out, _ = await cli(capsys, "job", "logs", jid.hex(), "--node", primary.paths.root, "--offset", 6)
        assert (code, out) == (0, "1 loss 0.9\n")

    await with_placed_job(root, layout, test)


async def test_logs_follow_until_the_job_ends_then_output_copies_its_files(mesh_dir, mock_clock, capsys):
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir
    owner_key = layout["owners"][0]["key_file"]

    async def test(jid, primary, bystander):
        workdir = job_workdir(primary.paths.root, jid)
        log = OutputLog(workdir)
        log.append(b"step 1\n")
        code, _, err = await cli(capsys, "job", "output", jid.hex(), "--out", root / "early", "--node",
                                 bystander.paths.root, "--key", owner_key)
        one_line_error(code, err, "is still placed")

        async def workload_finishes():
            await trio.sleep(0.5)
            log.append(b"step 2\n" * 40_000)   # 280 kB: more than one chunk
            with open(os.path.join(workdir, "result.json"), "w") as fh:
                fh.write('{"accuracy": 0.93}\n')
            await primary._on_exit(jid, 0)      # what the runner reports when the process exits
        async with trio.open_nursery() as nursery:
            nursery.start_soon(workload_finishes)
            code, out, _ = await cli(capsys, "job", "logs", jid.hex()[:8], "--follow", "--node", bystander.paths.root,
                                     "--key", owner_key)
        assert code == 0 and out == "step 1\n" + "step 2\n" * 40_000   # whole, once, in order
        code, out, _ = await cli(capsys, "job", "status", jid.hex(), "--node", bystander.paths.root, "--json")
        assert (json.loads(out)["state"], json.loads(out)["exit_code"]) == ("completed", 0)
        code, out, _ = await cli(capsys, "job", "output", jid.hex(), "--out", root / "results", "--node",
                                 bystander.paths.root, "--key", owner_key, "--json")
        assert code == 0 and [f["path"] for f in json.loads(out)["files"]] == ["result.json"]
        assert (root / "results" / "result.json").read_text() == '{"accuracy": 0.93}\n'
        code, _, err = await cli(capsys, "job", "output", jid.hex(), "--out", root / "results", "--node",
                                 bystander.paths.root, "--key", owner_key)
        one_line_error(code, err, "already exists")

    await with_placed_job(root, layout, test)


async def test_move_and_cancel_are_signed_by_the_owner_only(mesh_dir, mock_clock, capsys):
    """`job move` (SPEC.md R2; its refusals are in tests/test_job_move.py) and `job cancel`
    (only once), in one mesh: each CLI call runs the mesh through seconds of virtual time."""
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir
    owner_key, other_key = layout["owners"][0]["key_file"], layout["owners"][1]["key_file"]

    async def test(jid, primary, bystander):
        await primary._handle(primary.core.workload_started(jid, 1, 0, primary.core.last_tick_ms))
        await trio.sleep(0.5)
        code, out, _ = await cli(capsys, "job", "move", jid.hex(), "--node", bystander.paths.root,
                                 "--key", owner_key, "--json")
        moved, me = json.loads(out), primary.identity.public_key.hex()
        assert code == 0 and moved["moved"] and (moved["from"], moved["fence"]) == (me, 2) and moved["to"] != me
        assert primary.core.job_view(jid)["primary"].hex() == moved["to"]   # decided everywhere
        code, _, err = await cli(capsys, "job", "cancel", jid.hex(), "--node", bystander.paths.root, "--key", other_key)
        one_line_error(code, err, "only the owner may cancel it")
        code, out, _ = await cli(capsys, "job", "cancel", jid.hex(), "--node", bystander.paths.root,
                                 "--key", owner_key, "--json")
        assert code == 0 and json.loads(out) == {"job_id": jid.hex(), "cancelled": True, "state": "cancelled"}
        await trio.sleep(0.5)
        assert primary.core.job_view(jid)["state"] == "cancelled"   # broadcast: the primary stopped it too
        code, _, err = await cli(capsys, "job", "cancel", jid.hex(), "--node", bystander.paths.root, "--key", owner_key)
        one_line_error(code, err, "already ended (cancelled)")

    await with_placed_job(root, layout, test)


def test_follow_resumes_at_its_offset_and_starts_over_on_the_node_a_job_moved_to():
    """follow_log against a scripted node: a failed read after a good one is waited out (a
    failover), and a new primary's log is read from its start."""
    from meshnode.cli.job_life import follow_log
    from meshnode.control.client import ControlUnavailable

    logs = {"a": b"one\ntwo\n", "b": b"resumed\nthree\n"}
    script = itertools.chain([("a", "running", True), ("a", "running", True), None, ("b", "running", True),
                              ("b", "running", True)], itertools.repeat(("b", "completed", False)))
    asked, notes = [], []

    class Reader:
        job_id_hex = "00" * 32

        def read(self, target, offset=0):
            step = next(script)
            if step is None:
                raise ControlUnavailable("job_output: peer a did not answer")
            primary, state, running = step
            asked.append((primary, offset))
            data = logs[primary][offset:offset + 4]
            return {"primary": primary, "state": state, "running": running, "offset": offset, "data": data,
                    "end": len(logs[primary])}

    class Node:
        def call(self, op, **args):
            assert op == "job_status"
            return {"primary": "a", "state": "running"}

    class Out:
        written = b""

        def write(self, data):
            Out.written += data

        def flush(self):
            pass

    follow_log(Reader(), Node(), 0, True, Out(), notes.append, sleep=lambda s: None, clock=lambda: 0.0)
    assert Out.written == b"one\ntwo\nresumed\nthree\n"
    assert asked == [("a", 0), ("a", 4), ("b", 8), ("b", 0), ("b", 4), ("b", 8), ("b", 12)]
    assert notes == ["job moved to node b; its output there follows"]


def test_job_tables_fit_80_columns_without_wrapping_ids():
    from rich.console import Console
    from meshnode.cli.job_life import render_job_list, render_job_status
    job = {"job_id": "ab" * 32, "name": "a-very-long-job-name-that-goes-on" * 2, "owner": "01" * 32,
           "state": "cancelled", "primary": "02" * 32, "backups": ["03" * 32, "04" * 32], "fence": 65537,
           "checkpoint_seq": 123456, "checkpoint_age_ms": 987_654, "migrations": 12, "lost_work_ms": None,
           "exit_code": 255, "submitted_ms": 1, "declines": {}, "hint": None, "attempt": 3, "max_retries": 16,
           "running_here": False}
    for table, shown_id in ((render_job_list({"jobs": [job, dict(job, job_id="cd" * 32)]}), "ab" * 4),
                            (render_job_status(job), "ab" * 32)):
        console = Console(width=80, record=True, force_terminal=False)
        console.print(table)
        lines = console.export_text().splitlines()
        assert max(len(line) for line in lines) <= 80
        # The id whole on one line, as a word of its own: copied, it names the job.
        assert sum(shown_id in line.split() for line in lines) == 1

