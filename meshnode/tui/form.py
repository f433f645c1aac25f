"""The compose-a-job form as data: field values -> manifest TOML -> JobManifest (pure).

The form never validates on its own: it writes what the owner typed into the same
TOML a manifest file would hold and hands it to ``meshnode.workload.manifest.parse_manifest``,
so the TUI and ``meshnode submit FILE`` accept and reject exactly the same jobs
and the error names the manifest field. A number field holding something that is not
an integer is written as a TOML string, so the parser, not the form, reports it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from protocol.errors import ManifestError

# form field id -> the manifest field path parse_manifest names in its errors
FORM_FIELDS = {
    "name": "name", "entrypoint": "entrypoint", "args": "args",
    "gpus": "resources.gpus", "gpu_mem_mib": "resources.gpu_mem_mib",
    "cpu_milli": "resources.cpu_milli", "mem_mib": "resources.mem_mib",
    "strategy": "strategy", "zones": "constraints.zones", "labels": "constraints.labels",
    "attested": "constraints.attested", "priority": "priority", "backups": "backups",
}
DEFAULT_VALUES = {
    "name": "", "entrypoint": "counter", "args": "", "gpus": "0", "gpu_mem_mib": "0",
    "cpu_milli": "1000", "mem_mib": "512", "strategy": "throughput", "zones": "", "labels": "",
    "attested": "", "priority": "100", "backups": "1",
}
RESOURCE_FIELDS = ("gpus", "gpu_mem_mib", "cpu_milli", "mem_mib")
MAX_FORM_TEXT = 4096  # longer than any valid field; keeps a pasted blob from reaching the parser


@dataclass(frozen=True)
class FormCheck:
    """The verdict on the form as it stands: a manifest, or the first error and its field."""
    manifest: object | None
    error: str
    field: str | None  # the form field id the error is about, when it names one


def _toml_string(text: str) -> str:
    # JSON string escapes (\", \\, \n, \u00XX) are valid TOML basic-string escapes; non-ASCII
    # stays literal because TOML refuses the surrogate pairs JSON would write for it, and
    # DEL, which JSON leaves alone, is a control character TOML wants escaped.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_number(text: str) -> str:
    text = text.strip()
    try:
        return str(int(text, 10))
    except ValueError:
        return _toml_string(text)


def _toml_pairs(text: str, where: str) -> str:
    """``k=v, k2=v2`` -> an inline TOML table; a pair without ``=`` is a ManifestError."""
    items = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ManifestError("%s: expected key=value pairs separated by commas, got %r" % (where, part))
        items.append("%s = %s" % (_toml_string(key.strip()), _toml_string(value.strip())))
    return "{ %s }" % ", ".join(items)


def form_to_toml(values: dict) -> str:
    """Write the form's text values as a manifest TOML document."""
    for field_id, text in values.items():
        if len(text) > MAX_FORM_TEXT:
            raise ManifestError("%s: longer than %d characters" % (FORM_FIELDS.get(field_id, field_id), MAX_FORM_TEXT))
    try:
        args = shlex.split(values["args"])
    except ValueError as exc:
        raise ManifestError("args: %s" % exc) from None
    zones = [z.strip() for z in values["zones"].split(",") if z.strip()]
    lines = [
        "name = %s" % _toml_string(values["name"].strip()),
        "entrypoint = %s" % _toml_string(values["entrypoint"].strip()),
        "args = [%s]" % ", ".join(_toml_string(a) for a in args),
        "strategy = %s" % _toml_string(values["strategy"].strip()),
        "priority = %s" % _toml_number(values["priority"]),
        "backups = %s" % _toml_number(values["backups"]),
        "",
        "[resources]",
        *("%s = %s" % (key, _toml_number(values[key])) for key in RESOURCE_FIELDS),
        "",
        "[constraints]",
        "zones = [%s]" % ", ".join(_toml_string(z) for z in zones),
        "labels = %s" % _toml_pairs(values["labels"], "constraints.labels"),
        "attested = %s" % _toml_pairs(values["attested"], "constraints.attested"),
    ]
    return "\n".join(lines) + "\n"


def field_of_error(message: str) -> str | None:
    """The form field a ManifestError message is about (it starts with the field path)."""
    best = None
    for field_id, path in FORM_FIELDS.items():
        if message.startswith(path) and (best is None or len(path) > len(FORM_FIELDS[best])):
            best = field_id
    return best


def check_form(values: dict, parse_manifest, owner_pubkey: bytes, now_ms: int) -> FormCheck:
    """Validate the form through ``parse_manifest``; never raises for bad input."""
    try:
        manifest = parse_manifest(form_to_toml(values), owner_pubkey, now_ms)
    except ManifestError as exc:
        message = str(exc)
        return FormCheck(None, message, field_of_error(message))
    return FormCheck(manifest, "", None)
