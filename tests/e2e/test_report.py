"""The offline plots page (`python -m reports.build`) opened in headless Debian Chromium.

A copy of the e2e tests' reproduced clone (tiny params) runs the real `dvc repro` again with
augmentation; the page is opened from
file:// with every http(s) request blocked, as on a machine without internet. The curves are
dvc.yaml's top-level plots: each must show its title, its axis labels and readable numbers.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from reports.build import BUNDLES, LEFT_OUT, ReportError, build_report
from tests.e2e.conftest import copy_project
from tests.helpers import REPO, debian_program, sh

# One worker builds the project and starts the browser once (module fixtures).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("report")]

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps dialling out of this closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's Chromium, installed with apt-get (as root) when it is missing."""
    return debian_program(str(CHROMIUM), "chromium")


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_baseline) -> Path:
    """A copy of the reproduced TINY project after a real `dvc repro` with ADA (its data and
    feature network the baseline's: only training and what follows run again), using this
    checkout's installed vega bundles."""
    node_modules = REPO / "reports/node_modules"
    if not node_modules.is_dir():
        pytest.fail(f"{node_modules} is missing: run `make setup` (it runs `npm ci` there)")
    root = copy_project(tiny_baseline, tmp_path_factory.mktemp("report") / "clone")
    # augmented with ADA, so that the strength p is logged and drawn too
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"].update(augment="translation", augment_target=0.6, augment_speed_kimg=1)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "reports/node_modules").symlink_to(node_modules)
    ran = sh(["dvc", "repro"], root).stdout
    assert "Running stage 'train'" in ran and "Running stage 'prepare'" not in ran, ran
    return root


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


# DVC's line template has a hover layer that filters on an empty selection until the mouse
# moves; vega warns that the extent of that empty data is infinite, once per field and plot.
BENIGN = re.compile(r'^WARN Infinite extent for field "[^"]+": \[Infinity, -Infinity\]$')


@dataclass
class Visit:
    """What a page showed: vega views' data, images, a screenshot, and everything that failed."""

    steps: dict[str, list[float]]  # plot div id -> the `step` of every row of its view
    texts: dict[str, dict]  # plot div id -> {"title": [...], "axes": [{"title", "labels"}]}
    images: dict[str, tuple[int, int]]  # file name -> natural size, for the loaded images
    screenshot: Image.Image
    plot_shots: dict[str, Image.Image]  # plot div id -> screenshot of that plot
    problems: list[str] = field(default_factory=list)


def visit(browser, page_file: Path) -> Visit:
    """Open ``page_file`` offline, wait for every vegaEmbed, and collect what rendered."""
    problems = []
    context = browser.new_context(viewport={"width": 1280, "height": 1000})

    def block(route):
        problems.append(f"blocked request {route.request.url}")
        route.abort()

    context.route(re.compile(r"^(https?|wss?)://"), block)
    page = context.new_page()

    def console(message):
        if message.type in ("error", "warning") and not BENIGN.search(message.text):
            problems.append(f"console {message.type}: {message.text}")

    page.on("console", console)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed request {r.url}: {r.failure}"))
    page.goto(page_file.as_uri(), wait_until="load")
    page.evaluate("() => Promise.all(window.__ganpipeEmbeds || []).then(() => null)")
    steps = page.evaluate(
        """() => Object.fromEntries(Object.entries(window.__ganpipeViews || {}).map(
            ([id, view]) => [id, view.data("source_0").map((row) => Number(row.step))]))"""
    )
    # What each view drew, read from vega's scenegraph: title and, per axis, title and labels.
    texts = page.evaluate(
        """() => Object.fromEntries(Object.entries(window.__ganpipeViews || {}).map(
            ([id, view]) => {
            const found = {title: [], axes: []};
            const collect = (mark, role, out) => {
                for (const item of mark.items || []) {
                    if (mark.role === role && item.text !== undefined) out.push(String(item.text));
                    for (const child of item.items || []) collect(child, role, out);
                }
            };
            const walk = (mark) => {
                for (const item of mark.items || []) {
                    if (mark.role === "axis") {
                        const axis = {title: [], labels: []};
                        for (const child of item.items || []) {
                            collect(child, "axis-title", axis.title);
                            collect(child, "axis-label", axis.labels);
                        }
                        found.axes.push({title: axis.title.join(" "), labels: axis.labels});
                        continue;
                    }
                    if (mark.role === "title-text" && item.text !== undefined) {
                        found.title.push(String(item.text));
                    }
                    for (const child of item.items || []) walk(child);
                }
            };
            walk(view.scenegraph().root);
            return [id, found];
        }))"""
    )
    images = page.evaluate(
        """() => Array.from(document.images).map((img) => [
            img.getAttribute("src"), img.complete, img.naturalWidth, img.naturalHeight])"""
    )
    for src, complete, width, _ in images:
        if not complete or width == 0:
            problems.append(f"image {src} did not load")
    visited = Visit(
        steps=steps,
        texts=texts,
        images={Path(src).name: (w, h) for src, complete, w, h in images if complete and w},
        screenshot=Image.open(io.BytesIO(page.screenshot(full_page=True))),
        plot_shots={
            id_: Image.open(io.BytesIO(page.locator(f"#{id_}").screenshot())) for id_ in steps
        },
        problems=problems,
    )
    context.close()
    return visited


def spread(image: Image.Image) -> float:
    """Standard deviation of the grey levels: 0 for a blank (one-colour) picture."""
    return float(np.asarray(image.convert("L"), dtype=np.float64).std())


def read_curve(tsv: Path, field: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of one logged curve."""
    rows = list(csv.DictReader(io.StringIO(tsv.read_text()), delimiter="\t"))
    return [float(row["step"]) for row in rows], [float(row[field]) for row in rows]


@dataclass
class Curves:
    """One top-level plot of dvc.yaml, with the data of the files it draws."""

    title: str
    x_label: str
    y_label: str
    steps: list[float]
    values: list[float]


def plotted_curves(project: Path) -> tuple[dict[str, Curves], set[str]]:
    """dvc.yaml's top-level plots (by id, which is the page's div id), and the files they draw."""
    spec = yaml.safe_load((project / "dvc.yaml").read_text())
    curves, drawn = {}, set()
    for entry in spec["plots"]:
        ((name, props),) = entry.items()
        steps, values = [], []
        for tsv, column in props["y"].items():
            more_steps, more_values = read_curve(project / tsv, column)
            steps, values = steps + more_steps, values + more_values
            drawn.add(tsv)
        curves[name] = Curves(props["title"], props["x_label"], props["y_label"], steps, values)
    return curves, drawn


def number(label: str) -> float:
    """An axis label as a number: ``2.0e-4``, ``0.5``, ``1200``, ``20k`` (SI)."""
    prefixes = {"µ": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    if label and label[-1] in prefixes:
        return float(label[:-1].replace("−", "-")) * prefixes[label[-1]]
    return float(label.replace("−", "-"))


def test_page_renders_every_plot_and_image_offline(project, browser):
    page_file = build_report(project)
    assert page_file == project / "reports/plots/index.html"
    assert sorted(p.name for p in (page_file.parent / "vendor").iterdir()) == sorted(BUNDLES)

    shown = visit(browser, page_file)

    assert shown.problems == []
    curves, drawn = plotted_curves(project)
    logged = {
        p.relative_to(project).as_posix()
        for folder in ("metrics", "measurements")  # computed, and measured (not in dvc.lock)
        for p in (project / folder / "train/plots/metrics").rglob("*.tsv")
        if p.name not in LEFT_OUT
    }
    assert len(logged) >= 11 and drawn == logged  # every logged curve is in a group
    # one view per group, no curve drawn again on its own; rows: each file's steps in turn
    assert {id_: sorted(steps) for id_, steps in shown.steps.items()} == {
        id_: sorted(c.steps) for id_, c in curves.items()
    }
    # logged every 0.032 kimg, FID and KID measured every 0.064 kimg (TINY)
    for id_, curve in curves.items():
        assert set(curve.steps) == ({64, 128} if id_ in ("fid", "kid") else {32, 64, 96, 128})
    for id_, curve in curves.items():
        texts = shown.texts[id_]
        assert texts["title"] == [curve.title], id_
        (x_axis,) = [a for a in texts["axes"] if a["title"] == curve.x_label]
        (y_axis,) = [a for a in texts["axes"] if a["title"] == curve.y_label]
        assert [number(label) for label in x_axis["labels"]] == sorted(
            number(label) for label in x_axis["labels"]
        )
        # The y labels must reach the data: a 2e-4 learning rate labelled "0" does not.
        shown_values = [number(label) for label in y_axis["labels"]]
        assert shown_values, f"{id_}: no y labels"
        low, high = min(curve.values), max(curve.values)
        assert min(shown_values) <= high and max(shown_values) >= low, (id_, y_axis, low, high)
        if low > 0 or high < 0:
            assert any(v != 0 for v in shown_values), f"{id_}: axis reads 0 for {low}..{high}"
    lr_axis = [a for a in shown.texts["learning_rates"]["axes"] if a["title"] == "learning rate"]
    assert lr_axis[0]["labels"] == ["2.0e-4"]  # the constant 2e-4 of the tiny run
    on_disk = {p.name: Image.open(p).size for p in (page_file.parent / "static").iterdir()}
    progress = list((project / "metrics/train/plots/images/progress").glob("*.png"))
    # progress grids at 64 and 128 images, the sample grid and the interpolation strips
    assert len(on_disk) == len(progress) + 2 == 4
    assert shown.images == on_disk
    for name in ("grid", "interpolation"):
        assert shown.images[f"workspace_samples_{name}.png"] == (
            Image.open(project / f"samples/{name}.png").size
        )
    assert spread(shown.screenshot) > 10
    for id_, shot in shown.plot_shots.items():
        assert spread(shot) > 10, f"plot {id_} looks blank"


def test_dvc_default_page_shows_no_plots_offline(project, browser):
    """The same checks notice missing vega: DVC's own page loads it from a CDN."""
    sh(["dvc", "plots", "show", "-o", "default_plots"], project)

    shown = visit(browser, project / "default_plots/index.html")

    assert shown.steps == {}
    assert any("blocked request https://cdn.jsdelivr.net/npm/vega@" in p for p in shown.problems)
    assert any("vegaEmbed is not defined" in p for p in shown.problems), shown.problems
    assert len(shown.images) == 4  # the images are local files and still load


def test_failed_build_keeps_the_previous_page(project, tmp_path):
    page_file = build_report(project)
    before = page_file.read_bytes()
    bad_template = tmp_path / "template.html"
    bad_template.write_text("<html><body>no plots placeholder</body></html>")

    with pytest.raises(ReportError, match="plot_divs"):
        build_report(project, template=bad_template)
    with pytest.raises(ReportError, match="make setup"):
        build_report(project, node_modules=tmp_path / "node_modules")
    with pytest.raises(ReportError, match="refusing to replace"):
        build_report(project, out=Path("samples"))  # a folder that is not a plots page
    assert (project / "samples/grid.png").is_file()

    assert page_file.read_bytes() == before
    assert sorted(p.name for p in (project / "reports").iterdir() if p.name.startswith(".")) == []


def test_command_line_reports_missing_bundles(project, tmp_path):
    result = sh(
        ["python", "-m", "reports.build", "--node-modules", str(tmp_path), "--out", "elsewhere"],
        project,
        check=False,
    )
    assert result.returncode == 2
    assert "vega.min.js is missing" in result.stderr and "make setup" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (project / "elsewhere").exists()
