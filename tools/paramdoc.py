"""docs/parameters.md, generated from the params schema so that it cannot drift.

Inputs: ``ganpipe.params`` (the pydantic models: types, choices, defaults, ranges and the
docstring under every field).
Outputs: the Markdown page on stdout, or written to docs/parameters.md with ``--write``.
Command: ``python -m tools.paramdoc --write`` (``make docs``); ``tests/unit/test_docs.py``
fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ganpipe.params import (
    MAX_PARAMS_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    Params,
    ParamsError,
    parse_params,
)
from tools.doclinks import slug

PAGE = Path(__file__).resolve().parents[1] / "docs" / "parameters.md"
COMMAND = "python -m tools.paramdoc --write"

HEADER = """\
# Parameters

<!-- Generated from src/ganpipe/params.py by `{command}` (`make docs`).
Do not edit by hand: tests/unit/test_docs.py fails when this page is stale. -->

Set parameters in `params.yaml`, or for one experiment on the command line:

```bash
dvc exp run -S train.strategy=g_first_detach -S precision=bf16
```

Every stage validates the whole of `params.yaml` before doing anything, so a bad value stops
the run at once. Unknown keys, wrong types, out-of-range values and incompatible combinations
are reported together, each with its dotted key and the fix:

```
$ dvc exp run -S data.image_size=48 -S train.batch_size=0 -S train.strategy=both
error: {example_error}
```

A misspelt key gets a suggestion: `{typo_error}`.

Types are strict: a quoted number (`image_size: "32"`), a float for an integer (`seed: 2.0`)
or a word for a boolean (`activation_checkpointing: "yes"`) is an error, not a silent
conversion. What YAML and `dvc exp run -S` write stays valid: an integer for a float
(`train.kimg: 5`), a list for `train.betas`, `null` for an optional value, `all` or a list of
integers for `devices.gpus`. params.yaml is read as DVC reads it (YAML 1.2, ruamel's safe
loader): `lr_g: 1e-3` is a number, `yes` / `no` are words (write `true` / `false`), and a key
given twice is an error. Overrides given to the Prefect flows follow the same rules.

The **default** column is the schema's default: the value used when a key is left out of
`params.yaml`. It is also the committed `params.yaml`'s value (the default run's
configuration): `tests/unit/test_params.py` fails when the two differ in any key, so a
missing key never silently means another value. Under `dvc repro` DVC also reads the params
dvc.yaml names per stage and stops (`Parameters '...' are missing from 'params.yaml'`) when
one is absent: besides whole sections these are single keys (`devices.accelerator`,
`devices.gpus`, `devices.cpu_threads`, `generate.grid_rows`, the `eval` keys of train's
measurement), so keep them in the file even at their defaults. `dvc params diff` and
`dvc exp show` show what a run used. Every number has an upper bound (lengths and intervals
in kimg at most 1,000,000: a billion images), so a value like `1e308` is refused by name
instead of overflowing mid-run.

**The file itself.** `params.yaml` must be UTF-8 text (a Latin-1 or UTF-16 file is refused
with the byte and line), a regular file of at most {max_kib} KiB (the committed one is about
5 KiB), nested at most {max_depth} levels, and at most {max_nodes} keys and values once YAML
aliases (`*name`) are expanded. The last limit refuses "billion laughs" alias bombs (a few KB
that expand to a billion values) within a second, naming the file; aliases that stay small
work. **DVC itself hangs on such a file:** `dvc status`, `dvc repro` and `dvc exp run` load
`params.yaml` into their `${{...}}` interpolation context, expanding every alias, before any
stage starts (DVC 3.67.1 was still expanding a 441-byte bomb, memory growing, when stopped
after 60 s), and nothing in this project can prevent that. If a DVC command hangs at start,
stop it and check the file with
`python -c "from ganpipe.params import load_params; load_params()"`: its last line names
the problem.

Rules across keys (checked too, named in the error): `data.image_size` must be one that
`model.arch` supports (`dcgan`: 16, 32 or 64; `resnet`: 32, 64, 128 or 256, with
`model.g_channels` / `model.d_channels` entries for every resolution up to it);
`model.conditional` needs `model.arch: resnet` and a normalisation layer in G (`model.norm`
not `spectral` / `none`); `train.batch_size` must be divisible by the world size
(`devices.nproc_per_node` × `devices.nnodes`) × `train.grad_accum`; with `model.arch: dcgan`,
`train.loss: wgan_gp` and `train.r1_gamma > 0` need a per-sample `model.norm` (not `batch` /
`sync_batch`) and `train.activation_checkpointing` refuses `model.norm: spectral`;
`sync_batch` and `devices.backend: nccl` need CUDA; `determinism.deterministic` and
`determinism.cudnn_benchmark` exclude each other; `data.path` is required by every source
except `digits`, which refuses it; `eval.feature_extractor: inception` needs
`eval.inception_weights`.
"""


def error_of(raw: dict[str, Any]) -> str:
    """What the stages print for ``raw`` (so the page's examples are the real messages)."""
    try:
        parse_params(raw, "params.yaml")
    except ParamsError as exc:
        return str(exc)
    raise AssertionError(f"{raw} is valid; the example needs an invalid one")


def header() -> str:
    example = {"data": {"image_size": 48}, "train": {"batch_size": 0, "strategy": "both"}}
    typo = error_of({"data": {"chanels": 3}}).splitlines()[1].removeprefix("  - ")
    return HEADER.format(
        command=COMMAND,
        example_error=error_of(example),
        typo_error=typo,
        max_kib=MAX_PARAMS_BYTES // 1024,
        max_depth=MAX_YAML_DEPTH,
        max_nodes=f"{MAX_YAML_NODES:,}",
    )


def render_value(value: Any) -> str:
    """A default as params.yaml writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(render_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {render_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def render_number(value: Any) -> str:
    if isinstance(value, int) and value >= 2**32 and (value & (value - 1)) == 0:
        return f"2^{value.bit_length() - 1}"
    return f"{value:,}" if isinstance(value, int) else render_value(value)


def render_bounds(metadata: list[Any]) -> str:
    """``ge`` / ``gt`` / ``le`` / ``lt`` and ``pattern`` constraints, as ``0 ≤ x < 1``."""
    low = high = ""
    pattern = None
    for item in metadata:
        if isinstance(item, FieldInfo):  # Annotated[int, Field(ge=0)] inside a list or tuple
            nested = render_bounds(item.metadata)
            if nested:
                return nested
        elif isinstance(item, annotated_types.Ge):
            low = f"{render_number(item.ge)} ≤ "
        elif isinstance(item, annotated_types.Gt):
            low = f"{render_number(item.gt)} < "
        elif isinstance(item, annotated_types.Le):
            high = f" ≤ {render_number(item.le)}"
        elif isinstance(item, annotated_types.Lt):
            high = f" < {render_number(item.lt)}"
        elif getattr(item, "pattern", None):
            pattern = item.pattern
    parts = [f"{low}x{high}"] if low or high else []
    if pattern:
        parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def render_type(annotation: Any) -> tuple[str, str]:
    """``(type or choices, range)`` of an annotation, recursing into lists and tuples."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        inner, inner_range = render_type(args[0])
        bounds = render_bounds(list(args[1:]))
        return inner, "; ".join(r for r in (inner_range, bounds) if r)
    if origin is Literal:
        return " \\| ".join(f"`{render_value(a)}`" for a in args), ""
    if origin in (typing.Union, types.UnionType):
        rendered = [render_type(a) for a in args]
        return " or ".join(t for t, _ in rendered), "; ".join(r for _, r in rendered if r)
    if origin is dict:
        key, _ = render_type(args[0])
        value, value_range = render_type(args[1])
        return f"mapping {key} → {value}", f"each value {value_range}" if value_range else ""
    if origin is list:
        item, item_range = render_type(args[0])
        return f"list of {item}", f"each {item_range}" if item_range else ""
    if origin is tuple:
        rendered = [render_type(a) for a in args]
        ranges = {r for _, r in rendered}
        shown = f"each {ranges.pop()}" if len(ranges) == 1 and "" not in ranges else ""
        return f"[{', '.join(t for t, _ in rendered)}]", shown
    if annotation is type(None):
        return "null", ""
    return getattr(annotation, "__name__", str(annotation)), ""


def describe_field(field: FieldInfo) -> tuple[str, str, str]:
    """``(type or choices, default, range)`` of one field."""
    kind, inner_range = render_type(field.annotation)
    bounds = render_bounds(field.metadata)
    default = field.get_default(call_default_factory=True)
    return kind, render_value(default), "; ".join(r for r in (inner_range, bounds) if r)


def cell(text: str) -> str:
    """One line of table cell text: whitespace collapsed, reST ``code`` as Markdown, pipes
    escaped."""
    text = " ".join(text.split()).replace("``", "`")
    return re.sub(r"(?<!\\)\|", r"\\|", text)


def table(rows: list[tuple[str, FieldInfo]]) -> list[str]:
    lines = ["| key | type or choices | default | range | meaning |", "|---|---|---|---|---|"]
    for key, field in rows:
        kind, default, bounds = describe_field(field)
        doc = cell(field.description or "")
        lines.append(f"| `{key}` | {cell(kind)} | `{default}` | {cell(bounds)} | {doc} |")
    return lines


def is_section(field: FieldInfo) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


def render(schema: type[BaseModel] = Params) -> str:
    """The whole page: the header, the top-level keys, then one table per section."""
    top = [(name, f) for name, f in schema.model_fields.items() if not is_section(f)]
    sections = [(name, f.annotation) for name, f in schema.model_fields.items() if is_section(f)]
    lines = [
        header().rstrip("\n"),
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{slug(name)})" for name, _ in sections) + ".",
        "",
    ]
    lines += ["## Top level", "", *table(top), ""]
    for name, section in sections:
        doc = " ".join((section.__doc__ or "").split())
        lines += [f"## {name}", "", doc, ""]
        lines += table([(f"{name}.{key}", f) for key, f in section.model_fields.items()])
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE} instead of stdout")
    args = parser.parse_args()
    page = render()
    if args.write:
        PAGE.write_text(page, encoding="utf-8")
        print(f"wrote {PAGE}", file=sys.stderr)
    else:
        sys.stdout.write(page)


if __name__ == "__main__":
    main()
