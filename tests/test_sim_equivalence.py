"""testnet/sim_equivalence.py: the seed-for-seed comparison a refactor is judged by.

Two tiny matrices from the same code must compare identical; a perturbed fingerprint,
or a genuinely different run under the same key, must be reported with what differs.
"""

from __future__ import annotations

import copy
import json

import pytest

from testnet.sim_equivalence import Case, compare_documents, main, matrix, run_cases, runs_of

TINY = [(Case(4, 2, "none", seeds=(1,)), 1), (Case(4, 3, "all", 330, 50, seeds=(2,)), 2)]


@pytest.fixture(scope="module")
def twice():
    return run_cases(TINY), run_cases(TINY)


def _messages(report: dict) -> dict:
    return {(key, section): message for key, _reproduce, found in report["runs"] for section, _adv, message in found}


def test_the_same_code_twice_compares_identical(twice):
    first, second = twice
    assert all(run["decisions"] for run in first["runs"])
    report = compare_documents(first, second)
    assert report["identical"] and report["compared"] == len(TINY) and not report["runs"]


def test_a_perturbed_fingerprint_is_reported_with_what_differs(twice):
    first, second = twice
    changed = copy.deepcopy(second)
    run = changed["runs"][1]
    run["decisions"][3][4] = "00" * 32                       # one decided value's digest
    run["latencies_ms"][0] += 1
    run["messages"]["sent"][2][1] = "ff" * 32
    changed["runs"][0]["core_counters"][0]["invented"] = 1  # advisory only
    report = compare_documents(first, changed)
    assert not report["identical"] and report["failing"] == 1
    found = _messages(report)
    key, node = run["key"], run["decisions"][3][1]
    assert "node %d's decision #" % node in found[(key, "decisions")]
    assert "value_sha256" in found[(key, "decisions")]
    assert "job #0" in found[(key, "latencies_ms")]
    assert "sent streams of nodes [2]" in found[(key, "messages")]
    assert (changed["runs"][0]["key"], "core_counters") in found
    assert not compare_documents(first, changed, strict=True)["identical"]
    # A missing decision is named by node and position too.
    dropped = copy.deepcopy(second)
    gone = dropped["runs"][0]["decisions"].pop()
    message = _messages(compare_documents(first, dropped))[(dropped["runs"][0]["key"], "decisions")]
    assert "node %d:" % gone[1] in message and "only A has" in message


def test_a_different_run_under_the_same_key_differs_and_a_subset_compares(twice):
    first, _ = twice
    other = run_cases([(TINY[0][0], 7)])
    other["runs"][0]["key"] = first["runs"][0]["key"]
    report = compare_documents(first, other, subset=True)
    assert not report["identical"] and report["only_a"] == [first["runs"][1]["key"]]
    sections = {section for _key, _r, found in report["runs"] for section, _adv, _msg in found}
    assert {"world", "decisions", "latencies_ms"} <= sections
    # Only the common runs, and they agree: identical with --subset, not without.
    partial = copy.deepcopy(first)
    partial["runs"] = partial["runs"][:1]
    assert compare_documents(partial, first, subset=True)["identical"]
    assert not compare_documents(partial, first)["identical"]


def test_the_command_line_runs_one_case_and_compares(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert main(["run", "--out", str(out), "--only", "^n4-j4-fnone-b0-s0-hb1-bs-#1$"]) == 0
    document = json.loads(out.read_text())
    assert [r["key"] for r in document["runs"]] == ["n4-j4-fnone-b0-s0-hb1-bs-#1"]
    assert main(["compare", str(out), str(out)]) == 0
    changed = copy.deepcopy(document)
    changed["runs"][0]["summary"]["messages"] += 1
    other = tmp_path / "changed.json"
    other.write_text(json.dumps(changed))
    capsys.readouterr()
    assert main(["compare", str(out), str(other)]) == 1
    assert "messages: A" in capsys.readouterr().out


def test_the_matrix_covers_what_the_refactor_promises():
    cases = matrix()
    assert len(cases) >= 50 and len({c.key() for c in cases}) == len(cases)
    assert {c.nodes for c in cases} >= {4, 5, 7, 8, 16, 32, 64}
    assert {c.slot_ms for c in cases} == {0, 50} and {c.heartbeats for c in cases} == {True, False}
    assert {"none", "all"} <= {c.faults for c in cases} and {0, 330} <= {c.byzantine_milli for c in cases}
    assert any(c.bid_sample for c in cases if c.nodes >= 32)
    quick = runs_of(cases, True, None)
    assert quick and set(quick) <= set(runs_of(cases, False, None))
