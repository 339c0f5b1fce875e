"""Tenants without a cluster: the tenants file's validation, the fair queue's order (VTC, priority classes, bounds),
the token buckets and the usage meter — each table-driven with an injected clock (docs/DESIGN.md §15)."""

from __future__ import annotations

import json
import os
import re

import pytest

from dplb.errors import ConfigError, RouterErrorKind
from dplb.router.admission import FairQueue, QueueRefusal, Waiter
from dplb.router.limits import DEFAULT_OUTPUT_TOKENS, TenantLimits, TokenBucket, reset_text
from dplb.router.usage import Meter, max_tokens, sequences, with_fields
from dplb.tenants import Tenant, hash_key, load_tenants, parse_tenants

H1, H2 = hash_key("key-one"), hash_key("key-two")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def doc(**tenants: dict) -> dict:
    return {"tenants": tenants}


# ---- the tenants file ---------------------------------------------------------------------------------------
def test_a_valid_file_loads_with_defaults_and_lookup_finds_the_key(tmp_path) -> None:
    p = tmp_path / "t.toml"
    p.write_text(f'[priorities]\norder = ["interactive", "batch"]\n[fair_queue]\noutput_token_weight = 3\n'
                 f'[tenants.chat]\napi_key_sha256 = ["{H1}"]\nweight = 2\npriority = "interactive"\n'
                 f'models = ["m1"]\nrequests_per_s = 5\n[tenants.batch]\napi_key_sha256 = "{H2.upper()}"\n'
                 f'priority = "batch"\n[slo.interactive]\navailability = 0.999\nttft_s = 0.5\n')
    tc = load_tenants(str(p))
    assert [t.name for t in tc.tenants] == ["chat", "batch"] and tc.names() == ("chat", "batch", "default")
    assert tc.classes == ("interactive", "batch") and tc.rank("batch") == 1 and tc.output_token_weight == 3
    chat = tc.lookup(b"key-one")
    assert chat is not None and chat.name == "chat" and chat.weight == 2 and chat.requests_per_s == 5
    # No model named is not "allowed": the gate checks the model that would serve it (test_tenants_cluster.py).
    assert chat.may_use("m1") and not chat.may_use("m2") and not chat.may_use(None) and not chat.may_use(["m1"])
    batch = tc.lookup(b"key-two")
    assert batch is not None and batch.name == "batch" and batch.weight == 1.0 and batch.models is None
    assert tc.lookup(b"key-three") is None and tc.lookup(b"") is None
    assert tc.slos["interactive"].availability == 0.999 and tc.slos["interactive"].ttft_s == 0.5


def test_operators_are_the_admin_tenants_and_the_api_keys_default_and_the_check_names_them() -> None:
    tc = parse_tenants("t.toml", doc(ops={"api_key_sha256": [H1], "admin": True, "models": ["m"]},
                                     team={"api_key_sha256": [H2], "admin": False}))
    ops, team = tc.by_name("ops"), tc.by_name("team")
    assert ops is not None and ops.admin and ops.operator
    assert team is not None and not team.admin and not team.operator
    assert Tenant("default").operator  # --api-key's tenant, and every request of a router without keys
    assert tc.summary() == "2 tenants, admin ops, classes default"


def test_reserve_holds_slots_per_less_urgent_class() -> None:
    tc = parse_tenants("t.toml", {"priorities": {"order": ["a", "b", "c"], "reserve": 2},
                                  **doc(x={"api_key_sha256": [H1], "priority": "c"})})
    assert [tc.held(r) for r in range(4)] == [0, 2, 4, 4]  # rank 3: a class no longer in the file ranks last
    assert parse_tenants("t.toml", doc(x={"api_key_sha256": [H1]})).held(0) == 0


@pytest.mark.parametrize(("document", "needle"), [
    ({}, "no tenant"),
    (doc(a={"weight": 1}), "tenants.a.api_key_sha256 must list"),
    (doc(a={"api_key_sha256": ["abc"]}), "tenants.a.api_key_sha256: 'abc' is not a SHA-256"),
    (doc(a={"api_key_sha256": [H1], "weight": -1}), "tenants.a.weight must be a number from 0.001 to 1000, got -1"),
    (doc(a={"api_key_sha256": [H1], "weight": True}), "tenants.a.weight must be a number"),
    (doc(a={"api_key_sha256": [H1], "max_concurrent": 1.5}), "tenants.a.max_concurrent must be an integer"),
    (doc(a={"api_key_sha256": [H1], "colour": 1}), "tenants.a.colour is not a tenant key"),
    (doc(a={"api_key_sha256": [H1], "priority": "gold"}), "tenants.a.priority must be one of"),
    # With classes, a tenant without one: said as missing (it was "must be one of …, got None").
    ({"priorities": {"order": ["interactive", "batch"]}, **doc(lim={"api_key_sha256": [H1]})},
     "t.toml: tenants.lim.priority is missing: with [priorities] every tenant names one of its order "
     "(interactive, batch)"),
    (doc(a={"api_key_sha256": [H1]}, b={"api_key_sha256": [H1]}), "is also tenant a's"),
    (doc(a={"api_key_sha256": [H1], "models": "m"}), "tenants.a.models must be a list"),
    (doc(default={"api_key_sha256": [H1]}), "tenants.default: the name is reserved"),
    ({"priorities": {"order": []}, **doc(a={"api_key_sha256": [H1]})}, "priorities.order must list"),
    ({"slo": {"gold": {}}, **doc(a={"api_key_sha256": [H1]})}, "slo.gold: 'gold' is not a class"),
    ({"slo": {"default": {"availability": 2}}, **doc(a={"api_key_sha256": [H1]})},
     "slo.default.availability must be a fraction"),
    ({"extra": 1, **doc(a={"api_key_sha256": [H1]})}, "extra is not a section"),
    ({"priorities": {"reserve": -1}, **doc(a={"api_key_sha256": [H1]})},
     "priorities.reserve must be an integer from 0 to 100000, got -1"),
    # An empty allow-list refuses everything: a mistake, said with how to write "any model".
    (doc(a={"api_key_sha256": [H1], "models": []}), "tenants.a.models is empty: every request of the tenant would "
     "be refused (403); leave models out to allow every model"),
    # Absurd numbers: they overflowed the integer headers (309 digits) or starved the tenant (BOUNDS).
    (doc(a={"api_key_sha256": [H1], "requests_per_s": 1e308}), "tenants.a.requests_per_s must be a number from "
     "0.001 to 1e+06, got 1e+308"),
    (doc(a={"api_key_sha256": [H1], "requests_per_s": 1e-300}), "tenants.a.requests_per_s must be a number from"),
    (doc(a={"api_key_sha256": [H1], "tokens_per_min": 1e300}), "tenants.a.tokens_per_min must be a number from "
     "1 to 1e+10"),
    (doc(a={"api_key_sha256": [H1], "weight": 1e-300}), "tenants.a.weight must be a number from 0.001 to 1000"),
    (doc(a={"api_key_sha256": [H1], "max_concurrent": 2**62}), "tenants.a.max_concurrent must be an integer from "
     "1 to 1e+06"),
    ({"fair_queue": {"output_token_weight": 1e300}, **doc(a={"api_key_sha256": [H1]})},
     "fair_queue.output_token_weight must be a number from 0 to 1000"),
    ({"slo": {"default": {"ttft_s": 1e300}}, **doc(a={"api_key_sha256": [H1]})},
     "slo.default.ttft_s must be a number from 0.001 to 3600"),
    ({"priorities": {"reserve": 1.5}, **doc(a={"api_key_sha256": [H1]})}, "priorities.reserve must be an integer"),
    ({"priorities": {"reserved": 1}, **doc(a={"api_key_sha256": [H1]})}, "priorities.reserved is not a key"),
    ({"fair_queue": {"anticipation_s": -0.1}, **doc(a={"api_key_sha256": [H1]})},
     "fair_queue.anticipation_s must be a number from 0 to 1, got -0.1"),
    ({"fair_queue": {"anticipation_s": 250}, **doc(a={"api_key_sha256": [H1]})},
     "fair_queue.anticipation_s must be a number from 0 to 1, got 250"),
    ({"fair_queue": {"idle_s": 1}, **doc(a={"api_key_sha256": [H1]})}, "fair_queue takes"),
    # admin grants operator rights (LoRA administration, every decision): only a TOML boolean says so.
    (doc(a={"api_key_sha256": [H1], "admin": "true"}), "tenants.a.admin must be true or false, got 'true'"),
    (doc(a={"api_key_sha256": [H1], "admin": 1}), "tenants.a.admin must be true or false, got 1"),
])
def test_a_bad_file_is_one_line_naming_the_file_and_key(document: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_tenants("t.toml", document)
    msg = str(e.value)
    assert msg.startswith("t.toml: ") and needle in msg and "\n" not in msg, msg


_CONTROL = ["a\nb", "a\rb", "\x1b[31mred", "tab\there", "nul\x00", "del\x7f", "nel\x85", "ls\u2028x"]


@pytest.mark.parametrize("bad", _CONTROL)
def test_every_tenants_file_error_is_one_line_whatever_the_file_holds(tmp_path, bad: str) -> None:
    """Regression: a tenant name with a newline was echoed raw, so the error spanned two lines. Every name, key,
    class, model and path the file or its command line gives, holding a control character (newline, escape, NUL,
    a Unicode line separator), is echoed escaped: each error is one line without a control character, through a
    real file as TOML writes such names (quoted keys with escapes)."""
    q = json.dumps(bad)  # (a TOML basic string: the same escapes)
    key = f'api_key_sha256 = ["{H1}"]\n'
    files = {
        "tenant name": f"[tenants.{q}]\n{key}",
        "tenant key": f"[tenants.a]\n{key}{q} = 1\n",
        "section": f"{q} = 1\n[tenants.a]\n{key}",
        "priorities key": f"[priorities]\n{q} = 1\n[tenants.a]\n{key}",
        "priority": f'[priorities]\norder = ["x", "y"]\n[tenants.a]\n{key}priority = {q}\n',
        "class": f'[priorities]\norder = [{q}]\n[tenants.a]\n{key}',
        "slo class": f"[tenants.a]\n{key}[slo.{q}]\nttft_s = 1\n",
        "model": f"[tenants.a]\n{key}models = [{q}, 3]\n",
        "digest": f"[tenants.a]\napi_key_sha256 = [{q}]\n",
        "toml": f"[tenants.a]\n{key}x = {q}{q}\n",
    }
    path = tmp_path / f"dir{bad.replace(chr(0), '0')}"
    path.mkdir()
    for what, text in files.items():
        f = path / "t.toml"
        f.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_tenants(str(f))
        msg = str(e.value)
        assert msg.isprintable() and repr(str(path))[1:-1] in msg, (what, msg)
    with pytest.raises(ConfigError) as e:
        load_tenants(str(path / "missing.toml"))
    assert str(e.value).isprintable() and "cannot read it" in str(e.value), str(e.value)


def test_unreadable_and_invalid_toml_name_the_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"--tenants .*missing\.toml: cannot read it"):
        load_tenants(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.a\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_tenants(str(bad))


# ---- the fair queue -------------------------------------------------------------------------------------------
def names(q: FairQueue, n: int) -> list[str]:
    out = []
    for _ in range(n):
        w = q.pop()
        assert w is not None
        out.append(w.data)
    return out


def push(q: FairQueue, tenant: str, tag: str, weight: float = 1.0, rank: int = 0, prompt: int = 10) -> Waiter:
    q.arrive(tenant)
    w = Waiter(tenant, weight, rank, prompt, tag)
    assert q.push(w) is None
    return w


def test_vtc_alternates_between_equal_tenants_and_a_flooder_does_not_starve_the_light_one() -> None:
    q = FairQueue(1, 100, 60, clock=Clock())
    for i in range(10):
        push(q, "A", f"a{i}")
    push(q, "B", "b0")
    # B is lifted to A's counter; on the tie the tenant with fewer queued goes first; then A alone.
    assert names(q, 3) == ["b0", "a0", "a1"]


def test_weights_split_service_by_tokens() -> None:
    q = FairQueue(1, 100, 60, clock=Clock())
    for i in range(20):
        push(q, "A", f"a{i}", weight=2.0)
        push(q, "B", f"b{i}", weight=1.0)
    got = names(q, 12)
    assert got.count("a0") == 1 and sum(n.startswith("a") for n in got) == 8  # 2:1 by weight


def test_output_tokens_charged_as_produced_reorder_the_queue() -> None:
    q = FairQueue(1, 100, 60, w_prompt=1.0, w_output=2.0, clock=Clock())
    push(q, "A", "a0")
    push(q, "B", "b0")
    q.charge("A", 1.0, output_tokens=50)  # A's earlier request streamed 50 tokens meanwhile
    assert q.counters["A"] == 100
    assert names(q, 2) == ["b0", "a0"]


def test_counter_lift_a_newcomer_banks_no_credit_for_idle_time() -> None:
    q = FairQueue(1, 100, 60, clock=Clock())
    q.counters["A"] = 1000.0
    push(q, "A", "a0")
    push(q, "B", "b0")  # B was idle: lifted to A's 1000, not left at 0
    assert q.counters["B"] == 1000.0
    push(q, "A", "a1")
    push(q, "B", "b1")
    # Equal counters: the tenant with fewer queued first (B's newcomer), then alternation by counter.
    assert names(q, 4) == ["a0", "b0", "a1", "b1"]


def test_lift_when_the_queue_is_empty_uses_the_last_tenant_that_left() -> None:
    q = FairQueue(1, 100, 60, clock=Clock())
    q.counters["A"] = 500.0
    push(q, "A", "a0")
    names(q, 1)
    q.arrive("B")
    assert q.counters["B"] == 510.0  # A left with 500 + its 10 prompt tokens


def test_anticipation_holds_the_slot_of_the_tenant_served_next_and_its_next_request_takes_it() -> None:
    """A's request ends while A has nothing queued and B waits: A (lower counter) would be served next, so its slot
    is held for A, charged like the request that ended; A's next request takes it without the lift erasing A's
    deficit, and the charge is refunded (the request is charged its own at dispatch)."""
    clock = Clock()
    q = FairQueue(1, 100, 60, clock=clock, anticipation_s=0.1)
    q.counters.update(A=100.0, B=300.0)
    push(q, "B", "b0")
    assert q.anticipate("A", 2.0, 0, 10, 20, data=7)
    assert q.holding == 1 and q.counters["A"] == 100.0 + (10 + 2 * 20) / 2
    clock.t += 0.05
    q.arrive("A")  # holding a slot counts as queued: no lift to B's 300
    assert q.claim("A") == 7 and q.holding == 0 and q.counters["A"] == 100.0
    assert q.claim("A") is None


def test_anticipation_only_for_the_tenant_the_queue_would_serve_next() -> None:
    q = FairQueue(2, 100, 60, clock=Clock(), anticipation_s=0.1)
    assert not q.anticipate("A", 1.0, 0, 10, 0, data=0)  # nothing waits: the slot is free for anyone
    q.counters.update(A=500.0, B=100.0)
    push(q, "B", "b0")
    assert not q.anticipate("A", 1.0, 0, 10, 0, data=0)  # A is ahead of B: B's request gets the slot
    assert not q.anticipate("C", 1.0, 1, 10, 0, data=0)  # a less urgent class than the one waiting
    push(q, "A", "a0")
    assert not q.anticipate("A", 1.0, 0, 10, 0, data=0)  # A has a request queued: the queue decides
    q.counters["D"] = 0.0
    assert q.anticipate("D", 1.0, 0, 10, 0, data=0)  # behind nobody
    q.anticipation_s = 0.0
    assert not q.anticipate("E", 1.0, 0, 10, 0, data=0)  # turned off


def test_a_slot_another_tenant_frees_is_held_for_the_tenant_expected_back_when_it_would_be_served_next() -> None:
    """Equal requests end together: A's ended while nothing waited (no hold), then B queued, then C's request ends.
    A is expected back (its request ended within anticipation_s and no request of it arrived since) and has the
    smallest counter, so C's slot is held for A; once A's client is back, A is no longer expected."""
    clock = Clock()
    q = FairQueue(1, 100, 60, clock=clock, anticipation_s=0.1)
    q.counters.update(A=100.0, B=300.0, C=1000.0)
    assert not q.anticipate("A", 1.0, 0, 10, 0, data=1)  # nothing waits
    push(q, "B", "b0")
    clock.t += 0.02
    assert q.anticipate("C", 1.0, 0, 10, 0, data=2)
    assert q.counters["A"] == 110.0 and q.counters["C"] == 1000.0
    q.arrive("A")
    assert q.claim("A") == 2 and q.counters["A"] == 100.0
    assert not q.anticipate("C", 1.0, 0, 10, 0, data=3)  # A is back; C (1000) is not next, B's request is


def test_an_unused_hold_expires_refunded_and_the_tenant_gets_none_until_it_comes_back_in_time() -> None:
    clock = Clock()
    q = FairQueue(1, 100, 60, clock=clock, anticipation_s=0.1)
    q.counters.update(A=0.0, B=100.0)
    push(q, "B", "b0")
    assert q.anticipate("A", 1.0, 0, 10, 0, data=3)
    clock.t += 0.05
    assert q.expire_holds() == []
    clock.t += 0.06
    assert q.expire_holds() == [3] and q.holding == 0 and q.counters["A"] == 0.0
    assert not q.anticipate("A", 1.0, 0, 10, 0, data=3)  # its client did not come back in time: no hold
    clock.t += 0.05
    q.arrive("A")  # ... until a request of A arrives within anticipation_s of one of A's requests ending
    assert q.anticipate("A", 1.0, 0, 10, 0, data=4)
    assert q.expire_holds(every=True) == [4]  # the router stops: every hold ends


def test_priority_class_first_then_fairness_within_it() -> None:
    q = FairQueue(2, 100, 60, clock=Clock())
    push(q, "batch", "x0", rank=1)
    push(q, "batch", "x1", rank=1)
    push(q, "chat", "c0", rank=0)
    q.counters["chat"] = 1e6  # even a chat tenant far ahead on tokens goes first: the class is the first key
    assert names(q, 3) == ["c0", "x0", "x1"]


def test_work_conserving_skips_a_request_no_worker_can_take() -> None:
    q = FairQueue(1, 100, 60, clock=Clock())
    push(q, "A", "a0")
    push(q, "B", "b0")
    w = q.pop(lambda w: w.data != "a0")
    assert w is not None and w.data == "b0" and q.length == 1


def test_full_queue_pushes_out_the_tenant_over_its_share_or_refuses() -> None:
    q = FairQueue(1, 4, 60, clock=Clock())
    for i in range(4):
        push(q, "A", f"a{i}")
    q.arrive("B")
    out = q.push(Waiter("B", 1.0, 0, 10, "b0"))  # A holds the whole queue: its newest request goes
    assert out is not None and out.data == "a3" and q.queued("B") == 1
    q.arrive("A")
    with pytest.raises(QueueRefusal) as e:  # A (3 of 4, share 2) arrives again: 429 over its share
        q.push(Waiter("A", 1.0, 0, 10, "a4"))
    assert e.value.kind is RouterErrorKind.QUEUE_SHARE_EXCEEDED
    lone = FairQueue(1, 2, 60, clock=Clock())
    push(lone, "A", "a0")
    push(lone, "A", "a1")
    with pytest.raises(QueueRefusal) as e:  # a lone tenant fills the server: 503, not its fault
        lone.push(Waiter("A", 1.0, 0, 10, "a2"))
    assert e.value.kind is RouterErrorKind.QUEUE_FULL


def test_timeouts_expire_with_429_over_share_else_503_and_remove_takes_out() -> None:
    clock = Clock()
    q = FairQueue(1, 4, 5.0, clock=clock)
    a = [push(q, "A", f"a{i}") for i in range(3)]
    push(q, "B", "b0")
    clock.t += 4.9
    assert q.expire() == []
    clock.t += 0.1
    got = [(w.data, kind.code) for w, kind in q.expire()]
    # a0 leaves while A holds 3 of 4 (share 2): 429; then A is within its share: 503 like B's.
    assert got == [("a0", "queue_share_exceeded"), ("a1", "queue_timeout"), ("a2", "queue_timeout"),
                   ("b0", "queue_timeout")]
    assert q.length == 0 and not q.remove(a[0])
    w = push(q, "A", "a9")
    assert q.remove(w) and q.length == 0 and q.pop() is None


def test_resize_keeps_queued_requests() -> None:
    q = FairQueue(2, 10, 60, clock=Clock())
    push(q, "A", "a0", rank=1)
    push(q, "B", "b0", rank=0)
    q.resize(1)
    assert q.length == 2 and sorted(names(q, 2)) == ["a0", "b0"]


# ---- limits -----------------------------------------------------------------------------------------------------
def test_request_bucket_refuses_with_the_exact_retry_after_and_refills() -> None:
    clock = Clock()
    lim = TenantLimits(Tenant("a", requests_per_s=2), clock)
    assert lim.check(10) is None and lim.check(10) is None
    refused = lim.check(10)
    assert refused is not None and refused[0] is RouterErrorKind.RATE_LIMITED and refused[1] == 1
    clock.t += 0.5
    assert lim.check(10) is None
    hdr = dict(lim.headers())
    assert hdr[b"x-ratelimit-limit-requests"] == b"2" and hdr[b"x-ratelimit-remaining-requests"] == b"0"
    assert hdr[b"x-ratelimit-reset-requests"] == b"1s"


def test_a_refusal_message_quotes_the_reset_header_and_the_retry_after_it_rounds() -> None:
    """requests_per_s = 5 (burst 5), 5 taken, 0.8 s later: one request is back in 0.2 s (Retry-After 1), all 5 in
    0.2 s + 4 × 0.2 s = 1 s — the message says both, in the headers' words (it said only "retry in 200ms" beside
    a reset header of 1s, and looked wrong)."""
    clock = Clock()
    lim = TenantLimits(Tenant("a", requests_per_s=5, tokens_per_min=60), clock)
    for _ in range(5):
        assert lim.check(1) is None
    refused = lim.check(1)
    assert refused is not None and refused[1] == 1
    hdr = dict(lim.headers(refill=False))
    assert hdr[b"x-ratelimit-reset-requests"] == b"1s"
    assert refused[2] == "rate limit of 5 requests/s reached; retry in 200ms (one request is back then; all 5 in 1s, " \
        "x-ratelimit-reset-requests)"
    clock.t += 1.0
    assert lim.check(1) is None
    for _ in range(4):
        lim.check(1)
    lim.correct(54)  # tokens (60/min = 1/s): 60 - 5 + 1 - 5 - 54 = -3
    clock.t += 1.0  # -2: 5 tokens are back in 7 s, all 60 in 62 s
    refused = lim.check(5)
    assert refused is not None and refused[0] is RouterErrorKind.TOKENS_RATE_LIMITED and refused[1] == 7
    assert dict(lim.headers(refill=False))[b"x-ratelimit-reset-tokens"] == b"1m2s"
    assert "retry in 7s (this request's 5 tokens are back then; all in 1m2s, x-ratelimit-reset-tokens)" in refused[2]


def test_token_bucket_debt_from_the_engines_count_delays_the_next_request() -> None:
    clock = Clock()
    lim = TenantLimits(Tenant("a", tokens_per_min=600), clock)  # 10 tokens/s
    assert lim.check(100) is None
    lim.correct(550)  # the engine counted 650 in all: the bucket is 50 in debt
    refused = lim.check(100)
    assert refused is not None and refused[0] is RouterErrorKind.TOKENS_RATE_LIMITED and refused[1] == 15
    clock.t += 15
    assert lim.check(100) is None


def test_token_reservation_counts_max_tokens_so_a_burst_admits_only_what_fits() -> None:
    clock = Clock()
    lim = TenantLimits(Tenant("a", tokens_per_min=1000), clock)
    need = lim.estimate(10, 200)
    assert need == 210
    admitted = [lim.check(need) is None for _ in range(10)]  # ten at once: no time passes, no usage known yet
    assert admitted == [True] * 4 + [False] * 6
    refused = lim.check(need)
    assert refused is not None and refused[0] is RouterErrorKind.TOKENS_RATE_LIMITED
    assert refused[1] == 3  # 1000 − 4 × 210 = 160 left: 50 more at 1000/60 tokens/s take 3 s
    for _ in range(4):  # each used 10 + 5 tokens: the unused 195 go back
        lim.correct(15 - need)
    assert lim.check(need) is None


def test_a_request_larger_than_the_whole_quota_is_refused_as_a_client_error() -> None:
    lim = TenantLimits(Tenant("a", tokens_per_min=1000), Clock())
    refused = lim.check(lim.estimate(12, 1000))
    assert refused is not None and refused[0] is RouterErrorKind.TOKENS_EXCEED_QUOTA
    assert RouterErrorKind.TOKENS_EXCEED_QUOTA.status == 400 and "1012" in refused[2]
    assert lim.tokens is not None and lim.tokens.level == 1000  # nothing taken


def test_remaining_is_never_above_the_limit_after_a_refund_on_any_path() -> None:
    """A refund (the engine counted less than reserved) while the bucket had refilled meanwhile pushed the level
    past the capacity: a later 400 tokens_exceed_quota said remaining 20990 for a limit of 20000."""
    clock = Clock()
    lim = TenantLimits(Tenant("a", requests_per_s=5, tokens_per_min=20000), clock)
    assert lim.check(1000) is None
    clock.t += 3  # 1000 tokens refill meanwhile (333/s)
    lim.correct(10 - 1000)  # the request used 10 of its 1000
    assert lim.tokens is not None and lim.tokens.level == 20000
    seen = []
    for kind in (RouterErrorKind.TOKENS_EXCEED_QUOTA, RouterErrorKind.RATE_LIMITED):
        refused = lim.check(30008 if kind is RouterErrorKind.TOKENS_EXCEED_QUOTA else 1)
        assert refused is not None and refused[0] is kind
        hdr = dict(lim.headers(refill=False))
        for name in (b"requests", b"tokens"):
            limit = int(hdr[b"x-ratelimit-limit-" + name])
            assert 0 <= int(hdr[b"x-ratelimit-remaining-" + name]) <= limit, (kind, hdr)
        seen.append(hdr[b"x-ratelimit-remaining-tokens"])
        for _ in range(5):  # the request bucket's burst: the next check is its 429
            lim.check(1)
    assert seen == [b"20000", b"19995"]
    lim.correct(-10**6)
    assert dict(lim.headers())[b"x-ratelimit-remaining-tokens"] == b"20000"


def test_the_reservation_counts_the_output_limit_once_per_generated_sequence() -> None:
    lim = TenantLimits(Tenant("a", tokens_per_min=2000), Clock())
    assert sequences(10, None) == 10 and sequences(2, 5) == 5 and sequences(" 7 ", 3.0) == 7
    assert sequences(None, None) == sequences(0, -3) == sequences("x", 2.5) == sequences(float("inf"), None) == 1
    need = lim.estimate(1, 300, sequences(10, None))
    assert need == 3001
    refused = lim.check(need)
    assert refused is not None and refused[0] is RouterErrorKind.TOKENS_EXCEED_QUOTA and "3001" in refused[2]
    assert lim.estimate(1, 0, 10) == 2000  # no max_tokens: the default per sequence, capped at the capacity


def test_without_max_tokens_the_default_output_is_reserved_within_the_capacity() -> None:
    assert TenantLimits(Tenant("a", tokens_per_min=100_000)).estimate(30, 0) == 30 + DEFAULT_OUTPUT_TOKENS
    small = TenantLimits(Tenant("a", tokens_per_min=100))
    assert small.estimate(30, 0) == 100 and small.check(100) is None  # the whole bucket, never "too large"
    assert TenantLimits(Tenant("a", requests_per_s=5)).estimate(30, 500) == 0  # no token limit: nothing reserved


@pytest.mark.parametrize(("s", "text"), [(0.02, "20ms"), (1.0, "1s"), (1.5, "1.5s"), (360, "6m0s"), (61.2, "1m2s")])
def test_reset_text_is_openais_format(s: float, text: str) -> None:
    assert reset_text(s) == text


def test_token_bucket_caps_a_wait_at_its_capacity() -> None:
    b = TokenBucket(1.0, 5.0, Clock())
    b.take(5)
    assert b.wait_s(100) == 5.0


# ---- usage metering and body fields ---------------------------------------------------------------------------
USAGE = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
EVENTS = [b'data: {"id":"x","choices":[{"delta":{"content":"a"}}]}\n\n'] * 3


@pytest.mark.parametrize("split", [1, 7, 50, 10000])
def test_meter_reads_the_usage_chunk_however_the_stream_is_cut(split: int) -> None:
    stream = b"".join(EVENTS) + USAGE + b"data: [DONE]\n\n"
    for strip in (False, True):
        m = Meter(True, strip)
        relayed = b"".join(m.chunk(stream[i:i + split]) for i in range(0, len(stream), split))
        u = m.finish()
        assert u is not None and (u.prompt_tokens, u.completion_tokens) == (7, 3) and m.exact
        assert m.events == 3
        assert relayed == (b"".join(EVENTS) + b"data: [DONE]\n\n" if strip else stream)


def test_meter_json_body_and_a_stream_without_usage() -> None:
    m = Meter(False)
    m.chunk(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": ')
    m.chunk(b'{"cached_tokens": 4}}}')
    u = m.finish()
    assert u is not None and (u.prompt_tokens, u.completion_tokens, u.cached) == (5, 2, 4)
    m = Meter(True)
    m.chunk(b"".join(EVENTS) + b"data: [DONE]\n\n")
    assert m.finish() is None and not m.exact and m.events == 3


def test_meter_reads_the_responses_apis_usage_names() -> None:
    """A Responses API body counts input/output tokens: read as prompt/completion (else a token quota's
    reservation was given back whole, and the ledger counted 0)."""
    m = Meter(False)
    m.chunk(b'{"object":"response","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":3},'
            b'"output_tokens":4,"total_tokens":13}}')
    u = m.finish()
    assert u is not None and (u.prompt_tokens, u.completion_tokens, u.cached) == (9, 4, 3)


@pytest.mark.parametrize(("body", "out"), [
    (b'{"model":"m"}', b'{"priority":1,"model":"m"}'),
    (b' {}', b' {"priority":1}'),
    (b'{ }', b'{"priority":1 }'),
])
def test_with_fields_writes_first_and_keeps_the_rest(body: bytes, out: bytes) -> None:
    assert with_fields(body, b'"priority":1') == out


def test_expected_output_is_charged_at_dispatch_so_a_batch_started_together_is_not_all_one_tenants() -> None:
    q = FairQueue(1, 100, 60, w_prompt=1.0, w_output=2.0, clock=Clock())
    for i in range(4):
        q.arrive("A")
        q.push(Waiter("A", 1.0, 0, 10, f"a{i}", output_tokens=64))
        q.arrive("B")
        q.push(Waiter("B", 1.0, 0, 10, f"b{i}", output_tokens=64))
    # Four slots free at once (nothing has completed yet): two each, not four of whoever is first.
    got = names(q, 4)
    assert sorted(n[0] for n in got) == ["a", "a", "b", "b"] and q.counters["A"] == q.counters["B"] == 2 * 138


def test_bench_fairness_index_and_next_slot_waits() -> None:
    from dplb.bench.tenants import jain, next_slot_waits

    assert jain([5.0, 5.0]) == 1.0 and jain([3.0, 1.0]) == pytest.approx(0.8) and jain([0.0, 0.0]) is None
    assert next_slot_waits([0.0, 1.5, 9.0], [2.0, 1.0, 3.0]) == [1.0, 0.5]  # 9.0 is past the last free slot
    # Two arrivals in one gap: one slot admits one request, so the second waits for the slot after it.
    assert next_slot_waits([0.1, 0.0, 2.5], [1.0, 2.0, 3.0]) == pytest.approx([1.0, 1.9, 0.5])
    assert next_slot_waits([0.0, 0.0, 0.0], [1.0, 2.0]) == [1.0, 2.0]  # the third has no slot left


def test_hash_key_cli_reads_stdin_and_refuses_an_empty_key(monkeypatch, capsys) -> None:
    import io

    from dplb.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("key-one\n"))
    assert main(["tenants", "hash-key", "-"]) == 0
    assert capsys.readouterr().out.strip() == H1
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert main(["tenants", "hash-key", "-"]) == 2
    assert "(the key given, 0 characters, is empty)" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("key-one\r\n"))
    assert main(["tenants", "hash-key", "-"]) == 0
    assert capsys.readouterr().out.strip() == H1
    # More than one line (a key file with a comment, two keys): refused, never the first line's digest silently.
    for text in ("# team a\nkey-one\n", "key-one\nkey-two"):
        monkeypatch.setattr("sys.stdin", io.StringIO(text))
        assert main(["tenants", "hash-key", "-"]) == 2
        out = capsys.readouterr()
        assert out.out == "" and "stdin has 2 lines: give one key per run" in out.err, out


@pytest.mark.parametrize(("body", "n"), [(b'{"max_tokens": 64}', 64), (b'{"max_completion_tokens": 9, "max_tokens": 64}', 9),
                                         (b'{"max_tokens": true}', 0), (b'{"x": 1}', 0), (b"not json", 0)])
def test_max_tokens_reads_the_output_limit(body: bytes, n: int) -> None:
    assert max_tokens(body) == n


def test_bench_targets_judge_the_reserve_modes_and_leave_the_engine_only_row_as_reference() -> None:
    from dplb.bench.tenants import tenant_targets

    mode = {"b_p99_vs_solo": 2.5}
    f = {"b_p99_fair_vs_fifo": 0.05, "physical_bound_ms": 900.0, "b_p99_fair_vs_bound": 1.2,
         "throughput_fair_vs_fifo": 1.0, "fair": {"jain": 1.0}, "priority": mode, "priority-2proc": {"b_p99_vs_solo": 3.2},
         "priority-noreserve": {"b_p99_vs_solo": 40.0}}
    rows = {name: (value, limit) for name, value, limit, _ in tenant_targets({"tenants": f})}
    assert rows["two classes (priority): B's TTFT P99 / solo ≤ 3"] == (2.5, 3.0)
    assert rows["two classes (priority-2proc): B's TTFT P99 / solo ≤ 3"] == (3.2, 3.0)
    assert not any("noreserve" in name for name in rows) and len(rows) == 6


def test_tenants_check_notes_group_wide_limits_for_more_than_one_router_process(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """With --router-processes N > 1 and a limited tenant, one note on stderr says the limits hold group-wide, the
    overshoot bound and the fallback past the segment's 64 shared entries (it said nothing: an operator sizing
    limits for N processes could not tell that they are the group's, not each process's); stdout stays one line."""
    from dplb.cli import main

    f = tmp_path / "t.toml"
    f.write_text(f'[tenants.a]\napi_key_sha256 = ["{H1}"]\nrequests_per_s = 5\n'
                 f'[tenants.b]\napi_key_sha256 = ["{H2}"]\n')
    assert main(["tenants", "check", str(f), "--router-processes", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{f}: OK (2 tenants, classes default)\n" and err.count("\n") == 1, (out, err)
    assert err.startswith("note: tenant limits are enforced group-wide across the 3 router processes (1 limited "
                          "tenant)") and "one request per peer" in err and "past 64 limited tenants" in err, err
    assert main(["tenants", "check", str(f), "--router-processes", "1"]) == 0
    assert capsys.readouterr().err == ""
    f.write_text("".join(f'[tenants.t{i}]\napi_key_sha256 = ["{hash_key(f"k{i}")}"]\nmax_concurrent = 2\n'
                         for i in range(70)))
    assert main(["tenants", "check", str(f), "--processes", "2"]) == 0
    err = capsys.readouterr().err
    assert "(70 limited tenants)" in err and "6 of the 70 limited tenants are past the segment's 64" in err, err
    assert "divided by 2" in err
    f.write_text(f'[tenants.a]\napi_key_sha256 = ["{H1}"]\n')  # nothing limited: nothing to say
    assert main(["tenants", "check", str(f), "--processes", "2"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["tenants", "check", str(f), "--processes", "9"]) == 2
    assert "--router-processes must be 1..8, got 9" in capsys.readouterr().err


def test_tenants_check_cli_is_one_line_exit_0_or_2(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from dplb.cli import main

    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(f'[tenants.a]\napi_key_sha256 = ["{H1}"]\n')
    bad.write_text("garbage [\n")
    assert main(["tenants", "check", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: OK (1 tenant, classes default)\n"
    assert main(["tenants", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}: not valid TOML" in err


def test_last_good_copy_serves_only_the_file_it_was_taken_from(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A file that loads is kept (atomically, no temporary file left); when it later does not load the copy is
    used with the error that refused it; another file, or no copy, raises as before."""
    from dplb.tenants import last_good_path, load_tenants_or_last_good

    f, other = tmp_path / "t.toml", tmp_path / "other.toml"
    f.write_text(f'[tenants.a]\napi_key_sha256 = ["{H1}"]\n')
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ConfigError):
        load_tenants_or_last_good(str(other), str(run))  # no such file, nothing to fall back on
    tc, err = load_tenants_or_last_good(str(f), str(run))
    assert err is None and [t.name for t in tc.tenants] == ["a"]
    assert os.listdir(run) == [os.path.basename(last_good_path(str(run)))]
    f.write_text("garbage [\n")
    tc, err = load_tenants_or_last_good(str(f), str(run))
    assert [t.name for t in tc.tenants] == ["a"] and err is not None and "not valid TOML" in str(err)
    assert tc.path == str(f)
    other.write_text("garbage [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_tenants_or_last_good(str(other), str(run))  # the copy is t.toml's, not other.toml's


# ---- the prompt estimate ---------------------------------------------------------------------------------------
def test_prompt_estimate_is_the_prompt_fields_bytes_and_the_docs_say_so() -> None:
    """The estimate (the token reservation, a cancelled stream's charge) is the prompt field's raw bytes ÷ 4 — chat's
    ``messages`` JSON, completions' ``prompt``, ``input`` otherwise — not the body's; the whole body only when it has
    none. Regression: the README and DESIGN said "body bytes ÷ 4" (a chat body with tools or sampling fields is
    larger than its messages: the tester measured 1118 body bytes, 1033 of messages, a charge of 257)."""
    import json

    from dplb.router.exchange import Exchange
    from dplb.router.peek import peek_decoder
    from dplb.router.proxy import Proxy
    from dplb.router.tenancy import BYTES_PER_TOKEN, prompt_estimate

    messages = [{"role": "user", "content": "x" * 400}]
    cases = [  # (body, the bytes the estimate is of)
        ({"model": "m", "messages": messages, "tools": [{"type": "function", "function": {"name": "f" * 300}}],
          "max_tokens": 5}, json.dumps(messages)),
        ({"model": "m", "prompt": "p" * 200, "temperature": 0.5, "user": "u" * 300}, json.dumps("p" * 200)),
        ({"model": "m", "input": ["a" * 100, "b" * 100], "user": "u" * 300}, json.dumps(["a" * 100, "b" * 100])),
        ({"model": "m", "user": "u" * 300}, None),
    ]
    for obj, field in cases:
        body = json.dumps(obj).encode()
        ex = Exchange({"type": "http", "headers": []}, None, None)
        ex.body = body
        ex.request = Proxy.route_request(peek_decoder.decode(body), frozenset())
        want = len(field.encode() if field is not None else body) // BYTES_PER_TOKEN
        assert prompt_estimate(ex) == want and (field is None or want < len(body) // BYTES_PER_TOKEN), obj
    root = os.path.join(os.path.dirname(__file__), "..")
    for doc in ("README.md", "docs/DESIGN.md"):
        with open(os.path.join(root, doc)) as f:
            text = " ".join(f.read().split())
        said = re.findall(r"prompt estimate[d]?[^.]{0,40}?(?:\(|as )([^÷]{0,60}÷ 4)", text)
        assert said and all("prompt field's bytes" in s for s in said), (doc, said)
        assert "body bytes ÷ 4" not in text, doc
