"""executor/ray_private.py: the one table of Ray's private names the product uses. Each resolves on the
installed Ray (or the table says this release lacks it), one missing is said once and changes nothing,
and no product module reaches into Ray's private parts past the table."""

from __future__ import annotations

import ast
import logging

import pytest
import ray

from executor import ray_private
from executor.ray_private import ITEMS, Private
from tests.conftest import REPO

PRODUCT = ("executor", "sandboxes", "harnesses", "policy")


def test_every_item_resolves_on_the_installed_ray_or_is_known_absent_there() -> None:
    missing = [name for name in ITEMS if ray_private._lookup(name) is None]
    expected = [name for name, item in ITEMS.items() if ray.__version__ in item.absent_in]
    assert missing == expected, f"Ray {ray.__version__}"


def test_a_missing_name_is_said_once_and_patches_nothing(monkeypatch, caplog) -> None:
    name = "ray._private.services.no_such_function_of_ray"
    monkeypatch.setitem(ITEMS, name, Private(name, "this test", "nothing"))
    with caplog.at_level(logging.INFO, logger="executor.ray_private"):
        assert ray_private.resolve(name) is None
        with ray_private.patched(name, lambda original: original) as done:
            assert done is False
        assert not ray_private.available(name, "ray._private.services.get_node")
    said = [r for r in caplog.records if name in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], [r.getMessage() for r in said]


def test_a_patch_is_undone() -> None:
    from ray._private import services

    name = "ray._private.services.get_node"
    before = services.get_node
    with ray_private.patched(name, lambda original: "in its place") as done:
        assert done and services.get_node == "in its place"
    assert services.get_node is before


def _private_uses(source: str, label: str) -> list[str]:
    """Where ``source`` imports or reaches a private part of Ray (a name of it starting with ``_``)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        dotted = []
        if isinstance(node, ast.ImportFrom) and node.module:
            dotted = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "ray":
                dotted = [".".join(["ray", *reversed(chain)])]
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1
        ):
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("_"):
                target = ast.unparse(node.args[0])
                if target == "ray" or target.startswith(("ray.", "getattr(ray")):
                    dotted = [f"{target}.{arg.value}"]
        for name in dotted:
            parts = name.split(".")
            if parts[0] == "ray" and any(p.startswith("_") for p in parts[1:]):
                found.append(f"{label}:{node.lineno}: {name}")
    return found


def test_no_product_module_reaches_into_ray_s_private_parts_but_the_table() -> None:
    paths = [p for package in PRODUCT for p in sorted((REPO / package).rglob("*.py"))]
    uses = [
        use
        for p in paths
        if p.name != "ray_private.py"
        for use in _private_uses(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))
    ]
    assert uses == []


@pytest.mark.parametrize(
    "source",
    [
        "from ray._private import services",
        "import ray._raylet",
        "ray._private.worker.x()",
        'getattr(ray, "_private")',
    ],
)
def test_the_check_sees_each_way_of_reaching_in(source) -> None:
    assert _private_uses(source, "probe")


def test_the_table_the_range_and_ci_s_oldest_ray_agree() -> None:
    """pyproject.toml's lower bound is the Ray `make test-ray-oldest` installs, and both ends were checked."""
    import re

    pin = re.search(r'"ray\[default\]>=([\d.]+),<([\d.]+)"', (REPO / "pyproject.toml").read_text())
    oldest = re.search(r"^RAY_OLDEST := ([\d.]+)$", (REPO / "Makefile").read_text(), re.M)
    assert pin and oldest
    assert pin[1] == oldest[1] == ray_private.CHECKED[0]
    newest = tuple(int(x) for x in ray_private.CHECKED[-1].split("."))
    assert newest < tuple(int(x) for x in pin[2].split("."))
