"""`meshnode mesh`: write and inspect genesis documents (SPEC.md section 5)."""

from __future__ import annotations

import argparse
import time

from rich import box
from rich.table import Table

from keys.errors import ConfigError
from keys.genesis import DEFAULT_PARAMS, UNLIMITED, Genesis, ProtocolParams, load_genesis
from keys.identity import peer_id_from_public_key, short_id
from keys.keystore import write_file_atomic
from meshnode.cli.keys import parse_key_value, parse_public_key
from meshnode.cli.output import add_json_flag, emit, examples, key_value_table
from meshnode.cli.pools_file import load_pools
from protocol.messages import Member

DEFAULT_ZONE = "zone-a"


def register(subparsers) -> None:
    mesh = subparsers.add_parser("mesh", help="create and inspect mesh genesis documents", epilog=examples(
        "meshnode mesh init --name lab --member node-a.key:100 --out genesis.bin", "meshnode mesh show genesis.bin"))
    sub = mesh.add_subparsers(dest="mesh_command", metavar="SUBCOMMAND")
    sub.required = True

    init = sub.add_parser("init", help="write a genesis document; its hash is the mesh id", epilog=examples(
        "meshnode mesh init --name lab --member node-a.key:100 --member 12D3KooW...:100:zone-b \\\n"
        "      --member-addr 0:/ip4/10.0.0.5/tcp/4001 --heartbeat-ms 50 --out genesis.bin",
        "meshnode mesh init --name lab --member node-a.key:100 --pools jobs/pools/lab.toml --out genesis.bin",
        "meshnode mesh init --name lab --member node-a.key:100 --bid-sample 6 --out genesis.bin"))
    init.add_argument("--name", required=True, help="the mesh's name (part of the genesis, so of the mesh id)")
    init.add_argument("--member", action="append", required=True, metavar="KEY:STAKE[:ZONE]",
                      help="a member (repeatable): KEY is a keystore file, 64 hex digits or a peer ID")
    init.add_argument("--member-label", action="append", default=[], metavar="N:KEY=VALUE",
                      help="a label for the N-th --member, counting from 0 (repeatable)")
    init.add_argument("--member-addr", action="append", default=[], metavar="N:MULTIADDR",
                      help="a listen address for the N-th --member (repeatable)")
    init.add_argument("--authority", action="append", default=[], metavar="PUBKEY",
                      help="a trusted attestation authority key (repeatable)")
    init.add_argument("--created-ms", type=int, default=None,
                      help="creation time in Unix ms (default now; fix it for a reproducible mesh id)")
    for name, ftype in ProtocolParams.SCHEMA.items():
        init.add_argument("--" + name.replace("_", "-"), dest="param_" + name, type=int, default=None,
                          help="protocol parameter, %s (default %d)" % (ftype.describe(), getattr(DEFAULT_PARAMS, name)))
    init.add_argument("--pools", metavar="FILE",
                      help="a TOML file naming pools, per-owner quotas and reservations (SPEC.md 5.5; "
                           "example: jobs/pools/lab.toml)")
    init.add_argument("--bid-sample", type=int, default=0, metavar="K",
                      help="about K members bid per job, chosen by hash (SPEC.md 5.6; default 0: every member)")
    init.add_argument("--out", required=True, metavar="FILE", help="the genesis file to write")
    init.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    add_json_flag(init)
    init.set_defaults(func=cmd_init)

    show = sub.add_parser("show", help="print a genesis document: mesh id, members, stake, parameters",
                          epilog=examples("meshnode mesh show genesis.bin --json"))
    show.add_argument("genesis", metavar="FILE", help="the genesis document to read")
    add_json_flag(show)
    show.set_defaults(func=cmd_show)


def parse_member_spec(spec: str) -> tuple[str, int, str]:
    """Split KEY:STAKE[:ZONE]; KEY may itself contain ':' (a path), so STAKE is found from the right."""
    parts = spec.split(":")
    for index in range(max(1, len(parts) - 2), len(parts)):
        if parts[index].isdigit() and len(parts) - index <= 2:
            zone = parts[index + 1] if index + 1 < len(parts) else DEFAULT_ZONE
            return ":".join(parts[:index]), int(parts[index]), zone
    raise ConfigError("--member %r: expected KEY:STAKE[:ZONE] with an integer STAKE" % spec)


def _indexed(values: list[str], count: int, flag: str) -> list[tuple[int, str]]:
    out = []
    for text in values:
        index, sep, rest = text.partition(":")
        if not sep or not index.isdigit() or int(index) >= count:
            raise ConfigError("%s %r: expected N:VALUE with N the index of a --member (0..%d)"
                              % (flag, text, count - 1))
        out.append((int(index), rest))
    return out


def build_genesis(args: argparse.Namespace) -> Genesis:
    specs = [parse_member_spec(s) for s in args.member]
    labels: list[dict] = [{} for _ in specs]
    addrs: list[list] = [[] for _ in specs]
    for index, text in _indexed(args.member_label, len(specs), "--member-label"):
        key, value = parse_key_value(text, "--member-label")
        labels[index][key] = value
    for index, addr in _indexed(args.member_addr, len(specs), "--member-addr"):
        addrs[index].append(addr)
    overrides = {name: getattr(args, "param_" + name) for name in ProtocolParams.SCHEMA
                 if getattr(args, "param_" + name) is not None}
    created_ms = args.created_ms if args.created_ms is not None else time.time_ns() // 1_000_000
    pools, reservations = load_pools(args.pools) if args.pools else ((), False)
    try:
        members = tuple(Member(public_key=parse_public_key(key), stake=stake, zone=zone,
                               labels=tuple(sorted(labels[i].items())), addrs=tuple(addrs[i]))
                        for i, (key, stake, zone) in enumerate(specs))
        params = ProtocolParams(**{**DEFAULT_PARAMS.to_body(), **overrides})
        return Genesis(name=args.name, created_ms=created_ms, members=members, params=params,
                       authorities=tuple(parse_public_key(a) for a in args.authority), pools=pools,
                       reservations=reservations, bid_sample=args.bid_sample)
    except ValueError as exc:  # a record's SCHEMA or invariant check names the field
        raise ConfigError("invalid genesis: %s" % exc) from None


def genesis_view(genesis: Genesis) -> dict:
    return {
        "mesh_id": genesis.mesh_id.hex(), "name": genesis.name, "created_ms": genesis.created_ms,
        "total_stake": genesis.total_stake,
        "members": [{"public_key": m.public_key.hex(), "peer_id": peer_id_from_public_key(m.public_key),
                     "short_id": short_id(m.public_key), "stake": m.stake, "zone": m.zone,
                     "labels": dict(m.labels), "addrs": list(m.addrs)} for m in genesis.members],
        "params": genesis.params.to_body(),
        "authorities": [a.hex() for a in genesis.authorities],
        "pools": [{"name": pool.name, "default": pool.default.to_body(),
                   "owners": {short_id(o.owner): o.quota.to_body() for o in pool.owners}} for pool in genesis.pools],
        "reservations": genesis.reservations,
        "bid_sample": genesis.bid_sample,
    }


def render_genesis(console, view: dict) -> None:
    authorities = [("authority", key) for key in view["authorities"]] or [("authorities", "-")]
    console.print(key_value_table("mesh %s" % view["name"], [
        ("mesh id", view["mesh_id"]), ("created_ms", view["created_ms"]),
        ("members", len(view["members"])), ("total stake", view["total_stake"])] + authorities))
    members = Table(title="members", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                    padding=(0, 1, 0, 0))  # the layout of every other table (meshnode/tui/tables.py)
    for column in ("node", "stake", "zone", "labels", "addrs"):
        members.add_column(column, no_wrap=column != "labels", overflow="fold")  # an address is never split
    for m in view["members"]:
        members.add_row(m["short_id"], str(m["stake"]), m["zone"],
                        ", ".join("%s=%s" % kv for kv in sorted(m["labels"].items())) or "-",
                        "\n".join(m["addrs"]) or "-")
    console.print(members)
    # Peer ids are 52 characters: beside the other columns they would be folded, and a
    # folded id cannot be copied; each gets a line of its own under its node's label.
    console.print(key_value_table("peer ids", [(m["short_id"], m["peer_id"]) for m in view["members"]]))
    console.print(key_value_table("protocol parameters", sorted(view["params"].items())
                                  + [("bid_sample (5.6)", view.get("bid_sample") or "0: every member bids")]))
    if view.get("pools") or view.get("reservations"):
        console.print(key_value_table("pools (SPEC 5.5; reservations %s)" % ("on" if view["reservations"] else "off"), [
            (repr(pool["name"]) + (" " + owner if owner else ""), _quota_text(quota))
            for pool in view["pools"]
            for owner, quota in [("", pool["default"])] + sorted(pool["owners"].items())]))


def _quota_text(quota: dict) -> str:
    parts = ["%s %s" % (name, "unlimited" if value >= UNLIMITED else value) for name, value in sorted(quota.items())]
    return ", ".join(parts)


def cmd_init(args: argparse.Namespace) -> int:
    genesis = build_genesis(args)
    write_file_atomic(args.out, genesis.encode(), mode=0o644, overwrite=args.force)
    view = genesis_view(genesis)
    emit(args, view, lambda console: render_genesis(console, view))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    view = genesis_view(load_genesis(args.genesis))
    emit(args, view, lambda console: render_genesis(console, view))
    return 0
