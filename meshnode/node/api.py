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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ControlApi:
    def __init__(self, node: "Node"):
        self.node = node

    def handlers(self) -> dict:
        return {"status": self.status, "nodes": self.nodes, "jobs": self.jobs, "consensus": self.consensus,
                "submit": self.submit, "cancel": self.cancel, "why": self.why, "join": self.join,
                "checkpoint_stats": self.checkpoint_stats, "job_status": self.job_status,
                "job_output": self.job_output}

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
        return {"jobs": [self._job_row(job) for job in self.node.core.jobs()]}

    def _job_row(self, job: dict) -> dict:
        latest = self.node.checkpoints.latest(job["job_id"])
        if latest is not None:  # this node holds it: the stored record is the truth
            checkpoint_seq, checkpoint_age_ms = latest.seq, max(0, wall_ms() - latest.taken_ms)
        elif job.get("known_checkpoint"):  # reported by the primary's capability vector
            checkpoint_seq, at_ms = job["known_checkpoint"]
            checkpoint_age_ms = max(0, now_ms() - at_ms)
        else:
            checkpoint_seq = checkpoint_age_ms = None
        return {
            "job_id": job["job_id"].hex(), "name": job["name"], "owner": job["owner"].hex(),
            "state": job["state"], "primary": _hex(job.get("primary")), "backups": _hex_list(job.get("backups", ())),
            "fence": job.get("fence", 0),
            "checkpoint_seq": checkpoint_seq, "checkpoint_age_ms": checkpoint_age_ms,
            "migrations": job.get("migrations", 0), "lost_work_ms": job.get("lost_work_ms"),
            "submitted_ms": job.get("submitted_ms", 0),
            "declines": {reason: len(nodes) for reason, nodes in job.get("declines", {}).items()},
            "hint": job.get("hint"), "exit_code": job.get("exit_code"),
        }

    def _find_job(self, args) -> dict:
        """The one job ``args.job_id`` names: its full id, or a prefix of one (hex)."""
        text = args.get("job_id")
        if not isinstance(text, str) or not text:
            raise MeshError("job_id must be the job's id in hex (or a prefix of it)")
        text = text.lower()
        if len(text) > 64 or any(c not in "0123456789abcdef" for c in text):
            raise MeshError("job_id %r is not a hex job id" % text[:80])
        matches = [j for j in self.node.core.jobs() if j["job_id"].hex().startswith(text)]
        if not matches:
            raise MeshError("no job %s on this node (`meshnode job list` shows the jobs it knows)" % text[:64])
        if len(matches) > 1:
            raise MeshError("job id %s is ambiguous: it starts %d jobs; give more digits" % (text, len(matches)))
        return matches[0]

    async def job_status(self, args) -> dict:
        """One job in full (`meshnode job status`): the `jobs` row, its exit code and
        attempt, and whether its workload runs on this node."""
        job = self._find_job(args)
        row = self._job_row(job)
        manifest = job["manifest"]
        row.update({"attempt": job["attempt"], "max_retries": manifest.max_retries, "exit_code": job["exit_code"],
                    "entrypoint": manifest.entrypoint, "gpus": list(job.get("gpus", ())),
                    "running_here": bool(self.node.runner and job["job_id"] in self.node.runner.running()),
                    "this_node": self.node.identity.public_key.hex()})
        return row

    async def job_output(self, args) -> dict:
        """Part of a job's output (SPEC.md 9.8): ``target`` "log" | "files" | "file", read here
        if this node runs the job, else from its primary with ``request`` (owner-signed)."""
        job = self._find_job(args)
        request = args.get("request")
        if request is not None and not isinstance(request, bytes):
            raise MeshError("args.request must be a signed output_read envelope (bytes)")
        target, path = args.get("target", "log"), args.get("path", "")
        offset, max_bytes = args.get("offset", 0), args.get("max_bytes", 65536)
        if not isinstance(target, str) or not isinstance(path, str) or not _is_int(offset) or not _is_int(max_bytes):
            raise MeshError("target and path are text, offset and max_bytes integers")
        return await self.node.output.read(job, target, path, offset, max_bytes, request)

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
            raise MeshError("submit: args.job must be the signed job envelope (bytes)")
        return {"job_id": (await self.node.submit(job)).hex()}

    async def cancel(self, args) -> dict:
        request = args.get("request")
        if not isinstance(request, bytes):
            raise MeshError("cancel: args.request must be an owner-signed cancel envelope (bytes)")
        return {"job_id": (await self.node.cancel(request)).hex()}

    async def why(self, args) -> dict:
        try:
            job_id = bytes.fromhex(args.get("job_id", ""))
        except ValueError:
            raise MeshError("why: job_id must be hex") from None
        matches = [j for j in self.node.core.jobs() if j["job_id"].startswith(job_id)] if job_id else []
        if len(matches) != 1:
            raise MeshError("why: %s matches %d jobs" % (args.get("job_id"), len(matches)))
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
        bootstrap = args.get("bootstrap", "")
        if "/p2p/" not in bootstrap:
            raise MeshError("join: --bootstrap must end in /p2p/PEERID")
        addr, peer_id = bootstrap.rsplit("/p2p/", 1)
        try:
            peer_key = public_key_from_peer_id(peer_id)
        except (RemoteProtocolError, ValueError) as exc:
            raise MeshError("join: %s" % exc) from None
        return await self.node.join(peer_key, addr)

