"""A refused body names the place of its first bad value exactly (SPEC.md 3), although the
checks that pass no longer format that place for every field and item (issue 18: the
text work was most of a decode's schema cost). Each message is the one the per-field
formatting gave."""

import copy

import pytest

from protocol.errors import RemoteProtocolError
from protocol.messages import JobManifest
from test_mesh_core import make_job


def bad(path_and_value):
    body = make_job()[0].to_body()
    *parents, last = path_and_value[0]
    target = body
    for key in parents:
        target = target[key]
    target[last] = copy.deepcopy(path_and_value[1])
    return body


@pytest.mark.parametrize("change, message", [
    ((("args",), ["ok", 5]), "JobManifest.args[1]: expected text of 0..1024 bytes, got 5"),
    ((("constraints", "labels"), {"a": "x", "b": 7}), "JobManifest.constraints.labels[b]: expected text of 0..256 bytes, got 7"),
    ((("constraints", "labels"), {"a": "x", "": "y"}), "JobManifest.constraints.labels key: expected text of 1..64 bytes, got ''"),
    ((("resources", "gpus"), -1), "JobManifest.resources.gpus: expected int in [0, 64], got -1"),
    ((("constraints", "zones"), ["z", "q" * 300]), "JobManifest.constraints.zones[1]: expected text of 1..64 bytes, got 'qqqq"),
    ((("constraints", "zones"), "zone"), "JobManifest.constraints.zones: expected array of at most"),
    ((("constraints",), {"zones": []}), "JobManifest.constraints: missing fields ['attested', 'labels'], unknown fields []"),
])
def test_a_bad_value_is_named_by_its_place(change, message):
    with pytest.raises(RemoteProtocolError) as refused:
        JobManifest.from_body(bad(change))
    assert str(refused.value).startswith(message)


def test_a_good_body_decodes_to_the_same_record():
    job = make_job()[0]
    assert JobManifest.from_body(job.to_body()) == job
