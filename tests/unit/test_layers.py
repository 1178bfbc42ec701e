"""The structure stays as drawn: the layers of pyproject.toml's import-linter contract hold, and
no module of the package imports itself back through others (imports inside functions and
TYPE_CHECKING blocks count: an annotation is a dependency too)."""

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).parents[2]


def test_layering_contract_holds():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.find_modules_directly_imported_by(node):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    graph = grimp.build_graph("moepipe", exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def test_the_contract_counts_type_checking_imports():
    """An import under ``if TYPE_CHECKING:`` is part of the structure the contract holds."""
    text = (ROOT / "pyproject.toml").read_text()
    assert "\nexclude_type_checking_imports = false\n" in text
