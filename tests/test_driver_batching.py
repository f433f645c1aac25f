"""The node driver batches its sends (issue 18 item 3): a Ready's messages are all queued
in the transport before any other task runs, and the frames already received are all
stepped before the receive loop yields. Between two scheduler passes the transport's
writer for a peer then finds every frame for it and sends them in one write (one yamux
frame, one Noise message, one syscall) instead of one each.

Observed, not timed: a task that checkpoints in a loop records what it sees at every
scheduler pass; with a yield per message (the driver before this change) it sees the
work half done.
"""

import trio

from meshnode.node.driver import RECEIVE_BATCH_FRAMES, RECEIVE_BATCH_MS, Node
from protocol.ready import Outbound, Ready
from testnet import launcher

PEERS = [bytes([i]) * 32 for i in range(1, 6)]


class RecordingTransport:
    """The Transport interface, recording what is queued; ``send`` checkpoints first, as
    the real transports do."""

    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []
        self._incoming_send, self.incoming = trio.open_memory_channel(1000)

    async def send(self, peer_key: bytes, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.send_nowait(peer_key, data)

    def send_nowait(self, peer_key: bytes, data: bytes) -> None:
        self.sent.append((peer_key, data))


class RecordingCore:
    """Steps nothing: remembers the frames it was given, answers with an empty Ready."""

    def __init__(self):
        self.stepped: list[bytes] = []

    def broadcast_targets(self) -> list[bytes]:
        return list(PEERS)

    def step(self, data: bytes, _now_ms: int, _sender: bytes) -> Ready:
        self.stepped.append(data)
        return Ready()


def driver_without_network(tmp_path) -> Node:
    launcher.create_testnet(tmp_path / "net", 4, run_workloads=False)
    node = Node(tmp_path / "net" / "node-0", run_workloads=False)
    node.transport, node.core = RecordingTransport(), RecordingCore()
    return node


PASSES_MAX = 1000   # a test that goes wrong stops, it does not spin


async def watch(seen: list, measure, until) -> None:
    """Record ``measure()`` at every scheduler pass until ``until()``."""
    for _ in range(PASSES_MAX):
        if until():
            return
        seen.append(measure())
        await trio.lowlevel.checkpoint()


async def passes(count: int) -> None:
    """Let the other tasks run ``count`` scheduler passes (they loop or wait, never block
    for good, so trio.testing.wait_all_tasks_blocked would never return)."""
    for _ in range(count):
        await trio.lowlevel.checkpoint()


async def test_a_readys_messages_are_all_queued_before_another_task_runs(tmp_path):
    node = driver_without_network(tmp_path)
    transport = node.transport
    messages = [Outbound(None, b"broadcast"), Outbound(PEERS[0], b"to one"), Outbound(PEERS[1], b"to another")]
    expected = len(PEERS) + 2
    seen: list[int] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, seen, lambda: len(transport.sent), lambda: len(transport.sent) == expected)
            await passes(3)   # the watcher is looping
            await node._send(messages)
        assert len(transport.sent) == expected
        assert transport.sent[:len(PEERS)] == [(key, b"broadcast") for key in PEERS]
        assert set(seen) == {0}, "another task ran with %s of %d messages queued" % (sorted(set(seen)), expected)
    finally:
        node.close()


async def test_the_frames_already_received_are_all_stepped_before_the_receive_loop_yields(tmp_path):
    node = driver_without_network(tmp_path)
    core, transport = node.core, node.transport
    frames = [b"frame %d" % i for i in range(RECEIVE_BATCH_FRAMES + 3)]
    seen: list[int] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node._receive_loop)
            await passes(3)   # the loop waits on an empty queue
            for frame in frames:
                transport._incoming_send.send_nowait((PEERS[0], frame))
            nursery.start_soon(watch, seen, lambda: len(core.stepped), lambda: len(core.stepped) == len(frames))
            for _ in range(PASSES_MAX):
                if len(core.stepped) == len(frames):
                    break
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
        assert core.stepped == frames
        # One batch of RECEIVE_BATCH_FRAMES, then the rest: the watcher never sees a batch cut short.
        assert set(seen) <= {0, RECEIVE_BATCH_FRAMES}, "the loop yielded after %s frames" % sorted(set(seen))
    finally:
        node.close()


class SlowCore(RecordingCore):
    """Each frame takes ``step_ms`` of the (mock) clock to step, as a slot frame did on a
    starved host."""

    def __init__(self, clock, step_ms: int):
        super().__init__()
        self.clock, self.step_ms = clock, step_ms

    def step(self, data: bytes, now_ms: int, sender: bytes) -> Ready:
        self.clock.jump(self.step_ms / 1000)
        return super().step(data, now_ms, sender)


async def test_a_batch_of_received_frames_ends_once_stepping_it_took_receive_batch_ms(tmp_path, mock_clock):
    # Issue 18: the tick (heartbeats, suspicions) waits for a batch; 32 frames of a few ms
    # each, times the starvation of 16 nodes on 2 cores, held it past the suspicion threshold.
    node = driver_without_network(tmp_path)
    step_ms = 4
    node.core = core = SlowCore(mock_clock, step_ms)
    transport = node.transport
    frames = [b"frame %d" % i for i in range(RECEIVE_BATCH_FRAMES)]
    seen: list[int] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node._receive_loop)
            await passes(3)
            for frame in frames:
                transport._incoming_send.send_nowait((PEERS[0], frame))
            nursery.start_soon(watch, seen, lambda: len(core.stepped), lambda: len(core.stepped) == len(frames))
            for _ in range(PASSES_MAX):
                if len(core.stepped) == len(frames):
                    break
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
        assert core.stepped == frames
        per_batch = -(-RECEIVE_BATCH_MS // step_ms)   # 3 frames of 4 ms reach 10 ms
        assert per_batch < RECEIVE_BATCH_FRAMES
        # Other tasks ran after every batch of per_batch frames, never later.
        assert set(seen) >= {per_batch, 2 * per_batch}, sorted(set(seen))
        assert all(count % per_batch == 0 or count == len(frames) for count in seen), sorted(set(seen))
    finally:
        node.close()
