"""``dplb usage``, ``dplb tenants hash-key`` and ``dplb tenants check``: the usage ledger of a running router, a
key's digest for the tenants file, and a tenants file checked as the router loads it (docs/DESIGN.md §15).

Contract
- :func:`read_ledger` reads the router's ``/metrics`` (a group's answer covers every process) and sums the
  ``dplb_tenant_*`` families per tenant: ``{tenant: {requests: {outcome: n}, prompt_tokens, completion_tokens,
  cached_tokens, queued, queue_wait_s_mean, ttft_s_mean, e2e_s_mean}}`` (means from the histograms' sum / count;
  None when no sample). The queue wait counts every request that waited (one refused after its wait too), TTFT
  only streamed requests (a tenant that never streams has none), E2E only those answered OK: the table heads that
  column ``OK_E2E_MS``. Raises :class:`~dplb.errors.DPLBError` naming the URL when the router does not answer, and
  when the page is not a DPLB router's (no ``dplb_*`` family, or no Prometheus text: another server's ``/metrics``).
- :func:`format_table` renders it as one row per tenant.
"""

from __future__ import annotations

import argparse
import collections
import getpass
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dplb.config import MAX_ROUTER_PROCESSES, default_router_processes
from dplb.errors import ConfigError, DPLBError
from dplb.http_values import check_bearer_token
from dplb.obs.metrics import (
    NAME_PREFIX,
    TENANT_E2E,
    TENANT_QUEUE_WAIT,
    TENANT_QUEUED,
    TENANT_REQUESTS,
    TENANT_TOKENS,
    TENANT_TTFT,
)
from dplb.tenants import hash_key, load_tenants, shown

_MEANS = {TENANT_QUEUE_WAIT: "queue_wait_s_mean", TENANT_TTFT: "ttft_s_mean", TENANT_E2E: "e2e_s_mean"}


def read_ledger(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """The per-tenant ledger of the router at ``url`` (module docstring). Raises :class:`DPLBError` when ``url`` is
    not ``http(s)://…``, the router cannot be read, or ``url`` is not a DPLB router."""
    if not url.startswith(("http://", "https://")):
        raise DPLBError(f"--url must be the router's http://HOST:PORT, got {url!r}")
    req = urllib.request.Request(url.rstrip("/") + "/metrics",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = r.read().decode()
    except (OSError, urllib.error.URLError) as e:
        raise DPLBError(f"cannot read {url}/metrics: {getattr(e, 'reason', e)} (is the router running? --url)") \
            from None
    base = url.rstrip("/")
    try:
        dplb_page = any(fam.name.startswith(NAME_PREFIX) for fam in text_string_to_metric_families(text))
    except ValueError:  # (not Prometheus text: an HTML page, JSON, …)
        dplb_page = False
    if not dplb_page:
        raise DPLBError(f"{base} is not a DPLB router (no {NAME_PREFIX}* metrics at {base}/metrics); --url must be "
                        "the router's address (dplb launch --port, default http://127.0.0.1:30000)")
    return ledger_of(text)


def ledger_of(text: str) -> dict[str, dict[str, Any]]:
    """The ledger from Prometheus text (module docstring)."""
    out: dict[str, dict[str, Any]] = collections.defaultdict(lambda: {
        "requests": collections.Counter(), "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
        "queued": 0})
    sums: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            tenant = s.labels.get("tenant")
            if tenant is None:
                continue
            if s.name == TENANT_REQUESTS + "_total":
                out[tenant]["requests"][s.labels["outcome"]] += int(s.value)
            elif s.name == TENANT_TOKENS + "_total":
                out[tenant][f"{s.labels['kind']}_tokens"] += int(s.value)
            elif s.name == TENANT_QUEUED:
                out[tenant]["queued"] += int(s.value)
            elif s.name.endswith(("_sum", "_count")) and s.name.rsplit("_", 1)[0] in _MEANS:
                base, part = s.name.rsplit("_", 1)
                sums[(tenant, base)][0 if part == "sum" else 1] += s.value
    for (tenant, base), (total, count) in sums.items():
        out[tenant][_MEANS[base]] = total / count if count else None
    for row in out.values():
        row["requests"] = dict(row["requests"])
        for key in _MEANS.values():
            row.setdefault(key, None)
    return dict(out)


def format_table(ledger: dict[str, dict[str, Any]]) -> str:
    """One row per tenant: requests (ok / total), tokens, queued now, mean queue wait, TTFT and E2E."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    rows = [("TENANT", "OK", "REQUESTS", "PROMPT", "COMPLETION", "CACHED", "QUEUED", "WAIT_MS", "TTFT_MS", "OK_E2E_MS")]
    for name in sorted(ledger):
        r = ledger[name]
        rows.append((name, str(r["requests"].get("ok", 0)), str(sum(r["requests"].values())), str(r["prompt_tokens"]),
                     str(r["completion_tokens"]), str(r["cached_tokens"]), str(r["queued"]),
                     ms(r["queue_wait_s_mean"]), ms(r["ttft_s_mean"]), ms(r["e2e_s_mean"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                    strict=True)))
                     for row in rows)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``dplb usage`` and ``dplb tenants``."""
    p = sub.add_parser("usage", help="print the per-tenant usage ledger of a running router",
                       description="Read the router's /metrics and print requests, tokens (the engine's counts), "
                       "queue wait, TTFT (streamed requests) and E2E per tenant.")
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the router (default %(default)s)")
    p.add_argument("--api-key", default=None, help="a key the router accepts, when /metrics needs one")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_usage)
    t = sub.add_parser("tenants", help="tenants file helpers")
    ts = t.add_subparsers(dest="tenants_cmd", required=True, metavar="{hash-key,check}")
    h = ts.add_parser("hash-key", help="print the SHA-256 digest of an API key for api_key_sha256",
                      description="Print the digest of KEY (or of a key typed at the prompt, or read from stdin "
                      "with '-' or when stdin is not a terminal: keeps it out of the shell history).")
    h.add_argument("key", nargs="?", default=None, help="the key; omit to type it (or to read a pipe), '-' to read "
                   "stdin")
    h.set_defaults(func=_cmd_hash_key)
    c = ts.add_parser("check", help="validate a tenants file (before a SIGHUP reload): one line, exit 0 or 2",
                      description="Load FILE as the router would: print one line, 'FILE: OK (…)' and exit 0, or the "
                      "error (file, key, why) and exit 2.")
    c.add_argument("file", help="the tenants file (TOML)")
    c.add_argument("--router-processes", "--processes", dest="router_processes", type=int,
                   default=default_router_processes(),
                   help="the router processes that will load it (dplb launch --router-processes, dplb router "
                   "--processes; default theirs, here %(default)s): with more than one, a note on stderr says how "
                   "the limits hold for the group")
    c.set_defaults(func=_cmd_check)


def _cmd_usage(args: argparse.Namespace, rest: list[str]) -> int:
    ledger = read_ledger(args.url, args.api_key)
    if not ledger:  # the router keeps no ledger without a tenants file, an API key or the access log
        print(f"{args.url} keeps no usage ledger (it runs without --tenants, --api-key and --access-log)",
              file=sys.stderr)
    print(json.dumps(ledger, indent=2, sort_keys=True) if args.json else format_table(ledger))
    return 0


def _cmd_check(args: argparse.Namespace, rest: list[str]) -> int:
    """Print one line for a tenants file that loads (and, for more than one router process with limited tenants,
    a note on stderr: :func:`dplb.router.group_quota.group_limits_note`); :class:`~dplb.errors.ConfigError` (exit 2)
    for one that does not."""
    from dplb.router.group_quota import group_limits_note

    if not 1 <= args.router_processes <= MAX_ROUTER_PROCESSES:
        raise ConfigError(f"--router-processes must be 1..{MAX_ROUTER_PROCESSES}, got {args.router_processes}")
    tc = load_tenants(args.file)
    print(f"{shown(tc.path)}: OK ({tc.summary()})")
    note = group_limits_note(args.router_processes, tc)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _cmd_hash_key(args: argparse.Namespace, rest: list[str]) -> int:
    """Print KEY's digest; KEY from the argument, stdin ('-', or no KEY and stdin not a terminal: read without
    getpass, whose fallback warns ``GetPassWarning``; exactly one line) or the terminal's prompt (a trailing ``\n``
    / ``\r\n`` of a line read is not part of it). Raises :class:`DPLBError` for no key, and
    :class:`~dplb.errors.ConfigError` (exit 2) for stdin of several lines or a key the router would refuse as
    ``--api-key`` (:func:`dplb.config.check_bearer_token`: the one check), the empty one included."""
    key = args.key
    if key == "-" or (key is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
        if not text and key is None:  # nothing piped in (stdin at EOF)
            raise DPLBError("no key given: pass KEY, type it at the prompt, or pipe it with '-'")
        lines = text.splitlines() or [""]
        if len(lines) > 1:  # a key file with a comment or a second key: hashing only the first would be silent
            raise ConfigError(f"stdin has {len(lines)} lines: give one key per run (one line, its trailing newline "
                              "optional)")
        key = lines[0]
    elif key is None:
        try:
            key = getpass.getpass("API key: ")
        except EOFError:  # no terminal and nothing on stdin
            raise DPLBError("no key given: pass KEY, type it at the prompt, or pipe it with '-'") from None
    check_bearer_token(key, "the key")
    print(hash_key(key))
    return 0


__all__ = ["add_parsers", "format_table", "ledger_of", "read_ledger"]
