"""`meshnode job list|status|cancel|move|logs|output`: a job's life, from any node of the mesh.

Every command is a client of one node's control socket (``--node DIR``). A job is named
by its id or any unambiguous prefix of it (the 12 digits the tables show). Reading a
job's output from a node that does not run it needs the owner's key: the CLI signs each
read (an ``output_read``, SPEC.md 9.8) and the node carries it to the job's primary over
the mesh; on the node that runs the job, its operator reads without a key.
"""

from __future__ import annotations

import os
import sys
import time

from rich import box
from rich.table import Table

from keys.identity import short_id
from meshnode.cli.output import (add_json_flag, add_passphrase_args, emit, examples, key_value_table,
                                 passphrase_source_from_args, unlock_identity)
from meshnode.control.client import ControlClient, ControlError, ControlUnavailable
from meshnode.tui.tables import format_ms, gang_summary, node_label, primary_cell, short_job_id
from protocol.errors import MeshError
from protocol.messages import (MAX_OUTPUT_CHUNK_BYTES, MAX_OUTPUT_FILES, Cancel, MoveRequest, OutputRead,
                               encode_message)

TERMINAL = ("completed", "failed", "cancelled")
CALL_TIMEOUT_S = 20.0            # a read from another node may take the transport's 10 s
FOLLOW_POLL_S = 0.25
FOLLOW_RETRY_S = 15.0            # a followed log survives this long without an answer (a failover)
OUTPUT_MAX_BYTES_DEFAULT = 1 << 30
NAME_COLUMN_MAX = 16
MOVE_WAIT_S = 10.0               # `job move` waits this long for the decision, to show where the job went
LIST_COLUMN_WIDTHS = {"job": 8, "state": 9, "primary": 8, "checkpoint": 10}


def register(sub) -> None:
    def node_arg(parser):
        parser.add_argument("--node", required=True, metavar="DIR",
                            help="the data directory of the node to ask (any node of the mesh)")

    def key_arg(parser, required: bool, why: str):
        parser.add_argument("--key", required=required, metavar="OWNER_KEYSTORE", help=why)
        add_passphrase_args(parser)

    listing = sub.add_parser("list", help="every job this node knows, one row each",
                             description="Every job this node knows: state, primary, checkpoints, exit code.",
                             epilog=examples("meshnode job list --node net/node-0"))
    node_arg(listing)
    add_json_flag(listing)
    listing.set_defaults(func=cmd_list)

    status = sub.add_parser("status", help="one job: state, primary, backups, fence, checkpoint, exit code",
                            description="One job in full.",
                            epilog=examples("meshnode job status 51d37e04 --node net/node-0"))
    status.add_argument("job", metavar="JOB", help="job id or a unique prefix of it")
    node_arg(status)
    add_json_flag(status)
    status.set_defaults(func=cmd_status)

    cancel = sub.add_parser("cancel", help="stop a job everywhere (signed with the owner's key)",
                            description="Sign a Cancel with the owner's key and broadcast it.",
                            epilog=examples("meshnode job cancel 51d37e04 --key owner.key --node net/node-0"))
    cancel.add_argument("job", metavar="JOB", help="job id or a unique prefix of it")
    node_arg(cancel)
    key_arg(cancel, True, "the job owner's keystore (only the owner may cancel)")
    add_json_flag(cancel)
    cancel.set_defaults(func=cmd_cancel)

    move = sub.add_parser("move", help="move a running job to another node (signed with the owner's key)",
                          description="Sign a move request with the owner's key: the mesh decides by vote to "
                                      "move the running job to --to NODE, or to the node with room that "
                                      "placement scoring ranks best. Its primary stops it after a final "
                                      "checkpoint, which the new node resumes from (SPEC.md R2). Waits up to "
                                      "%d s for the decision, to show where it went." % MOVE_WAIT_S,
                          epilog=examples("meshnode job move 51d37e04 --key owner.key --node net/node-0",
                                          "meshnode job move 51d37e04 --to 9c1e --key owner.key --node net/node-0"))
    move.add_argument("job", metavar="JOB", help="job id or a unique prefix of it")
    move.add_argument("--to", metavar="NODE", help="the member to move it to: its key in hex, or a unique prefix "
                                                   "(`meshnode nodes` lists them); default: the mesh picks")
    node_arg(move)
    key_arg(move, True, "the job owner's keystore (only the owner may move it)")
    add_json_flag(move)
    move.set_defaults(func=cmd_move)

    logs = sub.add_parser("logs", help="the workload's stdout and stderr, from the node that runs it",
                          description="Print the job's output (stdout and stderr) that its node keeps (the newest "
                                      "8 MiB), fetched over the mesh if it runs elsewhere.",
                          epilog=examples("meshnode job logs 51d37e04 --node net/node-1 --key owner.key --follow"))
    logs.add_argument("job", metavar="JOB", help="job id or a unique prefix of it")
    node_arg(logs)
    key_arg(logs, False, "the job owner's keystore: needed when the job runs on another node")
    logs.add_argument("--follow", "-f", action="store_true",
                      help="keep printing new output until the job ends (Ctrl-C to stop)")
    logs.add_argument("--offset", type=int, default=0, metavar="N",
                      help="start at this byte of the job's output (a previous run's last offset resumes it)")
    logs.set_defaults(func=cmd_logs)

    output = sub.add_parser("output", help="copy the files a finished job left in its working directory",
                            description="Copy every regular file the job left in its working directory on its node "
                                        "into DIR (symbolic links are not followed, nothing is overwritten).",
                            epilog=examples("meshnode job output 51d37e04 --out results --node net/node-1 "
                                            "--key owner.key"))
    output.add_argument("job", metavar="JOB", help="job id or a unique prefix of it")
    output.add_argument("--out", required=True, metavar="DIR", help="where to write the files (created if missing)")
    node_arg(output)
    key_arg(output, False, "the job owner's keystore: needed when the job ran on another node")
    output.add_argument("--max-bytes", type=int, default=OUTPUT_MAX_BYTES_DEFAULT, metavar="N",
                        help="refuse if the files add up to more than N bytes (default 1 GiB)")
    add_json_flag(output)
    output.set_defaults(func=cmd_output)


# --- list and status ---------------------------------------------------------------------------

def _short_job(job_id_hex: str) -> str:
    return short_job_id(job_id_hex)   # any unique prefix names the job: this one can be copied as is


def _checkpoint_text(job: dict) -> str:
    if job.get("checkpoint_seq") is None:
        return "-"
    return "#%d %s" % (job["checkpoint_seq"], format_ms(job.get("checkpoint_age_ms")))


def _exit_text(job: dict) -> str:
    return "-" if job.get("exit_code") is None else str(job["exit_code"])


def render_job_list(result: dict) -> Table:
    # No rules and one space between columns: the row fits 80 columns with a 16-character
    # name; a longer name is cut (the ids never are, and no cell wraps).
    table = Table(title="jobs (%d)" % len(result["jobs"]), title_justify="left", box=None,
                  padding=(0, 1, 0, 0), pad_edge=False)
    for column in ("job", "name", "state", "primary", "bk", "checkpoint", "migr", "exit"):
        if column == "name":
            table.add_column(column, no_wrap=True, overflow="ellipsis", max_width=NAME_COLUMN_MAX)
        else:   # never squeezed: the name gives way
            table.add_column(column, no_wrap=True, min_width=LIST_COLUMN_WIDTHS.get(column))
    for job in sorted(result["jobs"], key=lambda j: (j.get("submitted_ms", 0), j["job_id"])):
        table.add_row(_short_job(job["job_id"]), job["name"], job["state"], primary_cell(job),
                      str(len(job.get("backups", []))), _checkpoint_text(job), str(job.get("migrations", 0)),
                      _exit_text(job))
    return table


def cmd_list(args) -> int:
    with ControlClient(args.node) as client:
        result = client.call("jobs")
    emit(args, result, lambda console: console.print(render_job_list(result)))
    return 0


def render_job_status(job: dict) -> Table:
    declines = ", ".join("%s: %d" % (reason, n) for reason, n in sorted(job.get("declines", {}).items())) or "-"
    rows = [("job", job["job_id"]), ("name", job["name"]), ("owner", short_id(bytes.fromhex(job["owner"]))),
            ("state", job["state"]), ("primary", node_label(job.get("primary"))),
            ("backups", " ".join(node_label(b) for b in job.get("backups", [])) or "-"),
            ("fence", job.get("fence", 0)),
            ("attempt", "%d of %d" % (job.get("attempt", 0) + 1, job.get("max_retries", 0) + 1)),
            ("checkpoint", _checkpoint_text(job)), ("migrations", job.get("migrations", 0)),
            ("lost work", format_ms(job.get("lost_work_ms"))), ("exit code", _exit_text(job)),
            ("runs here", "yes" if job.get("running_here") else "no")]
    if job["state"] == "pending":
        rows += [("declines", declines), ("hint", job.get("hint") or "-")]
    gang = job.get("gang")
    if gang is not None:   # one job, its ranks listed (SPEC.md GA4)
        rows += [("gang", gang_summary(gang))]
        rows += [("rank %d" % w["rank"], "%s %s fence %d" % (node_label(w.get("primary")), w["state"], w["fence"]))
                 for w in gang["workers"]]
    if job.get("gang_of"):
        rows += [("gang", "rank %d of %s" % (job["gang_of"]["rank"], _short_job(job["gang_of"]["gang_id"])))]
    return key_value_table("job %s" % _short_job(job["job_id"]), rows)  # the 64-digit id fits whole at 80


def cmd_status(args) -> int:
    with ControlClient(args.node) as client:
        job = client.call("job_status", job_id=args.job)
    emit(args, job, lambda console: console.print(render_job_status(job)))
    return 0


# --- cancel --------------------------------------------------------------------------------------

def _owner_identity(args):
    return unlock_identity(args, args.key, passphrase_source_from_args(args))


def cmd_cancel(args) -> int:
    with ControlClient(args.node) as client:
        node = client.call("status")
        job = client.call("job_status", job_id=args.job)
        if job["state"] in TERMINAL:
            raise MeshError("job %s already ended (%s): nothing to cancel" % (_short_job(job["job_id"]), job["state"]))
        identity = _owner_identity(args)
        if identity.public_key.hex() != job["owner"]:
            raise MeshError("%s is not the key of job %s's owner (%s): only the owner may cancel it"
                            % (args.key, _short_job(job["job_id"]), short_id(bytes.fromhex(job["owner"]))))
        request = encode_message(identity, bytes.fromhex(node["mesh_id"]),
                                 Cancel(job_id=bytes.fromhex(job["job_id"]), requested_ms=time.time_ns() // 1_000_000))
        client.call("cancel", request=request)
        after = client.call("job_status", job_id=job["job_id"])
    result = {"job_id": job["job_id"], "cancelled": True, "state": after["state"]}
    emit(args, result, lambda console: console.print(
        "job %s: cancel signed and sent; state here: %s" % (_short_job(job["job_id"]), after["state"])))
    return 0


# --- move -----------------------------------------------------------------------------------------

def _member_key(client, text: str) -> bytes:
    """The member whose key (hex) starts with ``text``."""
    text = text.lower()
    keys = [row["key"] for row in client.call("nodes")["nodes"] if row["key"].startswith(text)]
    if len(keys) != 1:
        raise MeshError("--to %s names %s: give a member's key or a unique prefix (`meshnode nodes`)"
                        % (text, "no member" if not keys else "%d members" % len(keys)))
    return bytes.fromhex(keys[0])


def cmd_move(args) -> int:
    with ControlClient(args.node) as client:
        node = client.call("status")
        job = client.call("job_status", job_id=args.job)
        short = _short_job(job["job_id"])
        if job["state"] != "running":
            raise MeshError("job %s is %s, not running: only a running job can be moved" % (short, job["state"]))
        identity = _owner_identity(args)
        if identity.public_key.hex() != job["owner"]:
            raise MeshError("%s is not the key of job %s's owner (%s): only the owner may move it"
                            % (args.key, short, short_id(bytes.fromhex(job["owner"]))))
        to_node = _member_key(client, args.to) if args.to else b""
        request = encode_message(identity, bytes.fromhex(node["mesh_id"]),
                                 MoveRequest(job_id=bytes.fromhex(job["job_id"]), fence=job["fence"], to_node=to_node,
                                             requested_ms=time.time_ns() // 1_000_000))
        client.call("move", request=request)
        after = job
        deadline = time.monotonic() + MOVE_WAIT_S
        while time.monotonic() < deadline:
            after = client.call("job_status", job_id=job["job_id"])
            if after["fence"] != job["fence"]:
                break
            time.sleep(FOLLOW_POLL_S)
    moved = after["fence"] != job["fence"]
    result = {"job_id": job["job_id"], "moved": moved, "from": job["primary"], "to": after["primary"],
              "fence": after["fence"], "state": after["state"]}
    emit(args, result, lambda console: console.print(
        "job %s: moved from %s to %s (fence %d), %s" % (short, job["primary"][:12], after["primary"][:12],
                                                          after["fence"], after["state"]) if moved else
        "job %s: move requested; not decided yet after %d s (state %s, fence %d)"
        % (short, MOVE_WAIT_S, after["state"], after["fence"])))
    return 0


# --- output ---------------------------------------------------------------------------------------

class OutputReader:
    """Reads a job's output through one node, signing each read when an owner key is given."""

    def __init__(self, client: ControlClient, job_id_hex: str, identity=None):
        self.client = client
        self.job_id_hex = job_id_hex
        self.identity = identity
        node = client.call("status")
        self.node_key = bytes.fromhex(node["node"])
        self.mesh_id = bytes.fromhex(node["mesh_id"])

    def read(self, target: str, path: str = "", offset: int = 0, max_bytes: int = MAX_OUTPUT_CHUNK_BYTES) -> dict:
        args = {"job_id": self.job_id_hex, "target": target, "path": path, "offset": offset, "max_bytes": max_bytes}
        if self.identity is not None:
            read = OutputRead(job_id=bytes.fromhex(self.job_id_hex), target=target, path=path, offset=offset,
                              max_bytes=max_bytes, via=self.node_key, requested_ms=time.time_ns() // 1_000_000)
            args["request"] = encode_message(self.identity, self.mesh_id, read)
        return self.client.call("job_output", **args)


def _identity_or_none(args):
    return _owner_identity(args) if args.key else None


def follow_log(reader: OutputReader, client: ControlClient, offset: int, follow: bool, out, note,
               sleep=time.sleep, clock=time.monotonic) -> int:
    """Write the job's log from ``offset`` to ``out``; with ``follow`` until the job ended and
    all of its output was read. Returns the offset reached. A node that moved the job
    (a migration) starts a new log: it is announced with ``note`` and read from its start."""
    primary = None
    last_answer = clock()
    while True:
        try:
            if follow and primary is None:
                job = client.call("job_status", job_id=reader.job_id_hex)
                if job.get("primary") is None and job["state"] not in TERMINAL:
                    sleep(FOLLOW_POLL_S)   # not placed yet
                    continue
            chunk = reader.read("log", offset=offset)
        except (ControlError, ControlUnavailable):
            # The first read fails loudly (not the owner, unknown job); a followed log that
            # was flowing waits out a failover instead.
            if not follow or primary is None or clock() - last_answer > FOLLOW_RETRY_S:
                raise
            sleep(FOLLOW_POLL_S)
            continue
        last_answer = clock()
        if primary is not None and chunk["primary"] != primary:
            note("job moved to node %s; its output there follows" % node_label(chunk["primary"]))
            primary, offset = chunk["primary"], 0
            continue
        primary = chunk["primary"]
        if chunk["offset"] > offset:
            note("%d bytes of output were rotated out before they were read" % (chunk["offset"] - offset))
        data = chunk["data"]
        if data:
            out.write(data)
            out.flush()
        offset = chunk["offset"] + len(data)
        if len(data) == MAX_OUTPUT_CHUNK_BYTES:
            continue   # more is waiting
        if not follow or (chunk["state"] in TERMINAL and not chunk["running"] and offset >= chunk["end"]):
            return offset
        sleep(FOLLOW_POLL_S)


def cmd_logs(args) -> int:
    if args.offset < 0:
        raise MeshError("--offset must be >= 0")
    with ControlClient(args.node, timeout_s=CALL_TIMEOUT_S) as client:
        job = client.call("job_status", job_id=args.job)
        reader = OutputReader(client, job["job_id"], _identity_or_none(args))

        def note(text: str) -> None:
            print("meshnode: %s" % text, file=sys.stderr, flush=True)
        follow_log(reader, client, args.offset, args.follow, sys.stdout.buffer, note)
    return 0


def cmd_output(args) -> int:
    from meshnode.node.output_files import OutputWriter
    with ControlClient(args.node, timeout_s=CALL_TIMEOUT_S) as client:
        job = client.call("job_status", job_id=args.job)
        if job["state"] not in TERMINAL:
            raise MeshError("job %s is still %s: its files are copied once it ended (`meshnode job logs %s --follow` "
                            "waits for that)" % (_short_job(job["job_id"]), job["state"], _short_job(job["job_id"])))
        reader = OutputReader(client, job["job_id"], _identity_or_none(args))
        files = reader.read("files")["files"]
        total = sum(f["size"] for f in files)
        if total > args.max_bytes:
            raise MeshError("job %s left %d files of %d bytes in all, over --max-bytes %d"
                            % (_short_job(job["job_id"]), len(files), total, args.max_bytes))
        writer = OutputWriter(args.out)
        copied = 0
        for entry in files:
            copied += _copy_file(reader, writer, entry)
    result = {"job_id": job["job_id"], "out": os.path.abspath(args.out), "bytes": copied, "files": files,
              "truncated_list": len(files) >= MAX_OUTPUT_FILES}

    def render(console):
        console.print("job %s: %d files, %d bytes -> %s" % (_short_job(job["job_id"]), len(files), copied, args.out))
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("file", overflow="fold")
        table.add_column("bytes", justify="right", no_wrap=True)
        for entry in files:
            table.add_row(entry["path"], str(entry["size"]))
        console.print(table)
        if result["truncated_list"]:
            console.print("only the first %d files were listed" % MAX_OUTPUT_FILES)
    emit(args, result, render)
    return 0


def _copy_file(reader: OutputReader, writer, entry: dict) -> int:
    fd = writer.open(entry["path"])
    written = 0
    try:
        while written < entry["size"]:
            chunk = reader.read("file", path=entry["path"], offset=written)
            data = chunk["data"]
            if not data:
                break   # the file shrank since it was listed
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            written += len(data)
    finally:
        os.close(fd)
    return written
