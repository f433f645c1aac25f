"""The consensus benchmark's bookkeeping (testnet/bench_consensus.py), without a testnet."""

from testnet.bench_consensus import DecisionCollector


def event(kind, **detail):
    return {"kind": kind, "detail": dict(detail, mono_ns=detail.get("mono_ns", 1))}


def test_one_instance_per_job_counts_each_nodes_decided_event_of_the_jobs_instance():
    collector = DecisionCollector(2)
    collector.expect("aa")
    collector.on_event(0, event("decided", instance="aa", value_kind="placement", mono_ns=5))
    collector.on_event(0, event("placed", job_id="aa", mono_ns=6))          # not what this mode counts
    collector.on_event(1, event("decided", instance="bb", value_kind="placement"))  # another job
    assert collector.decided_ns["aa"] == {0: 5} and not collector.everywhere["aa"].is_set()
    collector.on_event(1, event("decided", instance="aa", value_kind="placement", mono_ns=9, round=1))
    assert collector.everywhere["aa"].is_set() and collector.rounds_over_zero == 1


def test_with_slots_a_job_counts_as_decided_where_it_was_placed():
    """SPEC.md P7: one slot decision places many jobs; its ``decided`` names the slot."""
    collector = DecisionCollector(2, slots=True)
    for job in ("aa", "bb"):
        collector.expect(job)
    collector.on_event(0, event("decided", instance="cc", value_kind="placement_slot"))
    for index in (0, 1):
        collector.on_event(index, event("placed", job_id="aa", mono_ns=10 + index))
    collector.on_event(0, event("placed", job_id="bb"))
    assert collector.decided_ns == {"aa": {0: 10, 1: 11}, "bb": {0: 1}}
    assert collector.everywhere["aa"].is_set() and not collector.everywhere["bb"].is_set()


def test_a_submit_refused_as_overloaded_is_retried_after_the_nodes_hint(monkeypatch):
    """SPEC.md 10.5a: the bench waits the `retry in N ms` the entry node names, then submits
    again; any other refusal is counted as refused and not retried."""
    import trio
    import trio.testing

    from meshnode.control.client import ControlError
    from protocol.errors import SubmitOverloaded
    from testnet import bench_consensus

    feeds, calls = {}, []

    async def fake_subscribe(node_dir, index, on_event, *, task_status=trio.TASK_STATUS_IGNORED, kinds=None):
        feeds[index] = on_event
        task_status.started()
        await trio.sleep_forever()

    class FakeClient:
        def __init__(self, node_dir, timeout_s=None):
            pass

        async def connect(self):
            pass

        async def aclose(self):
            pass

        async def call(self, op, job):
            calls.append((trio.current_time(), job))
            if job == b"bad":
                raise ControlError("submit: scheduling.pool: no such pool")
            if len(calls) == 1:
                raise ControlError("submit: " + str(SubmitOverloaded(64, 64, 250)))
            job_hex = ("aa" * 32) if job == b"good" else ("bb" * 32)
            feeds[0](0, event("decided", instance=job_hex, value_kind="placement"))
            return {"job_id": job_hex}

    monkeypatch.setattr(bench_consensus, "subscribe", fake_subscribe)
    monkeypatch.setattr(bench_consensus, "AsyncControlClient", FakeClient)
    monkeypatch.setattr(bench_consensus, "IDLE_SAMPLE_S", 0)
    layout = {"nodes": [{"dir": "node-0", "pid": None}]}
    signed = [(bytes.fromhex("aa" * 32), b"good"), (bytes.fromhex("bb" * 32), b"bad")]
    raw = trio.run(bench_consensus.measure, layout, signed, 1, 5.0, False, clock=trio.testing.MockClock(autojump_threshold=0))
    assert raw["overloaded"] == [250]
    assert calls[1][0] - calls[0][0] >= 0.25 and [job for _, job in calls] == [b"good", b"good", b"bad"]
    assert len(raw["latencies_ms"]) == 1 and len(raw["refused"]) == 1 and raw["undecided"] == 0
