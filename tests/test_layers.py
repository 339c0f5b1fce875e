"""The package's layers import only downward (docs/DESIGN.md §2).

An AST walk over every module under ``dplb/`` — imports inside functions included, since a lazy import is still a
dependency — maps each module and each ``dplb.*`` import to its layer and fails on any import the table below does
not allow. The layers, bottom to top:

- foundation: ``dplb`` (the package), ``dplb.config``, ``dplb.errors``, ``dplb.flags``, ``dplb.http_values``,
  ``dplb.native``, ``dplb.stack``, ``dplb.tenants``
- ``dplb.runtime`` and ``dplb.state``: the foundation only
- ``dplb.policy``: the state plane (it scores snapshots)
- ``dplb.obs``: the policy's data (decision reasons label metrics), the state plane, the runtime
- ``dplb.router`` and ``dplb.worker``: everything below, never each other
- ``dplb.ops`` and ``dplb.bench``: everything below; bench may use ops (the launcher's parser starts its stacks)
- ``dplb.cli``: everything
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dplb import native

PKG = Path(__file__).resolve().parent.parent / "dplb"
FOUNDATION = {"foundation"}
BELOW_ROUTER = FOUNDATION | {"runtime", "state", "policy", "obs"}
ALLOWED: dict[str, set[str]] = {
    "foundation": FOUNDATION,
    "runtime": FOUNDATION,
    "state": FOUNDATION,
    "policy": FOUNDATION | {"state"},
    "obs": FOUNDATION | {"state", "policy", "runtime"},
    "router": BELOW_ROUTER,
    "worker": BELOW_ROUTER,
    "ops": BELOW_ROUTER | {"router", "worker"},
    "bench": BELOW_ROUTER | {"router", "worker", "ops"},
    "cli": BELOW_ROUTER | {"router", "worker", "ops", "bench"},
}


def layer_of(module: str) -> str:
    """The layer of a dotted module name under ``dplb`` (``dplb.state.shm`` → ``state``)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("config", "errors", "flags", "http_values", "native", "stack", "tenants",
                                         "__init__"):
        return "foundation"
    if parts[1] == "cli":
        return "cli"
    return parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def dplb_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Every ``dplb.*`` module a tree imports, with its line: ``from dplb.x import y`` names ``dplb.x`` and, when
    ``y`` is a submodule, ``dplb.x.y`` (so ``from dplb import metrics`` names ``dplb.metrics``)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "dplb"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "dplb":
                continue
            out.append((node.lineno, node.module))
            for a in node.names:
                sub = PKG.parent / (node.module + "." + a.name).replace(".", "/")
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    out.append((node.lineno, node.module + "." + a.name))
    return out


def violations(root: Path = PKG) -> list[str]:
    """``path:line: layer A imports dplb.x (layer B)`` for every upward or sideways import under ``root``."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        mine = layer_of(module_name(path))
        if mine not in ALLOWED:
            found.append(f"{path}: module in unknown layer {mine!r}: add it to the layer table")
            continue
        for line, target in dplb_imports(ast.parse(path.read_text(), str(path))):
            theirs = layer_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                found.append(f"{path.relative_to(PKG.parent)}:{line}: {mine} imports {target} ({theirs})")
    return found


def test_no_layer_imports_upward() -> None:
    assert violations() == []


def test_every_top_level_entry_has_a_layer() -> None:
    """A new top-level module or package must be placed in the table, not silently land in a layer of its own."""
    for entry in PKG.iterdir():
        if entry.name.startswith("__pycache__") or entry.name.startswith(".") or entry.suffix == ".so" \
                or entry.name == native.MANIFEST:
            continue  # (.so and the manifest: the compiled build's, scripts/build_native.sh, not sources)
        name = entry.stem if entry.suffix == ".py" else entry.name
        assert layer_of("dplb." + name) in ALLOWED, entry


@pytest.mark.parametrize(("layer", "source", "bad"), [
    ("state", "from dplb.policy.prefix import PrefixIndex\n", True),
    ("state", "def f():\n    from dplb.router import proxy\n", True),
    ("state", "from dplb.errors import ShmError\n", False),
    ("policy", "import dplb.router.state\n", True),
    ("router", "from dplb.worker import process\n", True),
    ("worker", "from dplb.router.routes import match\n", True),
    ("router", "from dplb.obs import metrics\n", False),
    ("obs", "from dplb.ops import launcher\n", True),
])
def test_checker_catches_upward_imports(tmp_path: Path, layer: str, source: str, bad: bool) -> None:
    """The walk itself: an upward import (top level or inside a function) is reported, a downward one is not."""
    pkg = tmp_path / "dplb"
    (pkg / layer).mkdir(parents=True)
    (pkg / layer / "mod.py").write_text(source)
    global PKG
    saved, PKG = PKG, pkg
    try:
        assert bool(violations(pkg)) is bad, violations(pkg)
    finally:
        PKG = saved
