"""Recording an answer the client has: it joins the conversation's session, and the upstream's
``usage.prompt_tokens`` calibrates the token estimate of that conversation (:mod:`ctxfold.serve.window`).

After the response, still under the conversation's lock: the bookkeeping (and the commit of the
request's messages and answer to the session store) stays off the latency the client sees, and the next request finds the
answer recorded. Nothing is lost if the proxy dies in between or the recording fails: the client's
next request carries the answer, and a message the session does not hold yet is appended then.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ctxfold.chat.messages import Message
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.store import Spooled, StoreError
from ctxfold.serve.config import ProxyConfig
from ctxfold.serve.dialect import OPENAI, Dialect
from ctxfold.serve.engine_check import EngineCheck
from ctxfold.serve.forward import Answer
from ctxfold.serve.routing import ProxySession
from ctxfold.serve.window import calibrate

log = logging.getLogger("ctxfold.serve")


def answer_message(c: Compactor, message: dict[str, Any], usage: Any, index: int,
                   dialect: Dialect = OPENAI) -> Message | None:
    """The upstream's answer as the conversation's original ``index`` (None, logged, when it is not
    a chat message)."""
    return dialect.answer_message(message, usage, f"m{index + (1 if c.header.system is not None else 0)}")


def prompt_tokens(c: Compactor, *, count: bool = False) -> int | None:
    """ctxfold's count of the request the view makes (system, tools, messages, the generation prompt;
    no reply reserve): what the engine should report as ``usage.prompt_tokens``. None when the view is
    not counted yet, unless ``count`` (then it is counted now)."""
    if not count and c.counted_occupancy_tokens() is None:
        return None
    return c.accounting.total_tokens


async def record(config: ProxyConfig, session: ProxySession, answer: Answer, *, check: EngineCheck | None = None,
                 commit: Callable[[ProxySession], Awaitable[None]] | None = None) -> None:
    """Keep the answer in the session and, when it answers the request as the view was sent (no
    recall round in between), calibrate the estimate with the upstream's count, and compare the two
    (``check``, on the answers it samples); then ``commit`` (a shared store: the answer written under
    the session's lease).
    Never raises: the response is out, a failure here can only be logged."""
    try:
        await _record(config, session, answer, check)
        if commit is not None:
            await commit(session)
    except Spooled as e:
        log.warning("answer kept in the local spool: %s", e)
    except StoreError as e:
        log.warning("answer not stored (%s); the conversation's next request will bring it", e)
    except Exception:
        log.exception("answer not recorded; the conversation's next request will bring it")


async def _record(config: ProxyConfig, session: ProxySession, answer: Answer, check: EngineCheck | None) -> None:
    c = session.compactor
    if session.resend_drop:  # a re-sent request: the session holds the answer it got the first time
        return
    index = len(c.originals)
    m = answer_message(c, answer.message, answer.usage, index, answer.dialect)
    if m is None:
        return
    # The estimate of the request as it was sent, before the answer joins the view, when the trigger
    # check counted it: from about a fifth of the window on (where the byte bound meets a trigger
    # line), so the factor has settled long before it decides anything; below, nothing is counted.
    # (Not the occupancy less the configured reply reserve: the reserve of a request may be larger.)
    usage = answer.usage
    reported = answer.dialect.reported_prompt_tokens(usage)
    estimate = None
    if answer.rounds == 0:
        estimate = prompt_tokens(c)  # counted already when the request was (the X-Ctxfold-Prompt-Tokens header)
    if estimate is not None and isinstance(reported, int) and check is not None and check.due():
        check.compare(estimate, reported)
    if not config.compact.context_tokens:
        estimate = None
    c.append(m)  # into the session's buffered log: the commit writes it (and fsyncs, off the loop)
    session.note_wire([answer.dialect.answer_wire(answer.message, m)], index)
    if estimate is not None and isinstance(reported, int):
        calibrate(session, config.compact, reported, estimate)
