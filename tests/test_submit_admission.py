"""Admission control at the entry node (SPEC.md 10.5, issue 18): a node that already has
`max_undecided_submits` of the jobs submitted to it undecided refuses a new one, saying to
retry and when, instead of queueing work the mesh cannot decide. Pure cores (the router of
tests/test_mesh_core.py), the node's config, and the client's parse of the hint."""

import pytest

from keys.genesis import DEFAULT_PARAMS
from meshnode.control.client import ControlError
from meshnode.node.config import ConfigError, NodeConfig, parse_config
from protocol.errors import SubmitOverloaded
from protocol.messages import job_id
from tests.test_mesh_core import KEYS, Net, make_job

ENTRY = KEYS[1]


def test_a_full_entry_node_refuses_a_new_job_with_when_to_retry_and_accepts_once_decided():
    net = Net()
    net.down = set(KEYS) - {ENTRY}          # nothing can be decided: the instances stay open
    first, second, third = (make_job(nonce=n) for n in (1, 2, 3))
    net.emit(ENTRY, net.cores[ENTRY].submit(first[1], net.now, max_undecided=2))
    net.emit(ENTRY, net.cores[ENTRY].submit(second[1], net.now, max_undecided=2))
    core = net.cores[ENTRY]
    with pytest.raises(SubmitOverloaded) as refused:
        core.submit(third[1], net.now, max_undecided=2)
    # With no decision measured yet, the hint is the genesis round timeout (6.12).
    assert refused.value.retry_after_ms == DEFAULT_PARAMS.round_timeout_ms
    assert str(refused.value) == ("overloaded: 2 jobs submitted to this node are undecided "
                                  "(node.max_undecided_submits = 2): retry in %d ms" % DEFAULT_PARAMS.round_timeout_ms)
    assert core.job_view(job_id(third[0])) is None            # refused, nothing kept or sent
    core.submit(first[1], net.now, max_undecided=2)           # a job it holds already is not new work
    core.submit(third[1], net.now, max_undecided=0)           # 0: no bound
    # The mesh comes back and decides: the entry takes new work again.
    net.down = set()
    net.run(300)
    assert all(core.job_view(job_id(j[0]))["state"] == "placed" for j in (first, second, third))
    net.emit(ENTRY, core.submit(make_job(nonce=4)[1], net.now, max_undecided=2))


def test_jobs_submitted_to_other_nodes_do_not_count_against_this_one():
    net = Net()
    net.down = {KEYS[2], KEYS[3]}
    for nonce in (1, 2):
        net.emit(KEYS[0], net.cores[KEYS[0]].submit(make_job(nonce=nonce)[1], net.now, max_undecided=2))
    net.deliver()
    net.emit(ENTRY, net.cores[ENTRY].submit(make_job(nonce=3)[1], net.now, max_undecided=2))


def test_the_bound_is_a_node_setting_with_a_default():
    assert NodeConfig().max_undecided_submits == 64
    assert parse_config({"node": {"max_undecided_submits": 0}}).max_undecided_submits == 0
    with pytest.raises(ConfigError, match="node.max_undecided_submits"):
        parse_config({"node": {"max_undecided_submits": -1}})


def test_a_client_reads_the_hint_from_the_error_and_nothing_else_as_one():
    error = ControlError("submit: " + str(SubmitOverloaded(70, 64, 350)))
    assert error.retry_after_ms == 350
    assert ControlError("submit: the job names epoch 3, which this node has not reached").retry_after_ms is None
    assert ControlError("submit: overloaded: retry in 10 ms; but not at the end").retry_after_ms is None


def test_the_count_reads_only_the_jobs_entered_here_and_forgets_ended_ones():
    # Every submit counts (10.5a): over a table of up to MAX_JOBS records, reading them all
    # cost about 1 ms a submit; the count keeps the ids of the jobs entered here instead.
    net = Net()
    for nonce in (1, 2, 3):
        net.emit(KEYS[0], net.cores[KEYS[0]].submit(make_job(nonce=nonce)[1], net.now, max_undecided=8))
    net.emit(ENTRY, net.cores[ENTRY].submit(make_job(nonce=9)[1], net.now, max_undecided=8))
    net.run(300)
    placement = net.cores[ENTRY].placement
    assert len(net.cores[ENTRY].job_table) == 4 and len(placement._entered_here) == 1
    assert placement.undecided_submissions() == 0
    placement.jobs.get(next(iter(placement._entered_here))).state = "completed"
    assert placement.undecided_submissions() == 0 and placement._entered_here == set()
