"""The node's durable state, ``DIR/node.sqlite`` (sqlite-utils, WAL, synchronous=NORMAL).

It holds what the protocol core asks the driver to persist (``Ready.persist``: votes,
locks, jobs, membership, evidence ...), every commit certificate the node has applied
(``Ready.decisions``), in decision order, and a bounded tail of events. On restart the
driver replays ``certificates_in_order()`` into ``MeshCore(history=...)`` and reads
its safety records back with ``load(table)``.

One ``Ready`` batch is one transaction (``record_ready``), written before any message
of the batch is sent (protocol/ready.py step 1). synchronous=NORMAL in WAL mode keeps
every committed transaction across a process crash (kill -9); a power loss may drop
the last few, which the BFT quorum tolerates like any other crashed node's lag.

Columns: a PersistRecord's value maps column name -> int | str | bytes | None, stored
as SQLite values; a bool, list or map value is stored as canonical msgpack and decoded
on read. Which columns are encoded is recorded per table in ``_packed_columns``, and a
column keeps the kind it was created with, so reading back is lossless.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3

import msgpack
import sqlite_utils

from keys.errors import ConfigError
from protocol import codec
from protocol.epochs import VIEWS_KEPT
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.ready import Event, PersistRecord, Ready

# Tables the core may write through PersistRecord. A name outside this list is a driver/core
# contract violation (LocalProtocolError), never a new table made from arbitrary input.
PERSIST_TABLES = frozenset({"votes", "locks", "instances", "jobs", "membership", "epochs", "evidence",
                            "reservations", "suspicions", "checkpoints", "fences", "capability"})
MAX_EVENTS = 10_000      # the events table keeps only the newest this many rows
MAX_COLUMNS = 64
_COLUMN = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_RESERVED_COLUMNS = frozenset({"key", "rowid", "oid", "_rowid_"})
_INT64 = (-(1 << 63), (1 << 63) - 1)


class NodeStore:
    def __init__(self, path, max_events: int = MAX_EVENTS):
        try:
            self._conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.Error as exc:
            raise ConfigError("cannot open node database %s: %s" % (path, exc)) from None
        self.db = sqlite_utils.Database(self._conn)
        self.max_events = max_events
        self._packed: dict[str, set[str]] = {}
        self._plain: dict[str, set[str]] = {}
        self._columns: dict[str, set[str]] = {}          # table -> columns that exist (cache)
        self._upsert_sql: dict[tuple[str, tuple[str, ...]], str] = {}
        self._newest_event: int | None = None   # the events table's largest seq (None: not read yet)
        self._create_fixed_tables()
        self._load_column_kinds()

    def close(self) -> None:
        self._conn.close()

    def _create_fixed_tables(self) -> None:
        with self.db.atomic():
            self.db["certificates"].create(
                {"seq": int, "instance": str, "value_kind": str, "epoch": int, "certificate": bytes},
                pk="seq", if_not_exists=True)
            self.db["certificates"].create_index(["instance"], unique=True, if_not_exists=True)
            self.db["events"].create({"seq": int, "kind": str, "at_ms": int, "detail": bytes},
                                     pk="seq", if_not_exists=True)
            self.db["_packed_columns"].create({"tbl": str, "col": str, "packed": int},
                                              pk=("tbl", "col"), if_not_exists=True)

    def _load_column_kinds(self) -> None:
        for row in self.db["_packed_columns"].rows:
            kinds = self._packed if row["packed"] else self._plain
            kinds.setdefault(row["tbl"], set()).add(row["col"])

    # --- writing ------------------------------------------------------------------------------

    def record_ready(self, ready: Ready) -> None:
        """Persist one Ready batch (persist records, decisions, events) in one transaction."""
        if not (ready.persist or ready.decisions or ready.events):
            return  # a batch of messages only (heartbeats): no transaction to open
        with self._transaction():
            self._apply(ready.persist)
            for decision in ready.decisions:
                self._add_certificate(decision.instance, decision.value_kind, decision.certificate)
            self._append_events(ready.events)

    def apply(self, records: list[PersistRecord]) -> None:
        """Upsert each record into its table by key, all in one transaction."""
        with self._transaction():
            self._apply(records)

    @contextlib.contextmanager
    def _transaction(self):
        """BEGIN ... COMMIT, or ROLLBACK on any error (sqlite-utils' ``atomic`` without its
        savepoint branch: a batch is never written inside another transaction)."""
        conn = self._conn
        if conn.in_transaction:
            raise LocalProtocolError("node store: a batch written inside another transaction")
        conn.execute("BEGIN")
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            # The rollback also undid columns, column kinds and events this batch added: re-read them.
            self._packed.clear()
            self._plain.clear()
            self._columns.clear()
            self._load_column_kinds()
            self._newest_event = None
            raise

    def _apply(self, records: list[PersistRecord]) -> None:
        entered = [(r.value.get("epoch"), r.value.get("older_views") or []) for r in records
                   if r.table == "membership"]
        self._apply_records(records)
        epochs = [(e, kept) for e, kept in entered if isinstance(e, int) and not isinstance(e, bool)]
        if epochs:
            self._prune_safety_records(*max(epochs, key=lambda pair: pair[0]))

    def _prune_safety_records(self, epoch: int, older_views: list = ()) -> None:
        """SPEC.md 6.9: on entering ``epoch`` (the core persists a ``membership`` record), drop
        the votes and locks no restart can read again: those of instances decided (their
        certificate is stored: a replayed decision is never voted on) in an older epoch, and
        every one of an epoch older than the core's newest VIEWS_KEPT, whose view it no
        longer holds (``older_views``: the older ones it still holds, GA10). What stays: the
        current epoch's and the undecided ones of the epochs it holds views of."""
        oldest_view = epoch - VIEWS_KEPT + 1
        kept = [e for e in older_views if isinstance(e, int) and not isinstance(e, bool)][:64]
        spared = " AND epoch NOT IN (%s)" % ", ".join("?" * len(kept)) if kept else ""
        for table in ("votes", "locks"):
            if not {"epoch", "instance"} <= self._table_columns(table):
                continue
            self._conn.execute(
                "DELETE FROM [%s] WHERE epoch < ? AND ((epoch < ?%s) OR lower(hex(instance)) IN "
                "(SELECT instance FROM certificates))" % (table, spared), [epoch, oldest_view, *kept])

    def _table_columns(self, table: str) -> set[str]:
        known = self._columns.get(table)
        if known is None:
            known = set(self.db[table].columns_dict) if self.db[table].exists() else set()
            if known:
                self._columns[table] = known
        return known

    def _apply_records(self, records: list[PersistRecord]) -> None:
        for record in records:
            if record.table == "certificates":
                # The core persists a certificate before announcing it; it goes to the same
                # fixed table the decision path fills, once per instance.
                value = record.value
                self._add_certificate(value["instance"], value["value_kind"], value["certificate"])
                continue
            if record.table not in PERSIST_TABLES:
                raise LocalProtocolError("persist: table %r is not one of %s" % (record.table, sorted(PERSIST_TABLES)))
            if not isinstance(record.key, str) or not record.key:
                raise LocalProtocolError("persist %s: key must be non-empty text" % record.table)
            if len(record.value) > MAX_COLUMNS:
                raise LocalProtocolError("persist %s: %d columns, over %d" % (record.table, len(record.value), MAX_COLUMNS))
            if record.table == "reservations" and not record.value.get("held"):
                # Released or allocated: it holds nothing a restart could need (R1), so it goes.
                if self._table_columns("reservations"):
                    self._conn.execute("DELETE FROM [reservations] WHERE key = ?", [record.key])
                continue
            row = {"key": record.key}
            for column, value in record.value.items():
                row[column] = self._column_value(record.table, column, value)
            self._upsert(record.table, row)

    def _upsert(self, table: str, row: dict) -> None:
        known = self._columns.get(table)
        if known is None or not known.issuperset(row):
            # First sight of a table or column: let sqlite-utils create or alter it.
            self.db[table].upsert(row, pk="key", alter=True)
            self._columns[table] = set(self.db[table].columns_dict)
            return
        # Hot path: a prepared upsert, about 10x cheaper than sqlite-utils' introspecting one.
        columns = tuple(row)
        sql = self._upsert_sql.get((table, columns))
        if sql is None:
            updates = ", ".join("[%s] = excluded.[%s]" % (c, c) for c in columns if c != "key") or "key = key"
            sql = "INSERT INTO [%s] (%s) VALUES (%s) ON CONFLICT(key) DO UPDATE SET %s" % (
                table, ", ".join("[%s]" % c for c in columns), ", ".join("?" * len(columns)), updates)
            self._upsert_sql[(table, columns)] = sql
        self._conn.execute(sql, [row[c] for c in columns])

    def _column_value(self, table: str, column: str, value):
        # Fast path: a plain value for a column already known to hold plain values (its name
        # was checked when it was made). Most of a Ready's values; the checks below were a
        # fifth of record_ready's CPU (issue 18).
        kind = type(value)
        if (kind is str or kind is bytes or value is None
                or (kind is int and _INT64[0] <= value <= _INT64[1])) and column in self._plain.get(table, ()):
            return value
        if not isinstance(column, str) or not _COLUMN.match(column) or column in _RESERVED_COLUMNS:
            raise LocalProtocolError("persist %s: bad column name %r" % (table, column))
        packed = not (value is None or isinstance(value, (str, bytes))
                      or (isinstance(value, int) and not isinstance(value, bool)))
        if not packed and isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
            raise LocalProtocolError("persist %s.%s: integer outside SQLite's 64-bit range" % (table, column))
        if value is not None:  # None fits either kind of column
            self._fix_column_kind(table, column, packed)
        return codec.pack(value) if packed else value

    def _fix_column_kind(self, table: str, column: str, packed: bool) -> None:
        same, other = (self._packed, self._plain) if packed else (self._plain, self._packed)
        if column in other.get(table, ()):
            raise LocalProtocolError("persist %s.%s: column holds %s values, got a %s one" % (
                table, column, "plain" if packed else "encoded", "encoded" if packed else "plain"))
        if column not in same.setdefault(table, set()):
            same[table].add(column)
            self.db["_packed_columns"].insert({"tbl": table, "col": column, "packed": int(packed)})

    def _add_certificate(self, instance_id: bytes, value_kind: str, certificate: bytes) -> None:
        # A certificate is applied once; a duplicate decision is not a new one (the unique
        # index on instance ignores it). A prepared statement: sqlite-utils' insert
        # introspects the table on every call (0.35 -> 0.25 ms for a decision's Ready batch).
        self._conn.execute("INSERT OR IGNORE INTO certificates (instance, value_kind, epoch, certificate) "
                           "VALUES (?, ?, ?, ?)",
                           [instance_id.hex(), value_kind, certificate_epoch(certificate), certificate])

    def _append_events(self, events: list[Event]) -> None:
        if not events:
            return
        if self._newest_event is None:   # read once, not after every batch (issue 18)
            self._newest_event = self._conn.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
        self._conn.executemany("INSERT INTO events (kind, at_ms, detail) VALUES (?, ?, ?)",
                               [(e.kind, e.at_ms, codec.pack(e.detail)) for e in events])
        # seq is the rowid: each insert takes the largest one plus 1, and no insert gives it.
        self._newest_event += len(events)
        if self._newest_event > self.max_events:
            self._conn.execute("DELETE FROM events WHERE seq <= ?", [self._newest_event - self.max_events])

    # --- reading ------------------------------------------------------------------------------

    def certificates_in_order(self) -> list[bytes]:
        """Every applied commit certificate, oldest first: the history a restarted core replays."""
        return [row[0] for row in self.db.execute("SELECT certificate FROM certificates ORDER BY seq")]

    def safety_records(self) -> list[PersistRecord]:
        """The votes, locks and evidence a restarted core restores into an instance before it
        votes again (``MeshCore(safety_records=...)``, SPEC.md 6.9), and the reservations its
        bids still hold (R1: a restarted node never promises the same capacity twice)."""
        records = [PersistRecord(table, key, value) for table in ("votes", "locks", "evidence")
                   for key, value in self.load(table).items()]
        records += [PersistRecord("reservations", key, value) for key, value in self.load("reservations").items()
                    if value.get("held")]
        return records

    def capability_seq_floor(self) -> int:
        """Where a restarted core's capability seq starts (``MeshCore(capability_seq_floor=...)``)."""
        row = self.load("capability").get("seq_floor") or {}
        floor = row.get("seq_floor")
        return floor if isinstance(floor, int) and floor >= 0 else 0

    def job_outcomes(self) -> list[bytes]:
        """The newest exit or cancel envelope the core persisted per job (``MeshCore(job_outcomes=...)``)."""
        return [row["envelope"] for row in self.load("jobs").values() if isinstance(row.get("envelope"), bytes)]

    def certificates(self, value_kind: str | None = None) -> list[dict]:
        sql = "SELECT seq, instance, value_kind, epoch, certificate FROM certificates"
        params = []
        if value_kind is not None:
            sql += " WHERE value_kind = ?"
            params.append(value_kind)
        cursor = self.db.execute(sql + " ORDER BY seq", params)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor]

    def get(self, table: str, key: str) -> dict | None:
        if table not in PERSIST_TABLES or not self.db[table].exists():
            return None
        rows = list(self.db[table].rows_where("key = ?", [key]))
        return self._decode(table, rows[0]) if rows else None

    def load(self, table: str) -> dict[str, dict]:
        """All rows of a persist table, key -> value columns (decoded), for restart."""
        if table not in PERSIST_TABLES:
            raise LocalProtocolError("load: table %r is not one of %s" % (table, sorted(PERSIST_TABLES)))
        if not self.db[table].exists():
            return {}
        return {row["key"]: self._decode(table, row) for row in self.db[table].rows}

    def _decode(self, table: str, row: dict) -> dict:
        packed = self._packed.get(table, set())
        try:
            return {col: (codec.unpack(val) if col in packed and val is not None else val)
                    for col, val in row.items() if col != "key"}
        except RemoteProtocolError as exc:
            raise ConfigError("node database: %s row %r is corrupt: %s" % (table, row.get("key"), exc)) from None

    def recent_events(self, limit: int = 100) -> list[Event]:
        rows = self.db.execute("SELECT kind, at_ms, detail FROM events ORDER BY seq DESC LIMIT ?",
                               [max(0, min(limit, self.max_events))]).fetchall()
        return [Event(kind, at_ms, codec.unpack(detail)) for kind, at_ms, detail in reversed(rows)]


def certificate_epoch(certificate: bytes) -> int:
    """The epoch field of an encoded CommitCertificate envelope (the core has verified it,
    canonical form included, so it is read without the decoder's re-encoding check: issue 18)."""
    try:
        envelope = msgpack.unpackb(certificate, raw=False, max_ext_len=0)
        epoch = envelope[3]["epoch"]
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, msgpack.OutOfData,
            IndexError, KeyError, TypeError) as exc:
        raise LocalProtocolError("decision certificate is not an encoded CommitCertificate envelope: %s" % exc) from None
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise LocalProtocolError("decision certificate has a non-integer epoch")
    return epoch
