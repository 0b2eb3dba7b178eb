"""report: the training curves, progress grids and samples in one HTML page that works offline.

Inputs: the plots of dvc.yaml as the last `dvc repro` left them (``metrics/train/plots/``,
the measured curves in ``measurements/train/``, ``samples/grid.png``): the curves as
dvc.yaml's top-level ``plots`` group and label them (template
``reports/line_template.json``; a group without data here is left out), the images as the
stages declare them;
``reports/template.html``; the vega, vega-lite and vega-embed bundles
in ``reports/node_modules`` (``npm ci`` from ``reports/package-lock.json``, run by
``make setup``).
Outputs: ``reports/plots/``: ``index.html``, ``static/`` (the images, copied by DVC) and
``vendor/`` (the three bundles), so the folder opens offline from anywhere. It is built in a
temporary folder beside it (``.plots.tmp-<pid>``) and swapped in whole: a failure never
leaves a half page. A build holds a lock on the folder around ``plots/`` (a second build
fails at once, naming the pid of the first) and first deletes what a killed build left there.
Command: ``python -m reports.build`` (``make report``; ``make repro`` ends with it)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from ganpipe.files import TMP_MARK, OutputsBusyError, clear_leftovers, locked_dir, replace_dir

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "template.html"
NODE_MODULES = HERE / "node_modules"
OUT = Path("reports/plots")

#: File name under the page's ``vendor/`` -> its path in node_modules, in loading order
#: (vega-lite and vega-embed expect the globals of the ones before them).
BUNDLES = {
    "vega.min.js": "vega/build/vega.min.js",
    "vega-lite.min.js": "vega-lite/build/vega-lite.min.js",
    "vega-embed.min.js": "vega-embed/build/vega-embed.min.js",
}


#: Curves a stage logs that the page leaves out: ``kimg`` is the x axis (images seen) / 1000.
LEFT_OUT = {"kimg.tsv"}


class ReportError(Exception):
    """A report that cannot be built, with the reason and the fix."""


def _paths(entries: list) -> list[str]:
    """The paths of a dvc.yaml ``plots`` list (plain strings or one-key mappings)."""
    return [next(iter(e)) if isinstance(e, dict) else str(e) for e in entries or []]


def plot_targets(repo: Path) -> list[str]:
    """What the page shows, as ``dvc plots show`` targets (regexes matched against plot ids).

    Every top-level plot of dvc.yaml (the grouped, labelled curves); every stage plot none of
    them draws from (the images); and any curve file inside a stage plot folder that no
    top-level plot names (e.g. ``amp/*`` in fp16 runs), shown on its own, except ``LEFT_OUT``.
    A stage's curve folder is left out as a whole otherwise: DVC would draw each of its files
    again, titled by its path.
    """
    spec = yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8")) or {}
    top = top_level_plots(spec)
    drawn = {os.path.normpath(f) for y in top.values() if isinstance(y, dict) for f in y}
    # Targets are regexes, but DVC normalises them as paths first (a backslash breaks them):
    # "$" anchors them; an unescaped "." matching any character is harmless here.
    missing = set(groups_without_data(repo))
    targets = [f"{name}$" for name in top if name not in missing]
    for stage in (spec.get("stages") or {}).values():
        for path in _paths(stage.get("plots")):
            inside = sorted(f for f in drawn if f.startswith(os.path.normpath(path) + os.sep))
            if not inside and os.path.normpath(path) not in drawn:
                targets.append(f"{path}$")
                continue
            folder = repo / path
            for curve in sorted(folder.rglob("*.tsv")) if folder.is_dir() else []:
                relative = curve.relative_to(repo).as_posix()
                if os.path.normpath(relative) not in drawn and curve.name not in LEFT_OUT:
                    targets.append(relative)  # DVC reads a target that is a file as-is
    return targets


def top_level_plots(spec: dict) -> dict[str, object]:
    """Name -> ``y`` (file -> column, or None) of the top-level plots of a dvc.yaml."""
    top = {}
    for entry in spec.get("plots") or []:
        name, props = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        top[name] = (props or {}).get("y") if isinstance(props, dict) else None
    return top


def groups_without_data(repo: Path) -> list[str]:
    """Top-level plots none of whose files exist here, which the page leaves out.

    The measured curves (``measurements/``: throughput, step time, memory) are no stage's
    output: a clone, or a train stage restored from DVC's cache, has measured nothing. Some
    curves are logged by some runs only (``augment/p``: with ``train.augment``).
    """
    return [
        name
        for name, y in plots_of(repo).items()
        if isinstance(y, dict) and not any((repo / path).is_file() for path in y)
    ]


def plots_of(repo: Path) -> dict[str, object]:
    """:func:`top_level_plots` of the project's dvc.yaml."""
    return top_level_plots(yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8")) or {})


def find_bundles(node_modules: Path) -> dict[str, Path]:
    """The three bundles' paths, or a ReportError naming the first missing one."""
    bundles = {name: node_modules / relative for name, relative in BUNDLES.items()}
    for path in bundles.values():
        if not path.is_file():
            raise ReportError(
                f"{path} is missing: install the vega bundles with `make setup` "
                "(it runs `npm ci` in reports/)"
            )
    return bundles


def render_plots(repo: Path, template: Path, out: Path) -> Path:
    """Run ``dvc plots show`` in ``repo`` with ``template``; return the written page."""
    command = [sys.executable, "-m", "dvc", "plots", "show", "--html-template", template]
    result = subprocess.run(
        [*command, "-o", out, "-x", "step", *plot_targets(repo)],
        cwd=repo,
        env={**os.environ, "DVC_NO_ANALYTICS": "1"},
        capture_output=True,
        text=True,
    )
    output = (result.stdout + result.stderr).strip()
    page = out / "index.html"
    if result.returncode != 0 or not page.is_file():
        raise ReportError(f"`dvc plots show` wrote no page (run `dvc repro` first?):\n{output}")
    if "failed to load" in output:
        # DVC still writes the page, without the plots it could not read.
        raise ReportError(
            f"`dvc plots show` could not read every plot (run `dvc repro` first?):\n{output}"
        )
    return page


def is_plots_page(folder: Path) -> bool:
    """Whether ``folder`` looks like this module's output (so replacing it loses nothing)."""
    return (folder / "index.html").is_file() and all(
        (folder / "vendor" / name).is_file() for name in BUNDLES
    )


def clear_build_leftovers(out: Path) -> list[Path]:
    """Delete what killed builds of ``out`` left beside it; call under the build's lock.

    Those are ``.NAME.tmp-*`` / ``.NAME.old-*`` (:func:`ganpipe.files.clear_leftovers`) and,
    from builds before the staging folder had that name, tempfile's ``.NAME.XXXXXXXX``.
    """
    removed = clear_leftovers(out.parent, [out.name])
    tempfile_name = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}")
    for stale in sorted(out.parent.glob(f".{out.name}.*")):
        if tempfile_name.fullmatch(stale.name) and stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def build_report(
    repo: Path = Path("."),
    out: Path = OUT,
    node_modules: Path = NODE_MODULES,
    template: Path = TEMPLATE,
) -> Path:
    """Build the plots page of ``repo`` into ``out`` (relative to ``repo``); return its path.

    Raises:
        ReportError: the bundles are missing, ``out`` holds something else than an earlier
            page, or DVC wrote no page or missed plots.
        OutputsBusyError: another build of a page in the same folder is running.
    """
    out = (repo / out).resolve()
    with locked_dir(out.parent, "reports.build"):
        clear_build_leftovers(out)
        bundles = find_bundles(node_modules)
        if out.exists() and any(out.iterdir()) and not is_plots_page(out):
            raise ReportError(
                f"refusing to replace {out}: it is not a plots page built by reports.build "
                "(no index.html and vendor/); choose a new or empty folder"
            )
        tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}"
        tmp.mkdir()
        try:
            staging = tmp / "new"
            render_plots(repo, template.resolve(), staging)
            (staging / "vendor").mkdir()
            for name, path in bundles.items():
                shutil.copyfile(path, staging / "vendor" / name)
            replace_dir(staging, out)  # an atomic exchange; the old page is deleted after
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out / "index.html"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default: {OUT})")
    parser.add_argument(
        "--node-modules",
        type=Path,
        default=NODE_MODULES,
        help="where `npm ci` put the vega bundles (default: reports/node_modules)",
    )
    args = parser.parse_args()
    try:
        page = build_report(out=args.out, node_modules=args.node_modules)
    except (ReportError, OutputsBusyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    left_out = groups_without_data(Path("."))
    top = plots_of(Path("."))
    measured = [g for g in left_out if all(f.startswith("measurements/") for f in top[g])]
    if measured:
        print(
            f"note: no data for {', '.join(measured)} (measured by a train run on this "
            "machine, see measurements/; a stage restored from DVC's cache measures nothing)",
            file=sys.stderr,
        )
    if unlogged := [g for g in left_out if g not in measured]:
        print(
            f"note: no data for {', '.join(unlogged)} (the last train run logged none: "
            "augment_p needs train.augment)",
            file=sys.stderr,
        )
    print(f"plots page: {page.as_uri()}")


if __name__ == "__main__":
    main()
