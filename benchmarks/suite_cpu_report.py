"""The CPU seconds of the test suite per test file (or per test), which the machine's load changes far less than
wall time.

Run the suite with ``COLOSSAL_LITE_TEST_CPU_LOG=FOLDER`` (``tests/conftest.py`` then appends, per test, the CPU
seconds of the pytest process and of the processes it started and waited for), then::

    python benchmarks/suite_cpu_report.py FOLDER [--top 25] [--tests] [--compare OTHER_FOLDER]
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path


def read(folder: Path, by_test: bool) -> dict:
    """``{file or test id: [own CPU s, children's CPU s, tests]}`` summed over the folder's logs."""
    totals = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for log in sorted(Path(folder).glob("cpu-*.tsv")):
        for line in log.read_text(encoding="utf-8").splitlines():
            nodeid, own, children = line.rsplit("\t", 2)
            key = nodeid if by_test else nodeid.split("::")[0]
            entry = totals[key]
            entry[0] += float(own)
            entry[1] += float(children)
            entry[2] += 1
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tests", action="store_true", help="one line per test instead of per file")
    parser.add_argument("--compare", type=Path, help="a folder of an earlier run: its figures beside these")
    args = parser.parse_args()
    now = read(args.folder, args.tests)
    before = read(args.compare, args.tests) if args.compare else {}
    rows = sorted(now.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    print("| file | tests | CPU s (own + children) |" + (" before |" if before else ""))
    print("|---|---|---|" + ("---|" if before else ""))
    for key, (own, children, count) in rows[:args.top]:
        earlier = before.get(key)
        then = f" {sum(earlier[:2]):.1f} |" if earlier else (" |" if before else "")
        print(f"| {key} | {count} | {own + children:.1f} ({own:.1f} + {children:.1f}) |{then}")
    own, children = sum(v[0] for v in now.values()), sum(v[1] for v in now.values())
    line = f"all {sum(v[2] for v in now.values())} tests: {own + children:.1f} CPU s ({own:.1f} own + {children:.1f} children)"
    if before:
        line += f"; before: {sum(v[0] + v[1] for v in before.values()):.1f} CPU s, {sum(v[2] for v in before.values())} tests"
    print(line)


if __name__ == "__main__":
    main()
