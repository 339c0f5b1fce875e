"""The TCP ports one DPLB stack binds, checked before anything starts: what ``dplb launch`` refuses and what
``dplb doctor``'s ``ports`` check reports, with the same words.

Contract
- :func:`stack_ports` lists them as :class:`PortUse` (address, port, what binds it, the flag that moves the port,
  the flag that sets the address): the router (``--host``/``--port``), the HAProxy agent-check when on (the router
  binds it on ``--host``: ``--agent-port``), each worker's metrics port (``--metrics-host``/``--metrics-port-base``).
- :func:`clash` finds two of them on one port and overlapping addresses (equal, or either a wildcard:
  ``0.0.0.0``/``::`` take the port on every address): the stack would bind one port twice, so it is refused as a
  configuration error naming both flags, never reported later as "something holds it".
- :func:`try_bind` bind-tests one (``SO_REUSEADDR``, as the stack binds) and returns the error
  :func:`dplb.errors.bind_error` makes of a failure: in use (with :func:`dplb.errors.port_holders_hint`), not an
  address of this machine (naming the address flag), or another reason; None when it binds.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from dplb.errors import ConfigError, bind_error
from dplb.runtime.serving import bind_tcp

_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class PortUse:
    """One TCP port the stack binds: ``host:port``, ``who`` binds it ("the router", "worker 0's metrics"), ``flag``
    moves it, ``host_flag`` sets the address."""

    host: str
    port: int
    who: str
    flag: str
    host_flag: str


def stack_ports(host: str, port: int, metrics_host: str, metrics_ports: list[int],
                agent_port: int | None = None) -> list[PortUse]:
    """The ports of a stack whose router binds ``host:port`` (and ``agent_port`` there, when not None) and whose
    workers serve metrics on ``metrics_host`` at ``metrics_ports`` (module docstring)."""
    uses = [PortUse(host, port, "the router", "--port", "--host")]
    uses += [PortUse(metrics_host, p, f"worker {k}'s metrics",
                     "--metrics-port-base (e.g. 31001; 0 = no worker metrics)", "--metrics-host")
             for k, p in enumerate(metrics_ports)]
    if agent_port:  # last: a clash names it (the one port that does not follow --port)
        uses.append(PortUse(host, agent_port, "the HAProxy agent-check", "--agent-port", "--host"))
    return uses


def _addresses(host: str) -> frozenset[str]:
    """The addresses ``host`` names, in one spelling (a name resolved; a wildcard or an unresolvable name as
    given)."""
    try:
        return frozenset({ipaddress.ip_address(host).compressed})
    except ValueError:
        pass
    try:
        return frozenset(ipaddress.ip_address(str(i[4][0])).compressed
                         for i in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return frozenset({host.lower()})


def _overlap(a: str, b: str) -> bool:
    """Whether binding one port on ``a`` and on ``b`` would collide."""
    if a in _WILDCARDS or b in _WILDCARDS:
        return True
    return bool(_addresses(a) & _addresses(b))


def clash(uses: list[PortUse]) -> ConfigError | None:
    """The error for the first two ``uses`` of one port on overlapping addresses (module docstring), else None."""
    for i, a in enumerate(uses):
        for b in uses[i + 1:]:
            if a.port == b.port and _overlap(a.host, b.host):
                flag, other = b.flag.split(" ")[0], a.flag.split(" ")[0]
                return ConfigError(f"port {b.port} would be bound twice by the stack: by {b.who} ({flag}, on "
                                   f"{b.host}) and by {a.who} ({other}, on {a.host}); pass another {flag}")
    return None


def try_bind(use: PortUse) -> ConfigError | None:
    """Bind-test ``use``; the error a failure means (:func:`dplb.errors.bind_error`), or None when it binds."""
    try:
        bind_tcp(use.host, use.port).close()
    except OSError as e:
        return bind_error(use.host, use.port, e, use.flag, use.who, use.host_flag)
    return None


__all__ = ["PortUse", "clash", "stack_ports", "try_bind"]
