"""Tenant isolation on a real router with real sim workers (docs/DESIGN.md §15, README "Tenants, priorities and the
fair queue"): a ``models`` allow-list holds on every proxied route whatever the body says of the model (none,
``null``, ``""``, a number, a multipart form written to mislead), a restricted tenant learns only its own models
and its own routing decisions (not the other tenants' load on the workers), LoRA administration is an operator's,
a stored response answers only the tenant that created it, and the router's words agree with ``dplb tenants
check`` and its own headers.

Two workers with different default models: worker 0 serves ``dplb-sim`` (+ adapter ``lora-a``), worker 1
``other-base`` (+ ``lora-b``); ``--api-key`` is the admin (tenant ``default``); tenant ``ops`` has ``admin = true``
with an allow-list (an adapter-publishing key scoped to its adapters)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from dplb.router.privileges import TENANT_DECISION_FIELDS
from dplb.router.routes import PROXY_ROUTES
from dplb.tenants import hash_key
from tests.cluster import Cluster, assert_openai_error, cluster, post, wait_for

KEYS = {"lora": "lora-key", "base": "base-key", "open": "open-key", "limited": "limited-key", "ops": "ops-key"}
ADMIN = "admin-key"
SERVED = {"dplb-sim", "lora-a", "other-base", "lora-b"}
JSON_ROUTES = sorted(r.path for (m, _), r in PROXY_ROUTES.items() if r.body == "json")
AUDIO = sorted(r.path for r in PROXY_ROUTES.values() if r.body == "multipart")


def auth(tenant: str) -> dict[str, str | bytes]:
    return {"authorization": f"Bearer {KEYS.get(tenant, ADMIN)}"}


def chat(**fields: object) -> dict:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **fields}


@pytest.fixture(scope="module")
def iso(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    tmp = tmp_path_factory.mktemp("iso")
    tf = tmp / "tenants.toml"
    tf.write_text(f"""
[tenants.lora]
api_key_sha256 = ["{hash_key(KEYS['lora'])}"]
models = ["lora-a", "gone-lora"]

[tenants.base]
api_key_sha256 = ["{hash_key(KEYS['base'])}"]
models = ["dplb-sim"]

[tenants.open]
api_key_sha256 = ["{hash_key(KEYS['open'])}"]

[tenants.limited]
api_key_sha256 = ["{hash_key(KEYS['limited'])}"]
requests_per_s = 2

[tenants.ops]
api_key_sha256 = ["{hash_key(KEYS['ops'])}"]
admin = true
models = ["gone-lora"]
""")
    with cluster(str(tmp), 2, worker_args={0: ["--sim-lora-adapters", "lora-a"],
                                           1: ["--model", "other-base", "--sim-lora-adapters", "lora-b"]},
                 router_args=["--tenants", str(tf), "--api-key", ADMIN, "--allow-runtime-lora"]) as c:
        def known() -> bool:
            r = httpx.get(c.url + "/v1/models", headers=auth("admin"), timeout=5)
            return r.status_code == 200 and {m["id"] for m in r.json()["data"]} >= SERVED
        wait_for(known, 15, "both workers' model lists")
        yield c, tf


def form(*parts: tuple[str, str], audio_first: int = 0) -> tuple[bytes, str]:
    """A multipart body: ``audio_first`` bytes of a file part, then each (Content-Disposition parameters, value)
    part."""
    b = "dplbIsoBoundary"
    out = b""
    if audio_first:
        out += (f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                "Content-Type: audio/wav\r\n\r\n").encode() + b"\x01" * audio_first + b"\r\n"
    for params, value in parts:
        out += f"--{b}\r\nContent-Disposition: form-data; {params}\r\n\r\n{value}\r\n".encode()
    if not audio_first:
        out += (f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                "Content-Type: audio/wav\r\n\r\n").encode() + b"\x01" * 512 + b"\r\n"
    return out + f"--{b}--\r\n".encode(), f"multipart/form-data; boundary={b}"


def audio(c: Cluster, tenant: str, body: tuple[bytes, str], path: str = "/v1/audio/transcriptions") -> httpx.Response:
    return httpx.post(c.url + path, content=body[0], headers={"content-type": body[1], **auth(tenant)}, timeout=30)


def test_an_allow_list_holds_on_every_route_whatever_the_body_says_of_the_model(iso: tuple[Cluster, Path]) -> None:
    """Tenant ``lora`` may use lora-a only. A body naming no model was served by the worker's default model (200)
    on every route: now every JSON route refuses it 403 before any worker, without naming the defaults;
    so do ``null``, ``""``, a number, a served model outside the list, and — never checked before — the multipart
    audio form, however its ``model`` field is written. Tenant ``base`` (dplb-sim only) sending no model is served,
    only by worker 0, whose default is dplb-sim (worker 1 would have answered with other-base)."""
    c, _ = iso
    for path in JSON_ROUTES:
        for extra in ({}, {"model": None}, {"model": ""}, {"model": 123}, {"model": "dplb-sim"}, {"model": "lora-b"}):
            r = post(c, path, chat(input="x", prompt="x", **extra), headers=auth("lora"))
            assert_openai_error(r, 403, "model_not_allowed")
            assert "x-sg-worker-id" not in r.headers, (path, extra)  # the router answered, no worker saw it
            if extra.get("model", "") in ("", None):
                # No served name the tenant may not see (its /v1/models lists neither default).
                assert r.json()["error"]["message"] == (
                    "the request names no model, so a worker would serve it with its default model, which is not "
                    "one tenant lora may use; name one of its models in `model`: gone-lora, lora-a"), (path, extra)
    ok = post(c, "/v1/chat/completions", chat(model="lora-a"), headers=auth("lora"))
    assert ok.status_code == 200 and ok.headers["x-sg-worker-id"] == "0", ok.text
    for extra in ({}, {"model": None}, {"model": ""}) * 3:  # the default is checked and routed by: worker 0 only
        r = post(c, "/v1/chat/completions", chat(**extra), headers=auth("base"))
        assert r.status_code == 200 and r.headers["x-sg-worker-id"] == "0", (extra, r.text)
        assert r.json()["model"] == "dplb-sim"

    for path in AUDIO:
        assert audio(c, "lora", form(('name="model"', "lora-a")), path).status_code == 200
        for bad in (form(), form(('name="model"', "dplb-sim")), form(('name="model"', "lora-b")),
                    form(('name="model"', "lora-a"), ('name="model"', "lora-b")),  # vLLM reads the last one
                    form(('name="MODEL"', "lora-a")), form(("name=model", "lora-b")),  # not what the router read
                    form(('name="model"', "dplb-sim"), audio_first=70_000)):  # past the 64 KiB peek
            assert_openai_error(audio(c, "lora", bad, path), 403, "model_not_allowed")
        assert audio(c, "open", form(), path).status_code == 200  # no allow-list: nothing to check
        # Two fields, the first naming a model of the list that no worker serves: the two-fields 403 (what the
        # README documents), not the 404 of the first field that the served check used to answer first.
        for bad in (form(('name="model"', "gone-lora"), ('name="model"', "lora-a")),
                    form(('name="model"', "gone-lora"), ('name="model"', "gone-lora"))):
            r = audio(c, "lora", bad, path)
            assert_openai_error(r, 403, "model_not_allowed")
            assert "must carry the model once" in r.json()["error"]["message"], r.text
        assert_openai_error(audio(c, "lora", form(('name="model"', "gone-lora")), path), 404, "model_not_found")

    created = post(c, "/v1/responses", {"model": "lora-a", "input": "hi", "max_output_tokens": 2},
                   headers=auth("lora")).json()
    got = httpx.get(c.url + f"/v1/responses/{created['id']}", headers=auth("lora"), timeout=10)
    assert got.status_code == 200 and got.json()["id"] == created["id"]  # runs no model: not refused
    # The direct relay runs the gate too: it took the JSON requests the gate admitted (the lora-a chat, base's
    # nine) and declined every JSON refusal above, which the ASGI path answered (the 403s checked).
    relay = {p: c.metric("dplb_direct_relay_requests_total", {"path": p}) or 0.0
             for p in ("direct", "continued", "declined")}
    assert relay["direct"] + relay["continued"] >= 10 and relay["declined"] >= len(JSON_ROUTES) * 6, relay


def test_a_restricted_tenant_learns_only_its_models_and_its_decisions(iso: tuple[Cluster, Path]) -> None:
    """The 404 listed every served model to a tenant that /v1/models shows none of; any tenant's key read every
    tenant's routing decisions; and a decision's tenant was looked up by request id (client-chosen: two tenants
    sending the same X-Request-Id were both shown as the last one)."""
    c, _ = iso
    r = post(c, "/v1/chat/completions", chat(model="nonexist"), headers=auth("lora"))
    assert_openai_error(r, 403, "model_not_allowed")  # the same answer as for a served model outside the list
    assert r.json()["error"]["message"] == "tenant lora may not use the model `nonexist`; allowed: gone-lora, lora-a"
    r = post(c, "/v1/chat/completions", chat(model="gone-lora"), headers=auth("lora"))
    assert_openai_error(r, 404, "model_not_found")
    assert r.json()["error"]["message"] == "The model `gone-lora` does not exist. Served models: lora-a"
    r = post(c, "/v1/chat/completions", chat(model="nonexist"), headers=auth("open"))
    assert r.json()["error"]["message"].endswith("Served models: dplb-sim, lora-a, lora-b, other-base")
    r = httpx.get(c.url + "/v1/models/nonexist", headers=auth("lora"), timeout=5)
    assert_openai_error(r, 404, "model_not_found")
    assert r.json()["error"]["message"].endswith("Served models: lora-a")

    for tenant, rid, model in (("open", "same-id", "dplb-sim"), ("open", "open-only", "dplb-sim"),
                               ("lora", "same-id", "lora-a"), ("lora", "lora-only", "lora-a")):
        r = post(c, "/v1/chat/completions", chat(model=model), headers={**auth(tenant), "x-request-id": rid})
        assert r.status_code == 200, r.text

    def decisions(tenant: str) -> list[dict]:
        r = httpx.get(c.url + "/debug/decisions?limit=256", headers=auth(tenant), timeout=5)
        assert r.status_code == 200, r.text
        return [{"tenant": d["tenant"], "request_id": d["request_id"]} for d in r.json()]

    mine = decisions("lora")
    assert {d["tenant"] for d in mine} == {"lora"} and {"same-id", "lora-only"} <= {d["request_id"] for d in mine}
    assert "open-only" not in {d["request_id"] for d in mine}
    assert [d["request_id"] for d in mine].count("same-id") == 1
    assert {d["tenant"] for d in decisions("open")} == {"open"}
    every = decisions("admin")  # --api-key: the admin sees every tenant's, each with its own tenant
    assert {"open", "lora", "base"} <= {d["tenant"] for d in every}
    assert sorted(d["tenant"] for d in every if d["request_id"] == "same-id") == ["lora", "open"]



def served(c: Cluster) -> set[str]:
    return {m["id"] for m in httpx.get(c.url + "/v1/models", headers=auth("admin"), timeout=5).json()["data"]}


def test_lora_administration_is_an_operators(iso: tuple[Cluster, Path]) -> None:
    """The fan-out reaches every worker, and an adapter serves every tenant that lists it: tenant ``open`` (no
    allow-list) unloaded ``lora-b`` from under everyone (200), and any tenant could replace an adapter or make the
    workers read a path of its choosing. Now only an operator's key administers adapters — the router's
    ``--api-key`` any adapter, an ``admin = true`` tenant with an allow-list only the adapters it names — and every
    other tenant's key is 403 ``admin_only`` before anything about the workers is said."""
    c, _ = iso
    for tenant in ("open", "lora", "base"):
        for path, body in (("/v1/unload_lora_adapter", {"lora_name": "lora-b"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "lora-a"}),  # in lora's own list
                           ("/v1/load_lora_adapter", {"lora_name": "lora-x", "lora_path": "/etc"})):
            r = post(c, path + "?workers=9", body, headers=auth(tenant))  # refused before the bad ?workers= 400
            assert_openai_error(r, 403, "admin_only")
            assert r.json()["error"]["message"].startswith(f"tenant {tenant} may not load or unload LoRA adapters")
    assert {"lora-a", "lora-b"} <= served(c) and "lora-x" not in served(c)

    r = post(c, "/v1/unload_lora_adapter", {"lora_name": "lora-b"}, headers=auth("ops"))
    assert_openai_error(r, 403, "model_not_allowed")  # a scoped operator: only the adapters its list names
    assert "lora-b" in served(c)
    r = post(c, "/v1/load_lora_adapter", {"lora_name": "gone-lora", "lora_path": "/x"}, headers=auth("ops"))
    assert r.status_code == 200 and r.json()["object"] == "dplb.fanout", r.text
    assert "gone-lora" in served(c)
    r = post(c, "/v1/unload_lora_adapter", {"lora_name": "gone-lora"}, headers=auth("ops"))
    assert r.status_code == 200, r.text
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "lora-y", "lora_path": "/y"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "lora-y"})):  # --api-key: any adapter
        r = post(c, path, body, headers=auth("admin"))
        assert r.status_code == 200, r.text
    assert "lora-y" not in served(c) and {"lora-a", "lora-b"} <= served(c)


def test_the_tenant_count_and_the_rate_limit_message_agree_with_the_check_and_the_headers(
        iso: tuple[Cluster, Path]) -> None:
    """The reload line counted --api-key's tenant (6 against `dplb tenants check`'s 5) and the first start logged
    nothing; both name the admin tenants; a 429 said "retry in 168ms" beside a reset header of 968ms."""
    c, tf = iso
    check = subprocess.run([sys.executable, "-m", "dplb.cli", "tenants", "check", str(tf)], capture_output=True,
                           text=True, timeout=60, env=c.env())
    assert check.stdout == f"{tf}: OK (5 tenants, admin ops, classes default)\n", check.stderr
    log = Path(c.run_dir, "router.log")
    assert (f"tenants file {tf} loaded: 5 tenants (plus --api-key's tenant default), admin ops, classes "
            "default") in log.read_text()
    assert c.router is not None
    c.router.send_signal(signal.SIGHUP)
    wait_for(lambda: f"tenants file {tf} reloaded: 5 tenants (plus --api-key's tenant default), admin ops, "
             "classes default" in log.read_text(), 10, "the reload line")

    time.sleep(1.1)  # the bucket of `limited` (2 requests/s) is full
    codes = [post(c, "/v1/chat/completions", chat(model="dplb-sim"), headers=auth("limited")) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429], [r.text for r in codes]
    r = codes[2]
    msg, reset = r.json()["error"]["message"], r.headers["x-ratelimit-reset-requests"]
    assert f"; all 2 in {reset}, x-ratelimit-reset-requests)" in msg, (msg, reset)
    wait = msg.split("retry in ")[1].split(" ")[0]
    seconds = float(wait[:-2]) / 1000 if wait.endswith("ms") else float(wait[:-1])
    assert int(r.headers["retry-after"]) == math.ceil(seconds), (msg, r.headers)
    assert json.loads(r.text)["error"]["code"] == "rate_limit_exceeded"


FORMS = {  # Content-Disposition lines of one part, its value
    "plain": [('Content-Disposition: form-data; name="model"', "lora-a")],
    "upper header": [('CONTENT-DISPOSITION: form-data; name="model"', "lora-a")],
    "no space, tab": [('Content-Disposition:\tform-data;name="model"', "lora-a")],
    "after Content-Type": [('Content-Type: text/plain\r\nContent-Disposition: form-data; name="model"', "lora-a")],
    "unquoted": [("Content-Disposition: form-data; name=model", "lora-b")],
    "upper name": [('Content-Disposition: form-data; name="MODEL"', "lora-a")],
    "two fields": [('Content-Disposition: form-data; name="model"', "lora-a"),
                   ('Content-Disposition: form-data; name="model"', "lora-b")],
    "a file named model": [('Content-Disposition: form-data; name="model"; filename="m"', "lora-a")],
    "two lines": [('Content-Disposition: form-data; name="model"', "lora-a\r\nx")],
    "empty": [('Content-Disposition: form-data; name="model"', "")],
    "escaped name": [('Content-Disposition: form-data; name="mod\\el"', "lora-b")],
    "none": [('Content-Disposition: form-data; name="language"', "en")],
}


@pytest.mark.parametrize("case", sorted(FORMS))
def test_the_router_reads_a_forms_model_as_vllms_form_parser_does_or_refuses(case: str) -> None:
    """What the allow-list checks of an audio form is what vLLM (Starlette's MultiPartParser) will use: the same
    single value, no model on both sides, or a form the gate refuses (None or several fields)."""
    import asyncio

    formparsers = pytest.importorskip("starlette.formparsers")
    from starlette.datastructures import Headers

    from dplb.router.intake import form_models

    body = b"".join(f"--b0\r\n{h}\r\n\r\n{v}\r\n".encode() for h, v in FORMS[case]) + b"--b0--\r\n"

    async def stream() -> AsyncIterator[bytes]:
        yield body

    parsed = asyncio.run(formparsers.MultiPartParser(Headers({"content-type": "multipart/form-data; boundary=b0"}),
                                                     stream()).parse())
    theirs = parsed.get("model")
    ours = form_models(body)
    if len(ours) == 1 and ours[0] is not None:
        assert ours[0] == theirs, (ours, theirs)
    elif not ours:
        assert theirs is None, theirs
    else:  # refused by the gate: 403 before any worker
        assert len(ours) > 1 or ours == [None]


def test_a_tenants_decisions_do_not_tell_whether_another_tenant_sent_a_prompt(iso: tuple[Cluster, Path]) -> None:
    """The prefix index is shared by every tenant: tenant ``open`` sends a secret prompt, then tenant ``base``
    sends a guess at it. Its own decision said every block of the guess was already on the worker ``open`` used
    (``prefix_matched_blocks``; with a choice of workers also ``prefix_outcome: "hit"``, ``preferred`` and the
    prefix term) — an exact yes. Now a tenant's key sees its decision without any prefix-derived
    field (and no score, which sums the prefix term); the admin key still sees the hit."""
    c, _ = iso
    secret = "confidential plan: " + " ".join(f"item-{i}" for i in range(120))
    r = post(c, "/v1/chat/completions", chat(model="dplb-sim", messages=[{"role": "user", "content": secret}]),
             headers=auth("open"))
    assert r.status_code == 200, r.text
    r = post(c, "/v1/chat/completions", chat(model="dplb-sim", messages=[{"role": "user", "content": secret}]),
             headers={**auth("base"), "x-request-id": "guess"})
    assert r.status_code == 200, r.text

    def guess(tenant: str) -> dict:
        got = httpx.get(c.url + "/debug/decisions?limit=256", headers=auth(tenant), timeout=5)
        assert got.status_code == 200, got.text
        return next(d for d in got.json() if d["request_id"] == "guess")

    admin = guess("admin")  # what the tenant's key used to show: every block of the guess was already on worker 0
    w0 = admin["candidates"][0]
    assert "prefix_outcome" in admin and "preferred" in admin, admin
    assert w0["worker"] == 0 and w0["prefix_matched_blocks"] == w0["prefix_blocks"] > 0, w0
    seen = guess("base")
    assert "prefix_outcome" not in seen and "preferred" not in seen and "candidates" not in seen, seen
    assert not [k for k in seen if k.startswith("prefix")], seen
    assert seen["worker"] == admin["worker"] and seen["tenant"] == "base"


def test_a_tenants_decisions_do_not_show_the_load_of_the_other_tenants(iso: tuple[Cluster, Path]) -> None:
    """Tenant ``open`` holds a long stream on worker 0; tenant ``base``'s next decision carried every candidate's
    live load (``queue``, ``num_running``, ``correction``, KV use…): ``open``'s stream in worker 0's ``queue``,
    so a tenant could watch the others' traffic rise and fall. A tenant's key now reads of its own decisions only
    when, which request, which worker served it, why and the policy; the admin still reads the candidates, and
    sees the other tenant's stream in them."""
    c, _ = iso
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", c.url + "/v1/chat/completions", headers=auth("open"),
            json=chat(model="dplb-sim", stream=True, max_tokens=2000)) as held:
        assert held.status_code == 200 and held.headers["x-sg-worker-id"] == "0"
        chunks = held.iter_raw()  # kept: a dropped iterator closes the response (the client leaves)
        next(chunks)  # the stream is under way; wait until worker 0 publishes it running (the router's own
        # in-flight correction is dropped by the first snapshot after the send, which may not count it yet)
        wait_for(lambda: (c.metric("dplb_worker_requests_running", {"worker": "0"}) or 0) >= 1, 10, "the stream")
        r = post(c, "/v1/chat/completions", chat(model="dplb-sim"), headers={**auth("base"), "x-request-id": "watch"})
        assert r.status_code == 200, r.text

        def watch(tenant: str) -> dict:
            got = httpx.get(c.url + "/debug/decisions?limit=256", headers=auth(tenant), timeout=5)
            assert got.status_code == 200, got.text
            return next(d for d in got.json() if d["request_id"] == "watch")

        whole = watch("admin")
        w0 = next(cand for cand in whole["candidates"] if cand["worker"] == 0)
        assert w0["queue"] >= 1 and w0["num_running"] >= 1, w0  # open's stream, in base's decision
        for tenant in ("base", "ops"):  # an admin tenant's key is an operator's
            seen = watch(tenant)
            if tenant == "ops":
                assert seen == whole
                continue
            assert sorted(seen) == sorted(TENANT_DECISION_FIELDS), seen
            assert (seen["worker"], seen["reason"], seen["tenant"]) == (0, whole["reason"], "base"), seen



def test_a_stored_response_answers_only_the_tenant_that_created_it(iso: tuple[Cluster, Path]) -> None:
    """The router sends ``GET /v1/responses/{id}``, ``…/cancel`` and ``previous_response_id`` to the worker that
    created the response, for anyone: tenant ``base`` holding ``open``'s id (a leaked one, or a client-chosen
    ``request_id`` it guessed) read ``open``'s stored answer, continued ``open``'s conversation with
    ``previous_response_id``, and — creating a response under ``open``'s id as its ``request_id`` — replaced it, so
    that ``open`` read ``base``'s words back. Now each id is bound to the tenant that created it: another tenant gets
    vLLM's own 404 (409 for the request_id), an id the router cannot tell the creator of is refused too (fail
    closed), and the operators (``--api-key``, an ``admin`` tenant) may read any."""
    c, _ = iso

    def create(tenant: str, **extra: object) -> dict:
        r = post(c, "/v1/responses", {"model": "dplb-sim", "input": "open's secret plan", "max_output_tokens": 3,
                                      **extra}, headers=auth(tenant))
        assert r.status_code == 200, r.text
        return r.json()

    def get(tenant: str, rid: str) -> httpx.Response:
        return httpx.get(c.url + f"/v1/responses/{rid}", headers=auth(tenant), timeout=10)

    mine = create("open")
    guessable = create("open", request_id="chat-1")
    with httpx.stream("POST", c.url + "/v1/responses", headers=auth("open"), timeout=30, json={
            "model": "dplb-sim", "input": "x", "max_output_tokens": 3, "stream": True}) as s:
        lines = list(s.iter_lines())  # read to the end: a stream left early is aborted, not stored
    streamed = next(json.loads(ln[6:])["response"]["id"] for ln in lines if '"response.created"' in ln)
    odd = create("open", request_id="chat 2!")  # no id of the LRU's pattern: never pinned, routed by score
    ids = [mine["id"], guessable["id"], streamed, odd["id"]]
    for rid in ids:
        own = get("open", rid)
        assert own.status_code == 200 or rid == odd["id"], own.text  # (odd: whichever worker the score picks)
        for tenant in ("base", "lora"):
            r = get(tenant, rid)
            assert_openai_error(r, 404, "response_not_found")
            assert r.json()["error"]["message"] == f"Response with id '{rid}' not found.", r.text
            assert "x-sg-worker-id" not in r.headers  # the router answered: no worker saw it
            r = httpx.post(c.url + f"/v1/responses/{rid}/cancel", headers=auth(tenant), timeout=10)
            assert_openai_error(r, 404, "response_not_found")
        r = post(c, "/v1/responses", {"model": "dplb-sim", "input": "and then?", "previous_response_id": rid},
                 headers=auth("base"))
        assert_openai_error(r, 404, "response_not_found")
        r = post(c, "/v1/responses", {"model": "dplb-sim", "input": "injected", "request_id": rid},
                 headers=auth("base"))
        assert_openai_error(r, 409, "response_id_in_use")
    for tenant in ("admin", "ops"):  # operators read any
        assert get(tenant, mine["id"]).json()["output"] == mine["output"]
    assert get("open", guessable["id"]).json()["output"] == guessable["output"]  # not replaced by base's
    follow = post(c, "/v1/responses", {"model": "dplb-sim", "input": "and then?", "previous_response_id": mine["id"],
                                       "max_output_tokens": 2}, headers=auth("open"))
    assert follow.status_code == 200 and follow.json()["previous_response_id"] == mine["id"], follow.text
    # An id the router does not know (forgotten, another router process's, a guess): refused to a tenant; an
    # operator's request goes to a worker, which answers its own 404.
    assert_openai_error(get("open", "resp_" + "0" * 32), 404, "response_not_found")
    r = get("admin", "resp_" + "0" * 32)
    assert r.status_code == 404 and "x-sg-worker-id" in r.headers, r.text
