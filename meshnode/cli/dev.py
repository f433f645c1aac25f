"""`meshnode node init` (write a node's data directory) and `meshnode dev` (a one-node mesh).

`node init` gives an operator a valid ``DIR/node.toml`` (SPEC.md 10.2) with the mesh's
genesis and the node's keystore beside it, so `meshnode run --node DIR` starts as is.
`meshnode dev` is the quickest way to run a job: one node in the foreground, a throwaway
key, owner key and one-member genesis, removed on exit unless ``--keep``. A mesh of one
member decides alone: its own stake is a quorum (SPEC.md 6.1), and it never waits for a
peer to end a self-fencing halt (F3).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from keys.errors import ConfigError
from keys.genesis import DEFAULT_PARAMS, Genesis, load_genesis
from keys.identity import generate_identity, peer_id_from_public_key
from keys.keystore import MAX_KEYSTORE_BYTES, create_keystore, is_encrypted, read_public_key, write_file_atomic
from meshnode.cli.output import add_json_flag, emit, examples, key_value_table
from meshnode.node import config as node_config
from protocol.messages import Member

COMMANDS = ("node", "dev")
DEV_STAKE = 100
DEV_OWNER_KEY = "owner.key"


def register(subparsers) -> None:
    node = subparsers.add_parser("node", help="set up a node's data directory (node init)")
    sub = node.add_subparsers(dest="node_command", metavar="SUBCOMMAND")
    sub.required = True
    init = sub.add_parser(
        "init", help="write DIR/node.toml, DIR/genesis.bin and DIR/keystore.json for `meshnode run --node DIR`",
        description="Write a node's data directory: its config (node.toml, SPEC.md 10.2), a copy of the "
                    "mesh's genesis and of the node's keystore.",
        epilog=examples("meshnode node init --dir node-a --genesis genesis.bin --key node-a.key "
                        "--listen /ip4/0.0.0.0/tcp/4001 \\\n"
                        "      --bootstrap /ip4/10.0.0.5/tcp/4001/p2p/12D3KooW..."))
    init.add_argument("--dir", required=True, metavar="DIR", help="the node's data directory (created if missing)")
    init.add_argument("--genesis", required=True, metavar="FILE", help="the mesh's genesis document (mesh init)")
    init.add_argument("--listen", required=True, action="extend", nargs="+", metavar="MULTIADDR",
                      help="address(es) to listen on, /ip4/HOST/tcp/PORT")
    init.add_argument("--bootstrap", action="extend", nargs="+", default=[], metavar="MULTIADDR",
                      help="peer(s) to dial first, /ip4/HOST/tcp/PORT/p2p/PEERID or PUBKEYHEX@/ip4/HOST/tcp/PORT")
    init.add_argument("--key", metavar="KEYSTORE",
                      help="the node's keystore (keys new), copied to DIR/keystore.json; "
                           "default: the one already in DIR")
    init.add_argument("--zone", metavar="ZONE", help="the node's zone (default: its zone in the genesis, else zone-a)")
    init.add_argument("--metrics-listen", default="", metavar="127.0.0.1:PORT",
                      help="serve Prometheus metrics there (README \"Metrics\"); default: off")
    source = init.add_mutually_exclusive_group()
    source.add_argument("--passphrase-env", metavar="NAME",
                        help="the running node reads an encrypted keystore's passphrase from this variable "
                             "(default MESHNODE_PASSPHRASE)")
    source.add_argument("--passphrase-file", metavar="FILE",
                        help="... or from this file (relative paths: from DIR)")
    init.add_argument("--force", action="store_true", help="overwrite an existing node.toml, genesis or keystore")
    add_json_flag(init)
    init.set_defaults(func=cmd_node_init)

    dev = subparsers.add_parser(
        "dev", help="run a one-node mesh in the foreground with throwaway keys (Ctrl-C stops it)",
        description="Start one node that is a whole mesh by itself, with a throwaway node key, owner key "
                    "and genesis, print how to submit jobs to it, and run them. Ctrl-C stops it and removes "
                    "what it created unless --keep.",
        epilog=examples("meshnode dev --dir dev-mesh --keep",
                        "meshnode submit jobs/counter.toml --key dev-mesh/owner.key --node dev-mesh --wait   "
                        "# in another shell"))
    dev.add_argument("--dir", metavar="DIR",
                     help="use DIR instead of a temporary directory; a dev node kept there earlier is restarted")
    dev.add_argument("--keep", action="store_true", help="keep the directory on exit (restart with --dir)")
    dev.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                     help="serve Prometheus metrics on 127.0.0.1:PORT (default: any free port; -1: off)")
    dev.add_argument("--no-workloads", action="store_true", help="decide placements but start no workloads")
    dev.set_defaults(func=cmd_dev)


# --- node init -------------------------------------------------------------------------------------

def _read_small(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(MAX_KEYSTORE_BYTES + 1)
    except OSError as exc:
        raise ConfigError("cannot read %s %s: %s" % (what, path, exc.strerror)) from None


def init_node_dir(data_dir, *, genesis_path: str, listen: list[str], bootstrap: list[str] = (),
                  key_path: str | None = None, zone: str | None = None, metrics_listen: str = "",
                  passphrase: node_config.PassphraseSource | None = None,
                  force: bool = False) -> tuple[node_config.NodeConfig, dict]:
    """Validate everything first, then write genesis, keystore and config: a bad argument
    leaves the directory as it was. Returns the config written and a summary."""
    root = Path(data_dir)
    paths = node_config.node_paths(root)
    if paths.config.exists() and not force:
        raise ConfigError("%s already exists; pass --force to overwrite it" % paths.config)
    listen = tuple(node_config.parse_multiaddr(a, "--listen") for a in listen)
    peers = tuple(node_config.parse_bootstrap(b, "--bootstrap") for b in bootstrap)
    node_config.parse_metrics_listen(metrics_listen, "--metrics-listen")
    genesis = load_genesis(genesis_path)
    keystore = key_path or paths.keystore
    public_key = read_public_key(keystore)   # a real keystore, readable by its owner only
    member = next((m for m in genesis.members if m.public_key == public_key), None)
    if passphrase is None:
        passphrase = (node_config.NodeConfig.passphrase if is_encrypted(keystore)
                      else node_config.PassphraseSource("insecure"))
    config = node_config.NodeConfig(
        listen=listen, bootstrap=peers, zone=zone or (member.zone if member else node_config.NodeConfig.zone),
        passphrase=passphrase, metrics_listen=metrics_listen)
    node_config.parse_config(node_config.config_document(config))   # e.g. a zone name too long
    root.mkdir(parents=True, exist_ok=True)
    genesis_bytes = genesis.encode()
    if not (paths.genesis.exists() and paths.genesis.read_bytes() == genesis_bytes):
        write_file_atomic(paths.genesis, genesis_bytes, mode=0o644, overwrite=force)
    if key_path is not None and os.path.abspath(key_path) != os.path.abspath(paths.keystore):
        write_file_atomic(paths.keystore, _read_small(key_path, "keystore"), mode=0o600, overwrite=force)
    written = node_config.write_config(root, config)
    return config, {"config": str(written), "dir": str(root), "mesh_id": genesis.mesh_id.hex(),
                    "node": public_key.hex(), "peer_id": peer_id_from_public_key(public_key),
                    "genesis_member": member is not None, "zone": config.zone,
                    "passphrase": config.passphrase.kind, "listen": list(listen),
                    "bootstrap": ["%s@%s" % (p.public_key.hex(), p.addr) for p in peers],
                    "metrics_listen": metrics_listen or None}


def cmd_node_init(args) -> int:
    passphrase = None
    if args.passphrase_env:
        passphrase = node_config.PassphraseSource("env", args.passphrase_env)
    elif args.passphrase_file:
        passphrase = node_config.PassphraseSource("file", args.passphrase_file)
    _config, summary = init_node_dir(args.dir, genesis_path=args.genesis, listen=args.listen,
                                     bootstrap=args.bootstrap, key_path=args.key, zone=args.zone,
                                     metrics_listen=args.metrics_listen, passphrase=passphrase, force=args.force)

    def render(console):
        console.print(key_value_table("node %s" % summary["dir"], sorted(summary.items())))
        console.print("start it: meshnode run --node %s" % args.dir, soft_wrap=True)
        if not summary["genesis_member"]:
            console.print("not a genesis member: once it runs, ask the mesh to admit it with "
                          "meshnode join --node %s --bootstrap MULTIADDR" % args.dir, soft_wrap=True)
    emit(args, summary, render)
    return 0


# --- dev -------------------------------------------------------------------------------------------

def create_dev_node(data_dir: Path, metrics_port: int | None) -> None:
    """A one-member mesh in ``data_dir``: unencrypted node and owner keys (throwaway, like a
    testnet's), the genesis, and a config that accepts any owner's jobs."""
    identity, owner = generate_identity(), generate_identity()
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)
    paths = node_config.node_paths(data_dir)
    create_keystore(paths.keystore, identity, None)
    create_keystore(data_dir / DEV_OWNER_KEY, owner, None)
    genesis = Genesis(name="dev", created_ms=time.time_ns() // 1_000_000, params=DEFAULT_PARAMS, authorities=(),
                      members=(Member(public_key=identity.public_key, stake=DEV_STAKE, zone="zone-a",
                                      labels=(), addrs=()),))
    paths.genesis.write_bytes(genesis.encode())
    node_config.write_config(data_dir, node_config.NodeConfig(
        listen=("/ip4/127.0.0.1/tcp/0",), passphrase=node_config.PassphraseSource("insecure"),
        metrics_listen="" if metrics_port is None else "%s:%d" % (node_config.METRICS_HOST, metrics_port)))


def dev_instructions(data_dir: Path, node) -> str:
    owner_key = data_dir / DEV_OWNER_KEY
    lines = ["meshnode dev: node %s is a one-member mesh (%s), data in %s"
             % (node.identity.peer_id, node.genesis.mesh_id.hex()[:16], data_dir),
             "  submit:  meshnode submit jobs/counter.toml --key %s --node %s --wait" % (owner_key, data_dir),
             "  watch:   meshnode jobs --node %s   (or: meshnode tui --node %s --key %s)"
             % (data_dir, data_dir, owner_key)]
    if node.metrics_url:
        lines.append("  metrics: curl %s" % node.metrics_url)
    lines.append("Ctrl-C stops the node")
    return "\n".join(lines)


def cmd_dev(args) -> int:
    import trio
    from meshnode.node.driver import run_node
    if not -1 <= args.metrics_port <= 65535:
        raise ConfigError("--metrics-port: expected a port 0..65535, or -1 for off")
    metrics_port = None if args.metrics_port == -1 else args.metrics_port
    made_dir = args.dir is None or not Path(args.dir).exists()
    data_dir = Path(tempfile.mkdtemp(prefix="meshnode-dev-") if args.dir is None else args.dir).absolute()
    # Throwaway: what this run creates. A dev node kept earlier (--keep) is restarted, never removed.
    throwaway = not node_config.node_paths(data_dir).config.exists()
    if throwaway:
        if not made_dir and any(data_dir.iterdir()):
            raise ConfigError("%s holds files but no node.toml: name an empty or new directory" % data_dir)
        create_dev_node(data_dir, metrics_port)
    try:
        trio.run(lambda: run_node(data_dir, run_workloads=not args.no_workloads,
                                  on_started=lambda node: print(dev_instructions(data_dir, node), flush=True)))
    finally:
        if throwaway and not args.keep:
            remove_dev_files(data_dir, made_dir)
            print("meshnode dev: stopped; removed %s" % data_dir, file=sys.stderr)
        else:
            print("meshnode dev: stopped; kept %s (restart: meshnode dev --dir %s)" % (data_dir, data_dir),
                  file=sys.stderr)
    return 0


def remove_dev_files(data_dir: Path, made_dir: bool) -> None:
    """The directory if this run made it, else (an empty one the user named) what is in it."""
    if made_dir:
        shutil.rmtree(data_dir, ignore_errors=True)
        return
    for child in data_dir.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
