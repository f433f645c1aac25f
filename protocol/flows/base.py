"""The interface of a value flow, and the registry that maps value kinds to flows.

The instance table (protocol/instances.py) calls the hooks below while it drives an
instance of the flow; the core (protocol/mesh.py) calls ``instance_from_proposal``,
``binding_error`` and ``apply``. Every hook gets ``out`` (the Ready batch being built)
and appends to it in order; none raises on bad remote input except where it says so.
"""

from __future__ import annotations

from protocol.messages import MAX_BIDS_PER_PROPOSAL
from protocol.ready import Ready


class ValueFlow:
    value_kind: str = ""                 # the kind an instance of this flow starts with
    value_kinds: tuple[str, ...] = ()    # every kind its instances may decide
    max_rounds: int | None = None        # None: the genesis' max_rounds
    places_jobs: bool = False            # whether its values place jobs (job_ids says which)
    # SPEC.md 6.12: its round timeout follows the node's measured decision time, up to this
    # many genesis round timeouts.
    adapts_round_timeout: bool = False
    adapted_timeout_max_factor: int = 2
    # Proposal justifications beyond this are refused before any decoding (None: no limit).
    max_justification: int | None = MAX_BIDS_PER_PROPOSAL + 1

    @property
    def round_timeout_extra_ms(self) -> int:
        return 0

    def max_rounds_for(self, iid: bytes) -> int | None:
        """Rounds before this node gives up instance ``iid`` (None: the genesis' max_rounds)."""
        return self.max_rounds

    def timed_as(self, subject) -> "ValueFlow":
        """The flow whose decision times (6.12) set the round timeout of this flow's instance
        deciding ``subject``, and take its samples: itself, but for 6.12b."""
        return self

    def validators(self, iid: bytes) -> tuple:
        """(validate, {other kind: validate} or None) for a new instance ``iid``."""
        raise NotImplementedError

    def instance_from_proposal(self, proposal, value, view, now_ms: int, out: Ready):
        """A proposal for an instance not running here: start it if the value allows (or None)."""
        raise NotImplementedError

    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        """This node leads the instance's round and may propose."""

    def on_round_changed(self, inst, now_ms: int, out: Ready) -> None:
        """The instance entered a new round (new leader)."""

    def round_on_hold(self, inst, now_ms: int) -> bool:
        """True while the instance has nothing to decide here: when its round times out it
        stays in that round (no round change is sent) and is asked again a little later."""
        return False

    def on_bid_window_closed(self, inst, now_ms: int, out: Ready) -> None:
        """A timer the flow scheduled with ``what="bid_window"`` is due."""

    def on_gave_up(self, iid: bytes, subject, now_ms: int, out: Ready) -> None:
        """The instance gave up undecided after its last round."""

    def on_dropped(self, iid: bytes) -> None:
        """An evicted node dropped the instance (F7): forget what was held for it."""

    def binding_error(self, iid: bytes, value_kind: str, value, epoch: int) -> str | None:
        """Why a certified value must not be applied (only a Byzantine quorum certifies one)."""
        return None

    def apply(self, iid: bytes, value_kind: str, value, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        raise NotImplementedError

    def job_ids(self, iid: bytes, subject) -> tuple:
        """The jobs an instance of this flow may place (for tools that show it)."""
        return ()


class SharedStateFlow(ValueFlow):
    """A flow that reads the core's shared state: the node's context, the epochs, the job
    table, the ledger, the instance table and the capability book (its subclasses add their
    own collaborators after calling this)."""

    def __init__(self, ctx, epochs, jobs, ledger, instances, capability) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.jobs = jobs
        self.ledger = ledger
        self.instances = instances
        self.capability = capability


class FlowRegistry:
    """Value kind -> flow. The only place a kind string selects behaviour."""

    def __init__(self, flows) -> None:
        self._by_kind: dict[str, ValueFlow] = {}
        for flow in flows:
            for kind in flow.value_kinds:
                self._by_kind[kind] = flow

    def __getitem__(self, kind: str) -> ValueFlow:
        return self._by_kind[kind]

    def get(self, kind: str) -> ValueFlow | None:
        return self._by_kind.get(kind)

    def kinds(self) -> tuple[str, ...]:
        return tuple(self._by_kind)
