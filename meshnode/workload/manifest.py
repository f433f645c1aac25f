"""Job manifests: TOML files a workload owner writes and signs (SPEC.md section 4.2).

:func:`parse_manifest` turns TOML text into a ``protocol.messages.JobManifest``. Every
error names the field and what was expected, and unknown keys are refused (a typo
like ``gpu = 1`` must not silently mean "no GPU"). Limits come from the message
SCHEMA, so this file and the wire format cannot disagree.
"""

from __future__ import annotations

import tomllib

from protocol import codec
from protocol.envelope import Envelope
from protocol.errors import ManifestError, RemoteProtocolError
from protocol.messages import (MAX_REFLEXES, REFLEX_AMOUNTS, Constraints, Gang,
                               JobManifest, Reflex, Resources, Scheduling, Service, decode_message)
from protocol.schema import Bool, Bytes, FieldType, Int, List, Optional, Text, TextMap

MAX_MANIFEST_BYTES = 64 * 1024

# Fields a manifest may leave out, and the value they then take (SPEC.md 4.2).
TOP_LEVEL_DEFAULTS = {"args": [], "strategy": "throughput", "priority": 0, "backups": 1,
                      "max_retries": 3, "nonce": 0}
REQUIRED = ("name", "entrypoint")
TABLES = {"resources": Resources, "constraints": Constraints, "scheduling": Scheduling, "gang": Gang,
          "service": Service}
TABLE_DEFAULTS = {
    "resources": {"gpus": 0, "gpu_mem_mib": 0, "cpu_milli": 0, "mem_mib": 0, "gpu_milli": 0, "gpu_model": ""},
    "constraints": {"zones": [], "labels": {}, "attested": {}},
    "scheduling": {"pool": "", "preemptible": False, "max_runtime_ms": 0},
    "gang": {"workers": 1, "min_workers": 0, "max_workers": 0, "multiple_of": 1, "topology": "none"},
    "service": {"port": 0, "min_replicas": 1, "max_replicas": 1},
}
# Filled in from the signer and the clock, never from the file.
NOT_IN_FILE = ("owner", "created_ms", "epoch")
# Reflex rules are written one ``[[reflex]]`` table each (SPEC.md 4.2, R3).
REFLEX_KEY = "reflex"
REFLEX_DEFAULTS = {"above": None, "below": None, "for_ms": 5000, "zone": "", "cooldown_ms": 60_000}
REFLEX_REQUIRED = ("signal", "action")
# R4: a replica action's amount is written under the action's own name (``clone = 2``,
# ``reroute = 50``, ``decay = 50``); a clone adds one replica unless it says more.
REFLEX_AMOUNT_KEYS = ("clone", "reroute", "decay")
REFLEX_AMOUNT_DEFAULTS = {"clone": 1}


def human_expectation(ftype: FieldType) -> str:
    """What a TOML author must write for a field of this type, in words."""
    if isinstance(ftype, Int):
        return "an integer %d..%d" % (ftype.low, ftype.high)
    if isinstance(ftype, Text):
        if ftype.choices:
            return "one of " + ", ".join(repr(c) for c in ftype.choices)
        return "a string of %d..%d bytes" % (ftype.min_len, ftype.max_len)
    if isinstance(ftype, List):
        return "an array of at most %d items, each %s" % (ftype.max_items, human_expectation(ftype.item))
    if isinstance(ftype, TextMap):
        return "a table of at most %d string values" % ftype.max_items
    if isinstance(ftype, Optional):
        return human_expectation(ftype.inner)
    if isinstance(ftype, Bool):
        return "true or false"
    if isinstance(ftype, Bytes):
        return "bytes"
    return ftype.describe()


def _checked(ftype: FieldType, value, where: str):
    try:
        return ftype.check(value, where)
    except RemoteProtocolError:
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        raise ManifestError("%s: expected %s, got %s" % (where, human_expectation(ftype), shown)) from None


def _reject_unknown(found: dict, allowed, where: str) -> None:
    unknown = sorted(set(found) - set(allowed))
    if unknown:
        raise ManifestError("%s: unknown key %r (allowed: %s)" % (where, unknown[0], ", ".join(sorted(allowed))))


def _table(document: dict, name: str):
    cls = TABLES[name]
    raw = document.get(name, {})
    if not isinstance(raw, dict):
        raise ManifestError("%s: expected a table [%s], got %r" % (name, name, raw))
    _reject_unknown(raw, cls.SCHEMA, "[%s]" % name)
    values = {**TABLE_DEFAULTS[name], **raw}
    if name == "gang" and "workers" not in raw and ("min_workers" in raw or "max_workers" in raw):
        values["workers"] = 0   # a size range alone means an elastic gang
    checked = {field: _checked(ftype, values[field], "%s.%s" % (name, field)) for field, ftype in cls.SCHEMA.items()}
    try:
        return cls(**checked)
    except ValueError as exc:  # a cross-field rule, e.g. resources.gpu_milli needs gpus = 1
        raise ManifestError("[%s]: %s" % (name, str(exc).split(": ", 1)[-1])) from None


def _reflexes(document: dict) -> tuple:
    """The ``[[reflex]]`` tables, each checked like a table and named ``reflex[i]`` in errors."""
    raw = document.get(REFLEX_KEY, [])
    if not isinstance(raw, list) or not all(isinstance(item, dict) for item in raw):
        raise ManifestError("%s: expected [[reflex]] tables, got %r" % (REFLEX_KEY, raw))
    if len(raw) > MAX_REFLEXES:
        raise ManifestError("%s: at most %d rules, got %d" % (REFLEX_KEY, MAX_REFLEXES, len(raw)))
    rules = []
    for i, item in enumerate(raw):
        where = "%s[%d]" % (REFLEX_KEY, i)
        _reject_unknown(item, [f for f in Reflex.SCHEMA if f != "amount"] + list(REFLEX_AMOUNT_KEYS), where)
        for name in REFLEX_REQUIRED:
            if name not in item:
                raise ManifestError("%s.%s: required, expected %s" % (where, name, human_expectation(Reflex.SCHEMA[name])))
        if ("above" in item) == ("below" in item):
            raise ManifestError("%s: give exactly one of above and below" % where)
        values = {**REFLEX_DEFAULTS, **item}
        values["amount"] = _reflex_amount(item, where)
        rules.append(Reflex(**{field: _checked(ftype, values[field], "%s.%s" % (where, field))
                               for field, ftype in Reflex.SCHEMA.items()}))
    return tuple(rules)


def _reflex_amount(item: dict, where: str) -> int:
    """R4: the rule's amount, from the key named after its action (refused under another)."""
    action = item["action"]
    for key in REFLEX_AMOUNT_KEYS:
        if key in item and key != action:
            raise ManifestError("%s.%s: only a rule with action = %r gives it (this one's action is %r)"
                                % (where, key, key, action))
    if action not in REFLEX_AMOUNTS or action not in REFLEX_AMOUNT_KEYS:
        return 0   # migrate (an unknown action is refused by the schema, naming reflex[i].action)
    if action not in item and action not in REFLEX_AMOUNT_DEFAULTS:
        raise ManifestError("%s.%s: required with action = %r, expected an integer %d..%d (a percentage)"
                            % ((where, action, action) + REFLEX_AMOUNTS[action]))
    low, high = REFLEX_AMOUNTS[action]
    return _checked(Int(low, high), item.get(action, REFLEX_AMOUNT_DEFAULTS.get(action)), "%s.%s" % (where, action))


def parse_manifest(text: str, owner_pubkey: bytes, now_ms: int, *, epoch: int) -> JobManifest:
    """Parse a TOML manifest for ``owner_pubkey``, stamped ``created_ms = now_ms`` and the
    mesh ``epoch`` whose members are to place it (SPEC.md P2: the node's current one)."""
    if not isinstance(epoch, int) or epoch < 0:
        raise ManifestError("epoch: expected a mesh epoch (int >= 0), got %r" % (epoch,))
    if len(text.encode("utf-8")) > MAX_MANIFEST_BYTES:
        raise ManifestError("manifest is larger than %d bytes" % MAX_MANIFEST_BYTES)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError("manifest is not valid TOML: %s" % exc) from None
    allowed = [f for f in JobManifest.SCHEMA if f not in NOT_IN_FILE and f != "reflexes"] + [REFLEX_KEY]
    _reject_unknown(document, allowed, "manifest")
    for name in REQUIRED:
        if name not in document:
            raise ManifestError("%s: required, expected %s" % (name, human_expectation(JobManifest.SCHEMA[name])))
    values = {**TOP_LEVEL_DEFAULTS, **document}
    fields = {}
    for name, ftype in JobManifest.SCHEMA.items():
        if name in NOT_IN_FILE:
            continue
        if name == "reflexes":
            fields[name] = _reflexes(document)
            continue
        fields[name] = _table(document, name) if name in TABLES else _checked(ftype, values[name], name)
    if fields["strategy"] == "sovereign" and not (fields["constraints"].zones or fields["constraints"].attested):
        raise ManifestError("strategy: 'sovereign' needs constraints.zones or constraints.attested")
    return JobManifest(owner=owner_pubkey, created_ms=now_ms, epoch=epoch, **fields)


def load_manifest(path, owner_pubkey: bytes, now_ms: int, *, epoch: int) -> JobManifest:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError("cannot read manifest %s: %s" % (path, exc.strerror)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError("manifest %s is not UTF-8 text" % path) from None
    return parse_manifest(text, owner_pubkey, now_ms, epoch=epoch)


def verify_signed_job(data: bytes, mesh_id: bytes | None = None) -> tuple[Envelope, JobManifest]:
    """Verify a signed job envelope: signature, schema, and owner == signer.

    With ``mesh_id`` the job must be signed for that mesh or for ANY_MESH (SPEC.md
    4.2); with ``None`` it is checked for whichever mesh it names.
    """
    if mesh_id is None:
        value = codec.unpack(data)
        if not isinstance(value, list) or len(value) != 6 or not isinstance(value[1], bytes):
            raise RemoteProtocolError("envelope: expected an array of 6 items")
        mesh_id = value[1]
    envelope, job = decode_message(data, mesh_id, expect=JobManifest, allow_any_mesh=True)
    if job.owner != envelope.signer:
        raise RemoteProtocolError("job: signed by a key that is not its owner")
    return envelope, job

