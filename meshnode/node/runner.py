"""The workload runner: starts workload subprocesses and takes their checkpoints (SPEC.md 9).

One ``WorkloadRunner`` per node, served in the node's trio nursery::

    runner = WorkloadRunner(data_dir, checkpoint_ms, on_checkpoint, on_exit,
                            commands=config_commands, allowed_entrypoints=policy.allowed_entrypoints)
    await nursery.start(runner.serve)
    await runner.start(job_id, "counter", ["--progress-log", path], gpus=[0], restore=None, fence=1)

Every ``checkpoint_ms`` the runner reads the workload's shared-memory state slot
(``meshnode.workload.state_slot``) and, if the workload offered a new state since the last
tick, awaits ``on_checkpoint(job_id, seq, progress, taken_ms, state)``. The read does
not involve the workload's process, so a descheduled or stalled workload delays no
checkpoint: the newest state it offered is taken on time.

The workload's stdout and stderr come to the node through a pipe and are kept in its
working directory as a bounded ring (meshnode/node/output_log.py), which `meshnode job
logs` reads; all of it is in the ring before the exit is reported.

A workload never outlives its node (SPEC.md 9.3). Linux only: the child sets
PR_SET_PDEATHSIG=SIGKILL in a preexec_fn and then checks getppid() against the node's
pid, which closes the race where the node died between fork and prctl. The death signal
fires when the *thread* that forked exits, so ``subprocess.Popen`` is called on the trio
thread itself (which lives as long as the node), never through ``trio.to_thread`` --
trio's own ``open_process`` forks in a cached worker thread that exits after an idle
timeout, which would kill the workload. Fork + exec blocks the loop for a few ms per
start; that is the price. The SDK's EOF check is the second guard.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from keys.errors import ConfigError
from meshnode.node.output_log import OutputLog, job_workdir
from meshnode.workload import sdk
from meshnode.workload.builtin import BUILTIN_KINDS
from meshnode.workload.serve import percentile
from meshnode.workload.state_slot import SlotReader, create_region
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.messages import MAX_STATE_BYTES

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
STATS_WINDOW = 1024       # checkpoint tick intervals kept per workload
MAX_WORKLOADS = 256       # a node runs at most this many at once
OUTPUT_READ_BYTES = 65536  # one read of a workload's output pipe
OUTPUT_DRAIN_READS = 16    # after the exit: what is left in the pipe (a pipe holds 64 KiB)

CheckpointCallback = Callable[[bytes, int, int, int, bytes], Awaitable[None]]
ExitCallback = Callable[[bytes, int], Awaitable[None]]


def _load_prctl():
    if not sys.platform.startswith("linux"):
        raise ConfigError("the workload runner needs Linux (PR_SET_PDEATHSIG); this is %s" % sys.platform)
    return ctypes.CDLL(None, use_errno=True).prctl


# Workloads run at a lower CPU priority than their node. A CPU-hungry workload must not
# starve the node's 50 ms heartbeats and 5 ms ticks: a node that misses the detection
# bound is evicted and fences itself (SPEC.md F2, F7), which would cost the very work the
# workload was doing. nice 10 gives the node about 9x a workload's CPU share under CFS.
WORKLOAD_NICE = 10


def _die_with_parent(prctl, parent_pid: int):
    """preexec_fn: SIGKILL this child when the forking thread dies; close the fork race;
    drop to WORKLOAD_NICE."""
    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent_pid:  # the node died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        os.nice(WORKLOAD_NICE)
    return preexec


@dataclass
class RunningWorkload:
    job_id: bytes
    entrypoint: str
    argv: list[str]
    pid: int
    fence: int
    gpus: tuple[int, ...]
    started_ms: int
    seq: int
    progress: int
    last_taken_ms: int | None = None
    torn_reads: int = 0
    output_lost_bytes: int = 0     # output that could not be written to the ring (disk full)
    # The newest load report (SPEC.md 9.4a): (request_rate_milli, latency_p99_us,
    # progress_rate_milli), and when it came (trio clock, s); None: none yet.
    signals: tuple | None = None
    signals_at: float = 0.0
    reports_refused: str = ""      # why this workload's reports are no longer read ("" = they are)
    interval_error_us: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))

    def summary(self) -> dict:
        return {
            "entrypoint": self.entrypoint, "pid": self.pid, "fence": self.fence, "gpus": list(self.gpus),
            "started_ms": self.started_ms, "seq": self.seq, "progress": self.progress,
            "last_taken_ms": self.last_taken_ms, "torn_reads": self.torn_reads,
            "interval_error_us_p50": percentile(self.interval_error_us, 0.5),
            "interval_error_us_p99": percentile(self.interval_error_us, 0.99),
            "signals": list(self.signals) if self.signals else None, "reports_refused": self.reports_refused,
        }


class _Job:
    """Runner-private bookkeeping for one workload process."""

    def __init__(self, info: RunningWorkload, popen: subprocess.Popen, stream: trio.SocketStream,
                 slot: SlotReader, restore_frame: bytes, output_fd: int, output_log: OutputLog):
        self.info = info
        self.output_fd = output_fd         # read end of the workload's stdout/stderr pipe
        self.output_log = output_log
        self.pump_scope = trio.CancelScope()
        self.reports_scope = trio.CancelScope()   # reading its load reports; cancelled once it is gone
        self.popen = popen
        self.stream = stream
        self.slot = slot
        self.restore_frame = restore_frame
        self.stopping = False
        self.exited = trio.Event()         # set once the process is reaped and the job unlisted
        self.tick_scope = trio.CancelScope()
        self.process_gone = False          # set when the pidfd reports the exit
        self.in_callback = False           # the tick is awaiting on_checkpoint
        self.read_final = False            # stop_for_handover: read the slot once the process is gone
        self.final_offer: tuple | None = None
        self.last_offer: tuple | None = None   # (progress, taken_ms, state) the last tick read


class WorkloadRunner:
    def __init__(self, data_dir, checkpoint_ms: int, on_checkpoint: CheckpointCallback,
                 on_exit: ExitCallback, *, commands: dict[str, list[str]] | None = None,
                 allowed_entrypoints: frozenset[str] | None = None):
        self._prctl = _load_prctl()
        if checkpoint_ms < 1:
            raise ConfigError("checkpoint_ms must be at least 1, got %d" % checkpoint_ms)
        # Absolute: a workload runs in its own working directory, so a path the node was
        # given relative to its own (`meshnode run --node demo-mesh/node-0`) would not resolve.
        self.data_dir = os.path.abspath(os.fspath(data_dir))
        self.checkpoint_ms = checkpoint_ms
        self._on_checkpoint = on_checkpoint
        self._on_exit = on_exit
        self._commands = {name: list(argv) for name, argv in (commands or {}).items()}
        for name, argv in self._commands.items():
            if not argv or not all(isinstance(part, str) for part in argv):
                raise ConfigError("workload command %r must be a non-empty list of strings" % name)
        self._allowed = allowed_entrypoints
        self._jobs: dict[bytes, _Job] = {}
        self._nursery: trio.Nursery | None = None

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; every workload is killed when this returns."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def resolve_argv(self, entrypoint: str, args: list[str]) -> list[str]:
        """The argv for ``entrypoint`` (SPEC.md 9.1), or LocalProtocolError if not allowed here."""
        if self._allowed is not None and entrypoint not in self._allowed:
            raise LocalProtocolError("entrypoint %r is not allowed on this node (allowed: %s)"
                                     % (entrypoint, ", ".join(sorted(self._allowed)) or "none"))
        if entrypoint in self._commands:
            return self._commands[entrypoint] + list(args)
        if entrypoint in BUILTIN_KINDS:
            return [sys.executable, "-m", "meshnode.workload.builtin", entrypoint, *args]
        raise LocalProtocolError("entrypoint %r is neither a built-in kind (%s) nor a command in this "
                                 "node's config" % (entrypoint, ", ".join(BUILTIN_KINDS)))

    async def start(self, job_id: bytes, entrypoint: str, args: list[str], gpus: list[int],
                    restore: tuple[bytes, int, int] | None, fence: int, extra_env: dict | None = None) -> int:
        """Start a workload; ``restore`` is (state, progress, seq) of the checkpoint to resume;
        ``extra_env``: variables added to its environment (a gang's rank, SPEC.md GA5)."""
        if self._nursery is None:
            raise LocalProtocolError("WorkloadRunner.start before serve() is running")
        if job_id in self._jobs:
            raise LocalProtocolError("job %s is already running here" % job_id.hex())
        if len(self._jobs) >= MAX_WORKLOADS:
            raise LocalProtocolError("this node already runs %d workloads" % MAX_WORKLOADS)
        argv = self.resolve_argv(entrypoint, args)
        state, progress, seq = restore if restore is not None else (b"", 0, 0)
        if len(state) > MAX_STATE_BYTES:
            raise LocalProtocolError("restore state is %d bytes, over %d" % (len(state), MAX_STATE_BYTES))
        workdir = self.workdir(job_id)
        os.makedirs(workdir, exist_ok=True)
        node_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        output_read, output_write = os.pipe()
        os.set_blocking(output_read, False)
        slot_fd = slot = popen = None
        try:
            slot_fd = create_region()
            slot = SlotReader(slot_fd)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(g) for g in gpus),
                       **{sdk.SDK_FD_ENV: str(child_end.fileno()), sdk.SLOT_FD_ENV: str(slot_fd),
                          sdk.WORKDIR_ENV: workdir}, **(extra_env or {}))
            popen = subprocess.Popen(
                argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=output_write,
                stderr=subprocess.STDOUT, pass_fds=(child_end.fileno(), slot_fd), start_new_session=True,
                preexec_fn=_die_with_parent(self._prctl, os.getpid()))
        except OSError as exc:
            raise LocalProtocolError("cannot start %r: %s" % (argv[0], exc.strerror)) from None
        finally:
            child_end.close()
            os.close(output_write)   # the child holds its copy: EOF once it and its group are gone
            if popen is None:
                os.close(output_read)
            if slot_fd is not None:
                os.close(slot_fd)  # the mapping (ours) and the child's copy keep the memory alive
            if popen is None:  # not started (OSError, or e.g. a failing preexec_fn): nothing may leak
                node_end.close()
                if slot is not None:
                    slot.close()
        restore_fields = sdk.RESTORE_FIELDS.pack(int(restore is not None), fence, seq, progress, self.checkpoint_ms)
        info = RunningWorkload(job_id=job_id, entrypoint=entrypoint, argv=argv, pid=popen.pid, fence=fence,
                               gpus=tuple(gpus), started_ms=time.time_ns() // 1_000_000, seq=seq,
                               progress=progress)
        job = _Job(info, popen, trio.SocketStream(trio.socket.from_stdlib_socket(node_end)), slot,
                   sdk.encode_frame(sdk.RESTORE, restore_fields, state), output_read, OutputLog(workdir))
        self._jobs[job_id] = job
        self._nursery.start_soon(self._supervise, job)
        return popen.pid

    async def stop(self, job_id: bytes) -> int | None:
        """SIGKILL the workload's process group and wait for it; its exit code (None if unknown job).

        A stopped workload gets no on_exit call (the caller asked for it) and no
        on_checkpoint call after stop() returns. stop() may be awaited from inside this
        job's own on_checkpoint (a node that finds itself fenced does that).
        """
        job = self._jobs.get(job_id)
        if job is None:
            return None
        job.stopping = True
        _kill_group(job.popen)
        await job.exited.wait()
        return job.popen.returncode

    def freeze(self, job_id: bytes) -> bool:
        """SIGSTOP the workload's process group (SPEC.md F3b): it keeps its process and its
        memory but does no work and offers no new state until ``thaw``; ``stop`` still kills
        it. False if the job does not run here."""
        return self._signal_group(job_id, signal.SIGSTOP)

    def thaw(self, job_id: bytes) -> bool:
        """SIGCONT what ``freeze`` stopped: the same process goes on. False if it is gone."""
        return self._signal_group(job_id, signal.SIGCONT)

    def _signal_group(self, job_id: bytes, signum: int) -> bool:
        job = self._jobs.get(job_id)
        if job is None or job.stopping or job.process_gone or job.popen.returncode is not None:
            return False
        try:
            os.killpg(job.popen.pid, signum)
        except ProcessLookupError:
            return False
        return True

    async def stop_for_handover(self, job_id: bytes) -> tuple | None:
        """``stop``, and the newest state the workload offered, read once its process is gone
        (so it can offer nothing later) as the checkpoint after the last one read: (seq,
        progress, taken_ms, state), or None if it offered none. A move hands it to the job's
        new primary (SPEC.md R2). Like ``stop``, it waits for nothing but the process, so it
        may be awaited while the job's own checkpoint callback is waiting for this node's core."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        job.read_final = True
        await self.stop(job_id)
        return job.final_offer

    def workdir(self, job_id: bytes) -> str:
        """The job's working directory (absolute; manifests name it as ``{workdir}``)."""
        return job_workdir(self.data_dir, job_id)

    def running(self) -> dict[bytes, dict]:
        return {job_id: job.info.summary() for job_id, job in self._jobs.items()}

    def jobs_info(self) -> list[RunningWorkload]:
        return [job.info for job in self._jobs.values()]

    async def _supervise(self, job: _Job) -> None:
        try:
            pidfd = os.pidfd_open(job.popen.pid)
        except OSError:
            pidfd = None  # out of descriptors: the workload cannot be watched, so it is killed
        try:
            if pidfd is not None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._tick, job)
                    nursery.start_soon(self._pump_output, job)
                    nursery.start_soon(self._read_reports, job)
                    await trio.lowlevel.wait_readable(pidfd)
                    job.process_gone = True
                    # A tick inside on_checkpoint is not cancelled: the callback may itself be
                    # in stop(), which the reap below lets return; the tick ends after it.
                    if not job.in_callback:
                        job.tick_scope.cancel()
                    self._reap(job)
                    job.pump_scope.cancel()   # what is left in the pipe is drained below
                    job.reports_scope.cancel()
                # What the workload offered after the last tick, e.g. just before it failed:
                # a retry resumes from it.
                await self._take_checkpoint(job)
        finally:
            if pidfd is not None:
                os.close(pidfd)
            self._reap(job)          # on runner shutdown: kills the workload here
            self._drain_output(job)  # before the exit is reported: a reader sees all of it
            job.stream.socket.close()
            job.slot.close()
        if not job.stopping:
            await self._on_exit(job.info.job_id, job.popen.returncode)

    def fresh_signals(self, max_age_s: float) -> dict[bytes, tuple]:
        """job id -> its newest load report, for the workloads that sent one in the last
        ``max_age_s`` (trio clock): a report that went stale is no longer the job's load."""
        now = trio.current_time()
        return {job_id: job.info.signals for job_id, job in self._jobs.items()
                if job.info.signals is not None and now - job.info.signals_at <= max_age_s}

    async def _read_reports(self, job: _Job) -> None:
        """Read the workload's SIGNALS frames (SPEC.md 9.4a) until it goes; keep the newest.
        A malformed frame ends its reports (what it sends later is read and dropped), not
        the workload."""
        with job.reports_scope:
            await self._read_report_frames(job)

    async def _read_report_frames(self, job: _Job) -> None:
        buffer = b""
        while True:
            try:
                data = await job.stream.receive_some(4096)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            if job.info.reports_refused:
                continue   # read and dropped: a workload blocked on a full socket would stall
            buffer += data
            while len(buffer) >= sdk.FRAME_HEADER.size:
                length, frame_type = sdk.FRAME_HEADER.unpack_from(buffer)
                if frame_type != sdk.SIGNALS or length != 1 + sdk.SIGNALS_FIELDS.size:
                    self._refuse_reports(job, "frame type %d of length %d is not a SIGNALS frame"
                                         % (frame_type, length))
                    break
                if len(buffer) < 4 + length:
                    break
                job.info.signals = sdk.decode_signals(buffer[sdk.FRAME_HEADER.size:4 + length])
                job.info.signals_at = trio.current_time()
                buffer = buffer[4 + length:]

    @staticmethod
    def _refuse_reports(job: _Job, why: str) -> None:
        job.info.reports_refused, job.info.signals = why, None
        log.warning("job %s: its load reports are ignored from now on: %s", job.info.job_id.hex()[:12], why)

    async def _pump_output(self, job: _Job) -> None:
        """Copy the workload's output into its ring as it comes. The node reads at most
        OUTPUT_READ_BYTES per wake-up; a workload that writes faster waits on its pipe."""
        with job.pump_scope:
            while True:
                await trio.lowlevel.wait_readable(job.output_fd)
                if not self._read_output_once(job):
                    return

    def _read_output_once(self, job: _Job) -> bool:
        """One read of the pipe into the ring; False at EOF (or when nothing is waiting)."""
        try:
            data = os.read(job.output_fd, OUTPUT_READ_BYTES)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        try:
            job.output_log.append(data)
        except OSError as exc:   # a full disk loses output, never the node
            job.info.output_lost_bytes += len(data)
            if job.info.output_lost_bytes == len(data):
                log.warning("job %s: output not kept: %s", job.info.job_id.hex()[:12], exc)
        return True

    def _drain_output(self, job: _Job) -> None:
        """After the process group is gone: the rest of the pipe, without waiting (a
        descendant that left the group may hold it open), then close it."""
        if job.output_fd < 0:
            return
        for _ in range(OUTPUT_DRAIN_READS):
            try:
                data = os.read(job.output_fd, OUTPUT_READ_BYTES)
            except OSError:
                break
            if not data:
                break
            try:
                job.output_log.append(data)
            except OSError:
                job.info.output_lost_bytes += len(data)
        os.close(job.output_fd)
        job.output_fd = -1
        job.output_log.close()

    def _reap(self, job: _Job) -> None:
        _kill_group(job.popen)   # its children too
        job.popen.wait()         # exited or SIGKILLed: returns at once
        if job.read_final and not job.exited.is_set():
            job.final_offer = self._read_final_offer(job)
        # Reaped twice (on exit, then in _supervise's finally); by the second time a new run
        # of the same job may hold the entry (stop then run in one batch): leave that one.
        if self._jobs.get(job.info.job_id) is job:
            del self._jobs[job.info.job_id]
        job.exited.set()

    async def _tick(self, job: _Job) -> None:
        with job.tick_scope:
            await self._tick_until_gone(job)

    async def _tick_until_gone(self, job: _Job) -> None:
        """Read the state slot every checkpoint_ms on absolute deadlines (no drift)."""
        try:
            await job.stream.send_all(job.restore_frame)
        except trio.BrokenResourceError:
            return  # the workload died at once; _supervise sees the exit
        job.restore_frame = b""
        period_s = self.checkpoint_ms / 1000
        next_tick = trio.current_time() + period_s
        last_tick = None
        while not job.process_gone:
            await trio.sleep_until(next_tick)
            now = trio.current_time()
            if last_tick is not None:
                job.info.interval_error_us.append(round((now - last_tick - period_s) * 1e6))
            last_tick = now
            next_tick += period_s
            if next_tick < now:  # the loop was blocked past whole periods: resume the grid, don't burst
                next_tick = now + period_s - (now - next_tick) % period_s
            await self._take_checkpoint(job)

    @staticmethod
    def _read_final_offer(job: _Job) -> tuple | None:
        """The newest state the (dead) workload offered, as the checkpoint after the last one
        read: (seq, progress, taken_ms, state), or None if it offered none. With nothing new
        in the slot it is the state the last tick read: that tick's checkpoint may never have
        been taken (the core refuses one of a job that was just moved away)."""
        try:
            offered = job.slot.read() or job.last_offer
        except RemoteProtocolError:
            offered = job.last_offer   # a slot broken by the workload: the last good state stands
        if offered is None:
            return None
        progress, taken_ms, state = offered
        job.info.seq += 1
        job.info.progress, job.info.last_taken_ms = progress, taken_ms
        return job.info.seq, progress, taken_ms, state

    async def _take_checkpoint(self, job: _Job) -> None:
        if job.stopping:
            return  # after stop() no callback may report this job again
        try:
            offered = job.slot.read()
        except RemoteProtocolError:
            _kill_group(job.popen)  # a workload that breaks the slot's rules is killed; _supervise reports it
            return
        job.info.torn_reads = job.slot.torn_reads
        if offered is None:
            return
        progress, taken_ms, state = offered
        job.last_offer = offered
        job.info.seq += 1
        job.info.progress = progress
        job.info.last_taken_ms = taken_ms
        job.in_callback = True
        try:
            await self._on_checkpoint(job.info.job_id, job.info.seq, progress, taken_ms, state)
        finally:
            job.in_callback = False


def _kill_group(popen: subprocess.Popen) -> None:
    if popen.returncode is not None:
        return
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already gone
