"""The pools file `meshnode mesh init --pools FILE` reads (SPEC.md 5.5): TOML that names the
mesh's pools and each one's per-owner quotas, and whether waiting jobs reserve capacity.

    reservations = true                  # SPEC Q5 (default false)

    [pools.training]                     # a job names it: [scheduling] pool = "training"
    default = { gpus = 2, cpu_milli = 16000, mem_mib = 65536 }   # any owner not listed
    owners."<owner public key hex, peer ID or keystore>" = { gpus = 4 }

    [pools.default]                      # the default pool (a job's pool = "")

A quota names `gpus` (whole GPUs) or `gpu_milli` (thousandths), `cpu_milli` and
`mem_mib`; a dimension left out has no limit. Unknown keys are refused, naming them.
"""

from __future__ import annotations

import tomllib

from keys.errors import ConfigError
from keys.genesis import UNLIMITED, OwnerQuota, Pool, Quota
from meshnode.cli.keys import parse_public_key
from protocol.gpu_shares import MILLI_PER_GPU

QUOTA_KEYS = ("gpus", "gpu_milli", "cpu_milli", "mem_mib")
POOL_KEYS = ("default", "owners")
DEFAULT_POOL_NAME = "default"   # the TOML name of the pool jobs name with ""


def _quota(table, where: str) -> Quota:
    if not isinstance(table, dict):
        raise ConfigError("%s: expected a table like { gpus = 2 }" % where)
    unknown = sorted(set(table) - set(QUOTA_KEYS))
    if unknown:
        raise ConfigError("%s: unknown field %s (known: %s)" % (where, unknown[0], ", ".join(QUOTA_KEYS)))
    if "gpus" in table and "gpu_milli" in table:
        raise ConfigError("%s: give gpus or gpu_milli, not both" % where)
    values = {}
    for key, value in table.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError("%s.%s: expected a whole number >= 0, got %r" % (where, key, value))
        values[key] = value
    gpu_milli = values["gpus"] * MILLI_PER_GPU if "gpus" in values else values.get("gpu_milli", UNLIMITED)
    try:
        return Quota(gpu_milli=min(gpu_milli, UNLIMITED), cpu_milli=min(values.get("cpu_milli", UNLIMITED), UNLIMITED),
                     mem_mib=min(values.get("mem_mib", UNLIMITED), UNLIMITED))
    except ValueError as exc:
        raise ConfigError("%s: %s" % (where, exc)) from None


def pools_from_toml(text: str) -> tuple[tuple, bool]:
    """(pools, reservations) from a pools file's text; ConfigError naming what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("pools file: %s" % exc) from None
    unknown = sorted(set(doc) - {"pools", "reservations"})
    if unknown:
        raise ConfigError("pools file: unknown field %s (known: pools, reservations)" % unknown[0])
    reservations = doc.get("reservations", False)
    if not isinstance(reservations, bool):
        raise ConfigError("pools file: reservations must be true or false")
    pools = []
    for name, table in sorted(doc.get("pools", {}).items()):
        where = "pools.%s" % name
        if not isinstance(table, dict):
            raise ConfigError("%s: expected a table" % where)
        unknown = sorted(set(table) - set(POOL_KEYS))
        if unknown:
            raise ConfigError("%s: unknown field %s (known: default, owners)" % (where, unknown[0]))
        owners = []
        for key, quota in sorted(table.get("owners", {}).items()):
            owners.append(OwnerQuota(owner=parse_public_key(key), quota=_quota(quota, "%s.owners.%s" % (where, key))))
        try:
            pools.append(Pool(name="" if name == DEFAULT_POOL_NAME else name,
                              default=_quota(table.get("default", {}), where + ".default"),
                              owners=tuple(sorted(owners, key=lambda o: o.owner))))
        except ValueError as exc:
            raise ConfigError("%s: %s" % (where, exc)) from None
    return tuple(pools), reservations


def load_pools(path) -> tuple[tuple, bool]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("cannot read pools file %s: %s" % (path, exc)) from None
    return pools_from_toml(text)
