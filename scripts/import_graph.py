"""Print the package's modules with their sizes and the internal imports between them, at a git revision or now.

    python scripts/import_graph.py            # the working tree
    python scripts/import_graph.py --rev HEAD~3

The layers and the rule that imports point only down them are checked by tests/test_layout.py.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_memtenants"


def modules(rev: str | None) -> dict[str, str]:
    """Module name -> source, from the working tree or from ``git show rev:path``."""
    if rev is None:
        base = ROOT / "src" / PACKAGE
        return {_name(p.relative_to(base.parent)): p.read_text() for p in sorted(base.rglob("*.py"))}
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, f"src/{PACKAGE}"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    out = {}
    for path in (line for line in listing.splitlines() if line.endswith(".py")):
        source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout
        out[_name(Path(path).relative_to("src"))] = source.decode()
    return out


def _name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def imports(source: str, known: set[str]) -> set[str]:
    """The package's modules that ``source`` imports when it runs (top level and inside functions)."""
    found = set()
    for node in _runtime_nodes(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith(PACKAGE)]
        found |= {name for name in names if name in known}
    return found


def graph(rev: str | None) -> tuple[dict[str, int], dict[str, set[str]]]:
    """Lines per module and each module's internal imports."""
    sources = modules(rev)
    known = set(sources)
    sizes = {name: len(source.splitlines()) for name, source in sources.items()}
    edges = {name: imports(source, known) - {name} for name, source in sources.items()}
    return sizes, edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default=None, help="a git revision (default: the working tree)")
    args = parser.parse_args()
    sizes, edges = graph(args.rev)
    short = {name: name.removeprefix(PACKAGE).lstrip(".") or "(package)" for name in sizes}
    print(f"{'module':<28}{'lines':>7}  imports")
    for name in sorted(sizes):
        targets = ", ".join(sorted(short[t] for t in edges[name]))
        print(f"{short[name]:<28}{sizes[name]:>7}  {targets}")
    print(f"{'total':<28}{sum(sizes.values()):>7}  {sum(map(len, edges.values()))} internal imports")


if __name__ == "__main__":
    main()
