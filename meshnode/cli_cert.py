"""`meshnode cert`: check a commit certificate offline against a genesis (SPEC.md 6.7)."""

from __future__ import annotations

import json
import sys

from keys.genesis import load_genesis
from keys.identity import short_id
from meshnode.output import add_json_flag, emit, key_value_table
from protocol import codec
from protocol.certificate import verify_commit_certificate
from protocol.errors import ConfigError, RemoteProtocolError
from protocol.messages import JobManifest, decode_message, decode_value, placement_binding_error, value_hash
from protocol.quorum import EpochView


def register(subparsers) -> None:
    cert = subparsers.add_parser("cert", help="verify commit certificates offline")
    sub = cert.add_subparsers(dest="cert_command", metavar="SUBCOMMAND")
    sub.required = True
    verify = sub.add_parser("verify", help="check a CommitCertificate envelope file against a genesis")
    verify.add_argument("certificate", metavar="FILE", help="encoded CommitCertificate envelope bytes")
    verify.add_argument("--genesis", required=True, metavar="FILE", help="the mesh's genesis document")
    add_json_flag(verify)
    verify.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    genesis = load_genesis(args.genesis)
    view = EpochView.from_genesis(genesis)
    try:
        with open(args.certificate, "rb") as fh:
            data = fh.read(codec.MAX_FRAME_BYTES + 1)
    except OSError as exc:
        raise ConfigError("cannot read certificate %s: %s" % (args.certificate, exc.strerror)) from None
    try:
        cert, value = verify_commit_certificate(data, genesis.mesh_id, view)
        if cert.value_kind == "placement":  # SPEC.md P2: one instance id, one epoch
            placement = decode_value("placement", value)
            _job_envelope, job = decode_message(placement.job, genesis.mesh_id, expect=JobManifest,
                                                allow_any_mesh=True)
            problem = placement_binding_error(cert.instance, job, cert.epoch)
            if problem is not None:
                raise RemoteProtocolError("placement certificate: %s" % problem)
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
    emit(args, result, lambda console: console.print(key_value_table("valid commit certificate", [
        ("instance", result["instance"]), ("round", cert.round), ("epoch", cert.epoch),
        ("value kind", cert.value_kind), ("value hash", result["value_hash"]),
        ("signers", ", ".join(short_id(s) for s in signers)),
        ("stake", "%d of %d" % (stake, view.total_stake))])))
    return 0
