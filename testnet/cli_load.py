"""`meshnode load`: drive HTTP services (the built-in `serve` workload) open-loop at a fixed
request rate and report sent / ok / errors / latency per target (testnet/loadgen.py)."""

from __future__ import annotations

import argparse
import json
from functools import partial

import trio

from meshnode.cli.output import add_json_flag, emit, examples
from protocol.errors import MeshError
from testnet.loadgen import (DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT_S, endpoints_of_job, follow_endpoints,
                             parse_target, run_load)

JSON_KEYS = """
--json prints one object: rps, duration_s, elapsed_s, sent, ok, errors, achieved_ok_rps,
latency_ms {p50, p99, max, n} (from when each request was due: open loop), and "targets":
one {target, weight, sent, ok, errors, error_kinds, latency_ms} per target ever driven;
endpoint_updates: how often --job's endpoint table was read again after a change.
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "load", help="drive HTTP services open-loop at N requests/s; latency and errors per target",
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=examples(
            "meshnode load --target 127.0.0.1:8080 --rps 200 --duration-s 10 --json",
            "meshnode load --target 127.0.0.1:8080=3 --target 127.0.0.1:8081=1 --rps 100 --duration-s 30",
            "meshnode load --job ea9aec16873a --node net/node-0 --rps 50 --duration-s 60 --json") + JSON_KEYS)
    parser.add_argument("--target", action="append", default=[], metavar="HOST:PORT[=WEIGHT]",
                        help="a service to drive (repeatable); WEIGHT > 0 sets its share of requests (default 1)")
    parser.add_argument("--job", default=None, metavar="JOB",
                        help="drive the job's endpoints, as the endpoint table of the node (--node) lists them")
    parser.add_argument("--node", default=None, metavar="DIR",
                        help="with --job: the node asked for its endpoints, again at each change of them "
                             "(a clone gets requests once the node applied it)")
    parser.add_argument("--rps", type=float, required=True, metavar="N",
                        help="requests per second, all targets together")
    parser.add_argument("--duration-s", type=float, required=True, metavar="S", help="how long to send")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="a request not answered within S seconds is an error (default %g)" % DEFAULT_TIMEOUT_S)
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, metavar="N",
                        help="requests due while N are outstanding are not sent, counted `shed` (default %d)"
                             % DEFAULT_MAX_IN_FLIGHT)
    add_json_flag(parser)
    parser.set_defaults(func=cmd_load)


def cmd_load(args) -> int:
    targets = [parse_target(text) for text in args.target]
    follow = None
    if args.job is not None:
        if args.node is None:
            raise MeshError("--job needs --node DIR: the node whose endpoint table lists the job's replicas")
        targets += endpoints_of_job(args.node, args.job)
        if not args.target:   # the table alone decides the targets: follow its changes
            follow = partial(follow_endpoints, args.node, args.job)
    elif args.node is not None:
        raise MeshError("--node is for --job: give the services with --target HOST:PORT")
    result = trio.run(lambda: run_load(targets, args.rps, args.duration_s, timeout_s=args.timeout_s,
                                       max_in_flight=args.max_in_flight, follow=follow))
    emit(args, result, lambda console: _render(console, result))
    return 0 if result["ok"] else 1


def _render(console, result: dict) -> None:
    from rich.table import Table
    table = Table(title="%d requests at %g/s for %g s: %d ok, %d errors" % (
        result["sent"], result["rps"], result["duration_s"], result["ok"], result["errors"]))
    for column in ("target", "weight", "sent", "ok", "errors", "p50 ms", "p99 ms", "error kinds"):
        table.add_column(column)
    for row in result["targets"]:
        latency = row["latency_ms"]
        table.add_row(row["target"], "%g" % row["weight"], str(row["sent"]), str(row["ok"]), str(row["errors"]),
                      _ms(latency["p50"]), _ms(latency["p99"]), json.dumps(row["error_kinds"]) if row["errors"] else "")
    console.print(table)


def _ms(value) -> str:
    return "-" if value is None else "%.1f" % value
