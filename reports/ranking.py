"""The sweep's comparison: runs ranked by a metric, grouped over seeds, a table and a plot.

Pure functions over what each experiment run published (its ``pipeline-metrics`` artifact,
see :func:`run_rows`, read back by :mod:`flows.sweep`); no Prefect, no DVC
calls, so the report can be rebuilt and tested from saved JSON (:func:`write_sweep_report`
writes its three files). A metric that no experiment
has (the evaluation stage not run yet, a typo) is reported as missing, never a crash. Every
string a caller chose (grid values, metric names, errors) is shown as a code span
(:func:`code`), so it cannot add lines, cells or HTML to the markdown.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ganpipe.files import write_bytes_atomic
from ganpipe.overrides import flatten

#: Train-stage measurements shown beside the ranking metric (dotted keys of its metrics).
PERF_KEYS = {
    "step_ms": "perf.step_ms",
    "peak_memory_mb": "perf.peak_memory_mb",
    "images_per_s": "perf.images_per_s",
}
#: Grid keys that repeat a setting rather than define one; the summary averages over them.
REPEAT_KEYS = ("seed",)
PERF_TITLES = {
    "step_ms": "step ms",
    "peak_memory_mb": "peak memory MB",
    "images_per_s": "images/s",
}


@dataclass
class Run:
    """One experiment of the sweep."""

    name: str
    settings: dict[str, Any]
    """The grid values of this run (``{"train.strategy": ..., "seed": ...}``)."""
    state: str
    """success, failed, crashed (its worker died), cancelled, or missing (never ended)."""
    metric: float | None = None
    perf: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    ran_on: str | None = None
    """Which worker and GPUs ran it (``gpu-host-gpu0, CUDA_VISIBLE_DEVICES=0``)."""
    ruler: str | None = None
    """What its metric was measured with: feature network and val split (:func:`ruler_of`)."""
    other_ruler: bool = False
    """Measured with another ruler than the sweep's: shown, never ranked or averaged."""

    @property
    def comparable(self) -> float | None:
        """The metric, where it can be compared with the other runs'."""
        return None if self.other_ruler else self.metric


def describe_ran_on(ran_on: Mapping[str, Any] | None) -> str | None:
    """``worker, CUDA_VISIBLE_DEVICES=N`` from a run's record of where it ran."""
    if not ran_on:
        return None
    devices = ran_on.get("cuda_visible_devices")
    shown = "unset" if devices is None else repr(devices) if devices == "" else devices
    return f"{ran_on.get('worker') or ran_on.get('host')}, CUDA_VISIBLE_DEVICES={shown}"


@dataclass
class Group:
    """The runs sharing every grid value except the seed."""

    settings: dict[str, Any]
    runs: list[Run]

    def values(self, attr: str) -> list[float]:
        found = [r.comparable if attr == "metric" else r.perf.get(attr) for r in self.runs]
        return [v for v in found if v is not None]

    def mean(self, attr: str) -> float | None:
        values = self.values(attr)
        return statistics.fmean(values) if values else None


def find_metric(metrics: Mapping[str, Any], key: str) -> float | None:
    """Value of dotted ``key`` in any metrics file of one experiment (first file wins)."""
    for data in metrics.values():
        value = flatten(data).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) if math.isfinite(value) else None
    return None


def ruler_of(metrics: Mapping[str, Any]) -> str | None:
    """``extractor sha256 / val split sha256`` (12 hex digits each) of the evaluate stage's
    ``ruler`` record, None where no metrics file names one (made before rulers were recorded)."""
    for data in metrics.values():
        flat = flatten(data)
        extractor, val = flat.get("ruler.extractor_sha256"), flat.get("ruler.val_sha256")
        if isinstance(extractor, str) and isinstance(val, str):  # hex only: shown unquoted
            return "/".join(re.sub("[^0-9a-f]", "?", h[:12].lower()) for h in (extractor, val))
    return None


def mark_other_rulers(runs: Sequence[Run]) -> str | None:
    """Mark the runs measured with another ruler than most runs with the metric (ties: the
    first planned) as :attr:`Run.other_ruler`; return the sweep's ruler (None: none known).

    A FID measured in another feature network or against other val images is on another
    scale: ranking it beside the others, or averaging it into their mean, would compare
    numbers that mean different things.
    """
    counts: dict[str, int] = {}
    for run in runs:
        if run.metric is not None and run.ruler is not None:
            counts[run.ruler] = counts.get(run.ruler, 0) + 1
    if not counts:
        return None
    reference = max(counts, key=lambda r: counts[r])  # max keeps the first of equal counts
    for run in runs:
        run.other_ruler = run.ruler is not None and run.ruler != reference
    return reference


def collect_runs(
    planned: Mapping[str, Mapping[str, Any]],
    found: Mapping[str, Mapping[str, Any]],
    metric: str,
    errors: Mapping[str, str] | None = None,
) -> list[Run]:
    """One :class:`Run` per planned experiment (name -> grid values), in planned order."""
    runs = []
    for name, settings in planned.items():
        exp = found.get(name)
        if exp is None:
            runs.append(Run(name, dict(settings), "missing", error=(errors or {}).get(name)))
            continue
        metrics = exp.get("metrics") or {}
        perf = {short: find_metric(metrics, key) for short, key in PERF_KEYS.items()}
        runs.append(
            Run(
                name,
                dict(settings),
                exp.get("state") or "success",
                metric=find_metric(metrics, metric),
                perf={k: v for k, v in perf.items() if v is not None},
                error=(errors or {}).get(name) or exp.get("error"),
                ran_on=describe_ran_on(exp.get("ran_on")),
                ruler=ruler_of(metrics),
            )
        )
    mark_other_rulers(runs)
    return runs


def _order(value: float | None, higher_is_better: bool) -> tuple[int, float]:
    if value is None:
        return (1, 0.0)
    return (0, -value if higher_is_better else value)


def rank_runs(runs: Sequence[Run], higher_is_better: bool = False) -> list[Run]:
    """Runs best first; runs without the metric last, in their original order."""
    return sorted(runs, key=lambda r: _order(r.comparable, higher_is_better))


def group_runs(
    runs: Sequence[Run], group_keys: Sequence[str], higher_is_better: bool = False
) -> list[Group]:
    """Runs grouped by ``group_keys`` values, best mean metric first."""
    groups: dict[tuple, Group] = {}
    for run in runs:
        settings = {key: run.settings.get(key) for key in group_keys}
        key = tuple(repr(v) for v in settings.values())
        groups.setdefault(key, Group(settings, [])).runs.append(run)
    return sorted(groups.values(), key=lambda g: _order(g.mean("metric"), higher_is_better))


def code(value: Any) -> str:
    """``value`` as one markdown code span: a caller's string cannot break out of it, start
    a line, close a table cell or inject HTML."""
    text = " ".join(str(value).split()).replace("`", "'").replace("|", "\\|")
    return f"`{text}`"


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def _range(values: list[float]) -> str:
    return f"{_fmt(min(values))} – {_fmt(max(values))}" if len(values) > 1 else "—"


def verdict(groups: Sequence[Group], metric: str, higher_is_better: bool) -> str:
    """One paragraph: the best group, the runner-up, and whether seeds separate them."""
    ranked = [g for g in groups if g.values("metric")]
    if not ranked:
        return f"No run has the metric {code(metric)}, so nothing is ranked (see Notes)."

    def label(group: Group) -> str:
        return " + ".join(code(v) for v in group.settings.values()) or "all runs"

    best = ranked[0]
    text = (
        f"**Best by mean {code(metric)}: {label(best)}** "
        f"({_fmt(best.mean('metric'))} over {len(best.values('metric'))} run(s))."
    )
    if len(ranked) > 1:
        second = ranked[1]
        text += f" Next: {label(second)} ({_fmt(second.mean('metric'))})."
        lo_b, hi_b = min(best.values("metric")), max(best.values("metric"))
        lo_s, hi_s = min(second.values("metric")), max(second.values("metric"))
        overlap = lo_b <= hi_s and lo_s <= hi_b
        if len(best.values("metric")) < 2 or len(second.values("metric")) < 2:
            text += " One of them has a single run: the seed-to-seed spread is unknown."
        elif overlap:
            text += (
                " Their per-seed ranges overlap: the difference is within seed noise; run "
                "more seeds or longer training before choosing on this metric."
            )
        else:
            text += " Their per-seed ranges do not overlap."
    return text


def render_markdown(
    title: str,
    runs: Sequence[Run],
    group_keys: Sequence[str],
    metric: str,
    higher_is_better: bool,
    context: Mapping[str, Any],
    plot_name: str | None,
) -> str:
    """The sweep report (markdown): summary by group, verdict, plot, every run, notes."""
    groups = group_runs(runs, group_keys, higher_is_better)
    perf_cols = [k for k in PERF_KEYS if any(k in r.perf for r in runs)]
    direction = "higher is better" if higher_is_better else "lower is better"
    lines = [f"# {title}", ""]
    lines += [f"- {key}: {value}" for key, value in context.items()]
    lines += [f"- ranked by {code(metric)} ({direction})", ""]

    lines += ["## Summary (mean over seeds)", ""]
    head = [*map(code, group_keys), f"{code(metric)} mean", f"{code(metric)} min – max"]
    head += [f"{PERF_TITLES[k]} mean" for k in perf_cols] + ["runs"]
    lines += ["| rank | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for i, group in enumerate(groups, 1):
        ok = sum(r.state == "success" for r in group.runs)
        cells = [code(v) for v in group.settings.values()]
        cells += [_fmt(group.mean("metric")), _range(group.values("metric"))]
        cells += [_fmt(group.mean(k)) for k in perf_cols]
        cells += [f"{ok}/{len(group.runs)}"]
        rank = str(i) if group.values("metric") else "—"
        lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    lines += ["", verdict(groups, metric, higher_is_better), ""]
    if plot_name:
        lines += [f"![the metric and step cost per setting]({plot_name})", ""]

    lines += ["## All runs", ""]
    keys = list(dict.fromkeys(k for r in runs for k in r.settings))
    where = any(r.ran_on for r in runs)
    head = ["experiment", *map(code, keys), code(metric)]
    head += [*(PERF_TITLES[k] for k in perf_cols), "state"]
    head += ["ran on"] if where else []
    lines += ["| rank | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for i, run in enumerate(rank_runs(runs, higher_is_better), 1):
        cells = [code(run.name), *(code(run.settings.get(k, "")) for k in keys)]
        shown = _fmt(run.metric) + (" (other ruler)" if run.other_ruler else "")
        cells += [shown, *(_fmt(run.perf.get(k)) for k in perf_cols), run.state]
        cells += [code(run.ran_on) if run.ran_on else "—"] if where else []
        rank = str(i) if run.comparable is not None else "—"
        lines.append(f"| {rank} | " + " | ".join(cells) + " |")

    notes = notes_for(runs, metric)
    if notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def notes_for(runs: Sequence[Run], metric: str) -> list[str]:
    """What the reader must know: the ruler, missing metric or perf columns, failed runs."""
    notes = []
    rulers = list(
        dict.fromkeys(r.ruler for r in runs if r.ruler is not None and r.metric is not None)
    )
    others = [r for r in runs if r.other_ruler]
    if others:
        sweep = next(r.ruler for r in runs if r.ruler is not None and not r.other_ruler)
        names = ", ".join(f"{code(r.name)} ({r.ruler})" for r in others)
        notes.append(
            f"Not ranked: {names} measured {code(metric)} with another ruler (feature network / "
            f"val split sha256) than the other runs ({sweep}); values from different rulers "
            "are not comparable. Keep `data.split_seed`, `featurenet.*` and the data the same "
            "across a sweep."
        )
    elif len(rulers) == 1:
        notes.append(
            f"Every run was measured with one ruler (feature network / val split: {rulers[0]})."
        )
    unknown = [f"{code(r.name)}" for r in runs if r.metric is not None and r.ruler is None]
    if unknown and rulers:
        notes.append(
            f"{', '.join(unknown)} record no ruler (evaluated before rulers were recorded): "
            "they are ranked, but their scale cannot be checked."
        )
    finished = [r for r in runs if r.state == "success"]
    if finished and all(r.metric is None for r in finished):
        notes.append(
            f"No finished run has the metric {code(metric)} in its DVC metrics (is the stage that "
            "writes it in dvc.yaml?); runs are listed unranked."
        )
    elif any(r.metric is None for r in finished):
        missing = ", ".join(f"{code(r.name)}" for r in finished if r.metric is None)
        notes.append(f"{code(metric)} is missing in {missing}.")
    if finished and not any("step_ms" in r.perf for r in finished):
        notes.append(
            "`perf.step_ms` is not in the training metrics; the step cost is shown as "
            "images/s (`perf.images_per_s`) instead."
        )
    if finished and not any("peak_memory_mb" in r.perf for r in finished):
        notes.append("`perf.peak_memory_mb` is not in the training metrics; no memory column.")
    for run in runs:
        if run.state != "success":
            reason = f": {code(run.error)}" if run.error else ""
            notes.append(f"{code(run.name)} {run.state}{reason}")
    return notes


def draw_plot(
    path: Path,
    groups: Sequence[Group],
    panels: Sequence[tuple[str, str]],
) -> Path:
    """A PNG with one dot plot per panel: each group's runs as dots, its mean as a bar.

    Args:
        path: Where to write the PNG.
        groups: Rows of every panel, in this order (best first).
        panels: ``(attribute, title)``: ``"metric"`` or a perf key of :data:`PERF_KEYS`.
    """
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=14)
    labels = [" + ".join(str(v) for v in g.settings.values()) or "all runs" for g in groups]
    label_w = 20 + max(int(font.getlength(t)) for t in labels)
    plot_w, row_h, top, bottom = 420, 26, 34, 34
    panel_h = top + row_h * len(groups) + bottom
    image = Image.new("RGB", (label_w + plot_w + 40, panel_h * len(panels)), "white")
    draw = ImageDraw.Draw(image)
    for p, (attr, title) in enumerate(panels):
        y0 = p * panel_h
        values = [v for g in groups for v in g.values(attr)]
        caption = f"{title}   (dots: runs, bar: mean)" if p == 0 else title
        draw.text((10, y0 + 8), caption, fill="black", font=font)
        if not values:
            draw.text((label_w, y0 + top), "no values", fill="gray", font=font)
            continue
        lo, hi = min(values), max(values)
        pad = (hi - lo) * 0.1 or abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad

        def x_of(v: float, lo=lo, hi=hi) -> float:
            return label_w + (v - lo) / (hi - lo) * plot_w

        axis_y = y0 + top + row_h * len(groups) + 4
        draw.line([(label_w, axis_y), (label_w + plot_w, axis_y)], fill="black")
        for i in range(5):
            v = lo + (hi - lo) * i / 4
            draw.line([(x_of(v), axis_y), (x_of(v), axis_y + 4)], fill="black")
            text = _fmt(v, 3)
            x_text = x_of(v) - font.getlength(text) / 2
            draw.text((x_text, axis_y + 6), text, fill="black", font=font)
        for row, (group, label) in enumerate(zip(groups, labels, strict=True)):
            yc = y0 + top + row_h * row + row_h // 2
            draw.text((10, yc - 8), label, fill="black", font=font)
            draw.line([(label_w, yc), (label_w + plot_w, yc)], fill=(230, 230, 230))
            mean = group.mean(attr)
            if mean is not None:
                bar = [x_of(mean) - 2, yc - 9, x_of(mean) + 2, yc + 9]
                draw.rectangle(bar, fill=(200, 60, 40))
            for v in group.values(attr):
                dot = [x_of(v) - 4, yc - 4, x_of(v) + 4, yc + 4]
                draw.ellipse(dot, outline=(30, 80, 160), width=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


# -- the tables a run and a sweep publish (Prefect artifacts) -----------------------------


def run_rows(
    files: Mapping[str, Mapping[str, Any]],
    params: Mapping[str, Any],
    overrides: Mapping[str, Any],
    ran_on: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """A pipeline run's ``pipeline-metrics`` table: every metric (by file), every param
    (overridden ones marked) and where the run ran, one row each."""
    rows = [
        {"kind": "metric", "source": source, "key": key, "value": value}
        for source, data in files.items()
        for key, value in flatten(data).items()
    ]
    rows += [
        {
            "kind": "param (override)" if key in overrides else "param",
            "source": "params.yaml",
            "key": key,
            "value": json.dumps(value) if isinstance(value, list) else value,
        }
        for key, value in flatten(params).items()
    ]
    return rows + [
        {"kind": "run", "source": "environment", "key": key, "value": value}
        for key, value in ran_on.items()
    ]


def read_run_rows(rows: Sequence[Mapping[str, Any]]) -> tuple[dict[str, dict], dict[str, Any]]:
    """(metrics by file, where it ran) of a ``pipeline-metrics`` table (:func:`run_rows`)."""
    metrics: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["kind"] == "metric":
            metrics.setdefault(row["source"], {})[row["key"]] = row["value"]
    return metrics, {row["key"]: row["value"] for row in rows if row["kind"] == "run"}


def run_markdown(record: Mapping[str, Any]) -> str:
    """The markdown artifact of one pipeline run (callers' strings only inside code)."""
    exp = record["experiment"]
    lines = [
        "# ganpipe pipeline run",
        "",
        f"- DVC experiment: **{exp}** on commit `{record['commit'][:7]}` "
        f"(`dvc exp show`, `dvc exp apply {exp}` in the project)",
        "- ran on: " + ", ".join(f"{k} {code(v)}" for k, v in record["ran_on"].items()),
        "- stages: " + ", ".join(f"{name} ({how})" for name, how in record["stages"].items()),
    ]
    if record["overrides"]:
        lines.append(f"- overrides: {code(json.dumps(record['overrides']))}")
    lines += ["", "| metric | value |", "|---|---:|"]
    for key, value in record["metrics"].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            lines.append(f"| {code(key)} | {float(value):.6g} |")
    return "\n".join(lines)


def sweep_rows(
    runs: Sequence[Run],
    found: Mapping[str, Mapping[str, Any]],
    metric: str,
    higher_is_better: bool,
) -> list[dict[str, Any]]:
    """The ``sweep-ranking`` table: the runs ranked, with their settings, measurements,
    state, where and when they ran, and their error."""
    perf = [k for k in PERF_KEYS if any(k in r.perf for r in runs)]
    table = []
    for i, r in enumerate(rank_runs(runs, higher_is_better), 1):
        exp = found.get(r.name, {})
        ran_on = exp.get("ran_on") or {}
        table.append(
            {
                "rank": i,
                "experiment": r.name,
                **r.settings,
                metric: r.metric,
                **{PERF_TITLES[k]: r.perf.get(k) for k in perf},
                "state": r.state,
                **{k: ran_on.get(k) for k in ("worker", "host", "cuda_visible_devices")},
                **{k: exp.get(k) for k in ("started", "ended")},
                "error": r.error,
            }
        )
    return table


def write_sweep_report(
    md_path: Path,
    planned: Mapping[str, Mapping[str, Any]],
    found: Mapping[str, Mapping[str, Any]],
    metric: str,
    higher_is_better: bool,
    context: Mapping[str, Any],
) -> tuple[str, list[dict[str, Any]]]:
    """Write the sweep report ``md_path`` (markdown), its plot (``.png``) and its ranking
    (``.json``); return the markdown and the ranking table."""
    runs = collect_runs(planned, found, metric)
    keys = list(next(iter(planned.values())))
    group_keys = [k for k in keys if k not in REPEAT_KEYS]
    groups = group_runs(runs, group_keys, higher_is_better)
    panels = [("metric", f"{metric} ({'higher' if higher_is_better else 'lower'} is better)")]
    panels += [(k, PERF_TITLES[k]) for k in PERF_KEYS if any(k in r.perf for r in runs)]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    png_path = draw_plot(md_path.with_suffix(".png"), groups, panels)
    title = "Which update strategy? Sweep report" if "train.strategy" in keys else "Sweep report"
    markdown = render_markdown(
        title, runs, group_keys, metric, higher_is_better, context, png_path.name
    )
    write_bytes_atomic(markdown.encode(), md_path)
    table = sweep_rows(runs, found, metric, higher_is_better)
    record = {"context": context, "metric": metric, "runs": table}
    write_bytes_atomic((json.dumps(record, indent=2) + "\n").encode(), md_path.with_suffix(".json"))
    return markdown, table
