"""The log of ``ctxfold serve``: the standard library's logging, configured once by the command.

Every line has a UTC timestamp, the level and the logger; ``--log-format json`` writes one JSON object a
line instead (``time``, ``level``, ``logger``, ``message``, and the fields a line carries: an access
line's ``status``, ``tenant``, ``prompt_tokens``, ...), for a collector to read without a pattern. A JSON
formatter is a dozen lines: written here rather than a dependency added for it.

Loggers: ``ctxfold.access`` (one line per chat completion, INFO), ``ctxfold.serve`` (compactions,
fallbacks, pass-throughs, quarantines, changes of health), ``ctxfold.compaction.store`` (the spool).

The event loop never waits on a log write: a line goes into a bounded queue, and a thread of its own
writes what the queue holds to stderr every 50 ms, in one write (a line is written at most that late;
a wake of the writer and a write per line cost the proxy a tenth of its CPU under load). A stderr
nobody reads (a pipe whose reader took the first line and stopped)
would otherwise block the whole proxy once the pipe is full; instead the lines past the queue's bound
are dropped and counted (:func:`dropped_lines`). Each worker of a pool starts its own writer thread
(threads do not survive a fork).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")
QUEUE_LINES = 10_000  # lines waiting for the writer thread at most; more are dropped and counted
WRITE_LINES = 1024  # lines written together at most
WRITE_INTERVAL_S = 0.05  # the writer writes what came every this often: a line waits this long at most
LOG_FORMATS = ("text", "json")
_TRACEBACKS = logging.Formatter()  # formats a record's exception where it is logged
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
        exception = record.exc_text or (self.formatException(record.exc_info) if record.exc_info else None)
        if exception:
            out["exception"] = exception
        return json.dumps(out, ensure_ascii=False, default=str)


class _DroppingQueueHandler(logging.Handler):
    """Appends each record to a bounded queue the writer thread takes from; a full queue drops the
    record and counts it rather than wait. No lock and no wake: appending to a deque is atomic, and
    the writer looks every :data:`WRITE_INTERVAL_S` (a wake of the writer per line cost the event
    loop's thread more than the line itself). The writer formats: the records of ctxfold's lines hold
    values that do not change once logged."""

    def __init__(self, lines: deque[logging.LogRecord]) -> None:
        super().__init__()
        self.lines = lines
        self.dropped = 0

    def createLock(self) -> None:
        self.lock = None

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) >= QUEUE_LINES:
            self.dropped += 1
            return
        if record.exc_info:  # the traceback as text now: a waiting record must not keep its frames alive
            record.exc_text = _TRACEBACKS.formatException(record.exc_info)
            record.exc_info = None
        self.lines.append(record)


_state: dict[str, Any] = {}  # the queue's handler, the writer thread, the stream handler it writes through


class _StderrWriter(logging.Handler):
    """What the writer thread writes through: lines straight to file descriptor 2, those that wait
    together in one write. No lock (one thread uses it) and nothing to flush, so neither the
    interpreter's exit (logging.shutdown) nor anything else ever waits on a write the pipe's reader
    never takes."""

    def createLock(self) -> None:
        self.lock = None

    def emit(self, record: logging.LogRecord) -> None:
        self.emit_many([record])

    def emit_many(self, records: list[logging.LogRecord]) -> None:
        data = "".join(self._line(r) + "\n" for r in records).encode("utf-8", "backslashreplace")
        try:
            while data:  # a blocking write writes it all, but for a signal part way
                data = data[os.write(2, data):]
        except OSError:
            pass  # stderr is gone (closed, a broken pipe): the lines with it

    def _line(self, record: logging.LogRecord) -> str:
        try:
            return self.format(record)
        except Exception as e:  # noqa: BLE001 - a call whose arguments do not fit its message: said, not lost
            record.msg = f"this log line could not be formatted ({type(e).__name__}: {e}): {record.msg!r} % {record.args!r}"
            record.args = None
        try:
            return self.format(record)  # in the log's format, as every other line
        except Exception:  # noqa: BLE001 - a field that even the formatter's fallback cannot write
            return f"{record.levelname} {record.name}: {record.msg}"

    def flush(self) -> None:
        return None


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send ctxfold's log lines to stderr at ``level`` and above, as ``fmt`` ("text" or "json"), through
    a bounded queue and a writer thread (see the module docstring). Its own loggers only: an embedder's
    root logger is left as it is."""
    if level not in LOG_LEVELS or fmt not in LOG_FORMATS:
        raise ValueError(f"log level {level!r} / format {fmt!r}: expected one of {LOG_LEVELS} / {LOG_FORMATS}")
    stop_logging()
    out = _StderrWriter()
    out.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler = _start(out)
    logger = logging.getLogger("ctxfold")
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    if not _state.get("hooks"):
        os.register_at_fork(after_in_child=_restart_in_child)
        atexit.register(stop_logging)
        _state["hooks"] = True


def _start(out: _StderrWriter) -> _DroppingQueueHandler:
    lines: deque[logging.LogRecord] = deque()
    handler = _DroppingQueueHandler(lines)
    stop = threading.Event()
    writer = threading.Thread(target=_write, args=(lines, out, stop), name="ctxfold-log-writer", daemon=True)
    writer.start()
    _state.update(handler=handler, writer=writer, out=out, stop=stop)
    return handler


def _write(lines: deque[logging.LogRecord], out: _StderrWriter, stop: threading.Event) -> None:
    """Every :data:`WRITE_INTERVAL_S`, write the lines that came meanwhile in one write; ``stop``
    ends it, once what came before is written."""
    while True:
        stopping = stop.wait(WRITE_INTERVAL_S)
        while lines:
            out.emit_many([lines.popleft() for _ in range(min(len(lines), WRITE_LINES))])
        if stopping:
            return


def _restart_in_child() -> None:
    """After a fork: the writer thread stayed in the parent; the child gets a queue and a thread of its own."""
    old = _state.get("handler")
    if old is None:
        return
    logger = logging.getLogger("ctxfold")
    logger.removeHandler(old)
    logger.addHandler(_start(_state["out"]))


def dropped_lines() -> int:
    """Lines dropped since logging was configured because the writer could not keep up."""
    handler = _state.get("handler")
    return handler.dropped if handler is not None else 0


def stop_logging(timeout_s: float = 2.0) -> None:
    """Write what waits in the queue and stop the writer thread, waiting ``timeout_s`` at most (a stderr
    nobody reads must not keep the process from exiting)."""
    handler, writer, stop = _state.pop("handler", None), _state.pop("writer", None), _state.pop("stop", None)
    if handler is None or writer is None or stop is None:
        return
    stop.set()
    writer.join(timeout_s)
