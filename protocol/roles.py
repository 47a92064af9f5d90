"""Server roles and placement modes: one spelling on every wire and in every label.

`Role` is what the coordinator leases and the fleet places (`/select`'s `role`; the aliases the
coordinator API accepts are `Role.parse`'s, unchanged). `Mode` is how a request was served: the
coordinator's `/select_pair` answers one of `PAIR_MODES`; the fleet labels its route header and
`splitserve_fleet_placements_total` with any member (the last three are decided by the fleet alone).
"""
from __future__ import annotations

from enum import StrEnum

__all__ = ["Role", "Mode", "PAIR_MODES", "ROLE_ALIASES"]


class Role(StrEnum):
    CONTEXT = "context"
    GENERATION = "generation"

    @classmethod
    def parse(cls, name: object) -> "Role | None":
        """The role named by `name` (canonical or an accepted alias), or None."""
        v = ROLE_ALIASES.get(name) if isinstance(name, str) else None
        return None if v is None else cls(v)


# The names the coordinator API accepts for a role (docs/coordinator-api.md) → the canonical name,
# as a plain `str` (the Role's value): state tables and answers keyed by role hold plain strings,
# which msgspec and every JSON/msgpack codec treat as such.
ROLE_ALIASES: dict[str, str] = {
    alias: role.value
    for role, names in ((Role.CONTEXT, ("context", "ctx", "prefill")),
                        (Role.GENERATION, ("generation", "gen", "decode")))
    for alias in names
}


class Mode(StrEnum):
    # placed by /select_pair (or the fleet's local fallback for it)
    DISAGGREGATED = "disaggregated"              # a context leg, then a generation leg
    LOCAL_PREFILL = "generation_only"            # conditional disaggregation: the generation server
    #   prefills the uncached rest (<= max_local_prefill_length tokens) itself; the wire value is our
    #   API's (not TensorRT-LLM's request_type "generation_only", which means "receives the KV")
    AGGREGATE_FALLBACK = "aggregate_fallback"    # no healthy context server: generation serves alone
    # decided by the fleet
    AGGREGATED = "aggregated"                    # no context servers configured
    CONTEXT_ONLY = "context_only"                # the context leg already finished the request
    NO_KV_TRANSFER = "no_kv_transfer"            # the generation server cannot receive KV (501)


PAIR_MODES = frozenset({Mode.DISAGGREGATED, Mode.LOCAL_PREFILL, Mode.AGGREGATE_FALLBACK})
