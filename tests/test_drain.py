"""The one Ready drain (protocol/drain.py): contract order, nested inputs queued."""

import pytest
import trio
import trio.testing

from protocol.drain import MAX_QUEUED_BATCHES, ReadyDrain
from protocol.errors import LocalProtocolError
from protocol.ready import Decision, Event, Outbound, PersistRecord, Ready


def batch(tag: str) -> Ready:
    return Ready(persist=[PersistRecord("t", tag, {})], messages=[Outbound(None, tag.encode())],
                 decisions=[Decision(tag, b"", None, b"")], events=[Event(tag, 0)])


def test_a_batch_is_persisted_then_sent_then_applied_then_published():
    log = []
    drain = ReadyDrain(persist=lambda r: log.append(("persist", r.persist[0].key)),
                       send=lambda m: log.append(("send", m[0].data)),
                       apply=lambda d: log.append(("apply", d.value_kind)),
                       publish=lambda e: log.append(("publish", e[0].kind)))
    drain.drain(batch("a"))
    assert log == [("persist", "a"), ("send", b"a"), ("apply", "a"), ("publish", "a")]


def test_an_input_fed_while_applying_is_drained_after_the_current_batch_not_inside_it():
    log = []

    def apply(decision):
        log.append(("apply", decision.value_kind))
        if decision.value_kind == "outer":
            drain.drain(batch("nested"))  # e.g. a started workload reports workload_started
            log.append(("apply returned", "outer"))

    drain = ReadyDrain(apply=apply, publish=lambda e: log.append(("publish", e[0].kind)))
    drain.drain(batch("outer"))
    assert log == [("apply", "outer"), ("apply returned", "outer"), ("publish", "outer"),
                   ("apply", "nested"), ("publish", "nested")]


def test_an_empty_batch_calls_nothing():
    calls = []
    ReadyDrain(persist=calls.append, send=calls.append).drain(Ready())
    assert calls == []


def test_a_driver_feeding_the_core_in_a_loop_is_stopped():
    def apply(decision):
        for _ in range(MAX_QUEUED_BATCHES + 1):
            drain.drain(batch("again"))

    drain = ReadyDrain(apply=apply)
    with pytest.raises(LocalProtocolError, match="in a loop"):
        drain.drain(batch("first"))


def test_the_async_face_keeps_the_same_order():
    log = []

    async def record(kind, item):
        log.append(kind)

    async def apply(decision):
        log.append("apply " + decision.value_kind)
        if decision.value_kind == "outer":
            await drain.drain_async(batch("nested"))

    async def persist(ready):
        await record("persist", ready)

    async def send(messages):
        await record("send", messages)

    async def publish(events):
        await record("publish", events)

    drain = ReadyDrain(persist=persist, send=send, apply=apply, publish=publish)
    trio.run(drain.drain_async, batch("outer"))
    assert log == ["persist", "send", "apply outer", "publish", "persist", "send", "apply nested", "publish"]


async def test_backlog_counts_the_batches_waiting_behind_a_slow_send():
    """The node's receive loop stops reading frames while this is large (driver backpressure)."""
    release = trio.Event()
    seen = []

    async def send(messages):
        seen.extend(m.data for m in messages)
        if len(seen) == 1:
            await release.wait()   # the first batch's send is slow: the others queue behind it

    async def nothing(_item):
        return None

    drain = ReadyDrain(persist=nothing, send=send, apply=nothing, publish=nothing)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain.drain_async, batch("a"))
        await trio.testing.wait_all_tasks_blocked()
        for tag in "bcd":
            await drain.drain_async(batch(tag))   # returns at once: queued
        assert drain.backlog() == 3
        release.set()
    assert drain.backlog() == 0 and seen == [b"a", b"b", b"c", b"d"]
