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
from protocol.messages import Heartbeat, encode_unsigned, is_heartbeat_frame
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


async def receive_all(node, frames: list, seen: list | None = None) -> None:
    """Run the node's receive loop over ``frames`` queued at once, until all are stepped;
    ``seen``: how many were stepped at each scheduler pass of another task."""
    core, transport = node.core, node.transport
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node._receive_loop)
        await passes(3)   # the loop waits on an empty queue
        for frame in frames:
            transport._incoming_send.send_nowait((PEERS[0], frame))
        if seen is not None:
            nursery.start_soon(watch, seen, lambda: len(core.stepped), lambda: len(core.stepped) == len(frames))
        for _ in range(PASSES_MAX):
            if len(core.stepped) == len(frames):
                break
            await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()


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
    core = node.core
    frames = [b"frame %d" % i for i in range(RECEIVE_BATCH_FRAMES + 3)]
    seen: list[int] = []
    try:
        await receive_all(node, frames, seen)
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
    frames = [b"frame %d" % i for i in range(RECEIVE_BATCH_FRAMES)]
    seen: list[int] = []
    try:
        await receive_all(node, frames, seen)
        assert core.stepped == frames
        per_batch = -(-RECEIVE_BATCH_MS // step_ms)   # 3 frames of 4 ms reach 10 ms
        assert per_batch < RECEIVE_BATCH_FRAMES
        # Other tasks ran between batches of per_batch frames (not only after 32).
        assert len(set(seen) - {0, len(frames)}) >= 2, sorted(set(seen))
        assert all(count % per_batch == 0 or count == len(frames) for count in seen), sorted(set(seen))
    finally:
        node.close()


def heartbeat_frame(index: int) -> bytes:
    return encode_unsigned(PEERS[index % len(PEERS)], b"m" * 32, Heartbeat(epoch=0, seq=index + 1, sent_ms=index))


async def test_heartbeats_queued_behind_other_frames_are_stepped_first(tmp_path):
    # Issue 18: on a starved 16-node mesh frames waited 17-19 s in a node's queue, heartbeats
    # among them, so their senders looked silent: suspicions, refutations, a storm. The
    # core still decodes and checks a heartbeat as any frame; only the order changes.
    node = driver_without_network(tmp_path)
    core = node.core
    bulk = [b"frame %d" % i for i in range(3 * RECEIVE_BATCH_FRAMES)]
    beats = [heartbeat_frame(i) for i in range(3)]
    try:
        await receive_all(node, bulk[:40] + [beats[0]] + bulk[40:80] + beats[1:] + bulk[80:])
        # Every heartbeat queued behind the bulk frames was stepped before any of them.
        assert core.stepped[:3] == beats
        assert [f for f in core.stepped if f not in beats] == bulk   # the others keep their order
        assert not is_heartbeat_frame(b"frame 1") and all(is_heartbeat_frame(b) for b in beats)
    finally:
        node.close()


class DeadlineCountingCore(RecordingCore):
    """Counts the driver's questions for its next tick."""

    def __init__(self):
        super().__init__()
        self.deadline_asked = 0

    def next_tick_ms(self, now_ms: int) -> int:
        self.deadline_asked += 1
        return now_ms + 40


async def test_the_next_tick_is_asked_once_per_batch_of_received_frames(tmp_path):
    # Issue 18: after every frame the driver asked the core for its next deadline (4-6% of
    # a node's CPU with slots); the tick loop cannot run before the receive loop yields,
    # so once per batch brings the tick as early.
    node = driver_without_network(tmp_path)
    node.core = core = DeadlineCountingCore()
    frames = [b"frame %d" % i for i in range(10)] + [heartbeat_frame(i) for i in range(3)]
    try:
        with trio.CancelScope(deadline=trio.current_time() + 3600) as tick_wait:
            node._tick_wait = tick_wait   # the tick loop, asleep for an hour
            await receive_all(node, frames)
        assert len(core.stepped) == len(frames)
        assert core.deadline_asked == 1
        assert tick_wait.deadline <= trio.current_time() + 0.05   # brought forward to the core's 40 ms
    finally:
        node.close()
