"""A node's local control socket ``DIR/control.sock`` (SPEC.md "Control API"): wire.py is
the framing both ends share, server.py the node's trio server, client.py the one client
(a sans-IO core with a blocking face for the CLI and an async face for trio and asyncio)."""
