"""The log of ``ctxfold serve``: the standard library's logging, configured once by the command.

Every line has a UTC timestamp, the level and the logger; ``--log-format json`` writes one JSON object a
line instead (``time``, ``level``, ``logger``, ``message``, and the fields a line carries: an access
line's ``status``, ``tenant``, ``prompt_tokens``, ...), for a collector to read without a pattern. A JSON
formatter is a dozen lines: written here rather than a dependency added for it.

Loggers: ``ctxfold.access`` (one line per chat completion, INFO), ``ctxfold.serve`` (compactions,
fallbacks, pass-throughs, quarantines, changes of health), ``ctxfold.store`` (the spool).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
# The attributes every LogRecord has: what is not among them was passed with extra= and is a field.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class _UtcFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(_UtcFormatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")


class JsonFormatter(_UtcFormatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname.lower(),
                               "logger": record.name, "message": record.getMessage()}
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_"))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send ctxfold's log lines to stderr at ``level`` and above, as ``fmt`` ("text" or "json"). Its own
    loggers only: an embedder's root logger is left as it is."""
    if level not in LOG_LEVELS or fmt not in LOG_FORMATS:
        raise ValueError(f"log level {level!r} / format {fmt!r}: expected one of {LOG_LEVELS} / {LOG_FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger = logging.getLogger("ctxfold")
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
