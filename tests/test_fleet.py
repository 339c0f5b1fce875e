"""The host load report and what reads it, on real routers in front of real sim workers: the Model Server
Protocol families on /metrics (checked with the Endpoint Picker's own extraction rules), the HAProxy agent-check
port, the ORCA header, the drain notice and their bad inputs."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import statistics
import subprocess
import time

import httpx
import pytest
from cluster import Cluster, cluster, dplb_cmd, free_port
from epp_rules import extract, picker_filter, picker_scores
from fleet_support import agent_answer

from dplb.router.host_report import PICKER_QUEUE_PER_WORKER

CHAT = {"model": "dplb-sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 40}


def chat(c: Cluster, headers: dict[str, str] | None = None, max_tokens: int = 40) -> httpx.Response:
    return httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "max_tokens": max_tokens},
                      headers=headers or {}, timeout=60)


def test_epp_reads_one_host_aggregate_per_family(tmp_path: pytest.TempPathFactory) -> None:
    """Under load, the EPP's rules find exactly one series per family, and it is the host's aggregate: the sum
    of the per-worker dplb_* figures, the KV blocks of both workers, within the scrape budget."""
    slow = ["--sim-chunk-delay-s", "0.05", "--sim-max-num-seqs", "4", "--sim-kv-blocks", "1000"]
    with cluster(str(tmp_path), 2, worker_args={0: slow, 1: slow}) as c:
        idle = extract(httpx.get(c.url + "/metrics").text)
        assert not idle.errors, idle.errors
        assert idle.series == {"vllm:num_requests_waiting": 1, "vllm:num_requests_running": 1,
                               "vllm:kv_cache_usage_perc": 1, "vllm:cache_config_info": 1}, idle.series
        assert (idle.cache_block_size, idle.cache_num_blocks) == (16, 2000)
        assert (idle.waiting_queue_size, idle.running_requests_size) == (0, 0)
        with concurrent.futures.ThreadPoolExecutor(14) as pool:
            # 8 batch slots: some must wait. 200 tokens at 50 ms = 10 s each, so the first batch is still running
            # when the last request arrives, even on a loaded box that takes seconds to open them (at 40 tokens
            # the first batch once finished before all 14 were open, and the host never showed 14 at once).
            futs = [pool.submit(chat, c, None, 200) for _ in range(14)]
            deadline = time.monotonic() + 15  # a loaded 2-core box can take seconds to open 14 requests
            busy = extract(httpx.get(c.url + "/metrics").text)
            while (busy.running_requests_size + busy.waiting_queue_size < 14 or not busy.running_requests_size) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)  # until every request reached the router and a worker's snapshot counts it running
                text = httpx.get(c.url + "/metrics").text
                busy = extract(text)
            lat = []
            with httpx.Client(timeout=5) as scraper:  # keep-alive, as the EPP's scraper
                for _ in range(20):
                    t0 = time.perf_counter()
                    lean = scraper.get(c.url + "/metrics/host").text
                    lat.append(time.perf_counter() - t0)
            assert not extract(lean).errors and extract(lean).series == busy.series
            assert all(f.result().status_code == 200 for f in futs)
        assert not busy.errors, busy.errors
        # Every open request counted once (engine running, engine waiting, or sent but not yet counted by the
        # worker's snapshot); never more running than the two batches hold.
        assert busy.running_requests_size + busy.waiting_queue_size == 14, busy
        assert 1 <= busy.running_requests_size <= 8 and busy.waiting_queue_size >= 6, busy
        assert 0 < busy.kv_cache_usage_percent <= 1
        assert 'dplb_host_state{state="up"} 1.0' in text
        # Prometheus asks for OpenMetrics: the families keep their vllm: names there too (they were once escaped
        # to vllm_num_requests_waiting, so Prometheus stored none of them).
        om = httpx.get(c.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}).text
        assert all(any(line.startswith(f + " ") or line.startswith(f + "{") for line in om.splitlines())
                   for f in busy.series), om[:2000]
        # The EPP scrapes every 50 ms: /metrics/host (its metrics-data-source `path`) answers well inside that,
        # even on a router under load on a shared 2-core machine.
        assert statistics.median(lat) < 0.025, lat


def test_lora_adapters_reach_the_epp(tmp_path: pytest.TempPathFactory) -> None:
    """Adapters and max_lora reach the EPP: max_lora is the workers' --max-loras (the sim's --sim-max-loras)
    summed over the host, published through each worker's slot."""
    lora = ["--sim-lora-adapters", "sql-lora,chat-lora"]
    with cluster(str(tmp_path), 2, worker_args={0: [*lora, "--sim-max-loras", "3"], 1: [*lora, "--sim-max-loras", "2"]}) \
            as c:
        deadline = time.monotonic() + 10
        m = extract(httpx.get(c.url + "/metrics").text)
        while not m.active_models and time.monotonic() < deadline:  # the router asks /v1/models once ready
            time.sleep(0.2)
            m = extract(httpx.get(c.url + "/metrics").text)
        assert set(m.active_models) == {"sql-lora", "chat-lora"} and m.series["vllm:lora_requests_info"] == 1
        assert m.max_active_models == 5, m
        assert not m.errors


def test_agent_orca_and_drain_notice(tmp_path: pytest.TempPathFactory) -> None:
    """The agent answers up/weight, SIGUSR1 flips it to drain and /ready to 503 while requests still succeed,
    SIGTERM keeps serving for the drain notice; ORCA headers in both formats, a bad format gets TEXT."""
    agent = free_port()
    with cluster(str(tmp_path), 2, router_args=["--agent-port", str(agent), "--drain-notice", "1.5"]) as c:
        line = agent_answer("127.0.0.1", agent)
        assert line.startswith("up ready ") and line.endswith("%\n") and 1 <= int(line[9:-2]) <= 100, line
        r = chat(c, {"endpoint-load-metrics-format": "TEXT"}, max_tokens=2)
        text = r.headers["endpoint-load-metrics"]
        assert text.startswith("TEXT ") and "application_utilization=" in text and "rps_fractional=" in text
        fields = dict(kv.split("=") for kv in text[5:].split(", "))
        assert 0 <= float(fields["application_utilization"]) <= 1 and float(fields["rps_fractional"]) > 0
        j = chat(c, {"endpoint-load-metrics-format": "json"}, max_tokens=2).headers["endpoint-load-metrics"]
        assert j.startswith("JSON {") and '"named_metrics":{' in j
        assert chat(c, {"endpoint-load-metrics-format": "BIN, or yaml?"}, max_tokens=2
                    ).headers["endpoint-load-metrics"].startswith("TEXT ")
        assert "endpoint-load-metrics" not in chat(c, max_tokens=2).headers  # mode "asked": not asked
        assert c.router is not None
        c.router.send_signal(signal.SIGUSR1)
        time.sleep(0.3)
        assert agent_answer("127.0.0.1", agent) == "drain\n"
        assert httpx.get(c.url + "/ready").status_code == 503
        assert chat(c, max_tokens=2).status_code == 200  # still serving: the balancer moves traffic first
        t0 = time.monotonic()
        c.router.send_signal(signal.SIGTERM)
        # The drain began about 0.5 s ago: the router serves about 1 s more before it closes its socket.
        assert chat(c, max_tokens=2).status_code == 200
        c.router.wait(15)
        assert 0.8 < time.monotonic() - t0 < 10


def test_taken_agent_port_is_one_line_error(tmp_path: pytest.TempPathFactory) -> None:
    with socket.socket() as hold:
        hold.bind(("127.0.0.1", 0))
        hold.listen(1)
        port = hold.getsockname()[1]
        with cluster(str(tmp_path), 1) as c:
            r = subprocess.run(dplb_cmd("router", "--host", "127.0.0.1", "--port", str(free_port()), "--run-dir",
                                        c.run_dir, "--agent-port", str(port), "--processes", "1"),
                               env=c.env(), capture_output=True, text=True, timeout=60)
        # `dplb launch` refuses it before starting anything (it once restarted its router three times first).
        t0 = time.monotonic()
        launch = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--host", "127.0.0.1", "--port",
                                         str(free_port()), "--agent-port", str(port), "--metrics-port-base", "0",
                                         "--run-dir", str(tmp_path / "launch-run"), "--shm-path",
                                         f"/dev/shm/dplb_state_test_agent_{port}"),
                                capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    for res in (r, launch):
        assert res.returncode != 0
        err = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert any(f"cannot bind 127.0.0.1:{port} for the HAProxy agent-check" in ln and "--agent-port" in ln
                   for ln in err), res.stderr
        assert "Traceback" not in res.stderr
    assert len(launch.stderr.strip().splitlines()) == 1 and launch.returncode == 2 and took < 20, launch.stderr


def test_host_without_segment_is_up_while_it_serves(tmp_path: pytest.TempPathFactory) -> None:
    """The segment deleted: the router keeps serving on its own in-flight counts, so the host must not report
    down to its balancer (it once did, and the balancer would have dropped a serving host)."""
    import os

    agent = free_port()
    with cluster(str(tmp_path), 2, router_args=["--agent-port", str(agent)]) as c:
        os.unlink(c.shm_path)
        deadline = time.monotonic() + 10
        while '"shm_segment_present":false' not in httpx.get(c.url + "/ready").text.replace(" ", ""):
            assert time.monotonic() < deadline, "the router did not notice the segment was gone"
            time.sleep(0.2)
        time.sleep(0.5)  # a few report intervals
        assert chat(c, max_tokens=2).status_code == 200
        text = httpx.get(c.url + "/metrics/host").text
        assert 'dplb_host_state{state="up"} 1.0' in text, text
        assert agent_answer("127.0.0.1", agent).startswith("up ready ")


def _orca(r: httpx.Response) -> dict[str, float]:
    text = r.headers["endpoint-load-metrics"]
    assert text.startswith("TEXT "), text
    return {k: float(v) for k, v in (kv.split("=") for kv in text[5:].split(", "))}


def test_a_down_or_draining_host_is_the_endpoint_pickers_last_choice(tmp_path: pytest.TempPathFactory) -> None:
    """Regression: a host with no routable worker, and a draining one, showed an idle host's figures in the Model
    Server Protocol families (waiting 0, KV usage 0): to the Endpoint Picker's queue and KV-cache scorers the *best*
    endpoint, while the agent said down/drain and ORCA utilization 1. Now both report saturation there (KV usage 1,
    waiting at the picker's default threshold per worker): the picker's saturation filter drops them at its default
    thresholds, the shipped config's (5 per worker) and with headroom, and they score lowest. And the router's own
    503 on a down host carries the ORCA report when asked (it carried none, so Envoy never saw the host's
    utilization ≥ 1), and so does a local route's 503 (/ready on a down or draining host)."""
    tmp = str(tmp_path)
    with cluster(os.path.join(tmp, "down"), 2, start_workers=False, wait_router_ready=False) as down, \
            cluster(os.path.join(tmp, "up"), 2) as up:
        down_m = extract(httpx.get(down.url + "/metrics/host").text)
        r = chat(down, {"endpoint-load-metrics-format": "TEXT"}, max_tokens=2)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, dict(r.headers))
        assert _orca(r)["application_utilization"] >= 1, r.headers
        # a router-local route's 503 carries it too (it carried none), and only when asked
        r = httpx.get(down.url + "/ready", headers={"endpoint-load-metrics-format": "TEXT"})
        assert r.status_code == 503 and _orca(r)["application_utilization"] >= 1, r.headers
        assert "endpoint-load-metrics" not in httpx.get(down.url + "/ready").headers
        r = chat(up, {"endpoint-load-metrics-format": "TEXT"}, max_tokens=2)
        assert r.status_code == 200 and _orca(r)["application_utilization"] < 1
        idle = extract(httpx.get(up.url + "/metrics/host").text)
        assert up.router is not None
        up.router.send_signal(signal.SIGUSR1)  # drain without stopping: still serving
        deadline = time.monotonic() + 10
        while 'dplb_host_state{state="drain"} 1.0' not in (text := httpx.get(up.url + "/metrics/host").text):
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        drained = extract(text)
        assert chat(up, max_tokens=2).status_code == 200
        r = httpx.get(up.url + "/ready", headers={"endpoint-load-metrics-format": "TEXT"})
        assert r.status_code == 503 and _orca(r)["application_utilization"] >= 1, (r.text, r.headers)
    saturated = PICKER_QUEUE_PER_WORKER * 2  # two workers per host
    print(f"endpoint picker's view: idle {idle}, down {down_m}, draining {drained}")
    assert not (idle.errors or down_m.errors or drained.errors)
    assert idle.kv_cache_usage_percent < 0.5 and idle.waiting_queue_size == 0
    for m in (down_m, drained):
        assert m.kv_cache_usage_percent == 1.0 and m.waiting_queue_size == saturated, m
    eps = {"idle": idle, "down": down_m, "draining": drained}
    for q_threshold, kv_threshold, headroom in ((5, 0.8, 0.0), (saturated, 0.8, 0.0), (saturated, 0.8, 0.25)):
        assert picker_filter(eps, q_threshold, kv_threshold, headroom) == ["idle"], (q_threshold, headroom)
    scores = picker_scores(eps)
    assert scores["down"] == scores["draining"] == 0 and scores["idle"] > 1.5, scores
