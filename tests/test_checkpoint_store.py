"""Checkpoint store: fencing, bound, integrity, crash safety (SPEC.md 9.5-9.7)."""

import hashlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from meshnode.node.checkpoint_store import AsyncCheckpointStore, CheckpointStore, StoredCheckpoint
from protocol.errors import RemoteProtocolError
from protocol.messages import MAX_STATE_BYTES

JOB = hashlib.sha256(b"job").digest()
OTHER_JOB = hashlib.sha256(b"other job").digest()
NODE = bytes(range(32))


def checkpoint(fence, seq, job=JOB, state=None):
    state = state if state is not None else b"state %d/%d" % (fence, seq)
    return StoredCheckpoint.taken(job, fence, seq, progress=seq * 10, taken_ms=1000 + seq, state=state,
                                  origin=NODE, stored_ms=2000 + seq)


@pytest.fixture
def store(tmp_path):
    store = CheckpointStore(tmp_path / "node.db", keep=4)
    yield store
    store.close()


def test_latest_returns_the_newest_checkpoint(store):
    assert store.latest(JOB) is None
    for seq in (1, 2, 3):
        assert store.put(checkpoint(1, seq))
    assert store.latest(JOB) == checkpoint(1, 3)
    assert store.jobs() == [JOB]


def test_lower_fence_is_refused(store):
    assert store.put(checkpoint(fence=2, seq=5))
    assert not store.put(checkpoint(fence=1, seq=99))  # the evicted node's late checkpoint
    assert store.refused_count == 1
    assert store.latest(JOB).fence == 2


def test_same_fence_needs_a_newer_seq(store):
    assert store.put(checkpoint(1, 5))
    assert not store.put(checkpoint(1, 5))
    assert not store.put(checkpoint(1, 4))
    assert store.put(checkpoint(1, 6))


def test_higher_fence_may_restart_seq(store):
    assert store.put(checkpoint(1, 50))
    assert store.put(checkpoint(2, 1))
    assert store.latest(JOB) == checkpoint(2, 1)


def test_raised_fence_refuses_old_fence_before_any_new_checkpoint(store):
    assert store.put(checkpoint(1, 7))
    assert store.raise_fence(JOB, 2)
    assert not store.put(checkpoint(1, 8))
    assert not store.raise_fence(JOB, 1)
    assert store.latest(JOB) == checkpoint(1, 7)  # the survivor still restores from it


def test_only_the_newest_keep_checkpoints_are_kept(store, tmp_path):
    for seq in range(1, 11):
        store.put(checkpoint(1, seq))
    store.put(checkpoint(1, 1, job=OTHER_JOB))
    with sqlite3.connect(tmp_path / "node.db") as conn:
        seqs = [row[0] for row in conn.execute("SELECT seq FROM checkpoints WHERE job_id = ? ORDER BY seq", (JOB,))]
    assert seqs == [7, 8, 9, 10]
    assert store.latest(OTHER_JOB) == checkpoint(1, 1, job=OTHER_JOB)


def test_dropped_job_keeps_its_fence(store):
    store.put(checkpoint(3, 1))
    store.drop(JOB)
    assert store.latest(JOB) is None and store.jobs() == []
    assert not store.put(checkpoint(2, 9))


def test_corrupted_row_is_skipped_for_the_previous_one(store, tmp_path):
    for seq in (1, 2, 3):
        store.put(checkpoint(1, seq))
    with sqlite3.connect(tmp_path / "node.db") as conn:
        conn.execute("UPDATE checkpoints SET state = ? WHERE seq = 3", (b"bit rot",))
    assert store.latest(JOB) == checkpoint(1, 2)
    assert store.corrupt_skipped_count == 1


def test_a_record_with_a_wrong_hash_is_never_returned(store):
    assert store.put(checkpoint(1, 1))
    wrong = StoredCheckpoint(JOB, 1, 2, 0, 0, b"other", checkpoint(1, 2).state_hash, NODE, 0)
    assert store.put(wrong)  # put trusts the constructors; latest() is the check at rest
    assert store.latest(JOB) == checkpoint(1, 1)


def test_oversized_state_is_refused(store):
    with pytest.raises(RemoteProtocolError):
        store.put(checkpoint(1, 1, state=bytes(MAX_STATE_BYTES + 1)))


def test_message_round_trip(store):
    record = checkpoint(2, 3)
    assert StoredCheckpoint.from_message(record.to_message(), NODE, record.stored_ms) == record


async def test_async_store_runs_off_the_event_loop(store):
    async_store = AsyncCheckpointStore(store)
    assert await async_store.put(checkpoint(1, 1))
    assert not await async_store.put(checkpoint(1, 1))
    assert (await async_store.latest(JOB)).seq == 1
    assert await async_store.jobs() == [JOB]


WRITER = textwrap.dedent("""
    import hashlib, random, sys
    from meshnode.node.checkpoint_store import CheckpointStore, StoredCheckpoint
    path, first_seq = sys.argv[1], int(sys.argv[2])
    store = CheckpointStore(path, keep=8)
    job = hashlib.sha256(b"job").digest()
    rng = random.Random(first_seq)
    seq = first_seq
    while True:
        state = rng.randbytes(rng.randrange(1, 100_000))
        store.put(StoredCheckpoint.taken(job, 1, seq, seq, seq, state, bytes(32), seq))
        print(seq, flush=True)  # printed only after the commit returned
        seq += 1
""")


def test_node_killed_mid_checkpoint_write_leaves_a_database_that_resumes(tmp_path):
    """SIGKILL a writer at seeded random moments; every time the DB opens, checks and resumes."""
    rng = random.Random(20240607)
    path = tmp_path / "node.db"
    next_seq = 1
    for _ in range(3):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(next_seq)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            kill_after = rng.randrange(2, 20)
            for _ in range(kill_after):
                last_committed = int(writer.stdout.readline())
            os.kill(writer.pid, signal.SIGKILL)  # the writer is inside its next put() or about to be
            for line in writer.stdout:  # lines it printed before the kill landed: also committed
                last_committed = int(line)
        finally:
            writer.kill()
            writer.wait(timeout=10)
            writer.stdout.close()
        store = CheckpointStore(path, keep=8)
        try:
            assert store.integrity_ok()
            latest = store.latest(JOB)
            assert latest is not None
            assert last_committed <= latest.seq <= last_committed + 1  # the last commit may be unprinted
            assert hashlib.sha256(latest.state).digest() == latest.state_hash
            next_seq = latest.seq + 1
        finally:
            store.close()
