"""Whether the router's hot path runs compiled, and whether that compiled build is whole and current.

The build is opt-in (README, "Optional: compile the hot path"): ``scripts/build_native.sh`` compiles every entry of
:data:`HOT_MODULES` with mypyc into one extension module (``.so``) next to its ``.py`` file, plus mypyc's shared
library :data:`GROUP_LIBRARY` that holds the code of all of them, and writes the build's manifest
(:data:`MANIFEST`, inside the package): the sha256 of every extension file it installed and of every source file the
compiled code depends on (:func:`build_sources`). Python's import system then loads each extension instead of its
source; ``scripts/build_native.sh --clean`` removes them and the pure-Python modules run again.

Contract
- :func:`inspect_build` says what a package directory holds (:class:`Build`), asking the import system where each
  hot module would be loaded from (``PathFinder``'s spec origin: the ``__file__`` mypyc gives a module that compiled
  code imported first can name a path that does not exist) and hashing the files the manifest names; it imports
  nothing of DPLB's, so it can decide before any hot module is loaded. :func:`build` is the same for this
  process's package, computed once.
- A compiled build only works whole: the shared library calls its own compiled copy of every module, so a missing
  extension (Python then loads the ``.py``: two copies of the classes) segfaults or fails with ``TypeError: X
  object expected; got X``, and a missing shared library fails every import. :meth:`Build.refusal` is the one line
  to refuse with for a build that is partial (an extension missing, the shared library or the manifest missing, an
  extension file that is not the build's) or stale (a source changed since the build: the extensions would run the
  old code, silently); a stale build runs only when :data:`ACCEPT_STALE_ENV` is ``1``. ``dplb``'s entry point
  (:func:`dplb.cli.main`) refuses with it before any subcommand's module is imported.
- :meth:`Build.label` is ``dplb_build_info``'s ``compiled`` label: ``"true"`` only for a whole, current build;
  ``"false"`` (pure Python), ``"partial"``, ``"stale"``. :func:`describe` is the router's start-up line.
- A build that goes stale while a router runs it (the checkout edited or pulled under it) is noticed by
  :class:`StaleWatch`, which the router polls from its monitor: its label becomes ``"stale"`` (a restart would be
  refused, :class:`dplb.errors.StaleBuildError`'s exit status, which ``dplb launch`` retries without giving up).

Why the sources compiled code depends on, not only the compiled ones: mypyc inlines the literal value of a
``Final`` name wherever it is used, from any module ("safe even for non-native names",
``mypyc/irbuild/builder.py``, ``emit_load_final``), so a changed constant in ``dplb/config.py`` stays old in the
extensions. :func:`build_sources` is every ``dplb`` module the hot modules import, transitively (ast, ``dplb.*``
imports only), with their packages' ``__init__.py``.

:func:`mypyc_attr` and :func:`trait` are ``mypy_extensions``'s to mypy and mypyc, no-ops otherwise (mypy_extensions
is not a dependency).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.machinery
import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr, trait
else:
    def mypyc_attr(*_args: object, **_kwargs: object):
        """``mypy_extensions.mypyc_attr`` for pure Python: it only means something to mypyc, which reads the
        decorator from the source (``allow_interpreted_subclasses=True`` on a compiled class that plugins, tests or
        modules not compiled subclass); at run time it returns the class unchanged."""
        return lambda cls: cls

    def trait(cls):
        """``mypy_extensions.trait`` for pure Python: to mypyc, a class of methods that a compiled class may take in
        besides its base class (called through a table, not looked up by name); at run time the class unchanged."""
        return cls


#: The modules compiled by scripts/build_native.sh (dotted names): the client-side HTTP protocol, the request's
#: path through the router (its intake checks, the worker health, the HTTP request count) and the worker-side HTTP
#: client, the policy's pick and the shm reads it works on, the per-request metrics and the tenant gate's admission,
#: ticket and rate limits (its waiting room with it: one module imports the other); and the modules split out
#: of those that they import (the protocol's rejection path, the latency baseline, the segment file), so that the
#: same code runs compiled (a base class of a compiled class must be compiled too).
HOT_MODULES: tuple[str, ...] = (
    "dplb.runtime.direct", "dplb.runtime.protocol", "dplb.runtime.lane_cycle", "dplb.runtime.edge",
    "dplb.runtime.conn_timer", "dplb.runtime.rejection",
    "dplb.router.direct", "dplb.router.upstream", "dplb.router.upstream_pool", "dplb.router.attempt",
    "dplb.router.exchange",
    "dplb.router.proxy", "dplb.router.state", "dplb.router.resume", "dplb.router.orca", "dplb.router.routes",
    "dplb.router.models", "dplb.router.health", "dplb.router.intake", "dplb.router.http_count",
    "dplb.router.tenancy", "dplb.router.ticket", "dplb.router.limits", "dplb.router.waiting",
    "dplb.policy.core", "dplb.policy.baseline", "dplb.policy.fused", "dplb.policy.scorers", "dplb.policy.prefix",
    "dplb.policy.decision", "dplb.policy.pickers", "dplb.policy.filters", "dplb.policy.framework",
    "dplb.policy.plugins", "dplb.policy.stall",
    "dplb.obs.fastmetrics", "dplb.obs.metrics_router",
    "dplb.state.router_slots", "dplb.state.shm", "dplb.state.segment_file", "dplb.state.worker_state",
    "dplb.state.kv_rings", "dplb.state.layout", "dplb.state.health_board",
)

#: mypyc's shared library (group ``dplb._hot`` of scripts/build_native.sh): inside the package, so that it imports
#: wherever ``dplb`` does.
GROUP_LIBRARY = "dplb._hot__mypyc"
#: The build's manifest, in the package directory (JSON; :func:`manifest_for`).
MANIFEST = "_hot_build.json"
#: ``1`` runs a stale build anyway (README): its extensions run the code they were built from.
ACCEPT_STALE_ENV = "DPLB_ACCEPT_STALE_BUILD"
#: The two ways out of a broken build, in every refusal.
FIXES = "rebuild with scripts/build_native.sh, or remove the build with scripts/build_native.sh --clean (pure Python)"
#: How often, at most, a running router stats the build's sources for a change under it (:class:`StaleWatch`).
STALE_CHECK_S = 5.0
#: While a stale build keeps refusing a router's restarts (``dplb launch``'s router, a group's child), at most one
#: line about it this often after the first (the retries themselves are every few seconds).
STALE_RETRY_LOG_S = 60.0
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


@dataclass(frozen=True)
class Build:
    """What a package directory holds. ``compiled``: the :data:`HOT_MODULES` the import system loads from an
    extension module; ``missing``: parts of a compiled build that are not there (hot modules, :data:`GROUP_LIBRARY`,
    the manifest; empty for pure Python); ``foreign``: extension files (package-relative paths) the manifest does not
    list with their content; ``stale``: source files (package-relative) changed since the build."""

    pkg_dir: str
    compiled: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    foreign: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()

    @property
    def pure(self) -> bool:
        """True when no extension module of the package would be loaded."""
        return not self.compiled and not self.foreign and GROUP_LIBRARY in self.missing

    @property
    def partial(self) -> bool:
        """True for a compiled build that is not whole (it crashes or fails to import: module docstring)."""
        return not self.pure and bool(self.missing or self.foreign)

    @property
    def label(self) -> str:
        """``dplb_build_info``'s ``compiled`` label: ``"true"``, ``"false"``, ``"partial"`` or ``"stale"``."""
        return "false" if self.pure else "partial" if self.partial else "stale" if self.stale else "true"

    def refusal(self, accept_stale: bool = False) -> str:
        """One line saying why no ``dplb`` command may run on this build, naming the fixes; "" when it may (pure
        Python, a whole current build, or a stale one with ``accept_stale``)."""
        where = os.path.join(self.pkg_dir, "")
        if self.partial:
            what = [f"{m} has no extension module" for m in self.missing if m in HOT_MODULES]
            what += ["mypyc's shared library dplb/_hot__mypyc.*.so is missing" for m in self.missing
                     if m == GROUP_LIBRARY]
            what += [f"{p} is missing" for p in self.missing if p.startswith("dplb/")]
            what += [f"{p} is not this build's" for p in self.foreign]
            return (f"the compiled build in {where} is partial ({_first(what)}), and a compiled build only works "
                    f"whole; {FIXES}")
        if self.stale and not accept_stale:
            return (f"the compiled build in {where} is stale: {_first([f'dplb/{p}' for p in self.stale])} changed "
                    f"since it was built, and it would run the old code; {FIXES}; {ACCEPT_STALE_ENV}=1 runs it "
                    "anyway")
        return ""


def _first(items: list[str], n: int = 3) -> str:
    """The first ``n`` of ``items`` joined, and how many more."""
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def _origin(pkg_dir: str, name: str) -> str:
    """The file the import system would load module ``name`` (``dplb.x.y``) from in ``pkg_dir``; "" when none."""
    parts = name.split(".")[1:]
    spec = importlib.machinery.PathFinder.find_spec(name, [os.path.join(pkg_dir, *parts[:-1])])
    return (spec.origin or "") if spec is not None else ""


def _sha256(path: str) -> str:
    """Hex sha256 of the file at ``path``; "" when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return ""


def _extension_files(pkg_dir: str) -> list[str]:
    """Every file under ``pkg_dir`` this Python would import as an extension module (package-relative paths)."""
    out = []
    for d, dirs, files in os.walk(pkg_dir):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out += [os.path.relpath(os.path.join(d, f), pkg_dir) for f in files if f.endswith(_SUFFIXES)]
    return sorted(out)


def inspect_build(pkg_dir: str = _PKG_DIR) -> Build:
    """What the package directory ``pkg_dir`` holds (:class:`Build`). Hashes the files the manifest names when
    there is a compiled build (~10 ms for 44 modules); nothing for pure Python."""
    found = _extension_files(pkg_dir)
    origins = {m: _origin(pkg_dir, m) for m in (*HOT_MODULES, GROUP_LIBRARY)}
    compiled = tuple(m for m in HOT_MODULES if origins[m].endswith(_SUFFIXES))
    missing = [m for m, o in origins.items() if not o.endswith(_SUFFIXES)]
    if not found:
        return Build(pkg_dir, compiled, tuple(missing))
    try:
        with open(os.path.join(pkg_dir, MANIFEST)) as f:
            manifest = json.load(f)
        extensions, sources = dict(manifest["extensions"]), dict(manifest["sources"])
    except (OSError, ValueError, KeyError, TypeError):  # no manifest: only the files of no hot module are foreign
        missing.append(f"dplb/{MANIFEST}")
        mine = {os.path.relpath(o, pkg_dir) for o in origins.values() if o.endswith(_SUFFIXES)}
        extensions, sources = dict.fromkeys(mine, ""), {}
    foreign = [f"dplb/{p}" for p in found
               if p not in extensions or (extensions[p] and _sha256(os.path.join(pkg_dir, p)) != extensions[p])]
    stale = [p for p, digest in sources.items() if _sha256(os.path.join(pkg_dir, p)) != digest]
    return Build(pkg_dir, compiled, tuple(missing), tuple(foreign), tuple(sorted(stale)))


_BUILD: list[Build] = []


def build() -> Build:
    """:func:`inspect_build` of this process's own package, computed on the first call (at start-up: what the
    process loads) and kept."""
    if not _BUILD:
        _BUILD.append(inspect_build())
    return _BUILD[0]


def accept_stale() -> bool:
    """True when :data:`ACCEPT_STALE_ENV` is ``1``."""
    return os.environ.get(ACCEPT_STALE_ENV, "") == "1"


def refusal() -> str:
    """:meth:`Build.refusal` for this process (:func:`build`, :func:`accept_stale`)."""
    return build().refusal(accept_stale())


def compiled_modules() -> list[str]:
    """The entries of :data:`HOT_MODULES` that are (or will be) loaded from an extension module (``.so``)."""
    return list(build().compiled)


def build_label() -> str:
    """``dplb_build_info``'s ``compiled`` label for this process (:attr:`Build.label`)."""
    return build().label


def describe() -> str:
    """One line for the router's start-up log and ``dplb launch``'s banner: ``"pure Python"``, ``"compiled (44/44
    hot modules)"``; a stale build run anyway, or a partial one, says so (``"compiled (44/44 hot modules; STALE:
    dplb/config.py changed since the build, run because DPLB_ACCEPT_STALE_BUILD=1)"``)."""
    b = build()
    if b.pure:
        return "pure Python"
    head = f"compiled ({len(b.compiled)}/{len(HOT_MODULES)} hot modules"
    if b.partial:
        return f"{head}; PARTIAL: {b.refusal()})"
    if b.stale:
        return (f"{head}; STALE: {_first([f'dplb/{p}' for p in b.stale])} changed since the build, run because "
                f"{ACCEPT_STALE_ENV}=1)")
    return head + ")"


def _stat(path: str) -> tuple[int, int]:
    """``(mtime in ns, size in bytes)`` of ``path``; ``(0, -1)`` when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return 0, -1
    return st.st_mtime_ns, st.st_size


class StaleWatch:
    """Notices a process's compiled build going stale under it (the checkout edited or pulled while it runs: it
    keeps running the build it loaded, but a restart would be refused). :meth:`poll` stats the manifest's sources
    (mtime and size; ~65 ``stat`` calls) at most every ``every_s`` seconds and hashes only a source whose stat
    changed, against the manifest's digest. ``start`` is the build the process loaded (:func:`build`); pure Python
    and a partial build are never watched (:meth:`poll` returns None)."""

    def __init__(self, start: Build, every_s: float = STALE_CHECK_S) -> None:
        self.label = start.label
        self.every_s = every_s
        self._dir = start.pkg_dir
        self._stale = set(start.stale)
        self._sources: dict[str, str] = {}
        if start.compiled and not start.partial:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError), \
                    open(os.path.join(self._dir, MANIFEST)) as f:
                self._sources = dict(json.load(f)["sources"])
        self._stats = {p: _stat(os.path.join(self._dir, p)) for p in self._sources}
        self._next = 0.0

    @property
    def stale(self) -> tuple[str, ...]:
        """The sources (package-relative) whose content differs from the build's, at the last check."""
        return tuple(sorted(self._stale))

    def poll(self, now: float) -> str | None:
        """At ``now`` (monotonic seconds): the new :attr:`Build.label` (``"stale"``, or ``"true"`` once every
        changed source is back to the build's content) when it changed since the last call, else None."""
        if not self._sources or now < self._next:
            return None
        self._next = now + self.every_s
        for rel, digest in self._sources.items():
            path = os.path.join(self._dir, rel)
            st = _stat(path)
            if st == self._stats[rel]:
                continue
            self._stats[rel] = st
            if _sha256(path) != digest:
                self._stale.add(rel)
            else:
                self._stale.discard(rel)
        label = "stale" if self._stale else "true"
        if label == self.label:
            return None
        self.label = label
        return label


# ---- the build's side: what scripts/build_native.sh writes -------------------------------------------------------
def _imports(path: str, pkg_root: str) -> set[str]:
    """The ``dplb`` modules the source at ``path`` imports (``from dplb.x import y`` names ``dplb.x``, and
    ``dplb.x.y`` when that is a module), with every package above each."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "dplb")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "dplb":
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {n for n in out if _source(n, pkg_root)}


def _source(name: str, pkg_root: str) -> str:
    """The source file of module ``name`` under ``pkg_root`` (the directory holding ``dplb/``); "" when none."""
    base = os.path.join(pkg_root, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return ""


def build_sources(pkg_dir: str = _PKG_DIR) -> list[str]:
    """The source files (package-relative) the compiled code depends on: every :data:`HOT_MODULES` entry and every
    ``dplb`` module they import, transitively, with the packages' ``__init__.py`` (module docstring)."""
    root = os.path.dirname(os.path.abspath(pkg_dir))
    todo, seen = list(HOT_MODULES), set()
    while todo:
        name = todo.pop()
        if name in seen or not _source(name, root):
            continue
        seen.add(name)
        todo += _imports(_source(name, root), root)
    return sorted(os.path.relpath(_source(n, root), pkg_dir) for n in seen)


def manifest_for(pkg_dir: str) -> dict[str, object]:
    """The manifest of the compiled build in ``pkg_dir``: ``{"python": extension suffix, "modules": HOT_MODULES,
    "extensions": {path: sha256}, "sources": {path: sha256}}`` (package-relative paths). Raises RuntimeError naming
    what is missing when the build there is not whole."""
    b = inspect_build(pkg_dir)
    absent = [m for m in b.missing if m in HOT_MODULES or m == GROUP_LIBRARY]
    if absent:
        raise RuntimeError(f"{len(b.compiled)} of {len(HOT_MODULES)} hot modules compiled; missing: "
                           f"{_first(absent, 5)}")
    return {"python": _SUFFIXES[0], "modules": list(HOT_MODULES),
            "extensions": {p: _sha256(os.path.join(pkg_dir, p)) for p in _extension_files(pkg_dir)},
            "sources": {p: _sha256(os.path.join(pkg_dir, p)) for p in build_sources(pkg_dir)}}


class ImportGuard:
    """A ``sys.meta_path`` finder that checks the build (:func:`refusal`) when the first hot module is imported, in
    any process that imports ``dplb`` (``dplb/__init__.py`` installs it): tests, benchmarks and scripts that import
    the package directly, not through ``dplb``'s entry point, would otherwise load a stale build's old code
    silently, or a partial build's crash. On a build that may run it removes itself (one check per process); on
    one that may not, every import of a hot module raises ``ImportError`` with :meth:`Build.refusal`'s line."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        """Checks the build on the first import of a hot module (``name``: dotted); never finds anything itself.

        Raises:
            ImportError: the build may not run (the message is :meth:`Build.refusal`'s line)."""
        if name not in _HOT_SET:
            return None
        problem = refusal()
        if problem:
            raise ImportError(problem, name=name)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        return None


_HOT_SET = frozenset(HOT_MODULES)


def guard_imports() -> None:
    """Install :class:`ImportGuard` first on ``sys.meta_path`` unless one is there (``dplb/__init__.py``)."""
    if not any(isinstance(f, ImportGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, ImportGuard())


def main(argv: list[str]) -> int:
    """``python -m dplb.native manifest DIR``: print the manifest of the build in package directory DIR (exit 1,
    saying what is missing, when it is not whole). ``python -m dplb.native check [DIR]``: print :func:`describe`'s
    verdict for DIR (default: this package); exit 1 with the refusal when the build there may not run."""
    if len(argv) == 2 and argv[0] == "manifest":
        try:
            print(json.dumps(manifest_for(argv[1]), indent=1, sort_keys=True))
        except RuntimeError as e:
            print(f"build failed: {e}", file=sys.stderr)
            return 1
        return 0
    if argv[:1] == ["check"] and len(argv) <= 2:
        b = inspect_build(argv[1] if len(argv) == 2 else _PKG_DIR)
        problem = b.refusal(accept_stale())
        print(problem or f"{b.label}: {len(b.compiled)}/{len(HOT_MODULES)} hot modules compiled",
              file=sys.stderr if problem else sys.stdout)
        return 1 if problem else 0
    print("usage: python -m dplb.native manifest DIR | check [DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
