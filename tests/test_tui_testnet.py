"""The owner's TUI, headless, against a REAL 4-node testnet on 127.0.0.1.

tests/test_tui.py drives every screen against a scripted fake node; this module checks
that the same flows work against `meshnode run` processes: the real control API's
result shapes and event stream, the real placement vote, and a node that really goes
away and comes back. One testnet serves both tests (it takes seconds to start), with
workloads off: placement is what the TUI follows, and a busy counter process per job
would only load the machine. Every wait polls the app's state against a deadline; none
asserts how fast anything happened.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import pytest
from textual.widgets import Input

from keys.genesis import load_genesis
from keys.keystore import KDF_PROFILES, encode_keystore, load_identity
from meshnode.control.client import ControlClient
from meshnode.node.config import node_paths
from meshnode.tui.app import OwnerTui
from meshnode.tui.screens import ComposeScreen, PassphraseScreen, WhyScreen
from meshnode.tui.tables import JOB_COLUMNS, MESH_COLUMNS
from meshnode.workload.manifest import parse_manifest
from protocol.messages import encode_message
from testnet import launcher
from test_tui import until as until_in_app

pytestmark = pytest.mark.e2e
NODES = 4
PASSPHRASE = "owner passphrase"
DEADLINE_S = 30.0  # upper bound on any one condition; on an idle machine each takes well under a second
PLACED_STATES = ("placed", "running")
LIVE_STATES = PLACED_STATES + ("migrating",)


@pytest.fixture(scope="module")
def testnet():
    # A short path under /tmp: a Unix socket path is limited to 107 bytes.
    root = tempfile.mkdtemp(prefix="tuinet", dir="/tmp")
    try:
        launcher.up(root, NODES, run_workloads=False)
        layout = launcher.load_layout(root)
        # The testnet's owner key is unencrypted; an encrypted copy of the same identity
        # makes the TUI ask for the passphrase in its modal, as it would for a real owner.
        owner = load_identity(layout["owners"][0]["key_file"], None)
        encrypted_key = os.path.join(root, "owner-encrypted.key")
        with open(encrypted_key, "wb") as fh:
            fh.write(encode_keystore(owner, PASSPHRASE.encode(), KDF_PROFILES["insecure-test"]))
        os.chmod(encrypted_key, 0o600)
        yield {"root": root, "layout": layout, "owner": owner, "encrypted_key": encrypted_key}
    finally:
        if os.path.exists(os.path.join(root, launcher.LAYOUT_FILE)):
            launcher.down(root)
        left = launcher.testnet_processes(root)
        shutil.rmtree(root, ignore_errors=True)
    assert left == [], "testnet processes left running: %s" % left


def new_app(node_dir: str, key_path: str | None) -> OwnerTui:
    return OwnerTui(node_dir, key_path, poll_s=0.2, retry_min_s=0.05, retry_max_s=0.5)


async def until(pilot, predicate, what: str) -> None:
    await until_in_app(pilot, predicate, what, timeout_s=DEADLINE_S, poll_s=0.05)


def connection_text(app) -> str:
    return str(app.connection_bar.render())


def event_lines(app) -> list[str]:
    return list(app.event_lines)


def job_state(app, jid: str) -> str | None:
    row = app.jobs.get(jid)
    return None if row is None else row.get("state")


def jobs_at(node_dir: str) -> dict:
    with ControlClient(node_dir) as client:
        return {j["job_id"]: j for j in client.call("jobs")["jobs"]}


def test_compose_sign_broadcast_until_placed_on_a_real_testnet(testnet):
    node_dirs = [n["dir"] for n in testnet["layout"]["nodes"]]
    member_keys = {n["public_key"] for n in testnet["layout"]["nodes"]}

    async def scenario() -> str:
        app = new_app(node_dirs[0], testnet["encrypted_key"])
        async with app.run_test(size=(100, 30)) as pilot:
            # Capability vectors are gossiped a moment after the peers connect: wait for all four.
            await until(pilot, lambda: app.connected and len(app.nodes) == NODES
                        and all(n["capability"] for n in app.nodes), "the mesh view of 4 nodes with GPUs")
            assert app.status["mesh_id"] == testnet["layout"]["mesh_id"]
            assert {n["key"] for n in app.nodes} == member_keys
            assert app.mesh_table.row_count == NODES
            gpu_cells = {app.mesh_table.get_row(n["key"])[MESH_COLUMNS.index("gpus")] for n in app.nodes}
            assert gpu_cells == {"8/8 H100-80GB", "4/4 A100-40GB", "2/2 L4-24GB", "1/1 A10-24GB"}, gpu_cells

            await pilot.press("n")
            await until(pilot, lambda: isinstance(app.screen, ComposeScreen), "the compose form")
            await pilot.press(*"tui-e2e")  # the name field has focus first
            app.screen.query_one("#field-cpu_milli", Input).value = "250"
            app.screen.query_one("#field-mem_mib", Input).value = "128"
            await pilot.pause()
            assert app.screen.check.manifest is not None, app.screen.check.error
            await pilot.press("ctrl+s")

            await until(pilot, lambda: isinstance(app.screen, PassphraseScreen), "the passphrase modal")
            await pilot.press(*PASSPHRASE, "enter")
            await until(pilot, lambda: app.followed is not None, "the node to accept the job")
            jid = app.followed.job_id
            assert app.followed.name == "tui-e2e" and app.tabs.active == "jobs"
            await until(pilot, lambda: job_state(app, jid) in PLACED_STATES, "the placement in the jobs view")

            row = app.jobs[jid]
            assert row["owner"] == testnet["owner"].public_key.hex()
            assert row["primary"] in member_keys and row["primary"] not in row["backups"]
            assert job_state(app, jid) in app.jobs_table.get_row(jid)
            # The jobs view names the primary by the same label as the mesh view's node column.
            mesh_labels = {app.mesh_table.get_row(n["key"])[0]: n["key"] for n in app.nodes}
            assert mesh_labels[app.jobs_table.get_row(jid)[JOB_COLUMNS.index("primary")]] == row["primary"]
            assert "tui-e2e" in app.jobs_table.get_row(jid)
            assert app.followed.states[0] == "submitted" and app.followed.states[-1] in PLACED_STATES
            assert "placed" in str(app.jobs_note.render()) or "running" in str(app.jobs_note.render())
            # The real event stream reached the events view, in the shape event_line reads.
            await until(pilot, lambda: any(" placed " in line and jid[:8] in line for line in event_lines(app)),
                        "the node's 'placed' event in the events view")
            await pilot.press("4")
            await until(pilot, lambda: any(jid[:8] in strip.text for strip in app.events_log.lines),
                        "the events view to show the job's events")
            await until(pilot, lambda: app.consensus.get("certificates", 0) >= 1, "a certificate")
            return jid

    jid = asyncio.run(scenario())
    # The mesh decided, not just node 0: another node holds the same placement.
    at_node_0, at_node_2 = jobs_at(node_dirs[0])[jid], jobs_at(node_dirs[2])[jid]
    assert at_node_2["state"] in PLACED_STATES
    assert (at_node_2["primary"], at_node_2["backups"]) == (at_node_0["primary"], at_node_0["backups"])


def submit_counter_job(testnet, node_dir: str, name: str) -> str:
    """Submit a small job straight through the control API (not the TUI under test)."""
    owner = testnet["owner"]
    manifest = parse_manifest('name = "%s"\nentrypoint = "counter"\n[resources]\ncpu_milli = 250\nmem_mib = 128\n'
                              % name, owner.public_key, time.time_ns() // 1_000_000, epoch=0)
    mesh_id = load_genesis(node_paths(node_dir).genesis).mesh_id
    with ControlClient(node_dir) as client:
        return client.call("submit", job=encode_message(owner, mesh_id, manifest))["job_id"]


def test_node_stopped_and_restarted_shows_disconnected_then_reconnects_with_the_job(testnet):
    root = testnet["root"]
    node_dirs = [n["dir"] for n in testnet["layout"]["nodes"]]
    jid = submit_counter_job(testnet, node_dirs[1], "survivor")

    async def scenario() -> None:
        app = new_app(node_dirs[0], testnet["layout"]["owners"][0]["key_file"])
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.connected and job_state(app, jid) in PLACED_STATES,
                        "the job placed in the jobs view")
            await pilot.press("2")
            app.jobs_table.move_cursor(row=app.jobs_table.get_row_index(jid))
            assert app.selected_job()["job_id"] == jid

            # The launcher blocks while the node shuts down: keep the TUI's loop running meanwhile.
            await asyncio.to_thread(launcher.stop_node, root, 0)
            await until(pilot, lambda: not app.connected, "the node's loss to be noticed")
            assert connection_text(app).startswith("disconnected")
            assert jid in app.jobs, "the last known jobs stay listed while disconnected"
            # Actions while disconnected answer in the UI; none of them may crash the app.
            await pilot.press("w")
            await until(pilot, lambda: isinstance(app.screen, WhyScreen), "the why dialog")
            assert "not connected" in str(app.screen.query_one("#why-text").render())
            await pilot.press("escape", "r", "x")
            # Let the cancel worker finish before the node is back, so it meets the disconnected state.
            await until(pilot, lambda: not [w for w in app.workers if w.group == "actions" and not w.is_finished],
                        "the actions to finish: %s" % [(w.name, w.state) for w in app.workers])
            assert any("cancel refused: not connected" in str(n.message) for n in app._notifications)
            assert jid in app.jobs

            await asyncio.to_thread(launcher.start_node, root, 0)
            await until(pilot, lambda: app.connected and jid in app.jobs, "reconnection with the job listed")
            assert connection_text(app).startswith("connected")
            # Without node 0 the mesh may have moved the job: with workloads off it then stays
            # "migrating" (nothing starts to report "running"), still placed and live.
            assert job_state(app, jid) in LIVE_STATES
            assert sum(line.startswith("connected to ") for line in event_lines(app)) >= 2
            await until(pilot, lambda: len(app.nodes) == NODES, "the mesh view after the restart")
        assert app.return_code in (None, 0)

    asyncio.run(scenario())
