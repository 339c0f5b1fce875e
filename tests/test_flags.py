"""Every numeric flag of every subcommand, found in the parsers themselves (a new flag is covered without a new
test): float flags refuse ``nan``, ``inf`` and negatives, port flags refuse what is not a port (0 too, where the
stack derives its run dir and metrics ports from the number), each with one line naming the flag, while the command
line is parsed, before anything starts. The configurations refuse a non-finite float field whatever builds them."""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import dplb_cmd

from dplb.cli import build_parser
from dplb.config import PolicyConfig, RouterConfig
from dplb.errors import ConfigError
from dplb.worker.engines import sim_arg_parser, sim_config
from dplb.worker.process import WorkerConfig

#: Float flags where ``inf`` is a value with a meaning (``dplb bench run --request-rate inf``: all at once).
INF_ALLOWED = {("bench", "run", "--request-rate")}
#: Port flags where 0 means off.
ZERO_IS_OFF = {"--metrics-port", "--metrics-port-base", "--admin-port"}  # --admin-port 0: no Envoy admin listener
#: A port this test may name (nothing binds it: every case is refused before that).
PORT = "33917"


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from _leaves(child, (*path, name))


def _takes(action: argparse.Action, text: str) -> object:
    """What ``action``'s type makes of ``text`` (None when it refuses it)."""
    if action.type is None or not callable(action.type) or action.choices is not None:
        return None
    try:
        return action.type(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return None


def _required(parser: argparse.ArgumentParser) -> list[str]:
    """Arguments that satisfy ``parser``'s required ones (a positional's first choice, an option's plain value)."""
    out: list[str] = []
    for a in parser._actions:
        if a.option_strings and not a.required:
            continue
        value = next(iter(a.choices)) if a.choices else ("1" if _takes(a, "1") is not None else "x")
        out += [a.option_strings[0], str(value)] if a.option_strings else [str(value)]
    return out


def _flags(kind: str) -> list[tuple[tuple[str, ...], str, list[str]]]:
    """``(subcommand path, flag, required arguments)`` of every float (``kind='float'``) or port flag."""
    found = []
    for path, leaf in _leaves(build_parser()):
        for a in leaf._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS:
                continue
            is_float = isinstance(_takes(a, "1.5"), float)
            is_port = a.dest.endswith(("port", "port_base"))
            if (kind == "float" and is_float) or (kind == "port" and is_port):
                found.append((path, a.option_strings[0], _required(leaf)))
    return found


FLOAT_FLAGS = _flags("float")
PORT_FLAGS = _flags("port")


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> str:
    """Parse ``argv``: it must be refused (exit 2) with one line naming ``flag``. Returns the line."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_known_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"argument {flag}" in err, (argv, err)
    assert "Traceback" not in err and "--help`)" in err, err
    return err


def test_the_flags_are_found() -> None:
    """The discovery sees the flags of the reports (so an empty table cannot pass)."""
    floats = {(" ".join(p), f) for p, f, _ in FLOAT_FLAGS}
    for want in (("launch", "--idle-timeout"), ("launch", "--drain-timeout"), ("router", "--first-byte-timeout"),
                 ("router", "--connect-timeout"), ("state", "--interval"), ("worker", "--drain-timeout"),
                 ("bench run", "--request-rate"), ("bench run", "--timeout")):
        assert want in floats, want
    ports = {(" ".join(p), f) for p, f, _ in PORT_FLAGS}
    for want in (("launch", "--port"), ("router", "--port"), ("doctor", "--port"), ("worker", "--metrics-port"),
                 ("launch", "--metrics-port-base"), ("router", "--agent-port"), ("fleet haproxy-config", "--agent-port")):
        assert want in ports, want
    assert len(FLOAT_FLAGS) >= 35 and len(PORT_FLAGS) >= 10


@pytest.mark.parametrize(("path", "flag", "required"), FLOAT_FLAGS, ids=[f"{' '.join(p)} {f}" for p, f, _ in FLOAT_FLAGS])
def test_every_float_flag_refuses_nan_inf_and_negatives(capsys: pytest.CaptureFixture[str], path: tuple[str, ...],
                                                        flag: str, required: list[str]) -> None:
    """Regression: ``--idle-timeout nan`` (and inf; ``--first-byte-timeout``, ``--connect-timeout``,
    ``--drain-timeout``) started the stack, whose router or workers then crash-looped; ``dplb state --interval nan``
    was a traceback."""
    bad = ["nan", "-nan", "-inf", "-1", "-0.5", "abc"] + ([] if (*path, flag) in INF_ALLOWED else ["inf", "1e999"])
    for value in bad:
        _refused(capsys, [*path, *required, f"{flag}={value}"], flag)
    args, _ = build_parser().parse_known_args([*path, *required, f"{flag}=0.5"])  # a finite number is taken
    dest = next(a.dest for _, leaf in _leaves(build_parser()) for a in leaf._actions if flag in a.option_strings)
    assert getattr(args, dest) == 0.5


@pytest.mark.parametrize(("path", "flag", "required"), PORT_FLAGS, ids=[f"{' '.join(p)} {f}" for p, f, _ in PORT_FLAGS])
def test_every_port_flag_refuses_what_is_not_a_port(capsys: pytest.CaptureFixture[str], path: tuple[str, ...],
                                                    flag: str, required: list[str]) -> None:
    """Regression: ``dplb launch --port 0`` started a stack that advertised :0 (banner, scrape targets), never said
    its workers were ready and took the default stack's run dir and metrics ports."""
    for value in ["-1", "65536", "99999", "x", "1.5"] + ([] if flag in ZERO_IS_OFF else ["0"]):
        err = _refused(capsys, [*path, *required, f"{flag}={value}"], flag)
        if value == "0":
            assert "0 is refused" in err, err  # and says why
    for value in ["1", "65535"] + (["0"] if flag in ZERO_IS_OFF else []):
        build_parser().parse_known_args([*path, *required, f"{flag}={value}"])


def test_every_sim_float_knob_refuses_nan_inf_and_negatives() -> None:
    """The sim engine's --sim-* knobs (a worker's engine arguments) are refused by its configuration, one line."""
    knobs = [a.option_strings[0] for a in sim_arg_parser()._actions if isinstance(_takes(a, "1.5"), float)]
    assert "--sim-speed" in knobs and len(knobs) >= 5
    for knob in knobs:
        for value in ("nan", "inf", "-inf", "-1"):
            with pytest.raises(ConfigError):
                sim_config([f"{knob}={value}"])


def _float_fields(cfg: object) -> list[str]:
    return [f.name for f in dataclasses.fields(cfg) if isinstance(getattr(cfg, f.name), float)]  # type: ignore[arg-type]


@pytest.mark.parametrize("cfg", [RouterConfig(policy=PolicyConfig(), run_dir="/tmp"), PolicyConfig(),
                                 WorkerConfig(worker_id=0, uds="/tmp/w.sock")], ids=lambda c: type(c).__name__)
def test_every_float_field_of_a_config_refuses_non_finite_values(cfg: object) -> None:
    """Built from JSON or by code, not flags: NaN passed ``idle_timeout_s <= 0`` (and inf every bound), and the
    launcher's router then failed to decode its own configuration (NaN travels as null)."""
    names = _float_fields(cfg)
    assert len(names) >= 3
    for name in names:
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ConfigError):
                dataclasses.replace(cfg, **{name: value})  # type: ignore[type-var]


@pytest.mark.parametrize("flags", [
    ("--idle-timeout", "nan"), ("--idle-timeout", "inf"), ("--first-byte-timeout", "nan"),
    ("--connect-timeout", "nan"), ("--drain-timeout", "nan"), ("--port", "0"),
])
def test_launch_refuses_a_bad_number_before_starting_anything(tmp_path: Path, flags: tuple[str, str]) -> None:
    """The reported runs, end to end: one line, exit 2, no run directory created."""
    run_dir = tmp_path / "run"
    argv = ["--port", PORT, *flags] if flags[0] != "--port" else list(flags)
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--run-dir", str(run_dir), "--metrics-port-base",
                                "0", *argv), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and flags[0] in r.stderr, r.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("argv", [
    ["router", "--num-workers", "2", "--port", PORT, "--idle-timeout", "nan"],
    ["router", "--num-workers", "2", "--port", PORT, "--first-byte-timeout", "inf"],
    ["state", "--watch", "--interval", "nan"],
])
def test_router_and_state_refuse_a_non_finite_number(argv: list[str]) -> None:
    """Regression: the router ran with a NaN timeout; ``dplb state --watch --interval nan`` was a traceback."""
    r = subprocess.run(dplb_cmd(*argv), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "must be a finite number" in r.stderr, r.stderr
