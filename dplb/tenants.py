"""Tenants: who may call the router, with which weight, priority class, limits and models (docs/DESIGN.md §15).

Contract
- :func:`load_tenants` reads a TOML file (``--tenants FILE``) into a validated, immutable :class:`TenantsConfig`,
  or raises :class:`~dplb.errors.ConfigError` with one line naming the file and the key (``tenants.toml:
  tenants.chat.weight must be a number > 0, got -1``). Parsed once at start and on every reload; the router never
  looks at the file's text again. :func:`load_tenants_or_last_good` is what a router uses: every load that succeeds
  is kept as ``<run_dir>/tenants.last-good.toml`` (atomically), and a (re)start with a file that does not load falls
  back on that copy — a restarted router process keeps serving with the configuration its siblings run — while a
  first start with nothing to fall back on still refuses with one line.
- Keys are never stored: a tenant lists the SHA-256 hex digests of its keys (``dplb tenants hash-key`` prints one).
  :meth:`TenantsConfig.lookup` hashes the presented key once and compares it against **every** configured digest
  with :func:`hmac.compare_digest` (no early exit), so the time does not depend on which digest matched.
- ``[priorities] order`` lists the priority classes, most urgent first (default: one class, ``default``); a tenant's
  ``priority`` names one (required with more than one class). ``[priorities] reserve`` (default 0) holds batch slots
  of every worker for the more urgent classes: class rank ``r`` (0 = most urgent) may fill a worker up to
  ``max_num_seqs − reserve · r`` slots (the most urgent class all of them), so an urgent request finds a slot at once
  while a less urgent class floods (docs/DESIGN.md §15). ``[fair_queue]`` holds the Virtual Token Counter's token
  weights (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, §4: a prompt token costs
  ``prompt_token_weight``, a generated one ``output_token_weight``; the paper's evaluation uses 1 and 2) and
  ``anticipation_s`` (default :data:`ANTICIPATION_S`, 0 = off): how long a slot freed by a tenant that would be served
  next is held for that tenant's next request (:mod:`dplb.router.admission`). ``[slo.<class>]`` holds that class's
  objectives: ``availability`` (fraction of requests not failed by the server) and ``ttft_s`` with ``ttft_target``
  (the fraction of streamed requests whose TTFT must be ≤ ``ttft_s``; the router sees no first token of a response
  that is not a stream).
- :data:`DEFAULT_TENANT` is the tenant of requests when no tenants file is given (and of ``--api-key``'s key).
- Every number has a range, :data:`BOUNDS` (one table: the loader enforces it, README quotes it); ``models = []``
  is refused (it would refuse every request: leave ``models`` out for "any model"); ``admin`` is a boolean
  (``true``/``false``, no string or number). A name, key or path an error message echoes is :func:`shown`
  (escaped when it holds a control character): every message is one line.
- Operators (:attr:`Tenant.operator`): :data:`DEFAULT_TENANT` (``--api-key``'s key, or everyone when no key is
  configured) and every tenant with ``admin = true``. What only they may do on a shared router (LoRA
  administration, the whole ``/debug/decisions``, a keyed ``/metrics``, any stored response) is
  :mod:`dplb.router.privileges` and :mod:`dplb.router.ownership`.

Example::

    [priorities]
    order = ["interactive", "batch"]
    reserve = 2

    [tenants.chat]
    api_key_sha256 = ["<hex sha256 of a key>"]
    weight = 2.0
    priority = "interactive"
    requests_per_s = 50
    tokens_per_min = 200000
    max_concurrent = 64
    models = ["llama-3.1-8b", "lora-a"]

    [tenants.ops]
    api_key_sha256 = ["<hex sha256 of another key>"]
    admin = true        # an operator's key: LoRA administration, every tenant's decisions
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from dplb.errors import ConfigError

DEFAULT_TENANT = "default"
DEFAULT_CLASS = "default"
LAST_GOOD_NAME = "tenants.last-good.toml"
# The fair queue's hold for a tenant's next request (seconds): longer than a closed-loop client's turnaround from a
# response to its next request (10-220 ms measured on the loaded 2-core CI box with 60 clients in one process),
# short next to an LLM request (docs/DESIGN.md §15).
ANTICIPATION_S = 0.25
#: Bits of a tenant's tag (:func:`tenant_tag`): the value word of a response-id ring entry keeps 8 for the worker.
TENANT_TAG_BITS = 56
_TAG_MASK = (1 << TENANT_TAG_BITS) - 1
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TENANT_KEYS = frozenset({"api_key_sha256", "weight", "priority", "requests_per_s", "tokens_per_min",
                          "max_concurrent", "models", "admin"})
_TOP_KEYS = frozenset({"tenants", "priorities", "fair_queue", "slo"})
_SLO_KEYS = frozenset({"availability", "ttft_s", "ttft_target"})
#: The inclusive range of every number of a tenants file. Outside it a value is almost surely a typo, and it would
#: overflow what it feeds: ``x-ratelimit-*`` and ``Retry-After`` are integers computed from the limits (a limit of
#: 1e308 printed 309 digits; a rate of 1e-300 a Retry-After of 1e300 s), and the fair queue divides by the weight
#: (1e-300 starved its tenant). The limits' ceilings are far above one server's throughput (a router process serves
#: about 10 000 requests/s, a GPU server some 10⁵–10⁶ tokens/min per model); the floors bound a refusal's
#: Retry-After to 1 000 s (requests) and 60 s (tokens). Weights: a share ratio of at most 10⁶ between two tenants.
BOUNDS: dict[str, tuple[float, float]] = {
    "weight": (0.001, 1000.0),
    "requests_per_s": (0.001, 1e6),
    "tokens_per_min": (1.0, 1e10),
    "max_concurrent": (1, 1_000_000),
    "reserve": (0, 100_000),
    "prompt_token_weight": (0.0, 1000.0),
    "output_token_weight": (0.0, 1000.0),
    "ttft_s": (0.001, 3600.0),
    "anticipation_s": (0.0, 1.0),  # a hold is for a client already sending; a larger number is likely milliseconds
}


def tenant_tag(name: str) -> int:
    """The compact id of tenant ``name`` that every router process derives alike (the response-id rings of the
    segment carry it, :mod:`dplb.state.response_rings`): the low :data:`TENANT_TAG_BITS` bits of BLAKE2b-64 of the
    name's UTF-8 bytes, never 0 (0 is "no tenant"). :func:`parse_tenants` refuses a file whose names would share
    one."""
    tag = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") & _TAG_MASK
    return tag or 1


def hash_key(key: str) -> str:
    """The SHA-256 hex digest (64 lower-case hex digits) of an API key, as the tenants file lists it."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant. ``weight``: its fair share relative to the others (> 0); ``priority``: its class;
    ``requests_per_s`` / ``tokens_per_min`` (prompt + generated tokens, reserved at admission as the prompt
    estimate + max_tokens: :mod:`dplb.router.limits`) / ``max_concurrent``: optional limits (None = none);
    ``models``: the model ids it may use (None = all); ``admin``: its keys are operator keys (module docstring).
    """

    name: str
    key_sha256: tuple[str, ...] = ()
    weight: float = 1.0
    priority: str = DEFAULT_CLASS
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    max_concurrent: int | None = None
    models: frozenset[str] | None = None
    admin: bool = False

    @property
    def operator(self) -> bool:
        """True for an operator's key (module docstring): ``admin = true``, or :data:`DEFAULT_TENANT`."""
        return self.admin or self.name == DEFAULT_TENANT

    def may_use(self, model: Any) -> bool:
        """True when the model id ``model`` is allowed to this tenant (always without an allow-list). A request that
        names no model is checked against the model that would serve it (:meth:`dplb.router.tenancy.Gate.enter`),
        never passed through as None."""
        return self.models is None or (isinstance(model, str) and model in self.models)


@dataclass(frozen=True, slots=True)
class Slo:
    """One priority class's objectives: ``availability`` (0–1, None = none), ``ttft_s`` (seconds) with
    ``ttft_target`` (0–1: the fraction of streamed requests whose TTFT is at most ``ttft_s``)."""

    availability: float | None = None
    ttft_s: float | None = None
    ttft_target: float = 0.99


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    """A validated tenants file (module docstring). ``classes``: priority classes, most urgent first;
    ``reserve``: batch slots per worker held for each more urgent class; ``anticipation_s``: the fair queue's hold
    for a tenant's next request (seconds)."""

    path: str
    tenants: tuple[Tenant, ...]
    classes: tuple[str, ...] = (DEFAULT_CLASS,)
    prompt_token_weight: float = 1.0
    output_token_weight: float = 2.0
    slos: dict[str, Slo] = field(default_factory=dict)
    reserve: int = 0
    anticipation_s: float = ANTICIPATION_S

    def names(self) -> tuple[str, ...]:
        """Every tenant name, :data:`DEFAULT_TENANT` included (the bounded ``tenant`` label set)."""
        return tuple(dict.fromkeys((*(t.name for t in self.tenants), DEFAULT_TENANT)))

    def summary(self) -> str:
        """One phrase for logs and ``dplb tenants check``: the file's tenants, those with ``admin = true`` and the
        classes (``3 tenants, admin ops, classes a, b``); ``--api-key``'s tenant :data:`DEFAULT_TENANT`, when the
        router added it, is named apart, not counted."""
        n = sum(t.name != DEFAULT_TENANT for t in self.tenants)
        extra = f" (plus --api-key's tenant {DEFAULT_TENANT})" if n < len(self.tenants) else ""
        admins = [t.name for t in self.tenants if t.admin]
        extra += f", admin {', '.join(admins)}" if admins else ""
        return f"{n} tenant{'' if n == 1 else 's'}{extra}, classes {', '.join(self.classes)}"

    def by_name(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return next((t for t in self.tenants if t.name == name), None)

    def rank(self, priority: str) -> int:
        """The class's position in :attr:`classes` (0 = most urgent); an unknown class ranks last."""
        return self.classes.index(priority) if priority in self.classes else len(self.classes)

    def held(self, rank: int) -> int:
        """Batch slots per worker that class ``rank`` leaves free for the more urgent classes (module docstring)."""
        return self.reserve * min(rank, len(self.classes) - 1)

    def lookup(self, key: bytes) -> Tenant | None:
        """The tenant whose digests include SHA-256(``key``), or None. Constant time in which digest matched:
        every digest is compared (module docstring)."""
        digest = hashlib.sha256(key).hexdigest().encode()
        found: Tenant | None = None
        for t in self.tenants:
            for h in t.key_sha256:
                if hmac.compare_digest(digest, h.encode()) and found is None:
                    found = t
        return found


def shown(text: str) -> str:
    """``text`` (a name, key or path from the tenants file or its command line) as an error message shows it: as
    it is when every character is printable, else quoted with Python's escapes (``'a\\nb'``), so every message
    stays one line and no control character reaches a terminal or a log."""
    return text if text.isprintable() else repr(text)


def _number(where: str, v: Any, key: str, *, integer: bool = False) -> float:
    """``v`` as a float when it is a number (an integer with ``integer``) in :data:`BOUNDS` ``[key]``. Raises
    :class:`ConfigError` naming ``where`` and the range."""
    low, high = BOUNDS[key]
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or not math.isfinite(v) or not low <= v <= high:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{where} must be {kind} from {low:g} to {high:g}, got {v!r}")
    return float(v)


def _tenant(path: str, name: str, raw: Any, classes: tuple[str, ...], seen: dict[str, str]) -> Tenant:
    """Tenant ``name`` of the file (``path``: as messages show it). Raises :class:`ConfigError`."""
    where = f"{path}: tenants.{shown(name)}"
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: a tenant name is 1-64 letters, digits, '_', '.' or '-'")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table ([tenants.{name}])")
    unknown = sorted(set(raw) - _TENANT_KEYS)
    if unknown:
        raise ConfigError(f"{where}.{shown(unknown[0])} is not a tenant key; use {', '.join(sorted(_TENANT_KEYS))}")
    hashes = raw.get("api_key_sha256", [])
    if isinstance(hashes, str):
        hashes = [hashes]
    if not isinstance(hashes, list) or not hashes:
        raise ConfigError(f"{where}.api_key_sha256 must list at least one key digest (dplb tenants hash-key KEY)")
    for h in hashes:
        if not isinstance(h, str) or not _HEX64.fullmatch(h.lower()):
            raise ConfigError(f"{where}.api_key_sha256: {h!r} is not a SHA-256 hex digest (64 hex digits; "
                              "dplb tenants hash-key KEY prints one)")
        if h.lower() in seen:
            raise ConfigError(f"{where}.api_key_sha256: the digest {h[:12]}… is also tenant {seen[h.lower()]}'s")
        seen[h.lower()] = name
    priority = raw.get("priority", classes[0] if len(classes) == 1 else None)
    if priority is None:
        raise ConfigError(f"{where}.priority is missing: with [priorities] every tenant names one of its order "
                          f"({', '.join(classes)})")
    if priority not in classes:
        raise ConfigError(f"{where}.priority must be one of [priorities] order ({', '.join(classes)}), "
                          f"got {priority!r}")
    models = raw.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)):
        raise ConfigError(f"{where}.models must be a list of model ids, got {models!r}")
    if models == []:
        raise ConfigError(f"{where}.models is empty: every request of the tenant would be refused (403); leave "
                          "models out to allow every model, or list the allowed ids (models = [\"llama-3.1-8b\"])")
    admin = raw.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}.admin must be true or false, got {admin!r}")
    limits: dict[str, Any] = {}
    for key in ("requests_per_s", "tokens_per_min", "max_concurrent"):
        if key in raw:
            limits[key] = _number(f"{where}.{key}", raw[key], key, integer=key == "max_concurrent")
    if "max_concurrent" in limits:
        limits["max_concurrent"] = int(limits["max_concurrent"])
    return Tenant(name, tuple(h.lower() for h in hashes), _number(f"{where}.weight", raw.get("weight", 1.0), "weight"),
                  priority, models=frozenset(models) if models is not None else None, admin=admin, **limits)


def _slos(path: str, raw: Any, classes: tuple[str, ...]) -> dict[str, Slo]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: slo must be a table of classes ([slo.<class>])")
    out: dict[str, Slo] = {}
    for cls, body in raw.items():
        where = f"{path}: slo.{shown(cls)}"
        if cls not in classes:
            raise ConfigError(f"{where}: {cls!r} is not a class of [priorities] order ({', '.join(classes)})")
        if not isinstance(body, dict) or set(body) - _SLO_KEYS:
            raise ConfigError(f"{where} must be a table of {', '.join(sorted(_SLO_KEYS))}")
        avail = body.get("availability")
        for key in ("availability", "ttft_target"):
            if key in body and not (isinstance(body[key], int | float) and 0 < body[key] < 1):
                raise ConfigError(f"{where}.{key} must be a fraction in (0, 1) like 0.999, got {body[key]!r}")
        ttft = _number(f"{where}.ttft_s", body["ttft_s"], "ttft_s") if "ttft_s" in body else None
        out[cls] = Slo(float(avail) if avail is not None else None, ttft, float(body.get("ttft_target", 0.99)))
    return out


def parse_tenants(path: str, doc: dict[str, Any]) -> TenantsConfig:
    """Validate a parsed TOML document (``path`` names it in errors, :func:`shown`). Raises :class:`ConfigError`."""
    file, path = path, shown(path)
    unknown = sorted(set(doc) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{path}: {shown(unknown[0])} is not a section; use {', '.join(sorted(_TOP_KEYS))}")
    prio = doc.get("priorities", {})
    order = prio.get("order", [DEFAULT_CLASS]) if isinstance(prio, dict) else None
    if (not isinstance(order, list) or not order or not all(isinstance(c, str) and _NAME.fullmatch(c) for c in order)
            or len(set(order)) != len(order)):
        raise ConfigError(f"{path}: priorities.order must list distinct class names, most urgent first, got {order!r}")
    classes = tuple(order)
    unknown = sorted(set(prio) - {"order", "reserve"}) if isinstance(prio, dict) else []
    if unknown:
        raise ConfigError(f"{path}: priorities.{shown(unknown[0])} is not a key; use order, reserve")
    reserve = int(_number(f"{path}: priorities.reserve", prio.get("reserve", 0), "reserve", integer=True))
    fq = doc.get("fair_queue", {})
    if not isinstance(fq, dict) or set(fq) - {"prompt_token_weight", "output_token_weight", "anticipation_s"}:
        raise ConfigError(f"{path}: fair_queue takes prompt_token_weight, output_token_weight and anticipation_s")
    wp = _number(f"{path}: fair_queue.prompt_token_weight", fq.get("prompt_token_weight", 1.0), "prompt_token_weight")
    wq = _number(f"{path}: fair_queue.output_token_weight", fq.get("output_token_weight", 2.0), "output_token_weight")
    anticipation = _number(f"{path}: fair_queue.anticipation_s", fq.get("anticipation_s", ANTICIPATION_S),
                           "anticipation_s")
    if wp + wq == 0:
        raise ConfigError(f"{path}: fair_queue weights must not both be 0")
    raw = doc.get("tenants")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path}: no tenant; add at least one [tenants.<name>] table")
    if DEFAULT_TENANT in raw:
        raise ConfigError(f"{path}: tenants.{DEFAULT_TENANT}: the name is reserved (--api-key's tenant)")
    seen: dict[str, str] = {}
    tenants = tuple(_tenant(path, name, body, classes, seen) for name, body in raw.items())
    tags: dict[int, str] = {}
    for name in (*raw, DEFAULT_TENANT):
        other = tags.setdefault(tenant_tag(name), name)
        if other != name:  # (odds ≈ tenants² / 2^57; a shared tag would let one read the other's stored responses)
            raise ConfigError(f"{path}: tenants.{name}: its name hashes to the same response-ownership tag as "
                              f"{other}'s; rename one of them")
    return TenantsConfig(file, tenants, classes, wp, wq, _slos(path, doc.get("slo", {}), classes), reserve,
                         anticipation)


def read_tenants(path: str) -> tuple[TenantsConfig, bytes]:
    """Read and validate the tenants file at ``path``: the configuration and the exact bytes it was parsed from
    (what :func:`save_last_good` keeps). Raises :class:`ConfigError` (one line: file, key, why)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"--tenants {shown(path)}: cannot read it: {e.strerror or e}") from None
    return _parse_bytes(path, raw), raw


def _parse_bytes(path: str, raw: bytes) -> TenantsConfig:
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{shown(path)}: not valid TOML: {shown(str(e))}") from None
    return parse_tenants(path, doc)


def load_tenants(path: str) -> TenantsConfig:
    """Read and validate the tenants file at ``path``. Raises :class:`ConfigError` (one line: file, key, why)."""
    return read_tenants(path)[0]


def last_good_path(run_dir: str) -> str:
    """Where a router keeps the last version of its tenants file that loaded: ``<run_dir>/tenants.last-good.toml``."""
    return os.path.join(run_dir, LAST_GOOD_NAME)


def save_last_good(path: str, raw: bytes, run_dir: str) -> bool:
    """Keep ``raw`` (the bytes of ``path`` that just loaded) as :func:`last_good_path`, atomically (a temporary file
    renamed over it), headed by a comment naming ``path`` so that a copy is never used for another file. False when
    the run directory cannot be written (nothing to fall back on later, nothing else changes)."""
    dest = last_good_path(run_dir)
    tmp = f"{dest}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(_last_good_header(path) + raw)
        os.replace(tmp, dest)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True


def _last_good_header(path: str) -> bytes:
    return f"# dplb: last good copy of {shown(path)}\n".encode()  # (one comment line, whatever the path)


def load_tenants_or_last_good(path: str, run_dir: str) -> tuple[TenantsConfig, ConfigError | None]:
    """The tenants file at ``path`` (kept as the last good copy when it loads), or — when it does not load and a last
    good copy of that same file is in ``run_dir`` — that copy, with the error that refused the file (the caller
    logs it and exposes it; nginx keeps its running configuration the same way). Raises :class:`ConfigError` when
    the file does not load and there is nothing to fall back on."""
    try:
        tc, raw = read_tenants(path)
    except ConfigError as e:
        try:
            with open(last_good_path(run_dir), "rb") as f:
                copy = f.read()
        except OSError:
            raise e from None
        header = _last_good_header(path)
        if not copy.startswith(header):
            raise e from None
        try:
            return _parse_bytes(path, copy[len(header):]), e
        except ConfigError:
            raise e from None
    save_last_good(path, raw, run_dir)
    return tc, None


def single_tenant(api_key: str | None) -> TenantsConfig:
    """The configuration without a tenants file: one tenant, :data:`DEFAULT_TENANT`, holding ``api_key`` (if any)."""
    hashes = (hash_key(api_key),) if api_key else ()
    return TenantsConfig("", (Tenant(DEFAULT_TENANT, hashes),))


__all__ = ["BOUNDS", "DEFAULT_CLASS", "DEFAULT_TENANT", "LAST_GOOD_NAME", "Slo", "Tenant", "TenantsConfig", "hash_key",
           "last_good_path", "load_tenants", "load_tenants_or_last_good", "parse_tenants", "read_tenants",
           "save_last_good", "shown", "single_tenant"]
