"""Per-module test times from a pytest JUnit XML report, as a Markdown table.

Inputs: the report of ``python -m pytest --junitxml=FILE`` (``make test`` passes pytest's
options through ``PYTEST_ADDOPTS``), optionally a second one to compare with. Outputs: one
row per test module (tests, skipped, the sum of its tests' times with setup and teardown, the
CPU seconds they used where the report has them (the ``cpu_s`` property of tests/conftest.py),
its longest test), the longest tests after it, on stdout.
Command: ``python -m tools.testtimes AFTER.xml [--before BEFORE.xml] [--longest N]``, e.g.
``PYTEST_ADDOPTS=--junitxml=/tmp/after.xml make test`` in a fresh clone, then
``python -m tools.testtimes /tmp/after.xml --before /tmp/before.xml``.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Module:
    """The tests of one module in a report."""

    seconds: float = 0.0
    cpu_s: float | None = None
    tests: int = 0
    skipped: int = 0
    longest: float = 0.0
    times: dict[str, float] = field(default_factory=dict)


def read_report(path: Path) -> tuple[dict[str, Module], float]:
    """Modules by path (``tests/unit/test_x.py``) and the run's wall time in seconds."""
    root = ET.parse(path).getroot()
    modules: dict[str, Module] = defaultdict(Module)
    for case in root.iter("testcase"):
        module = modules[case.get("classname", "").replace(".", "/") + ".py"]
        seconds = float(case.get("time", 0))
        module.seconds += seconds
        cpu = case.find("properties/property[@name='cpu_s']")
        if cpu is not None:
            module.cpu_s = (module.cpu_s or 0.0) + float(cpu.get("value", 0))
        module.tests += 1
        module.skipped += case.find("skipped") is not None
        module.longest = max(module.longest, seconds)
        module.times[case.get("name", "")] = seconds
    suites = list(root.iter("testsuite"))
    return dict(modules), sum(float(s.get("time", 0)) for s in suites)


def table(after: dict[str, Module], before: dict[str, Module] | None) -> list[str]:
    """Markdown rows, the slowest module first."""
    head = "| module | tests (skipped) | sum s | CPU s | longest s |"
    rule = "|---|---:|---:|---:|---:|"
    if before is not None:
        head, rule = head + " before s |", rule + "---:|"
    rows = [head, rule]
    names = sorted(set(after) | set(before or {}), key=lambda m: -after.get(m, Module()).seconds)
    for name in names:
        mod = after.get(name, Module())
        cpu = "" if mod.cpu_s is None else f"{mod.cpu_s:.1f}"
        row = f"| {name} | {mod.tests} ({mod.skipped}) | {mod.seconds:.1f} | {cpu} |"
        row += f" {mod.longest:.1f} |"
        if before is not None:
            row += f" {before.get(name, Module()).seconds:.1f} |"
        rows.append(row)
    total = sum(m.seconds for m in after.values())
    cpus = [m.cpu_s for m in after.values() if m.cpu_s is not None]
    cpu = f"{sum(cpus):.1f}" if cpus else ""
    last = f"| **all** | {sum(m.tests for m in after.values())} | {total:.1f} | {cpu} | |"
    if before is not None:
        last += f" {sum(m.seconds for m in before.values()):.1f} |"
    return [*rows, last]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--before", type=Path, help="an earlier report to compare with")
    parser.add_argument("--longest", type=int, default=20, help="how many tests to list")
    args = parser.parse_args(argv)
    after, wall = read_report(args.report)
    before = read_report(args.before)[0] if args.before else None
    print(f"wall time of the run: {wall:.0f} s\n")
    print("\n".join(table(after, before)))
    tests = [(t, f"{m}::{n}") for m, mod in after.items() for n, t in mod.times.items()]
    print()
    for seconds, name in sorted(tests, reverse=True)[: args.longest]:
        print(f"{seconds:7.1f} s  {name}")


if __name__ == "__main__":
    main()
