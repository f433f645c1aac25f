"""JobTable.mine is kept from the job ids that changed, not rebuilt by a scan (issue 18).

Every node rescanned the jobs it is primary of (and the workload orders and the vector's
running list recounted) whenever any job anywhere changed: each decision, at every node.
Now a record names its id to its table when a watched field is assigned, and the table
recounts only those. These tests hold both halves: the answer equals the full scan over
seeded random sequences of every kind of change, and a change to another node's job
costs this node no recount.
"""

import random

from protocol.job_table import LIVE_JOB_STATES, TERMINAL, JobTable
from test_mesh_core import KEYS, make_job, placed_on_the_big_node
from test_workload_orders import primary_core_counting_scans

ME = KEYS[0]
STATES = ("pending", *LIVE_JOB_STATES, *TERMINAL)


def full_scan(table: JobTable) -> list:
    """The definition: the records of the jobs this node is primary of now, by job id."""
    return [table.records[jid] for jid in sorted(table.records) if table.records[jid].primary == ME]


def test_mine_equals_the_full_scan_over_random_changes():
    manifests = [make_job(nonce=n) for n in range(24)]
    for seed in range(8):
        rng = random.Random(seed)
        table = JobTable(ME)
        version = table.mine_version()
        for step in range(400):
            before = [(r.job_id, r.primary, r.state, r.fence, r.gpus) for r in full_scan(table)]
            job, envelope = rng.choice(manifests)
            jid = bytes([rng.randrange(24)]) * 32
            record = table.get(jid)
            action = rng.randrange(6)
            if record is None or action == 0:
                table.add(jid, envelope, job, step)   # a new record, or one replacing the old
            elif action == 1:
                table.assign(record, rng.choice(KEYS[:3]), (), gpus=(rng.randrange(4),), fence=step)
            elif action == 2:
                record.primary = rng.choice(KEYS[:3])   # a plain assignment, no table method
            elif action == 3:
                record.state = rng.choice(STATES)
            elif action == 4:
                record.fence = step
            else:
                record.hint = "unwatched field %d" % step   # changes nothing mine() reads
            assert table.mine() == full_scan(table), (seed, step)
            assert table.may_have_mine() == bool(full_scan(table))
            after = [(r.job_id, r.primary, r.state, r.fence, r.gpus) for r in full_scan(table)]
            new_version = table.mine_version()
            if after != before:
                assert new_version != version, (seed, step)   # readers of mine() must recount
            version = new_version


def test_records_dropped_for_room_leave_mine(monkeypatch):
    monkeypatch.setattr("protocol.job_table.MAX_JOBS", 4)
    table = JobTable(ME)
    jobs = [make_job(nonce=n) for n in range(6)]
    for n, (job, envelope) in enumerate(jobs[:4]):
        record = table.add(bytes([n]) * 32, envelope, job, n)
        table.assign(record, ME, ())
        record.state = "completed"
    assert len(table.mine()) == 4
    table.add(bytes([9]) * 32, jobs[4][1], jobs[4][0], 9)   # over MAX_JOBS: the finished ones go
    assert table.mine() == full_scan(table) == []


def test_a_change_to_another_nodes_job_does_not_recount_the_orders_here():
    # Before: JobTable.mine was rebuilt, and the workload orders recounted, after any job's
    # field changed (job_table.changes), so each decision anywhere cost every node a scan.
    net, core, _jid, scans = primary_core_counting_scans()
    core.tick(net.now)
    scans.clear()
    job, envelope = make_job(nonce=77)
    other = core.job_table.add(b"\x77" * 32, envelope, job, net.now)
    core.job_table.assign(other, KEYS[2], (KEYS[3],), gpus=(0,), fence=1)
    other.state = "running"
    for step in range(1, 6):
        core.tick(net.now + step)
    assert scans == []
    mine = core.job_table.get(_jid)
    mine.state = "failed"   # one of this node's jobs: recounted (that one only), and the run is stopped
    out = core.tick(net.now + 10)
    assert [d.value for d in out.decisions if d.value_kind == "stop"] == [(_jid,)]


def test_the_placed_job_is_mine_at_its_primary_only():
    net, jid = placed_on_the_big_node()
    for key, core in net.cores.items():
        assert [r.job_id for r in core.job_table.mine()] == ([jid] if key == ME else [])


class Epochs:
    def __init__(self):
        self.member = True

    def is_member(self) -> bool:
        return self.member


class Liveness:
    halted = False
    startup_sync_due = False


class World:
    """A node's job table, ledger, waits and workload orders, changed only by ``apply``."""

    def __init__(self, full_recounts: bool):
        from protocol.ledger import ResourceLedger
        from protocol.workload_orders import WorkloadOrders
        self.jobs = JobTable(ME)
        self.ledger = ResourceLedger((80_000,) * 64, 1_000_000, 1_000_000)
        self.epochs, self.liveness = Epochs(), Liveness()
        self.handoff_waits, self.stop_waits = {}, {}
        self.orders = WorkloadOrders(self.epochs, self.jobs, self.liveness, self.ledger, self.handoff_waits,
                                     stop_waits=self.stop_waits)
        self.orders.full_recounts = full_recounts

    def apply(self, op: tuple, manifests: list) -> None:
        kind, n, arg = op
        jid = bytes([n]) * 32
        job, envelope = manifests[n]
        record = self.jobs.get(jid)
        if kind == "add" or record is None:
            self.jobs.add(jid, envelope, job, 0)
        elif kind == "assign":
            self.jobs.assign(record, ME if arg <= 5 else KEYS[arg % 3], (), gpus=(arg % 4,), fence=arg)
        elif kind == "state":
            record.state = LIVE_JOB_STATES[arg % 3] if arg <= 6 else STATES[arg % len(STATES)]
        elif kind == "fence":
            record.fence = arg
        elif kind == "allocate":
            self.ledger.allocate_now(jid, job.resources)
        elif kind == "free":
            self.ledger.free(jid)
        elif kind == "wait":
            waits = self.handoff_waits if arg % 2 else self.stop_waits
            if jid in waits:
                del waits[jid]
            else:
                waits[jid] = arg
        elif kind == "member":
            self.epochs.member = not self.epochs.member
        elif kind == "halt":
            self.liveness.halted = not self.liveness.halted
        elif kind == "exited":
            self.orders.exited(jid)

    def reconcile(self) -> list:
        from protocol.ready import Ready
        out = Ready()
        self.orders.reconcile(out)
        return [(d.value_kind, d.value) for d in out.decisions]


KINDS = ("add", "assign", "assign", "assign", "state", "state", "fence", "allocate", "allocate", "allocate",
         "free", "wait", "exited", "exited")


def test_incremental_workload_orders_equal_full_recounts_over_random_changes():
    # Issue 18: the orders now recount only the jobs that changed; the reference recounts
    # every job after every input (as before). Same decisions, in the same order, always.
    manifests = [make_job(nonce=n) for n in range(16)]
    recounted = 0
    for seed in range(10):
        rng = random.Random(seed)
        ops = [(KINDS[rng.randrange(len(KINDS))], rng.randrange(16), rng.randrange(1, 9)) for _ in range(300)]
        for at, toggle in ((100, "member"), (110, "member"), (200, "halt"), (215, "halt")):
            ops[at] = (toggle, 0, 0)   # out and back: everything stopped, then run again
        incremental, reference = World(full_recounts=False), World(full_recounts=True)
        for step, op in enumerate(ops):
            for world in (incremental, reference):
                world.apply(op, manifests)
            got, expected = incremental.reconcile(), reference.reconcile()
            assert got == expected, (seed, step, op)
            assert incremental.orders.ordered == reference.orders.ordered
            recounted += bool(expected)
    assert recounted > 200   # the sequences do order runs and stops


def test_a_change_to_one_of_this_nodes_jobs_recounts_that_job_only():
    # Before: the node a job was placed on rescanned all its jobs (twice per placement).
    manifests = [make_job(nonce=n) for n in range(40)]
    world = World(full_recounts=False)
    for n in range(40):
        for op in (("add", n, 0), ("assign", n, 1), ("state", n, 1), ("allocate", n, 0)):
            world.apply(op, manifests)
    assert [kind for kind, _ in world.reconcile()] == ["run"]
    asked = []
    allocated = world.ledger.allocated
    world.ledger.allocated = lambda key: asked.append(key) or allocated(key)
    world.apply(("fence", 7, 9), manifests)
    decisions = world.reconcile()
    assert [kind for kind, _ in decisions] == ["stop", "run"]
    assert asked == [bytes([7]) * 32]


def test_the_vectors_running_list_equals_the_full_scan_over_random_changes():
    # Issue 18: the capability book's list of jobs running here is kept from the jobs that
    # changed (JobTable.take_changes) instead of a scan of all of them after each change.
    net, jid = placed_on_the_big_node()
    core = net.cores[ME]
    table, book = core.job_table, core.capability
    records = [table.get(jid)]
    for n in range(12):
        job, envelope = make_job(nonce=100 + n)
        records.append(table.add(bytes([100 + n]) * 32, envelope, job, 0))
    rng = random.Random(5)
    for step in range(300):
        record = rng.choice(records)
        action = rng.randrange(3)
        if action == 0:
            table.assign(record, rng.choice(KEYS[:3]), (), fence=step)
        elif action == 1:
            record.state = rng.choice(("running", "running", "placed", "completed"))
        else:
            record.fence = step
        expected = tuple((r.job_id, r.fence) for r in full_scan(table) if r.state == "running")
        assert book._running_here() == expected, step


def test_the_vectors_running_list_looks_at_the_changed_job_only():
    net, jid = placed_on_the_big_node()
    core = net.cores[ME]
    table, book = core.job_table, core.capability
    book._running_here()
    scans = []
    mine = table.mine
    table.mine = lambda: scans.append(1) or mine()
    table.get(jid).state = "running"
    assert book._running_here() == ((jid, table.get(jid).fence),)
    assert scans == []   # before: every change to one of this node's jobs rescanned them all
