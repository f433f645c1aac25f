"""What binds a commit certificate's stated value kind to what it decided.

Votes sign only the value's hash (SPEC.md 6.4), so a certificate's ``value_kind`` is not
signed by its voters: anyone can relabel a real placement certificate as an eviction.
A certificate counts only if its value decodes as the stated kind AND its instance id is
the one that kind's flow decides that value in (a job's attempt, a slot, an epoch's
change, a job's move from a fence, a job's replica action). The node checks this before applying a decision (protocol/mesh.py), and the
offline verifier (``meshnode cert verify``) runs the same function.
"""

from __future__ import annotations

from protocol.errors import RemoteProtocolError
from protocol.flows.epoch_change import EpochChangeFlow
from protocol.flows.move import MoveFlow
from protocol.flows.gang import GangFlow
from protocol.flows.gang_replace import GangReplaceFlow
from protocol.flows.gang_resize import GangResizeFlow
from protocol.flows.placement import PlacementFlow
from protocol.flows.preemption import PreemptionFlow
from protocol.flows.replica import ReplicaFlow
from protocol.flows.slot import SlotFlow
from protocol.messages import decode_value

BINDINGS = {kind: flow.value_binding_error for flow in (PlacementFlow, SlotFlow, EpochChangeFlow, MoveFlow,
                                                        PreemptionFlow, GangFlow, ReplicaFlow, GangReplaceFlow,
                                                        GangResizeFlow)
            for kind in flow.value_kinds}


def certificate_binding_error(value_kind: str, instance: bytes, value_bytes: bytes, epoch: int, mesh_id: bytes,
                              slot_ms: int) -> str | None:
    """Why a certificate of ``value_kind`` for ``instance`` in ``epoch`` decides nothing, or None."""
    check = BINDINGS.get(value_kind)
    if check is None:
        return "unknown value kind %r" % value_kind
    try:
        value = decode_value(value_kind, value_bytes)
        return check(instance, value_kind, value, epoch, mesh_id, slot_ms)
    except RemoteProtocolError as exc:
        return "the value is not a %s: %s" % (value_kind, exc)
