"""A node's Prometheus metrics (README "Metrics"), served on 127.0.0.1 only.

Each node has its own ``CollectorRegistry``, never the process-wide default, so several
nodes in one process (driver tests, the node-mode simulator) keep theirs apart.

Two sources, and nothing is counted twice:
- what happens: the driver hands every applied decision and published event to
  ``observe_decision`` / ``observe_events`` (decisions by kind, decision latency, round
  changes, suspicions, evictions); these are ordinary prometheus_client counters and a
  histogram.
- what the node already counts or knows: the core's drop counters (SPEC.md 2.4), the
  transport's frame counters and link RTTs, the job table, the checkpoint store, the
  runner's checkpoint-period errors and the node's own signed capability vector (GPU
  telemetry). ``NodeStateCollector`` reads them at scrape time.

The HTTP server is prometheus_client's own (a daemon thread). The node's state belongs to
its trio thread, so the collector reads it there (``trio.from_thread.run_sync``) and
builds the metric families from that snapshot; a scrape never sees a half-updated table.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Counter as PromCounter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from keys.errors import ConfigError
from keys.identity import short_id
from meshnode.node.api import newest_checkpoint
from meshnode.node.config import METRICS_HOST
from meshnode.node.runner import percentile
from protocol.job_table import LIVE_JOB_STATES, TERMINAL
from protocol.messages import VALUE_KINDS

if TYPE_CHECKING:
    from meshnode.node.driver import Node

# Submit-to-certificate is about 1-15 ms on a 4-node loopback testnet (BENCHMARKS.md); round
# timeouts push it to seconds.
DECISION_LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
MAX_TRACKED_INSTANCES = 4096   # instances whose first event we remember for the latency
JOB_STATES = ("pending",) + LIVE_JOB_STATES + TERMINAL
TRANSPORT_DROP_COUNTERS = ("bad_frame", "dropped_closing", "dropped_oversize", "dropped_queue_full",
                           "dropped_send_queue_full", "send_failed", "peer_rejected")


class NodeMetrics:
    """The registry of one node and the event-driven metrics the driver feeds."""

    def __init__(self, node: "Node"):
        self.registry = CollectorRegistry()
        self.decisions = PromCounter("meshnode_decisions", "Certified decisions applied, by kind of value",
                                     ["kind"], registry=self.registry)
        self.decision_latency = Histogram(
            "meshnode_decision_latency_seconds",
            "From this node's first event of a consensus instance (the job's arrival, its bid, "
            "a proposal) to its decision here, by kind of value",
            ["kind"], buckets=DECISION_LATENCY_BUCKETS_S, registry=self.registry)
        self.round_changes = PromCounter("meshnode_round_changes", "Consensus rounds entered after round 0, "
                                         "by reason", ["reason"], registry=self.registry)
        self.suspicions = PromCounter("meshnode_suspicions", "Suspicions this node signed (SPEC.md F2)",
                                      registry=self.registry)
        self.evictions = PromCounter("meshnode_evictions", "Eviction decisions applied (SPEC.md F5)",
                                     registry=self.registry)
        for kind in VALUE_KINDS:   # every kind shows from the start, at 0: a scrape sees a count move
            self.decisions.labels(kind)
            self.decision_latency.labels(kind)
        self.collector = NodeStateCollector(node)
        self.registry.register(self.collector)
        self._first_event_ms: OrderedDict[str, int] = OrderedDict()   # instance hex -> at_ms

    def observe_decision(self, decision) -> None:
        if not decision.certificate:   # local orders (run, stop, halt, ...) are not decisions of the mesh
            return
        self.decisions.labels(decision.value_kind).inc()
        if decision.value_kind == "eviction":
            self.evictions.inc()

    def observe_events(self, events) -> None:
        first = self._first_event_ms
        for event in events:
            detail = event.detail
            if event.kind == "suspect":
                self.suspicions.inc()
            elif event.kind == "round_change":
                self.round_changes.labels(str(detail.get("reason", "unknown"))).inc()
            # A first placement's instance id is its job id (SPEC.md P1): the job's arrival counts.
            instance = detail.get("instance") or (detail.get("job_id") if event.kind == "job_submitted" else None)
            if not isinstance(instance, str):
                continue
            if event.kind == "decided":
                started = first.pop(instance, event.at_ms)
                self.decision_latency.labels(str(detail.get("value_kind"))).observe(
                    max(0, event.at_ms - started) / 1000)
            elif event.kind == "gave_up":
                first.pop(instance, None)
            elif instance not in first:
                first[instance] = event.at_ms
                if len(first) > MAX_TRACKED_INSTANCES:
                    first.popitem(last=False)


class NodeStateCollector(Collector):
    """Metric families built at scrape time from what the node already holds."""

    def __init__(self, node: "Node"):
        self.node = node
        self.trio_token = None   # set by serve_metrics: scrapes from the server's thread go through it

    def collect(self):
        snapshot = self._on_node_thread(self.snapshot)
        return [] if snapshot is None else _families(snapshot)

    def _on_node_thread(self, read):
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:   # the HTTP server's thread
            if self.trio_token is None:
                return None
            return trio.from_thread.run_sync(read, trio_token=self.trio_token)
        return read()

    def snapshot(self) -> dict | None:
        """Plain values, read on the node's trio thread."""
        node, core = self.node, self.node.core
        if core is None:
            return None
        jobs = core.jobs()
        states = Counter(job["state"] for job in jobs)
        checkpoint_age_ms = {}
        for job in jobs:
            if job["state"] in LIVE_JOB_STATES:
                _seq, age = newest_checkpoint(node, job)
                if age is not None:
                    checkpoint_age_ms[job["job_id"].hex()] = age
        transport = node.transport
        peers = transport.peers() if transport is not None else ()
        rtts = {short_id(key): transport.rtt_us(key) for key in peers}
        period_errors = {info.job_id.hex(): list(info.interval_error_us)
                         for info in (node.runner.jobs_info() if node.runner else ())}
        vector = core.capability.vector
        return {
            "epoch": core.epoch, "members": len(core.member_records()), "member": core.is_member(),
            "halted": core.halted, "peers": len(peers), "job_states": states,
            "running_workloads": len(node.runner.running()) if node.runner else 0,
            "core_drops": dict(core.counters),
            "transport": dict(transport.counters) if transport is not None else {},
            "rtt_us": {peer: rtt for peer, rtt in rtts.items() if rtt is not None},
            "checkpoint_age_ms": checkpoint_age_ms, "period_error_us": period_errors,
            "gpus": [gpu.to_body() for gpu in vector.gpus] if vector is not None else [],
        }


def _gauge(name: str, documentation: str, value, labels=None, rows=()) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, value=value, labels=labels)
    for label_values, row_value in rows:
        family.add_metric(label_values, row_value)
    return family


def _families(s: dict) -> list:
    transport = s["transport"]
    drops = CounterMetricFamily("meshnode_messages_dropped", "Messages dropped, by layer and reason (bad remote "
                                "input in the core, SPEC.md 2.4; full queues and failed sends in the transport)",
                                labels=["layer", "reason"])
    for reason, count in sorted(s["core_drops"].items()):
        drops.add_metric(["core", reason], count)
    for reason in TRANSPORT_DROP_COUNTERS:
        if transport.get(reason):
            drops.add_metric(["transport", reason], transport[reason])
    errors = GaugeMetricFamily("meshnode_checkpoint_period_error_seconds",
                               "Checkpoint tick minus its period, over the runner's recent window, per job "
                               "running here (quantile 0.5, 0.99, and 1 for the largest)", labels=["job", "quantile"])
    for job, samples in sorted(s["period_error_us"].items()):
        if samples:
            for q in (0.5, 0.99):
                errors.add_metric([job, str(q)], percentile(samples, q) / 1e6)
            errors.add_metric([job, "1"], max(samples) / 1e6)
    gpus = s["gpus"]

    def per_gpu(field: str, scale: float = 1.0):
        return [([str(g["index"]), g["model"]], g[field] * scale) for g in gpus]

    return [
        _gauge("meshnode_epoch", "The mesh epoch this node is in", s["epoch"]),
        _gauge("meshnode_members", "Members of the current epoch", s["members"]),
        _gauge("meshnode_member", "1 while this node is a member of the mesh", int(s["member"])),
        _gauge("meshnode_halted", "1 while this node holds its workloads after a pause (SPEC.md F3)",
               int(s["halted"])),
        _gauge("meshnode_peers_connected", "Peers with an open link", s["peers"]),
        CounterMetricFamily("meshnode_messages_received", "Frames received from peers", transport.get("frames_received", 0)),
        CounterMetricFamily("meshnode_messages_sent", "Frames sent to peers", transport.get("frames_sent", 0)),
        drops,
        _gauge("meshnode_peer_rtt_seconds", "Smoothed round-trip time of each peer link (pings beside the "
               "heartbeats)", None, ["peer"], [([peer], rtt / 1e6) for peer, rtt in sorted(s["rtt_us"].items())]),
        _gauge("meshnode_jobs", "Jobs this node knows, by state", None, ["state"],
               [([state], s["job_states"].get(state, 0)) for state in JOB_STATES]),
        _gauge("meshnode_workloads_running", "Workload processes this node runs", s["running_workloads"]),
        _gauge("meshnode_checkpoint_age_seconds", "Age of the newest checkpoint known here, per live job", None,
               ["job"], [([job], age / 1000) for job, age in sorted(s["checkpoint_age_ms"].items())]),
        errors,
        _gauge("meshnode_gpu_utilization_ratio", "GPU utilisation, 0..1", None, ["gpu", "model"],
               per_gpu("util_milli", 1 / 100_000)),
        _gauge("meshnode_gpu_memory_used_bytes", "GPU memory in use", None, ["gpu", "model"],
               per_gpu("mem_used_mib", 1 << 20)),
        _gauge("meshnode_gpu_memory_total_bytes", "GPU memory", None, ["gpu", "model"],
               per_gpu("mem_total_mib", 1 << 20)),
        _gauge("meshnode_gpu_temperature_celsius", "GPU temperature", None, ["gpu", "model"],
               per_gpu("temp_milli_c", 1 / 1000)),
        _gauge("meshnode_gpu_throttle_reasons", "NVML clock-throttle reason bits (0: not throttled)", None,
               ["gpu", "model"], per_gpu("throttle_reasons")),
        _gauge("meshnode_gpu_ecc_errors", "ECC errors NVML reports (volatile, since the driver loaded)", None,
               ["gpu", "model"], per_gpu("ecc_errors")),
        _gauge("meshnode_gpu_power_watts", "GPU power draw", None, ["gpu", "model"], per_gpu("power_mw", 1 / 1000)),
    ]


def serve_metrics(metrics: NodeMetrics, port: int):
    """Start the HTTP endpoint on 127.0.0.1:``port`` (0: any free port), from the node's trio
    thread. Returns the server; ``server.server_port`` is the bound port; stop it with
    ``stop_metrics``."""
    metrics.collector.trio_token = trio.lowlevel.current_trio_token()
    try:
        server, _thread = start_http_server(port, addr=METRICS_HOST, registry=metrics.registry)
    except OSError as exc:
        raise ConfigError("node.metrics_listen: cannot listen on %s:%d: %s" % (METRICS_HOST, port, exc.strerror)) \
            from None
    return server


def stop_metrics(server) -> None:
    server.shutdown()      # returns once serve_forever has left its loop (at most its 0.5 s poll)
    server.server_close()
