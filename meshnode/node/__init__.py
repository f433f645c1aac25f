"""The node runtime (``meshnode run``): driver.py runs the protocol core under trio and
drains its Ready batches into store.py (SQLite), the transport, runner.py (workload
processes, checkpoints into checkpoint_store.py) and the control server; api.py answers
control-API operations; config.py reads ``node.toml``; telemetry.py samples the GPUs."""
