"""The `meshnode` console command.

Each area of the CLI lives in its own ``meshnode/cli_*.py`` module that exposes
``register(subparsers)``; every subcommand sets ``func(args) -> int``. Errors the
project raises on purpose (``MeshError``) become one line on stderr and exit code 2,
never a traceback; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from protocol.errors import MeshError

# Top-level command -> the module whose register() adds it. A module may add several
# commands; it must add exactly those mapped to it here. Modules are imported lazily,
# per command, so `meshnode keys show` does not pay for importing libp2p.
COMMAND_MODULES = {
    "keys": "meshnode.cli_keys",
    "mesh": "meshnode.cli_mesh",
    "job": "meshnode.cli_job",
    "run": "meshnode.cli_node",
    "status": "meshnode.cli_node",
    "nodes": "meshnode.cli_node",
    "jobs": "meshnode.cli_node",
    "events": "meshnode.cli_node",
    "submit": "meshnode.cli_node",
    "why": "meshnode.cli_node",
    "consensus": "meshnode.cli_node",
    "join": "meshnode.cli_node",
    "testnet": "meshnode.cli_testnet",
    "demo": "meshnode.cli_demo",
    "cert": "meshnode.cli_cert",
    "tui": "meshnode.cli_tui",
    "bench": "meshnode.cli_bench",
    "sim": "meshnode.cli_sim",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshnode", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    wanted = set(COMMAND_MODULES.values()) if only is None else {COMMAND_MODULES[only]}
    for module_name in sorted(wanted):
        importlib.import_module(module_name).register(subparsers)
    for name, module_name in COMMAND_MODULES.items():
        if module_name not in wanted:
            subparsers.add_parser(name, help="(run `meshnode %s --help`)" % name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMAND_MODULES else None)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MeshError as exc:
        print("meshnode: error: %s" % exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `meshnode ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
