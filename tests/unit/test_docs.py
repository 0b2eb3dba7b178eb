"""README.md and docs/: the generated parameter page is current, and every link resolves."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_table
from tests.helpers import REPO
from tools import doclinks, paramdoc


def _json(path: str) -> dict:
    return json.loads((REPO / path).read_text())


# README's headline numbers -> the committed file each is quoted from, and how it is shown.
HEADLINES = {
    "metrics/eval/metrics.json": lambda d: f"{d['fid']:.2f}",
    "metrics/featurenet.json": lambda d: f"{d['val_accuracy']:.1%}",
    "benchmarks/results/loader.json": lambda d: f"{d['ratio_median']['lmdb_vs_imagefolder']:.2f}×",
    "benchmarks/results/strategies.json": lambda d: (
        f"{d['versus_reference']['throughput_ratio_median']:.2f}×"
    ),
    "benchmarks/results/ddp.json": lambda d: f"{d['scaling_efficiency_median']:.2f}",
    "benchmarks/results/conditional.json": lambda d: f"{d['metrics']['class_accuracy']:.1%}",
}


@pytest.mark.parametrize("source", HEADLINES)
def test_readme_headline_numbers_quote_their_files(source):
    section = (REPO / "README.md").read_text().split("## Headline numbers\n", 1)[1]
    rows = [
        line
        for line in section.split("\n## ", 1)[0].splitlines()
        if line.startswith("|") and f"`{source}`" in line
    ]
    assert len(rows) == 1, f"README.md's headline table should have one row quoting {source}"
    shown = HEADLINES[source](_json(source))
    assert f"| {shown} |" in rows[0], f"README.md quotes {source} as {rows[0]!r}, it holds {shown}"


def test_evaluation_page_quotes_the_committed_metrics_of_the_default_run():
    evaluated = _json("metrics/eval/metrics.json")
    page = (REPO / "docs/evaluation.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| trained (EMA"))
    shown = (
        f"| {evaluated['fid']:.2f} | {evaluated['kid']:.3f} ± {evaluated['kid_std']:.3f} "
        f"| {evaluated['precision']:.3f} | {evaluated['recall']:.3f} |"
    )
    assert row.endswith(shown), f"docs/evaluation.md shows {row!r}; the metrics say {shown}"


def test_gpu_table_on_the_benchmarks_page_is_the_committed_result():
    result = json.loads(gpu_table.RESULTS.read_text())
    title, rows = gpu_table.table(result).split("\n", 1)
    page = (REPO / "docs/benchmarks.md").read_text()
    section = page.split("\n## GPU\n", 1)[1].split("\n## ", 1)[0]
    assert title in section, f"docs/benchmarks.md#gpu does not name the measured run: {title}"
    assert rows in section, (
        "docs/benchmarks.md#gpu's table differs from benchmarks/results/gpu.json: paste "
        "benchmarks.gpu_table.table() of the committed result"
    )


def test_parameter_page_matches_the_schema():
    committed = (REPO / "docs/parameters.md").read_text(encoding="utf-8")
    assert committed == paramdoc.render(), (
        "docs/parameters.md is stale (src/ganpipe/params.py changed): "
        f"run `{paramdoc.COMMAND}` (or `make docs`) and commit the page"
    )


def test_parameter_page_lists_every_key_with_its_default_range_and_docstring():
    page = paramdoc.render()
    assert "| `train.kimg` | float | `100` | 0 < x ≤ 1,000,000 | Length of training, in" in page
    assert "| `train.lr_g` | float | `0.0002` | 0 < x ≤ 1 |" in page
    assert "| `train.betas` | [float, float] | `[0.5, 0.999]` | each 0 ≤ x < 1 |" in page
    assert "| `devices.gpus` | `all` or list of int | `all` | each 0 ≤ x ≤ 1,023 |" in page
    assert "| `generate.truncation` | float or null | `null` | 0 < x ≤ 10 |" in page
    assert "`fp32` \\| `bf16` \\| `fp16`" in page  # choices, pipes escaped inside the table
    assert "did you mean data.channels?" in page.lower()  # the real error message
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == 2 + sum(  # seed, precision, then every field of every section
        len(field.annotation.model_fields)
        for field in paramdoc.Params.model_fields.values()
        if paramdoc.is_section(field)
    )


def test_every_relative_link_and_anchor_resolves():
    pages = doclinks.documents()
    assert REPO / "docs/parameters.md" in pages and len(pages) >= 10
    problems = [p for page in pages for p in doclinks.broken_links(page)]
    assert problems == []


def test_link_check_finds_missing_files_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text(
        "# A page\n\n## Run `make repro`, then look\n\n## Run `make repro`, then look\n"
    )
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#run-make-repro-then-look) [ok](docs/a.md#run-make-repro-then-look-1)\n"
        "[ok](#top) [web](https://example.org/x) `[code](nowhere.md)`\n\n# Top\n\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nothing) ![img](docs/grid.png)\n\n"
        "```\n[in a fence](fenced.md)\n```\n"
    )

    problems = doclinks.broken_links(tmp_path / "README.md", root=tmp_path)

    assert problems == [
        "README.md: docs/b.md (docs/b.md is missing)",
        "README.md: docs/a.md#nothing (no heading #nothing in a.md)",
        "README.md: docs/grid.png (docs/grid.png is missing)",
    ]


def test_slugs_follow_github():
    assert doclinks.slug("Checkpoints and exact resume") == "checkpoints-and-exact-resume"
    assert doclinks.slug("`d_first_retain` vs. `g_first_detach`") == (
        "d_first_retain-vs-g_first_detach"
    )
    assert doclinks.slug("Speed / memory (MB)") == "speed--memory-mb"
    assert doclinks.slug("See [the data page](data.md)") == "see-the-data-page"
