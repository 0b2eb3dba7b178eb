"""The plots page template and the pinned vega bundles agree with reports/build.py."""

from __future__ import annotations

import json
import re

import yaml

from reports.build import BUNDLES, TEMPLATE, groups_without_data, plot_targets
from tests.helpers import REPO

MEASURED = {"throughput", "step_time", "peak_memory"}


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


def test_every_curve_group_has_a_title_axis_labels_and_the_line_template():
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())
    groups = [next(iter(entry.items())) for entry in spec["plots"]]
    assert [name for name, _ in groups] == [
        "losses",
        "fid",
        "kid",
        "d_outputs",
        "d_real_sign",
        "augment_p",
        "grad_norms",
        "throughput",
        "step_time",
        "peak_memory",
        "learning_rates",
    ]
    for name, props in groups:
        assert props["template"] == "reports/line_template.json", name
        assert props["title"] and props["y_label"] and props["x_label"] == "images seen", name
        # the measured curves live outside the stage's outputs (not in dvc.lock)
        folder = "measurements" if name in MEASURED else "metrics"
        assert props["x"] == "step" and all(
            path.startswith(f"{folder}/train/plots/metrics/") for path in props["y"]
        ), name
    template = (REPO / "reports/line_template.json").read_text()
    for anchor in ("DATA", "TITLE", "X", "Y", "X_LABEL", "Y_LABEL", "TOOLTIP"):
        assert f'"<DVC_METRIC_{anchor}>"' in template
    assert "'.1e'" in json.loads(template)["encoding"]["y"]["axis"]["labelExpr"]


def test_page_targets_are_the_groups_and_images_not_the_curve_folder(tmp_path):
    curves = tmp_path / "metrics/train/plots/metrics"
    for name in ("loss/d.tsv", "loss/g.tsv", "kimg.tsv", "amp/scale/g.tsv"):
        (curves / name).parent.mkdir(parents=True, exist_ok=True)
        (curves / name).write_text("step\tv\n1\t2\n")
    (tmp_path / "dvc.yaml").write_text(
        yaml.safe_dump(
            {
                "stages": {
                    "train": {
                        "cmd": "true",
                        "plots": [
                            {"metrics/train/plots/metrics": {"x": "step"}},
                            "metrics/train/plots/images",
                        ],
                    },
                    "generate": {"cmd": "true", "plots": ["samples/grid.png"]},
                },
                "plots": [
                    {
                        "losses": {
                            "y": {
                                "metrics/train/plots/metrics/loss/d.tsv": "d",
                                "metrics/train/plots/metrics/loss/g.tsv": "g",
                            }
                        }
                    },
                    {"throughput": {"y": {"measurements/train/plots/metrics/perf/x.tsv": "x"}}},
                ],
            },
            sort_keys=False,
        )
    )

    assert groups_without_data(tmp_path) == ["throughput"]  # a clone has measured nothing
    assert plot_targets(tmp_path) == [
        "losses$",
        "metrics/train/plots/metrics/amp/scale/g.tsv",  # no group draws it: shown on its own
        "metrics/train/plots/images$",
        "samples/grid.png$",
    ]
