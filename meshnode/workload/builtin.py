"""Built-in workload kinds, started as ``python -m meshnode.workload.builtin KIND ARGS``.

``counter``: counts work units of ``--unit-ms`` milliseconds of busy arithmetic each.
State is the unit count (and the arithmetic's accumulator); after a restore it goes on
from the restored count. With ``--progress-log PATH`` it appends one line per unit,
``<unit> <wall_us>``, written unbuffered with O_APPEND so the line survives a SIGKILL:
the failover benchmark reads this file, independently of the checkpoint path, to
measure lost work (units logged after the restored count were done twice).

``train``: a deterministic CPU training loop, logistic regression by full-batch
gradient descent over a seeded synthetic data set, in pure Python. State is the
weights, the step and the loss history (bounded), so it grows as training goes on;
a restored run reaches bit-identical weights to an uninterrupted one. With
``--log-every N`` it prints ``step <step> loss <loss>`` to stdout every N steps, which
is what `meshnode job logs` shows.

``allreduce``: a gang's collective (SPEC.md GA5): every step each rank makes a vector of
``--dim`` integers from its rank and the step, and the ranks sum them by a ring all-reduce
(reduce-scatter, then all-gather) over TCP between their peers' addresses; each checks
the sum against its closed form. State is the step; a restored gang first agrees on the
smallest step any rank restored (a ring pass of the minimum, ``Ring.consistent_step``), so
all go on from one step; when the ring breaks the survivors pause (their processes stay)
until the node publishes the replaced rank's address or the shrunk gang (GA7, GA8), and
log ``rank R paused at step S`` and ``rank R of W resumed at step S (held H)``: H - S steps
of a survivor's work were redone. A rank that holds no state (one a grow added, GA9)
joins at the step the others agree on, and so does one restored more than
``MAX_ROLLBACK_STEPS`` behind the newest step a rank holds (GA11: the others refuse to go
back that far; it logs why). ``Ring.barrier`` waits for every rank.
Progress lines as ``counter``'s, and ``step <step> sum <sum>`` every ``--log-every`` steps.

``serve``: a small HTTP/1.1 service on 127.0.0.1 that reports its request rate and p99
latency to its node (meshnode/workload/serve.py).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import socket
import struct
import sys
import time
from array import array

from meshnode.workload.sdk import GangInfo, Workload
from meshnode.workload.serve import SERVICE_PORT_ENV, run_serve, service_host, service_port
from protocol.errors import RemoteProtocolError

BUILTIN_KINDS = ("counter", "train", "allreduce", "serve")
LOSS_HISTORY_MAX = 8192  # entries kept in the train state: 64 KiB, far under MAX_STATE_BYTES

COUNTER_STATE = struct.Struct(">QQ")  # units done, accumulator
TRAIN_HEADER = struct.Struct(">4sQII")  # magic, step, n_features, n_losses
TRAIN_MAGIC = b"TRN1"


class ProgressLog:
    """Append-only ``<unit> <wall_us>`` lines; one write(2) per line so a kill never tears one."""

    def __init__(self, path: str | None):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None

    def unit_done(self, unit: int) -> None:
        if self._fd is not None:
            os.write(self._fd, b"%d %d\n" % (unit, time.time_ns() // 1000))


# --- counter ---------------------------------------------------------------------------------

def decode_counter_state(state: bytes) -> tuple[int, int]:
    if len(state) != COUNTER_STATE.size:
        raise RemoteProtocolError("counter state is %d bytes, expected %d" % (len(state), COUNTER_STATE.size))
    return COUNTER_STATE.unpack(state)


def run_counter(workload: Workload, unit_ms: int, units: int | None, log: ProgressLog) -> None:
    count, accumulator = (0, 1) if workload.restored_state is None else decode_counter_state(workload.restored_state)
    unit_ns = unit_ms * 1_000_000
    while units is None or count < units:
        deadline = time.perf_counter_ns() + unit_ns
        while time.perf_counter_ns() < deadline:  # the "work": an LCG, so the state is real
            for _ in range(64):
                accumulator = (accumulator * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        count += 1
        log.unit_done(count)
        workload.set_state(COUNTER_STATE.pack(count, accumulator), count)


# --- train -----------------------------------------------------------------------------------

class TrainingRun:
    """Logistic regression on a synthetic, seeded data set (features in [-1, 1])."""

    def __init__(self, features: int, samples: int, seed: int, learning_rate: float):
        rng = random.Random(seed)
        true_weights = [rng.uniform(-2, 2) for _ in range(features)]
        self.inputs = [[rng.uniform(-1, 1) for _ in range(features)] for _ in range(samples)]
        self.labels = [1.0 if sum(w * x for w, x in zip(true_weights, row)) > 0 else 0.0 for row in self.inputs]
        self.learning_rate = learning_rate
        self.weights = array("d", [0.0] * features)
        self.step = 0
        self.losses = array("d")

    def train_step(self) -> float:
        gradient = [0.0] * len(self.weights)
        loss = 0.0
        for row, label in zip(self.inputs, self.labels):
            z = sum(w * x for w, x in zip(self.weights, row))
            p = 1.0 / (1.0 + math.exp(-z))
            loss -= label * math.log(p + 1e-12) + (1 - label) * math.log(1 - p + 1e-12)
            error = p - label
            for i, x in enumerate(row):
                gradient[i] += error * x
        scale = self.learning_rate / len(self.inputs)
        for i, g in enumerate(gradient):
            self.weights[i] -= scale * g
        self.step += 1
        loss /= len(self.inputs)
        self.losses.append(loss)
        if len(self.losses) > LOSS_HISTORY_MAX:
            del self.losses[0]
        return loss

    def encode_state(self) -> bytes:
        return (TRAIN_HEADER.pack(TRAIN_MAGIC, self.step, len(self.weights), len(self.losses))
                + self.weights.tobytes() + self.losses.tobytes())

    def restore_state(self, state: bytes) -> None:
        if len(state) < TRAIN_HEADER.size:
            raise RemoteProtocolError("train state is too short")
        magic, step, n_features, n_losses = TRAIN_HEADER.unpack_from(state)
        expected = TRAIN_HEADER.size + 8 * (n_features + n_losses)
        if magic != TRAIN_MAGIC or n_features != len(self.weights) or len(state) != expected:
            raise RemoteProtocolError("train state does not match this run (magic, features or length)")
        body = memoryview(state)[TRAIN_HEADER.size:]
        self.weights = array("d", body[:8 * n_features].tobytes())
        self.losses = array("d", body[8 * n_features:].tobytes())
        self.step = step


def run_train(workload: Workload, run: TrainingRun, steps: int | None, log: ProgressLog,
              log_every: int = 0) -> None:
    if workload.restored_state is not None:
        run.restore_state(workload.restored_state)
        if log_every:
            print("resumed at step %d" % run.step, flush=True)
    while steps is None or run.step < steps:
        loss = run.train_step()
        if log_every and run.step % log_every == 0:
            print("step %d loss %.6f" % (run.step, loss), flush=True)
        log.unit_done(run.step)
        workload.set_state(run.encode_state(), run.step)


# --- allreduce (a gang's ring) ------------------------------------------------------------------

ALLREDUCE_STATE = struct.Struct(">Q")   # steps done
MAX_DIM = 4096                          # a step's vector fits the sockets' buffers: no send blocks a ring
RING_TIMEOUT_S = 30.0                   # how long a rank waits for its neighbours (they start at other moments)
RING_POLL_S = 0.05                      # while building a ring: between dials and reads of the peers file
EXIT_SUM_WRONG = 3
EXIT_RING_BROKEN = 4                    # a neighbour went away or never came


def local_vector(rank: int, step: int, dim: int) -> list[int]:
    return [(rank + 1) * (step + 1) + i for i in range(dim)]


def expected_sum(world: int, step: int, dim: int) -> list[int]:
    """The sum of every rank's local_vector: what the all-reduce must give."""
    return [(step + 1) * world * (world + 1) // 2 + world * i for i in range(dim)]


def peers_digest(peers: tuple) -> bytes:
    """What a rank sends first on its link to the next: the first 8 bytes of SHA-256 of its
    peers as ``host:port,...``. A ring forms only among ranks that built it from one list
    (after a shrink a stale list would sum over the wrong world size)."""
    return hashlib.sha256(",".join("%s:%d" % peer for peer in peers).encode("ascii")).digest()[:8]


def dial(address: tuple, digest: bytes):
    """A link to ``address`` that has been sent ``digest``, or None (nobody listening yet)."""
    try:
        link = socket.create_connection(address, timeout=RING_POLL_S * 10)
        link.sendall(digest)
    except OSError:
        return None
    link.settimeout(RING_POLL_S)
    return link


def hear(link, heard: bytes, digest: bytes):
    """(link, what it said so far) after one poll's read: (None, b"") when it closed or said
    something other than ``digest`` (the other end built from other peers)."""
    try:
        chunk = link.recv(len(digest) - len(heard))
    except TimeoutError:
        return link, heard
    except OSError:
        chunk = b""
    heard += chunk
    if not chunk or not digest.startswith(heard):
        link.close()
        return None, b""
    return link, heard


class PeersChanged(Exception):
    """The node published new peers while this rank was building its ring (GA5): build it
    again with them. Waiting on the old ones would wait for a rank that moved on."""

    def __init__(self, peers: tuple):
        super().__init__("the node published new peers")
        self.peers = peers


NO_STEP = (1 << 63) - 1   # offered to the consistent step by a rank that holds no state (GA9)
# SPEC.md GA11: a restored step further behind the newest step a rank holds is no consistent
# gang checkpoint (a lost run's replicated one is a checkpoint period or so behind, ~12 steps
# at the bench's 5 ms): the ring refuses to go back to it, and that rank takes the gang's step.
MAX_ROLLBACK_STEPS = 256


class Ring:
    """TCP to the next rank, from the previous one; integers as 8-byte big-endian words.

    Building it polls the node's peers file: a rank that moved twice in quick succession
    (its first new node died too) is published again, and a rank still dialling the first
    new address would otherwise block for ``timeout_s`` (SPEC.md GA5)."""

    def __init__(self, gang: GangInfo, timeout_s: float = RING_TIMEOUT_S):
        self.rank, self.world = gang.rank, gang.world_size
        self.to_next = self.from_prev = None
        if self.world == 1:
            return
        listener = socket.create_server(("", gang.peers[gang.rank][1]), reuse_port=False)
        listener.settimeout(RING_POLL_S)   # accept() waits one poll: the loop also dials and reads the peers
        # Each link is checked both ways: the dialler sends its peers' digest, the listener
        # echoes it when it is its own. A link the other end dropped (its build restarted,
        # or it built from other peers) is seen at once and dialled or accepted again.
        digest = peers_digest(gang.peers)
        next_address = gang.peers[(gang.rank + 1) % self.world]
        next_heard = prev_heard = b""
        deadline = time.monotonic() + timeout_s
        try:
            while next_heard != digest or prev_heard != digest:
                if self.to_next is None:
                    self.to_next = dial(next_address, digest)
                elif next_heard != digest:
                    self.to_next, next_heard = hear(self.to_next, next_heard, digest)
                if self.from_prev is None:
                    try:
                        self.from_prev = listener.accept()[0]
                        self.from_prev.settimeout(RING_POLL_S)
                    except TimeoutError:
                        pass
                elif prev_heard != digest:
                    self.from_prev, prev_heard = hear(self.from_prev, prev_heard, digest)
                    if prev_heard == digest:
                        self.from_prev.sendall(digest)
                if next_heard == digest and prev_heard == digest:
                    break
                published = gang.published_peers()
                if published is not None:
                    raise PeersChanged(published)
                if time.monotonic() > deadline:
                    raise TimeoutError("rank %d: %s" % (self.rank, "the next rank never answered" if next_heard != digest
                                                        else "the previous rank never connected"))
                if self.from_prev is not None and self.to_next is None:
                    time.sleep(RING_POLL_S)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self.to_next.settimeout(timeout_s)
        self.from_prev.settimeout(timeout_s)

    def _send(self, values: list[int]) -> None:
        self.to_next.sendall(struct.pack(">%dq" % len(values), *values))

    def _recv(self, count: int) -> list[int]:
        data = b""
        while len(data) < 8 * count:
            chunk = self.from_prev.recv(8 * count - len(data))
            if not chunk:
                raise ConnectionError("rank %d: the previous rank went away" % self.rank)
            data += chunk
        return list(struct.unpack(">%dq" % count, data))

    def close(self) -> None:
        for sock in (self.to_next, self.from_prev):
            if sock is not None:
                sock.close()

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of all ranks, at every rank (n - 1 hops around the ring)."""
        for _ in range(self.world - 1):
            self._send([value])
            value = min(value, self._recv(1)[0])
        return value

    def barrier(self) -> None:
        """Returns once every rank has called it: after n - 1 hops each rank has heard,
        through its predecessors, from every other."""
        self.agree_min(0)

    def consistent_step(self, newest_checkpointed: int | None) -> tuple[int, int]:
        """(the gang's consistent checkpoint, the newest step any rank holds), at every rank.
        The consistent checkpoint is the highest step every rank has checkpointed, given this
        rank's newest (the smallest of the ranks' newest). A rank that holds no state yet
        (None: a rank a grow added, GA9) takes the others' step, rather than taking the whole
        gang back to step 0; if none holds one, 0. So does a rank whose step is more than
        MAX_ROLLBACK_STEPS behind the newest (GA11): the others refuse to go back to it."""
        newest = -self.agree_min(-1 if newest_checkpointed is None else -newest_checkpointed)
        too_old = newest_checkpointed is None or newest_checkpointed < newest - MAX_ROLLBACK_STEPS
        held = self.agree_min(NO_STEP if too_old else newest_checkpointed)
        return (0 if held == NO_STEP else held), newest

    def allreduce(self, vector: list[int]) -> list[int]:
        """Ring all-reduce (sum): reduce-scatter, then all-gather, n - 1 steps each."""
        n, total = self.world, list(vector)
        if n == 1:
            return total
        bounds = [len(total) * i // n for i in range(n + 1)]
        chunk = lambda c: slice(bounds[c % n], bounds[c % n + 1])   # noqa: E731 (one line reads better)
        for s in range(n - 1):
            self._send(total[chunk(self.rank - s)])
            got = self._recv(len(total[chunk(self.rank - s - 1)]))
            part = chunk(self.rank - s - 1)
            total[part] = [a + b for a, b in zip(total[part], got)]
        for s in range(n - 1):
            self._send(total[chunk(self.rank - s + 1)])
            part = chunk(self.rank - s)
            total[part] = self._recv(len(total[part]))
        return total


def run_allreduce(workload: Workload, gang: GangInfo, dim: int, steps: int | None, unit_ms: int, log: ProgressLog,
                  log_every: int = 0, ring: Ring | None = None, timeout_s: float = RING_TIMEOUT_S) -> int:
    """Returns the exit status: 0 after ``steps``, EXIT_SUM_WRONG if a sum is wrong,
    EXIT_RING_BROKEN if the ring broke and no new peers came within ``timeout_s``."""
    return AllreduceRun(workload, gang, dim, unit_ms, log, log_every, timeout_s).run(steps, ring)


class AllreduceRun:
    """One rank's run. When the ring breaks (a neighbour's node died), the rank closes its
    own links (so every rank learns at once), keeps its process and its step, and waits for
    its node to publish the gang's new peers (the failed rank moved to a backup, GA5); then
    the ring is rebuilt and every rank goes on from the smallest step any rank holds."""

    def __init__(self, workload: Workload, gang: GangInfo, dim: int, unit_ms: int, log: ProgressLog,
                 log_every: int, timeout_s: float):
        self.workload, self.gang, self.dim, self.unit_ms = workload, gang, dim, unit_ms
        self.log, self.log_every, self.timeout_s = log, log_every, timeout_s
        self.step = 0 if workload.restored_state is None else ALLREDUCE_STATE.unpack(workload.restored_state)[0]
        self.holds_state = workload.restored_state is not None   # restored, or stepped since
        self.rebuilds = 0

    def run(self, steps: int | None, ring: Ring | None = None) -> int:
        waiting_since = time.monotonic()
        while True:
            try:
                ring = ring or Ring(self.gang, max(0.0, waiting_since + self.timeout_s - time.monotonic()))
                try:
                    return self._steps(ring, steps)
                finally:
                    ring.close()
            except PeersChanged as change:
                ring = None
                if not self._adopt(change.peers):
                    return EXIT_RING_BROKEN
                waiting_since = time.monotonic()
            except OSError as exc:   # ConnectionError and timeouts included
                ring = None
                print("rank %d paused at step %d: the ring broke: %s" % (self.gang.rank, self.step, exc), flush=True)
                # Rebuild with the newest published peers, the same ones included: a rank
                # started with the newest peers waits for the others to rebuild with them.
                if not self.gang.peers_file or time.monotonic() > waiting_since + self.timeout_s:
                    return EXIT_RING_BROKEN
                published = self.gang.published_peers()
                if published is not None:
                    if not self._adopt(published):
                        return EXIT_RING_BROKEN
                    waiting_since = time.monotonic()
                else:
                    time.sleep(RING_POLL_S)

    def _adopt(self, peers: tuple) -> bool:
        """Go on with the gang's new peers; False when this rank is not among them (a shrink
        left it out: its node stops it)."""
        moved = self.gang.with_peers(peers)
        if moved is None:
            return False
        self.gang, self.rebuilds = moved, self.rebuilds + 1
        print("rank %d of %d: rebuilding the ring with new peers" % (self.gang.rank, self.gang.world_size), flush=True)
        return True

    def _steps(self, ring: Ring, steps: int | None) -> int:
        # Every rank's state is its step, checkpointed each step: the consistent gang
        # checkpoint is the smallest, and ranks that held more roll back to it (recompute).
        restored = self.step
        self.step, newest = ring.consistent_step(restored if self.holds_state else None)
        if self.holds_state and restored < newest - MAX_ROLLBACK_STEPS:
            print("rank %d: its step %d is %d steps behind the gang's newest %d (more than %d): the gang does not"
                  " go back to it" % (self.gang.rank, restored, newest - restored, newest, MAX_ROLLBACK_STEPS),
                  flush=True)
        if restored or self.step:
            print("rank %d of %d resumed at step %d (held %d)" % (self.gang.rank, self.gang.world_size, self.step,
                                                                 restored), flush=True)
        while steps is None or self.step < steps:
            total = ring.allreduce(local_vector(self.gang.rank, self.step, self.dim))
            if total != expected_sum(self.gang.world_size, self.step, self.dim):
                print("rank %d step %d: wrong sum" % (self.gang.rank, self.step), flush=True)
                return EXIT_SUM_WRONG
            self.step += 1
            self.holds_state = True
            self.log.unit_done(self.step)
            self.workload.set_state(ALLREDUCE_STATE.pack(self.step), self.step)
            if self.log_every and self.step % self.log_every == 0:
                print("step %d sum %d" % (self.step, sum(total)), flush=True)
            if self.unit_ms:
                time.sleep(self.unit_ms / 1000)
        return 0


# --- entry point -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshnode.workload.builtin")
    kinds = parser.add_subparsers(dest="kind", required=True)
    counter = kinds.add_parser("counter", help="count units of busy work")
    counter.add_argument("--unit-ms", type=int, default=1)
    counter.add_argument("--units", type=int, default=None, help="stop after this many units (default: never)")
    counter.add_argument("--progress-log", default=None)
    train = kinds.add_parser("train", help="logistic regression in pure Python")
    train.add_argument("--features", type=int, default=16)
    train.add_argument("--samples", type=int, default=128)
    train.add_argument("--seed", type=int, default=1)
    train.add_argument("--learning-rate-milli", type=int, default=500)
    train.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: never)")
    train.add_argument("--progress-log", default=None)
    train.add_argument("--log-every", type=int, default=0, metavar="N",
                       help="print the step and loss to stdout every N steps (default: never)")
    allreduce = kinds.add_parser("allreduce", help="a gang's ring all-reduce over TCP between its ranks")
    allreduce.add_argument("--dim", type=int, default=64, help="integers per vector (1..%d)" % MAX_DIM)
    allreduce.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: never)")
    allreduce.add_argument("--unit-ms", type=int, default=10, help="pause between steps (default: 10)")
    allreduce.add_argument("--progress-log", default=None)
    allreduce.add_argument("--log-every", type=int, default=0, metavar="N",
                           help="print the step and the sum to stdout every N steps (default: never)")
    serve = kinds.add_parser("serve", help="an HTTP/1.1 service ($MESHNODE_SERVICE_HOST, else 127.0.0.1) that reports its load (SPEC.md 9.4a)")
    serve.add_argument("--port", type=int, default=0,
                       help="port when $%s is not set (default 0: any free port)" % SERVICE_PORT_ENV)
    serve.add_argument("--service-ms", type=float, default=0.0, help="each request waits this long (I/O-bound cost)")
    serve.add_argument("--cpu-ms", type=float, default=0.0, help="each request computes this long (CPU-bound cost)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workload = Workload.connect()
    if args.kind == "serve":   # its progress is requests served: no progress log
        return run_serve(workload, service_port(args.port), max(0.0, args.service_ms), max(0.0, args.cpu_ms),
                         service_host())
    log = ProgressLog(args.progress_log)
    if args.kind == "counter":
        run_counter(workload, max(1, args.unit_ms), args.units, log)
    elif args.kind == "allreduce":
        gang = workload.gang or GangInfo("", 0, 1, (("127.0.0.1", 0),))   # not a gang: a ring of one
        return run_allreduce(workload, gang, min(max(1, args.dim), MAX_DIM), args.steps, max(0, args.unit_ms), log,
                             max(0, args.log_every))
    else:
        run = TrainingRun(args.features, args.samples, args.seed, args.learning_rate_milli / 1000)
        run_train(workload, run, args.steps, log, max(0, args.log_every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
