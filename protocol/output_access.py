"""Who may read a job's output from the node that runs it (SPEC.md 9.8). Pure: no IO.

A job's output (its log and the files it leaves) stays on the node that ran it. Its
primary answers a read that reaches it over the mesh only if all of these hold:

1. the read is signed by the job's owner, or by the primary's own key (its operator,
   reading from another machine); nobody else, whatever their stake;
2. it names as ``via`` the peer that delivered it (authenticated by the transport), and
   that peer is a member of the primary's current epoch (or the primary itself): a
   signed read is useless to anyone but the node its signer chose to carry it;
3. the primary is the job's primary in its own job table (output is served where the
   job runs or last ran; after a migration, by the node it moved to);
4. its ``requested_ms`` is within OUTPUT_READ_VALID_MS of the primary's wall clock.

Reading through the node's own control socket needs none of this: that socket is the
operator's (SPEC.md 10.5), and the node serves only what it holds itself.
"""

from __future__ import annotations

from protocol.messages import OutputRead

OUTPUT_READ_VALID_MS = 10 * 60 * 1000


def output_read_refusal(signer: bytes, read: OutputRead, *, job: dict | None, me: bytes, carrier: bytes,
                        members, now_wall_ms: int) -> str | None:
    """Why node ``me`` must not answer ``read`` (signed by ``signer``, delivered by
    ``carrier``), or None when it may. ``job``: its view of the job (``MeshCore.job_view``)."""
    if carrier != read.via:
        return "the read names another node as its carrier"
    if carrier != me and carrier not in members:
        return "the carrier is not a member of this mesh"
    if job is None:
        return "unknown job %s" % read.job_id.hex()[:12]
    if job["primary"] != me:
        return "this node does not run job %s" % read.job_id.hex()[:12]
    if signer not in (job["owner"], me):
        return "only the job's owner or this node's operator may read its output"
    if abs(now_wall_ms - read.requested_ms) > OUTPUT_READ_VALID_MS:
        return "the read is stale or from the future (clocks more than %d s apart)" % (OUTPUT_READ_VALID_MS // 1000)
    return None
