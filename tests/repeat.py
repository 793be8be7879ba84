"""Run the test suite several times in a row and report every test that failed in any run.

    python tests/repeat.py --runs 3 [-- extra pytest arguments]

The last run shuffles the order (pytest-random-order: modules in a random
order, tests shuffled inside each module) unless --no-random is given, so a
test that needs another to run first shows up too. Each run writes a JUnit XML
report under build/test-repeat/; the summary names the seed of the shuffled
run so it can be replayed with `pytest -p random_order --random-order-seed=N`.
Exit status 1 when any test failed (or errored) in any run.
"""

from __future__ import annotations

import argparse
import collections
import random
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _failures(report: Path) -> tuple[int, list[str]]:
    """Tests run and the ids of those that failed or errored, from a JUnit XML report."""
    if not report.exists():
        return 0, ["<no report: pytest did not finish>"]
    ran, failed = 0, []
    for case in ET.parse(report).getroot().iter("testcase"):
        ran += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return ran, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-random", action="store_true", help="usual order in every run")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()

    out = ROOT / "build" / "test-repeat"
    out.mkdir(parents=True, exist_ok=True)
    failed_in: collections.Counter[str] = collections.Counter()
    lines = []
    for run in range(1, args.runs + 1):
        report = out / f"run-{run}.xml"
        report.unlink(missing_ok=True)
        command = [sys.executable, "-m", "pytest", f"--junitxml={report}", *args.pytest_args]
        order = "usual order"
        if run == args.runs and not args.no_random:
            seed = random.randrange(1, 1_000_000)
            command += ["-p", "random_order", f"--random-order-seed={seed}"]
            order = f"random order, seed {seed}"
        print(f"== run {run} of {args.runs} ({order})", flush=True)
        started = time.monotonic()
        code = subprocess.call(command, cwd=ROOT)
        took = time.monotonic() - started
        ran, failed = _failures(report)
        if code != 0 and not failed:
            failed = [f"<run {run}: pytest exited {code}>"]
        failed_in.update(failed)
        lines.append(
            f"run {run} ({order}): exit {code}, {ran} tests, {len(failed)} failed, {took:.0f} s"
        )

    print("\n== summary")
    print("\n".join(lines))
    if failed_in:
        print("failed in some run (runs failed / runs):")
        for test, times in failed_in.most_common():
            print(f"  {times}/{args.runs}  {test}")
        return 1
    print(f"no test failed in {args.runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
