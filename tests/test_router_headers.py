"""Response headers of the router's own answers, on a real router: every 503 it sends (local routes and proxied ones)
carries ``Retry-After``; under CORS an actual (non-preflight) response carries only the actual-response CORS
headers, the preflight-only ones (``Access-Control-Allow-Methods``/``-Headers``) go on preflight answers alone."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from cluster import Cluster, cluster, wait_for

from dplb.tenants import hash_key

ORIGIN = "https://app.example.com"
ADMIN_KEY = "ops-key"
PREFLIGHT_ONLY = ("access-control-allow-methods", "access-control-allow-headers", "access-control-max-age")
BODY = {"model": "dplb-sim", "prompt": "a", "messages": [{"role": "user", "content": "a"}], "input": "a",
        "lora_name": "a", "lora_path": "/a"}
#: Every route a client can get a 503 from with no worker up: local routes (HEAD too) and proxied ones.
ROUTES = [("GET", "/ready"), ("HEAD", "/ready"), ("GET", "/v1/models"), ("HEAD", "/v1/models"),
          ("GET", "/v1/models/dplb-sim"), ("HEAD", "/v1/models/dplb-sim"), ("POST", "/v1/load_lora_adapter"),
          ("POST", "/v1/unload_lora_adapter"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/v1/embeddings"), ("POST", "/v1/responses")]


@pytest.fixture(scope="module")
def empty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A router whose only worker never started: every route that needs a worker answers 503."""
    with cluster(str(tmp_path_factory.mktemp("empty")), 1, start_workers=False, wait_router_ready=False,
                 router_args=["--num-workers", "1", "--allow-runtime-lora", "--cors-allowed-origins", ORIGIN]) as c:
        yield c


@pytest.mark.parametrize("origin", [None, ORIGIN], ids=["no-origin", "origin"])
def test_every_503_the_router_sends_carries_retry_after(empty: Cluster, origin: str | None) -> None:
    """The tester saw ``GET /v1/models`` 503 without Retry-After while every other 503 had it; walk every 503 this
    router can be made to send (with and without CORS in play) and check each one."""
    headers = {"origin": origin} if origin else {}
    got = []
    with httpx.Client(base_url=empty.url, timeout=10) as cl:
        for method, path in ROUTES:
            r = cl.request(method, path, json=None if method != "POST" else BODY, headers=headers)
            got.append((method, path, r.status_code, r.headers.get("retry-after")))
    assert all(s == 503 for _, _, s, _ in got), got
    assert [g for g in got if g[3] != "1"] == [], got


@pytest.fixture(scope="module")
def empty_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The configuration of the report: a router group (``--processes 2``) with a tenants file, no worker up."""
    tmp = tmp_path_factory.mktemp("empty-group")
    tf = tmp / "tenants.toml"
    tf.write_text(f'[tenants.ops]\napi_key_sha256 = ["{hash_key(ADMIN_KEY)}"]\nadmin = true\nrequests_per_s = 1000\n')
    with cluster(str(tmp), 1, start_workers=False, wait_router_ready=False,
                 router_args=["--num-workers", "1", "--allow-runtime-lora", "--processes", "2", "--tenants",
                              str(tf)]) as c:
        wait_for(lambda: c.metric("dplb_router_processes", {"state": "answered"}) == 2, 30, "a group of 2",
                 step_s=0.1)
        yield c


def test_every_503_of_a_router_group_with_tenants_carries_retry_after(empty_group: Cluster) -> None:
    """The report's setup (not reproduced: every 503 of this walk, over fresh connections spread on both processes,
    and of a 45 s walk of a starting ``dplb launch --router-processes 2 --tenants`` had it): an operator's key, so
    every route gets past the tenant gate to its 503."""
    got = []
    for _ in range(4):  # fresh connections: the kernel spreads them over both processes
        with httpx.Client(base_url=empty_group.url, timeout=10) as cl:
            for method, path in ROUTES:
                r = cl.request(method, path, json=None if method != "POST" else BODY,
                               headers={"authorization": f"Bearer {ADMIN_KEY}"})
                got.append((method, path, r.status_code, r.headers.get("retry-after")))
    assert all(s == 503 for _, _, s, _ in got), got
    assert [g for g in got if g[3] != "1"] == [], got


def test_cors_preflight_only_headers_are_not_on_actual_responses(empty: Cluster) -> None:
    """Regression: a plain GET with Origin got ``Access-Control-Allow-Methods: *`` and ``-Allow-Headers: *`` (Litestar
    puts them on every response); the Fetch standard's CORS protocol has them on a preflight answer only. Local
    and proxied actual responses keep allow-origin, Vary and expose-headers; the preflight keeps its own."""
    with httpx.Client(base_url=empty.url, timeout=10) as cl:
        actual = [cl.get("/health", headers={"origin": ORIGIN}), cl.get("/ready", headers={"origin": ORIGIN}),
                  cl.head("/v1/models", headers={"origin": ORIGIN}),
                  cl.post("/v1/completions", json=BODY, headers={"origin": ORIGIN})]
        pre = cl.options("/v1/models", headers={"origin": ORIGIN, "access-control-request-method": "GET",
                                                "access-control-request-headers": "authorization"})
    for r in actual:
        where = (r.request.method, r.request.url.path, dict(r.headers))
        assert r.headers.get("access-control-allow-origin") == ORIGIN, where
        assert "retry-after" in r.headers.get("access-control-expose-headers", ""), where
        assert r.headers.get_list("vary") == ["Origin"], where
        assert not [h for h in PREFLIGHT_ONLY if h in r.headers], where
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == ORIGIN, pre.headers
    assert "GET" in pre.headers["access-control-allow-methods"], pre.headers
    assert "authorization" in pre.headers["access-control-allow-headers"].lower(), pre.headers
