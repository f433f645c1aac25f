"""Every "SPEC.md N.M" or "SPEC P4b" a comment or doc cites names a section SPEC.md has."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"SPEC(?:\.md)?,?\s+(?:sections?\s+)?((?:\d+(?:\.\d+)?|[PFR]\d+[a-z]?)(?:-[\d.]+)?)")
HEADING = re.compile(r"^#{2,4} ((?:\d+(?:\.\d+)?)|[PFR]\d+[a-z]?)[ .]", re.MULTILINE)


def sections() -> set[str]:
    spec = (ROOT / "SPEC.md").read_text()
    found = set(HEADING.findall(spec))
    return found | {name.rstrip(".") for name in found}


def citing_files():
    for folder in ("protocol", "meshnode", "keys", "testnet", "tests"):
        yield from (ROOT / folder).rglob("*.py")
    yield ROOT / "README.md"
    yield ROOT / "BENCHMARKS.md"


def test_every_spec_citation_names_an_existing_section():
    known = sections()
    assert {"2.1", "6.9", "P4b", "F7", "10.5"} <= known
    missing = []
    for path in citing_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for cited in CITATION.findall(line):
                first = cited.split("-")[0]
                if first not in known and first.rstrip("abcdefgh") not in known:  # P7c: rule c of P7
                    missing.append("%s:%d cites SPEC %s" % (path.relative_to(ROOT), number, cited))
    assert not missing, "\n".join(missing)
