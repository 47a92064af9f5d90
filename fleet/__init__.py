"""The public OpenAI front door: validation, snowflake ids, placement through the coordinator, the
two-leg flow for each engine protocol, relaying, metrics and the multi-process launcher
(docs/design.md §1, §4, §5; docs/fleet.md)."""
