"""The scenarios of ``dplb bench compare``: a sim cluster shape plus a seeded workload (docs/DESIGN.md §11).

Contract
- :data:`SCENARIOS` maps a name to a :class:`Scenario`; :meth:`Scenario.workload` gives the
  :class:`~dplb.bench.workload.WorkloadSpec` for ``quick`` or full runs and a worker count.
- Every scenario runs on the sim engine with :data:`SIM_ARGS` (8 sequences per worker; a decode step of
  20 ms + 2.5 ms per running sequence), chosen so a 2-core machine streams the whole cluster's tokens without the
  client or router being the bottleneck. Capacity (requests/s) is derived from that timing model
  (:func:`capacity_rps`), so "70 % load" stays 70 % if the knobs change.
- ``extra_policies`` are reference policies run only in that scenario (``prefix_hash`` in ``shared-prefix``: the
  hit rate of pure affinity). A scenario with a ``runner`` has its own (``tenants``: :mod:`dplb.bench.tenants`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dplb.bench.workload import WorkloadSpec

MAX_NUM_SEQS = 8
DECODE_STEP_S = 0.02
DECODE_STEP_S_PER_SEQ = 0.0025
PREFILL_S_PER_TOKEN = 0.0002
#: Engine flags every compare cluster's workers get (see the module docstring).
SIM_ARGS = (f"--sim-max-num-seqs {MAX_NUM_SEQS} --sim-decode-step-s {DECODE_STEP_S} "
            f"--sim-decode-step-s-per-seq {DECODE_STEP_S_PER_SEQ} --sim-prefill-s-per-token {PREFILL_S_PER_TOKEN}")


def capacity_rps(mean_input: float, mean_output: float, speed: float = 1.0) -> float:
    """Requests/s one sim worker sustains with a full batch: ``max_num_seqs`` sequences each needing
    ``mean_output`` steps of ``decode_step + per_seq·max_num_seqs`` seconds plus its prefill, all ÷ ``speed``."""
    step = DECODE_STEP_S + DECODE_STEP_S_PER_SEQ * MAX_NUM_SEQS
    per_request_s = (mean_output * step + mean_input * PREFILL_S_PER_TOKEN) / speed
    return MAX_NUM_SEQS / per_request_s


@dataclass(frozen=True)
class Scenario:
    """One comparison scenario. ``load``: fraction of the nominal (all workers at speed 1) capacity for Poisson
    scenarios; ``worker_args``: ``{worker: engine flags}`` (a slow worker); ``warmup``: requests sent first and not
    counted (they fill the latency baseline); ``quick_prompts``/``full_prompts``: measured requests."""

    name: str
    description: str
    base: WorkloadSpec
    load: float | None = 0.7
    sim_args: str = ""
    worker_args: dict[int, str] = field(default_factory=dict)
    warmup: int = 50
    quick_prompts: int = 150
    full_prompts: int = 600
    extra_policies: tuple[str, ...] = ()
    #: Reference variants run only in this scenario: label → `dplb launch` flags (the sent-bytes index, the oracle).
    extra_variants: dict[str, str] = field(default_factory=dict)
    runner: str = ""  # "tenants": its own runner (dplb.bench.tenants), not one seeded workload per policy

    def mean_lengths(self) -> tuple[float, float]:
        """(mean input, mean output) tokens per request of this workload (multi-turn: over the turns, with the
        whole history as input; prefix-cache hits not deducted, so "70 % load" is 70 % without any cache)."""
        b = self.base
        if b.conversations:
            t = b.turns
            return b.prefix_len + b.input_len * (t + 1) / 2 + b.output_len * (t - 1) / 2, float(b.output_len)
        lf = b.long_fraction
        inp = (1 - lf) * b.input_len + lf * b.long_input_len + b.shared_prefix_fraction * b.prefix_len
        out = (1 - lf) * b.output_len + lf * b.long_output_len
        return inp, out

    def rate_rps(self, num_workers: int) -> float:
        """Poisson rate for ``load`` of ``num_workers`` nominal workers (inf when ``load`` is None)."""
        if self.load is None:
            return math.inf
        return self.load * num_workers * capacity_rps(*self.mean_lengths())

    def workload(self, num_workers: int, quick: bool, seed: int = 0) -> WorkloadSpec:
        """The seeded workload, warm-up requests included (the first :attr:`warmup` of them)."""
        n = (self.quick_prompts if quick else self.full_prompts) + self.warmup
        if self.base.conversations:
            conv = n // self.base.turns
            return replace(self.base, conversations=conv, num_prompts=conv * self.base.turns,
                           request_rate=self.rate_rps(num_workers), seed=seed)
        if self.base.burst_size:
            return replace(self.base, num_prompts=n, seed=seed)
        return replace(self.base, num_prompts=n, request_rate=self.rate_rps(num_workers), seed=seed)


MULTI_TURN = WorkloadSpec(input_len=200, output_len=32, range_ratio=0.5, prefix_len=600, conversations=1, turns=5,
                          num_prompts=5)

#: Prefix cache per worker in the cache-pressure scenarios, blocks of 16 tokens. The working set: ~26 live
#: conversations at the knee (~2.4 conversations/s × ~11 s each), each up to ~70 blocks of its own (its history
#: at the last turn, ~1,130 tokens beyond the system prompt), plus the 38-block system prompt on each worker:
#: ~2,000 blocks against 4 × 192 = 768 cached, ~2.6×.
CACHE_PRESSURE_BLOCKS = 192
#: Prefix cache per worker in ``cache-fits``: the same ~2,000-block working set at ~0.8x the workers' total cache
#: (4 x 640 = 2,560 blocks), so a conversation's history survives to its next turn when it is routed back to the
#: worker that holds it (a workload whose prefixes fit when routed well, as llm-d sized its precise-scorer benchmark).
CACHE_FITS_BLOCKS = 640
#: The policies of the cache-pressure scenarios beside the ones asked for: the sent-bytes index (the index before
#: engine truth) and the oracle (dplb.bench.oracle: what every sim engine really holds, no lag).
CACHE_PRESSURE_VARIANTS = {
    "dplb-sent": "--policy dplb --scorer-param prefix.truth=sent",
    "oracle": "--policy dplb --policy-plugin dplb.bench.oracle "
              "--weights queue=0.3,memory=0.2,latency=0.2,prefix_oracle=0.3",
}

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("homogeneous", "identical workers, Poisson arrivals at 70 % of capacity",
             WorkloadSpec(input_len=128, output_len=32, range_ratio=0.5)),
    Scenario("heterogeneous", "the last worker at half speed (a throttled or shared GPU), same 70 % load",
             WorkloadSpec(input_len=128, output_len=32, range_ratio=0.5), worker_args={-1: "--sim-speed 0.5"}),
    Scenario("bursty", "idle, then bursts of 24 requests arriving together every 3 s",
             WorkloadSpec(input_len=128, output_len=32, range_ratio=0.5, burst_size=24, burst_interval_s=3.0,
                          idle_s=1.0), load=None, warmup=0, quick_prompts=96, full_prompts=480),
    Scenario("mixed-lengths", "80 % short chat turns, 20 % long prompts with long generations, 70 % load",
             WorkloadSpec(input_len=48, output_len=16, range_ratio=0.5, long_fraction=0.2, long_input_len=1024,
                          long_output_len=96)),
    Scenario("shared-prefix", "90 % of requests start with one of 8 system prompts of 512 words (prefix cache "
             "of 160 blocks per worker: 5 prompts fit), 70 % load",
             WorkloadSpec(input_len=32, output_len=24, range_ratio=0.5, shared_prefix_fraction=0.9, num_prefixes=8,
                          prefix_len=512), sim_args="--sim-prefix-cache-blocks 160",
             extra_policies=("prefix_hash",)),
    Scenario("multi-turn", "RAG-style chat: one app-wide system prompt of 600 words, conversations of 5 turns whose "
             "user turns carry ~200 words of context (each turn sends the whole history; the next turn 1 s after "
             "the answer on average), prefix cache of 4096 blocks per worker, 70 % load",
             MULTI_TURN, sim_args="--sim-prefix-cache-blocks 4096", quick_prompts=200, full_prompts=600,
             extra_policies=("prefix_hash",)),
    Scenario("multi-turn-slow", "multi-turn with the last worker at half speed", MULTI_TURN,
             sim_args="--sim-prefix-cache-blocks 4096", worker_args={-1: "--sim-speed 0.5"}, quick_prompts=200,
             full_prompts=600, extra_policies=("prefix_hash",)),
    Scenario("cache-pressure", "multi-turn with a working set ~2.6x the workers' total prefix cache (192 blocks per "
             "worker), at the saturation knee (90 % of nominal load); adds the sent-bytes index and the oracle",
             MULTI_TURN, load=0.9, sim_args=f"--sim-prefix-cache-blocks {CACHE_PRESSURE_BLOCKS}",
             quick_prompts=200, full_prompts=600, extra_policies=("least_loaded", "round_robin"),
             extra_variants=CACHE_PRESSURE_VARIANTS),
    Scenario("cache-pressure-50", "cache-pressure at 50 % load", MULTI_TURN, load=0.5,
             sim_args=f"--sim-prefix-cache-blocks {CACHE_PRESSURE_BLOCKS}", quick_prompts=200, full_prompts=600,
             extra_policies=("least_loaded", "round_robin"), extra_variants=CACHE_PRESSURE_VARIANTS),
    Scenario("cache-fits", "cache-pressure with a working set ~0.8x the workers' total prefix cache (640 blocks "
             "per worker), at the knee (90 % of nominal load); adds the sent-bytes index and the oracle",
             MULTI_TURN, load=0.9, sim_args=f"--sim-prefix-cache-blocks {CACHE_FITS_BLOCKS}", quick_prompts=200,
             full_prompts=600, extra_variants=CACHE_PRESSURE_VARIANTS),
    Scenario("tenants", "tenant A floods (96 open requests of 200 tokens, 3x the batch slots) while tenant B sends "
             "3 req/s of 16 tokens; FIFO (no tenants file) vs the router's fair queue (--tenants, equal weights); "
             "then both backlogged (Jain's index); the first policy only",
             WorkloadSpec(input_len=16, output_len=16), load=None, warmup=0, quick_prompts=60, full_prompts=150,
             runner="tenants"),
    Scenario("burst-herd", "64 requests at once to idle workers (per-worker max/min share)",
             WorkloadSpec(input_len=128, output_len=32, burst_size=64, burst_interval_s=1.0), load=None, warmup=0,
             quick_prompts=64, full_prompts=64),
)}
