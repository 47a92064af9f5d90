"""Pairing: which servers a request's two legs go to, and in which mode, decided once.

The coordinator places pairs with its index and leases (`coordinator/service.py` `place_pair`); a
fleet process places them over its own last-known server list for `round_robin`, and for every
policy while the coordinator is unreachable (`fleet/placement.py`). Both call `pair` below with
their own leg placers, so the rules cannot drift apart between the two processes
(tests/router/test_pairing.py drives both paths with the same inputs).

What is decided here:
- the policy traits (`PolicyKind`): which policies the coordinator places (a lease) and which need
  a routing key;
- the modes a pair can be placed in (`protocol.roles.Mode`, the one spelling):
  `disaggregated`; `generation_only` (conditional disaggregation: the generation server already
  caches all but `max_local_prefill_length` prompt tokens); `aggregate_fallback` (no context
  server, `no_context_fallback: aggregate`);
- the context-fallback rule, at placement and after a context leg that found no reachable server;
- the mode once the legs are known (`settle`: a generation server that cannot receive KV).

Pure and synchronous: placing a leg is the caller's function; nothing here does I/O or keeps state.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, TypeVar

from protocol.failures import NoServerAvailable
from protocol.roles import Mode

__all__ = ["PolicyKind", "POLICY_TYPES", "PairRules", "Pair", "NoContextServer", "pair", "settle"]


class PolicyKind(str, enum.Enum):
    """A routing policy type (the config's `router.type`) and its traits.

    `delegated`: the coordinator places it and holds a lease for it (round robin is placed by each
    fleet process from its server list, without a lease). `keyed`: it needs a routing key (block
    keys or a conversation id), so the fleet tokenizes the prompt for it."""

    def __new__(cls, value: str, delegated: bool, keyed: bool):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.delegated = delegated
        obj.keyed = keyed
        return obj

    ROUND_ROBIN = ("round_robin", False, False)
    LOAD_BALANCING = ("load_balancing", True, False)
    KV_CACHE_AWARE = ("kv_cache_aware", True, True)
    CONVERSATION = ("conversation", True, True)

    def __str__(self) -> str:
        return self.value


POLICY_TYPES: tuple[str, ...] = tuple(k.value for k in PolicyKind)


class NoContextServer(NoServerAvailable):
    """No context server can take the leg and `no_context_fallback` is `reject`."""


@dataclass(frozen=True, slots=True)
class PairRules:
    """The config's pairing rules. `max_local_prefill_length` None: conditional disaggregation off."""
    max_local_prefill_length: int | None = None
    no_context_fallback: str = "aggregate"      # "aggregate" | "reject"

    @classmethod
    def of(cls, config) -> "PairRules":
        """The rules of a `ClusterConfig` (`conditional_disagg_config`, `no_context_fallback`)."""
        cd = config.conditional_disagg_config
        return cls(cd.max_local_prefill_length if cd is not None else None, config.no_context_fallback)

    @property
    def rejects(self) -> bool:
        """No context server means 503, not a generation server alone."""
        return self.no_context_fallback != "aggregate"

    def local_prefill(self, num_tokens: int | None, matched_tokens: int) -> str | None:
        """Conditional disaggregation: why the generation server prefills the prompt itself (the
        context leg is skipped), or None. Only a real cache match counts: a server that caches
        nothing never skips the context leg, however short the prompt."""
        limit = self.max_local_prefill_length
        if limit is None or not num_tokens or matched_tokens <= 0:
            return None
        uncached = num_tokens - matched_tokens
        if uncached > limit:
            return None
        return (f"generation server caches {matched_tokens} of {num_tokens} tokens; "
                f"{uncached} <= max_local_prefill_length {limit}")

    def without_context(self, exc: NoServerAvailable) -> str:
        """No context server could be placed: the reason the generation server serves alone
        (`aggregate_fallback`), or `NoContextServer` raised under `reject`."""
        if self.rejects:
            raise NoContextServer(exc.reason)
        return f"{exc}; serving on the generation server alone"

    def serving_mode(self, ctx: int, gen: int, min_ctx: int, min_gen: int) -> str | None:
        """How requests are served with `ctx` / `gen` healthy servers against the readiness
        minimums (`ClusterConfig.health_minimums`), or None when they cannot be: the fleet's
        `/ready` (issue 39). Context servers short of their minimum still serve under `aggregate`
        (`aggregate_fallback` on a generation server), so readiness must not fail there."""
        if gen < min_gen:
            return None
        if ctx >= min_ctx:
            return Mode.DISAGGREGATED if ctx else Mode.AGGREGATED
        if self.rejects or not gen:
            return None
        return Mode.AGGREGATE_FALLBACK

    def aggregates_after_context_loss(self, healthy_context_servers: int) -> bool:
        """A context leg that found no reachable server (every retry spent) is served on the
        generation server alone under `aggregate`, once no context server is usable any more."""
        return not self.rejects and not healthy_context_servers


L = TypeVar("L")
# (context leg or None, generation leg, mode, reason or None): a plain tuple, since both callers
# unpack it at once (a dataclass cost ~3x a tuple per pair; round robin pairs every request).
Pair = tuple["L | None", L, Mode, "str | None"]

# the members read once: a StrEnum member looked up on its class costs several times a global
_DISAGGREGATED, _LOCAL_PREFILL, _AGGREGATE_FALLBACK = (
    Mode.DISAGGREGATED, Mode.LOCAL_PREFILL, Mode.AGGREGATE_FALLBACK)
_NO_KV_TRANSFER = Mode.NO_KV_TRANSFER


def pair(rules: PairRules, num_tokens: int | None, place_generation: Callable[[], L],
         matched_tokens: Callable[[L], int], place_context: Callable[[], L],
         release_generation: Callable[[L], object] | None = None) -> Pair:
    """Place both legs: the generation leg first, so conditional disaggregation can read its cache
    match (`matched_tokens(generation)`); then the context leg, unless skipped. Leg placers raise
    `NoServerAvailable`; a generation failure propagates, a context failure follows
    `no_context_fallback` (`release_generation` undoes the generation placement before
    `NoContextServer` is raised). Returns `(context or None, generation, mode, reason)`."""
    gen = place_generation()
    if rules.max_local_prefill_length is not None and num_tokens:
        reason = rules.local_prefill(num_tokens, matched_tokens(gen))
        if reason is not None:
            return None, gen, _LOCAL_PREFILL, reason
    try:
        ctx = place_context()
    except NoServerAvailable as exc:
        try:
            reason = rules.without_context(exc)
        except NoContextServer:
            if release_generation is not None:
                release_generation(gen)
            raise
        return None, gen, _AGGREGATE_FALLBACK, reason
    return ctx, gen, _DISAGGREGATED, None


def settle(mode: str, has_context: bool, receives_kv: bool) -> tuple[str, bool]:
    """(mode, whether the context leg runs) once the legs are placed: a generation server known
    not to receive KV (or of another engine family) serves the request alone, so the context leg
    would be wasted work."""
    if has_context and not receives_kv:
        return _NO_KV_TRANSFER, False
    return mode, has_context
