"""`meshnode endpoints JOB` (SPEC.md R4e) against real node drivers on the in-memory network:
any member answers with the same table, --json for scripts, one-line errors."""

import json

from tests.test_cli_job import cli, mesh_dir, one_line_error, with_placed_job  # noqa: F401 (fixture)


async def test_endpoints_show_the_primary_as_replica_0_at_every_member(mesh_dir, mock_clock, capsys):
    mock_clock.autojump_threshold = 0
    root, layout = mesh_dir

    async def test(jid, primary, bystander):
        tables = []
        for node in (primary, bystander):
            code, out, _ = await cli(capsys, "endpoints", jid.hex()[:12], "--node", node.paths.root, "--json")
            assert code == 0
            tables.append(json.loads(out))
        assert tables[0] == tables[1]   # derived from the job table: the same at every member
        table = tables[0]
        assert table["job_id"] == jid.hex() and table["port"] == 0 and table["total_weight"] == 1000
        [row] = table["endpoints"]
        assert (row["replica"], row["node"], row["weight"], row["address"]) == (
            0, primary.identity.public_key.hex(), 1000, "127.0.0.1")
        code, out, _ = await cli(capsys, "endpoints", jid.hex()[:12], "--node", bystander.paths.root)
        assert code == 0 and "127.0.0.1" in out and "100.0%" in out
        code, _, err = await cli(capsys, "endpoints", "0badc0de", "--node", bystander.paths.root)
        one_line_error(code, err, "no job 0badc0de")

    await with_placed_job(root, layout, test)
