"""Identities and trust: Ed25519 keys, encrypted keystores, peer IDs, genesis, attestations."""
