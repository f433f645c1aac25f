"""`meshnode cert`: check a commit certificate offline against a genesis and the membership
history (the epoch changes' own certificates) that leads to its epoch (SPEC.md 6.7)."""

from __future__ import annotations

import json
import sqlite3
import sys

from rich.table import Table

from keys.errors import ConfigError
from keys.genesis import load_genesis
from keys.identity import short_id
from meshnode.cli.output import add_json_flag, emit, examples, key_value_table
from meshnode.node.config import node_paths
from protocol import codec
from protocol.certificate import epoch_views_from_history, verify_commit_certificate
from protocol.errors import RemoteProtocolError
from protocol.flows.binding import certificate_binding_error
from protocol.messages import CommitCertificate, decode_message, value_hash
from protocol.quorum import EpochView


def register(subparsers) -> None:
    cert = subparsers.add_parser("cert", help="verify commit certificates offline",
                                 epilog=examples("meshnode cert verify placement.cert --genesis genesis.bin"))
    sub = cert.add_subparsers(dest="cert_command", metavar="SUBCOMMAND")
    sub.required = True
    verify = sub.add_parser("verify", help="check a CommitCertificate envelope file against a genesis", epilog=examples(
        "meshnode cert verify placement.cert --genesis genesis.bin",
        "meshnode cert verify placement.cert --genesis genesis.bin --node net/node-0   # epoch changes from a node"))
    verify.add_argument("certificate", metavar="FILE", help="encoded CommitCertificate envelope bytes")
    verify.add_argument("--genesis", required=True, metavar="FILE", help="the mesh's genesis document")
    verify.add_argument("--history", nargs="+", default=[], metavar="CERT",
                        help="epoch-change (eviction, join) certificate files leading to a later epoch")
    verify.add_argument("--node", metavar="DIR",
                        help="read the epoch-change certificates from a node's store (read-only)")
    add_json_flag(verify)
    verify.set_defaults(func=cmd_verify)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(codec.MAX_FRAME_BYTES + 1)
    except OSError as exc:
        raise ConfigError("cannot read %s %s: %s" % (what, path, exc.strerror)) from None


def _node_history(node_dir: str) -> list[bytes]:
    """The epoch-change certificates a node applied, from its store, opened read-only."""
    path = node_paths(node_dir).database
    if not path.is_file():
        raise ConfigError("no node store at %s" % path)
    uri = path.resolve().as_uri()  # percent-encodes '#', '?' and '%' in the path

    def read(options: str) -> list[bytes]:
        db = sqlite3.connect(uri + options, uri=True)
        try:
            return [row[0] for row in db.execute(
                "SELECT certificate FROM certificates WHERE value_kind IN ('eviction', 'membership') ORDER BY seq")]
        finally:
            db.close()

    try:
        try:
            return read("?mode=ro")
        except sqlite3.OperationalError:
            # A store in a directory we may not write (WAL needs its -shm file) is read as
            # immutable: safe for certificates, which are only ever added.
            return read("?mode=ro&immutable=1")
    except sqlite3.Error as exc:
        raise ConfigError("cannot read the certificates of %s: %s" % (path, exc)) from None


def cmd_verify(args) -> int:
    genesis = load_genesis(args.genesis)
    data = _read(args.certificate, "certificate")
    history = [_read(path, "history certificate") for path in args.history]
    if args.node:
        history += _node_history(args.node)
    try:
        views = epoch_views_from_history(EpochView.from_genesis(genesis), genesis.mesh_id, history)
        _envelope, claimed = decode_message(data, genesis.mesh_id, expect=CommitCertificate)
        view = views.get(claimed.epoch)
        if view is None:
            raise RemoteProtocolError("the certificate is of epoch %d; the membership history given reaches epoch %d "
                                      "(pass its epoch changes with --history or --node)"
                                      % (claimed.epoch, max(views)))
        cert, value = verify_commit_certificate(data, genesis.mesh_id, view)
        # SPEC.md 6.7: the stated kind bound to its value and instance, as a node checks it.
        problem = certificate_binding_error(cert.value_kind, cert.instance, value, cert.epoch, genesis.mesh_id,
                                            genesis.params.placement_slot_ms)
        if problem is not None:
            raise RemoteProtocolError("%s certificate: %s" % (cert.value_kind, problem))
    except RemoteProtocolError as exc:
        if args.json:
            json.dump({"valid": False, "reason": str(exc)}, sys.stdout, sort_keys=True)
            sys.stdout.write("\n")
        else:
            print("invalid: %s" % exc, file=sys.stderr)
        return 2
    signers = [decode_message(vote, genesis.mesh_id)[0].signer for vote in cert.precommits]
    stake = view.stake_of(signers)
    result = {
        "valid": True, "instance": cert.instance.hex(), "round": cert.round, "epoch": cert.epoch,
        "value_kind": cert.value_kind, "value_hash": value_hash(value).hex(), "signers": len(signers),
        "stake": stake, "total_stake": view.total_stake,
    }
    signer_labels = [short_id(s) for s in signers]
    emit(args, result, lambda console: console.print(render_valid_certificate(result, signer_labels)))
    return 0


def render_valid_certificate(result: dict, signer_labels: list[str]) -> Table:
    return key_value_table("valid commit certificate", [
        ("instance", result["instance"]), ("round", result["round"]), ("epoch", result["epoch"]),
        ("value kind", result["value_kind"]), ("value hash", result["value_hash"]),
        ("signers", " ".join(signer_labels)), ("stake", "%d of %d" % (result["stake"], result["total_stake"]))])
