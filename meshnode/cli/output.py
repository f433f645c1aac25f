"""Shared CLI helpers: the parser class, `--json` vs rich tables, progress, passphrases.

Every parser is a :class:`CommandParser` (argparse hands a parser's class down to its
subcommands), so each command's ``epilog`` of examples keeps its line breaks: build it
with :func:`examples`. Every query command adds ``--json`` with :func:`add_json_flag`
and prints through :func:`emit`, which writes one JSON document for scripts or calls the
command's own ``render(console)`` for humans. Slow steps run inside :func:`progress`: a
spinner on a terminal, nothing with ``--json`` or when stderr is not a terminal.
Commands that open a keystore add the passphrase options with
:func:`add_passphrase_args`, turn them into a :class:`keys.keystore.PassphraseSource`
with :func:`passphrase_source_from_args`, and open it with :func:`unlock_identity`.

Tables follow one rule for names (README "Names in tables"): a node is its 8-hex
``short_id`` label, a job its 8-hex id prefix, full ids only in ``--json``; cells are
plain text, never Python reprs; ids are never cut with an ellipsis or folded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Callable, Iterator

from rich import box
from rich.console import Console, Group
from rich.table import Table

from keys.keystore import PassphraseSource, is_encrypted, load_identity
from meshnode.tui.tables import plain_text


class CommandParser(argparse.ArgumentParser):
    """The parser of `meshnode` and of each of its commands: epilogs (examples) keep their lines."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)


def examples(*command_lines: str) -> str:
    """A command's ``epilog``: the example command lines, one per line."""
    return "example%s:\n%s" % ("s" if len(command_lines) > 1 else "", "\n".join("  " + c for c in command_lines))


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document (full ids) instead of tables; no progress output")


def emit(args: argparse.Namespace, data: Any, render: Callable[[Console], None]) -> None:
    """Print ``data`` as JSON when ``--json`` was given, else let ``render`` draw it."""
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        render(Console())


def key_value_table(title: str | None, rows: list[tuple[str, Any]]) -> Table:
    """A two-column view of one object's fields, borderless: a 64-hex id fits in 80
    columns whole beside a field name of up to 14 characters (a view with longer names
    puts its ids in a table of their own, as `status` and the job views do)."""
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False,
                  padding=(0, 2, 0, 0))
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for name, value in rows:
        table.add_row(str(name), plain_text(value))
    return table


def ids_then_fields(title: str, id_rows: list[tuple[str, Any]], rows: list[tuple[str, Any]]) -> Group:
    """One object's view as two key-value tables laid out alike: its full ids first,
    under short field names so each id fits 80 columns whole, then its other fields."""
    return Group(key_value_table(title, id_rows), key_value_table(None, rows))


def print_command(console: Console, command_line: str) -> None:
    """A command line for the user to copy: one line however narrow the terminal (the
    terminal may wrap it on screen; a copy of it is still one command)."""
    console.print(command_line, soft_wrap=True, highlight=False, markup=False)


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


class Progress:
    """What a slow step shows: ``update(text)`` changes the spinner's line (no-op when quiet)."""

    def __init__(self, status=None):
        self._status = status

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)


@contextlib.contextmanager
def progress(args: argparse.Namespace, text: str) -> Iterator[Progress]:
    """A spinner with ``text`` on stderr while the block runs, on a terminal only: scripts
    (``--json``, or stderr not a terminal) see nothing but the result."""
    if getattr(args, "json", False) or not stderr_is_terminal():
        yield Progress()
        return
    with Console(stderr=True, force_terminal=True).status(text) as status:
        yield Progress(status)


def add_passphrase_args(parser: argparse.ArgumentParser) -> None:
    """--passphrase-file / --passphrase-env; with neither, the passphrase is prompted for."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--passphrase-file", metavar="FILE",
                       help="read the keystore passphrase from the first line of FILE (default: ask)")
    group.add_argument("--passphrase-env", metavar="NAME",
                       help="read the keystore passphrase from environment variable NAME (default: ask)")


def passphrase_source_from_args(args: argparse.Namespace) -> PassphraseSource:
    if args.passphrase_file:
        return PassphraseSource.from_file(args.passphrase_file)
    if args.passphrase_env:
        return PassphraseSource.from_env(args.passphrase_env)
    return PassphraseSource.prompt()


def ask_first(source: PassphraseSource | None, keystore_path, confirm: bool = False) -> PassphraseSource | None:
    """Ask for a prompted passphrase now, so the spinner of the key derivation that follows
    does not draw over the prompt."""
    if source is None or source.kind != "prompt":
        return source
    return PassphraseSource.literal(source.read(str(keystore_path), confirm=confirm))


def unlock_identity(args: argparse.Namespace, keystore_path, source: PassphraseSource | None):
    """Open a keystore; an encrypted one derives its key (argon2id: seconds) under a spinner."""
    if not is_encrypted(keystore_path):  # a missing or unreadable keystore is reported before any prompt
        return load_identity(keystore_path, None)
    source = ask_first(source, keystore_path)
    with progress(args, "deriving the key of %s (argon2id)" % keystore_path):
        return load_identity(keystore_path, source)
