"""argparse ``type=`` converters of DPLB's numeric flags: a value no flag of its kind accepts is refused while the
command line is parsed, as one line naming the flag (``dplb router: error: argument --idle-timeout: must be a finite
number ≥ 0, got 'nan'``), before any configuration is built or anything started.

Contract: every float flag of every subcommand uses :func:`flag_number` (or :func:`flag_rate` where ``inf`` means no
limit), every TCP port flag :func:`flag_port` or :func:`flag_port_or_off` (tests/test_flags.py finds the flags in the
parsers and holds each to it). These are the kind's bounds only; each flag's own range (``--idle-timeout`` > 0,
``--latency-deadband`` < 1, …) is checked once where its configuration is validated (:mod:`dplb.config`).
"""

from __future__ import annotations

import argparse
import math


def flag_number(text: str) -> float:
    """A finite number ≥ 0: every DPLB float flag is a duration, a rate, a fraction or a weight, so ``nan``,
    ``inf`` and negatives are refused."""
    return _number(text, allow_inf=False)


def flag_rate(text: str) -> float:
    """A rate whose ``inf`` means "no limit" (``dplb bench run --request-rate``): as :func:`flag_number`, ``inf``
    allowed."""
    return _number(text, allow_inf=True)


def _number(text: str, *, allow_inf: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0{' (or inf)' if allow_inf else ''}, "
                                         f"got {text!r}")
    return value


#: Why a port flag refuses 0 (its ``--help`` says it too).
PORT_ZERO_REFUSED = "0 is refused: the stack derives its run dir, metrics ports and scrape targets from the number"


def flag_port(text: str) -> int:
    """A TCP port the stack binds and advertises: 1..65535. 0 (an ephemeral port) is refused
    (:data:`PORT_ZERO_REFUSED`)."""
    value = _port(text)
    if not 1 <= value <= 65535:
        why = f" ({PORT_ZERO_REFUSED})" if value == 0 else ""
        raise argparse.ArgumentTypeError(f"must be a TCP port 1..65535{why}, got {text!r}")
    return value


def flag_port_or_off(text: str) -> int:
    """A port flag where 0 means off (``--metrics-port``, ``--metrics-port-base``): 0..65535."""
    value = _port(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a TCP port 1..65535, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
