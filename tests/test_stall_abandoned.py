"""A stall whose request was abandoned by its client (client timeout shorter than ``--stall-after``) is seen by the
router too (dplb.policy.stall with the worker's published verdict, dplb.router.state, dplb.worker.stall_probe):
real router and sim workers. The router's own stall check forgives a debt whose requests leave before
``--stall-after``; the worker's own probe then finds the engine stalled and publishes ``FLAG_STALLED``, which the
router takes as its verdict: not ready, not picked, counted, and back once the engine's progress resumes."""

from __future__ import annotations

import re
import time

import httpx
from cluster import cluster, free_port, wait_for
from fleet_support import agent_answer

STALL_AFTER = 2.0  # the router's and the workers' --stall-after here
GIVE_UP_S = 0.8  # the client's timeout: shorter than STALL_AFTER
BODY = {"model": "dplb-sim", "prompt": "a", "max_tokens": 2}
STALLED_AGENT = "down #no routable worker (engine stalled: worker 0)\n"


def _abandon_on(url: str, worker: str, tries: int = 30) -> float:
    """Send requests until one to ``worker`` hangs and its client gives up after GIVE_UP_S; return when it gave up
    (monotonic s). The ones answered before are the sim engine's last good requests."""
    for _ in range(tries):
        try:
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=GIVE_UP_S)
        except httpx.TimeoutException:
            return time.monotonic()
        assert r.status_code == 200, r.text
    raise AssertionError(f"no request to worker {worker} hung in {tries} tries")


def test_an_abandoned_stall_makes_a_one_worker_host_not_ready_and_it_comes_back(tmp_path: str) -> None:
    """Regression: the tester's repro (``--stall-after 2 --sim-stall-after 3``, a client that gives up after 0.8 s):
    the worker flagged itself stalled but the router kept /ready 200, the agent ``up``, ``dplb_worker_stalled`` 0
    and no stall log line until the worker exited. Now /ready 503 and the agent ``down`` within --stall-after + 1 s
    (+ one probe start) of the client leaving, the stall counted once and logged; when the engine resumes (no
    client request) everything comes back."""
    agent = free_port()
    stall_for = 9.0
    stall = ["--stall-after", str(STALL_AFTER), "--sim-stall-after", "3", "--sim-stall-for-s", str(stall_for)]
    with cluster(str(tmp_path), 1, worker_args={0: stall},
                 router_args=["--stall-after", str(STALL_AFTER), "--agent-port", str(agent)]) as c:
        t_left = _abandon_on(c.url, "0")
        t_down = wait_for(lambda: httpx.get(c.url + "/ready", timeout=5).status_code == 503 and time.monotonic(),
                          3 * STALL_AFTER + 3, "/ready 503", step_s=0.1) - t_left
        wait_for(lambda: agent_answer("127.0.0.1", agent) == STALLED_AGENT, 2.0, "the agent down")
        t_agent = time.monotonic() - t_left
        assert "engine stalled: worker 0" in httpx.get(c.url + "/ready", timeout=5).text
        assert c.metric("dplb_worker_stalled", {"worker": "0"}) == 1
        assert c.metric("dplb_worker_stalls_total", {"worker": "0"}) == 1
        models = httpx.get(c.url + "/v1/models", timeout=5)  # the tester's 503 without Retry-After
        assert models.status_code == 503 and models.headers.get("retry-after") == "1", models.headers
        # Nobody sends a request; the worker's own probe brings it back once the engine resumes.
        wait_for(lambda: httpx.get(c.url + "/ready", timeout=5).status_code == 200, stall_for + 4 * STALL_AFTER,
                 "/ready 200 again", step_s=0.1)
        wait_for(lambda: c.metric("dplb_worker_stalled", {"worker": "0"}) == 0, 2.0, "dplb_worker_stalled 0")
        wait_for(lambda: agent_answer("127.0.0.1", agent).startswith("up "), 2.0, "the agent up again")
        assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=20).status_code == 200
        assert c.metric("dplb_worker_stalls_total", {"worker": "0"}) == 1
        log = c.router_log()
    print(f"client left; /ready 503 after {t_down:.1f} s, agent down after {t_agent:.1f} s")
    # The worker's probe starts within a state interval of the client leaving; its check flags the stall at the
    # first tick past --stall-after; the router reads the flag at its next monitor step (0.5 s): ~2.9 s measured
    # on an idle box, 3.3 s at worst by the ticks (0.2 s intervals).
    assert t_down <= STALL_AFTER + 1.5, t_down
    assert len(re.findall(r"worker 0: .*stalled", log)) >= 1, log[-2000:]
    assert "worker 0: engine progress resumed" in log, log[-2000:]


def test_after_an_abandoned_stall_the_router_sends_nothing_to_the_stuck_worker(tmp_path: str) -> None:
    """Regression: two workers, worker 1's engine stalls on a request whose client gave up after 0.8 s; 3 s later
    /ready still listed worker 1 and the next request the router gave it waited --stall-after and got 504. Now
    /ready lists only worker 0, and the next 10 requests all go to worker 0 and succeed."""
    stall = ["--stall-after", str(STALL_AFTER), "--sim-stall-after", "3", "--sim-stall-for-s", "0"]
    with cluster(str(tmp_path), 2, worker_args={1: stall},
                 router_args=["--stall-after", str(STALL_AFTER)]) as c:
        t_left = _abandon_on(c.url, "1")
        wait_for(lambda: httpx.get(c.url + "/ready", timeout=5).json().get("routable_workers") == [0],
                 STALL_AFTER + 2.0, "/ready without worker 1", step_s=0.1)
        t_out = time.monotonic() - t_left
        got = []
        for _ in range(10):
            r = httpx.post(c.url + "/v1/completions", json=BODY, timeout=20)
            got.append((r.status_code, r.headers.get("x-sg-worker-id")))
        assert c.metric("dplb_worker_stalled", {"worker": "1"}) == 1
    print(f"worker 1 out of /ready {t_out:.1f} s after the client left; next 10: {got}")
    assert got == [(200, "0")] * 10, got
