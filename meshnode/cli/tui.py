"""`meshnode tui`: the workload owner's terminal UI, or a one-shot snapshot of it."""

from __future__ import annotations

import argparse
import sys

from keys.errors import ConfigError
from meshnode.cli.output import add_json_flag, emit, examples

SNAPSHOT_OPS = ("status", "nodes", "jobs", "consensus")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tui", help="watch the mesh; compose, sign, follow and cancel jobs", epilog=examples(
            "meshnode tui --node net/node-0 --key net/owners/owner-0.key",
            "meshnode tui --node net/node-0 --snapshot     # the tables once, no terminal needed"))
    parser.add_argument("--node", required=True, metavar="DIR", help="the node's data directory (holds control.sock)")
    parser.add_argument("--key", metavar="OWNER_KEY", help="the owner's keystore, used to sign jobs and cancels")
    parser.add_argument("--snapshot", action="store_true",
                        help="print the mesh, job and consensus tables once and exit (no terminal needed)")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def fetch_snapshot(node_dir: str) -> dict:
    """One answer to each polled op, over the synchronous control client."""
    from meshnode.control.client import ControlClient
    with ControlClient(node_dir) as client:
        return {op: client.call(op) for op in SNAPSHOT_OPS}


def run(args: argparse.Namespace) -> int:
    if args.snapshot or args.json:
        from meshnode.tui.tables import render_snapshot
        snapshot = fetch_snapshot(args.node)
        emit(args, snapshot, lambda console: render_snapshot(snapshot, console))
        return 0
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ConfigError("meshnode tui needs a terminal; use --snapshot to print the tables once")
    from meshnode.tui.app import OwnerTui
    OwnerTui(args.node, args.key).run()
    return 0
