"""The one native module: router/_chain.c (canonical block keys in one call).

Everything else is in pyproject.toml. The extension is optional: without a C compiler the build
goes on and router/block_keys.py uses its pure-Python recipe (same keys, 14-24x fewer tokens per second,
bench/RESULTS.md "router core";
`router.block_keys.NATIVE` says which one runs).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("router._chain", ["router/_chain.c"], optional=True,
                             extra_compile_args=["-O2"])])
