"""Engines behind a worker: ``sim`` (CPU, vLLM-like; the default without a model) and ``vllm`` (real).

:func:`build_engine` is the only place that maps an engine name and its command-line arguments to an
:class:`~dplb.worker.engines.base.Engine`. The vLLM engine is imported lazily, so nothing on the router side ever
imports vllm or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from collections.abc import Callable

from dplb.errors import ConfigError
from dplb.worker.engines.base import Engine

if typing.TYPE_CHECKING:
    from dplb.worker.engines.sim.scheduler import SimConfig

ENGINES = ("sim", "vllm")


class _SimArgParser(argparse.ArgumentParser):
    """An argument parser whose errors are :class:`ConfigError` (one line on the CLI), not ``sys.exit(2)``."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"sim engine argument: {message} (see `dplb worker --help-engine sim`)")


def sim_arg_parser() -> argparse.ArgumentParser:
    """Parser of the sim engine's knobs: one ``--sim-<field>`` flag per :class:`SimConfig` field. A bad value
    raises :class:`ConfigError`."""
    from dplb.worker.engines.sim.engine import SimConfig

    p = _SimArgParser(prog="dplb worker --engine sim", add_help=False, allow_abbrev=False)
    hints = typing.get_type_hints(SimConfig)
    helps = knob_help(SimConfig.__doc__ or "")
    for f in dataclasses.fields(SimConfig):
        typ = hints[f.name]
        convs: dict[object, Callable[[str], object]] = {int: int, float: float, bool: _bool}
        conv = convs.get(typ, str)
        p.add_argument(f"--sim-{f.name.replace('_', '-')}", dest=f.name, type=conv, default=f.default,
                       help=f"{helps.get(f.name, '')} (default {f.default!r})".lstrip().replace("%", "%%"))
    return p


_ENTRY = re.compile(r"(?:^|; )``(\w+)``: ")


def knob_help(doc: str) -> dict[str, str]:
    """``{knob: one-line help}`` from a config class's docstring, where each knob is described in a bullet as
    ``- ``name``: text`` (several in one bullet are separated by ``; ``): the first sentence of its text, without the
    reST literal marks and roles. Knobs the docstring does not describe are absent."""
    bullets: list[str] = []
    for line in inspect.cleandoc(doc).splitlines():
        if line.startswith("- "):
            bullets.append(line[2:])
        elif line.startswith("  ") and bullets:
            bullets[-1] += " " + line.strip()
        else:
            bullets.append("")  # a heading or a blank line ends the bullet
    out: dict[str, str] = {}
    for text in bullets:
        found = list(_ENTRY.finditer(text))
        ends = [m.start() for m in found[1:]] + [len(text)] * bool(found)
        for m, end in zip(found, ends, strict=True):
            entry = text[m.end():end]
            out[m[1]] = re.split(r"\.\s", entry, maxsplit=1)[0].rstrip(" .;").replace("``", "")
            out[m[1]] = re.sub(r":\w+:`~?([^`]*)`", r"\1", out[m[1]])  # :meth:`X` -> X
    return out


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def sim_config(engine_args: list[str], *, model: str | None = None) -> SimConfig:
    """The sim engine's configuration from its ``--sim-*`` arguments (``model``: the served name), validated whole:
    what ``dplb launch`` checks before it starts anything. Raises :class:`ConfigError` for an unknown argument
    (one that names a knob without its ``--sim-`` prefix, such as vLLM's ``--max-model-len``, gets the right
    spelling), a bad value or an inconsistent configuration."""
    from dplb.worker.engines.sim.api import parse_adapters
    from dplb.worker.engines.sim.engine import SimConfig

    parser = sim_arg_parser()
    ns, rest = parser.parse_known_args(engine_args)
    if rest:
        known = {o for a in parser._actions for o in a.option_strings}
        hints = [f"{r} → --sim-{r[2:].split('=')[0]}" for r in rest
                 if r.startswith("--") and f"--sim-{r[2:].split('=')[0]}" in known]
        hint = f"; the sim's knobs start with --sim- ({', '.join(hints)})" if hints else ""
        raise ConfigError(f"unknown sim engine argument(s): {' '.join(rest)}{hint} (see `dplb worker --help-engine "
                          "sim`; vLLM's flags need --model)")
    kw = vars(ns)
    if model:
        kw["model"] = model
    cfg = SimConfig(**kw)
    parse_adapters(cfg.lora_adapters)
    return cfg


def build_engine(name: str, engine_args: list[str], *, model: str | None = None) -> Engine:
    """Build the engine ``name`` from its arguments.

    sim: ``engine_args`` are ``--sim-*`` flags (``--model`` sets the served name). vllm: ``engine_args`` are passed
    to vLLM's OpenAI server unchanged. Raises :class:`ConfigError` for an unknown engine or bad arguments.
    """
    if name == "sim":
        from dplb.worker.engines.sim.engine import SimEngine

        return SimEngine(sim_config(engine_args, model=model))
    if name == "vllm":
        from dplb.worker.engines.vllm import VllmEngine

        return VllmEngine(engine_args, model=model)
    raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
