"""Params overrides as ``dvc exp run -S`` gives them: dotted keys, exact values.

What a flow run is asked to change (``{"train.kimg": 5, "model.g_channels.4": 64}``) is
checked against the params file and the schema every stage uses before anything runs, then
written into params.yaml keeping its comments and layout.
"""

from __future__ import annotations

import copy
import io
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ganpipe.params import ParamsError, parse_params, read_yaml

__all__ = [
    "MACHINE_KEYS",
    "ParamsError",
    "apply_overrides",
    "check_inside",
    "flatten",
    "validate_overrides",
]

#: Keys that describe the machine a run is on, or name its files, rather than the experiment:
#: set in params.yaml (a commit), never by a caller. From a caller they would join another
#: host's rendezvous (whose store torchrun unpickles), probe any file of the worker, or lift
#: the bound on processes per machine.
MACHINE_KEYS = frozenset(
    {
        "devices.nnodes",
        "devices.node_rank",
        "devices.rdzv_endpoint",
        "devices.backend",
        "devices.oversubscribe",
        "eval.inception_weights",
        "eval.inception_sha256",
    }
)


def check_inside(path: str, root: Path | None = None) -> None:
    """Raises ParamsError unless ``path`` is relative and stays inside the project (``root``:
    links followed too): a run sees the project's files only, never the worker's folders."""
    outside = root is not None and not (root / path).resolve().is_relative_to(root.resolve())
    if Path(path).is_absolute() or ".." in Path(path).parts or outside:
        raise ParamsError(
            "overrides",
            [("data.path", f"{path!r} must be a folder inside the project, relative to it")],
        )


def _key(node: Mapping, part: str) -> str | int:
    """YAML reads ``4: 128`` (model.g_channels) with an int key: ``g_channels.4`` means it."""
    return int(part) if part.isdigit() and int(part) in node else part


def apply_overrides(params: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` with dotted-key ``overrides`` applied (``{"train.kimg": 5}``).

    Raises:
        ParamsError: a key sets a whole section, or reaches inside a value.
    """
    result = copy.deepcopy(dict(params))
    problems = []
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node: Any = result
        for part in parents:
            node = node.setdefault(_key(node, part), {}) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            problems.append((key, f"{'.'.join(parents)} is a value, not a section"))
        elif isinstance(node.get(_key(node, leaf)), dict):
            inner = ", ".join(f"{key}.{name}" for name in node[_key(node, leaf)])
            problems.append((key, f"is a section; override single values such as {inner}"))
        else:
            node[_key(node, leaf)] = value
    if problems:
        raise ParamsError("overrides", problems)
    return result


def validate_overrides(
    params_text: str, overrides: Mapping[str, Any] | None, where: str = "params.yaml"
) -> dict[str, Any]:
    """``overrides`` checked against the params file ``params_text`` and the schema, with the
    schema's values (``1`` for a float key becomes ``1.0``; ``"0.5"`` for a number is
    refused), so a typo or a bad value fails naming the key before any stage runs.

    Raises:
        ParamsError: listing every problem, keys named as in params.yaml; a key of
            :data:`MACHINE_KEYS`; a ``data.path`` outside the project.
    """
    overrides = dict(overrides or {})
    bad = [k for k in overrides if not isinstance(k, str) or not re.fullmatch(r"\w+(\.\w+)*", k)]
    if bad:
        raise ParamsError(
            "overrides", [(str(k), "keys are dotted params names, e.g. train.kimg") for k in bad]
        )
    local = sorted(key for key in overrides if key in MACHINE_KEYS)
    if local:
        fix = "it describes the machine, not the experiment: set it in params.yaml and commit it"
        raise ParamsError("overrides", [(key, fix) for key in local])
    merged = apply_overrides(read_yaml(params_text) or {}, overrides)
    valid = parse_params(merged, f"{where} with overrides {overrides}")
    if valid.data.path:
        check_inside(valid.data.path)
    normalised = flatten(valid.model_dump(mode="json"))
    return {key: normalised.get(key, value) for key, value in overrides.items()}


def write_params(path: Path, overrides: Mapping[str, Any]) -> None:
    """Set ``overrides`` in the params file ``path``, keeping its comments and layout.

    Strings are written double-quoted, so every value reads back unchanged by YAML 1.1 and
    1.2 readers alike (``yes``, ``null``, ``1e3``, ``${x}``, newlines, backslashes).
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    rt = YAML()
    rt.preserve_quotes, rt.width, rt.allow_unicode = True, 4096, True
    rt.representer.add_representer(  # ruamel writes None as nothing; params.yaml says null
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null")
    )

    def exact(value: Any) -> Any:
        if isinstance(value, str):
            return DoubleQuotedScalarString(value)
        if isinstance(value, list):
            seq = CommentedSeq(exact(v) for v in value)
            seq.fa.set_flow_style()
            return seq
        return value

    data = rt.load(path.read_text(encoding="utf-8"))
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(_key(node, part), {})
        node[_key(node, leaf)] = exact(value)
    text = io.StringIO()
    rt.dump(data, text)
    path.write_text(text.getvalue(), encoding="utf-8")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    if not isinstance(tree, Mapping):
        return {prefix: tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat
