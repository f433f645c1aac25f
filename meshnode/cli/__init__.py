"""The `meshnode` console command.

Each area of the CLI lives in its own module that exposes ``register(subparsers)``;
every subcommand sets ``func(args) -> int``. The node's own areas are the modules of
this package (``COMMAND_MODULES``). Other packages add commands through the entry-point
group ``meshnode.commands`` (name: the command, value: ``module:register``); testnet/
adds ``testnet``, ``sim``, ``bench`` and ``demo`` that way (pyproject.toml), so the
node never imports the testnet that drives it. Errors the project raises on purpose
(``MeshError``) become one line on stderr and exit code 2, never a traceback; Ctrl-C
exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

from meshnode.cli.output import CommandParser, examples
from protocol.errors import MeshError

COMMAND_GROUP = "meshnode.commands"

# Top-level command -> the module whose register() adds it. A module may add several
# commands; it must add exactly those mapped to it here. Modules are imported lazily,
# per command, so `meshnode keys show` does not pay for importing libp2p.
COMMAND_MODULES = {
    "keys": "meshnode.cli.keys",
    "mesh": "meshnode.cli.mesh",
    "job": "meshnode.cli.job",
    "run": "meshnode.cli.node",
    "status": "meshnode.cli.node",
    "nodes": "meshnode.cli.node",
    "jobs": "meshnode.cli.node",
    "events": "meshnode.cli.node",
    "submit": "meshnode.cli.node",
    "why": "meshnode.cli.node",
    "endpoints": "meshnode.cli.endpoints",
    "consensus": "meshnode.cli.node",
    "join": "meshnode.cli.node",
    "cert": "meshnode.cli.cert",
    "tui": "meshnode.cli.tui",
    "node": "meshnode.cli.dev",
    "dev": "meshnode.cli.dev",
}


# The top-level help lists the commands by what users do with them. A command named in no
# group (e.g. one a newly installed package adds) is listed under "other commands".
COMMAND_GROUPS = (
    ("operate a node", ("keys", "mesh", "node", "run", "join")),
    ("own jobs", ("job", "submit", "tui")),
    ("inspect a node", ("status", "nodes", "jobs", "why", "endpoints", "consensus", "events", "metrics",
                        "cert")),
    ("test and try", ("dev", "testnet", "sim", "bench", "demo")),
)
TOP_LEVEL_EXAMPLES = (
    "meshnode testnet up --nodes 4 --dir net          # a local mesh of 4 node processes",
    "meshnode submit jobs/counter.toml --key net/owners/owner-0.key --node net/node-0 --wait",
    "meshnode tui --node net/node-0 --key net/owners/owner-0.key",
    "meshnode COMMAND --help                          # what a command's flags do, with examples",
)


def plugin_commands() -> dict[str, metadata.EntryPoint]:
    """Commands other installed packages add (entry-point group ``meshnode.commands``).

    A name the node already has stays the node's."""
    return {ep.name: ep for ep in metadata.entry_points(group=COMMAND_GROUP) if ep.name not in COMMAND_MODULES}


def _registrar(target: str | metadata.EntryPoint) -> str:
    """What registers a command: a module name, or an entry point's ``module:function``."""
    return target if isinstance(target, str) else target.value


def _load_register(target: str | metadata.EntryPoint):
    return importlib.import_module(target).register if isinstance(target, str) else target.load()


def build_parser(only: str | None = None, plugins: dict[str, metadata.EntryPoint] | None = None
                 ) -> argparse.ArgumentParser:
    """The parser with ``only``'s module registered (every module when None); each other
    command gets a placeholder, so `meshnode --help` lists them all."""
    parser = CommandParser(prog="meshnode", usage="meshnode [-h] COMMAND [ARGS...]",
                           description="meshnode: a mesh of GPU nodes that places workloads by a signed, "
                                       "stake-weighted vote and moves them when a node fails.")
    # The flat list argparse would print is replaced by the grouped one in the epilog.
    # prog: with a usage of its own, argparse would put that whole usage in front of each command's.
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", help=argparse.SUPPRESS, prog="meshnode")
    subparsers.required = True
    plugins = plugin_commands() if plugins is None else plugins
    commands: dict[str, str | metadata.EntryPoint] = {**COMMAND_MODULES, **plugins}
    by_registrar = {_registrar(target): target for target in commands.values()}  # several commands, one module
    wanted = set(by_registrar) if only is None else {_registrar(commands[only])}
    for registrar in sorted(wanted):
        _load_register(by_registrar[registrar])(subparsers)
    for name, target in commands.items():
        if _registrar(target) not in wanted:
            subparsers.add_parser(name, help="(run `meshnode %s --help`)" % name)
    parser.epilog = grouped_commands_help(subparsers) + "\n\n" + examples(*TOP_LEVEL_EXAMPLES)
    return parser


def grouped_commands_help(subparsers) -> str:
    """Every command with its one-line help, under the heading of what it is for."""
    # argparse keeps each command's help only on its pseudo-action in _choices_actions
    # (add_parser pops it before building the parser); that list is the one argparse
    # itself prints, so reading it shows exactly what the default listing would.
    helps = {action.dest: action.help or "" for action in subparsers._choices_actions}
    width = max(len(name) for name in helps) + 2
    grouped = {name for _title, names in COMMAND_GROUPS for name in names}
    sections = [(title, [n for n in names if n in helps]) for title, names in COMMAND_GROUPS]
    sections.append(("other commands", sorted(n for n in helps if n not in grouped)))
    lines = ["commands, by what you do with them:"]
    for title, names in sections:
        if names:
            lines.append("  %s:" % title)
            lines += ["    %-*s%s" % (width, name, helps[name]) for name in names]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in COMMAND_MODULES:
        parser = build_parser(first, plugins={})  # a node command: no need to scan installed packages
    else:
        plugins = plugin_commands()
        if first is not None and not plugins:  # e.g. `meshnode testnet` from a stale install
            print("meshnode: no commands from installed packages (entry-point group %s); "
                  "reinstall the project (pip install -e .) to get testnet, sim, bench and demo"
                  % COMMAND_GROUP, file=sys.stderr)
        parser = build_parser(first if first in plugins else None, plugins)
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
