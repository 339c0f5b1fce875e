"""The sim engine's priority scheduling (vLLM ``--scheduling-policy priority``; dplb/worker/engines/sim/scheduler.py):
the waiting queue in (priority, arrival) order, no preemption for a full batch (vLLM V1), the least urgent running
sequence preempted under KV pressure and resumed with its tokens, fcfs unchanged; ``priority`` validated like
vLLM's field."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dplb.errors import ConfigError
from dplb.worker.engines.sim.engine import SimConfig, SimEngine
from tests.test_sim_engine import FAST, Served, _comp


@pytest.fixture
def sim() -> Iterator[Callable[..., Served]]:
    """Factory: ``sim(**SimConfig fields)`` → a served engine, stopped after the test."""
    d = tempfile.mkdtemp(prefix="dplbprio", dir="/tmp")  # short: UDS paths are limited to ~107 bytes
    servers: list[Served] = []

    def make(**kw: Any) -> Served:
        s = Served(SimEngine(SimConfig(**kw)), os.path.join(d, f"w{len(servers)}.sock"))
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()
    shutil.rmtree(d, ignore_errors=True)


def _order(s: Served, first: dict[str, Any], then: list[dict[str, Any]]) -> list[int]:
    """Send ``first``, then (once it runs) ``then`` one after another; the indexes of ``then`` in completion order."""
    done: list[int] = []

    async def main() -> None:
        async with s.aclient() as c:
            async def one(i: int, body: dict[str, Any]) -> None:
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                if i >= 0:
                    done.append(i)
            head = asyncio.ensure_future(one(-1, first))
            while s.engine.stats().num_running == 0:
                await asyncio.sleep(0.005)
            tasks = []
            for i, body in enumerate(then):
                tasks.append(asyncio.ensure_future(one(i, body)))
                while s.engine.stats().num_waiting < i + 1:  # queued in this order
                    await asyncio.sleep(0.005)
            await asyncio.gather(head, *tasks)
    asyncio.run(main())
    return done


def _preemptions(s: Served) -> float:
    m = re.search(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", s.client.get("/metrics").text, re.M)
    assert m, "vllm:num_preemptions_total missing"
    return float(m.group(1))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_queue_order_follows_the_policy(sim: Callable[..., Served], policy: str) -> None:
    s = sim(max_num_seqs=1, scheduling_policy=policy, **{**FAST, "decode_step_s": 0.01})
    then = [_comp(3, priority=p) for p in (5, 1, -2, 1)]
    got = _order(s, _comp(20), then)
    # priority: lower first, equals in arrival order (vLLM V1's (priority, arrival_time)); fcfs ignores the field
    assert got == ([2, 1, 3, 0] if policy == "priority" else [0, 1, 2, 3])
    assert _preemptions(s) == 0  # a full batch preempts nothing, whatever the priority (vLLM V1)


def test_kv_pressure_preempts_the_least_urgent_running_request_which_resumes(sim: Callable[..., Served]) -> None:
    # each request needs ceil((10 + 40) / 16) = 4 blocks = the whole cache; 16 batch slots are free
    s = sim(kv_blocks=4, block_size=16, max_model_len=64, decode_step_s=0.01, decode_step_s_per_seq=0.0,
            scheduling_policy="priority")
    prompt = " ".join(f"t{i}" for i in range(10))
    ends: dict[str, float] = {}

    async def main() -> dict[str, Any]:
        async with s.aclient() as c:
            async def one(name: str, body: dict[str, Any]) -> dict[str, Any]:
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                ends[name] = asyncio.get_running_loop().time()
                return dict(r.json())
            batch = asyncio.ensure_future(one("batch", _comp(40, prompt=prompt, priority=1)))
            while s.engine.scheduler.generation_tokens_total < 10:
                await asyncio.sleep(0.005)
            urgent = await one("urgent", _comp(40, prompt=prompt + " x", priority=0))
            assert urgent["usage"]["completion_tokens"] == 40
            return await batch
    batch = asyncio.run(main())
    assert ends["urgent"] < ends["batch"]  # the batch request made room and finished after it
    assert batch["usage"]["completion_tokens"] == 40 and len(batch["choices"][0]["text"].split()) == 40
    assert _preemptions(s) == 1


def test_fcfs_under_kv_pressure_preempts_nothing(sim: Callable[..., Served]) -> None:
    s = sim(kv_blocks=4, block_size=16, max_model_len=64, decode_step_s=0.01, decode_step_s_per_seq=0.0)
    prompt = " ".join(f"t{i}" for i in range(10))
    got = _order(s, _comp(40, prompt=prompt, priority=5), [_comp(40, prompt=prompt + " x", priority=0)])
    assert got == [0] and _preemptions(s) == 0


def test_priority_field_and_policy_are_validated(sim: Callable[..., Served]) -> None:
    s = sim(**FAST)
    for bad in ("high", 1.5, True):
        r = s.client.post("/v1/completions", json=_comp(2, priority=bad))
        assert r.status_code == 400 and "priority must be an integer" in r.json()["error"]["message"], r.text
    assert s.client.post("/v1/completions", json=_comp(2, priority=-3)).status_code == 200  # fcfs: accepted
    with pytest.raises(ConfigError, match="scheduling_policy must be fcfs or priority"):
        SimConfig(scheduling_policy="lifo")
