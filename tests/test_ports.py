"""The ports a stack binds, as ``dplb launch`` refuses them and ``dplb doctor`` reports them (one check,
:mod:`dplb.ops.ports`): two of the stack's own ports on one port, an address that is not this machine's, worker
metrics ports on ``--metrics-host``, and a port held by a client connection inside the ephemeral range. Real
``dplb`` processes and real sockets; nothing starts when a check refuses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster import dplb_cmd, free_block, free_port

from dplb.errors import ephemeral_range

TEST_NET = "192.0.2.1"  # RFC 5737 documentation address: never one of this machine's


def _launch(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    shm = f"/dev/shm/dplb_state_test_ports_{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--run-dir", str(tmp_path / "run"), "--shm-path", shm,
                                *args), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert not os.path.exists(shm) and not (tmp_path / "run").exists(), "the launcher started something"
    return r, took


def _doctor_ports(*args: str) -> dict[str, str]:
    r = subprocess.run(dplb_cmd("doctor", "--num-workers", "2", "--json", *args), capture_output=True, text=True,
                       timeout=120)
    return next(c for c in json.loads(r.stdout) if c["name"] == "ports")  # type: ignore[no-any-return]


def test_two_of_the_stacks_own_ports_on_one_port_are_refused_before_anything_starts(tmp_path: Path) -> None:
    """Regression: ``dplb launch --agent-port`` equal to ``--port`` (or to a worker's metrics port) was bind-tested
    alone, port by port, so the clash showed only once the workers had started: the router exited three times and
    the launcher gave up after ~9 s blaming "another process" (its own router). Now it is one line, exit 2, before
    anything starts (``--emit-systemd`` too), naming both users and the flag to change, and ``dplb doctor`` (which
    had no ``--agent-port``) fails its ports check with the same words."""
    port = free_block(4)
    cases = [(["--agent-port", str(port)], "--agent-port", "the router"),
             (["--agent-port", str(port + 1)], "--agent-port", "worker 0's metrics"),
             (["--metrics-port-base", str(port - 1)], "--metrics-port-base", "the router")]
    for args, flag, other in cases:
        r, took = _launch(tmp_path, "--port", str(port), *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and took < 20, (args, r.stderr)
        assert "would be bound twice by the stack" in lines[0] and f"pass another {flag}" in lines[0], lines
        assert f"by {other} (" in lines[0] and "another process" not in lines[0], lines
        emit = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--port", str(port), *args, "--emit-systemd",
                                       str(tmp_path / "units")), capture_output=True, text=True, timeout=120)
        assert emit.returncode == 2 and lines[0].split("error: ", 1)[1] in emit.stderr, emit.stderr
        check = _doctor_ports("--port", str(port), *args)
        assert check["status"] == "fail" and check["detail"] in lines[0] and check["fix"] == f"pass another {flag}", \
            check


@contextmanager
def _listening(host: str, port: int) -> Iterator[None]:
    with socket.socket() as s:
        s.bind((host, port))
        s.listen(1)
        yield


def test_doctor_names_a_foreign_address_and_checks_metrics_ports_on_metrics_host(tmp_path: Path) -> None:
    """Regression: ``dplb doctor --host <address not on this machine>`` said the router and the workers' metrics ports
    were "in use", and bound the metrics ports on ``--host`` although the workers bind them on ``--metrics-host``.
    Now it says what ``dplb launch`` says (not an address of this machine, naming ``--host``; the metrics ports, free
    on 127.0.0.1, are not blamed), a metrics port held on 127.0.0.1 fails the check under ``--host 127.0.0.2``, and a
    held ``--agent-port`` fails it too."""
    port = free_block(4)
    check = _doctor_ports("--host", TEST_NET, "--port", str(port))
    assert check["status"] == "fail" and "in use" not in check["detail"] + check["fix"], check
    assert check["detail"].startswith(f"cannot bind {TEST_NET}:{port} for the router: ") and "also" not in check[
        "detail"] and check["fix"].startswith("--host must be an address of this machine"), check
    r, _ = _launch(tmp_path, "--host", TEST_NET, "--port", str(port))
    assert r.returncode == 2 and f"{check['detail']}; {check['fix']}" in r.stderr, (check, r.stderr)
    with _listening("127.0.0.1", port + 1):  # worker 0's metrics port, where the workers bind it
        check = _doctor_ports("--host", "127.0.0.2", "--port", str(port))
        assert check["status"] == "fail" and f"127.0.0.1:{port + 1} for worker 0's metrics" in check["detail"], check
        assert _doctor_ports("--host", "127.0.0.2", "--port", str(port), "--metrics-host", "127.0.0.3")[
            "status"] == "pass"
    agent = free_port()
    with _listening("127.0.0.1", agent):
        check = _doctor_ports("--host", "127.0.0.1", "--port", str(port), "--agent-port", str(agent))
    assert check["status"] == "fail" and "for the HAProxy agent-check" in check["detail"], check
    assert "pass another --agent-port" in check["fix"], check


def test_a_port_held_by_a_client_connection_says_how_to_see_it(tmp_path: Path) -> None:
    """Regression: a port held by a client socket (a connection or a TIME-WAIT on that local port, common inside the
    kernel's ephemeral range) failed the check with a fix line of ``ss -ltnp | grep PORT``, which lists listeners
    only and showed nothing. Now launch and doctor name ``ss -tanp 'sport = :PORT'`` and, for a port inside the
    ephemeral range, say so; a port below it held by a listener gets no such note."""
    rng = ephemeral_range()
    assert rng is not None
    with socket.socket() as srv, socket.socket() as client:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        client.connect(srv.getsockname())  # its local port: an ephemeral one, held by this connection
        port = client.getsockname()[1]
        assert rng[0] <= port <= rng[1]
        r, _ = _launch(tmp_path, "--host", "127.0.0.1", "--port", str(port), "--metrics-port-base", "0")
        check = _doctor_ports("--host", "127.0.0.1", "--port", str(port), "--metrics-port-base", "0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    for text in (r.stderr, check["fix"]):
        assert f"`ss -tanp 'sport = :{port}'`" in text and "TIME-WAIT" in text, text
        assert f"{port} is in the ephemeral port range {rng[0]}-{rng[1]}" in text and "ss -ltnp" not in text, text
    low = free_port()  # the tests' ports lie below the ephemeral range
    with _listening("127.0.0.1", low):
        check = _doctor_ports("--host", "127.0.0.1", "--port", str(low), "--metrics-port-base", "0")
    assert check["status"] == "fail" and f"sport = :{low}" in check["fix"] and "ephemeral" not in check["fix"], check
