"""What runs on a node: manifest.py parses job manifests (TOML), sdk.py is the library a
workload process imports, builtin.py the built-in workload kinds, state_slot.py the shared
memory the runner reads checkpoints from.

The SDK's public names are re-exported here, so a workload writes
``from meshnode.workload import Workload`` (SPEC.md 9.4).
"""

from meshnode.workload.sdk import Workload

__all__ = ["Workload"]
