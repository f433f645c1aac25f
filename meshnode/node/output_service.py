"""Serving a job's output (SPEC.md 9.8): the log ring and the files a workload leaves in
its working directory, read where the job runs.

Three faces, one per caller:

* ``local``: this node's own copy, for the control socket (its operator) and for a read
  this node answers as the job's primary;
* ``answer``: the transport's request handler; a signed OutputRead from a peer, checked
  by protocol/output_access.py, answered with a signed OutputData;
* ``read``: the control op's entry point; serves locally where this node runs the job and
  otherwise carries the owner-signed read to the job's primary and returns its answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

from keys.identity import short_id
from meshnode.node.clock import wall_ms
from meshnode.node.output_files import list_files, read_file
from meshnode.node.output_log import OutputLog, job_workdir
from protocol.errors import MeshError, RemoteProtocolError
from protocol.messages import MAX_OUTPUT_CHUNK_BYTES, OUTPUT_TARGETS, OutputData, OutputRead, decode_message, encode_message
from protocol.output_access import output_read_refusal

if TYPE_CHECKING:
    from meshnode.node.driver import Node


def output_view(data: OutputData, primary: bytes) -> dict:
    return {"job_id": data.job_id.hex(), "primary": primary.hex(), "state": data.state, "running": data.running,
            "start": data.start, "offset": data.offset, "end": data.end, "data": data.data,
            "files": [{"path": f.path, "size": f.size, "mtime_ms": f.mtime_ms} for f in data.files]}


class OutputService:
    def __init__(self, node: "Node"):
        self.node = node

    def _running_here(self, jid: bytes) -> bool:
        runner = self.node.runner
        return runner is not None and jid in runner.running()

    def local(self, job: dict, target: str, path: str, offset: int, max_bytes: int) -> OutputData:
        """What this node holds of ``job``'s output. RemoteProtocolError for a bad path."""
        jid = job["job_id"]
        workdir = job_workdir(self.node.paths.root, jid)
        start = end = 0
        data, files = b"", ()
        if target == "log":
            start, offset, data, end = OutputLog(workdir).read(offset, max_bytes)
        elif target == "files":
            files = tuple(list_files(workdir))
            offset = 0
        else:
            end, data = read_file(workdir, path, offset, max_bytes)
        return OutputData(job_id=jid, read=bytes(32), error="", state=job["state"], running=self._running_here(jid),
                          start=start, offset=offset, end=end, data=data, files=files)

    async def answer(self, carrier: bytes, request: bytes) -> bytes | None:
        """The transport's request handler: answer a peer's signed OutputRead, or None
        (no answer) for bytes that are not one."""
        node = self.node
        try:
            envelope, read = decode_message(request, node.genesis.mesh_id, expect=OutputRead)
        except RemoteProtocolError:
            node.core.counters["output_read_undecodable"] += 1
            return None
        job = node.core.job_view(read.job_id)
        refusal = output_read_refusal(envelope.signer, read, job=job, me=node.identity.public_key, carrier=carrier,
                                      members=node.core.view.stakes, now_wall_ms=wall_ms())
        data = None
        if refusal is None:
            try:
                data = self.local(job, read.target, read.path, read.offset, read.max_bytes)
            except RemoteProtocolError as exc:
                refusal = str(exc)
            except OSError as exc:   # e.g. a ring file the operator made unreadable
                refusal = "cannot read the job's output here: %s" % (exc.strerror or exc)
        if refusal is not None:
            node.core.counters["output_read_refused"] += 1
            # A refusal says why and nothing about the job (its reader may not see it).
            data = OutputData(job_id=read.job_id, read=bytes(32), error=refusal[:256], state="", running=False,
                              start=0, offset=0, end=0, data=b"", files=())
        answer = dataclasses.replace(data, read=hashlib.sha256(request).digest())
        return encode_message(node.identity, node.genesis.mesh_id, answer)

    async def read(self, job: dict, target: str, path: str, offset: int, max_bytes: int,
                   request: bytes | None) -> dict:
        """The control op: ``job``'s output, from here or from its primary."""
        node, me = self.node, self.node.identity.public_key
        jid, primary = job["job_id"], job["primary"]
        if primary is None:
            raise MeshError("job %s was never placed (%s): it has no output" % (jid.hex()[:12], job["state"]))
        if request is not None:
            try:
                _, read = decode_message(request, node.genesis.mesh_id, expect=OutputRead)
            except RemoteProtocolError as exc:
                raise MeshError("the signed read does not verify: %s" % exc) from None
            if read.job_id != jid or read.via != me:
                raise MeshError("the signed read names another job or another node to carry it")
            target, path, offset, max_bytes = read.target, read.path, read.offset, read.max_bytes
        if target not in OUTPUT_TARGETS or not 1 <= max_bytes <= MAX_OUTPUT_CHUNK_BYTES or offset < 0:
            raise MeshError("target must be one of %s, max_bytes 1..%d, offset >= 0"
                            % (", ".join(OUTPUT_TARGETS), MAX_OUTPUT_CHUNK_BYTES))
        if primary == me:
            try:
                return output_view(self.local(job, target, path, offset, max_bytes), me)
            except RemoteProtocolError as exc:
                raise MeshError(str(exc)) from None
            except OSError as exc:
                raise MeshError("cannot read the job's output: %s" % (exc.strerror or exc)) from None
        if request is None:
            raise MeshError("job %s runs on node %s, not here: reading its output from this node needs the "
                            "owner's key (--key OWNER_KEYSTORE), or ask node %s itself"
                            % (jid.hex()[:12], short_id(primary), short_id(primary)))
        answer = await node.transport.request(primary, request)
        try:
            envelope, data = decode_message(answer, node.genesis.mesh_id, expect=OutputData)
        except RemoteProtocolError as exc:
            raise MeshError("node %s sent a bad answer: %s" % (short_id(primary), exc)) from None
        if envelope.signer != primary or data.read != hashlib.sha256(request).digest() or data.job_id != jid:
            raise MeshError("node %s answered another read" % short_id(primary))
        if data.error:
            raise MeshError("node %s refused: %s" % (short_id(primary), data.error))
        return output_view(data, primary)
