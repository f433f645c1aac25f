"""The node's two clocks, read only here and in the driver's tasks, never in protocol/."""

from __future__ import annotations

import time

import trio


def now_ms() -> int:
    """The core's clock: trio's (monotonic, and mockable in driver tests)."""
    return int(trio.current_time() * 1000)


def wall_ms() -> int:
    """Wall-clock milliseconds: checkpoint timestamps, which other processes compare."""
    return time.time_ns() // 1_000_000
