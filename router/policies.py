"""The four routing policies behind one interface, each explaining its decision.

``Policy.select(candidates, key, view) -> Decision``; the explanation record is
``{"policy", "candidates": [{"server", "matched_tokens", "load_requests", "load_tokens",
"score", "why"}], "chosen", "reason", "num_tokens", "matched_tokens"}`` (plus policy-specific
keys such as ``"conversation"``). ``score`` is a cost where lower wins (``kv_cache_aware``), the
load metric (``load_balancing``), or None where no score applies.

Policies are synchronous and deterministic given their inputs: the only state is what they
must remember (round-robin cursors, conversation pins, a seeded rng for power-of-two choices).
``make_policy`` validates arguments strictly; upstream ``trtllm-serve`` router arguments are
accepted with the meaning documented in docs/routing.md ("Policies").

The records and the interface live in router/policy_base.py, ``RoundRobinPolicy`` and
``LoadBalancingPolicy`` in router/policy_load.py, ``KvCacheAwarePolicy`` in router/policy_kv.py and
``ConversationPolicy`` in router/policy_conversation.py. This module holds ``make_policy`` and is
where callers import all of them from.
"""

from __future__ import annotations

import difflib
from typing import Any

from protocol.failures import NoServerAvailable

from .policy_base import Candidate, Decision, IndexLoadView, LoadView, Policy, RoutingKey
from .policy_conversation import ConversationPolicy
from .policy_kv import KvCacheAwarePolicy
from .pairing import POLICY_TYPES
from .policy_load import LoadBalancingPolicy, RoundRobinPolicy

__all__ = [
    "Candidate", "RoutingKey", "LoadView", "Decision", "NoServerAvailable", "Policy",
    "RoundRobinPolicy", "LoadBalancingPolicy", "KvCacheAwarePolicy", "ConversationPolicy",
    "IndexLoadView", "make_policy", "POLICY_TYPES",
]


# ---------------------------------------------------------------------------------------------
# make_policy: strict argument validation

_NUM = (int, float)


def _check_type(ptype: str, name: str, value: Any, kind) -> Any:
    ok = True
    if kind is bool:
        ok = type(value) is bool
    elif kind is int:
        ok = type(value) is int
    elif kind == "num":
        ok = isinstance(value, _NUM) and type(value) is not bool
    elif kind == "num?":
        ok = value is None or (isinstance(value, _NUM) and type(value) is not bool)
    elif kind == "int?":
        ok = value is None or type(value) is int
    elif kind is str:
        ok = isinstance(value, str)
    elif kind == "str?":
        ok = value is None or isinstance(value, str)
    if not ok:
        want = {"num": "a number", "num?": "a number or null", "int?": "an int or null",
                "str?": "a string or null"}.get(kind, getattr(kind, "__name__", str(kind)))
        raise ValueError(f"router {ptype!r}: argument {name!r} must be {want}, "
                         f"found {value!r} ({type(value).__name__})")
    return value


# upstream trtllm-serve copies these into every router's args
_COMMON_UPSTREAM = {"max_batch_size": "int?", "max_num_tokens": "int?"}
# consumed by the fleet's tokenizer, not by the policy
_TOKENIZER_ARGS = {"custom_tokenizer": "str?", "tokenizer_dir": "str?", "use_harmony": bool,
                   "model_path": "str?"}

_SPECS: dict[str, dict[str, Any]] = {
    "round_robin": {},
    "load_balancing": {"use_tokens": bool, "power_of_two_choices": bool, "seed": "int?"},
    "kv_cache_aware": {
        "cost": "str?", "uncached_weight": "num", "decode_weight": "num",
        "prefill_tokens_per_s": "num?", "decode_step_s": "num?", "learn_rates": bool,
        "hotspot_slack_s": "num?",
        "prefill_weight": "num", "load_tokens_weight": "num", "load_requests_weight": "num",
        "affinity_bonus": "num", "affinity_slack": "num", "hotspot_factor": "num?",
        "hotspot_slack": "num", "max_conversations": int, "track_routed_blocks": bool, "speculative_ttl_s": "num",
        "explain_rows": int, "implicit_sessions": bool,
        # upstream KvCacheAwareRouter
        "use_tokens": bool, "load_weight": "num", "load_cap": "num?",
        "tokens_per_block": "int?", **_TOKENIZER_ARGS,
    },
    "conversation": {
        "match_threshold": "num", "max_sessions": int, "implicit_sessions": bool,
        "tokens_per_block": "int?", "use_tokens": bool,
        # upstream ConversationRouter
        "use_token_ids": bool, "hash_skip_count": int,
    },
}
# The types and their traits are pairing's table (router/pairing.py `PolicyKind`).
assert tuple(_SPECS) == POLICY_TYPES, "router/pairing.py PolicyKind and _SPECS list other types"


def _positive(ptype: str, name: str, v, allow_zero: bool = False):
    if v is not None and (v < 0 or (v == 0 and not allow_zero)):
        raise ValueError(f"router {ptype!r}: argument {name!r} must be "
                         f"{'non-negative' if allow_zero else 'positive'}, found {v!r}")


def make_policy(type: str, args: dict | None = None, *, block_size: int = 16,
                seed: int | None = None) -> Policy:
    """Build a policy; unknown or mistyped arguments raise ValueError naming the argument."""
    ptype = type
    if ptype not in _SPECS:
        close = difflib.get_close_matches(str(ptype), list(POLICY_TYPES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown router type {ptype!r}{hint}; expected one of {', '.join(POLICY_TYPES)}")
    args = dict(args or {})
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, found {block_size!r}")
    spec = {**_COMMON_UPSTREAM, **_SPECS[ptype]}
    for name, value in args.items():
        if name not in spec:
            close = difflib.get_close_matches(str(name), sorted(spec), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"router {ptype!r}: unknown argument {name!r}{hint}; expected one of "
                             f"{', '.join(sorted(spec)) or '(none)'}")
        _check_type(ptype, name, value, spec[name])
    for name in ("prefill_weight", "load_tokens_weight", "load_requests_weight", "affinity_bonus",
                 "affinity_slack", "hotspot_slack", "load_weight", "hotspot_factor", "load_cap", "uncached_weight",
                 "decode_weight", "hotspot_slack_s", "decode_step_s"):
        _positive(ptype, name, args.get(name), allow_zero=True)
    _positive(ptype, "prefill_tokens_per_s", args.get("prefill_tokens_per_s"))
    for name in ("max_conversations", "max_sessions", "speculative_ttl_s", "max_batch_size",
                 "explain_rows",
                 "tokens_per_block", "max_num_tokens"):
        _positive(ptype, name, args.get(name))
    passthrough = {k: args.pop(k) for k in list(args) if k in _TOKENIZER_ARGS or k in (
        "max_num_tokens", "tokens_per_block")}
    policy: Policy
    if ptype == "round_robin":
        args.pop("max_batch_size", None)
        policy = RoundRobinPolicy(block_size)
    elif ptype == "load_balancing":
        args.pop("max_batch_size", None)
        if "seed" not in args:
            args["seed"] = seed
        policy = LoadBalancingPolicy(block_size, **args)
    elif ptype == "kv_cache_aware":
        if "load_weight" in args:
            if "load_requests_weight" in args:
                raise ValueError(f"router {ptype!r}: give 'load_weight' (upstream, in matched "
                                 "blocks per request) or 'load_requests_weight' (tokens per "
                                 "request), not both")
            args["load_requests_weight"] = float(args.pop("load_weight")) * block_size
        use_tokens = args.pop("use_tokens", None)
        if use_tokens is False and "load_tokens_weight" not in args:
            args["load_tokens_weight"] = 0.0
        if args.get("cost") not in (None, "time", "tokens"):
            raise ValueError(f"router {ptype!r}: argument 'cost' must be 'time' or 'tokens', "
                             f"found {args['cost']!r}")
        try:
            policy = KvCacheAwarePolicy(block_size, **args)
        except ValueError as e:
            raise ValueError(f"router {ptype!r}: {e}") from None
    else:
        skip = args.pop("hash_skip_count", 0)
        if skip:
            raise ValueError(
                f"router {ptype!r}: hash_skip_count={skip} is not supported: block keys are "
                "chained from the first token, so a prefix cannot be skipped; raise "
                "match_threshold instead so a shared system prompt alone does not match")
        args.pop("use_token_ids", None)  # we always match on token ids
        args.pop("max_batch_size", None)
        tpb = passthrough.pop("tokens_per_block", None)
        if tpb is not None:
            args["tokens_per_block"] = tpb
        if not 0 < args.get("match_threshold", 0.75) <= 1:
            raise ValueError(f"router {ptype!r}: argument 'match_threshold' must be in (0, 1], "
                             f"found {args['match_threshold']!r}")
        policy = ConversationPolicy(block_size, **args)
    policy.passthrough = passthrough
    return policy
