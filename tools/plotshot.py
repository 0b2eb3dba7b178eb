"""Save one plot of the plots page as a PNG, for the docs (the README's FID curve).

Inputs: ``reports/plots/index.html`` as ``make report`` (``python -m reports.build``) left it;
Debian's Chromium (``/usr/bin/chromium``, as tests/e2e/test_report.py uses it), driven by
Playwright, offline. Outputs: the PNG of the plot whose id (the name of its group in
dvc.yaml's top-level ``plots``) is given.
Command: ``python -m tools.plotshot fid docs/fid-curve.png`` (after ``make repro``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGE = Path("reports/plots/index.html")
CHROMIUM = Path("/usr/bin/chromium")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plot", help="a group of dvc.yaml's top-level plots, e.g. fid")
    parser.add_argument("out", type=Path, help="the PNG to write")
    args = parser.parse_args()
    for needed, fix in ((PAGE, "run `make report`"), (CHROMIUM, "apt-get install chromium")):
        if not needed.exists():
            sys.exit(f"error: {needed} is missing; {fix}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
        page.goto(PAGE.resolve().as_uri(), wait_until="load")
        page.evaluate("() => Promise.all(window.__ganpipeEmbeds || []).then(() => null)")
        plot = page.locator(f"#{args.plot}")
        if plot.count() == 0:
            sys.exit(f"error: {PAGE} has no plot {args.plot!r} (no data for it in this run?)")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plot.screenshot(path=str(args.out))
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
