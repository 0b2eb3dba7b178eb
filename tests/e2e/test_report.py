"""The offline plots page (`python -m reports.build`) opened in headless Debian Chromium.

A temporary clone runs the real `dvc repro` with tiny params; the page is opened from
file:// with every http(s) request blocked, as on a machine without internet.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from reports.build import BUNDLES, ReportError, build_report
from tests.e2e.test_dvc_pipeline import TINY
from tests.helpers import REPO, clone_working_tree, sh

pytestmark = pytest.mark.slow

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
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.fail(
            f"{CHROMIUM} is missing and this test cannot install it (needs apt-get as root): "
            "install Debian's `chromium` package"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=300", "chromium"],
    ):
        result = subprocess.run(args, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(
                f"`{' '.join(args)}` failed ({result.returncode}); install Debian's `chromium` "
                f"package by hand:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
            )
    assert CHROMIUM.exists(), f"apt-get installed chromium but {CHROMIUM} is missing"
    return CHROMIUM


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A clone after a real `dvc repro`, using this checkout's installed vega bundles."""
    node_modules = REPO / "reports/node_modules"
    if not node_modules.is_dir():
        pytest.fail(f"{node_modules} is missing: run `make setup` (it runs `npm ci` there)")
    root = clone_working_tree(tmp_path_factory.mktemp("report") / "clone", TINY)
    (root / "reports/node_modules").symlink_to(node_modules)
    sh(["dvc", "repro"], root)
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
    images = page.evaluate(
        """() => Array.from(document.images).map((img) => [
            img.getAttribute("src"), img.complete, img.naturalWidth, img.naturalHeight])"""
    )
    for src, complete, width, _ in images:
        if not complete or width == 0:
            problems.append(f"image {src} did not load")
    visited = Visit(
        steps=steps,
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


def logged_steps(project: Path) -> dict[str, list[float]]:
    """Plot div id (as dvc_render names it) -> the steps in that curve's .tsv file."""
    found = {}
    for tsv in sorted((project / "metrics/train/plots/metrics").rglob("*.tsv")):
        name = tsv.relative_to(project).as_posix()
        rows = list(csv.DictReader(io.StringIO(tsv.read_text()), delimiter="\t"))
        found[re.sub(r"[/.]", "_", name)] = [float(row["step"]) for row in rows]
    return found


def test_page_renders_every_plot_and_image_offline(project, browser):
    page_file = build_report(project)
    assert page_file == project / "reports/plots/index.html"
    assert sorted(p.name for p in (page_file.parent / "vendor").iterdir()) == sorted(BUNDLES)

    shown = visit(browser, page_file)

    assert shown.problems == []
    expected = logged_steps(project)
    assert len(expected) >= 9 and "metrics_train_plots_metrics_loss_g_tsv" in expected
    assert all(steps == [32, 64, 96, 128] for steps in expected.values()), expected
    assert shown.steps == expected
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
