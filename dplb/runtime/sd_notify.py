"""systemd integration: ``sd_notify`` (READY=1, WATCHDOG=1, STATUS=…), a leaf module the hot paths may import.

Contract: :func:`notify` is a no-op outside systemd (no ``NOTIFY_SOCKET``) and never raises. :class:`Watchdog`
pings at half of ``WATCHDOG_USEC`` when it is set (sd_watchdog_enabled semantics: honour ``WATCHDOG_PID``).
The unit files live in ``deploy/systemd/``; their env files are written by :mod:`dplb.ops.systemd_units`.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("dplb.systemd")


def notify(message: str) -> bool:
    """Send ``message`` (e.g. "READY=1") to systemd. Returns True if it was sent."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError as e:
        log.warning("sd_notify(%r) failed: %s", message, e)
        return False


class Watchdog:
    """Sends WATCHDOG=1 at most every ``WATCHDOG_USEC / 2`` when :meth:`maybe_ping` is called."""

    def __init__(self) -> None:
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        ok = usec is not None and usec.isdigit() and (pid is None or pid == str(os.getpid()))
        self.interval_s = int(usec) / 2e6 if ok and usec else 0.0
        self._last = 0.0

    @property
    def enabled(self) -> bool:
        """True when systemd asked for watchdog pings."""
        return self.interval_s > 0

    def maybe_ping(self) -> None:
        """Ping if enabled and due. Call it from a loop that proves liveness (the collector tick)."""
        if self.interval_s <= 0:
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            notify("WATCHDOG=1")
