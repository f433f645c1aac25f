"""Modal screens of the owner's TUI: help, passphrase, why-pending, compose-a-job.

Each screen is keyboard driven and fits 80x24 (the compose form scrolls). Screens hold
no connection of their own: they ask the app (``self.app``) for the data and actions,
so a node that goes away never reaches a screen as an exception.
"""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from meshnode.tui.form import DEFAULT_VALUES, FORM_FIELDS, check_form
from meshnode.tui.tables import gang_lines, short_job_id
from meshnode.tui.why import format_declines, group_declines, placeable_hint, queue_rows
from protocol.messages import STRATEGIES

HELP_TEXT = """\
[b]meshnode tui[/b]: watch the mesh, compose and follow jobs

  [b]1[/b]  mesh: stake, zone, health, GPUs, utilisation, temperature, throttle
  [b]2[/b]  jobs: state, primary, backups, checkpoint age, migrations, lost work
  [b]3[/b]  consensus: rounds, leaders, certificates, equivocation evidence
  [b]4[/b]  events: the node's event stream
  [b]n[/b]  compose a job (checked as you type; ctrl+s signs and submits)
  [b]w[/b]  why is the selected job pending, and what would place it
  [b]x[/b]  cancel the selected job (owner-signed)
  [b]r[/b]  refresh now      [b]?[/b]  this help      [b]q[/b]  quit
  [b]esc[/b] closes a dialog; arrows move, tab changes field

When the node goes away the top line says "disconnected" and the TUI
retries with exponential backoff until it is back.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog"):
            yield Static(HELP_TEXT)


class PassphraseScreen(ModalScreen):
    """Asks for a keystore passphrase; dismisses with the text, or None when cancelled."""
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, keystore_path: str, problem: str = ""):
        super().__init__()
        self.keystore_path = keystore_path
        self.problem = problem

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Passphrase for %s" % self.keystore_path)
            yield Input(password=True, id="passphrase")
            yield Static(self.problem, id="passphrase-problem", classes="error")
            yield Label("enter: sign   esc: cancel")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class WhyScreen(ModalScreen):
    """Why a job is pending: declines grouped by reason, the node's hint and ours; for a gang
    also its ranks, topology groups and recovery history."""
    BINDINGS = [Binding("escape,w,q", "dismiss", "close")]

    def __init__(self, job: dict, why: dict | None, error: str, manifest_body: dict, nodes: list[dict]):
        super().__init__()
        self.job, self.why, self.error = job, why, error
        self.manifest_body, self.nodes = manifest_body, nodes

    def compose(self) -> ComposeResult:
        declines = (self.why or {}).get("declines") or self.job.get("declines") or {}
        lines = ["[b]job %s[/b] %s: %s" % (short_job_id(self.job.get("job_id")), self.job.get("name", "?"),
                                            self.job.get("state", "?"))]
        if self.error:
            lines.append("[red]why: %s[/red]" % self.error)
        preempted_by = (self.why or {}).get("preempted_by")
        if preempted_by:   # SPEC P8: stopped to place a higher-priority job; resumes from its checkpoint
            lines.append("preempted by job %s: resumes from its checkpoint when capacity returns"
                         % short_job_id(preempted_by))
        borrowing = (self.why or {}).get("borrowing")
        if borrowing:   # SPEC Q6: over its owner's quota, preemptible: in-quota work may reclaim it
            lines.append(escape(borrowing))
        lines.append(format_declines(declines))
        for group in group_declines(declines):
            if group.nodes:
                lines.append("  %s (%s)" % (group.text, " ".join(group.nodes)))
        node_hint = (self.why or {}).get("hint") or self.job.get("hint")
        if node_hint:
            lines.append("node says: %s" % node_hint)
        lines.extend("%s: %s" % row for row in queue_rows((self.why or {}).get("queue")))
        lines.append("to place it: %s" % placeable_hint(declines, self.manifest_body, self.nodes))
        gang = (self.why or {}).get("gang")
        if gang:   # a gang: its rule, ranks, the groups its rule allows, its recovery history
            lines.extend(escape(line) for line in gang_lines(gang))
        with VerticalScroll(classes="dialog"):
            yield Static("\n".join(lines), id="why-text", markup=True)


class ComposeScreen(ModalScreen):
    """The compose-a-job form. Every keystroke re-runs parse_manifest on the whole form."""
    BINDINGS = [Binding("escape", "cancel", "cancel"), Binding("ctrl+s", "submit", "sign & submit")]

    def __init__(self, parse_manifest, owner_pubkey: bytes, now_ms, values: dict | None = None):
        super().__init__()
        self.parse_manifest = parse_manifest
        self.owner_pubkey = owner_pubkey
        self.now_ms = now_ms  # a callable: the app owns the clock
        self.initial = dict(DEFAULT_VALUES, **(values or {}))
        self.check = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog", id="compose"):
            yield Label("[b]compose a job[/b]  ctrl+s: sign & submit   esc: cancel")
            for field_id, path in FORM_FIELDS.items():
                with Horizontal(classes="form-row"):
                    yield Label(path, classes="form-label")
                    if field_id == "strategy":
                        yield Select([(s, s) for s in STRATEGIES], value=self.initial[field_id],
                                     allow_blank=False, id="field-strategy", compact=True)
                    else:  # compact: one line per field, so the whole form fits 80x24
                        yield Input(self.initial[field_id], id="field-" + field_id, compact=True,
                                    placeholder=_PLACEHOLDERS.get(field_id, ""))
            yield Static("", id="form-error", classes="error")
            with Horizontal(classes="form-row"):
                yield Button("Sign & submit", id="submit", variant="primary", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one("#field-name", Input).focus()
        self.validate_form()

    def values(self) -> dict:
        values = {}
        for field_id in FORM_FIELDS:
            if field_id == "strategy":
                values[field_id] = str(self.query_one("#field-strategy", Select).value)
            else:
                values[field_id] = self.query_one("#field-" + field_id, Input).value
        return values

    def validate_form(self) -> None:
        self.check = check_form(self.values(), self.parse_manifest, self.owner_pubkey, self.now_ms())
        for field_id in FORM_FIELDS:
            self.query_one("#field-" + field_id).set_class(field_id == self.check.field, "invalid")
        error = self.query_one("#form-error", Static)
        if self.check.manifest is None:
            error.update("invalid: " + self.check.error)
        else:
            error.update("ok: ready to sign")
        error.set_class(self.check.manifest is None, "error")
        self.query_one("#submit", Button).disabled = self.check.manifest is None

    def on_input_changed(self, event: Input.Changed) -> None:
        self.validate_form()

    def on_select_changed(self, event: Select.Changed) -> None:
        self.validate_form()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "submit":
            self.action_submit()
        else:
            self.action_cancel()

    def action_submit(self) -> None:
        self.validate_form()
        if self.check.manifest is not None:
            self.dismiss(self.check.manifest)

    def action_cancel(self) -> None:
        self.dismiss(None)


# Shown in empty fields; "e.g." so that a screen capture without colour cannot pass them for values.
_PLACEHOLDERS = {"args": "e.g. --steps 100 (shell quoting)", "zones": "e.g. zone-a, zone-b (empty: any)",
                 "labels": "e.g. rack=r1, tier=gold", "attested": "e.g. jurisdiction=eu"}
