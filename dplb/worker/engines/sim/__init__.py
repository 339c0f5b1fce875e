"""The sim engine: a CPU simulation of vLLM, the product's default without ``--model``.

- :mod:`dplb.worker.engines.sim.engine`: the engine (ASGI app, core endpoints); ``python -m`` is ``__main__``.
- :mod:`dplb.worker.engines.sim.scheduler`: batching, KV blocks, the prefix cache, its knobs (``SimConfig``).
- :mod:`dplb.worker.engines.sim.vllm_metrics`: the engine's ``vllm:*`` metrics.
- :mod:`dplb.worker.engines.sim.api`: the extra vLLM endpoints.
- :mod:`dplb.worker.engines.sim.http`: shared HTTP plumbing.
"""
