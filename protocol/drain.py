"""The one Ready drain: how every driver (the node, the simulator, the test harnesses)
handles the core's output, in the order protocol/ready.py writes down.

    1. persist(ready)       every record durably, BEFORE anything is sent
    2. send(messages)       best effort
    3. apply(decision)      each decision, in order
    4. publish(events)      log and tell subscribers

A handler may feed the core another input while a batch is being drained (applying a
"run" order starts a workload, which reports ``workload_started``): that input's Ready is
queued and drained after the current batch, never inside it, so no batch is ever seen
half-applied. The queue is bounded: a driver that feeds more nested inputs than
MAX_QUEUED_BATCHES is looping, and is told so loudly.

The drain does no IO itself; it calls what the driver gives it, through ``drain`` (plain
callables) or ``drain_async`` (coroutine functions, for trio drivers).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from protocol.errors import LocalProtocolError
from protocol.ready import Ready

MAX_QUEUED_BATCHES = 4096


def _nothing(_item) -> None:
    return None


class ReadyDrain:
    def __init__(self, *, persist: Callable = _nothing, send: Callable = _nothing, apply: Callable = _nothing,
                 publish: Callable = _nothing) -> None:
        self.persist, self.send, self.apply, self.publish = persist, send, apply, publish
        self._queue: deque[Ready] = deque()
        self._draining = False

    def _enqueue(self, ready: Ready) -> bool:
        """Queue ``ready``; True if the caller must drain (no drain is running)."""
        if not ready:
            return False
        if len(self._queue) >= MAX_QUEUED_BATCHES:
            raise LocalProtocolError("more than %d Ready batches queued: a driver feeds the core in a loop"
                                     % MAX_QUEUED_BATCHES)
        self._queue.append(ready)
        return not self._draining

    def backlog(self) -> int:
        """Batches waiting behind the one being drained (a driver's receive loop reads no
        further frames while it is large: meshnode/node/driver.py)."""
        return len(self._queue)

    def drain(self, ready: Ready) -> None:
        if not self._enqueue(ready):
            return
        self._draining = True
        try:
            while self._queue:
                batch = self._queue.popleft()
                self.persist(batch)
                self.send(batch.messages)
                for decision in batch.decisions:
                    self.apply(decision)
                self.publish(batch.events)
        finally:
            self._draining = False

    async def drain_async(self, ready: Ready) -> None:
        if not self._enqueue(ready):
            return
        self._draining = True
        try:
            while self._queue:
                batch = self._queue.popleft()
                await self.persist(batch)
                await self.send(batch.messages)
                for decision in batch.decisions:
                    await self.apply(decision)
                await self.publish(batch.events)
        finally:
            self._draining = False
