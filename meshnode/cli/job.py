"""`meshnode job`: sign and verify job manifests (SPEC.md section 4.2); a job's life on a
running mesh (list, status, cancel, logs, output) is in meshnode/cli/job_life.py."""

from __future__ import annotations

import argparse
import time

from keys.genesis import load_genesis
from keys.identity import peer_id_from_public_key, short_id
from keys.keystore import write_file_atomic
from meshnode.cli.output import (add_json_flag, add_passphrase_args, emit, examples, ids_then_fields,
                                 passphrase_source_from_args, unlock_identity)
from meshnode.tui.tables import short_job_id
from meshnode.workload.manifest import load_manifest, verify_signed_job
from protocol import codec
from protocol.envelope import ANY_MESH
from protocol.errors import ManifestError, RemoteProtocolError
from protocol.messages import job_id, sign_message


def register(subparsers) -> None:
    job = subparsers.add_parser("job", help="sign, verify, list, inspect, cancel jobs; read their logs and files",
                                epilog=examples("meshnode job sign jobs/counter.toml --key owner.key --out counter.job",
                                                "meshnode job list --node net/node-0"))
    sub = job.add_subparsers(dest="job_command", metavar="SUBCOMMAND")
    sub.required = True

    sign = sub.add_parser("sign", help="sign a TOML job manifest with the owner's key", epilog=examples(
        "meshnode job sign jobs/counter.toml --key owner.key --out counter.job          # valid in any mesh",
        "meshnode job sign jobs/train.toml --key owner.key --genesis genesis.bin --out train.job"))
    sign.add_argument("manifest", metavar="MANIFEST", help="TOML job manifest")
    sign.add_argument("--key", required=True, metavar="FILE", help="the owner's keystore")
    sign.add_argument("--genesis", metavar="FILE",
                      help="sign for this mesh only (default: valid in any mesh)")
    sign.add_argument("--epoch", type=int, default=0, metavar="N",
                      help="the mesh epoch whose members place it (`meshnode status` shows it; default 0)")
    sign.add_argument("--out", required=True, metavar="SIGNED", help="the signed job file to write")
    sign.add_argument("--force", action="store_true", help="overwrite SIGNED if it exists")
    add_passphrase_args(sign)
    add_json_flag(sign)
    sign.set_defaults(func=cmd_sign)

    verify = sub.add_parser("verify", help="check a signed job: signature, schema, owner; print its id",
                            epilog=examples("meshnode job verify train.job --genesis genesis.bin"))
    verify.add_argument("signed", metavar="SIGNED", help="a signed job file (from `meshnode job sign`)")
    verify.add_argument("--genesis", metavar="FILE", help="also require it to be valid in this mesh")
    add_json_flag(verify)
    verify.set_defaults(func=cmd_verify)

    from meshnode.cli import job_life
    job_life.register(sub)


def job_view(envelope, job) -> dict:
    return {
        "job_id": job_id(job).hex(), "mesh_id": envelope.mesh_id.hex(),
        "any_mesh": envelope.mesh_id == ANY_MESH, "owner": job.owner.hex(),
        "owner_peer_id": peer_id_from_public_key(job.owner), "name": job.name,
        "entrypoint": job.entrypoint, "args": list(job.args), "strategy": job.strategy,
        "resources": job.resources.to_body(), "constraints": job.constraints.to_body(),
        "priority": job.priority, "backups": job.backups, "max_retries": job.max_retries,
        "nonce": job.nonce, "created_ms": job.created_ms, "epoch": job.epoch,
    }


ID_FIELDS = ("job_id", "mesh_id", "owner", "owner_peer_id")


def render_job(console, title: str, view: dict) -> None:
    rows = [(k, v) for k, v in view.items() if k not in ("resources", "constraints") + ID_FIELDS]
    rows += [("resources." + k, v) for k, v in sorted(view["resources"].items())]
    rows += [("constraints." + k, v) for k, v in sorted(view["constraints"].items())]
    console.print(ids_then_fields(title, [(k, view[k]) for k in ID_FIELDS], rows))


def cmd_sign(args: argparse.Namespace) -> int:
    mesh_id = load_genesis(args.genesis).mesh_id if args.genesis else ANY_MESH
    identity = unlock_identity(args, args.key, passphrase_source_from_args(args))
    job = load_manifest(args.manifest, identity.public_key, time.time_ns() // 1_000_000, epoch=args.epoch)
    envelope = sign_message(identity, mesh_id, job)
    write_file_atomic(args.out, envelope.encode(), mode=0o644, overwrite=args.force)
    view = job_view(envelope, job)
    emit(args, view, lambda console: render_job(
        console, "job %s signed by %s -> %s" % (short_job_id(view["job_id"]), short_id(job.owner), args.out), view))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    mesh_id = load_genesis(args.genesis).mesh_id if args.genesis else None
    try:
        with open(args.signed, "rb") as fh:
            data = fh.read(codec.MAX_FRAME_BYTES + 1)
    except OSError as exc:
        raise ManifestError("cannot read %s: %s" % (args.signed, exc.strerror)) from None
    try:
        envelope, job = verify_signed_job(data, mesh_id)
    except RemoteProtocolError as exc:
        raise ManifestError("%s does not verify: %s" % (args.signed, exc)) from None
    view = job_view(envelope, job)
    emit(args, view, lambda console: render_job(console, "%s: signature OK" % args.signed, view))
    return 0
