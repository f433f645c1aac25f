"""A node's data directory and its config file, ``DIR/node.toml``.

The directory is the node's whole local state (DESIGN.md "Interfaces"): config,
keystore, genesis, SQLite database, control socket (mode 0600) and log. The config is
read strictly: an unknown section or key, a wrong type or a malformed address is a
ConfigError whose message names the field (``policy.allowed_owners[1]: ...``), so an
operator's typo never silently becomes a default.

``write_config`` is the inverse of ``load_config`` (the testnet launcher writes one
config per node). The standard library reads TOML but cannot write it, so a small
serializer covers exactly the value types a NodeConfig holds.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from keys.errors import ConfigError
from keys.identity import peer_id_from_public_key, public_key_from_peer_id
from protocol.errors import RemoteProtocolError
from protocol.policy import LocalCapacity, NodePolicy

CONFIG_NAME = "node.toml"
MAX_LIST_ITEMS = 64  # listen/bootstrap/owners/entrypoints/attestations: bounded like everything else
MAX_TEXT_CHARS = 1024
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_MULTIADDR = re.compile(r"^/(ip4|ip6|dns4|dns6)/([^/]+)/tcp/(\d{1,5})$")
GPU_SOURCES = ("auto", "nvml", "simulated")
METRICS_HOST = "127.0.0.1"   # the Prometheus endpoint has no authentication: localhost only
_METRICS_LISTEN = re.compile(r"^127\.0\.0\.1:(\d{1,5})$")


@dataclass(frozen=True)
class NodePaths:
    """Where each piece of a node's state lives inside its data directory."""
    root: Path
    config: Path
    keystore: Path
    genesis: Path
    database: Path
    control_socket: Path
    log: Path


def node_paths(data_dir) -> NodePaths:
    root = Path(data_dir)
    return NodePaths(root=root, config=root / CONFIG_NAME, keystore=root / "keystore.json",
                     genesis=root / "genesis.bin", database=root / "node.sqlite",
                     control_socket=root / "control.sock", log=root / "node.log")


@dataclass(frozen=True)
class BootstrapPeer:
    public_key: bytes
    addr: str  # a /ip4|ip6|dns4|dns6/HOST/tcp/PORT multiaddr, without /p2p

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)


@dataclass(frozen=True)
class PassphraseSource:
    """Where the keystore passphrase comes from. ``insecure``: the empty passphrase (testnets)."""
    kind: str   # "env" | "file" | "insecure"
    value: str = ""  # the variable name or the file path (relative paths: from the data dir)


@dataclass(frozen=True)
class GpuProfile:
    """``source``: auto = NVML if a GPU answers, else this simulated profile."""
    source: str = "auto"
    model: str = "SIM-GPU"
    count: int = 1
    mem_mib: int = 24576     # per simulated GPU
    seed: int = 0            # the simulated telemetry's jitter is deterministic given it


@dataclass(frozen=True)
class NodeConfig:
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    bootstrap: tuple[BootstrapPeer, ...] = ()
    zone: str = "zone-a"
    rail_group: str = ""
    cpu_milli: int = 8000
    mem_mib: int = 32768
    passphrase: PassphraseSource = PassphraseSource("env", "MESHNODE_PASSPHRASE")
    allowed_owners: tuple[bytes, ...] | None = None  # None: "*", any owner
    allowed_entrypoints: tuple[str, ...] = ("counter", "train", "allreduce", "serve")
    labels: tuple[tuple[str, str], ...] = ()
    attestation_files: tuple[str, ...] = ()  # authority-signed Attestation envelopes, relative to DIR
    gpu: GpuProfile = GpuProfile()
    entrypoints: tuple[tuple[str, tuple[str, ...]], ...] = ()  # name -> argv the operator allows
    log_level: str = "info"
    metrics_listen: str = ""   # "127.0.0.1:PORT" serves Prometheus metrics there (0: any free port); "": off
    # SPEC 10.5: a submit is refused (retry later) while this many jobs submitted here are undecided; 0: no bound
    max_undecided_submits: int = 64

    @property
    def metrics_port(self) -> int | None:
        return parse_metrics_listen(self.metrics_listen)

    def entrypoint_argv(self, name: str) -> tuple[str, ...] | None:
        return dict(self.entrypoints).get(name)


# --- reading ------------------------------------------------------------------------------

def _text(value, where: str, min_chars: int = 1, max_chars: int = MAX_TEXT_CHARS) -> str:
    if not isinstance(value, str) or not min_chars <= len(value) <= max_chars:
        raise ConfigError("%s: expected text of %d..%d characters, got %r" % (where, min_chars, max_chars, value))
    return value


def _int(value, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError("%s: expected an integer in [%d, %d], got %r" % (where, low, high, value))
    return value


def _list(value, where: str) -> list:
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        raise ConfigError("%s: expected a list of at most %d items, got %r" % (where, MAX_LIST_ITEMS, value))
    return value


def _table(doc: dict, name: str, allowed: set[str]) -> dict:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError("%s: expected a table" % name)
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError("%s.%s: unknown key (allowed: %s)" % (name, unknown[0], ", ".join(sorted(allowed))))
    return table


def parse_multiaddr(text, where: str) -> str:
    match = _MULTIADDR.match(text) if isinstance(text, str) else None
    if match is None or int(match.group(3)) > 65535:
        raise ConfigError("%s: expected a multiaddr like /ip4/127.0.0.1/tcp/4001, got %r" % (where, text))
    return text


def parse_metrics_listen(text, where: str = "node.metrics_listen") -> int | None:
    """``"127.0.0.1:PORT"`` -> PORT (0: any free port); ``""`` -> None (metrics off)."""
    if text == "":
        return None
    match = _METRICS_LISTEN.match(text) if isinstance(text, str) else None
    if match is None or int(match.group(1)) > 65535:
        raise ConfigError("%s: expected \"127.0.0.1:PORT\" (metrics are served on localhost only) or \"\" (off), "
                          "got %r" % (where, text))
    return int(match.group(1))


def parse_bootstrap(text, where: str) -> BootstrapPeer:
    """``PUBKEYHEX@/ip4/H/tcp/P`` or ``/ip4/H/tcp/P/p2p/PEERID``."""
    if isinstance(text, str) and "@" in text:
        key_hex, _, addr = text.partition("@")
        public_key = _hex_key(key_hex, where)
        return BootstrapPeer(public_key, parse_multiaddr(addr, where))
    if isinstance(text, str) and "/p2p/" in text:
        addr, _, peer_id = text.partition("/p2p/")
        try:
            public_key = public_key_from_peer_id(peer_id)
        except (RemoteProtocolError, ValueError) as exc:
            raise ConfigError("%s: bad peer id %r: %s" % (where, peer_id, exc)) from None
        return BootstrapPeer(public_key, parse_multiaddr(addr, where))
    raise ConfigError("%s: expected PUBKEYHEX@/ip4/HOST/tcp/PORT or /ip4/HOST/tcp/PORT/p2p/PEERID, got %r"
                      % (where, text))


def _hex_key(text, where: str) -> bytes:
    if not isinstance(text, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise ConfigError("%s: expected a public key as 64 hex characters, got %r" % (where, text))
    return bytes.fromhex(text)


def _text_map(value, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or len(value) > MAX_LIST_ITEMS:
        raise ConfigError("%s: expected a table of text values" % where)
    return tuple(sorted((_text(k, where, 1, 64), _text(v, "%s.%s" % (where, k), 0, 256))
                        for k, v in value.items()))


def _passphrase(table: dict) -> PassphraseSource:
    if not table:
        return NodeConfig.passphrase
    if len(table) != 1:
        raise ConfigError("passphrase: set exactly one of env, file, insecure")
    (kind, value), = table.items()
    if kind == "insecure":
        if value is not True:
            raise ConfigError("passphrase.insecure: expected true (or remove it), got %r" % (value,))
        return PassphraseSource("insecure")
    return PassphraseSource(kind, _text(value, "passphrase.%s" % kind))


def _gpu(table: dict) -> GpuProfile:
    default = GpuProfile()
    source = table.get("source", default.source)
    if source not in GPU_SOURCES:
        raise ConfigError("gpu.source: expected one of %s, got %r" % (", ".join(GPU_SOURCES), source))
    return GpuProfile(source=source,
                      model=_text(table.get("model", default.model), "gpu.model", 1, 96),
                      count=_int(table.get("count", default.count), "gpu.count", 0, 64),
                      mem_mib=_int(table.get("mem_mib", default.mem_mib), "gpu.mem_mib", 1, 1 << 24),
                      seed=_int(table.get("seed", default.seed), "gpu.seed", 0, (1 << 63) - 1))


def _entrypoint_table(doc: dict) -> dict:
    table = doc.get("entrypoints", {})
    if not isinstance(table, dict) or len(table) > MAX_LIST_ITEMS:
        raise ConfigError("entrypoints: expected a table of at most %d name = [argv...] entries" % MAX_LIST_ITEMS)
    return table


def _entrypoints(table: dict) -> tuple[tuple[str, tuple[str, ...]], ...]:
    result = []
    for name, argv in sorted(table.items()):
        where = "entrypoints.%s" % name
        if not _NAME.match(name):
            raise ConfigError("%s: entrypoint names are 1..64 of A-Z a-z 0-9 _ . -" % where)
        argv = _list(argv, where)
        if not argv:
            raise ConfigError("%s: expected a non-empty argv list" % where)
        result.append((name, tuple(_text(arg, "%s[%d]" % (where, i), 0) for i, arg in enumerate(argv))))
    return tuple(result)


def parse_config(doc: dict) -> NodeConfig:
    """Validate a parsed TOML document. Raises ConfigError naming the first bad field."""
    unknown = sorted(set(doc) - {"node", "passphrase", "policy", "gpu", "entrypoints"})
    if unknown:
        raise ConfigError("%s: unknown section (allowed: node, passphrase, policy, gpu, entrypoints)" % unknown[0])
    node = _table(doc, "node", {"listen", "bootstrap", "zone", "rail_group", "cpu_milli", "mem_mib", "log_level",
                                "metrics_listen", "max_undecided_submits"})
    policy = _table(doc, "policy", {"allowed_owners", "allowed_entrypoints", "labels", "attestations"})
    default = NodeConfig()
    listen = tuple(parse_multiaddr(a, "node.listen[%d]" % i)
                   for i, a in enumerate(_list(node.get("listen", list(default.listen)), "node.listen")))
    if not listen:
        raise ConfigError("node.listen: expected at least one address")
    owners_raw = _list(policy.get("allowed_owners", ["*"]), "policy.allowed_owners")
    if owners_raw == ["*"]:
        owners = None
    else:
        owners = tuple(_hex_key(k, "policy.allowed_owners[%d]" % i) for i, k in enumerate(owners_raw))
    log_level = node.get("log_level", default.log_level)
    if log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError("node.log_level: expected debug, info, warning or error, got %r" % (log_level,))
    return NodeConfig(
        listen=listen,
        bootstrap=tuple(parse_bootstrap(b, "node.bootstrap[%d]" % i)
                        for i, b in enumerate(_list(node.get("bootstrap", []), "node.bootstrap"))),
        zone=_text(node.get("zone", default.zone), "node.zone", 1, 64),
        rail_group=_text(node.get("rail_group", default.rail_group), "node.rail_group", 0, 64),
        cpu_milli=_int(node.get("cpu_milli", default.cpu_milli), "node.cpu_milli", 0, 1 << 20),
        mem_mib=_int(node.get("mem_mib", default.mem_mib), "node.mem_mib", 0, 1 << 24),
        passphrase=_passphrase(_table(doc, "passphrase", {"env", "file", "insecure"})),
        allowed_owners=owners,
        allowed_entrypoints=tuple(
            _text(e, "policy.allowed_entrypoints[%d]" % i, 1, 64) for i, e in
            enumerate(_list(policy.get("allowed_entrypoints", list(default.allowed_entrypoints)),
                            "policy.allowed_entrypoints"))),
        labels=_text_map(policy.get("labels", {}), "policy.labels"),
        attestation_files=tuple(_text(p, "policy.attestations[%d]" % i) for i, p in
                                enumerate(_list(policy.get("attestations", []), "policy.attestations"))),
        gpu=_gpu(_table(doc, "gpu", {f.name for f in fields(GpuProfile)})),
        entrypoints=_entrypoints(_entrypoint_table(doc)),
        log_level=log_level,
        metrics_listen=_metrics_listen(node.get("metrics_listen", default.metrics_listen)),
        max_undecided_submits=_int(node.get("max_undecided_submits", default.max_undecided_submits),
                                   "node.max_undecided_submits", 0, 1 << 20),
    )


def _metrics_listen(value) -> str:
    parse_metrics_listen(value)
    return value


def load_config(data_dir) -> NodeConfig:
    path = node_paths(data_dir).config
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("no node config at %s (write one with `meshnode node init --dir %s --genesis FILE "
                          "--listen MULTIADDR`)" % (path, data_dir)) from None
    except OSError as exc:
        raise ConfigError("cannot read %s: %s" % (path, exc.strerror)) from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("%s: not valid TOML: %s" % (path, exc)) from None
    try:
        return parse_config(doc)
    except ConfigError as exc:
        raise ConfigError("%s: %s" % (path, exc)) from None


def read_passphrase(config: NodeConfig, data_dir, environ=None) -> str:
    """The keystore passphrase from the configured source. ``environ`` defaults to os.environ."""
    source = config.passphrase
    if source.kind == "insecure":
        return ""
    if source.kind == "env":
        value = (os.environ if environ is None else environ).get(source.value)
        if value is None:
            raise ConfigError("passphrase.env: environment variable %s is not set" % source.value)
        return value
    path = Path(data_dir) / source.value
    try:
        return path.read_text(encoding="utf-8").rstrip("\n")
    except OSError as exc:
        raise ConfigError("passphrase.file: cannot read %s: %s" % (path, exc.strerror)) from None


def node_policy(config: NodeConfig, data_dir) -> NodePolicy:
    """The sovereignty policy the protocol core enforces, with attestation files read."""
    attestations = []
    for i, name in enumerate(config.attestation_files):
        path = Path(data_dir) / name
        try:
            attestations.append(path.read_bytes())
        except OSError as exc:
            raise ConfigError("policy.attestations[%d]: cannot read %s: %s" % (i, path, exc.strerror)) from None
    return NodePolicy(
        allowed_owners=None if config.allowed_owners is None else frozenset(config.allowed_owners),
        allowed_entrypoints=frozenset(config.allowed_entrypoints), zone=config.zone,
        labels=config.labels, attestations=tuple(attestations))


def local_capacity(config: NodeConfig, gpu_mem_total_mib: tuple[int, ...], gpu_model: str) -> LocalCapacity:
    return LocalCapacity(gpu_mem_total_mib=tuple(gpu_mem_total_mib), cpu_milli=config.cpu_milli,
                         mem_mib=config.mem_mib, gpu_model=gpu_model, rail_group=config.rail_group)


# --- writing ------------------------------------------------------------------------------

def _toml_string(text: str) -> str:
    # TOML basic strings forbid raw control characters (except tab) and DEL.
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif (ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F:
            out.append("\\u%04X" % ord(ch))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join("%s = %s" % (_toml_key(k), _toml_value(v)) for k, v in value.items()) + "}"
    raise TypeError("no TOML form for %s" % type(value).__name__)


def config_document(config: NodeConfig) -> dict:
    """The TOML document (sections of plain values) that ``parse_config`` reads back as ``config``."""
    passphrase = ({"insecure": True} if config.passphrase.kind == "insecure"
                  else {config.passphrase.kind: config.passphrase.value})
    return {
        "node": {"listen": list(config.listen),
                 "bootstrap": ["%s@%s" % (p.public_key.hex(), p.addr) for p in config.bootstrap],
                 "zone": config.zone, "rail_group": config.rail_group, "cpu_milli": config.cpu_milli,
                 "mem_mib": config.mem_mib, "log_level": config.log_level,
                 "metrics_listen": config.metrics_listen, "max_undecided_submits": config.max_undecided_submits},
        "passphrase": passphrase,
        "policy": {"allowed_owners": ["*"] if config.allowed_owners is None
                   else [k.hex() for k in config.allowed_owners],
                   "allowed_entrypoints": list(config.allowed_entrypoints),
                   "labels": dict(config.labels), "attestations": list(config.attestation_files)},
        "gpu": {f.name: getattr(config.gpu, f.name) for f in fields(GpuProfile)},
        "entrypoints": {name: list(argv) for name, argv in config.entrypoints},
    }


def dumps_config(config: NodeConfig) -> str:
    lines = ["# meshnode node config (see SPEC.md, node configuration)"]
    for section, table in config_document(config).items():
        lines.append("")
        lines.append("[%s]" % section)
        lines.extend("%s = %s" % (_toml_key(k), _toml_value(v)) for k, v in table.items())
    return "\n".join(lines) + "\n"


def write_config(data_dir, config: NodeConfig) -> Path:
    """Write ``DIR/node.toml`` atomically (temp file + rename) with mode 0600."""
    path = node_paths(data_dir).config
    text = dumps_config(config)
    parse_config(tomllib.loads(text))  # never write a file we would refuse to read
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)
    return path
