"""testnet/clone_breakdown.py: a clone round's stages from node logs written as a kept
`bench reflex` run writes them."""

import os

from testnet.clone_breakdown import breakdown, log_ms

JOB = "ab" * 32
INSTANCE = "cd" * 32


def write_log(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("2026-11-26 20:05:%s INFO meshnode.node: %s\n" % (at, text) for at, text in lines))


def test_stages_of_one_round_add_up_to_its_clone_ms(tmp_path):
    write_log(tmp_path / "node-0" / "node.log", [
        ("03,500", "proposed instance=%s round=0 value_hash=00" % INSTANCE),
        ("03,520", "decided instance=%s round=0 value_hash=00 value_kind=replica_action" % INSTANCE),
        ("03,520", "replica_action job_id=%s seq=0 replicas=2 added=[1] retired=[]" % JOB)])
    write_log(tmp_path / "node-1" / "node.log", [
        ("03,530", "decided instance=%s round=0 value_hash=00 value_kind=replica_action" % INSTANCE),
        ("03,540", "started job %s pid 7 fence 1 from scratch" % JOB[:12]),
        ("03,540", "replica_action job_id=%s seq=0 replicas=2 added=[1] retired=[]" % JOB)])
    output = tmp_path / "node-1" / "workloads" / JOB / "output.log"
    output.parent.mkdir(parents=True)
    output.write_text("listening on 127.0.0.2:18400\n")
    listening_s = log_ms("2026-11-26 20:05:03,690") / 1000
    os.utime(output, (listening_s, listening_s))
    # The condition had held its duration at 03,400: the first apply (03,520) came 120 ms
    # later, and the bench's probe got the first answer at 03,700 (clone_ms 300).
    result = {"clone_rounds": [{"round": 0, "clone_node": 1, "clone_decided_ms": 120.0, "clone_ms": 300.0}]}
    row, = breakdown(tmp_path, result)["rounds"]
    assert row == {"round": 0, "clone_ms": 300, "to_proposal": 100, "vote": 20, "to_process": 20,
                   "serve_start": 150, "to_answer": 10}
    assert sum(row[k] for k in ("to_proposal", "vote", "to_process", "serve_start", "to_answer")) == row["clone_ms"]
