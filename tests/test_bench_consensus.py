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
