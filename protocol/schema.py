"""Declarative field types for strict message schemas (SPEC.md section 3).

Every message body is a map whose keys are exactly the declared field names. Each
field type checks the decoded value (type, length, range) and converts it to the
Python value the dataclass holds; ``encode`` is its inverse. Limits are part of the
type, so no field is unbounded (STYLE.md: "put a limit on everything").
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from protocol.errors import RemoteProtocolError


class FieldType:
    def check(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    def encode(self, value: Any) -> Any:
        return value

    def describe(self) -> str:
        raise NotImplementedError


def _fail(where: str, expected: str, value: Any) -> RemoteProtocolError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return RemoteProtocolError("%s: expected %s, got %s" % (where, expected, shown))


@dataclass(frozen=True)
class Int(FieldType):
    low: int = 0
    high: int = (1 << 63) - 1

    def check(self, value, where):
        if isinstance(value, bool) or not isinstance(value, int) or not self.low <= value <= self.high:
            raise _fail(where, self.describe(), value)
        return value

    def describe(self):
        return "int in [%d, %d]" % (self.low, self.high)


@dataclass(frozen=True)
class Bool(FieldType):
    def check(self, value, where):
        if not isinstance(value, bool):
            raise _fail(where, "bool", value)
        return value

    def describe(self):
        return "bool"


@dataclass(frozen=True)
class Bytes(FieldType):
    min_len: int = 0
    max_len: int = 1 << 20

    def check(self, value, where):
        if not isinstance(value, (bytes, bytearray)) or not self.min_len <= len(value) <= self.max_len:
            raise _fail(where, self.describe(), value)
        return bytes(value)

    def describe(self):
        if self.min_len == self.max_len:
            return "bin of %d bytes" % self.min_len
        return "bin of %d..%d bytes" % (self.min_len, self.max_len)


def Key() -> Bytes:  # an Ed25519 public key or a SHA-256 digest
    return Bytes(32, 32)


@dataclass(frozen=True)
class Text(FieldType):
    min_len: int = 0
    max_len: int = 256
    choices: tuple = ()

    def check(self, value, where):
        if not isinstance(value, str) or not self.min_len <= len(value.encode("utf-8")) <= self.max_len:
            raise _fail(where, self.describe(), value)
        if self.choices and value not in self.choices:
            raise _fail(where, "one of " + ", ".join(self.choices), value)
        return value

    def describe(self):
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return "text of %d..%d bytes" % (self.min_len, self.max_len)


@dataclass(frozen=True)
class Optional(FieldType):
    inner: FieldType

    def check(self, value, where):
        return None if value is None else self.inner.check(value, where)

    def encode(self, value):
        return None if value is None else self.inner.encode(value)

    def describe(self):
        return self.inner.describe() + " or nil"


@dataclass(frozen=True)
class List(FieldType):
    item: FieldType
    max_items: int = 64

    def check(self, value, where):
        if not isinstance(value, (list, tuple)) or len(value) > self.max_items:
            raise _fail(where, "array of at most %d" % self.max_items, value)
        check = self.item.check
        try:
            return tuple([check(v, where) for v in value])
        except RemoteProtocolError:
            # The item's place in the message is named only on this path: formatting it for
            # every item that passes was most of a decode's text work (issue 18).
            for i, v in enumerate(value):
                check(v, "%s[%d]" % (where, i))
            raise

    def encode(self, value):
        return [self.item.encode(v) for v in value]

    def describe(self):
        return "array of at most %d x (%s)" % (self.max_items, self.item.describe())


@dataclass(frozen=True)
class TextMap(FieldType):
    """A map of short text keys to short text values (labels, attested attributes)."""
    max_items: int = 32

    def check(self, value, where):
        if isinstance(value, tuple):  # the Python form held by a record: sorted pairs
            value = dict(value)
        if not isinstance(value, dict) or len(value) > self.max_items:
            raise _fail(where, self.describe(), value)
        try:
            for k, v in value.items():
                _TEXT_MAP_KEY.check(k, where)
                _TEXT_MAP_VALUE.check(v, where)
        except RemoteProtocolError:   # the offending entry is named on this path only (List.check)
            for k, v in value.items():
                _TEXT_MAP_KEY.check(k, where + " key")
                _TEXT_MAP_VALUE.check(v, "%s[%s]" % (where, k))
            raise
        return tuple(sorted(value.items()))  # hashable, canonical order

    def encode(self, value):
        return dict(value)

    def describe(self):
        return "map of at most %d text -> text" % self.max_items


_TEXT_MAP_KEY = Text(1, 64)
_TEXT_MAP_VALUE = Text(0, 256)


@dataclass(frozen=True)
class Nested(FieldType):
    cls: type

    def check(self, value, where):
        if isinstance(value, self.cls):
            return value
        return self.cls.from_body(value, where)

    def encode(self, value):
        return value.to_body()

    def describe(self):
        return self.cls.__name__


class Record:
    """Base of frozen, self-validating records. Subclasses are frozen dataclasses with SCHEMA."""

    SCHEMA: ClassVar[dict[str, FieldType]] = {}
    # Fields added after a record's first version: at their default (given here as the
    # decoded value) the key is left out of the body, so older bodies keep their bytes (and
    # a job its id), and a body that sends the default is refused: one encoding per record.
    LEFT_OUT_AT_DEFAULT: ClassVar[dict[str, Any]] = {}

    def __post_init__(self):
        # Validate on construction too: a locally built record is as strict as a decoded one.
        for name, ftype in self.SCHEMA.items():
            try:
                checked = ftype.check(getattr(self, name), name)
            except RemoteProtocolError as exc:
                raise ValueError("%s.%s" % (type(self).__name__, exc)) from None
            object.__setattr__(self, name, checked)

    @classmethod
    def from_body(cls, body: Any, where: str | None = None):
        where = where or cls.__name__
        if not isinstance(body, dict):
            raise _fail(where, "map", body)
        if cls.LEFT_OUT_AT_DEFAULT:
            body = cls._with_defaults(body, where)
        expected = _field_names.get(cls)
        if expected is None:
            expected = _field_names[cls] = frozenset(cls.SCHEMA)
        if body.keys() != expected:
            missing = sorted(expected - set(body))
            extra = sorted(set(body) - expected)
            raise RemoteProtocolError("%s: missing fields %s, unknown fields %s" % (where, missing, extra))
        record = object.__new__(cls)  # fields are checked here, so skip __post_init__'s second pass
        set_field = object.__setattr__
        for name, ftype in cls.SCHEMA.items():
            try:
                set_field(record, name, ftype.check(body[name], where))
            except RemoteProtocolError:
                # The field's name goes into the message on this path only (see List.check).
                ftype.check(body[name], "%s.%s" % (where, name))
                raise
        if cls.__post_init__ is not Record.__post_init__:
            # The subclass adds cross-field rules (Checkpoint.state_hash, Genesis members):
            # a decoded record must obey them too, or a signed but invalid message gets in.
            try:
                record.__post_init__()
            except ValueError as exc:
                raise RemoteProtocolError("%s: %s" % (where, exc)) from None
        return record

    @classmethod
    def _with_defaults(cls, body: dict, where: str) -> dict:
        body = dict(body)
        for name, default in cls.LEFT_OUT_AT_DEFAULT.items():
            encoded = cls.SCHEMA[name].encode(default)
            if name not in body:
                body[name] = encoded
            elif body[name] == encoded:
                what = "an empty list" if encoded == [] else "the default"
                raise RemoteProtocolError("%s.%s: %s is left out, not sent" % (where, name, what))
        return body

    def to_body(self) -> dict:
        names = _plain_fields.get(type(self))
        if names is None:
            names = _plain_fields[type(self)] = _fields_if_plain(self.SCHEMA)
        if names:  # every field encodes as itself (votes, most small messages): no call per field
            body = {name: getattr(self, name) for name in names}
        else:
            body = {name: ftype.encode(getattr(self, name)) for name, ftype in self.SCHEMA.items()}
        for name, default in self.LEFT_OUT_AT_DEFAULT.items():
            if getattr(self, name) == default:
                del body[name]
        return body


def scalars_only(schema: dict) -> bool:
    """Whether every field is an int, bool, bin or text (or nil): the body such a record
    seals decodes back to the same values, with no tuple -> list or nested record changes."""
    def scalar(ftype: FieldType) -> bool:
        if isinstance(ftype, Optional):
            return scalar(ftype.inner)
        return type(ftype) in (Int, Bool, Bytes, Text)
    return all(scalar(f) for f in schema.values())


_field_names: dict[type, frozenset] = {}  # record class -> the names of its SCHEMA (from_body)
_plain_fields: dict[type, tuple] = {}  # record class -> its field names if all encode as themselves, else ()


def _encodes_as_itself(ftype: FieldType) -> bool:
    if isinstance(ftype, Optional):
        return _encodes_as_itself(ftype.inner)
    return type(ftype).encode is FieldType.encode


def _fields_if_plain(schema: dict) -> tuple:
    return tuple(schema) if all(_encodes_as_itself(f) for f in schema.values()) else ()


def check_schema_matches_fields(cls) -> None:
    """Import-time guard: a record's dataclass fields and SCHEMA must name the same things."""
    names = [f.name for f in fields(cls)]
    if names != list(cls.SCHEMA):
        raise TypeError("%s: dataclass fields %s differ from SCHEMA %s" % (cls.__name__, names, list(cls.SCHEMA)))
