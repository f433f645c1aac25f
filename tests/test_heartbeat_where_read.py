"""SPEC F1d: a heartbeat that only feeds the failure detector is taken where the transport
reads it (MeshCore.take_heartbeat), not queued, stepped and drained as an input (issue 18:
that path was most of an idle node's CPU). It must change nothing the core does: the same
suspicions, evictions, halts and decisions as stepping every heartbeat. Pure cores, the
integer clock and FIFO router of test_monitors."""

import hashlib
import random

import pytest

from protocol.envelope import seal_unsigned
from protocol.errors import RemoteProtocolError
from protocol.messages import Heartbeat, decode_heartbeat, decode_message, encode_message, encode_unsigned
from tests.test_monitors import PERIOD, Mesh


def beat_from(mesh: Mesh, index: int, sent_ms: int, epoch: int = 0, seq: int = 1) -> bytes:
    return mesh.cores[mesh.keys[index]].ctx.unsigned(Heartbeat(epoch=epoch, seq=seq, sent_ms=sent_ms))


def test_a_quiet_heartbeat_is_taken_and_moves_its_senders_last_heard_time():
    mesh = Mesh(4)
    mesh.run(500)
    core = mesh.cores[mesh.keys[0]]
    sender = mesh.keys[1]
    later = mesh.now + 20
    assert core.detector.last_heard_ms(sender) < later
    assert core.take_heartbeat(beat_from(mesh, 1, later, seq=99), later, sender)
    assert core.detector.last_heard_ms(sender) == later
    assert core.liveness.peer_beat_sent_ms[sender] == later


def test_anything_else_is_left_to_step_untouched():
    mesh = Mesh(4)
    mesh.run(500)
    core = mesh.cores[mesh.keys[0]]
    a, b = mesh.keys[1], mesh.keys[2]
    now = mesh.now + 10
    heard = core.detector.last_heard_ms(a)
    outsider = Mesh(5)   # same genesis name and keys, one more member: its fifth is a stranger here
    stranger_key = outsider.keys[4]
    stranger = outsider.cores[stranger_key]
    signed = encode_message(mesh.ids[1], mesh.genesis.mesh_id, Heartbeat(epoch=0, seq=5, sent_ms=now))
    not_taken = [
        (beat_from(mesh, 1, now), b),                 # relayed by another peer: counts only from its sender
        (signed, a),                                  # signed: refused (2.2)
        (stranger.ctx.unsigned(Heartbeat(epoch=0, seq=1, sent_ms=now)), stranger_key),   # not a member
        (b"\x96\x01garbage", a),
        (mesh.cores[a].ctx.sign(Heartbeat(epoch=0, seq=6, sent_ms=now)), a),
    ]
    for data, sender in not_taken:
        assert not core.take_heartbeat(data, now, sender)
    assert core.detector.last_heard_ms(a) == heard
    assert not core.counters   # nothing counted either: step() counts what it refuses


def test_a_suspected_sender_or_a_halted_node_gets_the_whole_step():
    mesh = Mesh(4)
    mesh.run(500)
    watcher, silent = mesh.keys[0], mesh.keys[1]
    core = mesh.cores[watcher]
    mesh.paused.add(silent)
    mesh.run(280)
    assert core.detector.is_suspected(silent, mesh.now) and core.epoch == 0
    assert not core.take_heartbeat(beat_from(mesh, 1, mesh.now, seq=50), mesh.now, silent)
    # The step of the same heartbeat asks the member heard again for what it missed (F6).
    ready = core.step(beat_from(mesh, 1, mesh.now, seq=50), mesh.now, silent)
    assert ready.messages
    # A node halted by its own pause (F3): a heartbeat may end the halt, so it is stepped.
    sleeper = mesh.cores[silent]
    mesh.resume(silent)
    mesh.held[silent].clear()
    sleeper.tick(mesh.now + 400)
    assert sleeper.halted
    assert not sleeper.take_heartbeat(beat_from(mesh, 2, mesh.now + 400, seq=60), mesh.now + 400, mesh.keys[2])


def test_an_adaptive_detector_steps_every_heartbeat():
    """With min_silence_ms below suspect_by_ms a new sample may lower a threshold, and so a
    deadline: that heartbeat must go through step, after which the driver asks again."""
    mesh = Mesh(4)
    key = mesh.keys[0]
    core = mesh.cores[key]
    core.liveness.detector.min_silence_ms = PERIOD * 2
    mesh.run(500)
    assert not core.take_heartbeat(beat_from(mesh, 1, mesh.now, seq=99), mesh.now, mesh.keys[1])


def _course(take_where_read: bool, scenario) -> tuple:
    mesh = Mesh(16, sparse_ticks=True, take_where_read=take_where_read)
    scenario(mesh)
    events = {k: [(e.kind, e.at_ms, sorted(e.detail.items())) for e in mesh.events[k]] for k in mesh.keys}
    decisions = {k: [(d.value_kind, repr(d.value)) for d in mesh.decisions[k]] for k in mesh.keys}
    return mesh, events, decisions, {k: c.epoch for k, c in mesh.cores.items()}


def _crash(mesh):
    mesh.run(500)
    mesh.down.add(mesh.keys[5])
    mesh.run(1500)


def _pause(pause_ms):
    def scenario(mesh):
        mesh.run(500)
        mesh.paused.add(mesh.keys[3])
        mesh.run(pause_ms)
        mesh.resume(mesh.keys[3], read_lag_ms=60)
        mesh.run(2000)
    return scenario


@pytest.mark.parametrize("scenario", [_crash, _pause(150), _pause(280), _pause(900)],
                         ids=["crash", "pause150", "pause280", "pause900"])
def test_taking_heartbeats_where_read_changes_nothing_the_mesh_does(scenario):
    """A crash (evicted), pauses short of the bound (no eviction; 280 ms: its monitors suspect
    it and it refutes) and one past it (evicted, then halted): the same events at the same
    times, the same decisions and epochs, whether heartbeats are taken where read or stepped."""
    stepped = _course(False, scenario)
    taken = _course(True, scenario)
    assert taken[1:] == stepped[1:]
    # Most heartbeats were taken: only those of a suspect, to a halted node or stale were stepped.
    sent = sum(stepped[0].heartbeats_sent.values())
    assert taken[0].heartbeats_taken >= 0.8 * sent


def _full_decode(data: bytes, mesh_id: bytes, sender: bytes):
    try:
        return decode_message(data, mesh_id, Heartbeat, channel_sender=sender)[1]
    except RemoteProtocolError:
        return None


def test_the_heartbeat_reader_accepts_exactly_what_the_full_decoder_accepts():
    """decode_heartbeat reads a heartbeat's fixed bytes and three integers instead of the
    whole unpack, re-encode and schema check: on every well-formed heartbeat (integers of
    every msgpack width) and on 4,000 seeded mutations of them (a byte changed, cut, added,
    an integer re-encoded longer than needed) it returns what decode_message returns, or
    None where that refuses."""
    rng = random.Random(18)
    mesh_id = hashlib.sha256(b"mesh").digest()
    sender, other = (hashlib.sha256(b"key %d" % i).digest() for i in range(2))
    widths = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]
    beats = [Heartbeat(epoch=rng.choice(widths), seq=rng.choice(widths), sent_ms=rng.choice(widths))
             for _ in range(60)]
    for beat in beats:
        data = encode_unsigned(sender, mesh_id, beat)
        # Put together from its parts, the bytes are the envelope's canonical encoding.
        assert data == seal_unsigned(sender, mesh_id, Heartbeat.KIND, beat.to_body()).encode()
        assert decode_heartbeat(data, mesh_id, sender) == beat == _full_decode(data, mesh_id, sender)
        assert decode_heartbeat(data, mesh_id, other) is None is _full_decode(data, mesh_id, other)
        assert decode_heartbeat(data, bytes(32), sender) is None
    for _ in range(4000):
        data = bytearray(encode_unsigned(sender, mesh_id, rng.choice(beats)))
        mutation = rng.randrange(4)
        at = rng.randrange(len(data))
        if mutation == 0:
            data[at] = rng.randrange(256)
        elif mutation == 1:
            del data[at:at + rng.randint(1, 3)]
        elif mutation == 2:
            data[at:at] = bytes([rng.randrange(256)])
        else:   # a small integer in a longer form than canonical (uint8 for a fixint)
            fixints = [i for i in range(40, len(data) - 36) if data[i] < 0x80 and data[i - 1] in b"hqs"]
            if fixints:
                at = rng.choice(fixints)
                data[at:at + 1] = b"\xcc" + bytes([data[at]])
        data = bytes(data)
        assert decode_heartbeat(data, mesh_id, sender) == _full_decode(data, mesh_id, sender)
