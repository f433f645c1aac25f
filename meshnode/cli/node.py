"""`meshnode run` and the commands that talk to a running node over its control socket."""

from __future__ import annotations

import json
import time

from rich.table import Table

from meshnode.cli.output import add_json_flag, add_passphrase_args, emit, key_value_table, passphrase_source_from_args
from meshnode.control.client import ControlClient
from meshnode.tui.tables import node_label
from protocol.errors import MeshError

COMMANDS = ("run", "status", "nodes", "jobs", "events", "submit", "why", "consensus", "join")
WAIT_TIMEOUT_S = 30


def _node_arg(parser) -> None:
    parser.add_argument("--node", required=True, metavar="DIR", help="the node's data directory")


def register(subparsers) -> None:
    run = subparsers.add_parser("run", help="run a node until SIGINT/SIGTERM")
    run.add_argument("--node", "--dir", dest="node", required=True, metavar="DIR",
                     help="the node's data directory (`meshnode node init` writes one)")
    run.add_argument("--no-workloads", action="store_true",
                     help="decide placements but start no workload processes (consensus benchmarks)")
    run.set_defaults(func=cmd_run)
    for name, help_text in (("status", "the node's identity, mesh, epoch and connections"),
                            ("nodes", "mesh members with stake, zone, health and capability"),
                            ("jobs", "jobs with state, primary, backups, checkpoints"),
                            ("consensus", "consensus instances, certificates and evidence")):
        parser = subparsers.add_parser(name, help=help_text)
        _node_arg(parser)
        add_json_flag(parser)
        parser.set_defaults(func=cmd_query, op=name)
    events = subparsers.add_parser("events", help="follow the node's events (Ctrl-C to stop)")
    _node_arg(events)
    events.add_argument("--count", type=int, default=0, help="stop after this many events")
    add_json_flag(events)
    events.set_defaults(func=cmd_events)
    submit = subparsers.add_parser("submit", help="sign a manifest with the owner key and submit it")
    submit.add_argument("manifest", metavar="MANIFEST", help="TOML job manifest, or an already signed job")
    submit.add_argument("--key", metavar="OWNER_KEY", help="the owner's keystore (not needed for a signed job)")
    _node_arg(submit)
    submit.add_argument("--wait", action="store_true",
                        help="wait until the job runs; exit 0 if it runs (or completed), 1 if it was not "
                             "placed, 3 if it failed, was cancelled or did not start")
    submit.add_argument("--wait-s", type=float, default=WAIT_TIMEOUT_S, metavar="SECONDS",
                        help="how long --wait waits (default %d)" % WAIT_TIMEOUT_S)
    add_passphrase_args(submit)
    add_json_flag(submit)
    submit.set_defaults(func=cmd_submit)
    why = subparsers.add_parser("why", help="why a job is pending: declines grouped by reason")
    why.add_argument("job_id", metavar="JOB_ID")
    _node_arg(why)
    add_json_flag(why)
    why.set_defaults(func=cmd_why)
    join = subparsers.add_parser("join", help="ask a mesh to admit this node (membership consensus)")
    _node_arg(join)
    join.add_argument("--bootstrap", required=True, metavar="MULTIADDR",
                      help="a member's address: /ip4/HOST/tcp/PORT/p2p/PEERID")
    add_json_flag(join)
    join.set_defaults(func=cmd_join)


def cmd_run(args) -> int:
    import trio
    from meshnode.node.driver import run_node
    trio.run(lambda: run_node(args.node, run_workloads=not args.no_workloads))
    return 0


def _short(hex_id) -> str:
    """Job and instance ids; nodes are named by node_label, as in `meshnode nodes` and the TUI."""
    return hex_id[:12] if isinstance(hex_id, str) else "-"


def cmd_query(args) -> int:
    with ControlClient(args.node) as client:
        result = client.call(args.op)
    emit(args, result, lambda console: console.print(RENDERERS[args.op](result)))
    return 0


def render_status(result) -> Table:
    return key_value_table("node", sorted(result.items()))


def render_nodes(result) -> Table:
    table = Table(title="mesh nodes", title_justify="left")
    for column in ("node", "stake", "zone", "health", "gpus", "free", "util %", "temp C", "rtt ms"):
        table.add_column(column)
    for node in result["nodes"]:
        cap = node.get("capability") or {}
        gpus = cap.get("gpus", [])
        util = max((g["util_milli"] for g in gpus), default=0) / 1000
        temp = max((g["temp_milli_c"] for g in gpus), default=0) / 1000
        rtt = "-" if node.get("rtt_us") is None else "%.2f" % (node["rtt_us"] / 1000)
        table.add_row(node["short"], str(node["stake"]), node["zone"], node["health"],
                      "%d x %s" % (len(gpus), gpus[0]["model"]) if gpus else "0",
                      str(len(cap.get("gpus_free", []))), "%.0f" % util, "%.0f" % temp, rtt)
    return table


def render_jobs(result) -> Table:
    table = Table(title="jobs", title_justify="left")
    for column in ("job", "name", "state", "primary", "backups", "ckpt age ms", "migrations", "why pending"):
        table.add_column(column)
    for job in result["jobs"]:
        age = job.get("checkpoint_age_ms")
        declines = "; ".join("%d: %s" % (n, r) for r, n in sorted(job.get("declines", {}).items()))
        table.add_row(_short(job["job_id"]), job["name"], job["state"], node_label(job.get("primary")),
                      ", ".join(node_label(b) for b in job.get("backups", [])), "-" if age is None else str(age),
                      str(job.get("migrations", 0)), declines if job["state"] == "pending" else "")
    return table


def render_consensus(result) -> Table:
    table = Table(title="consensus (certificates: %d, evidence: %d)"
                  % (result["certificates"], len(result["evidence"])), title_justify="left")
    for column in ("instance", "kind", "round", "leader", "decided"):
        table.add_column(column)
    for inst in result["instances"]:
        table.add_row(_short(inst["instance"]), inst["kind"], str(inst["round"]), node_label(inst["leader"]),
                      "yes" if inst["decided"] else "no")
    return table


RENDERERS = {"status": render_status, "nodes": render_nodes, "jobs": render_jobs, "consensus": render_consensus}


def cmd_events(args) -> int:
    seen = 0
    with ControlClient(args.node).subscribe() as events:
        for event in events:
            if args.json:
                print(json.dumps(event, default=lambda v: v.hex() if isinstance(v, bytes) else str(v)), flush=True)
            else:
                detail = " ".join("%s=%s" % (k, v.hex()[:12] if isinstance(v, bytes) else v)
                                  for k, v in sorted(event.get("detail", {}).items()) if k != "mono_ns")
                print("%10d %-18s %s" % (event["at_ms"], event["kind"], detail), flush=True)
            seen += 1
            if args.count and seen >= args.count:
                break
    return 0


def _signed_job_bytes(args, epoch: int) -> bytes:
    """The job to submit: a signed envelope as given, or a TOML manifest signed here for the
    node's current ``epoch`` (SPEC.md P2: the members of that epoch place it)."""
    with open(args.manifest, "rb") as fh:
        data = fh.read(1 << 20)
    if not data.lstrip()[:1].isalpha() and not data.lstrip().startswith(b"#") and not data.lstrip().startswith(b"["):
        return data  # already a signed envelope (msgpack), e.g. from `meshnode job sign`
    if not args.key:
        raise MeshError("submitting a TOML manifest needs --key OWNER_KEY to sign it")
    from keys.genesis import load_genesis
    from keys.keystore import is_encrypted, load_identity
    from meshnode.node.config import node_paths
    from meshnode.workload.manifest import load_manifest
    from protocol.messages import encode_message
    source = passphrase_source_from_args(args) if is_encrypted(args.key) else None
    identity = load_identity(args.key, source)
    job = load_manifest(args.manifest, identity.public_key, time.time_ns() // 1_000_000, epoch=epoch)
    genesis = load_genesis(node_paths(args.node).genesis)
    return encode_message(identity, genesis.mesh_id, job)


# `meshnode submit --wait` exit codes (README "Running a node"); 2 stays "bad input or no node".
WAIT_RUNNING = 0       # the job runs, or already completed
WAIT_NOT_PLACED = 1    # every member declined it, or it was still pending when the wait ended
WAIT_ENDED_BADLY = 3   # placed, but failed or was cancelled, or did not start within the wait


def cmd_submit(args) -> int:
    with ControlClient(args.node) as client:
        signed = _signed_job_bytes(args, client.call("status")["epoch"])
        result = client.call("submit", job=signed)
        if not args.wait:
            emit(args, result, lambda console: console.print(key_value_table("submitted", sorted(result.items()))))
            return 0
        result, code = _wait_running(client, result["job_id"], args.wait_s)
    emit(args, result, lambda console: console.print(key_value_table("submitted", sorted(result.items()))))
    return code


def _wait_running(client, job_id_hex: str, wait_s: float) -> tuple[dict, int]:
    """Until the job runs or ends, or every member declined it (then it stays pending), or
    ``wait_s`` passed. A placed job that never starts (its primary cannot run it) is not a
    success: the caller asked for a running job."""
    members = client.call("status")["members"]
    deadline = time.monotonic() + wait_s
    job = None
    while True:
        job = next((j for j in client.call("jobs")["jobs"] if j["job_id"] == job_id_hex), job)
        state = job["state"] if job else "submitted"
        if state == "running" or (state == "completed" and not job.get("exit_code")):
            return _wait_result(job, state, "running" if state == "running" else "completed"), WAIT_RUNNING
        if state in ("completed", "failed", "cancelled"):
            return _wait_result(job, state, "ended: %s (exit code %s)" % (state, job.get("exit_code"))), \
                WAIT_ENDED_BADLY
        if state == "pending" and sum(job.get("declines", {}).values()) >= members:
            return dict(_wait_result(job, state, "not placed: every member declined it"),
                        declines=job["declines"], hint=job.get("hint")), WAIT_NOT_PLACED
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if state in ("submitted", "pending"):
        return _wait_result(job, state, "not placed within %g s" % wait_s), WAIT_NOT_PLACED
    return _wait_result(job, state, "placed but not running within %g s" % wait_s), WAIT_ENDED_BADLY


def _wait_result(job: dict | None, state: str, outcome: str) -> dict:
    job = job or {}
    return {"job_id": job.get("job_id"), "state": state, "outcome": outcome, "primary": job.get("primary"),
            "backups": job.get("backups", []), "exit_code": job.get("exit_code")}


def cmd_why(args) -> int:
    with ControlClient(args.node) as client:
        result = client.call("why", job_id=args.job_id)

    def render(console):
        console.print(key_value_table("why %s is pending" % args.job_id[:12],
                                      [(reason, ", ".join(nodes)) for reason, nodes in result["declines"].items()]
                                      + [("hint", result.get("hint") or "-")]))
    emit(args, result, render)
    return 0


def cmd_join(args) -> int:
    with ControlClient(args.node, timeout_s=WAIT_TIMEOUT_S) as client:
        result = client.call("join", bootstrap=args.bootstrap)
    emit(args, result, lambda console: console.print(key_value_table("join", sorted(result.items()))))
    return 0
