"""Errors of keys and local configuration. Both derive from protocol's ``MeshError``, so
the project keeps one root exception type while protocol/ knows nothing about files."""

from __future__ import annotations

from protocol.errors import MeshError


class KeystoreError(MeshError):
    """A keystore could not be created or opened (wrong passphrase, corrupt, unsafe mode)."""


class ConfigError(MeshError):
    """A node config, genesis document or data directory is missing or invalid."""
