"""The plots page template and the pinned vega bundles agree with reports/build.py."""

from __future__ import annotations

import json
import re

from reports.build import BUNDLES, TEMPLATE
from tests.helpers import REPO


def test_template_loads_the_copied_bundles_in_order_and_nothing_remote():
    page = TEMPLATE.read_text()
    assert re.findall(r'<script src="([^"]+)"', page) == [f"vendor/{name}" for name in BUNDLES]
    assert page.count("{plot_divs}") == 1 and page.count("{refresh_tag}") == 1
    assert "{scripts}" not in page  # dvc_render would put its CDN script tags there
    assert not re.search(r'(src|href)="(https?:)?//', page)


def test_package_pins_exact_versions_that_the_lock_file_holds():
    wanted = json.loads((REPO / "reports/package.json").read_text())["dependencies"]
    locked = json.loads((REPO / "reports/package-lock.json").read_text())["packages"]
    assert set(wanted) == {path.split("/")[0] for path in BUNDLES.values()}
    for name, version in wanted.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"{name}: pin an exact version"
        assert locked[f"node_modules/{name}"]["version"] == version
        assert locked[""]["dependencies"][name] == version
