"""``dplb bench``: a benchmark_serving-style load generator and the policy comparison (docs/DESIGN.md §11).

Modules, one job each:
- :mod:`dplb.bench.workload`: seeded workloads — prompts, output lengths and arrival times (no I/O but reading a
  JSONL dataset).
- :mod:`dplb.bench.client`: sends a workload to an OpenAI endpoint and measures every request (TTFT, ITL, E2E,
  tokens, status, ``X-SG-Worker-ID``).
- :mod:`dplb.bench.report`: turns measured requests into figures (percentiles, throughput, per-worker share),
  prints them, writes JSON.
- :mod:`dplb.bench.plots`: PNG plots (matplotlib, the ``bench`` extra).
- :mod:`dplb.bench.compare`: scenarios × policies on fresh ``dplb launch`` sim clusters, the table and the targets.
- :mod:`dplb.bench.cli`: the ``dplb bench run`` / ``dplb bench compare`` flags.

The load generator never imports the router or engine code: it is an HTTP client and works against any OpenAI
endpoint (DPLB's router, one worker, vLLM, anything else).
"""
