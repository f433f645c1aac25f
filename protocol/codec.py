"""Canonical msgpack encoding (SPEC.md section 2).

Signed bytes must be reproducible by any implementation, so there is exactly one
encoding for a value: maps with text keys sorted by their UTF-8 bytes, the shortest
integer and length forms (what msgpack-python emits), ``bin`` for bytes, ``str`` for
text, and no floats anywhere. The decoder rejects input that is not exactly the
canonical encoding of what it decodes to, so a signature can never cover two
different byte strings.
"""

from __future__ import annotations

import msgpack

from protocol.errors import LocalProtocolError, RemoteProtocolError

MAX_FRAME_BYTES = 1 << 20  # SPEC.md 2.3: no message, envelope or file is larger
MAX_DEPTH = 16
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_SCALARS = frozenset({str, bytes, bool, type(None)})  # canonical leaves besides int


def _canonical(value, depth: int = 0):
    """Return ``value`` with maps rebuilt in sorted key order; refuse non-canonical types."""
    kind = type(value)
    if kind is int and _INT_MIN <= value <= _INT_MAX:
        return value  # depth: containers refuse items past MAX_DEPTH before recursing
    # Leaves are kept inline (no call per item): signing a vote packs a few small ints.
    if kind is list or kind is tuple:
        if value and depth >= MAX_DEPTH:
            raise LocalProtocolError("value nested deeper than %d levels" % MAX_DEPTH)
        return [item if type(item) in _SCALARS or (type(item) is int and _INT_MIN <= item <= _INT_MAX)
                else _canonical(item, depth + 1) for item in value]
    if kind is dict and all(type(key) is str for key in value):
        if value and depth >= MAX_DEPTH:
            raise LocalProtocolError("value nested deeper than %d levels" % MAX_DEPTH)
        # Code point order of str is the UTF-8 byte order SPEC.md 2.1 asks for.
        out = {}
        for key in sorted(value):
            item = value[key]
            out[key] = (item if type(item) in _SCALARS or (type(item) is int and _INT_MIN <= item <= _INT_MAX)
                        else _canonical(item, depth + 1))
        return out
    return _canonical_slow(value, depth)


def _canonical_slow(value, depth: int):
    """The general case of ``_canonical`` (ints, subclasses, errors)."""
    if depth > MAX_DEPTH:
        raise LocalProtocolError("value nested deeper than %d levels" % MAX_DEPTH)
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise LocalProtocolError("integer out of 64-bit range: %d" % value)
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(item, depth + 1) for item in value]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise LocalProtocolError("map keys must be text, got %r" % (key,))
        return {key: _canonical(value[key], depth + 1)
                for key in sorted(value, key=lambda k: k.encode("utf-8"))}
    if isinstance(value, float):
        raise LocalProtocolError("floats are not allowed in canonical data (use milli-units)")
    raise LocalProtocolError("cannot encode %s canonically" % type(value).__name__)


def pack(value) -> bytes:
    """Encode ``value`` canonically. Raises LocalProtocolError for unencodable values."""
    data = msgpack.packb(_canonical(value), use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise LocalProtocolError("encoded value is %d bytes, over the %d cap" % (len(data), MAX_FRAME_BYTES))
    return data


def _check_decoded(value, depth: int = 0) -> None:
    """Refuse what ``pack`` would refuse or reorder in a freshly decoded value.

    Decoded values hold only lists, dicts with keys in wire order, str, bytes, bool,
    None, ints within 64 bits and floats, so three rules remain: no floats, text map
    keys in sorted order, and MAX_DEPTH (an item of a container sits one level deeper).
    Python orders str by code point, which is the UTF-8 byte order of valid text, so
    comparing the keys as str is the SPEC.md 2.1 byte order. Minimal length forms are
    left to the byte comparison in ``unpack``.
    """
    kind = type(value)
    if kind is list:
        items = value
    elif kind is dict:
        keys = list(value)
        for key in keys:
            if type(key) is not str:
                raise RemoteProtocolError("not canonical: map keys must be text, got %r" % (key,))
        if keys != sorted(keys):
            raise RemoteProtocolError("not canonical msgpack (unsorted keys or non-minimal encoding)")
        items = value.values()
    elif kind is float:
        raise RemoteProtocolError("not canonical: floats are not allowed in canonical data")
    else:
        return  # int (msgpack yields only 64-bit ones), str, bytes, bool, None
    if items and depth >= MAX_DEPTH:
        raise RemoteProtocolError("not canonical: value nested deeper than %d levels" % MAX_DEPTH)
    for item in items:
        if type(item) in _SCALARS or type(item) is int:
            continue
        _check_decoded(item, depth + 1)


def unpack(data: bytes, max_bytes: int = MAX_FRAME_BYTES):
    """Decode canonical bytes. Any deviation raises RemoteProtocolError.

    The size cap is checked before msgpack allocates anything, and msgpack's own
    per-object limits are set from it so a forged length prefix cannot ask for more.
    Canonical form is checked without building a second copy of the value: a walk for
    the type, order and depth rules, then msgpack's own (minimal) encoding of the
    decoded value must equal the input byte for byte.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError("expected bytes, got %s" % type(data).__name__)
    if len(data) > max_bytes:
        raise RemoteProtocolError("message is %d bytes, over the %d cap" % (len(data), max_bytes))
    if len(data) > MAX_FRAME_BYTES:
        raise RemoteProtocolError("not canonical: over the %d byte cap" % MAX_FRAME_BYTES)
    data = bytes(data)
    try:
        value = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=max_bytes, max_str_len=max_bytes, max_array_len=max_bytes,
            max_map_len=max_bytes, max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError, msgpack.OutOfData, UnicodeDecodeError) as exc:
        raise RemoteProtocolError("not valid msgpack: %s" % exc) from None
    _check_decoded(value)
    if msgpack.packb(value, use_bin_type=True) != data:
        raise RemoteProtocolError("not canonical msgpack (unsorted keys or non-minimal encoding)")
    return value
