"""`meshnode cert`: check a commit certificate offline against a genesis and the membership
history (the epoch changes' own certificates) that leads to its epoch (SPEC.md 6.7), and
export a running node's certificates of a job or an instance as files that check does
read (SPEC.md 10.5, op `certificates`)."""

from __future__ import annotations

import json
import pathlib
import sqlite3
import sys

from rich.table import Table

from keys.errors import ConfigError
from keys.genesis import load_genesis
from keys.identity import short_id
from meshnode.cli.output import add_json_flag, emit, examples, key_value_table
from meshnode.control.client import ControlClient
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
    export = sub.add_parser("export", help="write a running node's certificates of a job or an instance to files",
                            epilog=examples("meshnode cert export --node net/node-0 --job 8c322d0f --out certs"))
    which = export.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", metavar="JOB_ID", help="a job id, or a prefix of one the node knows")
    which.add_argument("--instance", metavar="ID", help="a consensus instance id (64 hex digits)")
    export.add_argument("--node", required=True, metavar="DIR", help="the node's data directory")
    export.add_argument("--out", required=True, metavar="DIR", help="directory to write the files to")
    add_json_flag(export)
    export.set_defaults(func=cmd_export)


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

def cmd_export(args) -> int:
    genesis = load_genesis(node_paths(args.node).genesis)
    selector = {"job_id": args.job} if args.job is not None else {"instance": args.instance}
    with ControlClient(args.node) as client:
        result = client.call("certificates", **selector)
    written = write_export(result, genesis.encode(), args.out)
    hint = "meshnode cert verify FILE --genesis %s" % written["genesis"]
    if written["history"]:
        hint += " --history %s" % (pathlib.Path(args.out) / "history" / "*.cert")
    emit(args, written, lambda console: console.print(key_value_table("exported to %s" % args.out, [
        ("certificates", "\n".join(written["certificates"])), ("epoch changes", len(written["history"])),
        ("verify with", hint)])))
    return 0


def write_export(result: dict, genesis_bytes: bytes, out_dir) -> dict:
    """Write what the `certificates` op returned, as `cert verify` reads it: OUT/genesis.bin,
    one OUT/NN-KIND-INSTANCE.cert per certificate (decision order), and the epoch changes
    leading to their epochs as OUT/history/epoch-E-KIND.cert (pass them with --history)."""
    out = pathlib.Path(out_dir)
    written = {"genesis": str(out / "genesis.bin"), "certificates": [], "history": []}
    try:
        (out / "history").mkdir(parents=True, exist_ok=True)
        (out / "genesis.bin").write_bytes(genesis_bytes)
        for index, row in enumerate(result["certificates"]):
            path = out / ("%02d-%s-%s.cert" % (index, row["value_kind"], row["instance"]))
            path.write_bytes(row["certificate"])
            written["certificates"].append(str(path))
        for row in result["epoch_changes"]:
            path = out / "history" / ("epoch-%d-%s.cert" % (row["epoch"], row["value_kind"]))
            path.write_bytes(row["certificate"])
            written["history"].append(str(path))
    except OSError as exc:
        raise ConfigError("cannot write the export to %s: %s" % (out, exc.strerror or exc)) from None
    return written
