"""The tenant gate's configuration side: reading the tenants file (with its last good copy), each tenant's rate
limits kept across reloads, and the SLO figures (docs/DESIGN.md §15).

Contract
- :func:`read_tenants`: the configuration a router runs — the tenants file plus ``--api-key``'s tenant
  (``default``, least urgent class), or the single tenant without a file. A file that does not load raises
  :class:`dplb.errors.ConfigError` (a reload keeps what runs), except at a start with a last good copy of it in the
  run directory (:func:`dplb.tenants.load_tenants_or_last_good`): then the copy, one ERROR line and
  ``dplb_tenants_file_valid 0``. At a start of a ``--processes N`` group's process (N > 1) with limited tenants, the
  start line says that their limits are enforced group-wide (:func:`dplb.router.group_quota.group_limits_note`).
- :func:`limits_for`: one :class:`dplb.router.limits.TenantLimits` per tenant; a tenant whose limits did not change
  keeps its buckets (a reload neither refills nor empties them).
- :func:`publish_slos` / :func:`count_slo`: ``dplb_tenant_slo_objective`` from the file, and one finished request
  counted against its class's SLOs (``dplb_tenant_slo_events_total``).
"""

from __future__ import annotations

import dataclasses
import logging

from dplb.config import RouterConfig
from dplb.errors import ConfigError
from dplb.obs.metrics_tenant import TenantMetrics, TenantsFileMetrics
from dplb.router.group_quota import group_limits_note
from dplb.router.limits import TenantLimits
from dplb.tenants import (
    DEFAULT_TENANT,
    Tenant,
    TenantsConfig,
    hash_key,
    last_good_path,
    load_tenants_or_last_good,
    single_tenant,
)

log = logging.getLogger("dplb.router.tenants")


def read_tenants(cfg: RouterConfig, file_metrics: TenantsFileMetrics | None, starting: bool = False
                 ) -> TenantsConfig:
    """The configuration (module docstring); ``file_metrics`` (None without ``--tenants``) gets whether the file
    loaded. Raises :class:`ConfigError` when the file does not load (at a start: only without a last good copy)."""
    path, key = cfg.tenants_file, cfg.api_key
    if path is None:
        return single_tenant(key)
    try:
        tc, err = load_tenants_or_last_good(path, cfg.run_dir)
        if err is not None and not starting:
            raise err
    except ConfigError:
        if file_metrics is not None:
            file_metrics.loaded(False)
        raise
    if err is not None:
        log.error("tenants file not loaded, starting with its last good copy %s: %s", last_good_path(cfg.run_dir),
                  err)
    if file_metrics is not None:
        file_metrics.loaded(err is None)
    if key:
        extra = Tenant(DEFAULT_TENANT, (hash_key(key),), priority=tc.classes[-1])
        tc = dataclasses.replace(tc, tenants=(*tc.tenants, extra))
    note = group_limits_note(cfg.processes, tc) if starting else None
    if starting and err is None:
        log.info("tenants file %s loaded: %s%s", path, tc.summary(), f"; {note}" if note else "")
    elif note:
        log.info("%s", note)
    return tc


def limits_for(tc: TenantsConfig, old: dict[str, TenantLimits]) -> dict[str, TenantLimits]:
    """Each tenant's limits under ``tc``: its ``old`` ones when its rates are unchanged, else new full buckets."""
    new = {}
    for t in tc.tenants:
        prev = old.get(t.name)
        same = prev is not None and (prev.requests.rate if prev.requests else None) == t.requests_per_s and (
            prev.tokens.capacity if prev.tokens else None) == t.tokens_per_min
        new[t.name] = prev if same and prev is not None else TenantLimits(t)
    return new


def publish_slos(metrics: TenantMetrics, tc: TenantsConfig) -> None:
    """``dplb_tenant_slo_objective`` from the file (what the burn-rate alerts divide by), and every tenant's
    ``dplb_tenant_slo_events_total`` series of its class's SLOs at 0, good and bad: a ``result="bad"`` series that
    appears only with the first bad event left the error-budget panel empty ("no data") while nothing had failed
    (Prometheus's advice: initialise the label values you know)."""
    for cls, slo in tc.slos.items():
        kinds = [k for k, on in (("availability", slo.availability is not None), ("ttft", slo.ttft_s is not None))
                 if on]
        if slo.availability is not None:
            metrics.slo_objective.labels(cls, "availability").set(slo.availability)
        if slo.ttft_s is not None:
            metrics.slo_objective.labels(cls, "ttft").set(slo.ttft_target)
        for t in tc.tenants:
            if t.priority == cls:
                for kind in kinds:
                    for result in ("good", "bad"):
                        metrics.slo_events.labels(t.name, cls, kind, result)


def count_slo(metrics: TenantMetrics, tc: TenantsConfig, t: Tenant, outcome: str, ttft_s: float | None) -> None:
    """One request of tenant ``t`` against its class's SLOs: availability counts ok, client_error (good) and
    server_error (bad); TTFT counts successful streamed requests (``ttft_s`` None otherwise: the first body byte of
    a response that is not a stream is the whole answer, not a first token), bad when over ``ttft_s``."""
    slo = tc.slos.get(t.priority)
    if slo is None:
        return
    ev = metrics.slo_events
    if slo.availability is not None and outcome in ("ok", "client_error", "server_error"):
        ev.labels(t.name, t.priority, "availability", "bad" if outcome == "server_error" else "good").inc()
    if slo.ttft_s is not None and outcome == "ok" and ttft_s is not None:
        ev.labels(t.name, t.priority, "ttft", "bad" if ttft_s > slo.ttft_s else "good").inc()
