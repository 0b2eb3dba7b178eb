"""tools.testtimes: per-module sums of a JUnit report, wall and CPU."""

from __future__ import annotations

from pathlib import Path

from tools import testtimes

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" time="12.5">
<testcase classname="tests.unit.test_a" name="test_one" time="1.5">
  <properties><property name="cpu_s" value="1.25" /></properties></testcase>
<testcase classname="tests.unit.test_a" name="test_two" time="4.0">
  <properties><property name="cpu_s" value="0.50" /></properties></testcase>
<testcase classname="tests.e2e.test_b" name="test_three" time="7.0">
  <properties><property name="cpu_s" value="13.00" /></properties>
  <skipped message="no" /></testcase>
</testsuite></testsuites>
"""


def test_modules_sum_wall_and_cpu_seconds_and_name_their_longest_test(tmp_path: Path, capsys):
    (tmp_path / "r.xml").write_text(REPORT)
    modules, wall = testtimes.read_report(tmp_path / "r.xml")
    assert wall == 12.5
    a, b = modules["tests/unit/test_a.py"], modules["tests/e2e/test_b.py"]
    assert (a.seconds, a.cpu_s, a.tests, a.skipped, a.longest) == (5.5, 1.75, 2, 0, 4.0)
    assert (b.seconds, b.cpu_s, b.tests, b.skipped) == (7.0, 13.0, 1, 1)
    rows = testtimes.table(modules, None)
    assert rows[2] == "| tests/e2e/test_b.py | 1 (1) | 7.0 | 13.0 | 7.0 |"  # slowest first
    assert rows[3] == "| tests/unit/test_a.py | 2 (0) | 5.5 | 1.8 | 4.0 |"
    assert rows[-1] == "| **all** | 3 | 12.5 | 14.8 | |"


def test_a_report_without_cpu_leaves_the_column_empty(tmp_path: Path):
    (tmp_path / "r.xml").write_text(REPORT.replace("cpu_s", "other"))
    modules, _ = testtimes.read_report(tmp_path / "r.xml")
    rows = testtimes.table(modules, modules)
    assert rows[2] == "| tests/e2e/test_b.py | 1 (1) | 7.0 |  | 7.0 | 7.0 |"
    assert rows[-1] == "| **all** | 3 | 12.5 |  | | 12.5 |"
