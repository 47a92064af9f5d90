"""coordinator/kv_parity.compare: each differing field is named, first difference first (pure;
the end-to-end probe through real workers is tests/fleet/test_routing_e2e.py)."""
from __future__ import annotations

from coordinator.kv_parity import MISMATCH, OK, PROBES, compare, expected_ids
from router.block_keys import block_keys_list, salt_seed
from protocol.tokenizer import ByteTokenizer

B, SCHEME = 16, "xxh3_chain_v1"
TOK = ByteTokenizer()
NS = salt_seed("tenant-a")


def answers(ids: dict, *, bs=B, scheme=SCHEME, ns=NS):
    return {k: {"token_ids": v, "block_size": bs, "key_scheme": scheme, "ns_seed": ns,
                "block_keys": block_keys_list(v, bs, ns)} for k, v in ids.items()}


def check(ans, **kw):
    return compare(expected_ids(TOK), ans, block_size=B, key_scheme=SCHEME, ns_seed=NS, **kw)


def test_equal_is_ok():
    p = check(answers(expected_ids(TOK)))
    assert p.status == OK and p.field is None
    assert p.checked == ["block_size", "key_scheme", "tokenizer", "chat_template", "namespace", "keys"]


def test_each_field():
    exp = expected_ids(TOK)
    assert check(answers(exp, bs=32)).field == "block_size"
    assert check(answers(exp, scheme="sha256_v1")).field == "key_scheme"
    text = dict(exp, completion=exp["completion"][:-1] + [7])
    p = check(answers(text))
    assert (p.status, p.field) == (MISMATCH, "tokenizer") and f"token {len(exp['completion']) - 1}" in p.detail
    chat = dict(exp, chat=exp["chat"] + [1])
    assert check(answers(chat)).field == "chat_template"
    assert check(answers(exp, ns=salt_seed("tenant-b"))).field == "namespace"
    bad = answers(exp)
    bad["chat"]["block_keys"] = [k ^ 1 for k in bad["chat"]["block_keys"]]
    assert check(bad).field == "key_scheme"


def test_default_namespace_worker_is_fine():
    # the index salts event tokens itself; only the worker's snapshot keys are unusable
    p = check(answers(expected_ids(TOK), ns=0))
    assert p.status == OK and "default namespace" in p.detail


def test_tokenize_only_checks_token_ids():
    exp = expected_ids(TOK)
    ok = compare(exp, {k: {"token_ids": v} for k, v in exp.items()}, block_size=B,
                 key_scheme=SCHEME, ns_seed=NS, keys_known=False)
    assert ok.status == OK and "unverified" in ok.detail and ok.checked == ["tokenizer", "chat_template"]
    assert set(PROBES) == {"completion", "chat"}
