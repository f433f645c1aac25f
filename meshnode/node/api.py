"""The control-API operations a node serves (SPEC.md "Control API / Operations").

Each handler turns the protocol core's read-only views into the documented result
shape: text keys, keys and ids as hex, integers only. The TUI and the CLI read these
shapes; tests pin them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keys.identity import public_key_from_peer_id, short_id
from meshnode.node.clock import now_ms, wall_ms
from meshnode.node.telemetry import SimulatedFault
from protocol import codec
from protocol.errors import MeshError, RemoteProtocolError
from protocol.flows.move import decode_request
from protocol.gang_placement import gang_worker_id
from protocol.placement import resource_check
from protocol.messages import (CommitCertificate, MoveRequest, decode_message, decode_value, job_id as job_id_of,
                               placement_attempts, placement_instance_id, placement_slot, placement_slot_id,
                               preemption_instance_id)

if TYPE_CHECKING:
    from meshnode.node.driver import Node

CHECKPOINT_STATS_WINDOW = 4096   # latencies kept for the checkpoint_stats op (the driver's windows too)
# The certificates op answers in one control frame (1 MiB): what it returns stays under
# this, the rest of the frame being the keys and ids around the certificate bytes.
CERTIFICATE_REPLY_BYTES = codec.MAX_FRAME_BYTES - 64 * 1024
GANG_HISTORY_SHOWN = 32   # a gang's newest recovery-history entries `why` returns


def _hex(value):
    return value.hex() if isinstance(value, (bytes, bytearray)) else value


def _hex_list(values):
    return [_hex(v) for v in values]


def _gang_fields(job: dict) -> dict:
    """A gang's topology, sizes and ranks, or a rank's gang, in hex for the wire (GA4)."""
    fields = {}
    if "gang" in job:
        gang = job["gang"]
        fields["gang"] = {"topology": gang["topology"], "sizes": gang["sizes"], "workers": [
            {**w, "job_id": w["job_id"].hex(), "primary": _hex(w["primary"])} for w in gang["workers"]]}
    if "gang_of" in job:
        fields["gang_of"] = {"gang_id": job["gang_of"]["gang_id"].hex(), "rank": job["gang_of"]["rank"]}
    return fields


def _text_arg(args: dict, name: str) -> str:
    """A text argument of a request; anything else is the client's error, not a handler bug.

    Error texts name no op: the client prefixes the op it called (``why: ...``)."""
    value = args.get(name, "")
    if not isinstance(value, str):
        raise MeshError("args.%s: expected text, got %s" % (name, type(value).__name__))
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _without_seq(row: dict) -> dict:
    return {key: value for key, value in row.items() if key != "seq"}


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def newest_checkpoint(node: "Node", job: dict) -> tuple[int | None, int | None]:
    """(seq, age in ms) of the newest checkpoint of ``job`` known here, or (None, None)."""
    latest = node.checkpoints.latest(job["job_id"])
    if latest is not None:  # this node holds it: the stored record is the truth
        return latest.seq, max(0, wall_ms() - latest.taken_ms)
    if job.get("known_checkpoint"):  # reported by the primary's capability vector
        seq, at_ms = job["known_checkpoint"]
        return seq, max(0, now_ms() - at_ms)
    return None, None


class ControlApi:
    def __init__(self, node: "Node"):
        self.node = node

    def handlers(self) -> dict:
        return {"status": self.status, "nodes": self.nodes, "jobs": self.jobs, "consensus": self.consensus,
                "submit": self.submit, "cancel": self.cancel, "move": self.move, "why": self.why, "join": self.join,
                "checkpoint_stats": self.checkpoint_stats, "certificates": self.certificates,
                "job_status": self.job_status, "job_output": self.job_output, "endpoints": self.endpoints,
                "set_simulated_telemetry": self.set_simulated_telemetry}

    async def status(self, args) -> dict:
        node, core = self.node, self.node.core
        return {"node": node.identity.public_key.hex(), "peer_id": node.identity.peer_id,
                "mesh_id": node.genesis.mesh_id.hex(), "epoch": core.epoch,
                "members": len(core.member_records()), "member": core.is_member(),
                "evicted_at_epoch": core.evicted_at_epoch, "halted": core.halted,
                "connected": len(node.transport.peers()), "uptime_ms": now_ms() - node.started_ms,
                "running_workloads": len(node.runner.running()) if node.runner else 0,
                "dropped": dict(core.counters), "transport": dict(node.transport.counters),
                "telemetry": dict(node.telemetry.describe_source(), failing=core.capability.telemetry_fault,
                                  read_errors=node.telemetry_errors),
                "metrics": node.metrics_url,
                "bid_sample": core.ctx.bid_sample or 0,   # about this many members bid per job (SPEC.md 5.6)
                # Thousandths of each of this node's GPUs its bids and jobs hold (SPEC.md R1, P4c).
                "gpu_milli_held": list(core.ledger.held_gpu_milli())}

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
                "gpu_milli_free": list(cap.gpu_milli_free), "cpu_milli_free": cap.cpu_milli_free, "mem_mib_free": cap.mem_mib_free,
                "taken_ms": cap.taken_ms, "seq": cap.seq, "simulated": cap.simulated,
                # The load its jobs reported (SPEC.md R3a), as reflex rules read it.
                "job_signals": {s.job_id.hex(): {"request_rate_milli": s.request_rate_milli,
                                                 "latency_p99_us": s.latency_p99_us,
                                                 "progress_rate_milli": s.progress_rate_milli}
                                for s in cap.job_signals}}

    async def jobs(self, args) -> dict:
        """Every job; a gang is one row with its ranks (SPEC.md GA4), not a row per rank."""
        return {"jobs": [self._job_row(job) for job in self.node.core.jobs() if "gang_of" not in job]}

    def _job_row(self, job: dict) -> dict:
        checkpoint_seq, checkpoint_age_ms = newest_checkpoint(self.node, job)
        return {
            "job_id": job["job_id"].hex(), "name": job["name"], "owner": job["owner"].hex(),
            "state": job["state"], "primary": _hex(job.get("primary")), "backups": _hex_list(job.get("backups", ())),
            "fence": job.get("fence", 0),
            "checkpoint_seq": checkpoint_seq, "checkpoint_age_ms": checkpoint_age_ms,
            "migrations": job.get("migrations", 0), "lost_work_ms": job.get("lost_work_ms"),
            "submitted_ms": job.get("submitted_ms", 0),
            "declines": {reason: len(nodes) for reason, nodes in job.get("declines", {}).items()},
            "hint": job.get("hint"), "exit_code": job.get("exit_code"),
            # Where it runs at its primary, and its share of that GPU (0: whole GPUs; SPEC.md P4c).
            "gpus": list(job.get("gpus", ())), "gpu_milli": job["manifest"].resources.gpu_milli,
            **_gang_fields(job),
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

    async def endpoints(self, args) -> dict:
        """A job's endpoint table (SPEC.md R4e, `meshnode endpoints`): replica -> node, address,
        the service port and weight; the same at every member."""
        job = self._find_job(args)
        rows = self.node.core.endpoints(job["job_id"], self.node.member_host) or []
        total = sum(row["weight"] for row in rows)
        return {"job_id": job["job_id"].hex(), "name": job["manifest"].name, "state": job["state"],
                "port": job["manifest"].service.port, "total_weight": total,
                "endpoints": [{**row, "node": _hex(row["node"])} for row in rows]}

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
                               "leader": _hex(i["leader"]), "decided": i["decided"], "applied": i["applied"],
                               "gave_up": i["gave_up"]}
                              for i in view["instances"]],
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

    async def move(self, args) -> dict:
        request = args.get("request")
        if not isinstance(request, bytes):
            raise MeshError("args.request must be an owner-signed move_request envelope (bytes)")
        return {"job_id": (await self.node.move(request)).hex()}

    async def why(self, args) -> dict:
        job = self._one_job(_text_arg(args, "job_id"))
        queue = self.node.core.pending_report(job["job_id"], now_ms()) if job["state"] == "pending" else None
        result = {"job_id": job["job_id"].hex(), "state": job["state"],
                  "declines": {reason: [short_id(k) for k in nodes]
                               for reason, nodes in job.get("declines", {}).items()},
                  "hint": job.get("hint"), "queue": queue,
                  "preempted_by": job["preempted_by"].hex() if job.get("preempted_by") else None,
                  "borrowing": self.node.core.borrowing_report(job["job_id"], now_ms())}
        if "gang" in job:
            result["gang"] = dict(_gang_fields(job)["gang"], groups=self._topology_groups(job),
                                  history=self._gang_history(job))
        return result

    def _topology_groups(self, job: dict) -> list[dict]:
        """The groups a gang's topology rule draws its workers from (SPEC.md GA2), over the
        members' newest capability vectors: per zone (``zone``, ``spread_zones``) or per zone and
        rail group (``rail_group``, ``none``), its nodes, how many fit one worker now, and their
        GPUs. A node with no rail group cannot hold a ``rail_group`` gang's worker (``allowed``)."""
        manifest, book = job["manifest"], self.node.core.capability
        by_zone = manifest.gang.topology in ("zone", "spread_zones")
        groups: dict[str, dict] = {}
        for member in self.node.core.members():
            key = member["key"]
            cap = book.vector if key == self.node.identity.public_key else book.peers.get(key)
            if cap is None:
                continue
            name = cap.zone if by_zone else "%s/%s" % (cap.zone, cap.rail_group or "-")
            group = groups.setdefault(name, {"group": name, "nodes": 0, "fit": 0, "gpus": 0, "gpus_free": 0,
                                             "allowed": by_zone or bool(cap.rail_group)
                                             or manifest.gang.topology == "none"})
            group["nodes"] += 1
            group["fit"] += int(resource_check(manifest, cap)[0])
            group["gpus"] += len(cap.gpus)
            group["gpus_free"] += len(cap.gpus_free)
        return [groups[name] for name in sorted(groups)]

    def _gang_history(self, job: dict) -> list[dict]:
        """What the certificates this node applied say happened to a gang, in decision order:
        each attempt's placement (GA3) and each rank an eviction moved (F5, GA5)."""
        jid, manifest = job["job_id"], job["manifest"]
        attempts = {placement_instance_id(jid, attempt).hex(): attempt
                    for attempt in range(placement_attempts(manifest))}
        rank_of = {gang_worker_id(jid, rank): rank for rank in range(max(manifest.gang.sizes()))}
        history = []
        for row in self._certificate_rows("value_kind IN ('gang_placement', 'eviction')", []):
            if row["value_kind"] == "gang_placement":
                if row["instance"] in attempts:
                    history.append({"kind": "placed", "epoch": row["epoch"], "attempt": attempts[row["instance"]],
                                    "workers": [w.node.hex() for w in self._decided(row).workers]})
                continue
            eviction = self._decided(row)
            history += [{"kind": "rank_moved", "epoch": row["epoch"], "rank": rank_of[m.job_id],
                         "from": eviction.node.hex(), "to": m.to_node.hex()}
                        for m in eviction.migrations if m.job_id in rank_of]
        return history[-GANG_HISTORY_SHOWN:]

    async def certificates(self, args) -> dict:
        """SPEC.md 10.5: the commit certificates (wire bytes) this node applied for one job or
        one instance, and the epoch changes that lead to their epochs, so `meshnode cert
        export` can write files `meshnode cert verify` checks anywhere, with only the genesis."""
        if set(args) not in ({"job_id"}, {"instance"}):
            raise MeshError("args must be {job_id: hex prefix} or {instance: 64 hex digits}")
        if "instance" in args:
            instance = args["instance"]
            if not isinstance(instance, str) or len(instance) != 64 or not _is_hex(instance):
                raise MeshError("instance must be 64 hex digits")
            rows = self._certificate_rows("instance = ?", [instance.lower()])
            if not rows:
                raise MeshError("this node applied no certificate of instance %s" % instance)
        else:
            rows = self._job_certificate_rows(self._one_job(args["job_id"]))
        newest_epoch = max(row["epoch"] for row in rows) if rows else 0
        changes = self._certificate_rows("value_kind IN ('eviction', 'membership') AND epoch < ?", [newest_epoch])
        size = sum(len(row["certificate"]) for row in rows + changes)
        if size > CERTIFICATE_REPLY_BYTES:
            raise MeshError("%d bytes of certificates do not fit one control frame; export one "
                            "instance at a time, or verify on this host with `meshnode cert verify --node DIR`"
                            % size)
        return {"certificates": [_without_seq(row) for row in rows],
                "epoch_changes": [_without_seq(row) for row in changes]}

    def _certificate_rows(self, where: str, params: list) -> list[dict]:
        cursor = self.node.store.db.execute(
            "SELECT seq, instance, value_kind, epoch, certificate FROM certificates WHERE %s ORDER BY seq" % where,
            params)
        return [{"seq": seq, "instance": instance, "value_kind": kind, "epoch": epoch, "certificate": certificate}
                for seq, instance, kind, epoch, certificate in cursor]

    def _job_certificate_rows(self, job: dict) -> list[dict]:
        """A job's certificates: those of its placement instances (every attempt: retries and
        refusals, P2, R1), its slot's if that lists it (P7), the evictions whose
        migrations name it (F5), its owner's moves (R2) and its replica actions (R4)."""
        manifest, jid = job["manifest"], job["job_id"]
        instances = [placement_instance_id(jid, attempt).hex() for attempt in range(placement_attempts(manifest))]
        placeholders = ",".join("?" * len(instances))
        rows = self._certificate_rows("instance IN (%s) AND value_kind = 'placement'" % placeholders, instances)
        slot_ms = self.node.genesis.params.placement_slot_ms
        if slot_ms > 0:
            slot_id = placement_slot_id(manifest.epoch, placement_slot(manifest, slot_ms)).hex()
            rows += [row for row in self._certificate_rows("instance = ? AND value_kind = 'placement_slot'", [slot_id])
                     if any(self._placed_job_id(p.job) == jid for p in self._decided(row).placements)]
        rows += [row for row in self._certificate_rows("value_kind = 'eviction'", [])
                 if any(m.job_id == jid for m in self._decided(row).migrations)]
        rows += [row for row in self._certificate_rows("value_kind = 'job_move'", [])
                 if self._moved_job_id(self._decided(row)) == jid]
        rows += [row for row in self._certificate_rows("value_kind = 'replica_action'", [])
                 if self._decided(row).job_id == jid]   # its clones, reroutes and decays (R4)
        # Preemptions (P8) that placed it (one per attempt) or stopped it.
        preempting = {preemption_instance_id(bytes.fromhex(instance)).hex() for instance in instances}
        rows += [row for row in self._certificate_rows("value_kind = 'preemption'", [])
                 if row["instance"] in preempting or any(v.job_id == jid for v in self._decided(row).victims)]
        return sorted(rows, key=lambda row: row["seq"])   # decision order

    def _decided(self, row: dict):
        """The value a stored (so already verified) certificate decided."""
        _envelope, cert = decode_message(row["certificate"], self.node.genesis.mesh_id, expect=CommitCertificate)
        return decode_value(cert.value_kind, cert.value)

    def _moved_job_id(self, move) -> bytes:
        return decode_request(move.request, self.node.genesis.mesh_id)[1].job_id   # an owner's or a reflex's (R3)

    def _placed_job_id(self, job_envelope: bytes) -> bytes:
        return job_id_of(decode_message(job_envelope, self.node.genesis.mesh_id, allow_any_mesh=True)[1])

    def _one_job(self, prefix) -> dict:
        """The one job this node knows whose id starts with the hex ``prefix``. (Errors carry
        no op name: the client puts it in front.)"""
        try:
            wanted = bytes.fromhex(prefix) if isinstance(prefix, str) else b""
        except ValueError:
            raise MeshError("job_id must be hex (an even number of digits)") from None
        matches = [j for j in self.node.core.jobs() if j["job_id"].startswith(wanted)] if wanted else []
        if len(matches) != 1:
            raise MeshError("job %s matches %d jobs this node knows" % (prefix, len(matches)))
        return matches[0]

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

    async def set_simulated_telemetry(self, args) -> dict:
        """Force (or with ``clear``, stop forcing) the readings of this node's simulated GPUs
        (`meshnode testnet telemetry`, README). Like every op, only the socket's owner can
        ask (SPEC.md 10.5); a node reading real GPUs through NVML refuses."""
        gpu = args.get("gpu")
        if gpu is not None and not _is_int(gpu):
            raise MeshError("set_simulated_telemetry: gpu must be an integer")
        if args.get("clear"):
            fault = None
        else:
            read_error = args.get("read_error", False)
            if not isinstance(read_error, bool):
                raise MeshError("set_simulated_telemetry: read_error must be true or false")
            fault = SimulatedFault(util_milli=args.get("util_milli"), temp_milli_c=args.get("temp_milli_c"),
                                   throttle_reasons=args.get("throttle_reasons"), ecc_errors=args.get("ecc_errors"),
                                   read_error=read_error)
            if fault == SimulatedFault():
                raise MeshError("set_simulated_telemetry: name a reading to force, or clear")
        indices = self.node.telemetry.set_simulated_fault(fault, gpu)
        return {"gpus": indices, "faults": self.node.telemetry.describe_source()["faults"]}

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

