"""The layering of the product's packages, read from every import (those inside functions too, which the
start-up time puts there and which hide a circle from a reader): no product modules import each other in
a circle, and each package imports only those below it (policy at the bottom, sandboxes and harnesses
above it, the executor on top).

``python tests/test_layering.py`` prints the circles (each strongly connected set of modules) and the
arrows against the layering."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository's packages, not an installed copy
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import REPO

PACKAGES = ("policy", "sandboxes", "harnesses", "executor")
# What each package may import of the others. sandboxes -> harnesses is not yet asserted: the cache
# root (harnesses.install.default_cache_root) is on its way to a module both may use.
MAY_IMPORT = {
    "policy": set(),
    "sandboxes": {"policy"},
    "harnesses": {"policy", "sandboxes"},
    "executor": {"policy", "sandboxes", "harnesses"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    """Every module of the product's packages but their ``testing`` subpackages (tools for the tests
    and the benches, which may reach anywhere), by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = _module_name(path)
            if ".testing" not in f".{name}":
                found[name] = path
    return found


def imports(source: str, name: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The modules of ``known`` that module ``name`` (of ``source``) imports, anywhere in it."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, the module mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            if ".testing" in f".{target}":
                continue  # a tool of the tests' (product_modules), not a product module
            # The module itself, else the nearest package of ours that holds it.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = product_modules()
    known = set(modules)
    return {
        name: imports(path.read_text(encoding="utf-8"), name, known, is_package=path.name == "__init__.py")
        for name, path in modules.items()
    }


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return sorted(found)


def against_the_layering(edges: dict[str, set[str]]) -> list[str]:
    arrows = []
    for source, targets in sorted(edges.items()):
        top = source.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != top and other not in MAY_IMPORT[top]:
                arrows.append(f"{source} -> {target}")
    return arrows


def test_no_product_modules_import_each_other_in_a_circle() -> None:
    assert circles(graph()) == []


def test_each_package_imports_only_those_below_it() -> None:
    assert against_the_layering(graph()) == []


def test_the_reader_sees_imports_inside_functions_and_circles() -> None:
    known = {"x", "x.a", "x.b", "x.c", "x.d"}
    hidden = "import os\n\ndef f():\n    from x import b\n    from .c import name\n    import x.d.deeper\n"
    assert imports(hidden, "x.a", known) == {"x.b", "x.c", "x.d"}
    edges = {"x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}, "x.d": {"x.a"}}
    assert circles(edges) == [["x.a", "x.b", "x.c"]]


if __name__ == "__main__":
    edges = graph()
    print(f"{len(edges)} product modules, {sum(map(len, edges.values()))} imports among them")
    for members in circles(edges):
        print("circle:", " ".join(members))
    for arrow in against_the_layering(edges):
        print("against the layering:", arrow)
