"""Mesh genesis documents (SPEC.md section 5).

A mesh is named by the SHA-256 of its canonical genesis body, so two nodes agree on
the mesh exactly when they hold byte-identical genesis documents. The genesis fixes
the first epoch's members and stake, the protocol parameters every node must share,
and the attestation authorities whose signatures the mesh trusts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from keys.errors import ConfigError
from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.messages import Member, record
from protocol.schema import Bool, Int, Key, List, Nested, Record, Text

GENESIS_DOMAIN = b"meshnode/v1/genesis\x00"


@record
class ProtocolParams(Record):
    heartbeat_ms: int
    checkpoint_ms: int
    checkpoint_keep: int
    detection_bound_ms: int
    round_timeout_ms: int
    round_timeout_max_ms: int
    bid_window_ms: int
    max_rounds: int
    placement_slot_ms: int  # 0: one instance per job; > 0: first placements batched per slot (SPEC.md P7)
    SCHEMA: ClassVar = {
        "heartbeat_ms": Int(1, 60_000), "checkpoint_ms": Int(1, 60_000), "checkpoint_keep": Int(1, 1000),
        "detection_bound_ms": Int(1, 600_000), "round_timeout_ms": Int(1, 600_000),
        "round_timeout_max_ms": Int(1, 3_600_000), "bid_window_ms": Int(0, 600_000), "max_rounds": Int(1, 1000),
        "placement_slot_ms": Int(0, 60_000),
    }


DEFAULT_PARAMS = ProtocolParams(
    heartbeat_ms=50, checkpoint_ms=60, checkpoint_keep=16, detection_bound_ms=300,
    round_timeout_ms=200, round_timeout_max_ms=5000, bid_window_ms=20, max_rounds=64,
    placement_slot_ms=0,
)


UNLIMITED = 1 << 40   # a quota dimension with no limit (SPEC.md 5.5)
MAX_POOLS = 64
MAX_POOL_OWNERS = 1024
MAX_BID_SAMPLE = 4096   # the most members a genesis lists: a larger sample is every member


@record
class Quota(Record):
    """How much one owner may hold in a pool at once (SPEC.md 5.5). GPUs in thousandths:
    a whole-GPU job counts 1000 per GPU, a shared-GPU job its ``gpu_milli``."""
    gpu_milli: int = UNLIMITED
    cpu_milli: int = UNLIMITED
    mem_mib: int = UNLIMITED
    SCHEMA: ClassVar = {"gpu_milli": Int(0, UNLIMITED), "cpu_milli": Int(0, UNLIMITED), "mem_mib": Int(0, UNLIMITED)}


@record
class OwnerQuota(Record):
    owner: bytes
    quota: Quota
    SCHEMA: ClassVar = {"owner": Key(), "quota": Nested(Quota)}


@record
class Pool(Record):
    """A named share of the mesh (SPEC.md 5.5): jobs name it in ``[scheduling] pool``; an
    owner's live jobs in it may hold at most its quota: the owner's own, else ``default``."""
    name: str
    default: Quota
    owners: tuple = ()
    SCHEMA: ClassVar = {"name": Text(0, 64), "default": Nested(Quota),
                        "owners": List(Nested(OwnerQuota), MAX_POOL_OWNERS)}

    def __post_init__(self):
        super().__post_init__()
        keys = [entry.owner for entry in self.owners]
        if len(set(keys)) != len(keys):
            raise ValueError("Pool %r: an owner is listed twice" % self.name)


@record
class Genesis(Record):
    name: str
    created_ms: int
    members: tuple
    params: ProtocolParams
    authorities: tuple
    # The scheduling fields (SPEC.md 5.5) are left out of the encoding at their defaults,
    # so a genesis without them keeps its bytes and its mesh id.
    pools: tuple = ()
    reservations: bool = False   # a waiting job holds capacity against later ones (Q5)
    # SPEC.md 5.6: about this many members bid per job in round 0 (P3 sampling); 0: every member.
    bid_sample: int = 0
    SCHEMA: ClassVar = {
        "name": Text(1, 64), "created_ms": Int(), "members": List(Nested(Member), 4096),
        "params": Nested(ProtocolParams), "authorities": List(Key(), 16), "pools": List(Nested(Pool), MAX_POOLS),
        "reservations": Bool(), "bid_sample": Int(0, MAX_BID_SAMPLE),
    }
    OMITTED_AT_DEFAULT: ClassVar = {"pools": [], "reservations": False, "bid_sample": 0}

    def __post_init__(self):
        super().__post_init__()
        keys = [m.public_key for m in self.members]
        if not keys:
            raise ValueError("Genesis.members: a mesh needs at least one member")
        if len(set(keys)) != len(keys):
            raise ValueError("Genesis.members: a public key is listed twice")
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise ValueError("Genesis.pools: a pool name is listed twice")

    @classmethod
    def from_body(cls, body, where=None):
        if isinstance(body, dict):
            for name, default in cls.OMITTED_AT_DEFAULT.items():
                if name in body and body[name] == default:
                    # One encoding per genesis: a default written out would name another mesh.
                    raise RemoteProtocolError("Genesis.%s: must be left out at its default" % name)
            body = dict(cls.OMITTED_AT_DEFAULT, **body)
        return super().from_body(body, where)

    def to_body(self) -> dict:
        body = super().to_body()
        for name, default in self.OMITTED_AT_DEFAULT.items():
            if body[name] == default:
                del body[name]
        return body

    @cached_property  # immutable record; packing 1000 members costs ~130 ms (measured by the simulator)
    def mesh_id(self) -> bytes:
        return hashlib.sha256(GENESIS_DOMAIN + codec.pack(self.to_body())).digest()

    @property
    def total_stake(self) -> int:
        return sum(m.stake for m in self.members)

    def encode(self) -> bytes:
        return codec.pack(self.to_body())

    @classmethod
    def decode(cls, data: bytes) -> "Genesis":
        try:
            return cls.from_body(codec.unpack(data))
        except ValueError as exc:
            raise RemoteProtocolError(str(exc)) from None


def load_genesis(path) -> Genesis:
    try:
        with open(path, "rb") as fh:
            data = fh.read(codec.MAX_FRAME_BYTES + 1)
    except OSError as exc:
        raise ConfigError("cannot read genesis %s: %s" % (path, exc.strerror)) from None
    try:
        return Genesis.decode(data)
    except RemoteProtocolError as exc:
        raise ConfigError("%s is not a valid genesis document: %s" % (path, exc)) from None
