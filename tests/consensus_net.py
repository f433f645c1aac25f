"""A tiny deterministic network for driving ConsensusInstances in tests.

Messages are delivered in FIFO order; ``block`` decides which (sender, recipient,
message kind) deliveries are lost. Time only moves when ``advance`` is called.
"""

from __future__ import annotations

import hashlib
from collections import deque

from keys.identity import SigningIdentity
from protocol import codec
from protocol.consensus import ConsensusInstance
from protocol.drain import ReadyDrain
from protocol.quorum import EpochView
from protocol.ready import Ready

MESH_ID = hashlib.sha256(b"test mesh").digest()
INSTANCE = hashlib.sha256(b"test instance").digest()


def identities(n: int, tag: bytes = b"node") -> list[SigningIdentity]:
    return [SigningIdentity(hashlib.sha256(tag + b"%d" % i).digest()) for i in range(n)]


def kind_of(data: bytes) -> str:
    return codec.unpack(data)[2]  # the envelope's kind field; routing needs no signature check


class Net:
    def __init__(self, n: int = 4, stakes: list[int] | None = None, *, mesh_id: bytes = MESH_ID,
                 instance_id: bytes = INSTANCE, max_rounds: int = 16, validate=None, now_ms: int = 0):
        self.ids = identities(n)
        self.keys = [i.public_key for i in self.ids]
        self.view = EpochView(0, {k: (stakes[i] if stakes else 1) for i, k in enumerate(self.keys)})
        self.mesh_id = mesh_id
        self.now_ms = now_ms
        self.queue: deque = deque()
        self.down: set[bytes] = set()
        self.block = lambda sender, to, kind: False
        self.delivered = 0
        self.readies: dict[bytes, list[Ready]] = {k: [] for k in self.keys}
        self.drains: dict[bytes, ReadyDrain] = {}
        self.nodes = {
            ident.public_key: ConsensusInstance(
                instance_id=instance_id, value_kind="placement", view=self.view, identity=ident, mesh_id=mesh_id,
                round_timeout_ms=100, round_timeout_max_ms=1000, max_rounds=max_rounds,
                validate=validate or (lambda value, justification, proven=False: None), now_ms=now_ms)
            for ident in self.ids}

    def node(self, index: int) -> ConsensusInstance:
        return self.nodes[self.keys[index]]

    def absorb(self, sender: bytes, ready: Ready) -> None:
        """Through the drain every driver uses (protocol/drain.py): the batch is kept whole
        (the "disk" tests read back), then its messages are queued."""
        drain = self.drains.get(sender)
        if drain is None:
            drain = self.drains[sender] = ReadyDrain(persist=self.readies[sender].append,
                                                     send=lambda messages: self._send(sender, messages))
        drain.drain(ready)

    def _send(self, sender: bytes, messages: list) -> None:
        for out in messages:
            targets = [k for k in self.keys if k != sender] if out.to is None else [out.to]
            for to in targets:
                self.queue.append((sender, to, out.data))

    def start(self) -> None:
        for key, node in self.nodes.items():
            if key not in self.down:
                self.absorb(key, node.start(self.now_ms))

    def deliver(self, limit: int = 1_000_000) -> None:
        while self.queue and limit > 0:
            limit -= 1
            sender, to, data = self.queue.popleft()
            if to in self.down or sender in self.down or self.block(sender, to, kind_of(data)):
                continue
            self.delivered += 1
            self.absorb(to, self.nodes[to].receive(data, self.now_ms))

    def propose_where_asked(self, value_of) -> None:
        for key, node in self.nodes.items():
            if key not in self.down and node.awaiting_value:
                self.absorb(key, node.propose(value_of(key, node.round), (), self.now_ms))

    def advance(self, order: list[bytes] | None = None) -> None:
        """Jump the clock to the earliest round deadline and tick every live node."""
        deadlines = [n.deadline_ms for k, n in self.nodes.items() if k not in self.down and n.deadline_ms is not None]
        if not deadlines:
            return
        self.now_ms = max(self.now_ms, min(deadlines))
        for key in order or self.keys:
            if key not in self.down:
                self.absorb(key, self.nodes[key].tick(self.now_ms))

    def run(self, value_of=lambda key, round: b"value", max_steps: int = 200, start: bool = True) -> None:
        """Start (unless already), then propose/deliver/tick until every live node decided or gave up."""
        if start:
            self.start()
        for _ in range(max_steps):
            self.propose_where_asked(value_of)
            self.deliver()
            if all(n.decision is not None or n.gave_up for k, n in self.nodes.items() if k not in self.down):
                return
            if not self.queue and not any(n.awaiting_value for n in self.nodes.values()):
                self.advance()
        raise AssertionError("no decision within %d steps" % max_steps)

    def live(self) -> list[ConsensusInstance]:
        return [n for k, n in self.nodes.items() if k not in self.down]

    def events(self, key: bytes, kind: str) -> list:
        return [e for r in self.readies[key] for e in r.events if e.kind == kind]
