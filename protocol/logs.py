"""One log format for every splitserve process (coordinator, fleet, launcher, worker):

    2026-12-07 13:40:01,123 INFO [pid 4242] splitserve.fleet: fleet process 4242 ready ...

or, with `log_format: json` (`--log-format json`, `SPLITSERVE_LOG_FORMAT=json`), one JSON object
per line: `{"ts", "level", "pid", "logger", "msg"}` plus `exc` with the traceback and any fields a
record carries in `extra={"fields": {...}}` (the fleet's access log: `fleet.access_log`).
"""
from __future__ import annotations

import json
import logging
import time

__all__ = ["FORMATS", "TEXT_FORMAT", "setup"]

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s [pid %(process)d] %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname, "pid": record.process,
               "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once for this process (replacing any earlier handler)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, found {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))
