"""``ctxfold serve --upstream URL``: the compacting OpenAI-compatible proxy."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ctxfold.compaction.config import CompactConfig, load_config
from ctxfold.errors import ConfigError

EPILOG = """examples:
  ctxfold serve --upstream http://127.0.0.1:8000/v1 --context-tokens 131072
  ctxfold serve --upstream http://gpu-1:8000/v1 --context-tokens 32k --port 8080 --data-dir /var/lib/ctxfold
  ctxfold serve --upstream https://api.deepseek.com/v1 --context-tokens 128k --max-output-tokens 8192
  ctxfold serve --upstream http://127.0.0.1:8000/v1 --config agent.yml --summarizer config
  ctxfold serve --upstream http://vllm:8000/v1 --context-tokens 64k --archive-url s3://bucket/ctxfold
  ctxfold serve --upstream http://vllm:8000/v1 --context-tokens 64k --store redis://redis:6379/0 --workers 4

Point the client's OpenAI base URL at http://HOST:PORT/v1. A conversation is named by the
X-Ctxfold-Session header, else by its system prompt and first message. Sessions, history dumps
and archives live in --data-dir; a restarted proxy resumes every conversation. GET /health, GET
/metrics (Prometheus text). Details: docs/serve.md.

exit codes: 0 stopped by a signal, 2 usage error (bad option or setting), 3 the data directory
or the port cannot be used, 4 tokenizer or package (the serve extra) unavailable, 5 internal error."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from ctxfold.cli._common import FORMATTER, port_number, positive_int, wrap
    from ctxfold.cli._flags import add_setting_flags, flag_type
    from ctxfold.compaction.config import CompactConfig, SummaryConfig
    from ctxfold.serve.config import (
        CLIENTS,
        COMPACTION,
        HELP_GROUPS,
        LISTENING,
        LOGGING,
        STORAGE,
        SUMMARIES,
        ProxyConfig,
    )
    from ctxfold.serve.logs import LOG_FORMATS, LOG_LEVELS
    from ctxfold.settings import field_check

    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run an OpenAI-compatible proxy that compacts every conversation to fit the upstream's window",
        description=wrap("Accept OpenAI chat.completions requests (streaming and not), keep each conversation "
        "as a ctxfold session in the data directory, compact it when it nears the window, forward the "
        "compacted request to the upstream and stream the answer back unchanged."),
        epilog=EPILOG, formatter_class=FORMATTER,
    )
    groups = {title: p.add_argument_group(title) for title in HELP_GROUPS}
    # The proxy's own settings come from ProxyConfig's fields (add_setting_flags). The flags here are not
    # fields: the compaction settings (a CompactConfig's, checked as its fields are), the secrets (read from
    # the environment: a command line is visible to every local user), how the command listens and logs.
    compaction = groups[COMPACTION]
    compaction.add_argument("--config", type=Path, metavar="FILE",
                            help="compaction settings (YAML or TOML, agent.compact)")

    def compact_type(name: str) -> Any:
        return flag_type(field_check(CompactConfig, name))

    compaction.add_argument("--context-tokens", "--ctx", type=compact_type("context_tokens"), metavar="TOKENS",
                            help="the upstream model's context window (16k, 128k, ...); unset: token triggers "
                            "are off")
    compaction.add_argument("--max-output-tokens", type=compact_type("max_output_tokens"), metavar="TOKENS",
                            help="the model's reply cap (sets the reply reserve)")
    compaction.add_argument("--reply-reserve-tokens", type=compact_type("reply_reserve_tokens"), metavar="TOKENS",
                            help="tokens kept free for the answer (default: min(max output or 8192, 20480))")
    add_setting_flags(groups, ProxyConfig)
    groups[SUMMARIES].add_argument(
        "--summary-timeout-s", type=flag_type(field_check(SummaryConfig, "timeout_s")), metavar="S",
        help="time budget of a summary written by a model, connection to last token; past it the extractive "
        "summary is used and the log and ctxfold_summary_fallbacks_total say so (default: the summarizer "
        "section of --config, else 120)")
    groups[SUMMARIES].add_argument(
        "--summary-api-key-env", metavar="NAME",
        help="environment variable holding the key summaries are sent with (--summarizer upstream; default: "
        "the Authorization header of the client request that triggered the compaction)")
    groups[CLIENTS].add_argument(
        "--operator-token-env", metavar="VAR",
        help="the environment variable holding a secret (16+ characters) that GET /metrics and the details of "
        "GET /health then require in an X-Ctxfold-Operator-Token header; without it they are open to every "
        "client that reaches the port")
    # An alias of a value of --fsync (dest fsync), not a setting of its own.
    groups[STORAGE].add_argument("--no-fsync", dest="fsync", action="store_const", const="never",
                                 help="the same as --fsync never")
    listening = groups[LISTENING]
    listening.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    listening.add_argument("--port", type=port_number, default=8080,
                           help="port to listen on, 0 to 65535 (default 8080; 0: any free port)")
    listening.add_argument("--workers", type=positive_int, default=1, metavar="N",
                           help="worker processes accepting on one listening socket (default 1); more than one "
                           "needs a shared session store, since each worker's sessions must be every worker's")
    listening.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                           help="asyncio event loop: uvloop (faster; in the serve extra), asyncio, or auto: "
                           "uvloop when it is installed (default)")
    groups[LOGGING].add_argument("--log-level", choices=LOG_LEVELS, default="info",
                                 help="the least severe log lines written to stderr (default info: one line per "
                                 "request, per compaction and per change of health)")
    groups[LOGGING].add_argument("--log-format", choices=LOG_FORMATS, default="text",
                                 help="text (a timestamp, the level, the logger, the message) or json (one object "
                                 "a line, with each line's fields)")
    return p


def secret_from_env(flag: str, var: str | None, field: str, what: str) -> str | None:
    """The secret environment variable ``var`` holds (None without the flag), checked as ProxyConfig's
    ``field`` is, the error naming the flag and the variable (never the secret)."""
    from ctxfold.cli import EXIT_USAGE, CommandError
    from ctxfold.serve.config import ProxyConfig
    from ctxfold.settings import SettingError, check_value, field_check

    if var is None:
        return None
    value = os.environ.get(var)
    if not value:
        raise CommandError(f"{flag} {var}: that environment variable is not set or empty; {what}", EXIT_USAGE)
    try:
        return str(check_value(field, value, field_check(ProxyConfig, field)))
    except SettingError as e:
        raise CommandError(f"{flag} {var}: {e.problem}", EXIT_USAGE) from None


def check_args(args: argparse.Namespace, compact: CompactConfig) -> None:
    """What argparse cannot see alone: --summarizer config without a config file, a data directory that
    is a file, and the window against the reply reserve (check_settings). Each setting itself (the
    upstream URL, every number) is checked by its flag, from ProxyConfig's own check of it."""
    from ctxfold.cli import EXIT_INPUT, EXIT_USAGE, CommandError
    from ctxfold.cli._common import check_settings

    if args.data_dir.exists() and not args.data_dir.is_dir():
        raise CommandError(f"--data-dir {args.data_dir}: exists and is not a directory", EXIT_INPUT)
    if args.summarizer == "config" and args.config is None:
        raise CommandError("--summarizer config: reads the summarizer section of --config FILE; add --config, "
                           "or choose --summarizer upstream or extractive", EXIT_USAGE)
    check_settings(args, compact)
    check_workers(args.workers, args.store_url)


def check_workers(workers: int, store: str | None) -> None:
    """Several workers serve any request of any conversation, so they must share the sessions: a local
    data directory is one process's (its locks and loaded sessions live in that process's memory)."""
    from ctxfold.cli import EXIT_USAGE, CommandError
    from ctxfold.compaction.store import is_shared_url

    if workers > 1 and (store is None or not is_shared_url(store)):
        raise CommandError(f"--workers {workers}: several worker processes need a shared session store "
                           "(Redis or Valkey); a --data-dir serves one process, so run --workers 1", EXIT_USAGE)


def build_config(args: argparse.Namespace) -> Any:
    from ctxfold.cli._flags import settings_from_args
    from ctxfold.serve.config import ProxyConfig, cli_session_ttl_s

    overrides = {k: getattr(args, k) for k in ("context_tokens", "max_output_tokens", "reply_reserve_tokens")
                 if getattr(args, k) is not None}
    compact = load_config(args.config, **overrides) if args.config else CompactConfig.from_mapping(overrides)
    if args.summary_timeout_s is not None:
        compact = replace(compact, summary=replace(compact.summary, timeout_s=args.summary_timeout_s))
    check_args(args, compact)
    summary_api_key = secret_from_env("--summary-api-key-env", args.summary_api_key_env, "summary_api_key",
                                      "export the key in it, or leave the option out to send the client's own "
                                      "Authorization header")
    operator_token = secret_from_env("--operator-token-env", args.operator_token_env, "operator_token",
                                     "export the secret in it (16 characters or more)")
    settings = settings_from_args(ProxyConfig, args)
    settings["session_ttl_s"] = cli_session_ttl_s(settings["session_ttl_s"], settings["store_url"])
    return ProxyConfig(**settings, compact=compact, summary_api_key=summary_api_key, operator_token=operator_token)


def startup_warnings(config: Any) -> list[str]:
    """What the operator should know before the first request: settings that leave the proxy doing
    less than they may think, and a data directory it cannot write."""
    out = []
    if config.compact.context_tokens is None:
        out.append("--context-tokens is not set: the model's window is unknown, so nothing is compacted "
                   "automatically (requests go upstream as they come); give it, e.g. --context-tokens 131072")
    try:
        with tempfile.NamedTemporaryFile(dir=config.data_dir, prefix=".startup-probe-"):
            pass
    except OSError as e:
        out.append(f"the data directory {config.data_dir} cannot be written ({e.strerror or e}): every request "
                   "will pass through uncompacted until it can")
    return out


def run(args: argparse.Namespace) -> int:
    from ctxfold.serve import require_serve_extra

    require_serve_extra()
    from ctxfold.serve.app import serve

    config = build_config(args)
    if not config.data_dir.exists():
        from ctxfold.compaction.archive.store import make_private_dir

        make_private_dir(config.data_dir)  # 0700: it holds users' conversations

    from ctxfold.serve.app import redact_url

    warnings = startup_warnings(config)

    def ready(url: str) -> None:
        where = f"sessions in {redact_url(config.store_url)}" if config.store_url else f"data in {config.data_dir}"
        print(f"ctxfold serve: listening on {url}, forwarding to {redact_url(config.completions_url)}, {where}",
              file=sys.stderr, flush=True)
        for line in warnings:  # after the line that says it listens: scripts wait for that one first
            print(f"ctxfold serve: warning: {line}", file=sys.stderr, flush=True)
        logging.getLogger("ctxfold").setLevel(args.log_level.upper())  # the lines below warning, from now on

    loop_factory = event_loop_factory(args.event_loop)
    # The last step before serving: a command that stops on a bad setting leaves the process's logging as it
    # was. Warnings and errors from now on; the rest once the listening line is out (ready), which scripts
    # read first.
    from ctxfold.serve.logs import configure_logging

    configure_logging("error" if args.log_level == "error" else "warning", args.log_format)
    try:
        if args.workers > 1:
            return serve_workers(config, args.host, args.port, args.workers, ready=ready, loop_factory=loop_factory)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config, args.host, args.port, ready=ready, stop_on_signals=True))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        # The listening socket (no file name, unlike a data directory error): say which address, plainly.
        if exc.filename is None and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            from ctxfold.cli import EXIT_INPUT, CommandError

            raise CommandError(f"--host {args.host} --port {args.port}: cannot listen there ({os.strerror(exc.errno)}); "
                               "choose another port, or --port 0 for any free one", EXIT_INPUT) from exc
        raise
    return 0


def share_metrics_between_workers(folder: Path) -> None:
    """Make the workers forked from here on write their metrics under ``folder`` (emptied first: an
    earlier run's figures would be added in), so /metrics sums them all (prometheus_client's
    multiprocess mode)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for old in folder.glob("*.db"):
        old.unlink()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    values = sys.modules.get("prometheus_client.values")
    if values is not None:
        # Imported already (an embedder's code, or the proxy's config): the library picks where values
        # live when it is imported, so it is told again; metrics made from here on (in the workers) use it.
        values.ValueClass = values.get_value_class()  # type: ignore[attr-defined]


def serve_workers(config: Any, host: str, port: int, workers: int, *, ready: Callable[[str], None] | None = None,
                  loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> int:
    """Run ``workers`` processes of the proxy, all accepting on one listening socket that this process
    binds before it forks them (so ``--port 0`` gives them all one port, and no connection is refused
    while they start: the kernel queues it until one accepts). Each worker has its own event loop and
    its own proxy; the kernel hands each new connection to one of them. SIGTERM or SIGINT here stops them
    all (exit 0); a worker that exits on its own stops the others, and the exit code says so (1), so that
    a supervisor restarts the whole pool rather than leaving it short. POSIX only (fork)."""
    import signal
    import socket
    import traceback

    share_metrics_between_workers(config.data_dir / "metrics")
    from ctxfold.serve.app import serve
    from ctxfold.serve.metrics import mark_worker_dead

    if config.tenant_key_file is None and not os.environ.get("CTXFOLD_TENANT_KEY"):
        # Made once here, before the fork: workers that made it at once could read it half written.
        from ctxfold.serve.keys import load_tenant_key

        load_tenant_key(config.data_dir)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    bound = sock.getsockname()[1]
    if ready is not None:  # listening already (connections queue until a worker accepts), and said first
        ready(f"http://{host}:{bound} ({workers} workers)")
    pids: list[int] = []
    for worker in range(workers):
        pid = os.fork()
        if pid == 0:  # the worker: serve until told to stop, and never return into the parent's code
            code = 0
            try:
                with asyncio.Runner(loop_factory=loop_factory) as runner:
                    runner.run(serve(config, host, port, stop_on_signals=True, sock=sock, worker=worker))
            except KeyboardInterrupt:
                pass
            except BaseException:  # noqa: BLE001 - the worker's last word, then its exit code
                traceback.print_exc()
                code = 1
            finally:
                from ctxfold.serve.logs import stop_logging

                stop_logging()  # os._exit runs no atexit hook: the lines still queued are written first
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    sock.close()  # the workers hold it; the parent only waits
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for p in pids:
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while pids:
        pid, status = os.wait()
        pids.remove(pid)
        mark_worker_dead(pid)
        if not stopping:
            print(f"ctxfold serve: worker {pid} exited ({os.waitstatus_to_exitcode(status)}); stopping the others",
                  file=sys.stderr, flush=True)
            code = 1
            stop(signal.SIGTERM, None)
    return code


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop for ``--event-loop``: uvloop's when asked for (or, with auto, installed), else None
    (asyncio's own). uvloop cuts the proxy's CPU per request by about a tenth (bench/bench_serve.py)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("--event-loop uvloop: uvloop is not installed; pip install 'ctxfold[serve]' "
                             "or uvloop") from None
        return None
    return uvloop.new_event_loop
