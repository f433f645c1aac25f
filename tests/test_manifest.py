"""Job manifests (SPEC.md 4.2, 4.3): TOML in, JobManifest out, errors that name the field."""

import pathlib

import pytest

from keys.identity import SigningIdentity
from meshnode.workload.builtin import BUILTIN_KINDS
from meshnode.workload.manifest import load_manifest, parse_manifest, verify_signed_job
from protocol.envelope import ANY_MESH
from protocol.errors import ManifestError, RemoteProtocolError
from protocol.messages import JobManifest, encode_message, job_id

OWNER = SigningIdentity(bytes(range(32)))
JOBS = pathlib.Path(__file__).resolve().parent.parent / "jobs"
MINIMAL = 'name = "c"\nentrypoint = "counter"\n'


def parse(text: str) -> JobManifest:
    return parse_manifest(text, OWNER.public_key, 1_700_000_000_000, epoch=0)


def test_minimal_manifest_takes_documented_defaults():
    job = parse(MINIMAL)
    assert (job.strategy, job.priority, job.backups, job.max_retries, job.nonce, job.args) == (
        "throughput", 0, 1, 3, 0, ())
    assert job.resources.to_body() == {"gpus": 0, "gpu_mem_mib": 0, "cpu_milli": 0, "mem_mib": 0,
                                       "gpu_milli": 0, "gpu_model": ""}
    assert job.scheduling.to_body() == {"pool": "", "preemptible": False, "max_runtime_ms": 0}
    assert job.owner == OWNER.public_key and job.created_ms == 1_700_000_000_000


@pytest.mark.parametrize("path", sorted(JOBS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_examples_parse(path):
    job = load_manifest(path, OWNER.public_key, 1, epoch=0)
    assert job.name and job.entrypoint in BUILTIN_KINDS


def test_sovereign_example_carries_constraints():
    job = load_manifest(JOBS / "sovereign.toml", OWNER.public_key, 1, epoch=0)
    assert job.strategy == "sovereign"
    assert dict(job.constraints.attested) == {"jurisdiction": "eu"}
    assert job.constraints.zones == ("zone-a", "zone-b")


@pytest.mark.parametrize("text,message", [
    (MINIMAL + '[resources]\ngpus = "two"\n', "resources.gpus: expected an integer 0..64, got 'two'"),
    (MINIMAL + "[resources]\ngpus = 65\n", "resources.gpus: expected an integer 0..64, got 65"),
    (MINIMAL + "[resources]\ncpu_milli = 1.5\n", "resources.cpu_milli: expected an integer"),
    (MINIMAL + "[resources]\ngpus = true\n", "resources.gpus: expected an integer"),
    (MINIMAL + "[resources]\ngpu = 1\n", "[resources]: unknown key 'gpu'"),
    (MINIMAL + "gpus = 1\n", "manifest: unknown key 'gpus'"),
    (MINIMAL + 'owner = "me"\n', "manifest: unknown key 'owner'"),  # owner comes from the signing key
    (MINIMAL + 'strategy = "fastest"\n', "strategy: expected one of 'latency', 'throughput', 'sovereign'"),
    (MINIMAL + "priority = -1\n", "priority: expected an integer 0..1000"),
    (MINIMAL + "backups = 9\n", "backups: expected an integer 0..4"),
    (MINIMAL + "args = [1]\n", "args: expected an array of at most 64 items, each a string"),
    (MINIMAL + "resources = 3\n", "resources: expected a table"),
    (MINIMAL + "[constraints]\nzones = \"eu\"\n", "constraints.zones: expected an array"),
    (MINIMAL + "[constraints]\nlabels = { a = 1 }\n", "constraints.labels: expected a table"),
    (MINIMAL + 'strategy = "sovereign"\n', "strategy: 'sovereign' needs"),
    ('entrypoint = "counter"\n', "name: required"),
    ('name = ""\nentrypoint = "counter"\n', "name: expected a string of 1..64 bytes"),
    ("name = \n", "not valid TOML"),
])
def test_errors_name_the_field_and_expectation(text, message):
    with pytest.raises(ManifestError) as info:
        parse(text)
    assert message in str(info.value)


def test_signed_job_verifies_and_checks_owner():
    job = parse(MINIMAL)
    envelope, decoded = verify_signed_job(encode_message(OWNER, ANY_MESH, job))
    assert decoded == job and envelope.mesh_id == ANY_MESH
    mesh_id = bytes(range(32))
    assert verify_signed_job(encode_message(OWNER, ANY_MESH, job), mesh_id)[1] == job  # ANY_MESH is valid anywhere
    assert verify_signed_job(encode_message(OWNER, mesh_id, job), mesh_id)[1] == job
    with pytest.raises(RemoteProtocolError):
        verify_signed_job(encode_message(OWNER, mesh_id, job), bytes(range(1, 33)))
    thief = SigningIdentity(bytes(32))
    with pytest.raises(RemoteProtocolError, match="not its owner"):
        verify_signed_job(encode_message(thief, ANY_MESH, job))


def test_job_id_changes_with_nonce():
    assert job_id(parse(MINIMAL)) != job_id(parse(MINIMAL + "nonce = 1\n"))
    assert job_id(parse(MINIMAL)) == job_id(parse(MINIMAL))


def test_verify_rejects_garbage_cleanly():
    for data in (b"", b"\x96", b"not msgpack at all"):
        with pytest.raises(RemoteProtocolError):
            verify_signed_job(data)


def test_scheduling_table_and_gpu_share_parse():
    job = parse(MINIMAL + '[resources]\ngpus = 1\ngpu_milli = 250\ngpu_model = "A100"\n'
                '[scheduling]\npool = "research"\npreemptible = true\nmax_runtime_ms = 60000\n')
    assert (job.resources.gpu_milli, job.resources.gpu_model) == (250, "A100")
    assert (job.scheduling.pool, job.scheduling.preemptible, job.scheduling.max_runtime_ms) == (
        "research", True, 60000)


@pytest.mark.parametrize("tail, error", [
    ('[resources]\ngpus = 2\ngpu_milli = 500\n', "[resources]: gpu_milli 500 is a share of one GPU, so gpus must be 1"),
    ('[resources]\ngpus = 1\ngpu_milli = 1000\n', "resources.gpu_milli: expected an integer 0..999"),
    ('[scheduling]\npreemptible = "yes"\n', "scheduling.preemptible: expected true or false"),
    ('[scheduling]\npriority = 5\n', "[scheduling]: unknown key 'priority'"),
])
def test_scheduling_and_gpu_share_errors_name_the_field(tail, error):
    with pytest.raises(ManifestError) as raised:
        parse(MINIMAL + tail)
    assert error in str(raised.value)


REFLEX = MINIMAL + '[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "migrate"\n'


def test_reflex_rules_parse_with_defaults_and_jobs_without_them_keep_their_ids():
    job = parse(REFLEX + '[[reflex]]\nsignal = "gpu_util"\nbelow = 5\nfor_ms = 9000\nzone = "prod"\n'
                         'action = "migrate"\ncooldown_ms = 0\n')
    first, second = job.reflexes
    assert (first.signal, first.above, first.below, first.for_ms, first.zone, first.cooldown_ms) == (
        "gpu_temp", 85, None, 5000, "", 60_000)
    assert (second.below, second.for_ms, second.zone, second.cooldown_ms) == (5, 9000, "prod", 0)
    assert "reflexes" not in parse(MINIMAL).to_body()   # SPEC.md 4.2: so old job ids stay
    assert verify_signed_job(encode_message(OWNER, ANY_MESH, job))[1] == job


@pytest.mark.parametrize("tail, error", [
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "clone"\nclone = 0\n', "reflex[0].clone: expected an integer 1..7"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "decay"\n', "reflex[0].decay: required with action = 'decay'"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "decay"\ndecay = 101\n', "reflex[0].decay: expected an integer 1..100"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "migrate"\nclone = 1\n', "reflex[0].clone: only a rule with"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "clone"\nreroute = 5\n', "reflex[0].reroute: only a rule with"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "migrate"\namount = 1\n', "reflex[0]: unknown key 'amount'"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "explode"\n', "reflex[0].action: expected one of 'migrate', 'clone'"),
    ('[[reflex]]\nsignal = "fan_rpm"\nabove = 85\naction = "migrate"\n', "reflex[0].signal: expected one of"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "migrate"\nfor = 3\n', "reflex[0]: unknown key 'for'"),
    ('[[reflex]]\nsignal = "gpu_temp"\naction = "migrate"\n', "reflex[0]: give exactly one of above and below"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 1\nbelow = 2\naction = "migrate"\n', "exactly one of above"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\n', "reflex[0].action: required"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = -1\naction = "migrate"\n', "reflex[0].above: expected an integer"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "migrate"\nfor_ms = "5s"\n',
     "reflex[0].for_ms: expected an integer"),
    ('reflex = 3\n', "reflex: expected [[reflex]] tables"),
    ('[[reflex]]\nsignal = "gpu_temp"\nabove = 85\naction = "migrate"\n' * 9, "reflex: at most 8 rules"),
])
def test_reflex_errors_name_the_field(tail, error):
    with pytest.raises(ManifestError) as info:
        parse(MINIMAL + tail)
    assert error in str(info.value)


def test_service_table_and_replica_reflexes_parse_and_old_job_ids_stay():
    job = parse(MINIMAL + '[service]\nport = 8080\nmin_replicas = 1\nmax_replicas = 3\n'
                '[[reflex]]\nsignal = "gpu_util"\nabove = 80\nfor_ms = 5000\naction = "clone"\n'
                '[[reflex]]\nsignal = "gpu_util"\nabove = 80\nfor_ms = 5000\naction = "reroute"\nreroute = 50\n'
                '[[reflex]]\nsignal = "gpu_util"\nbelow = 20\nfor_ms = 5000\naction = "decay"\ndecay = 100\n')
    assert (job.service.port, job.service.min_replicas, job.service.max_replicas) == (8080, 1, 3)
    assert [(r.action, r.amount) for r in job.reflexes] == [("clone", 1), ("reroute", 50), ("decay", 100)]
    assert verify_signed_job(encode_message(OWNER, ANY_MESH, job))[1] == job
    plain = parse(REFLEX).to_body()   # R4: no [service] and a migrate rule: the bytes of before
    assert "service" not in plain and "amount" not in plain["reflexes"][0]


@pytest.mark.parametrize("tail, error", [
    ('[service]\nport = 70000\n', "service.port: expected an integer 0..65535"),
    ('[service]\nmin_replicas = 3\nmax_replicas = 2\n', "[service]: min_replicas 3 is above max_replicas 2"),
    ('[service]\nmax_replicas = 9\n', "service.max_replicas: expected an integer 1..8"),
    ('[service]\nreplicas = 2\n', "[service]: unknown key 'replicas'"),
])
def test_service_errors_name_the_field(tail, error):
    with pytest.raises(ManifestError) as info:
        parse(MINIMAL + tail)
    assert error in str(info.value)


def test_gang_table_parses_fixed_and_elastic_sizes():
    assert not parse(MINIMAL).gang.is_gang   # no [gang]: a plain job, as before
    fixed = parse(MINIMAL + '[gang]\nworkers = 4\ntopology = "rail_group"\n').gang
    assert (fixed.is_gang, fixed.sizes(), fixed.topology) == (True, (4,), "rail_group")
    elastic = parse(MINIMAL + '[gang]\nmin_workers = 2\nmax_workers = 8\nmultiple_of = 4\n').gang
    assert (elastic.workers, elastic.sizes()) == (0, (8, 4))


@pytest.mark.parametrize("tail, error", [
    ('[gang]\nworkers = 4\nmax_workers = 8\n', "[gang]: min_workers, max_workers and multiple_of are for an elastic"),
    ('[gang]\nmin_workers = 5\nmax_workers = 3\n', "[gang]: an elastic gang (workers = 0) needs 1 <= min_workers"),
    ('[gang]\nmin_workers = 5\nmax_workers = 7\nmultiple_of = 4\n', "[gang]: no multiple of multiple_of 4"),
    ('[gang]\nworkers = 17\n', "gang.workers: expected an integer 0..16"),
    ('[gang]\ntopology = "rack"\n', "gang.topology: expected one of 'none', 'zone', 'rail_group', 'spread_zones'"),
    ('[gang]\nsize = 2\n', "[gang]: unknown key 'size'"),
])
def test_gang_errors_name_the_field(tail, error):
    with pytest.raises(ManifestError) as raised:
        parse(MINIMAL + tail)
    assert error in str(raised.value)
