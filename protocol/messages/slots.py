"""Checks of a placement slot's value (SPEC.md P7): its jobs, decoded and owner-signed,
and whether an instance may decide it."""

from __future__ import annotations

from protocol.caches import CoreCaches
from protocol.errors import RemoteProtocolError
from protocol.messages.jobs import JobManifest, PlacementSlot, job_id, placement_slot, placement_slot_id
from protocol.messages.wire import decode_message


def slot_placements(value: PlacementSlot, mesh_id: bytes, *, caches: CoreCaches | None = None) -> list[tuple]:
    """(placement, job, job id) of every placement a slot value lists; raises
    RemoteProtocolError unless every job is a valid job signed by its owner. Remembered in
    ``caches.slot_items`` by value object (decode_value remembers the object): validating,
    binding and applying a slot all ask. An entry holds its value, so no id is reused while
    the entry exists, and a hit checks identity."""
    table = caches.slot_items if caches is not None else None
    if table is not None:
        key = (id(value), mesh_id)
        hit = table.lookup(key)
        if hit is not None and hit[0] is value:
            return hit[1]
    items = []
    for placement in value.placements:
        envelope, job = decode_message(placement.job, mesh_id, expect=JobManifest, allow_any_mesh=True,
                                       caches=caches)
        if envelope.signer != job.owner:
            raise RemoteProtocolError("a slot places a job not signed by its owner")
        items.append((placement, job, job_id(job)))
    if table is not None:
        table.remember(key, (value, items))
    return items


def slot_binding_error(iid: bytes, value: PlacementSlot, items: list, epoch: int, slot_ms: int) -> str | None:
    """SPEC.md P7: why ``value`` may not be decided by instance ``iid`` in ``epoch``, or None."""
    if slot_ms <= 0:
        return "this mesh does not place jobs in slots"
    if value.epoch != epoch or placement_slot_id(value.epoch, value.slot) != iid:
        return "instance is not the slot of epoch %d the value names" % epoch
    seen = set()
    for _placement, job, jid in items:
        if job.epoch != epoch or placement_slot(job, slot_ms) != value.slot:
            return "job %s is not one of this slot's" % jid.hex()[:12]
        if jid in seen:
            return "job %s is placed twice" % jid.hex()[:12]
        seen.add(jid)
    return None
