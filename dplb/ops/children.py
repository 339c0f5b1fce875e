"""The processes ``dplb launch`` supervises (:class:`Child`): start in its own process group with its CPU
pinning, liveness, signals, reaping what an engine left in its group, and the tail of this launcher's run in its
log (docs/DESIGN.md §10).

Contract: a child's log is appended to, never truncated; each launcher run starts with a :data:`_RUN_MARK` line so
:meth:`Child.log_tail` shows only this run's lines. Restart backoff starts at :data:`BACKOFF_START_S` and doubles up
to :data:`BACKOFF_MAX_S` (the launcher applies it). A child with ``shm`` (a worker: its engine's shared-memory files,
:mod:`dplb.ops.shm_leftovers`) has what its processes mapped turned into removal candidates when it is reaped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field

from dplb.ops.placement import preexec
from dplb.ops.shm_leftovers import ShmLeftovers
from dplb.runtime.procs import die_with_parent, reap_group

log = logging.getLogger("dplb.launch")
BACKOFF_START_S, BACKOFF_MAX_S = 1.0, 30.0
_RUN_MARK = "=== dplb launch"


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: str
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_START_S
    next_start: float = 0.0
    start_failures: int = 0
    ever_ready: bool = False
    extra: dict[str, object] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()  # pinned to these CPUs before exec (dplb.ops.placement); () = not pinned
    shm: ShmLeftovers | None = None  # the /dev/shm files its processes map (a worker's engine), removed when reaped

    def start(self) -> None:
        with open(self.log_path, "ab") as f:
            if self.started_at == 0.0:  # first start by this launcher: mark where its lines begin (logs are kept)
                f.write(f"{_RUN_MARK} {time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}\n".encode())
                f.flush()
            # Its own process group (a terminal's Ctrl-C reaches the launcher only, which drains the children in
            # order) but the launcher's session: a session is a kernel autogroup, and engines in separate
            # autogroups do not share a core fairly (a yielding vLLM engine kept one for seconds).
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, process_group=0,
                                         preexec_fn=preexec(self.cpus, die_with_parent))
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def reap(self) -> None:
        """After the process exited: kill what it left in its process group (an engine's own children); what its
        processes mapped in ``/dev/shm`` becomes a removal candidate (:meth:`ShmLeftovers.sweep` removes it once
        nothing uses it)."""
        if self.proc is not None and self.proc.poll() is not None and reap_group(self.proc.pid):
            log.info("%s: killed the processes it left behind (process group %d)", self.name, self.proc.pid)
        if self.shm is not None:
            self.shm.reaped()

    def watch(self) -> None:
        """While it runs: note the shared-memory files its processes map (every few seconds at most)."""
        if self.shm is not None and self.proc is not None and self.alive():
            self.shm.record(self.proc.pid)

    def log_tail(self, n: int = 20) -> str:
        """The last ``n`` lines this launcher's run wrote (earlier runs in the same run dir are left out)."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = f.readlines()
        except OSError:
            return ""
        starts = [i for i, ln in enumerate(lines) if ln.startswith(_RUN_MARK)]
        return "".join(lines[starts[-1] + 1 if starts else 0:][-n:])
