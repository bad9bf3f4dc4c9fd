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

from ctxfold.config import CompactConfig, load_config
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
    from ctxfold.cli._common import (
        FORMATTER,
        non_negative_int,
        non_negative_seconds,
        port_number,
        positive_int,
        positive_seconds,
        wrap,
    )
    from ctxfold.serve import (
        DEFAULT_CLIENT_TIMEOUT_S,
        DEFAULT_ENGINE_CHECK_EVERY,
        DEFAULT_MAX_ANSWER_BYTES,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_CONNECTIONS,
        DEFAULT_MAX_EVENT_BYTES,
        DEFAULT_MAX_LOADED_BYTES,
        DEFAULT_MAX_LOADED_CONVERSATIONS,
        DEFAULT_MAX_RECALL_CHARS,
        DEFAULT_SESSION_TTL_S,
        ENGINE_CHECK_MODES,
        FSYNC_MODES,
    )
    from ctxfold.serve.logs import LOG_FORMATS, LOG_LEVELS
    from ctxfold.store import DEFAULT_LEASE_MS, DEFAULT_SPOOL_MAX_BYTES

    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run an OpenAI-compatible proxy that compacts every conversation to fit the upstream's window",
        description=wrap("Accept OpenAI chat.completions requests (streaming and not), keep each conversation "
        "as a ctxfold session in the data directory, compact it when it nears the window, forward the "
        "compacted request to the upstream and stream the answer back unchanged."),
        epilog=EPILOG, formatter_class=FORMATTER,
    )
    p.add_argument("--upstream", required=True, metavar="URL",
                   help="the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8080,
                   help="port to listen on, 0 to 65535 (default 8080; 0: any free port)")
    p.add_argument("--data-dir", type=Path, default=Path("ctxfold-data"),
                   help="sessions, history dumps and archives (default ./ctxfold-data)")
    p.add_argument("--archive-url", metavar="URL",
                   help="fsspec URL for archives shared by several proxy replicas (s3://bucket/prefix, ...)")
    p.add_argument("--config", type=Path, metavar="FILE", help="compaction settings (YAML or TOML, agent.compact)")
    p.add_argument("--context-tokens", "--ctx", type=positive_int, metavar="TOKENS",
                   help="the upstream model's context window (16k, 128k, ...); unset: token triggers are off")
    p.add_argument("--max-output-tokens", type=positive_int, metavar="TOKENS",
                   help="the model's reply cap (sets the reply reserve)")
    p.add_argument("--reply-reserve-tokens", type=non_negative_int, metavar="TOKENS",
                   help="tokens kept free for the answer (default: min(max output or 8192, 20480))")
    p.add_argument("--tokenizer", default="estimate:deepseek-v4", metavar="SPEC",
                   help="token counter for the upstream's model: deepseek-v4, qwen3, mistral, o200k_base, "
                   "cl100k_base, a tokenizer.json or .model file, estimate:NAME, or chars4 (default: "
                   "estimate:deepseek-v4; the upstream's usage figures calibrate it per conversation)")
    p.add_argument("--template", default="deepseek-v4", metavar="SPEC",
                   help="chat template the upstream renders requests with: deepseek-v3.2, deepseek-v4, chatml, "
                   "mistral-v7, gemma-3, llama-3.1, llama-3.2, the model's own Jinja template (hf:PATH, "
                   "gguf:PATH, file:PATH), or none for message text alone (default: deepseek-v4)")
    p.add_argument("--summarizer", choices=("upstream", "config", "extractive"), default="upstream",
                   help="who writes summaries: the upstream model (default), the summarizer section of --config, "
                   "or no model (extractive); a failed summary always falls back to the extractive one")
    p.add_argument("--summary-model", metavar="NAME", help="model for summaries (default: the request's model)")
    p.add_argument("--summary-timeout-s", type=positive_seconds, metavar="S",
                   help="time budget of a summary written by a model, connection to last token; past it the "
                   "extractive summary is used and the log and ctxfold_summary_fallbacks_total say so (default: "
                   "the summarizer section of --config, else 120)")
    p.add_argument("--engine-check", choices=ENGINE_CHECK_MODES, default=ENGINE_CHECK_MODES[0],
                   help="whether the upstream sees what ctxfold counts: a probe at startup (tiny requests with "
                   "a system and a tool message, max_tokens 1) and, with sampled (default), one answer in "
                   "--engine-check-every compared when its request was counted anyway; every: each request "
                   "counted and compared (for tests); startup: the probe only; off")
    p.add_argument("--engine-check-every", type=positive_int, default=DEFAULT_ENGINE_CHECK_EVERY, metavar="N",
                   help=f"answers per sampled comparison (default {DEFAULT_ENGINE_CHECK_EVERY})")
    p.add_argument("--no-stream-usage", dest="stream_usage", action="store_false", default=True,
                   help="do not ask the upstream for usage in streamed answers the client asked none for (by "
                   "default the proxy asks, calibrates with it, and keeps it from the client)")
    p.add_argument("--summary-api-key-env", metavar="NAME",
                   help="environment variable holding the key summaries are sent with (--summarizer upstream; "
                   "default: the Authorization header of the client request that triggered the compaction)")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"largest request body accepted, else 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="the least severe log lines written to stderr (default info: one line per request, "
                        "per compaction and per change of health)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="text (a timestamp, the level, the logger, the message) or json (one object a line, "
                        "with each line's fields)")
    p.add_argument("--max-answer-bytes", type=positive_int, default=DEFAULT_MAX_ANSWER_BYTES, metavar="N",
                   help="largest upstream answer relayed: past it a JSON answer is a 502 and a stream ends with "
                        f"an error event (default {DEFAULT_MAX_ANSWER_BYTES})")
    p.add_argument("--max-event-bytes", type=positive_int, default=DEFAULT_MAX_EVENT_BYTES, metavar="N",
                   help="largest event of an upstream stream: past it the stream ends with an error event "
                        f"(default {DEFAULT_MAX_EVENT_BYTES})")
    p.add_argument("--connect-timeout-s", type=positive_seconds, default=10.0, metavar="S",
                   help="to connect upstream (default 10)")
    p.add_argument("--read-timeout-s", type=positive_seconds, default=600.0, metavar="S",
                   help="longest silence from the upstream before 504 or a cut stream (default 600)")
    p.add_argument("--client-timeout-s", type=positive_seconds, default=DEFAULT_CLIENT_TIMEOUT_S, metavar="S",
                   help="a client must send a request's head, and then its body, within this (else the "
                   f"connection is closed, or 408); idle connections close after it (default {DEFAULT_CLIENT_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="client connections open at once; more are answered 503 and closed (default "
                   f"{DEFAULT_MAX_CONNECTIONS}; each also holds an upstream connection: mind ulimit -n)")
    p.add_argument("--max-recall-rounds", type=non_negative_int, default=4, metavar="N",
                   help="read_archive rounds the proxy answers within one request (default 4)")
    p.add_argument("--max-recall-chars", type=positive_int, default=DEFAULT_MAX_RECALL_CHARS, metavar="N",
                   help="archived text the proxy's read_archive answers add to one request, all calls together; "
                   f"beyond it the model is told to read on later (default {DEFAULT_MAX_RECALL_CHARS})")
    p.add_argument("--fsync", choices=FSYNC_MODES, default="compactions",
                   help="fsync of the session logs: compactions (default: compactions and archives; the messages "
                   "are written, and the client resends them anyway), always (every message too: a disk flush on "
                   "each request's path), never (a machine crash may lose the last compactions; a killed proxy "
                   "loses nothing in any mode)")
    p.add_argument("--no-fsync", dest="fsync", action="store_const", const="never", help="the same as --fsync never")
    p.add_argument("--max-loaded-sessions", "--max-loaded-conversations", dest="max_loaded_conversations",
                   type=positive_int, default=DEFAULT_MAX_LOADED_CONVERSATIONS, metavar="N",
                   help="sessions kept in memory (each with at most one open file); the least recently used "
                   f"conversations beyond are closed and read back from --data-dir when they return (default "
                   f"{DEFAULT_MAX_LOADED_CONVERSATIONS})")
    p.add_argument("--max-loaded-bytes", type=positive_int, default=DEFAULT_MAX_LOADED_BYTES, metavar="N",
                   help="event-log bytes of the loaded sessions, all together (the memory they hold is about this); "
                   f"beyond, the least recently used conversations are closed (default {DEFAULT_MAX_LOADED_BYTES})")
    p.add_argument("--tenant-header", default="Authorization", metavar="NAME",
                   help="the request header whose value names the client's tenant, kept only as a keyed hash "
                   "(default Authorization); requests without it share one anonymous tenant")
    p.add_argument("--tenant-key-file", type=Path, metavar="FILE",
                   help="the secret the tenant hash is keyed with (default: $CTXFOLD_TENANT_KEY, else "
                   "<data-dir>/tenant.key, made once)")
    p.add_argument("--operator-token-env", metavar="VAR",
                   help="the environment variable holding a secret (16+ characters) that GET /metrics and the "
                        "details of GET /health then require in an X-Ctxfold-Operator-Token header; without it "
                        "they are open to every client that reaches the port")
    p.add_argument("--store", metavar="URL",
                   help="a session store shared by several proxy processes or machines: redis://HOST:PORT/DB, "
                   "rediss://, unix://, valkey:// (options: ?prefix=, durability=always|everysec, blobs=<fsspec "
                   "URL>; see docs/store.md); default: --data-dir, for one process")
    p.add_argument("--spool-max-bytes", type=positive_int, default=DEFAULT_SPOOL_MAX_BYTES, metavar="N",
                   help="with --store: the local spool (in --data-dir) that keeps session writes while the store "
                   f"is unreachable, per process (default {DEFAULT_SPOOL_MAX_BYTES})")
    p.add_argument("--store-lease-ms", type=positive_int, default=DEFAULT_LEASE_MS, metavar="MS",
                   help="with --store: how long a process's lease on a conversation lasts unrenewed; one that "
                   f"stalls longer loses it to another (default {DEFAULT_LEASE_MS})")
    p.add_argument("--max-sessions-per-tenant", type=positive_int, default=None, metavar="N",
                   help="sessions (a conversation and each fork) a tenant keeps at once; past it, its new "
                   "conversations pass through uncompacted, labelled, until some expire (default: no bound)")
    p.add_argument("--max-tenant-bytes", type=positive_int, default=None, metavar="N",
                   help="bytes a tenant's stored sessions hold at once (records, dumps, archives); at it, its "
                   "requests pass through uncompacted, labelled, until some expire (default: no bound)")
    p.add_argument("--session-ttl-s", type=non_negative_seconds, default=DEFAULT_SESSION_TTL_S, metavar="S",
                   help="a session untouched this long is deleted with its archive (the client's next request "
                   f"starts a new one from its history); 0 keeps sessions for ever (default {DEFAULT_SESSION_TTL_S:g}: "
                   "7 days)")
    p.add_argument("--workers", type=positive_int, default=1, metavar="N",
                   help="worker processes accepting on one listening socket (default 1); more than one needs "
                   "a shared session store, since each worker's sessions must be every worker's")
    p.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="asyncio event loop: uvloop (faster; in the serve extra), asyncio, or auto: uvloop when "
                   "it is installed (default)")
    return p


def check_args(args: argparse.Namespace, compact: CompactConfig) -> None:
    """What argparse cannot see alone: --summarizer config without a config file, the summary key's
    variable, and the window against the reply reserve (check_settings). The settings themselves (the
    upstream URL, every number) are checked by ProxyConfig, once, for the CLI and embedders alike."""
    from ctxfold.cli import EXIT_INPUT, EXIT_USAGE, CommandError
    from ctxfold.cli._common import check_settings

    if args.data_dir.exists() and not args.data_dir.is_dir():
        raise CommandError(f"--data-dir {args.data_dir}: exists and is not a directory", EXIT_INPUT)
    if args.summarizer == "config" and args.config is None:
        raise CommandError("--summarizer config: reads the summarizer section of --config FILE; add --config, "
                           "or choose --summarizer upstream or extractive", EXIT_USAGE)
    if args.summary_api_key_env is not None and not os.environ.get(args.summary_api_key_env):
        raise CommandError(f"--summary-api-key-env {args.summary_api_key_env}: that environment variable is not set "
                           "or empty; export the key in it, or leave the option out to send the client's own "
                           "Authorization header", EXIT_USAGE)
    if args.operator_token_env is not None and not os.environ.get(args.operator_token_env):
        raise CommandError(f"--operator-token-env {args.operator_token_env}: that environment variable is not set or "
                           "empty; export the secret in it (16 characters or more)", EXIT_USAGE)
    check_settings(args, compact)
    check_workers(args.workers, getattr(args, "store", None))


def check_workers(workers: int, store: str | None) -> None:
    """Several workers serve any request of any conversation, so they must share the sessions: a local
    data directory is one process's (its locks and loaded sessions live in that process's memory)."""
    from ctxfold.cli import EXIT_USAGE, CommandError
    from ctxfold.store import is_shared_url

    if workers > 1 and (store is None or not is_shared_url(store)):
        raise CommandError(f"--workers {workers}: several worker processes need a shared session store "
                           "(Redis or Valkey); a --data-dir serves one process, so run --workers 1", EXIT_USAGE)


def build_config(args: argparse.Namespace) -> Any:
    from ctxfold.serve.app import ProxyConfig

    overrides = {k: getattr(args, k) for k in ("context_tokens", "max_output_tokens", "reply_reserve_tokens")
                 if getattr(args, k) is not None}
    compact = load_config(args.config, **overrides) if args.config else CompactConfig.from_mapping(overrides)
    if args.summary_timeout_s is not None:
        compact = replace(compact, summary=replace(compact.summary, timeout_s=args.summary_timeout_s))
    check_args(args, compact)
    return ProxyConfig(
        upstream=args.upstream, data_dir=args.data_dir, compact=compact, archive_url=args.archive_url,
        summarizer=args.summarizer, summary_model=args.summary_model,
        summary_api_key=os.environ[args.summary_api_key_env] if args.summary_api_key_env else None,
        max_body_bytes=args.max_body_bytes, max_answer_bytes=args.max_answer_bytes,
        max_event_bytes=args.max_event_bytes,
        connect_timeout_s=args.connect_timeout_s, read_timeout_s=args.read_timeout_s,
        max_recall_rounds=args.max_recall_rounds, max_loaded_conversations=args.max_loaded_conversations,
        max_recall_chars=args.max_recall_chars, client_timeout_s=args.client_timeout_s,
        max_connections=args.max_connections, max_loaded_bytes=args.max_loaded_bytes,
        tenant_header=args.tenant_header, tenant_key_file=args.tenant_key_file,
        operator_token=os.environ[args.operator_token_env] if args.operator_token_env else None,
        fsync=args.fsync, tokenizer=args.tokenizer, store_url=args.store, spool_max_bytes=args.spool_max_bytes,
        lease_ms=args.store_lease_ms, max_sessions_per_tenant=args.max_sessions_per_tenant,
        max_tenant_bytes=args.max_tenant_bytes, session_ttl_s=args.session_ttl_s or None,
        template=None if args.template == "none" else args.template,
        engine_check=args.engine_check, engine_check_every=args.engine_check_every, stream_usage=args.stream_usage,
    )


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
        from ctxfold.archive.store import make_private_dir

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
        from ctxfold.serve.sessions import load_tenant_key

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
