"""Key parity probe: does a worker produce the block keys the fleet and the coordinator expect?

KV-aware routing silently matches nothing when the fleet's keys for a prompt differ from the keys
the coordinator computes from the worker's events (another tokenizer, chat template, namespace,
block size or key scheme): every index stays full and every match is 0. So when a server is
admitted, and again when it restarts, the coordinator sends a fixed text prompt and a fixed chat
prompt to the worker's `POST /kv_keys` (worker/server.py) and compares its token ids and block keys
with the shared recipe (protocol/prompt.py). A stock engine without `/kv_keys` is asked
its `POST /tokenize` (vLLM's and SGLang's shape: `{"tokens": [...]}`) for the token ids only; with
neither the server is `unverified`.

`compare()` is pure; `probe()` does the HTTP. The first differing field names the cause:
block_size, key_scheme, tokenizer (text prompt ids), chat_template (chat ids, text ids equal),
namespace (the worker salted its keys with another seed), key_scheme (keys differ otherwise).
"""
from __future__ import annotations

import asyncio
import time
import dataclasses
from dataclasses import dataclass
from typing import Any

from router.block_keys import block_keys_list
from protocol.tokenizer import Tokenizer

from protocol.prompt import request_token_ids

__all__ = ["PROBES", "Parity", "OK", "MISMATCH", "UNVERIFIED", "expected_ids", "compare", "probe"]

OK, MISMATCH, UNVERIFIED = "ok", "kv_mismatch", "unverified"

# Long enough for several blocks at common block sizes; plain ASCII so any tokenizer handles it.
_TEXT = ("splitserve key parity probe. The quick brown fox jumps over the lazy dog; "
         "pack my box with five dozen liquor jugs. ") * 6
PROBES: dict[str, dict] = {
    "completion": {"prompt": _TEXT, "max_tokens": 1},
    "chat": {"messages": [{"role": "system", "content": "You are the splitserve parity probe."},
                          {"role": "user", "content": _TEXT}], "max_tokens": 1},
}


@dataclass(slots=True)
class Parity:
    status: str                       # ok | kv_mismatch | unverified
    field: str | None = None          # the first differing field when kv_mismatch
    detail: str = ""
    worker_id: str | None = None
    checked: list = dataclasses.field(default_factory=list)   # fields actually compared
    probe_failed: bool = False        # the probe itself failed (network): retried on readmission
    at: float = dataclasses.field(default_factory=time.time)

    def describe(self) -> dict:
        return {"status": self.status, "field": self.field, "detail": self.detail,
                "worker_id": self.worker_id, "checked": list(self.checked),
                "checked_at": round(self.at, 3)}


def expected_ids(tok: Tokenizer) -> dict[str, list[int]]:
    return {kind: list(request_token_ids(tok, body, kind == "chat")) for kind, body in PROBES.items()}


def _first_diff(a: list, b: list) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at token {n} (expected {len(a)} tokens, found {len(b)})"


def compare(expected: dict[str, list[int]], answers: dict[str, dict], *, block_size: int,
            key_scheme: str, ns_seed: int, keys_known: bool = True) -> Parity:
    """`answers[kind]` is the worker's `/kv_keys` answer (or `{"token_ids"}` only when
    `keys_known` is False, from `/tokenize`)."""
    checked = []
    if keys_known:
        a = answers["completion"]
        if a.get("block_size") != block_size:
            return Parity(MISMATCH, "block_size", f"expected block size {block_size}, the worker "
                          f"uses {a.get('block_size')}", checked=["block_size"])
        if a.get("key_scheme") != key_scheme:
            return Parity(MISMATCH, "key_scheme", f"expected key scheme {key_scheme!r}, the worker "
                          f"uses {a.get('key_scheme')!r}", checked=["block_size", "key_scheme"])
        checked += ["block_size", "key_scheme"]
    for kind, fld in (("completion", "tokenizer"), ("chat", "chat_template")):
        want, got = expected[kind], list(answers[kind].get("token_ids") or [])
        checked.append(fld)
        if want != got:
            what = "text prompt" if kind == "completion" else "chat prompt (text prompt equal)"
            return Parity(MISMATCH, fld, f"{what} tokenizes differently: {_first_diff(want, got)}",
                          checked=checked)
    if not keys_known:
        return Parity(OK, None, "token ids equal; block keys unverified (no /kv_keys)",
                      checked=checked)
    note = "token ids and block keys equal"
    for kind in PROBES:
        a = answers[kind]
        ids, got = list(a.get("token_ids") or []), [int(k) for k in a.get("block_keys") or []]
        if got == block_keys_list(ids, block_size, ns_seed):
            continue
        wns = a.get("ns_seed")
        if isinstance(wns, int) and wns != ns_seed and got == block_keys_list(ids, block_size, wns):
            if wns == 0:
                # A worker that knows no namespace: the index salts its event tokens itself
                # (only its /kv_snapshot keys are not used), so routing is unaffected.
                note = ("token ids equal; the worker keys the default namespace, the index salts "
                        "its event tokens with routing.namespace")
                continue
            return Parity(MISMATCH, "namespace", f"the worker is configured for another cache "
                          f"namespace (ns_seed {wns}); the cluster's routing.namespace gives "
                          f"{ns_seed}", checked=checked + ["namespace"])
        return Parity(MISMATCH, "key_scheme", f"{kind} prompt: the worker's block keys differ from "
                      f"{key_scheme} over its own token ids", checked=checked + ["namespace", "keys"])
    return Parity(OK, None, note, checked=checked + ["namespace", "keys"])


async def _post(session, url: str, body: dict, timeout: float) -> tuple[int, Any]:
    import aiohttp

    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            return r.status, None
        return 200, await r.json(content_type=None)


async def probe(session, url: str, tok: Tokenizer, model: str | None, *, block_size: int,
                key_scheme: str, ns_seed: int, timeout: float = 5.0) -> Parity:
    """Ask the worker at `url`; network errors propagate (the caller retries on the next admission)."""
    expected = expected_ids(tok)
    answers: dict[str, dict] = {}
    for kind, body in PROBES.items():
        st, ans = await _post(session, f"{url}/kv_keys?kind={kind}", dict(body, model=model), timeout)
        if st != 200 or not isinstance(ans, dict):
            break
        answers[kind] = ans
    else:
        return compare(expected, answers, block_size=block_size, key_scheme=key_scheme,
                       ns_seed=ns_seed)
    # A stock engine: its /tokenize gives token ids only (vLLM: add_special_tokens defaults to
    # True for a prompt; messages are rendered with add_generation_prompt).
    answers = {}
    for kind, body in PROBES.items():
        req = {"model": model, "prompt": body["prompt"]} if kind == "completion" else \
              {"model": model, "messages": body["messages"], "add_generation_prompt": True}
        try:
            st, ans = await _post(session, f"{url}/tokenize", req, timeout)
        except asyncio.TimeoutError:
            st, ans = 0, None
        if st != 200 or not isinstance(ans, dict) or not isinstance(ans.get("tokens"), list):
            return Parity(UNVERIFIED, None, "the server has neither /kv_keys nor a usable /tokenize")
        answers[kind] = {"token_ids": ans["tokens"]}
    return compare(expected, answers, block_size=block_size, key_scheme=key_scheme,
                   ns_seed=ns_seed, keys_known=False)
