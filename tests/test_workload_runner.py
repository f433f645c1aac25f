"""Workload runner and SDK with real subprocesses (SPEC.md 9.1-9.4), plus the train kind.

These are the few real multi-process tests of this area: each waits on events from the
workload (checkpoints, exits) under a bounded trio.fail_after, never on fixed sleeps.
"""

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest
import trio
import trio.testing

from meshnode.node.runner import WORKLOAD_NICE, WorkloadRunner
from meshnode.workload.builtin import COUNTER_STATE, TrainingRun, decode_counter_state
from protocol.errors import LocalProtocolError

JOB = bytes(32)
WAIT_S = 20  # bound for any one wait on a subprocess; a loaded 2-core CI box needs slack


class Recorder:
    """Collects the runner's callbacks into bounded channels the test can await."""

    def __init__(self):
        self.checkpoints_send, self.checkpoints = trio.open_memory_channel(1000)
        self.exits_send, self.exits = trio.open_memory_channel(10)

    async def on_checkpoint(self, job_id, seq, progress, taken_ms, state):
        self.checkpoints_send.send_nowait((job_id, seq, progress, taken_ms, state))

    async def on_exit(self, job_id, exit_code):
        self.exits_send.send_nowait((job_id, exit_code))


async def open_runner(nursery, tmp_path, **options):
    recorder = Recorder()
    runner = WorkloadRunner(tmp_path, 20, recorder.on_checkpoint, recorder.on_exit, **options)
    await nursery.start(runner.serve)
    return runner, recorder


def process_state(pid):
    """The state letter of /proc/PID/stat (R, S, T stopped, Z zombie), or None once reaped."""
    try:
        with open("/proc/%d/stat" % pid) as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def process_gone(pid):
    return process_state(pid) in ("Z", None)  # a zombie has stopped running


async def test_counter_checkpoints_progress_and_stop_kills_it(tmp_path):
    log_path = tmp_path / "progress.log"
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path)
        pid = await runner.start(JOB, "counter", ["--progress-log", str(log_path)], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            seen = [await recorder.checkpoints.receive() for _ in range(4)]
        assert [c[1] for c in seen] == [1, 2, 3, 4]
        progresses = [c[2] for c in seen]
        assert progresses == sorted(progresses) and progresses[-1] > progresses[0]
        for _, _, progress, _, state in seen:
            assert decode_counter_state(state)[0] == progress
        assert runner.running()[JOB]["seq"] >= 4
        with trio.fail_after(WAIT_S):
            assert await runner.stop(JOB) == -signal.SIGKILL
        assert process_gone(pid) and runner.running() == {}
        nursery.cancel_scope.cancel()
    units = [int(line.split()[0]) for line in log_path.read_text().splitlines()]
    assert units[:3] == [1, 2, 3] and units[-1] >= progresses[-1]
    with pytest.raises(trio.WouldBlock):
        recorder.exits.receive_nowait()  # a stop() is not reported as an exit


async def test_a_job_started_again_right_after_its_stop_stays_tracked(tmp_path):
    """stop then run of one job in one Ready batch (a halt and a resume, SPEC.md F3): the old
    run's supervisor, finishing after the new run is registered, must not forget the new one,
    which would then run on untracked, never stopped, next to the one the next run order starts."""
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path)
        await runner.start(JOB, "counter", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            await recorder.checkpoints.receive()
            await runner.stop(JOB)
        second = await runner.start(JOB, "counter", [], gpus=[], restore=None, fence=1)
        try:
            with trio.fail_after(WAIT_S):
                while recorder.checkpoints.statistics().current_buffer_used == 0:
                    await trio.sleep(0.01)   # the old supervisor has long finished by the new run's first tick
            assert runner.running()[JOB]["pid"] == second
            with trio.fail_after(WAIT_S):
                await runner.stop(JOB)
            assert process_gone(second)
        finally:
            if not process_gone(second):
                os.killpg(second, signal.SIGKILL)
        nursery.cancel_scope.cancel()


async def test_a_node_dir_given_relative_still_gives_workloads_a_path_they_can_open(tmp_path, monkeypatch):
    """`make demo` runs nodes with `--node demo-mesh/node-0`: a workload runs in its own
    working directory, so `{workdir}` in its args must be absolute."""
    monkeypatch.chdir(tmp_path)
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, "relative-node-dir")
        workdir = runner.workdir(JOB)
        assert os.path.isabs(workdir) and workdir.startswith(str(tmp_path / "relative-node-dir"))
        await runner.start(JOB, "counter", ["--progress-log", os.path.join(workdir, "progress.log")],
                           gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            await recorder.checkpoints.receive()
        await runner.stop(JOB)
        nursery.cancel_scope.cancel()
    assert (tmp_path / "relative-node-dir" / "workloads" / JOB.hex() / "progress.log").stat().st_size > 0


async def test_restored_counter_continues_from_the_checkpoint(tmp_path):
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path)
        restore = (COUNTER_STATE.pack(5000, 12345), 5000, 41)
        await runner.start(JOB, "counter", ["--units", "5050"], gpus=[], restore=restore, fence=2)
        with trio.fail_after(WAIT_S):
            _, seq, progress, _, _ = await recorder.checkpoints.receive()
            assert (seq, 5000 < progress <= 5050) == (42, True)
            assert await recorder.exits.receive() == (JOB, 0)  # ran its 50 remaining units and finished
        nursery.cancel_scope.cancel()


OFFER_THEN_STOP = textwrap.dedent("""
    import os, signal
    from meshnode.workload import Workload
    w = Workload.connect()
    w.set_state(b"offered before the stop", progress=7)
    os.kill(os.getpid(), signal.SIGSTOP)   # descheduled from here on, as a starved workload is
""")


async def start_stopped_workload(nursery, tmp_path):
    """(runner, pid, its first checkpoint) of a workload that offered one state and then
    stopped itself (SIGSTOP)."""
    stopper = [sys.executable, "-c", OFFER_THEN_STOP]
    runner, recorder = await open_runner(nursery, tmp_path, commands={"stopper": stopper})
    pid = await runner.start(JOB, "stopper", [], gpus=[], restore=None, fence=1)
    with trio.fail_after(WAIT_S):
        while process_state(pid) != "T":
            await trio.sleep(0.01)
        return runner, pid, await recorder.checkpoints.receive()


async def test_a_stopped_workload_is_still_checkpointed_from_what_it_offered(tmp_path):
    """The node reads the state slot itself: a workload that cannot run (SIGSTOP, or starved
    at its lower priority) delays no checkpoint (SPEC.md 9.4)."""
    async with trio.open_nursery() as nursery:
        runner, _pid, (_, seq, progress, _, state) = await start_stopped_workload(nursery, tmp_path)
        assert (seq, progress, state) == (1, 7, b"offered before the stop")
        with trio.fail_after(WAIT_S):
            await runner.stop(JOB)
        nursery.cancel_scope.cancel()


LAST_WORDS = textwrap.dedent("""
    import sys
    from meshnode.workload import Workload
    Workload.connect().set_state(b"last words", progress=3)
    sys.exit(3)
""")


async def test_what_a_workload_offered_just_before_it_exited_is_checkpointed_before_the_exit(tmp_path):
    """A failed job's retry resumes from its newest checkpoint: the state offered after the
    last tick is read once more when the process is gone."""
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path, commands={"brief": [sys.executable, "-c", LAST_WORDS]})
        await runner.start(JOB, "brief", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            assert await recorder.exits.receive() == (JOB, 3)
        _, seq, progress, _, state = recorder.checkpoints.receive_nowait()
        assert (seq, progress, state) == (1, 3, b"last words")
        nursery.cancel_scope.cancel()


async def test_gpus_are_passed_as_cuda_visible_devices(tmp_path):
    show_env = [sys.executable, "-c", "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"]
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path, commands={"show-env": show_env})
        await runner.start(JOB, "show-env", [], gpus=[0, 3], restore=None, fence=1)
        await runner.start(bytes([1] * 32), "show-env", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            assert {await recorder.exits.receive() for _ in range(2)} == {(JOB, 0), (bytes([1] * 32), 0)}
        nursery.cancel_scope.cancel()
    assert (tmp_path / "workloads" / JOB.hex() / "output.log").read_text() == "'0,3'\n"
    assert (tmp_path / "workloads" / ("01" * 32) / "output.log").read_text() == "''\n"


async def test_workloads_run_at_a_lower_cpu_priority_than_their_node(tmp_path):
    """A CPU-hungry workload must not starve the node's heartbeats (SPEC.md 9.3)."""
    show_nice = [sys.executable, "-c", "import os; print(os.nice(0))"]
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path, commands={"show-nice": show_nice})
        await runner.start(JOB, "show-nice", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            assert await recorder.exits.receive() == (JOB, 0)
        nursery.cancel_scope.cancel()
    expected = min(19, os.nice(0) + WORKLOAD_NICE)
    assert (tmp_path / "workloads" / JOB.hex() / "output.log").read_text() == "%d\n" % expected


async def test_entrypoints_outside_the_policy_are_refused(tmp_path):
    async with trio.open_nursery() as nursery:
        runner, _ = await open_runner(nursery, tmp_path, allowed_entrypoints=frozenset({"counter", "mystery"}))
        with pytest.raises(LocalProtocolError, match="'train' is not allowed on this node"):
            await runner.start(JOB, "train", [], gpus=[], restore=None, fence=1)
        with pytest.raises(LocalProtocolError, match="not allowed on this node"):
            runner.resolve_argv("rm -rf /", [])
        with pytest.raises(LocalProtocolError, match="'mystery' is neither a built-in kind"):
            runner.resolve_argv("mystery", [])  # allowed by policy, but no command declares it
        assert runner.running() == {}
        nursery.cancel_scope.cancel()


def state_slot_mappings():
    with open("/proc/self/maps") as maps:
        return sum("meshnode-state" in line for line in maps)


async def test_a_workload_that_cannot_start_leaves_no_descriptor_or_mapping(tmp_path):
    missing = [str(tmp_path / "no-such-program")]
    async with trio.open_nursery() as nursery:
        runner, _ = await open_runner(nursery, tmp_path, commands={"missing": missing})
        fds, mappings = len(os.listdir("/proc/self/fd")), state_slot_mappings()
        with pytest.raises(LocalProtocolError, match="cannot start") as refused:
            await runner.start(JOB, "missing", [], gpus=[], restore=None, fence=1)
        # Checked while the exception (and the frames its context holds) is still alive.
        assert (len(os.listdir("/proc/self/fd")), state_slot_mappings()) == (fds, mappings)
        assert refused.value is not None and runner.running() == {}
        nursery.cancel_scope.cancel()


async def test_runner_shutdown_kills_its_workloads(tmp_path):
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path)
        pid = await runner.start(JOB, "counter", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            await recorder.checkpoints.receive()
        nursery.cancel_scope.cancel()
    assert process_gone(pid)


async def test_stop_from_inside_on_checkpoint_returns(tmp_path):
    """A node that learns in on_checkpoint that it was fenced stops the job right there."""
    finished = trio.Event()
    stopped = []

    async def stop_on_first_checkpoint(job_id, seq, progress, taken_ms, state):
        if not stopped:
            stopped.append(await runner.stop(job_id))
            finished.set()
        else:
            stopped.append("late checkpoint")

    async def on_exit(job_id, exit_code):
        stopped.append("exit reported")

    async with trio.open_nursery() as nursery:
        runner = WorkloadRunner(tmp_path, 20, stop_on_first_checkpoint, on_exit)
        await nursery.start(runner.serve)
        await runner.start(JOB, "counter", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            await finished.wait()
        assert runner.running() == {}
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert stopped == [-signal.SIGKILL]


PARENT = textwrap.dedent("""
    import sys, trio
    from meshnode.node.runner import WORKLOAD_NICE, WorkloadRunner
    async def ignore(*args):
        pass
    async def main():
        sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]  # does not use the SDK
        runner = WorkloadRunner(sys.argv[1], 100, ignore, ignore, commands={"sleeper": sleeper})
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.serve)
            print(await runner.start(bytes(32), "sleeper", [], [], None, 1), flush=True)
            await trio.sleep_forever()
    trio.run(main)
""")


def test_workload_dies_when_its_node_is_sigkilled(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        child = os.pidfd_open(child_pid)
        try:
            assert not select.select([child], [], [], 0)[0]  # running while its node lives
            os.kill(parent.pid, signal.SIGKILL)
            readable, _, _ = select.select([child], [], [], WAIT_S)  # a pidfd turns readable at exit
            assert readable == [child]
        finally:
            os.close(child)
    finally:
        parent.kill()
        parent.wait(timeout=WAIT_S)
        parent.stdout.close()


def test_train_state_grows_and_a_restored_run_matches_an_uninterrupted_one():
    straight = TrainingRun(features=6, samples=40, seed=3, learning_rate=0.5)
    losses = [straight.train_step() for _ in range(6)]
    assert losses[-1] < losses[0]

    first_half = TrainingRun(features=6, samples=40, seed=3, learning_rate=0.5)
    for _ in range(3):
        first_half.train_step()
    halfway_state = first_half.encode_state()
    resumed = TrainingRun(features=6, samples=40, seed=3, learning_rate=0.5)
    resumed.restore_state(halfway_state)
    for _ in range(3):
        resumed.train_step()
    assert resumed.encode_state() == straight.encode_state()
    assert len(straight.encode_state()) > len(halfway_state)


LOUD = textwrap.dedent("""
    import sys
    for i in range(60_000):
        print("line %05d" % i)
    print("to stderr too", file=sys.stderr)
    sys.exit(5)
""")


async def test_all_output_is_in_the_ring_before_the_exit_is_reported(tmp_path, monkeypatch):
    """`meshnode job logs --follow` stops once the job ended and its log is read to the end:
    the runner drains the workload's pipe into the ring (SPEC.md 9.8) before on_exit."""
    from meshnode.node import output_log
    from meshnode.node.output_log import OutputLog
    monkeypatch.setattr(output_log, "SEGMENT_BYTES", 256 * 1024)   # 660 kB of output rotates twice
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path, commands={"loud": [sys.executable, "-c", LOUD]})
        await runner.start(JOB, "loud", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            assert await recorder.exits.receive() == (JOB, 5)
        nursery.cancel_scope.cancel()
    expected = "".join("line %05d\n" % i for i in range(60_000)) + "to stderr too\n"
    log = OutputLog(runner.workdir(JOB))
    start, end = log.bounds()
    assert end == len(expected) and 0 < start and end - start <= 2 * 256 * 1024
    assert log.read(start, end)[2] == expected[start:].encode()


async def test_output_still_in_the_pipe_at_the_exit_is_drained_into_the_ring(tmp_path, monkeypatch):
    """The exit can be seen before the pump read the last bytes (both wake at once): what
    is left in the pipe is read before on_exit. Here the pump never runs at all."""
    from meshnode.node.output_log import OutputLog

    async def idle_pump(self, job):
        with job.pump_scope:   # cancelled at the exit, like the real pump
            await trio.sleep_forever()
    monkeypatch.setattr(WorkloadRunner, "_pump_output", idle_pump)
    last_words = [sys.executable, "-c", "print('x' * 2999)"]
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path, commands={"last-words": last_words})
        await runner.start(JOB, "last-words", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            assert await recorder.exits.receive() == (JOB, 0)
            assert OutputLog(runner.workdir(JOB)).read(0, 10_000)[2] == b"x" * 2999 + b"\n"
        nursery.cancel_scope.cancel()


async def test_train_prints_its_loss_to_the_log_when_asked(tmp_path):
    from meshnode.node.output_log import OutputLog
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path)
        await runner.start(JOB, "train", ["--steps", "4", "--log-every", "2", "--samples", "8"], gpus=[],
                           restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            assert await recorder.exits.receive() == (JOB, 0)
        nursery.cancel_scope.cancel()
    lines = OutputLog(runner.workdir(JOB)).read(0, 1000)[2].decode().splitlines()
    assert [line.split()[:2] for line in lines] == [["step", "2"], ["step", "4"]]


async def test_stop_for_handover_returns_the_newest_state_offered_even_once_a_tick_read_it(tmp_path):
    """SPEC.md R2: the final checkpoint a move hands over is the newest state the workload
    offered. A tick may have read it already and its checkpoint been refused (the core no
    longer sees the node as primary), so with nothing newer the runner gives that one again,
    under the next seq."""
    async with trio.open_nursery() as nursery:
        runner, pid, (_, seq, progress, taken_ms, state) = await start_stopped_workload(nursery, tmp_path)
        with trio.fail_after(WAIT_S):
            final = await runner.stop_for_handover(JOB)
        assert final == (seq + 1, progress, taken_ms, state) == (2, 7, taken_ms, b"offered before the stop")
        assert process_gone(pid) and await runner.stop_for_handover(JOB) is None
        nursery.cancel_scope.cancel()


async def test_a_frozen_workload_keeps_its_process_offers_nothing_and_goes_on_when_thawed(tmp_path):
    """SPEC.md F3b: a halted node freezes its workloads (SIGSTOP) instead of killing them, so a
    healthy worker (a gang's rank) is not restarted when the halt ends; stop still kills it."""
    async with trio.open_nursery() as nursery:
        runner, recorder = await open_runner(nursery, tmp_path)
        pid = await runner.start(JOB, "counter", [], gpus=[], restore=None, fence=1)
        with trio.fail_after(WAIT_S):
            await recorder.checkpoints.receive()
        assert runner.freeze(JOB)
        with trio.fail_after(WAIT_S):
            while process_state(pid) != "T":
                await trio.sleep(0.01)
        ticks = lambda: len(runner.jobs_info()[0].interval_error_us)   # noqa: E731 (one tick per period)
        with trio.fail_after(WAIT_S):
            seen = ticks()
            while ticks() < seen + 2:   # what it offered before the SIGSTOP landed is read by then
                await trio.sleep(0.01)
            frozen_at, seen = runner.running()[JOB]["progress"], ticks()
            while ticks() < seen + 10:   # ten ticks: a running counter offers a new state in each
                await trio.sleep(0.01)
        assert runner.running()[JOB]["progress"] == frozen_at and runner.running()[JOB]["pid"] == pid
        assert runner.thaw(JOB)
        with trio.fail_after(WAIT_S):
            _, _, progress, _, _ = await recorder.checkpoints.receive()
            while progress <= frozen_at:
                _, _, progress, _, _ = await recorder.checkpoints.receive()
        assert runner.running()[JOB]["pid"] == pid and process_state(pid) != "T"
        assert runner.freeze(JOB)
        with trio.fail_after(WAIT_S):
            await runner.stop(JOB)   # SIGKILL ends a frozen group too
        assert process_gone(pid) and not runner.thaw(JOB) and not runner.freeze(JOB)
        nursery.cancel_scope.cancel()
