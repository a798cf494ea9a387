"""bench/results/MANIFEST.yaml lists every committed result, and only those: each entry names a file
that exists and says what it measured, on what, when, by which command and at which commit ("not
recorded" where the file does not say); its topic is its folder, and its name follows bench/README.md's
naming rule. The calibration tests select results by the manifest's series, so a result missing from it
would silently drop out of them."""

from __future__ import annotations

import re
from collections import Counter

from tests.support.calibration import MANIFEST, REQUIRED, RESULTS, manifest

#: bench/README.md "Results": TOPIC/HARDWARE-WHAT[-CALL]-DATE[LETTER].EXT
NAME = re.compile(
    r"[a-z]+/(h200|h100|h200x2|cpu|model)-[a-z0-9-]*[a-z0-9](-[A-Z][A-Za-z0-9]*)?-20\d\d-\d\d-\d\d[a-z]?\.(json|txt)"
)


def test_every_result_file_is_in_the_manifest():
    files = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p != MANIFEST}
    listed = Counter(e["path"] for e in manifest())
    assert [p for p, n in listed.items() if n > 1] == []
    assert sorted(files - set(listed)) == [], "results missing from bench/results/MANIFEST.yaml"
    assert sorted(set(listed) - files) == [], "manifest entries whose file does not exist"


def test_every_entry_has_the_required_keys():
    for e in manifest():
        missing = [k for k in REQUIRED if not str(e.get(k) or "").strip()]
        assert missing == [], (e.get("path"), missing)
        assert e["topic"] == e["path"].split("/")[0], e["path"]


def test_every_name_follows_the_naming_rule():
    assert [e["path"] for e in manifest() if not NAME.fullmatch(e["path"])] == []


def test_the_date_in_a_name_is_the_date_it_records():
    """Where a file records its date, its name carries it (model-only results regenerated after their
    first run keep their first name)."""
    for e in manifest():
        named = re.search(r"20\d\d-\d\d-\d\d", e["path"].split("/")[1]).group(0)
        recorded = re.findall(r"20\d\d-\d\d-\d\d", str(e["date"]))
        if recorded and e["path"].split("/")[1].split("-")[0] != "model":
            assert named in recorded, (e["path"], e["date"])
