"""The control-API operations a node serves (SPEC.md "Control API / Operations").

Each handler turns the protocol core's read-only views into the documented result
shape: text keys, keys and ids as hex, integers only. The TUI and the CLI read these
shapes; tests pin them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keys.identity import public_key_from_peer_id, short_id
from meshnode.node.clock import now_ms, wall_ms
from protocol.errors import MeshError, RemoteProtocolError

if TYPE_CHECKING:
    from meshnode.node.driver import Node

CHECKPOINT_STATS_WINDOW = 4096   # latencies kept for the checkpoint_stats op (the driver's windows too)


def _hex(value):
    return value.hex() if isinstance(value, (bytes, bytearray)) else value


def _hex_list(values):
    return [_hex(v) for v in values]


def _text_arg(args: dict, name: str) -> str:
    """A text argument of a request; anything else is the client's error, not a handler bug.

    Error texts name no op: the client prefixes the op it called (``why: ...``)."""
    value = args.get(name, "")
    if not isinstance(value, str):
        raise MeshError("args.%s: expected text, got %s" % (name, type(value).__name__))
    return value


class ControlApi:
    def __init__(self, node: "Node"):
        self.node = node

    def handlers(self) -> dict:
        return {"status": self.status, "nodes": self.nodes, "jobs": self.jobs, "consensus": self.consensus,
                "submit": self.submit, "cancel": self.cancel, "why": self.why, "join": self.join,
                "checkpoint_stats": self.checkpoint_stats}

    async def status(self, args) -> dict:
        node, core = self.node, self.node.core
        return {"node": node.identity.public_key.hex(), "peer_id": node.identity.peer_id,
                "mesh_id": node.genesis.mesh_id.hex(), "epoch": core.epoch,
                "members": len(core.member_records()), "member": core.is_member(),
                "evicted_at_epoch": core.evicted_at_epoch, "halted": core.halted,
                "connected": len(node.transport.peers()), "uptime_ms": now_ms() - node.started_ms,
                "running_workloads": len(node.runner.running()) if node.runner else 0,
                "dropped": dict(core.counters), "telemetry": node.telemetry.describe_source()}

    async def nodes(self, args) -> dict:
        node = self.node
        rows = []
        for member in node.core.members():
            key = member["key"]
            rows.append({"key": key.hex(), "short": short_id(key), "stake": member["stake"],
                         "zone": member["zone"], "health": member["health"],
                         "rtt_us": None if key == node.identity.public_key else node.transport.rtt_us(key),
                         "capability": self._capability(key)})
        return {"nodes": rows}

    def _capability(self, key: bytes) -> dict | None:
        """The member's latest signed capability vector, per GPU (the TUI's mesh view)."""
        core = self.node.core
        cap = core.capability.vector if key == self.node.identity.public_key else core.capability.peers.get(key)
        if cap is None:
            return None
        return {"gpus": [gpu.to_body() for gpu in cap.gpus], "gpus_free": list(cap.gpus_free),
                "cpu_milli_free": cap.cpu_milli_free, "mem_mib_free": cap.mem_mib_free,
                "taken_ms": cap.taken_ms, "seq": cap.seq, "simulated": cap.simulated}

    async def jobs(self, args) -> dict:
        rows = []
        for job in self.node.core.jobs():
            latest = self.node.checkpoints.latest(job["job_id"])
            if latest is not None:  # this node holds it: the stored record is the truth
                checkpoint_seq, checkpoint_age_ms = latest.seq, max(0, wall_ms() - latest.taken_ms)
            elif job.get("known_checkpoint"):  # reported by the primary's capability vector
                checkpoint_seq, at_ms = job["known_checkpoint"]
                checkpoint_age_ms = max(0, now_ms() - at_ms)
            else:
                checkpoint_seq = checkpoint_age_ms = None
            rows.append({
                "job_id": job["job_id"].hex(), "name": job["name"], "owner": job["owner"].hex(),
                "state": job["state"], "primary": _hex(job.get("primary")), "backups": _hex_list(job.get("backups", ())),
                "fence": job.get("fence", 0),
                "checkpoint_seq": checkpoint_seq, "checkpoint_age_ms": checkpoint_age_ms,
                "migrations": job.get("migrations", 0), "lost_work_ms": job.get("lost_work_ms"),
                "submitted_ms": job.get("submitted_ms", 0),
                "declines": {reason: len(nodes) for reason, nodes in job.get("declines", {}).items()},
                "hint": job.get("hint"),
            })
        return {"jobs": rows}

    async def consensus(self, args) -> dict:
        view = self.node.core.consensus_view()
        return {"instances": [{"instance": i["instance"].hex(), "kind": i["kind"], "round": i["round"],
                               "leader": _hex(i["leader"]), "decided": i["decided"]} for i in view["instances"]],
                "certificates": view["certificates"],
                "evidence": [{"offender": e["offender"].hex(), "kind": e["kind"], "at_ms": e["at_ms"]}
                             for e in view["evidence"]]}

    async def submit(self, args) -> dict:
        job = args.get("job")
        if not isinstance(job, bytes):
            raise MeshError("args.job must be the signed job envelope (bytes)")
        return {"job_id": (await self.node.submit(job)).hex()}

    async def cancel(self, args) -> dict:
        request = args.get("request")
        if not isinstance(request, bytes):
            raise MeshError("args.request must be an owner-signed cancel envelope (bytes)")
        return {"job_id": (await self.node.cancel(request)).hex()}

    async def why(self, args) -> dict:
        text = _text_arg(args, "job_id")
        try:
            job_id = bytes.fromhex(text)
        except ValueError:
            raise MeshError("job_id %r is not hex" % text) from None
        matches = [j for j in self.node.core.jobs() if j["job_id"].startswith(job_id)] if job_id else []
        if len(matches) != 1:
            raise MeshError("job id %s matches %d jobs" % (text, len(matches)))
        job = matches[0]
        return {"job_id": job["job_id"].hex(), "state": job["state"],
                "declines": {reason: [short_id(k) for k in nodes] for reason, nodes in job.get("declines", {}).items()},
                "hint": job.get("hint")}

    async def checkpoint_stats(self, args) -> dict:
        """Raw recent samples (bounded windows): how late checkpoints are stored here after the
        workload offered them, as primary (write_ms) and as backup (replication_ms), and how
        far each checkpoint tick of the workloads running here was from its period."""
        node = self.node
        interval_error_us = [e for job in (node.runner.jobs_info() if node.runner else ())
                             for e in job.interval_error_us]
        # Bounded like the other two: 256 workloads' windows would overflow a control frame.
        interval_error_us = interval_error_us[-CHECKPOINT_STATS_WINDOW:]
        return {"write_ms": list(node.checkpoint_write_ms), "replication_ms": list(node.checkpoint_replication_ms),
                "interval_error_us": interval_error_us}

    async def join(self, args) -> dict:
        bootstrap = _text_arg(args, "bootstrap")
        if "/p2p/" not in bootstrap:
            raise MeshError("--bootstrap must end in /p2p/PEERID")
        addr, peer_id = bootstrap.rsplit("/p2p/", 1)
        try:
            peer_key = public_key_from_peer_id(peer_id)
        except (RemoteProtocolError, ValueError) as exc:
            raise MeshError(str(exc)) from None
        return await self.node.join(peer_key, addr)

