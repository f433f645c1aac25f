"""`meshnode keys`: create and inspect keystores, issue attestations (SPEC.md 1, 5.3, 5.4)."""

from __future__ import annotations

import argparse
import os
import time

from keys.attestation import issue_attestation
from keys.identity import generate_identity, peer_id_from_public_key, public_key_from_peer_id, short_id
from keys.keystore import create_keystore, is_encrypted, read_public_key, write_file_atomic
from meshnode.cli.output import (add_json_flag, add_passphrase_args, ask_first, emit, examples, key_value_table,
                                 passphrase_source_from_args, progress, unlock_identity)
from keys.errors import KeystoreError
from protocol.errors import RemoteProtocolError

DAY_MS = 86_400_000


def register(subparsers) -> None:
    keys = subparsers.add_parser("keys", help="create and inspect keystores, sign attestations",
                                 epilog=examples("meshnode keys new --out node.key", "meshnode keys show node.key"))
    sub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    sub.required = True

    new = sub.add_parser("new", help="create a new Ed25519 key in an encrypted keystore", epilog=examples(
        "meshnode keys new --out node.key                      # asks for the passphrase twice",
        "meshnode keys new --out node.key --passphrase-env NODE_PASSPHRASE"))
    new.add_argument("--out", required=True, metavar="FILE", help="keystore file to create (mode 0600)")
    new.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    new.add_argument("--insecure-no-passphrase", action="store_true",
                     help="store the key UNENCRYPTED (testnets only; every load warns)")
    add_passphrase_args(new)
    add_json_flag(new)
    new.set_defaults(func=cmd_new)

    show = sub.add_parser("show", help="print a keystore's public key and peer ID (no passphrase needed)",
                          epilog=examples("meshnode keys show node.key --json"))
    show.add_argument("keystore", metavar="FILE", help="the keystore to read")
    add_json_flag(show)
    show.set_defaults(func=cmd_show)

    attest = sub.add_parser("attest", help="sign an attestation about a key, as an attestation authority",
                            epilog=examples("meshnode keys attest --authority authority.key --subject 12D3KooW... "
                                            "--attr jurisdiction=eu --out node-a.attestation"))
    attest.add_argument("--authority", required=True, metavar="KEYFILE", help="the authority's keystore")
    attest.add_argument("--subject", required=True, metavar="PUBKEY",
                        help="the attested key: 64 hex digits, a peer ID, or a keystore file")
    attest.add_argument("--attr", action="append", default=[], metavar="KEY=VALUE",
                        help="an attested attribute (repeatable), e.g. jurisdiction=eu")
    attest.add_argument("--stake", type=int, default=0, help="stake the authority vouches for (default 0)")
    attest.add_argument("--valid-days", type=int, default=365, help="validity from now, in days (default 365)")
    attest.add_argument("--out", required=True, metavar="FILE", help="the attestation file to write")
    attest.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    add_passphrase_args(attest)
    attest.set_defaults(func=cmd_attest)


def identity_view(public_key: bytes) -> dict:
    return {"public_key": public_key.hex(), "peer_id": peer_id_from_public_key(public_key),
            "short_id": short_id(public_key)}


def parse_public_key(text: str) -> bytes:
    """A key given on the command line: 64 hex digits, a peer ID, or a keystore file."""
    if len(text) == 64:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    if text.startswith("12D3KooW"):
        try:
            return public_key_from_peer_id(text)
        except (RemoteProtocolError, ValueError):
            raise KeystoreError("%s is not an Ed25519 peer ID" % text) from None
    if not os.path.exists(text):
        raise KeystoreError("%r is not a public key (64 hex digits), a peer ID or a keystore file" % text)
    return read_public_key(text)


def parse_key_value(text: str, what: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise KeystoreError("%s %r: expected KEY=VALUE" % (what, text))
    return key, value


def cmd_new(args: argparse.Namespace) -> int:
    if not args.force and os.path.lexists(args.out):  # before asking for a passphrase twice in vain
        raise KeystoreError("%s already exists; pass --force to overwrite it" % args.out)
    source = None if args.insecure_no_passphrase else passphrase_source_from_args(args)
    source = ask_first(source, args.out, confirm=True)
    identity = generate_identity()
    with progress(args, "deriving the key of %s (argon2id)" % args.out):
        create_keystore(args.out, identity, source, overwrite=args.force)
    view = dict(identity_view(identity.public_key), file=args.out, encrypted=source is not None)
    emit(args, view, lambda console: console.print(
        key_value_table("new key written to %s" % args.out, list(view.items()))))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    view = dict(identity_view(read_public_key(args.keystore)), file=args.keystore,
                encrypted=is_encrypted(args.keystore))
    emit(args, view, lambda console: console.print(key_value_table(args.keystore, list(view.items()))))
    return 0


def cmd_attest(args: argparse.Namespace) -> int:
    subject = parse_public_key(args.subject)
    attributes = dict(parse_key_value(a, "--attr") for a in args.attr)
    if args.stake < 0 or args.valid_days < 1:
        raise KeystoreError("--stake must be >= 0 and --valid-days >= 1")
    authority = unlock_identity(args, args.authority, passphrase_source_from_args(args))
    now_ms = time.time_ns() // 1_000_000
    try:
        data = issue_attestation(authority, subject, attributes, args.stake, now_ms,
                                 now_ms + args.valid_days * DAY_MS)
    except ValueError as exc:  # a field outside its SCHEMA limits (SPEC.md 4)
        raise KeystoreError("cannot issue attestation: %s" % exc) from None
    write_file_atomic(args.out, data, mode=0o644, overwrite=args.force)
    print("attestation for %s signed by %s written to %s"
          % (short_id(subject), short_id(authority.public_key), args.out))
    return 0
