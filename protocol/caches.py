"""Memo tables of one protocol core: bounded, least recently used, never shared by accident.

Every table here remembers the result of a pure function of signed bytes (is this
signature valid, what do these envelope bytes decode to, does this certificate hold a
quorum), so a table changes how much work a core does, never what it decides: a function
given ``caches=None`` recomputes and returns the same answer. The functions that use them
(``decode_message``, ``sign_message``, ``open_envelope``, ``seal``, ``decode_value``,
``value_hash``, ``slot_placements``, the certificate checks, ``parse_bid``,
``choose_placement``) take a ``caches=`` keyword argument.

Why per core: these tables used to be module globals, so every core of a simulator
process (and every test in one pytest process) read the others' entries: a core skipped
work it never did, and an entry keyed by ``id()`` could outlive the object. A core owns
one ``CoreCaches`` and passes it along; two cores share a table only if their driver
deliberately hands both the same object.

Sizes are for one node (a real node runs one core per process), and every table is
bounded by entries; the decoded-message table also by the wire bytes it holds. The
defaults are the sizes the process-wide tables had, measured by the simulator
(BENCHMARKS.md, "Simulator scale"). A driver running many cores in one process can pass
smaller sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

# (signer, SHA-256 of the signed bytes, signature) -> None. Certificates re-carry votes a
# node has already checked (SPEC.md 2.4); an entry is ~300 bytes.
SIGNATURES_KEPT = 1 << 18
# (envelope wire bytes, mesh id) -> (Envelope, record). ~1 KiB each decoded: a 1000-node
# decision has 2000 votes. Also bounded by the wire bytes held.
DECODED_KEPT = 1 << 16
DECODED_BYTES = 64 << 20
# (value kind, value bytes) -> the decoded value: every validator of a proposal, and
# every certificate of it, carries the same value bytes.
VALUES_KEPT = 4096
# value bytes -> value_hash: a slot's value (SPEC.md P7) is up to hundreds of KiB, and
# every vote, certificate and late job's proof asks for its hash.
VALUE_HASHES_KEPT = 1024
# (id(value), mesh id) -> (value, its (placement, job, job id) items): validating,
# binding and applying a slot all ask. An entry holds its value, so no id is reused
# while the entry exists; a hit also checks identity.
SLOT_ITEMS_KEPT = 256
# (view digest, mesh id, certificate signer, certificate signature) -> None: a
# certificate is re-broadcast to everyone, and its quorum check is the costly part.
CERTIFICATE_VERDICTS_KEPT = 4096
# (bid bytes, mesh id, instance, epoch, authorities) -> BidFacts: the leader and every
# validator of every proposal that carries a bid check it (failures are not kept).
BIDS_KEPT = 8192
# (job envelope, instance, ids of the BidFacts) -> (job, facts, placement): every
# validator recomputes the leader's placement from the same verified bids. An entry
# holds its facts, so their ids are not reused while it exists; a hit checks identity.
PLACEMENTS_KEPT = 4096


class LRU(OrderedDict):
    """A bounded map, least recently used first out. Read with ``lookup`` (moves a hit to
    the back), write with ``remember`` (drops the oldest entries to stay within
    ``max_entries`` and, when ``size_of`` is given, ``max_bytes``)."""

    def __init__(self, max_entries: int, max_bytes: int | None = None,
                 size_of: Callable[[Hashable], int] | None = None):
        super().__init__()
        if max_entries < 1 or (max_bytes is not None and (max_bytes < 1 or size_of is None)):
            raise ValueError("an LRU holds at least one entry; a byte bound needs size_of")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.size_of = size_of
        self.bytes_held = 0

    def lookup(self, key: Hashable) -> Any:
        """The value remembered for ``key``, or None."""
        hit = self.get(key)
        if hit is not None:
            self.move_to_end(key)
        return hit

    def remember(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` for ``key`` (not None: None reads as a miss)."""
        if key in self:
            self.forget(key)
        size = self.size_of(key) if self.max_bytes is not None else 0
        while self and (len(self) >= self.max_entries
                        or (self.max_bytes is not None and self.bytes_held + size > self.max_bytes)):
            oldest, _ = self.popitem(last=False)
            if self.max_bytes is not None:
                self.bytes_held -= self.size_of(oldest)
        self[key] = value
        self.bytes_held += size

    def forget(self, key: Hashable) -> None:
        if key in self:
            del self[key]
            if self.max_bytes is not None:
                self.bytes_held -= self.size_of(key)

    def clear(self) -> None:
        super().clear()
        self.bytes_held = 0


def _wire_size(key: tuple) -> int:
    return len(key[0])


class CoreCaches:
    """The memo tables of one core (see the module docstring). Each keyword is a table's
    size in entries (``decoded_bytes``: the wire bytes the decoded table may hold)."""

    def __init__(self, *, signatures: int = SIGNATURES_KEPT, decoded: int = DECODED_KEPT,
                 decoded_bytes: int = DECODED_BYTES, values: int = VALUES_KEPT,
                 value_hashes: int = VALUE_HASHES_KEPT, slot_items: int = SLOT_ITEMS_KEPT,
                 certificate_verdicts: int = CERTIFICATE_VERDICTS_KEPT, bids: int = BIDS_KEPT,
                 placements: int = PLACEMENTS_KEPT):
        self.signatures = LRU(signatures)
        self.decoded = LRU(decoded, max_bytes=decoded_bytes, size_of=_wire_size)
        self.values = LRU(values)
        self.value_hashes = LRU(value_hashes)
        self.slot_items = LRU(slot_items)
        self.certificate_verdicts = LRU(certificate_verdicts)
        self.bids = LRU(bids)
        self.placements = LRU(placements)

    def tables(self) -> dict[str, LRU]:
        """Every table by name (for tests, stats and ``clear``)."""
        return {name: table for name, table in vars(self).items() if isinstance(table, LRU)}

    def clear(self) -> None:
        for table in self.tables().values():
            table.clear()

    def sizes(self) -> dict[str, int]:
        """Entries held per table."""
        return {name: len(table) for name, table in self.tables().items()}
