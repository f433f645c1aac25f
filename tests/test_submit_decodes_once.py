"""A submitted job's envelope is decoded and its owner's signature checked once at the entry
node (issue 18 item 3): the driver decoded it (to name the job id and refuse a bad one
before the core) without the core's caches, so the core checked the signature again."""

import protocol.envelope
from test_driver_batching import RecordingTransport
from test_failover_node import owner_job
from meshnode.node.driver import Node
from testnet import launcher


async def test_a_submit_checks_the_owners_signature_once(tmp_path, monkeypatch):
    launcher.create_testnet(tmp_path / "net", 4, run_workloads=False)
    layout = launcher.load_layout(tmp_path / "net")
    node = Node(tmp_path / "net" / "node-0", run_workloads=False)
    node.transport, node.core = RecordingTransport(), node._make_core()
    checked = []
    verify = protocol.envelope.verify_signature
    monkeypatch.setattr(protocol.envelope, "verify_signature",
                        lambda key, message, signature: checked.append(key) or verify(key, message, signature))
    job = owner_job(layout)
    try:
        job_id = await node.submit(job)
        owner = bytes.fromhex(layout["owners"][0]["public_key"])
        assert checked.count(owner) == 1   # twice before
        assert node.core.job_table.get(job_id) is not None   # and the core took it
    finally:
        node.close()
