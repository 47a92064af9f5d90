"""splitserve's version, read once from the installed package's metadata (pyproject.toml's
`version`, its one source): what `--version`, the coordinator's and the fleet's `/version` and
`/cluster_info` report."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("splitserve")
except PackageNotFoundError:      # run from a source tree that was never installed
    VERSION = "0+unknown"
