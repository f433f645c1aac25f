"""`meshnode endpoints JOB`: a job's endpoint table (SPEC.md R4e), from any member.

Every member derives the same table from the same decided replica actions, so any node's
answer is the mesh's: one row per replica, the node running it, that node's address, the
job's service port, and the weight a client gives it (its share of the requests)."""

from __future__ import annotations

from rich.table import Table

from meshnode.cli.output import add_json_flag, emit, examples
from meshnode.control.client import ControlClient
from meshnode.tui.tables import node_label, short_job_id


def register(subparsers) -> None:
    endpoints = subparsers.add_parser(
        "endpoints", help="a job's endpoint table: replica -> node address, service port, weight",
        epilog=examples("meshnode endpoints 8c322d0f --node net/node-0",
                        "meshnode endpoints 8c322d0f --node net/node-0 --json   # for load generators"))
    endpoints.add_argument("job_id", metavar="JOB_ID", help="the job's id, or a prefix of it that names one job")
    endpoints.add_argument("--node", required=True, metavar="DIR",
                           help="the data directory of the node to ask (any member: they all hold the same table)")
    add_json_flag(endpoints)
    endpoints.set_defaults(func=cmd_endpoints)


def cmd_endpoints(args) -> int:
    with ControlClient(args.node) as client:
        result = client.call("endpoints", job_id=args.job_id)
    emit(args, result, lambda console: console.print(endpoints_table(result)))
    return 0


def endpoints_table(result: dict) -> Table:
    total = result.get("total_weight") or 0
    table = Table(title="endpoints of job %s (%s, %s)" % (short_job_id(result["job_id"]), result.get("name"),
                                                         result.get("state")))
    for column in ("replica", "node", "address", "port", "weight", "share"):
        table.add_column(column, justify="right" if column in ("replica", "port", "weight", "share") else "left")
    for row in result.get("endpoints", ()):
        share = "%.1f%%" % (100 * row["weight"] / total) if total else "-"
        table.add_row(str(row["replica"]), node_label(row["node"]), row.get("address") or "-",
                      str(row["port"]) if row.get("port") else "-", str(row["weight"]), share)
    return table
