"""`meshnode replay` (testnet/replay.py, testnet/cli_replay.py): trace parsing, its
one-line errors, the fill experiment, and the JSON shape on a slice of the real files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from protocol.gpu_shares import TaskDemand
from protocol.packing import POLICY_NAMES
from testnet import cli_replay
from testnet.replay import DEFAULT_CLUSTER, DEFAULT_PODS, NodeSpec, TraceError, fill, load_cluster, load_tasks

NODES_HEADER = "sn,cpu_milli,memory_mib,gpu,model\n"
PODS_HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
               "creation_time,deletion_time,scheduled_time\n")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_pods_parse_into_the_three_shapes_with_optional_columns(tmp_path):
    pods = write(tmp_path, "pods.csv", PODS_HEADER +
                 "p0,12000,16384,1,1000,,LS,Running,0,100,0\n"
                 "p1,6000,12288,1,460,V100M16|V100M32,BE,Running,5,,6\n"
                 "p2,1000,1024,8,1000,,,,,,\n"
                 "p3,2000,2048,0,0,,LS,Running,1,2,1\n")
    tasks = load_tasks(pods)
    assert [t.demand for t in tasks] == [
        TaskDemand.whole(12000, 16384, 1), TaskDemand.fractional(6000, 12288, 460, frozenset({"V100M16", "V100M32"})),
        TaskDemand.whole(1000, 1024, 8), TaskDemand(2000, 2048)]
    assert (tasks[1].qos, tasks[1].creation_s, tasks[1].deletion_s, tasks[1].scheduled_s) == ("BE", 5, None, 6)
    assert tasks[2].qos is None and tasks[2].creation_s is None


def test_a_trace_variant_without_gpu_spec_qos_or_times_loads(tmp_path):
    pods = write(tmp_path, "pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,500\n"
                                       "p1,1000,1024,2,\n")
    tasks = load_tasks(pods)
    assert [t.demand for t in tasks] == [TaskDemand.fractional(1000, 1024, 500), TaskDemand.whole(1000, 1024, 2)]
    assert tasks[0].qos is None and tasks[0].scheduled_s is None
    nodes = write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu\nn0,8000,8192,2\n")
    assert load_cluster(nodes) == [NodeSpec("n0", "", 2, 8000, 8192)]


@pytest.mark.parametrize("body, message", [
    ("p0,12x,16384,1,1000,,LS,Running,0,1,0\n", "line 2 column cpu_milli: expected an integer, got '12x'"),
    ("p0,1,1,1,1000,,LS,Running,0,1,0\np1,1,1,1,1200,,LS,Running,0,1,0\n", "line 3 column gpu_milli: 1200"),
    ("p0,1,1,2,500,,LS,Running,0,1,0\n", "line 2 column gpu_milli: a 2-GPU task takes whole GPUs"),
    ("p0,1,1,0,300,,LS,Running,0,1,0\n", "line 2 column gpu_milli: 300 for a task with num_gpu 0"),
    ("p0,1,1,-1,0,,LS,Running,0,1,0\n", "line 2 column num_gpu: -1 is outside"),
    ("p0,1,1,1,1000,,LS,Running,0,1\n", "line 2: 10 fields, the header has 11"),
    ("p0,1,,1,1000,,LS,Running,0,1,0\n", "line 2 column memory_mib: empty"),
    ("p0,1,1,1,1000,,LS,Running,soon,1,0\n", "line 2 column creation_time: expected an integer"),
])
def test_bad_pod_rows_name_file_line_and_column(tmp_path, body, message):
    pods = write(tmp_path, "pods.csv", PODS_HEADER + body)
    with pytest.raises(TraceError) as error:
        load_tasks(pods)
    assert str(pods) in str(error.value) and message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text, message", [
    ("sn,cpu_milli,memory_mib,model\nn0,1,1,T4\n", "line 1: missing column gpu"),
    (NODES_HEADER + "n0,1,1,2,T4\nn0,1,1,2,T4\n", "line 3 column sn: node 'n0' listed twice"),
    (NODES_HEADER + "n0,1,1,99,T4\n", "line 2 column gpu: 99 is outside 0..64"),
    (NODES_HEADER, "no nodes"),
    ("", "empty file"),
])
def test_bad_node_files_name_file_line_and_column(tmp_path, text, message):
    nodes = write(tmp_path, "nodes.csv", text)
    with pytest.raises(TraceError, match=message):
        load_cluster(nodes)


def test_missing_file_is_a_one_line_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_cluster(tmp_path / "absent.csv")


def test_fill_counts_failures_and_the_share_at_the_first_one():
    # Two nodes with two GPUs each (4000 milli); tasks cycle: a whole GPU, then a 2-GPU task.
    # Offered milli: 1000, 3000, 4000, 6000 (>= 1.3 * 4000 = 5200: stop). The first three
    # fit (4000 allocated: share 1.0 after the third); the fourth (2 GPUs) fails at share 1.0.
    nodes = [NodeSpec("a", "T4", 2, 8000, 8192), NodeSpec("b", "T4", 2, 8000, 8192)]
    tasks = load_tasks_from_demands([TaskDemand.whole(0, 0, 1), TaskDemand.whole(0, 0, 2)])
    result = fill(nodes, tasks, "pack")
    assert (result["tasks_offered"], result["failed"], result["gpu_alloc_share"],
            result["share_at_first_failure"]) == (4, 1, 1.0, 1.0)


def load_tasks_from_demands(demands):
    from testnet.replay import TraceTask
    return [TraceTask("t%d" % i, d, None, None, None, None) for i, d in enumerate(demands)]


def test_fill_refuses_a_trace_with_no_gpu_demand():
    with pytest.raises(TraceError, match="no task asks for a GPU"):
        fill([NodeSpec("a", "T4", 2, 8000, 8192)], load_tasks_from_demands([TaskDemand(1, 1)]), "best-fit")


@pytest.fixture
def real_slice(tmp_path):
    """The first 60 nodes and 400 tasks of the real trace files."""
    if not (DEFAULT_CLUSTER.exists() and DEFAULT_PODS.exists()):
        pytest.skip("the Alibaba trace is not in ../shared/data")
    nodes = write(tmp_path, "nodes.csv", "".join(DEFAULT_CLUSTER.read_text().splitlines(True)[:61]))
    pods = write(tmp_path, "pods.csv", "".join(DEFAULT_PODS.read_text().splitlines(True)[:401]))
    return nodes, pods


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="meshnode")
    cli_replay.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["replay", *argv])
    return args.func(args)


def test_json_has_a_policies_map_with_the_figures_on_a_slice_of_the_real_trace(real_slice, capsys):
    nodes, pods = real_slice
    assert run_cli(["--cluster", str(nodes), "--pods", str(pods), "--policy", "all", "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == set(POLICY_NAMES)
    for figures in out["policies"].values():
        assert {"gpu_alloc_share", "share_at_first_failure", "failed", "fragmentation", "wall_s"} <= set(figures)
        assert 0 < figures["gpu_alloc_share"] <= 1 and 0 <= figures["fragmentation"] <= 1
        assert figures["failed"] > 0 and 0 < figures["share_at_first_failure"] <= figures["gpu_alloc_share"]
    assert out["nodes"] == 60 and out["tasks"] == 400


def test_same_seed_same_figures(real_slice, capsys):
    nodes, pods = real_slice
    figures = []
    for _ in range(2):
        run_cli(["--cluster", str(nodes), "--pods", str(pods), "--policy", "random-fit", "--policy", "fgd",
                 "--seed", "7", "--json"])
        out = json.loads(capsys.readouterr().out)["policies"]
        figures.append({name: {k: v for k, v in f.items() if k != "wall_s"} for name, f in out.items()})
    assert figures[0] == figures[1] and set(figures[0]) == {"random-fit", "fgd"}


def test_unknown_policy_is_a_one_line_error(real_slice):
    nodes, pods = real_slice
    with pytest.raises(TraceError, match="unknown policy worst-fit"):
        run_cli(["--cluster", str(nodes), "--pods", str(pods), "--policy", "worst-fit"])


def test_timed_replay_queues_in_arrival_order_and_reports_delay_per_qos(tmp_path):
    # One node, one GPU. a (LS): whole GPU, arrives 0, runs 100 s. b (BE): whole GPU,
    # arrives 10, runs 50: waits for a -> starts 100 (delay 90). c (BE): a 500-share,
    # arrives 20: the GPU is held whole until b ends at 150 -> delay 130. d has no times
    # (not replayed); e asks for 2 GPUs (fits on no node: counted apart, never queued).
    pods = write(tmp_path, "pods.csv", PODS_HEADER +
                 "a,1000,1024,1,1000,,LS,Running,0,100,0\n"
                 "b,1000,1024,1,1000,,BE,Running,10,1050,1000\n"
                 "c,1000,1024,1,500,,BE,Running,20,2010,2000\n"
                 "d,1000,1024,1,500,,BE,Pending,30,40,\n"
                 "e,1000,1024,2,1000,,LS,Running,0,100,0\n")
    nodes = [NodeSpec("n", "T4", 1, 8000, 8192)]
    from testnet.replay import timed
    result = timed(nodes, load_tasks(pods), "pack")
    delays = {q: {k: c[k] for k in ("started", "never_started", "delay_p50_s", "delay_p99_s")}
              for q, c in result["qos"].items()}
    assert delays == {"BE": {"started": 2, "never_started": 0, "delay_p50_s": 90, "delay_p99_s": 130},
                      "LS": {"started": 1, "never_started": 0, "delay_p50_s": 0, "delay_p99_s": 0}}
    assert (result["untimed"], result["unplaceable"], result["preemptions"]) == (1, 1, 0)


def test_timed_cli_draws_the_nodes_with_the_seed(real_slice, capsys):
    nodes, pods = real_slice
    assert run_cli(["--cluster", str(nodes), "--pods", str(pods), "--timed", "--nodes", "2", "--policy", "fgd",
                    "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nodes"] == 2 and out["timed"] and set(out["policies"]["fgd"]["qos"]) <= {"LS", "BE", "Burstable",
                                                                                         "Guaranteed", "none"}
    with pytest.raises(TraceError, match="--nodes must be in 1..60"):
        run_cli(["--cluster", str(nodes), "--pods", str(pods), "--timed", "--nodes", "61"])


def test_a_byte_order_mark_before_the_header_is_not_part_of_the_first_column(tmp_path):
    nodes = tmp_path / "nodes.csv"
    nodes.write_bytes(b"\xef\xbb\xbf" + (NODES_HEADER + "n0,8000,8192,2,T4\n").encode())
    assert load_cluster(nodes) == [NodeSpec("n0", "T4", 2, 8000, 8192)]


def test_a_file_that_is_not_utf8_is_a_one_line_error(tmp_path):
    nodes = tmp_path / "nodes.csv"
    nodes.write_bytes(NODES_HEADER.encode() + b"n\xff0,8000,8192,2,T4\n")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_cluster(nodes)


def test_shuffle_reorders_the_offered_tasks_by_its_seed(real_slice, capsys):
    nodes, pods = real_slice
    outputs = []
    for shuffle in ("1", "1", "2"):
        run_cli(["--cluster", str(nodes), "--pods", str(pods), "--policy", "pack", "--shuffle", shuffle, "--json"])
        out = json.loads(capsys.readouterr().out)
        assert out["shuffle"] == int(shuffle)
        outputs.append({k: v for k, v in out["policies"]["pack"].items() if k != "wall_s"})
    assert outputs[0] == outputs[1] != outputs[2]
    with pytest.raises(TraceError, match="--shuffle reorders the fill experiment"):
        run_cli(["--cluster", str(nodes), "--pods", str(pods), "--timed", "--shuffle", "1"])


# --- the timed replay with preemption (testnet/replay_preemption.py: the P8 rule via an adapter) ---

def timed_run(tmp_path, rows, gpus=1, **options):
    from testnet.replay import timed
    pods = write(tmp_path, "pods.csv", PODS_HEADER + rows)
    return timed([NodeSpec("n", "T4", gpus, 64000, 65536)], load_tasks(pods), "pack", seed=5, **options)


def test_a_latency_sensitive_task_preempts_a_best_effort_one_which_resumes_from_its_checkpoint(tmp_path):
    # One GPU. b (BE) arrives 0 and runs 100 s; a (LS) arrives 10 s and runs 50 s. With
    # preemption a starts at once and b resumes at 60 s, losing the work since its newest
    # checkpoint (3 s period, phase drawn from the seed): it ends at 60 + (100 - 10) s + lost.
    rows = "b,1000,1024,1,1000,,BE,Running,0,100,0\na,1000,1024,1,1000,,LS,Running,10,1050,1000\n"
    from testnet.replay_preemption import CheckpointClock
    lost = CheckpointClock(3000, 5).age_ms(0, 0, 10_000)
    result = timed_run(tmp_path, rows, checkpoint_ms=3000)
    assert result["qos"]["LS"]["delay_p50_s"] == 0 and result["preemptions"] == 1
    assert result["qos"]["BE"]["preemptions"] == 1 and result["qos"]["BE"]["lost_work_max_ms"] == lost
    assert 0 <= lost < 3000 and result["lost_work_total_s"] == lost / 1000
    assert result["never_started"] == 0 and result["qos"]["BE"]["started"] == 1
    baseline = timed_run(tmp_path, rows, preempt=False)
    assert baseline["qos"]["LS"]["delay_p50_s"] == 90 and baseline["preemptions"] == 0


def test_the_victim_is_the_one_that_loses_the_least_work(tmp_path):
    # Two GPUs held by x (BE, since 0 s) and y (BE, since 5 s); z (LS) arrives at 8 s. The
    # rule stops the one whose newest checkpoint is youngest: the least lost work.
    rows = ("x,1000,1024,1,1000,,BE,Running,0,100,0\ny,1000,1024,1,1000,,BE,Running,5,105,5\n"
            "z,1000,1024,1,1000,,LS,Running,8,58,8\n")
    from testnet.replay_preemption import CheckpointClock
    clock = CheckpointClock(7000, 5)
    ages = [clock.age_ms(0, 0, 8000), clock.age_ms(1, 5000, 8000)]
    result = timed_run(tmp_path, rows, gpus=2, checkpoint_ms=7000)
    assert result["preemptions"] == 1 and result["qos"]["BE"]["lost_work_max_ms"] == min(ages)


def test_only_best_effort_tasks_are_preempted_and_never_by_their_equals(tmp_path):
    # One GPU held by b (Burstable); an LS task waits for it. Then a BE task holds it and
    # another BE task waits: equal priority never preempts.
    rows = ("b,1000,1024,1,1000,,Burstable,Running,0,100,0\na,1000,1024,1,1000,,LS,Running,10,60,10\n"
            "c,1000,1024,1,1000,,BE,Running,200,300,200\nd,1000,1024,1,1000,,BE,Running,210,260,210\n")
    result = timed_run(tmp_path, rows)
    assert result["preemptions"] == 0
    assert result["qos"]["LS"]["delay_p50_s"] == 90 and result["qos"]["BE"]["delay_p99_s"] == 90


@pytest.mark.parametrize("header, rows, message", [
    ("name,cpu_milli,memory_mib,num_gpu,creation_time,scheduled_time,deletion_time\n", "p,1,1,1,0,0,1\n",
     "line 2 (task p): no qos"),
    (PODS_HEADER, "p,1,1,1,1000,,LS,Running,0,1,0\nq,1,1,1,1000,,Gold,Running,0,1,0\n",
     "line 3 (task q) column qos: unknown class 'Gold'"),
    (PODS_HEADER, "p,1,1,1,1000,,LS,Running,0,5,9\n", "line 2 (task p): deletion_time 5 is before scheduled_time 9"),
    (PODS_HEADER, "p,1,1,1,1000,,LS,Running,,5,0\n", "line 2 (task p): no creation_time"),
    ("name,cpu_milli,memory_mib,num_gpu,qos\n", "p,1,1,1,LS\n", "needs the scheduled_time and deletion_time columns"),
])
def test_timed_refuses_a_trace_without_qos_or_times_naming_the_row(tmp_path, header, rows, message):
    from testnet.replay import timed
    pods = write(tmp_path, "pods.csv", header + rows)
    with pytest.raises(TraceError) as error:
        timed([NodeSpec("n", "T4", 1, 8000, 8192)], load_tasks(pods), "pack")
    assert message in str(error.value)


# --- a trace slice through the simulated mesh (testnet/replay_mesh.py) ---

def test_the_mesh_decides_the_allocation_the_replay_predicts_on_a_small_slice(tmp_path):
    # Three nodes, two of one shape (10 GPUs); shares, whole GPUs and a 4-GPU task, 12.25
    # GPUs asked in all, and one task that names a model absent here (never placed).
    from testnet.replay_mesh import compare
    nodes = [NodeSpec("a", "T4", 2, 32000, 65536), NodeSpec("b", "G2", 4, 64000, 131072),
             NodeSpec("c", "G2", 4, 64000, 131072)]
    pods = write(tmp_path, "pods.csv", PODS_HEADER +
                 "p0,4000,8192,1,500,,LS,Running,0,1,0\np1,4000,8192,1,250,,BE,Running,0,1,0\n"
                 "p2,8000,16384,4,1000,,LS,Running,0,1,0\np3,4000,8192,1,1000,T4,LS,Running,0,1,0\n"
                 "p4,4000,8192,2,1000,,BE,Running,0,1,0\np5,2000,4096,1,500,,BE,Running,0,1,0\n"
                 "p6,4000,8192,1,1000,V100M32,LS,Running,0,1,0\np7,4000,8192,2,1000,,BE,Running,0,1,0\n"
                 "p8,4000,8192,2,1000,,BE,Running,0,1,0\n")
    result = compare(nodes, load_tasks(pods), seed=1)
    assert result["safety_violations"] == 0 and result["node_states_agree"]
    assert result["placed_by_mesh"] == result["placed_by_replay"] == result["placed_by_both"] == 6
    assert result["same_node_shape"] == 6 and result["only_mesh"] == result["only_replay"] == 0
    assert result["gpu_alloc_share_mesh"] == result["gpu_alloc_share_replay"] > 0.5


def test_mesh_slice_and_checkpoint_options_refuse_bad_values(tmp_path):
    nodes = write(tmp_path, "nodes.csv", NODES_HEADER + "n0,8000,8192,2,T4\n")
    pods = write(tmp_path, "pods.csv", PODS_HEADER + "p0,1000,1024,1,500,,LS,Running,0,1,0\n")
    base = ["--cluster", str(nodes), "--pods", str(pods), "--nodes", "1"]
    with pytest.raises(TraceError, match="--mesh-slice must be in 1..1, got 2"):
        run_cli(base + ["--mesh-slice", "2"])
    with pytest.raises(TraceError, match="not with --timed"):
        run_cli(base + ["--mesh-slice", "1", "--timed"])
    with pytest.raises(TraceError, match="--checkpoint-ms must be >= 1"):
        run_cli(base + ["--timed", "--checkpoint-ms", "0"])


# --- the timed replay with reservations (testnet/replay_reservations.py: Q5's rule) ---------------

def test_reservations_hold_capacity_for_a_big_task_and_let_only_short_ones_backfill(tmp_path):
    # Two GPUs. a (LS, 1 GPU) runs 0-100 s. b (Guaranteed, 2 GPUs) arrives at 10 s: no room.
    # c (Burstable, 1 GPU, runs 500 s) arrives at 20 s; d (BE, 1 GPU, runs 50 s) at 30 s.
    # With reservations b holds the node from 10 s: c would end after b could start (100 s,
    # when a ends) and waits until b ends (delay 130 s); d ends by then and backfills
    # (delay 0); b starts at 100 s (delay 90). Without, c takes the free GPU at once and b
    # waits for c to end at 520 s.
    rows = ("a,1000,1024,1,1000,,LS,Running,0,100,0\nb,1000,1024,2,1000,,Guaranteed,Running,10,60,10\n"
            "c,1000,1024,1,1000,,Burstable,Running,20,520,20\nd,1000,1024,1,1000,,BE,Running,30,80,30\n")

    def delays(result):
        return {qos: figures["delay_p99_s"] for qos, figures in result["qos"].items()}
    held = timed_run(tmp_path, rows, gpus=2, preempt=False, reservations=True)
    assert delays(held) == {"LS": 0, "Guaranteed": 90, "Burstable": 130, "BE": 0}
    free_for_all = timed_run(tmp_path, rows, gpus=2, preempt=False)
    assert delays(free_for_all) == {"LS": 0, "Guaranteed": 510, "Burstable": 0, "BE": 70}


def test_reservations_need_timed(tmp_path):
    nodes = write(tmp_path, "nodes.csv", NODES_HEADER + "n0,8000,8192,2,T4\n")
    pods = write(tmp_path, "pods.csv", PODS_HEADER + "p0,1000,1024,1,500,,LS,Running,0,1,0\n")
    with pytest.raises(TraceError, match="--reservations holds capacity over time: use it with --timed"):
        run_cli(["--cluster", str(nodes), "--pods", str(pods), "--reservations"])
