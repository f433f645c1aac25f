"""Who watches whom (SPEC.md F1a): each member is watched by k monitors, not by everyone.

Every member heartbeats its monitors only, so a node sends k heartbeats per period and
receives about k, whatever the mesh's size (it used to be n - 1 each way: n^2 work per
period mesh-wide). The assignment is a pure function of the membership, so every member
computes the same one (as in Rapid, USENIX ATC 2018: k rings, each a pseudo-random order
of the members, a subject's monitor on ring r being its successor there):

    position(r, key) = H("meshnode/monitor-ring" || u8 r || key)
    ring r           = the members sorted by position(r, key)
    monitors(s)      = for r in 0..k-1: the first member after s on ring r (wrapping)
                       that is not s and not already chosen on an earlier ring
    k                = min(MONITORS_PER_MEMBER, n - 1)

A member's position does not depend on the epoch, so a join or an eviction changes the
monitors of only the few members next to it on each ring. Every member watches at least
one subject (on ring 0 it is the monitor of its predecessor), so every member has someone
whose silence it notices. With n <= MONITORS_PER_MEMBER + 1 every member watches every
other: small meshes keep all-to-all heartbeats.
"""

from __future__ import annotations

import hashlib

MONITORS_PER_MEMBER = 4
RING_DOMAIN = b"meshnode/monitor-ring"


def ring_position(ring: int, key: bytes) -> bytes:
    return hashlib.sha256(RING_DOMAIN + bytes([ring]) + key).digest()


def monitor_assignment(members, k: int = MONITORS_PER_MEMBER) -> dict[bytes, tuple]:
    """Subject -> its monitors (in ring order), for every member of ``members``. O(k n log n):
    a caller keeps the result for as long as the membership holds (liveness.py, per view)."""
    members = tuple(sorted(members))
    n = len(members)
    k = max(0, min(k, n - 1))
    chosen: dict[bytes, list] = {key: [] for key in members}
    for ring in range(k):
        order = sorted(members, key=lambda key: ring_position(ring, key))
        for index, subject in enumerate(order):
            picked = chosen[subject]
            for step in range(1, n):
                candidate = order[(index + step) % n]
                if candidate not in picked:
                    picked.append(candidate)
                    break
    return {key: tuple(picked) for key, picked in chosen.items()}


def subjects_in(assignment: dict, monitor: bytes) -> tuple:
    """The members ``monitor`` watches under ``assignment``, sorted by key."""
    return tuple(subject for subject in sorted(assignment) if monitor in assignment[subject])
