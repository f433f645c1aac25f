"""A job's output (SPEC.md 9.8): the ring it is kept in, safe paths, who may read it,
and reading it over the mesh from a node that does not run the job.

The mesh tests run four real ``Node`` drivers on the in-memory network under trio's
autojumping MockClock, with no workload processes: the primary's output ring is written
directly, as the runner would.
"""

import os
import time

import pytest
import trio

from keys.keystore import load_identity
from meshnode.node.api import ControlApi
from meshnode.node.driver import Node
from meshnode.node.output_files import OutputWriter, list_files, path_parts, read_file
from meshnode.node.output_log import OLD_LOG_NAME, START_NAME, OutputLog, job_workdir
from protocol.errors import MeshError, RemoteProtocolError
from protocol.messages import Constraints, JobManifest, OutputRead, Resources, encode_message
from protocol.output_access import OUTPUT_READ_VALID_MS, output_read_refusal
from testnet import launcher
from tests.test_failover_node import memory_mesh

NODES = 4


# --- the ring ---------------------------------------------------------------------------------

def test_the_ring_keeps_two_segments_and_offsets_run_on_across_rotations(tmp_path):
    log = OutputLog(str(tmp_path), segment_bytes=10)
    written = b"".join(b"line %02d\n" % i for i in range(20))   # 160 bytes: many rotations
    for i in range(0, len(written), 7):
        log.append(written[i:i + 7])
    start, end = log.bounds()
    assert end == len(written) and end - start <= 20          # at most two segments kept
    assert (tmp_path / OLD_LOG_NAME).exists() and (tmp_path / START_NAME).exists()
    _, offset, data, _ = log.read(start, 1000)
    assert offset == start and data == written[start:]
    # A reader behind the ring is moved to what is kept, and can see the gap.
    got_start, offset, data, _ = OutputLog(str(tmp_path)).read(0, 5)
    assert offset == got_start == start and data == written[start:start + 5]


def test_9_8_a_follow_resumes_from_its_offset_without_duplicates(tmp_path):
    """Chunks read at the returned offsets, while the log grows and rotates, add up to
    exactly what was written: nothing twice, nothing skipped."""
    log = OutputLog(str(tmp_path), segment_bytes=64)
    reader = OutputLog(str(tmp_path))
    written, seen, offset = b"", b"", 0
    for i in range(40):
        line = b"step %d\n" % i
        log.append(line)
        written += line
        _, got_offset, data, _ = reader.read(offset, 9)   # smaller than what was added
        assert got_offset == offset                        # never behind the ring here
        seen += data
        offset = got_offset + len(data)
    while True:
        _, got_offset, data, end = reader.read(offset, 9)
        if not data:
            break
        seen += data
        offset = got_offset + len(data)
    assert seen == written and offset == end == len(written)


def test_a_reader_past_the_end_reads_nothing(tmp_path):
    log = OutputLog(str(tmp_path))
    log.append(b"abc")
    assert log.read(99, 10) == (0, 3, b"", 3)


# --- paths ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "", "a//b", "./a", "a/\0"])
def test_9_8_paths_that_could_leave_the_directory_are_refused(path):
    with pytest.raises(RemoteProtocolError):
        path_parts(path)


def test_9_8_symlinks_are_neither_listed_nor_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("no")
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "result.txt").write_text("42\n")
    (work / "sub" / "deep.bin").write_bytes(b"\x00\x01")
    (work / "output.log").write_text("the log is read with job logs\n")
    os.symlink(outside / "secret", work / "link-to-file")
    os.symlink(outside, work / "link-to-dir")
    assert [f.path for f in list_files(str(work))] == ["result.txt", "sub/deep.bin"]
    assert read_file(str(work), "sub/deep.bin", 1, 10) == (2, b"\x01")
    for escape in ("link-to-file", "link-to-dir/secret", "../outside/secret", "output.log"):
        with pytest.raises(RemoteProtocolError):
            read_file(str(work), escape, 0, 10)


def test_9_8_the_owner_side_writes_only_inside_out(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    out = tmp_path / "out"
    writer = OutputWriter(str(out))
    os.symlink(target, out / "trap")
    for evil in ("../escaped", "/tmp/escaped", "trap/escaped"):
        with pytest.raises(MeshError):
            writer.open(evil)
    os.close(writer.open("ok/file"))
    with pytest.raises(MeshError, match="already exists"):
        writer.open("ok/file")
    assert not (tmp_path / "escaped").exists() and list(target.iterdir()) == []


# --- who may read (pure) ----------------------------------------------------------------------

OWNER, PRIMARY, CARRIER, STRANGER = (bytes([n]) * 32 for n in (1, 2, 3, 4))
JOB_VIEW = {"owner": OWNER, "primary": PRIMARY, "state": "running"}
NOW = 1_700_000_000_000


def refusal(signer, via=CARRIER, carrier=CARRIER, job=JOB_VIEW, requested_ms=NOW, members=(PRIMARY, CARRIER)):
    read = OutputRead(job_id=bytes(32), target="log", path="", offset=0, max_bytes=10, via=via,
                      requested_ms=requested_ms)
    return output_read_refusal(signer, read, job=job, me=PRIMARY, carrier=carrier, members=members,
                               now_wall_ms=NOW)


def test_9_8_only_the_owner_or_the_primarys_operator_may_read():
    assert refusal(OWNER) is None
    assert refusal(PRIMARY) is None                    # the primary's own key: its operator
    assert "only the job's owner" in refusal(STRANGER)
    assert "only the job's owner" in refusal(CARRIER)  # a member carrying it is not enough


def test_9_8_a_read_is_bound_to_its_carrier_a_member_and_the_current_primary():
    assert "another node as its carrier" in refusal(OWNER, via=STRANGER)
    assert "not a member" in refusal(OWNER, via=STRANGER, carrier=STRANGER)
    assert "does not run" in refusal(OWNER, job={**JOB_VIEW, "primary": CARRIER})
    assert "unknown job" in refusal(OWNER, job=None)
    assert "stale" in refusal(OWNER, requested_ms=NOW - OUTPUT_READ_VALID_MS - 1)


# --- over the mesh: four drivers, memory network, MockClock -------------------------------------

@pytest.fixture
def mesh_dir(tmp_path):
    launcher.create_testnet(tmp_path / "net", NODES, owners=2, run_workloads=False)
    return tmp_path / "net", launcher.load_layout(tmp_path / "net")


def owner_job(owner, mesh_id: bytes, name="logs") -> bytes:
    job = JobManifest(owner=owner.public_key, name=name, nonce=1, entrypoint="counter", args=(),
                      resources=Resources(gpus=0, gpu_mem_mib=0, cpu_milli=100, mem_mib=64),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=0, backups=1, max_retries=0, created_ms=0, epoch=0)
    return encode_message(owner, mesh_id, job)


def signed_read(identity, mesh_id, jid, via, offset=0, max_bytes=64, target="log", path=""):
    return encode_message(identity, mesh_id, OutputRead(job_id=jid, target=target, path=path, offset=offset,
                                                        max_bytes=max_bytes, via=via,
                                                        requested_ms=time.time_ns() // 1_000_000))


async def run_mesh(root, test):
    async with memory_mesh(root) as nodes:
        await trio.sleep(1.0)
        await test(nodes)


async def place(nodes, envelope: bytes) -> tuple[bytes, Node, Node]:
    """(job id, its primary, a node that neither runs it nor backs it up)."""
    jid = await nodes[0].submit(envelope)
    await trio.sleep(1.0)
    view = nodes[0].core.job_view(jid)
    assert view["state"] == "placed"
    primary = next(n for n in nodes if n.identity.public_key == view["primary"])
    bystander = next(n for n in nodes if n.identity.public_key not in (view["primary"], *view["backups"]))
    return jid, primary, bystander


async def test_9_8_the_owner_reads_the_log_from_a_node_that_does_not_run_the_job(mesh_dir, mock_clock):
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir
    owner = load_identity(layout["owners"][0]["key_file"], None)
    other_owner = load_identity(layout["owners"][1]["key_file"], None)
    mesh_id = bytes.fromhex(layout["mesh_id"])

    async def test(nodes):
        jid, primary, bystander = await place(nodes, owner_job(owner, mesh_id))
        written = b"".join(b"out %d\n" % i for i in range(30))
        os.makedirs(job_workdir(primary.paths.root, jid))   # as the runner does before it starts the job
        OutputLog(job_workdir(primary.paths.root, jid)).append(written)
        api, via = ControlApi(bystander), bystander.identity.public_key

        # Without the owner's signature the bystander cannot ask for it.
        with pytest.raises(MeshError, match="needs the owner's key"):
            await api.job_output({"job_id": jid.hex()})
        # Someone else's key, even one the mesh takes jobs from: refused by the primary.
        with pytest.raises(MeshError, match="refused: only the job's owner"):
            await api.job_output({"job_id": jid.hex(), "request": signed_read(other_owner, mesh_id, jid, via)})
        # A read signed for another carrier is not forwarded.
        with pytest.raises(MeshError, match="another node to carry it"):
            await api.job_output({"job_id": jid.hex(),
                                  "request": signed_read(owner, mesh_id, jid, primary.identity.public_key)})
        assert primary.core.counters["output_read_refused"] == 1

        # The owner follows it in chunks, resuming at each returned offset.
        seen, offset = b"", 0
        while True:
            got = await api.job_output({"job_id": jid.hex()[:10],
                                        "request": signed_read(owner, mesh_id, jid, via, offset=offset, max_bytes=50)})
            assert got["primary"] == primary.identity.public_key.hex() and got["offset"] == offset
            if not got["data"]:
                break
            seen += got["data"]
            offset += len(got["data"])
        assert seen == written and got["end"] == len(written) and got["state"] == "placed"

        # On the primary its operator reads through the control socket without a key.
        local = await ControlApi(primary).job_output({"job_id": jid.hex(), "offset": 4, "max_bytes": 5})
        assert local["data"] == written[4:9]

    await run_mesh(root, test)


async def test_9_8_files_are_listed_and_read_by_path_only_inside_the_workdir(mesh_dir, mock_clock):
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir
    owner = load_identity(layout["owners"][0]["key_file"], None)
    mesh_id = bytes.fromhex(layout["mesh_id"])

    async def test(nodes):
        jid, primary, bystander = await place(nodes, owner_job(owner, mesh_id, name="files"))
        workdir = job_workdir(primary.paths.root, jid)
        os.makedirs(os.path.join(workdir, "ckpt"))
        with open(os.path.join(workdir, "ckpt", "model.bin"), "wb") as fh:
            fh.write(b"weights")
        os.symlink(primary.paths.keystore, os.path.join(workdir, "stolen-key"))
        api, via = ControlApi(bystander), bystander.identity.public_key
        listing = await api.job_output({"job_id": jid.hex(),
                                        "request": signed_read(owner, mesh_id, jid, via, target="files")})
        assert [f["path"] for f in listing["files"]] == ["ckpt/model.bin"]
        got = await api.job_output({"job_id": jid.hex(), "request": signed_read(
            owner, mesh_id, jid, via, target="file", path="ckpt/model.bin", offset=2)})
        assert (got["data"], got["end"]) == (b"ights", 7)
        for escape in ("stolen-key", "../../keystore.json"):
            with pytest.raises(MeshError, match="refused"):
                await api.job_output({"job_id": jid.hex(), "request": signed_read(
                    owner, mesh_id, jid, via, target="file", path=escape)})

    await run_mesh(root, test)


async def test_job_status_names_one_job_by_prefix_and_refuses_unknown_ids(mesh_dir, mock_clock):
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir
    owner = load_identity(layout["owners"][0]["key_file"], None)
    mesh_id = bytes.fromhex(layout["mesh_id"])

    async def test(nodes):
        jid, primary, _ = await place(nodes, owner_job(owner, mesh_id, name="status"))
        status = await ControlApi(nodes[1]).job_status({"job_id": jid.hex()[:12].upper()})
        assert (status["job_id"], status["primary"], status["state"]) == (jid.hex(), primary.identity.public_key.hex(),
                                                                         "placed")
        assert status["exit_code"] is None and status["attempt"] == 0
        for bad, message in (("ffff" * 16, "no job"), ("xyz", "not a hex job id"), (7, "must be the job's id")):
            with pytest.raises(MeshError, match=message):
                await ControlApi(nodes[1]).job_status({"job_id": bad})

    await run_mesh(root, test)
