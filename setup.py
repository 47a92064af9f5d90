"""The native modules: router/_chain.c (canonical block keys in one call), router/_kv_cost.c
(the numeric core of kv_cache_aware placement), router/_owner_map.c (the KV index's owner masks
as a native table, with its prefix walk and speculative inserts and expiries) and
router/_prefix_pins.c (kv_cache_aware's implicit sessions: prompt prefixes -> their latest server),
and transfer/_spin.c (the control listeners' bounded busy-poll with the GIL released).

Everything else is in pyproject.toml. The extensions are optional: without a C compiler the build
goes on and the pure-Python recipes run instead (the same keys and decisions; block keys 14-24x
fewer tokens per second, bench/RESULTS.md "router core"). `router.block_keys.NATIVE`,
`router.policy_kv.NATIVE`, `router.kv_owners.NATIVE`, `router.prefix_pins.NATIVE` and
`transfer.zmq_io.SPIN_NATIVE` say which ones run (without transfer/_spin.c the listeners never
spin: they sleep in poll until a message comes, as they always did).
"""
from setuptools import Extension, setup

# -ffp-contract=off: the placement core's costs must be the same doubles as its Python recipe's
# (router/_kv_cost.c), so no multiply-add may be fused.
_FLAGS = ["-O2", "-ffp-contract=off"]

# router/_args.h: what the first three share, included by each (a header: each module stays one source,
# as bench/routing/judged.sh compiles them); `depends` rebuilds them when it changes.
_DEPENDS = ["router/_args.h"]

setup(ext_modules=[Extension("router._chain", ["router/_chain.c"], optional=True,
                             extra_compile_args=_FLAGS, depends=_DEPENDS),
                   Extension("router._kv_cost", ["router/_kv_cost.c"], optional=True,
                             extra_compile_args=_FLAGS, depends=_DEPENDS),
                   Extension("router._owner_map", ["router/_owner_map.c"], optional=True,
                             extra_compile_args=_FLAGS, depends=_DEPENDS),
                   Extension("router._prefix_pins", ["router/_prefix_pins.c"], optional=True,
                             extra_compile_args=_FLAGS),
                   Extension("transfer._spin", ["transfer/_spin.c"], optional=True,
                             extra_compile_args=_FLAGS)])
