"""The largest checkpoint state (SPEC.md 9.4), in a module of its own: a workload's SDK
reads it, and importing protocol.messages (the schema, signing, msgpack) for one number
cost every workload start about 0.3 s (BENCHMARKS.md, "Clone latency")."""

MAX_STATE_BYTES = 900 * 1024  # checkpoint state; leaves room in the 1 MiB frame
