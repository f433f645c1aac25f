"""libp2p-only transport properties (SPEC.md "Transport / Security", "Shutdown").

Real hosts on 127.0.0.1, each test bounded by trio.fail_after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import trio

from keys.identity import SigningIdentity, peer_id_bytes
from meshnode.transport_libp2p import open_libp2p_transport

SEED_NODE = bytes([5]) * 32
SEED_PLAINTEXT = bytes([6]) * 32
KEY_NODE = SigningIdentity(SEED_NODE).public_key
KEY_PLAINTEXT = SigningIdentity(SEED_PLAINTEXT).public_key
TEST_TIMEOUT_S = 8


def plaintext_only_host():
    """A host offering only /plaintext/2.0.0: what a downgrade attacker would offer."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.network.config import ConnectionConfig, RetryConfig
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

    key_pair = create_new_key_pair(SEED_PLAINTEXT)
    host = new_host(
        key_pair=key_pair,
        sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)},
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )
    host.get_network().retry_config = RetryConfig(max_retries=0)
    return host


async def test_host_identity_is_the_signing_key():
    with trio.fail_after(TEST_TIMEOUT_S):
        async with open_libp2p_transport(SEED_NODE, ["/ip4/127.0.0.1/tcp/0"]) as transport:
            assert transport.local_key == KEY_NODE
            assert transport.listen_addrs[0].endswith("/p2p/" + SigningIdentity(SEED_NODE).peer_id)


async def test_plaintext_peer_is_refused_both_ways():
    import multiaddr
    from libp2p.exceptions import BaseLibp2pError
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from meshnode.transport import PROTOCOL_ID

    intruder = plaintext_only_host()
    with trio.fail_after(TEST_TIMEOUT_S):
        async with open_libp2p_transport(SEED_NODE, ["/ip4/127.0.0.1/tcp/0"]) as node:
            async with intruder.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                node_addr = multiaddr.Multiaddr(node.listen_addrs[0].split("/p2p/")[0])
                with pytest.raises(BaseLibp2pError):
                    await intruder.connect(PeerInfo(ID(peer_id_bytes(KEY_NODE)), [node_addr]))
                with pytest.raises(BaseLibp2pError):
                    await intruder.new_stream(ID(peer_id_bytes(KEY_NODE)), [PROTOCOL_ID])

                intruder_addr = str(intruder.get_addrs()[0]).split("/p2p/")[0]
                await node.connect(KEY_PLAINTEXT, intruder_addr)
                assert node.counters["dial_failed"] == 1

                assert node.peers() == set()
                assert node.counters["frames_received"] == 0
                with pytest.raises(trio.WouldBlock):
                    node.incoming.receive_nowait()
                await intruder.close()


def test_sigint_leaves_without_a_traceback(tmp_path):
    """Ctrl-C while two connected transports run under cancel_on_signals: the
    transports shut down in order, the process exits 0, nothing on stderr."""
    script = textwrap.dedent(
        """
        import trio
        from meshnode.transport import cancel_on_signals
        from meshnode.transport_libp2p import open_libp2p_transport

        async def run_two_nodes():
            addr = "/ip4/127.0.0.1/tcp/0"
            async with open_libp2p_transport(bytes([1]) * 32, [addr]) as a:
                async with open_libp2p_transport(bytes([2]) * 32, [addr]) as b:
                    await a.connect(b.local_key, b.listen_addrs[0])
                    while not b.peers():
                        await trio.sleep(0.01)
                    await a.send(b.local_key, b"hello")
                    await b.incoming.receive()
                    print("ready", flush=True)
                    await trio.sleep_forever()

        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_signals, nursery.cancel_scope)
                nursery.start_soon(run_two_nodes)

        trio.run(main)
        print("clean", flush=True)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        text=True,
    )
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert (process.returncode, stdout, stderr) == (0, "clean\n", "")
