"""The owner's TUI, headless (Textual's run_test pilot) against a fake control server.

The fake node speaks the real control framing (meshnode.control.wire) on a Unix
socket, verifies submitted jobs with the real manifest code, and changes job state
only when the test tells it to, so every assertion waits for a state the test made.
Textual runs on asyncio, so each UI test drives its own loop with asyncio.run.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import tempfile
import threading
import time

import pytest
from rich.console import Console
from textual.widgets import Input, Static

from keys.identity import SigningIdentity, short_id
from keys.keystore import KDF_PROFILES, encode_keystore
from meshnode.cli import main as cli_main
from meshnode.control.wire import LENGTH_PREFIX_BYTES, decode_map, encode_frame
from meshnode.tui.app import MAX_EVENT_LINES, FollowedJob, OwnerTui
from meshnode.tui.form import DEFAULT_VALUES, check_form, field_of_error, form_to_toml
from meshnode.tui.screens import ComposeScreen, PassphraseScreen, WhyScreen
from meshnode.tui.tables import (consensus_row, event_line, evidence_row, job_row, node_label, render_snapshot,
                                  status_line)
from meshnode.tui.why import format_declines, group_declines, placeable_hint, suggest_changes
from meshnode.workload.manifest import parse_manifest, verify_signed_job
from protocol.messages import Cancel, decode_message, job_id

MESH_ID = bytes(range(32))
BORROWING = ("waiting for capacity on borrowed quota (pool 'batch': owner ab12cd34's quota gpu_milli 1000, in use "
             "gpu_milli 1000): once running, it may be preempted by in-quota work")
WAIT_S = 10.0  # upper bound on any one UI condition; a pass normally takes milliseconds


def parse_at_epoch_0(text, owner_pubkey, now_ms):
    return parse_manifest(text, owner_pubkey, now_ms, epoch=0)


def gpu(index, total, used, util=50_000, temp=60_000, throttle=0):
    return {"index": index, "model": "H100", "mem_total_mib": total, "mem_used_mib": used, "util_milli": util,
            "temp_milli_c": temp, "sm_clock_mhz": 1980, "throttle_reasons": throttle, "ecc_errors": 0,
            "power_mw": 300_000}


def node_row(short, zone, gpus=(), free=(), health="alive"):
    return {"key": short * 8, "short": short, "stake": 100, "zone": zone, "health": health, "rtt_us": 800,
            "capability": {"gpus": list(gpus), "gpus_free": list(free), "cpu_milli_free": 4000,
                           "mem_mib_free": 8192, "taken_ms": 1}}


async def read_frame(reader: asyncio.StreamReader) -> dict:
    """One request frame; IncompleteReadError when the client has gone."""
    (length,) = struct.unpack(">I", await reader.readexactly(LENGTH_PREFIX_BYTES))
    return decode_map(await reader.readexactly(length))


class FakeNode:
    """A control server with a scripted mesh; ``place`` moves a job on like the real node would."""

    def __init__(self, path: str):
        self.path = path
        self.jobs: dict[str, dict] = {}
        self.nodes = [node_row("aaaa0001", "zone-a", [gpu(0, 81920, 1024, throttle=0x20)], [0]),
                      node_row("bbbb0002", "zone-b", [gpu(0, 24576, 0)], [0])]
        self.requests: list[str] = []
        self.received_jobs = []
        self.why_gang = None   # a gang's part of the why reply (SPEC.md GA4), when a test sets one
        self.server = None
        self.writers: set = set()
        self.handlers: set = set()

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, self.path)

    async def stop(self) -> None:
        self.server.close()
        for writer in list(self.writers):
            writer.close()
        await self.server.wait_closed()
        await asyncio.gather(*self.handlers)  # each ends at the EOF its closed connection gives it
        os.unlink(self.path)

    def place(self, jid: str, state: str = "placed") -> None:
        self.jobs[jid].update(state=state, primary="aaaa0001" * 8, backups=["bbbb0002" * 8])
        for writer in list(self.writers):
            if getattr(writer, "subscribed", False):
                writer.write(encode_frame({"event": {"kind": "job_" + state, "at_ms": 5, "detail": {"job_id": jid}}}))

    def publish(self, kind: str, detail: dict) -> None:
        for writer in list(self.writers):
            if getattr(writer, "subscribed", False):
                writer.write(encode_frame({"event": {"kind": kind, "at_ms": 5, "detail": detail}}))

    def handle(self, op: str, args: dict):
        if op == "status":
            return {"node": "aaaa0001" * 8, "peer_id": "12D3", "mesh_id": MESH_ID.hex(), "epoch": 1, "members": 2,
                    "connected": 1, "uptime_ms": 1000}
        if op == "nodes":
            return {"nodes": self.nodes}
        if op == "jobs":
            return {"jobs": list(self.jobs.values())}
        if op == "consensus":
            return {"instances": [{"instance": "cc" * 32, "kind": "placement", "round": 0, "leader": "aa" * 32,
                                   "decided": True}], "certificates": 1, "evidence": []}
        if op == "submit":
            envelope, job = verify_signed_job(args["job"], MESH_ID)
            self.received_jobs.append(job)
            jid = job_id(job).hex()
            self.jobs[jid] = {"job_id": jid, "name": job.name, "owner": job.owner.hex(), "state": "pending",
                              "primary": None, "backups": [], "fence": 0, "checkpoint_age_ms": None,
                              "checkpoint_seq": None, "migrations": 0, "lost_work_ms": None, "submitted_ms": 1,
                              "declines": {"not_enough_gpu_memory": 1}, "hint": None}
            return {"job_id": jid}
        if op == "cancel":
            envelope, cancel = decode_message(args["request"], MESH_ID, expect=Cancel)
            row = self.jobs[cancel.job_id.hex()]
            if envelope.signer.hex() != row["owner"] or row["state"] == "cancelled":
                raise KeyError("cancel refused: not the owner, or already cancelled")
            row["state"] = "cancelled"
            return {"job_id": cancel.job_id.hex()}
        if op == "why":
            return {"declines": {"not_enough_gpu_memory": ["bbbb0002"]}, "hint": "lower gpu memory",
                    "borrowing": BORROWING,
                    **({"gang": self.why_gang} if self.why_gang else {}),
                    "queue": {"pool": "", "position": 1, "queue_length": 2, "ahead_with_higher_priority": 0,
                              "quota": None, "estimate": {"start_ms": None, "in_ms": None,
                                                          "reason": "unknown: no node frees enough by declared runtimes"}}}
        raise KeyError("unknown op " + op)

    async def _serve(self, reader, writer) -> None:
        self.writers.add(writer)
        self.handlers.add(asyncio.current_task())
        try:
            while True:
                request = await read_frame(reader)
                self.requests.append(request["op"])
                if request["op"] == "subscribe":
                    writer.subscribed = True
                    writer.write(encode_frame({"id": request["id"], "ok": True, "result": {}}))
                    continue
                try:
                    reply = {"id": request["id"], "ok": True, "result": self.handle(request["op"], request["args"])}
                except KeyError as exc:
                    reply = {"id": request["id"], "ok": False, "error": exc.args[0]}
                writer.write(encode_frame(reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.writers.discard(writer)
            self.handlers.discard(asyncio.current_task())
            writer.close()


def write_keystore(directory: str, passphrase: bytes | None) -> tuple[str, SigningIdentity]:
    identity = SigningIdentity(bytes([7]) * 32)
    path = os.path.join(directory, "owner.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(encode_keystore(identity, passphrase, KDF_PROFILES["insecure-test"]))
    return path, identity


async def until(pilot, predicate, what: str, timeout_s: float = WAIT_S, poll_s: float = 0.02) -> None:
    """Let the app run until ``predicate()`` holds; fail after ``timeout_s`` with ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("timed out waiting for " + what)
        await pilot.pause(poll_s)


def short_dir() -> str:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    return tempfile.mkdtemp(prefix="tui", dir="/tmp")


def text_of(app, selector: str) -> str:
    """The text of a Static on the top screen (a dialog), else on the main views."""
    found = app.screen.query(selector)
    widget = found.first(Static) if found else app.screen_stack[0].query_one(selector, Static)
    return str(widget.render())


def new_app(directory: str, key_path: str | None) -> OwnerTui:
    return OwnerTui(directory, key_path, poll_s=0.2, retry_min_s=0.02, retry_max_s=0.1, clock_ms=lambda: 1_000)


# --- compose -> sign -> broadcast -> placed ---------------------------------------------------

def test_compose_sign_broadcast_and_follow_to_placement():
    async def scenario():
        directory = short_dir()
        key_path, identity = write_keystore(directory, None)
        node = FakeNode(os.path.join(directory, "control.sock"))
        await node.start()
        app = new_app(directory, key_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.connected, "connected")
            await until(pilot, lambda: app.mesh_table.row_count == 2, "mesh rows")
            await pilot.press("n")
            await until(pilot, lambda: isinstance(app.screen, ComposeScreen), "compose form")
            await pilot.press(*"job1")  # the name field has focus first
            app.screen.query_one("#field-gpus", Input).value = "1"
            app.screen.query_one("#field-gpu_mem_mib", Input).value = "40000"
            await pilot.pause()
            assert app.screen.check.manifest is not None, app.screen.check.error
            await pilot.press("ctrl+s")
            await until(pilot, lambda: len(node.received_jobs) == 1, "the node to receive the job")
            job = node.received_jobs[0]
            assert (job.name, job.owner, job.resources.gpus, job.resources.gpu_mem_mib, job.epoch) == \
                ("job1", identity.public_key, 1, 40000, 1)   # signed for the node's epoch (SPEC.md P2)
            jid = job_id(job).hex()
            await until(pilot, lambda: app.followed is not None and jid in app.jobs, "the job row")
            assert app.tabs.active == "jobs"
            node.place(jid)
            await until(pilot, lambda: "placed" in app.followed.states, "placement to show")
            assert "submitted -> pending -> placed" in text_of(app, "#jobs-note")
            await pilot.pause()
            assert "submitted -> pending -> placed" in app.screen_text(), "the note is hidden under the footer"
            assert "placed" in app.jobs_table.get_row(jid)
        await node.stop()
    asyncio.run(scenario())


def test_encrypted_key_prompts_for_passphrase_in_a_modal_and_retries_a_wrong_one():
    async def scenario():
        directory = short_dir()
        key_path, identity = write_keystore(directory, b"correct horse")
        node = FakeNode(os.path.join(directory, "control.sock"))
        await node.start()
        app = new_app(directory, key_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.connected, "connected")
            manifest = parse_manifest('name = "p"\nentrypoint = "counter"\n', identity.public_key, 1, epoch=0)
            app.submit_job(manifest)
            await until(pilot, lambda: isinstance(app.screen, PassphraseScreen), "passphrase modal")
            await pilot.press(*"wrong", "enter")
            await until(pilot, lambda: isinstance(app.screen, PassphraseScreen)
                        and "wrong passphrase" in text_of(app, "#passphrase-problem"), "wrong passphrase shown")
            await pilot.press(*"correct horse", "enter")
            await until(pilot, lambda: len(node.received_jobs) == 1, "the signed job")
            assert node.received_jobs[0].owner == identity.public_key
        await node.stop()
    asyncio.run(scenario())


# --- disconnected -> reconnected ------------------------------------------------------------

def test_node_going_away_shows_disconnected_and_reconnects_when_it_returns():
    async def scenario():
        directory = short_dir()
        node = FakeNode(os.path.join(directory, "control.sock"))
        app = new_app(directory, None)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: "disconnected" in text_of(app, "#connection"), "disconnected before start")
            await node.start()
            await until(pilot, lambda: app.connected, "first connection")
            assert text_of(app, "#connection").startswith("connected")
            await node.stop()
            await until(pilot, lambda: not app.connected, "the loss to be noticed")
            assert "disconnected" in text_of(app, "#connection")
            await pilot.press("n", "w", "x", "r")  # actions while disconnected must not crash
            await node.start()
            await until(pilot, lambda: app.connected, "reconnection")
            assert node.requests.count("status") >= 1
        await node.stop()
    asyncio.run(scenario())


def without_time(event_line_text: str) -> str:
    """An events-view line less its time of day, with single spaces."""
    return " ".join(event_line_text.split()[1:])


def test_events_view_keeps_the_newest_lines_while_it_is_not_shown():
    # RichLog holds back every write until it is first laid out, without a bound; the app
    # keeps the history itself so a long session on another tab cannot grow without limit.
    async def scenario():
        directory = short_dir()
        node = FakeNode(os.path.join(directory, "control.sock"))
        await node.start()
        app = new_app(directory, None)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.connected and "subscribe" in node.requests, "the event subscription")
            total = MAX_EVENT_LINES + 20
            for n in range(total):
                node.publish("tick", {"n": n})
            await until(pilot, lambda: app.event_lines and app.event_lines[-1].endswith("n=%d" % (total - 1)),
                        "the last event")
            assert len(app.event_lines) == MAX_EVENT_LINES
            assert without_time(app.event_lines[0]) == "tick n=20"
            # Nothing is written to the hidden view, not even into RichLog's unbounded backlog.
            assert app.events_log.lines == [] and len(app.events_log._deferred_renders) == 0
            await pilot.press("4")
            await until(pilot, lambda: len(app.events_log.lines) == MAX_EVENT_LINES, "the events view filled")
            assert without_time(app.events_log.lines[0].text) == "tick n=20"
            node.publish("tock", {"n": 0})
            await until(pilot, lambda: without_time(app.events_log.lines[-1].text) == "tock n=0", "a live event")
        await node.stop()
    asyncio.run(scenario())


# --- form validation --------------------------------------------------------------------------

def test_form_validation_names_the_field_as_you_type():
    async def scenario():
        directory = short_dir()
        key_path, _ = write_keystore(directory, None)
        app = new_app(directory, key_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("n")
            await until(pilot, lambda: isinstance(app.screen, ComposeScreen), "compose form")
            form = app.screen
            assert "name: " in text_of(app, "#form-error")  # the empty default name is invalid
            assert form.query_one("#field-name", Input).has_class("invalid")
            await pilot.press(*"ok")
            await pilot.pause()
            assert text_of(app, "#form-error").startswith("ok")
            form.query_one("#field-gpus", Input).value = "two"
            await pilot.pause()
            assert text_of(app, "#form-error").startswith("invalid: resources.gpus: expected an integer")
            assert form.query_one("#field-gpus", Input).has_class("invalid")
            assert not form.query_one("#field-name", Input).has_class("invalid")
            assert form.query_one("#submit").disabled
            await pilot.press("ctrl+s")  # refused while invalid: the form stays
            assert app.screen is form
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, ComposeScreen), "form to close")
    asyncio.run(scenario())


@pytest.mark.parametrize("field_id, text, field_path", [
    ("priority", "5000", "priority"),
    ("strategy", "sovereign", "strategy"),
    ("labels", "rack", "constraints.labels"),
    ("args", "'unclosed", "args"),
    ("gpu_mem_mib", "-1", "resources.gpu_mem_mib"),
])
def test_form_errors_name_the_manifest_field(field_id, text, field_path):
    values = dict(DEFAULT_VALUES, name="j", **{field_id: text})
    check = check_form(values, parse_at_epoch_0, bytes(32), 1)
    assert check.manifest is None
    assert check.error.startswith(field_path + ":"), check.error
    assert check.field == field_id


def test_form_builds_the_manifest_a_file_would():
    values = dict(DEFAULT_VALUES, name='quote"d', args='--steps 100 "two words"', zones="zone-a, zone-b",
                  labels="rack=r1", attested="country=DE", strategy="sovereign", gpus="2", gpu_mem_mib="8000")
    manifest = check_form(values, parse_at_epoch_0, bytes(32), 7).manifest
    assert manifest.name == 'quote"d' and manifest.args == ("--steps", "100", "two words")
    assert manifest.constraints.zones == ("zone-a", "zone-b")
    assert dict(manifest.constraints.labels) == {"rack": "r1"}
    assert dict(manifest.constraints.attested) == {"country": "DE"}
    assert (manifest.resources.gpus, manifest.resources.gpu_mem_mib, manifest.created_ms) == (2, 8000, 7)
    assert parse_at_epoch_0(form_to_toml(values), bytes(32), 7) == manifest
    assert field_of_error("constraints.zones: expected") == "zones"


# --- why pending ------------------------------------------------------------------------------

def test_declines_are_grouped_by_reason_most_common_first():
    declines = {"zone_not_allowed": ["n4", "n5"], "not_enough_gpu_memory": ["n3", "n1", "n2"], "fenced": []}
    assert format_declines(declines) == "3 nodes: not enough GPU memory; 2 nodes: zone not allowed"
    assert group_declines(declines)[0].nodes == ("n1", "n2", "n3")
    assert format_declines({"not_enough_gpus": 1}) == "1 node: not enough free GPUs"
    assert format_declines({}) == "no declines yet"


def test_hint_names_the_change_that_unblocks_most_nodes():
    nodes = [node_row("n1", "zone-a", [gpu(0, 24576, 0)], [0]), node_row("n2", "zone-a", [gpu(0, 16384, 0)], [0]),
             node_row("n3", "zone-b", [gpu(0, 81920, 0)], [0]), node_row("n4", "zone-c", [gpu(0, 81920, 0)], [0]),
             node_row("n5", "zone-c", [gpu(0, 81920, 0)], [0])]
    job = {"resources": {"gpus": 1, "gpu_mem_mib": 40000}, "constraints": {"zones": ["zone-b"]}}
    declines = {"not_enough_gpu_memory": ["n1", "n2"], "zone_not_allowed": ["n4", "n5"], "node_unhealthy": ["n9"]}
    suggestions = suggest_changes(declines, job, nodes)
    assert [(s.field, s.unblocks) for s in suggestions] == [("constraints.zones", 2), ("resources.gpu_mem_mib", 1)]
    assert suggestions[0].change == "add zone-c"
    assert suggestions[1].change == "lower to <= 24576 MiB (asked 40000)"
    assert placeable_hint(declines, job, nodes) == "constraints.zones: add zone-c (would unblock 2 nodes)"


def test_hint_when_nothing_in_the_job_can_help_or_nothing_declined():
    assert "no change to the job helps" in placeable_hint({"node_unhealthy": 3, "fenced": 1}, {})
    assert "still running" in placeable_hint({}, {})
    # counts only (the jobs op), no capability vectors: still a field to change
    assert placeable_hint({"not_enough_gpus": 2}, {"resources": {"gpus": 4}}).startswith("resources.gpus: lower it")


def test_why_screen_shows_groups_and_hint():
    async def scenario():
        directory = short_dir()
        node = FakeNode(os.path.join(directory, "control.sock"))
        await node.start()
        key_path, identity = write_keystore(directory, None)
        manifest = parse_manifest('name = "big"\nentrypoint = "counter"\n[resources]\ngpus = 1\ngpu_mem_mib = 60000\n',
                                  identity.public_key, 1, epoch=1)  # FakeNode's epoch: signed as is
        app = new_app(directory, key_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.connected, "connected")
            app.submit_job(manifest)
            jid = job_id(manifest).hex()
            await until(pilot, lambda: jid in app.jobs, "the pending job")
            await pilot.press("2")
            await until(pilot, lambda: app.selected_job() is not None, "a selected job")
            await pilot.press("w")
            await until(pilot, lambda: isinstance(app.screen, WhyScreen), "why screen")
            text = text_of(app, "#why-text")
            assert "1 node: not enough GPU memory (bbbb0002)" in text
            assert "node says: lower gpu memory" in text
            assert "queue: 1 of 2 in pool default" in text and "estimated start: unknown" in text   # SPEC Q3, Q4
            assert "resources.gpu_mem_mib: lower to <= 24576 MiB (asked 60000)" in text
            assert BORROWING in text   # SPEC Q6: on borrowed quota, reclaimable by in-quota work
            await pilot.press("escape")
            # A gang: its rule, ranks, topology groups and recovery history, as `meshnode why` shows them.
            node.why_gang = {"topology": "rail_group", "sizes": [4, 2], "workers": [
                {"rank": 0, "primary": "aa" * 32, "state": "running", "fence": 65537},
                {"rank": 1, "primary": "bb" * 32, "state": "migrating", "fence": 65538}],
                "groups": [{"group": "zone-a/rail-1", "nodes": 3, "fit": 2, "gpus": 18, "gpus_free": 12,
                            "allowed": True}],
                "history": [{"kind": "placed", "epoch": 1, "attempt": 0, "workers": ["aa" * 32, "cc" * 32]},
                            {"kind": "rank_moved", "epoch": 2, "rank": 1, "from": "cc" * 32, "to": "bb" * 32}]}
            await pilot.press("w")
            await until(pilot, lambda: isinstance(app.screen, WhyScreen), "why screen")
            text = text_of(app, "#why-text")
            assert "gang: 2..4 workers (4/2), topology rail_group" in text
            assert "zone-a/rail-1: 2/3 nodes, 12/18 GPUs" in text
            assert "rank 1 moved %s -> %s" % (node_label("cc" * 32), node_label("bb" * 32)) in text
            node.why_gang = None
            await pilot.press("escape")
            await pilot.press("x")  # an owner-signed Cancel, verified by the node
            await until(pilot, lambda: app.jobs[jid]["state"] == "cancelled", "the job to be cancelled")
            await pilot.press("x")  # a second cancel is refused: the refusal is shown, not raised
            await until(pilot, lambda: any("already cancelled" in str(n.message) for n in app._notifications),
                        "the cancel refusal")
        await node.stop()
    asyncio.run(scenario())


def test_every_view_names_a_node_by_the_mesh_views_label():
    # The nodes op labels a node with keys.identity.short_id (a hash of the key), not the
    # key's hex prefix; a job's primary must read the same, or it cannot be found by eye.
    key = SigningIdentity(bytes([9]) * 32).public_key.hex()
    label = short_id(bytes.fromhex(key))
    assert not key.startswith(label)
    assert job_row({"job_id": "ab" * 32, "name": "j", "state": "placed", "primary": key})[3] == label
    assert consensus_row({"instance": "cd" * 32, "leader": key})[3] == label
    assert evidence_row({"offender": key, "kind": "equivocation", "at_ms": 1})[0] == label
    assert status_line({"node": key, "mesh_id": "ef" * 32}).startswith("node %s  mesh efefefef" % label)
    assert event_line({"kind": "placed", "at_ms": 7, "detail": {"job_id": "ab" * 32, "primary": key, "fence": 1}},
                      EVENT_WALL_MS).endswith("placed           fence=1 job_id=abababab primary=%s" % label)
    followed = FollowedJob("ab" * 32, "train", ["submitted", "placed"], primary=key)
    assert followed.text() == "following abababab train: submitted -> placed (primary %s)" % label


EVENT_WALL_MS = 1_700_000_000_123


def test_events_read_as_times_of_day_without_clock_counters():
    line = event_line({"kind": "decided", "at_ms": 88_123_456, "detail": {"mono_ns": 987654321012, "round": 0,
                                                                           "votes": {"a": 1}, "none": None}},
                      EVENT_WALL_MS)
    clock = time.strftime("%H:%M:%S", time.localtime(EVENT_WALL_MS // 1000)) + ".123"
    assert line == clock + " decided          none=- round=0 votes=a=1"
    assert "mono_ns" not in line and "88123456" not in line


def test_arrow_keys_move_the_selection_without_a_tab_first():
    async def scenario():
        directory = short_dir()
        node = FakeNode(os.path.join(directory, "control.sock"))
        node.jobs.update({jid: {"job_id": jid, "name": jid[:4], "state": "running", "primary": "aa" * 32,
                                "backups": [], "declines": {}} for jid in ("11" * 32, "22" * 32)})
        await node.start()
        app = new_app(directory, None)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.mesh_table.row_count == 2, "mesh rows")
            await pilot.press("down")
            assert app.mesh_table.cursor_row == 1
            await pilot.press("2")
            await until(pilot, lambda: app.jobs_table.row_count == 2, "job rows")
            await pilot.press("down")
            assert app.jobs_table.cursor_row == 1 and app.selected_job()["job_id"] == "22" * 32
        await node.stop()
    asyncio.run(scenario())


# --- snapshot ---------------------------------------------------------------------------------

def test_snapshot_prints_mesh_and_jobs_tables():
    node = FakeNode("/nonexistent")
    node.jobs["ab" * 32] = {"job_id": "ab" * 32, "name": "train-1", "state": "running", "primary": "aa" * 32,
                            "backups": ["bb" * 32], "checkpoint_age_ms": 40, "checkpoint_seq": 12, "migrations": 1,
                            "lost_work_ms": 80, "declines": {}}
    snapshot = {op: node.handle(op, {}) for op in ("status", "nodes", "jobs", "consensus")}
    out = io.StringIO()
    render_snapshot(snapshot, Console(file=out, width=80, color_system=None))
    text = out.getvalue()
    assert "mesh: 2 nodes" in text and "aaaa0001" in text and "therm" in text and "zone-b" in text
    assert "train-1" in text and "running" in text and "40 ms #12" in text and "80 ms" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_malformed_results_are_treated_as_a_bad_connection_not_a_crash():
    async def scenario():
        directory = short_dir()
        node = FakeNode(os.path.join(directory, "control.sock"))
        node.jobs["x"] = {"name": "no job id"}
        await node.start()
        app = new_app(directory, None)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: "malformed control result" in text_of(app, "#connection"), "the fault shown")
            assert not app.connected
            del node.jobs["x"]
            await until(pilot, lambda: app.connected, "recovery once the node answers well")
        await node.stop()
    asyncio.run(scenario())


def test_cli_snapshot_against_a_node_in_another_thread(capsys):
    directory = short_dir()
    node = FakeNode(os.path.join(directory, "control.sock"))
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(node.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(WAIT_S)
    try:
        assert cli_main(["tui", "--node", directory, "--snapshot"]) == 0
        text = capsys.readouterr().out
        assert "mesh: 2 nodes" in text and "aaaa0001" in text and "consensus: 1 certificates" in text
        assert cli_main(["tui", "--node", directory, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["status"]["epoch"] == 1
    finally:
        asyncio.run_coroutine_threadsafe(node.stop(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
    assert cli_main(["tui", "--node", directory, "--snapshot"]) == 2  # node gone: one error line
    assert "node not running" in capsys.readouterr().err


def test_the_tuis_data_tables_fit_80_columns_in_the_worst_case():
    # Textual's DataTable gives each column its widest cell plus one cell of padding on each
    # side; the views must fit an 80-column terminal with wide (not absurd) cells: a 6-digit
    # stake, 8 GPUs each throttled every way, a job 100 minutes in (checkpoint #99999).
    from meshnode.tui.tables import JOB_COLUMNS, MESH_COLUMNS, job_row, mesh_row
    hot = node_row("aaaa0001", "zone-abcdefgh", [gpu(i, 81920, 81000, util=100_000, temp=99_000, throttle=0xff)
                                                 for i in range(8)], [0])
    hot["rtt_us"], hot["stake"], hot["health"] = 999_999, 100_000, "suspected"
    job = {"job_id": "ab" * 32, "name": "a-very-long-job-name", "state": "migrating", "primary": "cd" * 32,
           "backups": ["ef" * 32] * 3, "checkpoint_seq": 99_999, "checkpoint_age_ms": 9_999,
           "migrations": 99, "lost_work_ms": 99}
    for columns, row in ((MESH_COLUMNS, mesh_row(hot)), (JOB_COLUMNS, job_row(job))):
        width = sum(max(len(header), len(cell)) + 2 for header, cell in zip(columns, row))
        assert width <= 80, (width, row)


def test_the_consensus_table_says_gave_up_for_an_instance_given_up_here():
    row = {"instance": "cd" * 32, "kind": "replica_action", "round": 3, "leader": None}
    assert consensus_row({**row, "decided": True})[4] == "yes"
    assert consensus_row({**row, "decided": False, "gave_up": True})[4] == "gave up"
    assert consensus_row({**row, "decided": False, "gave_up": False})[4] == "no"
