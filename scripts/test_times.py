"""Seconds spent per test directory, from pytest's JUnit XML: how much each tier adds to a CI run.

    python scripts/test_times.py .pytest-times.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def main(path: str) -> int:
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        group = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        seconds[group] += float(case.get("time", 0))
        counts[group] += 1
    for group, total in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"[test] {group:<22} {counts[group]:4d} tests {total / 60:6.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
