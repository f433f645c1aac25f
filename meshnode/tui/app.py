"""The workload owner's TUI: ``meshnode tui --node DIR --key OWNER_KEY``.

A client of one node's control socket (DIR/control.sock). It polls ``status``,
``nodes``, ``jobs`` and ``consensus``, follows the ``subscribe`` event stream, and
lets the owner compose, sign and submit jobs, ask why a job is pending and cancel it.
The connection loop is the only code that talks to the node: every failure there
becomes the "disconnected" state and a retry with exponential backoff, so a node that
goes away, restarts or answers garbage never takes the TUI down.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace

from rich.console import Console
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, RichLog, Static, TabbedContent, TabPane

from keys.keystore import PassphraseSource, is_encrypted, load_identity, read_public_key
from meshnode.control.client import AsyncControlClient, ControlError, ControlUnavailable
from meshnode.tui.screens import ComposeScreen, HelpScreen, PassphraseScreen, WhyScreen
from meshnode.workload.manifest import parse_manifest
from meshnode.tui.tables import (CONSENSUS_COLUMNS, EVIDENCE_COLUMNS, JOB_COLUMNS, MESH_COLUMNS, consensus_row,
                                 event_line, evidence_row, gang_summary, gang_workers_text, job_row, mesh_row,
                                 node_label, short_job_id, status_line)
from keys.errors import KeystoreError
from meshnode.tui.why import format_declines
from protocol.envelope import ANY_MESH
from protocol.errors import RemoteProtocolError
from protocol.messages import Cancel, encode_message

CONTROL_SOCKET_NAME = "control.sock"
POLL_S = 1.0
REQUEST_TIMEOUT_S = 5.0   # a live node answers in milliseconds; longer means it is gone
RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
MAX_EVENT_LINES = 500       # the events view keeps the newest lines only
MAX_FOLLOWED_STATES = 8     # state transitions shown for the job being followed
MAX_PASSPHRASE_TRIES = 3
POLLED_OPS = ("status", "nodes", "jobs", "consensus")


def control_socket_path(node_dir: str) -> str:
    return os.path.join(node_dir, CONTROL_SOCKET_NAME)


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class FollowedJob:
    """The job the owner last submitted: its states as they were seen, oldest first."""
    job_id: str
    name: str
    states: list[str] = field(default_factory=lambda: ["submitted"])
    primary: str | None = None

    def see(self, row: dict) -> bool:
        """Record ``row``'s state; True when it changed."""
        self.primary = row.get("primary")
        if row.get("state") == self.states[-1]:
            return False
        self.states = (self.states + [row.get("state", "?")])[-MAX_FOLLOWED_STATES:]
        return True

    def text(self) -> str:
        line = "following %s %s: %s" % (short_job_id(self.job_id), self.name, " -> ".join(self.states))
        if self.primary:
            line += " (primary %s)" % node_label(self.primary)
        return line


class OwnerTui(App):
    TITLE = "meshnode"
    CSS = """
    #connection { height: 1; background: $boost; }
    #connection.down { background: $error; color: $text; }
    .note { height: auto; max-height: 3; color: $text-muted; }
    TabbedContent { height: 1fr; }  /* ends above the docked footer: the jobs note stays visible */
    DataTable { height: 1fr; }
    .dialog { width: 78; max-width: 100%; height: auto; max-height: 22; border: round $accent;
              background: $surface; padding: 0 1; }
    ModalScreen { align: center middle; }
    .form-row { height: auto; }
    .form-label { width: 23; }
    .form-row Input, .form-row Select { width: 1fr; }
    Input.invalid { background: $error 40%; }
    #form-error { height: auto; margin: 1 0 0 0; }
    .error { color: $error; }
    """
    BINDINGS = [
        Binding("question_mark", "help", "help"), Binding("n", "compose", "new job"),
        Binding("w", "why", "why pending"), Binding("x", "cancel_job", "cancel job"),
        Binding("r", "refresh", "refresh"), Binding("q", "quit", "quit"),
        Binding("1", "show('mesh')", "mesh", show=False), Binding("2", "show('jobs')", "jobs", show=False),
        Binding("3", "show('consensus')", "consensus", show=False),
        Binding("4", "show('events')", "events", show=False),
    ]

    def __init__(self, node_dir: str, key_path: str | None, *, poll_s: float = POLL_S,
                 retry_min_s: float = RETRY_MIN_S, retry_max_s: float = RETRY_MAX_S, clock_ms=wall_clock_ms):
        super().__init__()
        self.socket_path = control_socket_path(node_dir)
        self.key_path = key_path
        self.poll_s, self.retry_min_s, self.retry_max_s = poll_s, retry_min_s, retry_max_s
        self.clock_ms = clock_ms
        self.connected = False
        self.status: dict | None = None
        self.nodes: list[dict] = []
        self.jobs: dict[str, dict] = {}
        self.consensus: dict = {}
        self.manifest_bodies: dict[str, dict] = {}  # job id -> body, for jobs submitted here
        self.followed: FollowedJob | None = None
        # The events view's lines, newest last. RichLog defers every write until it has been
        # laid out, without bound, and a tab never shown is never laid out: so the history is
        # kept here, bounded, and written to the log only while the events tab is showing.
        self.event_lines: deque[str] = deque(maxlen=MAX_EVENT_LINES)
        self._client: AsyncControlClient | None = None
        self._identity = None
        self._wake = asyncio.Event()
        self._shown_rows: dict[str, list] = {}
        self._shown_text: dict[str, str] = {}

    # --- layout -------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # The views are kept as attributes, not queried: the connection loop updates them
        # while a dialog is on top and during shutdown, when queries would find nothing.
        self.connection_bar = Static("connecting to %s" % self.socket_path, id="connection", classes="down")
        self.mesh_table = DataTable(id="mesh-table", cursor_type="row", zebra_stripes=True)
        self.jobs_table = DataTable(id="jobs-table", cursor_type="row", zebra_stripes=True)
        self.jobs_note = Static("", id="jobs-note", classes="note")
        self.consensus_note = Static("", id="consensus-note", classes="note")
        self.consensus_table = DataTable(id="consensus-table", cursor_type="row")
        self.evidence_table = DataTable(id="evidence-table", cursor_type="row")
        self.events_log = RichLog(id="events-log", max_lines=MAX_EVENT_LINES, wrap=False)
        self.tabs = TabbedContent(initial="mesh")
        yield self.connection_bar
        with self.tabs:
            with TabPane("1 mesh", id="mesh"):
                yield self.mesh_table
            with TabPane("2 jobs", id="jobs"):
                yield self.jobs_table
                yield self.jobs_note
            with TabPane("3 consensus", id="consensus"):
                yield self.consensus_note
                yield self.consensus_table
                yield self.evidence_table
            with TabPane("4 events", id="events"):
                yield self.events_log
        yield Footer()

    def on_mount(self) -> None:
        for table, columns in ((self.mesh_table, MESH_COLUMNS), (self.jobs_table, JOB_COLUMNS),
                               (self.consensus_table, CONSENSUS_COLUMNS), (self.evidence_table, EVIDENCE_COLUMNS)):
            table.add_columns(*columns)
        self.mesh_table.focus()  # the arrow keys move the selection at once, not after a Tab
        self.run_worker(self._connection_loop(), name="connection", exclusive=True)

    # --- the connection loop ------------------------------------------------------------------

    async def _connection_loop(self) -> None:
        retry_s, attempt = self.retry_min_s, 0
        while True:
            client = AsyncControlClient(self.socket_path, timeout_s=REQUEST_TIMEOUT_S)
            events_task = None
            try:
                await client.connect()
                self._client = client
                events_task = asyncio.create_task(self._follow_events(client))
                while True:
                    await self._poll_once(client)
                    if not self.connected:
                        self._set_connected(True, "")
                    retry_s, attempt = self.retry_min_s, 0
                    try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel
                        async with asyncio.timeout(self.poll_s):
                            await self._wake.wait()
                    except TimeoutError:
                        pass
                    self._wake.clear()
            except (ControlUnavailable, RemoteProtocolError) as exc:
                attempt += 1
                self._set_connected(False, "%s; retry %d in %.1f s" % (exc, attempt, retry_s))
            finally:
                self._client = None
                if events_task is not None:
                    events_task.cancel()
                await client.aclose()
            await asyncio.sleep(retry_s)
            retry_s = min(retry_s * 2, self.retry_max_s)

    async def _poll_once(self, client: AsyncControlClient) -> None:
        results = {}
        for op in POLLED_OPS:
            try:
                results[op] = await client.call(op)
            except ControlError as exc:  # the node is up but cannot answer this one
                results[op] = None
                self.log.warning("control op %s: %s" % (op, exc))
        try:
            self._apply_results(results)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            # A result of the wrong shape is bad remote input: drop the connection and
            # retry like any other fault, never let it take the TUI down.
            raise RemoteProtocolError("malformed control result: %s: %s" % (type(exc).__name__, exc)) from None

    def _apply_results(self, results: dict) -> None:
        if results["status"] is not None:
            self.status = dict(results["status"])
        if results["nodes"] is not None:
            self.nodes = list(results["nodes"]["nodes"])
        if results["jobs"] is not None:
            self.jobs = {j["job_id"]: j for j in results["jobs"]["jobs"]}
        if results["consensus"] is not None:
            self.consensus = dict(results["consensus"])
        self._render_views()

    async def _follow_events(self, client: AsyncControlClient) -> None:
        try:
            async with client.subscribe() as events:
                async for event in events:
                    self.log_event(event_line(event, self.clock_ms()))
                    self._wake.set()  # something changed: refresh the tables now, not at the next tick
            self.log_event("event stream ended: the node closed it")  # the poll loop notices and reconnects
        except ControlError as exc:
            self.log_event("event stream refused: %s" % exc)
        except (ControlUnavailable, RemoteProtocolError) as exc:
            self.log_event("event stream ended: %s" % exc)  # the poll loop notices and reconnects

    def log_event(self, text: str) -> None:
        self.event_lines.append(text)
        if self.tabs.active == "events":
            self.events_log.write(text)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        # The shown view's table takes the keys (or the log, to scroll it): switching
        # views with 1-4 must not leave the focus on a table that is now hidden.
        focusable = {"mesh": self.mesh_table, "jobs": self.jobs_table, "consensus": self.consensus_table,
                     "events": self.events_log}.get(event.pane.id)
        if focusable is not None:
            focusable.focus()
        if event.pane.id == "events":
            self.events_log.clear()
            for text in self.event_lines:
                self.events_log.write(text)

    def _set_connected(self, connected: bool, reason: str) -> None:
        self.connected = connected
        bar = self.connection_bar
        bar.set_class(not connected, "down")
        if connected:
            self._show(bar, "connected  " + status_line(self.status))
            self.log_event("connected to %s" % self.socket_path)
        else:
            self._show(bar, "disconnected: %s" % reason)

    # --- views --------------------------------------------------------------------------------

    def _render_views(self) -> None:
        if self.connected:
            self._show(self.connection_bar, "connected  " + status_line(self.status))
        self._fill(self.mesh_table, [(n.get("key") or n.get("short"), mesh_row(n)) for n in self.nodes])
        self._fill(self.jobs_table, [(jid, job_row(j)) for jid, j in self.jobs.items()])
        self._fill(self.consensus_table, [(i.get("instance"), consensus_row(i))
                                       for i in self.consensus.get("instances", ())])
        self._fill(self.evidence_table, [(None, evidence_row(e)) for e in self.consensus.get("evidence", ())])
        self._show(self.consensus_note,
                   "certificates: %d   evidence: %d" % (self.consensus.get("certificates", 0),
                                                 len(self.consensus.get("evidence", ()))))
        self._render_jobs_note()

    def _show(self, widget: Static, text: str) -> None:
        if self._shown_text.get(widget.id) != text:
            self._shown_text[widget.id] = text
            widget.update(text)

    def _fill(self, table: DataTable, keyed_rows: list[tuple[str | None, tuple]]) -> None:
        # Rebuild a table only when its rows changed: a redraw every poll would flicker,
        # move the cursor and keep the app from ever being idle.
        if self._shown_rows.get(table.id) == keyed_rows:
            return
        self._shown_rows[table.id] = keyed_rows
        selected = self._selected_key(table)
        table.clear()
        for key, row in keyed_rows:
            table.add_row(*row, key=key)
        if selected is not None and selected in {k for k, _ in keyed_rows}:
            table.move_cursor(row=table.get_row_index(selected))

    @staticmethod
    def _selected_key(table: DataTable) -> str | None:
        if table.row_count == 0:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def _render_jobs_note(self) -> None:
        lines = []
        if self.followed is not None:
            row = self.jobs.get(self.followed.job_id)
            if row is not None and self.followed.see(row) and row.get("state") in ("placed", "running"):
                self.notify("job %s is %s" % (self.followed.name, row["state"]))
            lines.append(self.followed.text())
        selected = self.selected_job()
        if selected is not None and selected.get("state") == "pending":
            lines.append("%s pending: %s (w: why)"
                         % (short_job_id(selected["job_id"]), format_declines(selected.get("declines", {}))))
        if selected is not None and selected.get("gang"):   # the `meshnode jobs` caption's line (GA4)
            lines.append("gang %s: %s; ranks %s (w: groups, recovery history)" % (
                short_job_id(selected["job_id"]), gang_summary(selected["gang"]), gang_workers_text(selected["gang"])))
        self._show(self.jobs_note, "\n".join(lines))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table is self.jobs_table:
            self._render_jobs_note()

    def selected_job(self) -> dict | None:
        key = self._selected_key(self.jobs_table)
        return self.jobs.get(key) if key is not None else None

    def screen_text(self) -> str:
        """The screen as it is drawn, as plain text: for docs (``meshnode demo --capture``).

        The same rendering as Textual's own ``export_screenshot`` (which only writes SVG),
        printed to a colourless console.
        """
        width, height = self.size
        console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None,
                          legacy_windows=False, safe_box=False)
        console.print(self.screen._compositor.render_update(full=True, screen_stack=self._background_screens))
        return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"

    # --- actions ------------------------------------------------------------------------------

    def action_show(self, tab: str) -> None:
        self.tabs.active = tab

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_refresh(self) -> None:
        self._wake.set()

    async def request(self, op: str, args: dict | None = None):
        """A control request from an action; raises ControlUnavailable while disconnected."""
        if self._client is None:
            raise ControlUnavailable("not connected to %s" % self.socket_path)
        return await self._client.call(op, **(args or {}))

    def action_compose(self) -> None:
        if self.key_path is None:
            self.notify("start the TUI with --key OWNER_KEY to sign jobs", severity="error")
            return
        try:
            owner = read_public_key(self.key_path)
        except KeystoreError as exc:
            self.notify(str(exc), severity="error")
            return
        def parse_for_current_epoch(text, owner_pubkey, now_ms):
            return parse_manifest(text, owner_pubkey, now_ms, epoch=self._epoch())
        self.push_screen(ComposeScreen(parse_for_current_epoch, owner, self.clock_ms), self._on_job_composed)

    def _on_job_composed(self, manifest) -> None:
        if manifest is not None:
            self.submit_job(manifest)

    async def owner_identity(self):
        """The owner's signing identity, prompting for the passphrase in a modal if needed."""
        if self._identity is not None:
            return self._identity
        try:
            if not is_encrypted(self.key_path):
                self._identity = load_identity(self.key_path, None)
                self.notify("signing with an unencrypted testnet key", severity="warning")
                return self._identity
        except KeystoreError as exc:
            self.notify(str(exc), severity="error")
            return None
        problem = ""
        for _ in range(MAX_PASSPHRASE_TRIES):
            passphrase = await self.push_screen_wait(PassphraseScreen(self.key_path, problem))
            if passphrase is None:
                return None
            try:  # argon2id takes about a second at "moderate": keep the screen live meanwhile
                self._identity = await asyncio.to_thread(load_identity, self.key_path,
                                                         PassphraseSource.literal(passphrase))
                return self._identity
            except KeystoreError as exc:
                problem = str(exc)
        self.notify("not signed: %s" % problem, severity="error")
        return None

    def _mesh_id(self) -> bytes:
        # A job signed before the TUI has seen the node's status is valid in any mesh (SPEC.md 4.2).
        return bytes.fromhex(self.status["mesh_id"]) if self.status else ANY_MESH

    def _epoch(self) -> int:
        """The node's epoch, whose members place a job signed now (SPEC.md P2)."""
        epoch = self.status.get("epoch") if self.status else 0
        return epoch if isinstance(epoch, int) and epoch >= 0 else 0

    @work(group="actions")
    async def submit_job(self, manifest) -> None:
        identity = await self.owner_identity()
        if identity is None:
            return
        if manifest.epoch != self._epoch():  # the mesh moved on while the form was open
            manifest = replace(manifest, epoch=self._epoch())
        envelope = encode_message(identity, self._mesh_id(), manifest)
        try:
            result = await self.request("submit", {"job": envelope})
        except (ControlError, ControlUnavailable) as exc:
            self.notify("job not submitted: %s" % exc, severity="error")
            return
        if not isinstance(result, dict) or not isinstance(result.get("job_id"), str):
            self.notify("job submitted, but the node's reply is malformed: %r" % (result,), severity="error")
            return
        job_id = result["job_id"]
        self.manifest_bodies[job_id] = manifest.to_body()
        self.followed = FollowedJob(job_id, manifest.name)
        self.notify("submitted job %s (%s)" % (manifest.name, short_job_id(job_id)))
        self.action_show("jobs")
        self._render_jobs_note()
        self._wake.set()

    def action_why(self) -> None:
        job = self.selected_job()
        if job is None:
            self.notify("select a job on the jobs view first (2)", severity="warning")
            return
        self.show_why(job)

    @work(group="actions")
    async def show_why(self, job: dict) -> None:
        why, error = None, ""
        try:
            why = await self.request("why", {"job_id": job["job_id"]})
        except (ControlError, ControlUnavailable) as exc:
            error = str(exc)
        if why is not None and not (isinstance(why, dict) and isinstance(why.get("declines", {}), dict)):
            why, error = None, "malformed reply from the node"
        await self.push_screen_wait(WhyScreen(job, why, error, self.manifest_bodies.get(job["job_id"], {}),
                                              self.nodes))

    def action_cancel_job(self) -> None:
        job = self.selected_job()
        if job is None:
            self.notify("select a job on the jobs view first (2)", severity="warning")
            return
        self.cancel_job(job)

    @work(group="actions")
    async def cancel_job(self, job: dict) -> None:
        identity = await self.owner_identity()
        if identity is None:
            return
        request = encode_message(identity, self._mesh_id(),
                                 Cancel(job_id=bytes.fromhex(job["job_id"]), requested_ms=self.clock_ms()))
        try:
            await self.request("cancel", {"request": request})
        except (ControlError, ControlUnavailable) as exc:
            self.notify("cancel refused: %s" % exc, severity="error")
            return
        self.notify("cancel sent for %s" % short_job_id(job["job_id"]))
        self._wake.set()
