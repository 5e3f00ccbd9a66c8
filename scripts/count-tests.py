"""What ran on each database: tests and distinct test functions, from the passes' JUnit XML.

``python scripts/count-tests.py DIR``: DIR holds ``<database>-<part>.xml`` files (written by
scripts/test.sh). A test that ran is one that passed or failed (not skipped); a function is
``file::name`` without its parameters. The note of issue 32 compares these counts before and
after the selection by markers: every function of before still runs on the databases whose
SQL it exercises.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def ran(path: Path) -> list[str]:
    """The ids (``classname::name``) of the tests of one JUnit file that were not skipped."""
    ids = []
    for case in ET.parse(path).iter("testcase"):
        if case.find("skipped") is None:
            ids.append(f"{case.get('classname')}::{case.get('name')}")
    return ids


def main(directory: str) -> None:
    tests: dict[str, set[str]] = defaultdict(set)
    for path in sorted(Path(directory).glob("*.xml")):
        database = path.stem.split("-")[0]
        tests[database].update(ran(path))
    print(f"{'database':<12} {'tests run':>10} {'functions':>10}")
    for database, ids in sorted(tests.items()):
        functions = {test.split("[")[0] for test in ids}
        print(f"{database:<12} {len(ids):>10} {len(functions):>10}")


if __name__ == "__main__":
    main(sys.argv[1])
