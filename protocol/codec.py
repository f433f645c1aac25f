"""Canonical msgpack encoding (SPEC.md section 2).

Signed bytes must be reproducible by any implementation, so there is exactly one
encoding for a value: maps with text keys sorted by their UTF-8 bytes, the shortest
integer and length forms (what msgpack-python emits), ``bin`` for bytes, ``str`` for
text, and no floats anywhere. The decoder re-encodes what it read and rejects input
whose bytes differ, so a signature can never cover two different byte strings.
"""

from __future__ import annotations

import msgpack

from protocol.errors import LocalProtocolError, RemoteProtocolError

MAX_FRAME_BYTES = 1 << 20  # SPEC.md 2.3: no message, envelope or file is larger
MAX_DEPTH = 16
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def _canonical(value, depth: int = 0):
    """Return ``value`` with maps rebuilt in sorted key order; refuse non-canonical types."""
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


def unpack(data: bytes, max_bytes: int = MAX_FRAME_BYTES):
    """Decode canonical bytes. Any deviation raises RemoteProtocolError.

    The size cap is checked before msgpack allocates anything, and msgpack's own
    per-object limits are set from it so a forged length prefix cannot ask for more.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError("expected bytes, got %s" % type(data).__name__)
    if len(data) > max_bytes:
        raise RemoteProtocolError("message is %d bytes, over the %d cap" % (len(data), max_bytes))
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
    try:
        again = pack(value)
    except LocalProtocolError as exc:
        raise RemoteProtocolError("not canonical: %s" % exc) from None
    if again != data:
        raise RemoteProtocolError("not canonical msgpack (unsorted keys or non-minimal encoding)")
    return value
