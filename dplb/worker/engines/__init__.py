"""Engines behind a worker: ``sim`` (CPU, vLLM-like; the default without a model) and ``vllm`` (real).

:func:`build_engine` is the only place that maps an engine name and its command-line arguments to an
:class:`~dplb.worker.engines.base.Engine`. The vLLM engine is imported lazily, so nothing on the router side ever
imports vllm or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable

from dplb.errors import ConfigError
from dplb.worker.engines.base import Engine

ENGINES = ("sim", "vllm")


def sim_arg_parser() -> argparse.ArgumentParser:
    """Parser of the sim engine's knobs: one ``--sim-<field>`` flag per :class:`SimConfig` field."""
    from dplb.worker.engines.sim.engine import SimConfig

    p = argparse.ArgumentParser(prog="dplb worker --engine sim", add_help=False)
    hints = typing.get_type_hints(SimConfig)
    for f in dataclasses.fields(SimConfig):
        typ = hints[f.name]
        convs: dict[object, Callable[[str], object]] = {int: int, float: float, bool: _bool}
        conv = convs.get(typ, str)
        p.add_argument(f"--sim-{f.name.replace('_', '-')}", dest=f.name, type=conv, default=f.default,
                       help=f"(default {f.default!r})")
    return p


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def build_engine(name: str, engine_args: list[str], *, model: str | None = None) -> Engine:
    """Build the engine ``name`` from its arguments.

    sim: ``engine_args`` are ``--sim-*`` flags (``--model`` sets the served name). vllm: ``engine_args`` are passed
    to vLLM's OpenAI server unchanged. Raises :class:`ConfigError` for an unknown engine or bad arguments.
    """
    if name == "sim":
        from dplb.worker.engines.sim.engine import SimConfig, SimEngine

        ns, rest = sim_arg_parser().parse_known_args(engine_args)
        if rest:
            raise ConfigError(f"unknown sim engine argument(s): {' '.join(rest)} (see `dplb worker --help-engine sim`)")
        kw = vars(ns)
        if model:
            kw["model"] = model
        return SimEngine(SimConfig(**kw))
    if name == "vllm":
        from dplb.worker.engines.vllm import VllmEngine

        return VllmEngine(engine_args, model=model)
    raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
