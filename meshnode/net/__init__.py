"""Peer transports: transport.py is the contract the driver relies on (framing, per-peer
ordering, RTT); libp2p_transport.py implements it over py-libp2p (the only code that
imports libp2p), memory_transport.py in memory for tests and simulation."""
