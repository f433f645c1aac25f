"""The node: everything that does IO around the pure protocol core (protocol/).

Rooms, each a subpackage; arrows are the only import directions allowed between them
(tests/test_layering.py checks them):

    cli/       the ``meshnode`` command: one module per area of subcommands; testnet/
               adds its own through the ``meshnode.commands`` entry-point group
    tui/       the workload owner's Textual TUI, a client of one node's control socket
    node/      the runtime: the trio driver of MeshCore, its config, SQLite stores,
               workload runner, telemetry and control-API operations
    control/   the local control socket: framing, the trio server, the one client
    net/       peer transports: the Transport contract, libp2p, in-memory
    workload/  what runs: job manifests, the SDK a workload process imports, built-ins

    cli -> tui, node, control, workload;  tui -> control, workload;
    node -> control, net, workload
"""
