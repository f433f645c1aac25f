"""`meshnode run` and the commands that talk to a running node over its control socket."""

from __future__ import annotations

import json
import time

from rich.console import Group
from rich.table import Table

from meshnode.cli.output import (add_json_flag, add_passphrase_args, emit, examples, ids_then_fields, key_value_table,
                                 passphrase_source_from_args, progress, unlock_identity)
from meshnode.control.client import ControlClient
from meshnode.tui.tables import (consensus_table, event_line, evidence_table, format_ms, jobs_table, mesh_table,
                                 gang_lines, node_label, short_job_id)
from meshnode.tui.why import format_declines, group_declines, queue_rows
from protocol.errors import MeshError

COMMANDS = ("run", "status", "nodes", "jobs", "events", "submit", "why", "consensus", "join")
WAIT_TIMEOUT_S = 30


def _node_arg(parser) -> None:
    parser.add_argument("--node", required=True, metavar="DIR",
                        help="the node's data directory (its control.sock is how this command reaches it)")


QUERIES = (  # (command, help, what its example adds)
    ("status", "the node's identity, mesh, epoch and connections", ""),
    ("nodes", "mesh members with stake, zone, health and capability", ""),
    ("jobs", "jobs with state, primary, backups, checkpoints", " --json"),
    ("consensus", "consensus instances, certificates and evidence", ""),
)


def register(subparsers) -> None:
    run = subparsers.add_parser("run", help="run a node until SIGINT/SIGTERM",
                                epilog=examples("meshnode run --node /var/lib/meshnode/node-a"))
    run.add_argument("--node", "--dir", dest="node", required=True, metavar="DIR",
                     help="the node's data directory (`meshnode node init` writes one)")
    run.add_argument("--no-workloads", action="store_true",
                     help="decide placements but start no workload processes (consensus benchmarks)")
    run.set_defaults(func=cmd_run)
    for name, help_text, example_flags in QUERIES:
        parser = subparsers.add_parser(name, help=help_text,
                                       epilog=examples("meshnode %s --node net/node-0%s" % (name, example_flags)))
        _node_arg(parser)
        add_json_flag(parser)
        parser.set_defaults(func=cmd_query, op=name)
    events = subparsers.add_parser("events", help="follow the node's events (Ctrl-C to stop)", epilog=examples(
        "meshnode events --node net/node-0", "meshnode events --node net/node-0 --count 20 --json"))
    _node_arg(events)
    events.add_argument("--count", type=int, default=0, metavar="N", help="stop after N events (default: follow)")
    add_json_flag(events)
    events.set_defaults(func=cmd_events)
    submit = subparsers.add_parser("submit", help="sign a manifest with the owner key and submit it", epilog=examples(
        "meshnode submit jobs/counter.toml --key owner.key --node net/node-0 --wait",
        "meshnode submit counter.job --node net/node-0          # a job signed by `meshnode job sign`"))
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
    why = subparsers.add_parser("why", help="why a job is pending: declines grouped by reason",
                                epilog=examples("meshnode why 8c322d0f --node net/node-0"))
    why.add_argument("job_id", metavar="JOB_ID", help="the job's id, or a prefix of it that names one job")
    _node_arg(why)
    add_json_flag(why)
    why.set_defaults(func=cmd_why)
    join = subparsers.add_parser("join", help="ask a mesh to admit this node (membership consensus)", epilog=examples(
        "meshnode join --node net/node-4 --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW..."))
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


def cmd_query(args) -> int:
    with ControlClient(args.node) as client:
        result = client.call(args.op)
    emit(args, result, lambda console: console.print(RENDERERS[args.op](result)))
    return 0


def render_status(result) -> Group:
    """The node's status; keys and ids in full (they fit, and they are what one copies)."""
    id_rows = [("node", node_label(result.get("node"))), ("public key", result.get("node")),
               ("peer id", result.get("peer_id")), ("mesh id", result.get("mesh_id"))]
    rows = [("epoch", result.get("epoch")),
            ("members", result.get("members")), ("member", result.get("member")),
            ("evicted at epoch", result.get("evicted_at_epoch")), ("halted", result.get("halted")),
            ("connected peers", result.get("connected")), ("uptime", format_ms(result.get("uptime_ms"))),
            ("running workloads", result.get("running_workloads"))]
    shown = {"node", "peer_id", "mesh_id", "epoch", "members", "member", "evicted_at_epoch", "halted", "connected",
             "uptime_ms", "running_workloads"}
    rows += [(name.replace("_", " "), value) for name, value in sorted(result.items()) if name not in shown]
    return ids_then_fields("node %s" % node_label(result.get("node")), id_rows, rows)


def render_nodes(result) -> Table:
    return mesh_table(result["nodes"])  # the TUI's mesh view, cell for cell


def render_jobs(result) -> Table:
    return jobs_table(result["jobs"])  # the TUI's jobs view, cell for cell


def render_consensus(result) -> Group:
    tables = [consensus_table(result)]
    if result.get("evidence"):
        tables.append(evidence_table(result))
    return Group(*tables)


RENDERERS = {"status": render_status, "nodes": render_nodes, "jobs": render_jobs, "consensus": render_consensus}


def cmd_events(args) -> int:
    seen = 0
    with ControlClient(args.node).subscribe() as events:
        for event in events:
            if args.json:
                print(json.dumps(event, default=lambda v: v.hex() if isinstance(v, bytes) else str(v)), flush=True)
            else:  # the TUI's events view, line for line
                print(event_line(event, time.time_ns() // 1_000_000), flush=True)
            seen += 1
            if args.count and seen >= args.count:
                break
    return 0


def read_job_file(path: str) -> tuple[str | None, bytes]:
    """The file ``meshnode submit`` was given: ``(text, data)`` for a TOML manifest, or
    ``(None, data)`` for a job already signed (``meshnode job sign``), checked here.

    A signed job is a msgpack array, whose first byte is never valid UTF-8, so UTF-8 text
    is a manifest and anything else must verify as a signed job: a binary file named
    ``.toml`` is reported as what it is, not as a node's "not valid msgpack"."""
    from meshnode.workload.manifest import MAX_MANIFEST_BYTES, verify_signed_job
    from protocol import codec
    from protocol.errors import ManifestError, RemoteProtocolError
    try:
        with open(path, "rb") as fh:
            data = fh.read(max(MAX_MANIFEST_BYTES, codec.MAX_FRAME_BYTES) + 1)
    except OSError as exc:
        raise ManifestError("cannot read %s: %s" % (path, exc.strerror)) from None
    try:
        return data.decode("utf-8"), data
    except UnicodeDecodeError:
        pass
    try:
        verify_signed_job(data)
    except RemoteProtocolError as exc:
        raise ManifestError("%s is neither a TOML manifest (it is not UTF-8 text) nor a signed job (%s)"
                            % (path, exc)) from None
    return None, data


def _signed_job_bytes(args, text: str | None, data: bytes, epoch: int) -> bytes:
    """The job to submit: a signed envelope as given, or a TOML manifest signed here for the
    node's current ``epoch`` (SPEC.md P2: the members of that epoch place it)."""
    if text is None:
        return data
    from keys.genesis import load_genesis
    from meshnode.node.config import node_paths
    from meshnode.workload.manifest import parse_manifest
    from protocol.messages import encode_message
    identity = unlock_identity(args, args.key, passphrase_source_from_args(args))
    job = parse_manifest(text, identity.public_key, time.time_ns() // 1_000_000, epoch=epoch)
    genesis = load_genesis(node_paths(args.node).genesis)
    return encode_message(identity, genesis.mesh_id, job)


# `meshnode submit --wait` exit codes (README "Running a node"); 2 stays "bad input or no node".
WAIT_RUNNING = 0       # the job runs, or already completed
WAIT_NOT_PLACED = 1    # every member declined it, or it was still pending when the wait ended
WAIT_ENDED_BADLY = 3   # placed, but failed or was cancelled, or did not start within the wait


def cmd_submit(args) -> int:
    text, data = read_job_file(args.manifest)  # a bad file is the user's to fix, node or no node
    if text is not None and not args.key:
        raise MeshError("submitting a TOML manifest needs --key OWNER_KEY to sign it")
    with ControlClient(args.node) as client:
        signed = _signed_job_bytes(args, text, data, client.call("status")["epoch"])
        result = client.call("submit", job=signed)
        if not args.wait:
            emit(args, result, lambda console: console.print(render_submitted(result)))
            return 0
        with progress(args, "job %s submitted; waiting until it runs" % short_job_id(result["job_id"])):
            result, code = _wait_running(client, result["job_id"], args.wait_s)
    emit(args, result, lambda console: console.print(render_submitted(result)))
    return code


def render_submitted(result: dict) -> Table:
    """The submitted job: its full id (to copy), and with --wait how the wait ended, where
    the job runs, or why it was not placed."""
    rows = [("job id", result["job_id"]), ("state", result.get("state", "submitted"))]
    if result.get("outcome"):
        rows.append(("outcome", result["outcome"]))
    if result.get("primary"):
        rows += [("primary", node_label(result["primary"])),
                 ("backups", " ".join(node_label(b) for b in result.get("backups", ())) or "-")]
    if result.get("exit_code") is not None:
        rows.append(("exit code", result["exit_code"]))
    if result.get("declines"):
        rows += [("declined", format_declines(result["declines"])), ("node says", result.get("hint"))]
    return key_value_table("submitted", rows)


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
    emit(args, result, lambda console: render_why(console, result))
    return 0


def render_why(console, result: dict) -> None:
    """Declines grouped by reason for a pending job; for any other state, that state; for a
    gang then its rule, ranks, groups and recovery history."""
    job = short_job_id(result["job_id"])
    preempted_by = result.get("preempted_by")
    borrowing = result.get("borrowing")   # SPEC Q6: on borrowed quota, reclaimable by in-quota work
    if result.get("state") != "pending":
        console.print("job %s is %s, not pending: no decline holds it back%s" % (
            job, result.get("state", "?"), "" if not preempted_by else
            " (it was preempted by job %s, and resumed)" % short_job_id(preempted_by)))
        if borrowing:
            console.print(borrowing, markup=False, highlight=False)
        _print_gang(console, result)
        return
    groups = group_declines(result.get("declines", {}))
    preempted = [("preempted by", "job %s, to place it (SPEC P8); resumes from its checkpoint when capacity "
                  "returns" % short_job_id(preempted_by))] if preempted_by else []
    preempted += [("quota", borrowing)] if borrowing else []
    console.print(key_value_table("why job %s is pending" % job, preempted + [
        (group.text, " ".join(group.nodes)) for group in groups] + [("node says", result.get("hint") or "-")]
        + queue_rows(result.get("queue"))))
    _print_gang(console, result)


def _print_gang(console, result: dict) -> None:
    """A gang's rule, ranks, topology groups and recovery history (the TUI's why screen too)."""
    if result.get("gang"):
        console.print("\n".join(gang_lines(result["gang"])), markup=False, highlight=False)


def cmd_join(args) -> int:
    with ControlClient(args.node, timeout_s=WAIT_TIMEOUT_S) as client:
        result = client.call("join", bootstrap=args.bootstrap)
    emit(args, result, lambda console: console.print(key_value_table("join", sorted(result.items()))))
    return 0
