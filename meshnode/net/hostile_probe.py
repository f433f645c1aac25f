"""Hostile libp2p peers against a node's transport (SPEC.md 8 "Limits against hostile
peers"): connect/close churn and stalled half-sent frames. Used by
tests/test_transport_hostile.py and by `meshnode bench hostile` (testnet/bench_hostile.py);
it lives here because only meshnode.net imports libp2p (tests/test_layering.py).

Each peer is a plain py-libp2p host offering Noise + yamux, like a node's, with keys
from a seeded generator: what a peer that ignores our protocol can do.
"""

from __future__ import annotations

import random
from contextlib import AsyncExitStack, asynccontextmanager

import multiaddr
import trio

from meshnode.net.transport import MAX_FRAME_BYTES_DEFAULT, PROTOCOL_ID, encode_uvarint

CONNECT_TIMEOUT_S = 5


def _refusal_errors() -> tuple[type[BaseException], ...]:
    from libp2p.exceptions import BaseLibp2pError

    return (BaseLibp2pError, OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError)


@asynccontextmanager
async def hostile_host(seed: bytes):
    """A started libp2p host with the node's security and muxer, nothing of ours."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
    from libp2p.network.config import ConnectionConfig, RetryConfig
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    import meshnode.net.libp2p_transport  # noqa: F401  (quiets libp2p's loggers)

    key_pair = create_new_key_pair(seed)
    host = new_host(key_pair=key_pair,
                    sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)},
                    connection_config=ConnectionConfig(max_connections_per_peer=1))
    host.get_network().retry_config = RetryConfig(max_retries=0)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        await host.get_network().auto_connector.stop()
        try:
            yield host
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(3):
                await host.close()


def _target(node_addr: str, node_key: bytes):
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from keys.identity import peer_id_bytes

    peer_id = ID(peer_id_bytes(node_key))
    return peer_id, PeerInfo(peer_id, [multiaddr.Multiaddr(node_addr.split("/p2p/")[0])])


async def connect_close_cycles(node_addr: str, node_key: bytes, cycles: int, *, clients: int = 4,
                               rng: random.Random) -> dict:
    """``cycles`` complete inbound connections (Noise and yamux done), each closed before
    its client opens the next; ``clients`` hosts (keys from ``rng``) run side by side."""
    refusals = _refusal_errors()
    peer_id, info = _target(node_addr, node_key)
    results = {"connected": 0, "refused": 0}
    per_client = [cycles // clients + (1 if index < cycles % clients else 0) for index in range(clients)]

    async def one_client(seed: bytes, count: int) -> None:
        async with hostile_host(seed) as host, trio.open_nursery() as closers:
            network = host.get_network()
            for _ in range(count):
                network.unblock_peer(peer_id)
                try:
                    with trio.fail_after(CONNECT_TIMEOUT_S):
                        await host.connect(info)
                    results["connected"] += 1
                except refusals:
                    results["refused"] += 1
                for conn in list(network.get_connections(peer_id)):
                    closers.start_soon(conn.close)
                with trio.fail_after(CONNECT_TIMEOUT_S):
                    while network.get_connections(peer_id):
                        await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        for count in per_client:
            nursery.start_soon(one_client, rng.randbytes(32), count)
    return results


@asynccontextmanager
async def stalled_frame_peers(node_addr: str, node_key: bytes, peers: int, *, rng: random.Random,
                              max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT):
    """``peers`` peers, each with our protocol's stream open, that have sent a
    maximum-length prefix and all but one byte of the body, and then stall. Yields the
    number that got that far; the peers go when the context ends."""
    refusals = _refusal_errors()
    peer_id, info = _target(node_addr, node_key)
    length = max_frame_bytes + 1
    half_frame = encode_uvarint(length) + b"\x00" + bytes(length - 2)
    sent = 0
    async with AsyncExitStack() as stack:
        for _ in range(peers):
            host = await stack.enter_async_context(hostile_host(rng.randbytes(32)))
            try:
                with trio.fail_after(CONNECT_TIMEOUT_S):
                    await host.connect(info)
                    stream = await host.new_stream(peer_id, [PROTOCOL_ID])
                    await stream.write(half_frame)
                sent += 1
            except refusals:
                continue
        yield sent


async def overfill_yamux_window(node_addr: str, node_key: bytes, *, rng: random.Random, extra_bytes: int = 1) -> bool:
    """Open a yamux stream to the node and send, in one DATA frame, ``extra_bytes`` more
    than the 256 KiB window a new stream is granted (a yamux protocol violation that
    py-libp2p would buffer). True if the frame was written."""
    import struct

    from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, TYPE_DATA, YAMUX_HEADER_FORMAT

    refusals = _refusal_errors()
    peer_id, info = _target(node_addr, node_key)
    async with hostile_host(rng.randbytes(32)) as host:
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                await host.connect(info)
                muxed = host.get_network().get_connections(peer_id)[0].muxed_conn
                stream = await muxed.open_stream()
                body = bytes(DEFAULT_WINDOW_SIZE + extra_bytes)
                await muxed._write_frame(struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, stream.stream_id, len(body)) + body)
        except refusals:
            return False
        with trio.move_on_after(CONNECT_TIMEOUT_S):  # until the node closes the connection
            while host.get_network().get_connections(peer_id):
                await trio.sleep(0.01)
        return True


@asynccontextmanager
async def stream_holders(node_addr: str, node_key: bytes, peers: int, *, rng: random.Random,
                         frame_interval_s: float = 1.0):
    """``peers`` peers that each keep our protocol's stream open and send a small junk
    DATA frame every ``frame_interval_s``: slow peers that never go away. Yields a dict
    whose "holding" is the number whose stream is still open (it changes as the node
    closes them); the peers go when the context ends."""
    from meshnode.net.transport import FRAME_KIND_DATA, encode_frame

    refusals = _refusal_errors()
    peer_id, info = _target(node_addr, node_key)
    state = {"holding": 0, "connected": 0}

    async def trickle(stream) -> None:
        state["holding"] += 1
        try:
            while True:
                await stream.write(encode_frame(FRAME_KIND_DATA, rng.randbytes(32)))
                await trio.sleep(frame_interval_s)
        except refusals:
            pass
        finally:
            state["holding"] -= 1

    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        for _ in range(peers):
            host = await stack.enter_async_context(hostile_host(rng.randbytes(32)))
            try:
                with trio.fail_after(CONNECT_TIMEOUT_S):
                    await host.connect(info)
                    stream = await host.new_stream(peer_id, [PROTOCOL_ID])
                state["connected"] += 1
                nursery.start_soon(trickle, stream)
            except refusals:
                continue
        yield state
