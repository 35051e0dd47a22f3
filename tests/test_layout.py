"""The package's shape: imports point one way down the pipeline, and private APIs sit behind the adapters."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from import_graph import PACKAGE, graph

# Lower layers first; a module may import its own layer's modules and any below, never one above.
LAYERS: list[tuple[str, ...]] = [
    ("names", "units", "checks", "_private", "_private_inductor"),
    ("core",),
    ("analysis",),
    ("monitor", "evaluation"),
    ("predict", "render"),
    ("lightning", "cli"),
    ("pl",),  # the callback for pytorch_lightning.Trainer, built on lightning's
    ("", "__main__"),  # the package's __init__ re-exports the public API
]
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE


def layer_of(module: str) -> tuple[int, str]:
    """The layer index and the group (``core``, ``predict``...) of a module of the package."""
    rest = module.removeprefix(PACKAGE).lstrip(".")
    group = rest.split(".")[0]
    for index, groups in enumerate(LAYERS):
        if group in groups:
            return index, group
    raise AssertionError(f"{module} is in no layer; add its group to LAYERS")


def test_every_import_points_down_the_pipeline() -> None:
    _, edges = graph(None)
    upward = []
    for module, targets in edges.items():
        level, group = layer_of(module)
        for target in targets:
            target_level, target_group = layer_of(target)
            if target_level > level or (target_level == level and target_group != group and level > 0):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_predict_and_render_do_not_know_each_other_nor_lightning() -> None:
    _, edges = graph(None)
    for module, targets in edges.items():
        group = layer_of(module)[1]
        if group in ("core", "analysis", "predict", "render"):
            assert not any(layer_of(t)[1] in ("lightning", "cli") for t in targets), module
        if group == "predict":
            assert not any(layer_of(t)[1] == "render" for t in targets), module
        if group == "render":
            assert not any(layer_of(t)[1] in ("predict", "monitor") for t in targets), module


def test_within_a_group_imports_have_no_cycle() -> None:
    _, edges = graph(None)

    def reach(start: str, seen: set[str]) -> set[str]:
        for target in edges[start] - seen:
            seen.add(target)
            reach(target, seen)
        return seen

    assert [m for m in edges if m in reach(m, set())] == []


PRIVATE_IMPORT = re.compile(r"^(torch|lightning)(\.\w+)*\._\w+|^torch\._")


def test_private_torch_and_lightning_apis_only_in_the_adapter() -> None:
    offenders = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.name.startswith("_private"):  # the adapters: _private.py, and _private_inductor.py for inductor's
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_ATTRIBUTES:
                names = [node.attr]
            offenders += [f"{path.name}: {n}" for n in names if PRIVATE_IMPORT.match(n) or n in _PRIVATE_ATTRIBUTES]
    assert offenders == []


# The private attributes the package reads; each must be read in _private.py only.
_PRIVATE_ATTRIBUTES = {
    "_local_tensor",
    "_cache_enabled",
    "_batches_that_stepped",
    "_get_ddp_logging_data",
    "_record_memory_history",
    "_dump_snapshot",
    "_compiler_ctx",
    "_compiled_call_impl",
    "_per_optimizer_states",
    "_growth_tracker",
    "_parameters",
    "_buffers",
    "_base",
}


@pytest.mark.parametrize("adapter", ["_private.py", "_private_inductor.py"])
def test_the_adapter_names_why_for_each_private_api(adapter: str) -> None:
    tree = ast.parse((SOURCE / adapter).read_text())
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert functions
    assert [f.name for f in functions if not ast.get_docstring(f)] == []
    assert sorted(p.name for p in SOURCE.rglob("_private*.py")) == ["_private.py", "_private_inductor.py"]
