"""`meshnode submit --wait`: what it waits for and its exit codes (README "Running a node").

The node is a scripted control client: each `jobs` call returns the next row of the job.
"""

import pytest

from meshnode.cli.node import WAIT_ENDED_BADLY, WAIT_NOT_PLACED, WAIT_RUNNING, _wait_running

JOB = "ab" * 32


class ScriptedNode:
    def __init__(self, *rows, members=1):
        self.rows = list(rows)
        self.members = members

    def call(self, op, **_args):
        if op == "status":
            return {"members": self.members}
        row = self.rows.pop(0) if len(self.rows) > 1 else self.rows[0]
        return {"jobs": [] if row is None else [dict({"job_id": JOB, "primary": "cd" * 32, "backups": [],
                                                      "declines": {}, "exit_code": None}, **row)]}


@pytest.mark.parametrize("rows, code, outcome", [
    ([None, {"state": "pending"}, {"state": "placed"}, {"state": "running"}], WAIT_RUNNING, "running"),
    ([{"state": "completed", "exit_code": 0}], WAIT_RUNNING, "completed"),
    ([{"state": "pending", "declines": {"no free GPU": 1}}], WAIT_NOT_PLACED, "not placed: every member declined it"),
    ([{"state": "failed", "exit_code": 127}], WAIT_ENDED_BADLY, "ended: failed (exit code 127)"),
    ([{"state": "cancelled"}], WAIT_ENDED_BADLY, "ended: cancelled (exit code None)"),
])
def test_wait_follows_the_job_to_an_outcome(rows, code, outcome):
    result, got = _wait_running(ScriptedNode(*rows), JOB, wait_s=60)
    assert (got, result["outcome"]) == (code, outcome)


def test_a_placed_job_that_never_runs_is_not_a_success():
    # What a halted node showed before F3's fix: placed, never started, and `--wait` said 0.
    result, code = _wait_running(ScriptedNode({"state": "placed"}), JOB, wait_s=0)
    assert code == WAIT_ENDED_BADLY and result["outcome"] == "placed but not running within 0 s"


def test_a_job_still_pending_when_the_wait_ends_was_not_placed():
    result, code = _wait_running(ScriptedNode({"state": "pending", "declines": {"zone": 1}}, members=3), JOB, 0)
    assert code == WAIT_NOT_PLACED and result["outcome"] == "not placed within 0 s"
