"""Shared CLI helpers: `--json` vs rich tables, and passphrase options.

Every query command adds ``--json`` with :func:`add_json_flag` and prints through
:func:`emit`, which writes one JSON document for scripts or calls the command's own
``render(console)`` for humans. Commands that open a keystore add the passphrase
options with :func:`add_passphrase_args` and turn them into a
:class:`keys.keystore.PassphraseSource` with :func:`passphrase_source_from_args`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from keys.keystore import PassphraseSource


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def emit(args: argparse.Namespace, data: Any, render: Callable[[Console], None]) -> None:
    """Print ``data`` as JSON when ``--json`` was given, else let ``render`` draw it."""
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        render(Console())


def key_value_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    """A two-column table for one object's fields (the common human view)."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def add_passphrase_args(parser: argparse.ArgumentParser) -> None:
    """--passphrase-file / --passphrase-env; with neither, the passphrase is prompted for."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--passphrase-file", metavar="FILE",
                       help="read the keystore passphrase from the first line of FILE")
    group.add_argument("--passphrase-env", metavar="NAME",
                       help="read the keystore passphrase from environment variable NAME")


def passphrase_source_from_args(args: argparse.Namespace) -> PassphraseSource:
    if args.passphrase_file:
        return PassphraseSource.from_file(args.passphrase_file)
    if args.passphrase_env:
        return PassphraseSource.from_env(args.passphrase_env)
    return PassphraseSource.prompt()
