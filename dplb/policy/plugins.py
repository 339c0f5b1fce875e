"""The plugin registry: one line per built-in scorer and picker (like the Inference Extension's
``plugins/registry.go``), and loading of user plugin modules.

Adding a scorer to DPLB: write the class in its own module under ``dplb/policy/`` and add one
``register_scorer(...)`` line here. Outside the package: put the class and its ``register_scorer(...)`` line in any
importable module and start the router with ``--policy-plugin MODULE`` (``dplb launch`` forwards it); then name it in
``--weights``. Its term appears in ``/debug/decisions``, traces and ``dplb_worker_score_term{term=…}`` unchanged.
"""

from __future__ import annotations

import importlib
from typing import Final

from dplb.config import PolicyConfig
from dplb.errors import ConfigError
from dplb.policy.framework import PICKERS, SCORERS, plugin_class, register_picker, register_scorer, resolve_params
from dplb.policy.pickers import LeastLoaded, MaxScore, PowerOfTwo, PrefixHash, Random, RoundRobin
from dplb.policy.scorers import LatencyScorer, MemoryScorer, PrefixScorer, QueueScorer

register_scorer(QueueScorer)
register_scorer(MemoryScorer)
register_scorer(LatencyScorer)
register_scorer(PrefixScorer)

register_picker(MaxScore)
register_picker(RoundRobin)
register_picker(Random)
register_picker(LeastLoaded)
register_picker(PowerOfTwo)
register_picker(PrefixHash)

#: The built-in scorer and picker classes: the framework calls them as they are; a plugin's (or a plugin's subclass
#: of one of them) has its results normalised (:func:`dplb.policy.framework.plugin_scores`).
BUILT_IN: Final = frozenset({QueueScorer, MemoryScorer, LatencyScorer, PrefixScorer, MaxScore, RoundRobin, Random,
                             LeastLoaded, PowerOfTwo, PrefixHash})

#: Policy name → picker name. Every profile runs the same filters and scorers (the terms are visible whatever picks).
PROFILES: Final = {
    "dplb": "max_score", "round_robin": "round_robin", "random": "random", "least_loaded": "least_loaded",
    "power_of_two": "power_of_two", "prefix_hash": "prefix_hash",
}


def validate(cfg: PolicyConfig) -> None:
    """Load ``cfg.plugins``, check that every weighted scorer is registered and that every ``--scorer-param``
    names a registered plugin, one of its declared parameters and a value it accepts: what start-up calls once, so a
    typo fails before any process starts. Raises :class:`ConfigError` (one line naming the flag)."""
    load_plugins(cfg.plugins)
    unknown = [n for n, _ in cfg.effective_weights() if n not in SCORERS]
    if unknown:
        raise ConfigError(f"--weights names an unknown scorer {unknown[0]!r}; known: {', '.join(sorted(SCORERS))}")
    for plugin in dict.fromkeys(p for p, _, _ in cfg.params):
        cls = plugin_class(plugin)
        if cls is None:
            value = next(f"{p}.{n}={v}" for p, n, v in cfg.params if p == plugin)
            raise ConfigError(f"--scorer-param {value}: no plugin {plugin!r}; scorers: {', '.join(sorted(SCORERS))}; "
                              f"pickers: {', '.join(sorted(PICKERS))}")
        resolve_params(cls, cfg)
    check_in_use(cfg)


def check_in_use(cfg: PolicyConfig) -> None:
    """Refuse a ``--scorer-param`` for a plugin this configuration does not run (a scorer not in ``--weights``, a
    picker other than the ``--policy`` profile's): the value would change nothing, which hides a mistake (a
    forgotten weight, another policy meant). Raises :class:`ConfigError` (one line naming the flag)."""
    weighted = [n for n, _ in cfg.effective_weights()]
    picker = PROFILES.get(cfg.name)
    for plugin, name, text in cfg.params:
        if plugin not in weighted and plugin != picker:
            runs = f"scorers {', '.join(weighted)}" + (f", picker {picker} (--policy {cfg.name})" if picker else "")
            hint = "weight it in --weights" if plugin in SCORERS else "choose the --policy that uses it"
            raise ConfigError(f"--scorer-param {plugin}.{name}={text}: {plugin} is not in use (this configuration "
                              f"runs {runs}); {hint} or drop the flag")


def load_plugins(modules: tuple[str, ...]) -> None:
    """Import each user plugin module (its import registers its scorers/pickers). Raises :class:`ConfigError`
    naming the module when it cannot be imported."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # any failure of a user's module is a configuration error to report
            raise ConfigError(f"--policy-plugin {name}: cannot import it ({type(e).__name__}: {e}); it must be an "
                              "importable module (on PYTHONPATH) that calls register_scorer()") from e
