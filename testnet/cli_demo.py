"""`meshnode demo`: start a local testnet, submit the example jobs, and show the mesh.

With a terminal it opens the TUI on node 0 (quit with q); without one (CI, pipes) it
prints the mesh and job tables once. ``--capture DIR`` instead drives the TUI headless
and writes each view as text and SVG (the README's screens come from it). The testnet
is stopped at the end unless --keep.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from keys.genesis import load_genesis
from keys.keystore import load_identity
from meshnode.control.client import ControlClient
from meshnode.node.config import node_paths
from meshnode.workload.manifest import load_manifest
from protocol.errors import MeshError
from protocol.messages import encode_message
from meshnode.cli.output import examples
from meshnode.tui.tables import short_job_id
from meshnode.cli.pools_file import load_pools
from testnet import launcher

JOBS_DIR = Path(__file__).resolve().parent.parent / "jobs"
SETTLE_TIMEOUT_S = 20
CAPTURE_SIZE = (100, 30)  # columns, rows
CAPTURE_SETTLE_S = 0.5    # long enough for a view switch and a poll to be drawn


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="a local mesh with example workloads, shown live", epilog=examples(
        "meshnode demo", "meshnode demo --capture shots     # write every TUI screen to shots/ instead"))
    demo.add_argument("--dir", default="demo-mesh", metavar="DIR",
                      help="the demo testnet's directory (default demo-mesh)")
    demo.add_argument("--nodes", type=int, default=4, metavar="N", help="testnet nodes (default 4)")
    demo.add_argument("--keep", action="store_true", help="leave the testnet running afterwards")
    demo.add_argument("--capture", metavar="OUT_DIR",
                      help="write the TUI's screens (text and SVG, %dx%d) to OUT_DIR instead of opening it"
                      % CAPTURE_SIZE)
    demo.set_defaults(func=cmd_demo)


def submit_examples(root) -> list[str]:
    layout = launcher.load_layout(root)
    owner = load_identity(layout["owners"][0]["key_file"], None)
    node_dir = layout["nodes"][0]["dir"]
    mesh_id = load_genesis(node_paths(node_dir).genesis).mesh_id
    job_ids = []
    with ControlClient(node_dir) as client:
        epoch = client.call("status")["epoch"]
        for manifest_path in sorted(JOBS_DIR.glob("*.toml")):
            job = load_manifest(manifest_path, owner.public_key, time.time_ns() // 1_000_000, epoch=epoch)
            job_ids.append(client.call("submit", job=encode_message(owner, mesh_id, job))["job_id"])
            print("submitted %-22s %s" % (manifest_path.name, short_job_id(job_ids[-1])))
    return job_ids


def wait_settled(node_dir, job_ids, timeout_s=SETTLE_TIMEOUT_S) -> None:
    """Until every job is running, or pending with declines that explain why."""
    deadline = time.monotonic() + timeout_s
    with ControlClient(node_dir) as client:
        while time.monotonic() < deadline:
            jobs = {j["job_id"]: j for j in client.call("jobs")["jobs"]}
            if all(j in jobs and (jobs[j]["state"] == "running" or jobs[j]["declines"]) for j in job_ids):
                return
            time.sleep(0.1)


async def capture_tui(node_dir, key_path, job_ids, out_dir: Path) -> list[Path]:
    """Drive the TUI headless on ``node_dir`` and save each view, a why and the help screen."""
    from textual.widgets import Input  # Textual only loads when a TUI is wanted

    from meshnode.tui.app import OwnerTui
    from meshnode.tui.screens import WhyScreen
    out_dir.mkdir(parents=True, exist_ok=True)
    app = OwnerTui(node_dir, key_path, poll_s=0.2)
    written: list[Path] = []

    async def save(name: str) -> None:
        await pilot.pause(CAPTURE_SETTLE_S)
        for suffix, text in ((".txt", app.screen_text()), (".svg", app.export_screenshot(title="meshnode tui"))):
            path = out_dir / ("tui-%s%s" % (name, suffix))
            path.write_text(text)
            written.append(path)

    async def until(predicate, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + SETTLE_TIMEOUT_S
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise MeshError("capture: no %s within %d s" % (what, SETTLE_TIMEOUT_S))
            await pilot.pause(0.05)

    async with app.run_test(size=CAPTURE_SIZE) as pilot:
        await until(lambda: app.connected and all(j in app.jobs for j in job_ids) and app.nodes
                    and all(n.get("capability") for n in app.nodes), "view of every node and demo job")
        for key, view in (("1", "mesh"), ("3", "consensus"), ("4", "events"), ("2", "jobs")):
            await pilot.press(key)
            await save(view)
        pending = [j for j in job_ids if app.jobs[j]["state"] == "pending"]
        if pending:  # the jobs view's note and the why dialog explain the pending job
            app.jobs_table.move_cursor(row=app.jobs_table.get_row_index(pending[0]))
            await save("jobs-pending")
            await pilot.press("w")
            await until(lambda: isinstance(app.screen, WhyScreen), "why dialog")
            await save("why")
            await pilot.press("escape")
        await pilot.press("question_mark")
        await save("help")
        await pilot.press("escape", "n", *"my-job")
        for field_id, value in (("gpus", "1"), ("gpu_mem_mib", "16384"), ("zones", "zone-a")):
            app.screen.query_one("#field-" + field_id, Input).value = value
        await save("compose")
        await pilot.press("escape")
    return written


def cmd_demo(args) -> int:
    root = Path(args.dir)
    if (root / launcher.LAYOUT_FILE).exists():
        launcher.down(root)
        import shutil
        shutil.rmtree(root)
    print("starting a %d-node testnet in %s ..." % (args.nodes, root))
    # The example pools (jobs/pools/lab.toml), so the example that names a pool is placed too.
    pools, reservations = load_pools(JOBS_DIR / "pools" / "lab.toml")
    launcher.up(root, args.nodes, pools=pools, reservations=reservations)
    try:
        layout = launcher.load_layout(root)
        job_ids = submit_examples(root)
        node_dir = layout["nodes"][0]["dir"]
        wait_settled(node_dir, job_ids)
        time.sleep(1.0)  # a few checkpoints, so the tables show their age
        if args.capture:
            for path in asyncio.run(capture_tui(node_dir, layout["owners"][0]["key_file"], job_ids,
                                                Path(args.capture))):
                print("wrote %s" % path)
        elif sys.stdin.isatty() and sys.stdout.isatty():
            from meshnode.tui.app import OwnerTui
            OwnerTui(node_dir, layout["owners"][0]["key_file"]).run()
        else:
            from meshnode.cli.tui import fetch_snapshot
            from meshnode.tui.tables import render_snapshot
            from rich.console import Console
            render_snapshot(fetch_snapshot(node_dir), Console(width=120))
    finally:
        if args.keep:
            print("testnet left running: meshnode testnet status --dir %s; stop it with "
                  "meshnode testnet down --dir %s" % (root, root))
        else:
            launcher.down(root)
            print("testnet stopped")
    return 0
