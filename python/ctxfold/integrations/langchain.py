"""ctxfold as LangChain agent middleware: a drop-in for ``SummarizationMiddleware``.

    from langchain.agents import create_agent
    from ctxfold.integrations.langchain import CtxfoldMiddleware

    agent = create_agent(model, tools, middleware=[
        CtxfoldMiddleware(context_tokens=128_000, summarizer=model, session_dir="sessions")])

Before each model call the middleware hands the agent's messages that are new since the last call to the
conversation's :class:`~ctxfold.compaction.compactor.Compactor` (tool results through ``append_tool_result``, so the
hard trigger applies), runs ``before_request`` and sends the model the compacted view: the summary as a
``HumanMessage``, archived outputs as ``ToolMessage`` s holding the marker, every tool call with its results.
The asynchronous hook drives the same steps through :class:`~ctxfold.compaction.compactor.AsyncCompactor` (the
summarizer awaited on the loop). The model finds archived text with the ``search_archive`` tool and reads
it back with ``read_archive`` (:attr:`CtxfoldMiddleware.tools`, so ``create_agent`` registers both), offered
once there is something to find.

**The request, not the state.** ``SummarizationMiddleware`` rewrites the graph state (``RemoveMessage`` of
every message, then the summary and the kept tail): the originals are gone from the agent, and what the
next call sees is the last rewrite plus what came after. This middleware rewrites only the model request
(``wrap_model_call``). The state keeps the conversation as it happened, so it stays append-only, and that
is what ctxfold's model needs: the compactor holds the originals (in its session log as well) and derives
the view from them, so a later pass can re-judge an output it archived, restore is exact, and the mapping
between the two is one index (the n-th message of the state is the n-th original; LangChain message ids
are ctxfold ids, tool-call ids are kept). The price: the checkpointer stores the whole conversation, as
the session log does; what is sent stays inside the window.

**Conversations and sessions.** One compactor per LangGraph thread (``configurable.thread_id``; without
one, the key ``"default"``). With ``session_dir`` each thread's session is ``session_dir/<thread>``, and
a new middleware (a restarted process) resumes it on the thread's next call: the state's messages must
begin with the session's originals (same ids), and what follows is appended. A state that does not (it was
rewritten by something else, or a different conversation runs under the same key) starts a new session;
the old directory is kept, renamed ``<thread>.replaced-<n>``.

**Bad input.** A message this module cannot read (a type it does not know, a tool result whose call is not
in the conversation, a call without an id) is not stored: the request goes to the model as the agent built
it, uncompacted, with one warning per thread and reason, counted in :attr:`CtxfoldMiddleware.passed_through`.
A request that cannot fit whatever is compacted raises :class:`~ctxfold.errors.NoFitError`, as the
compactor does (the model would refuse it anyway).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from hashlib import sha256
from pathlib import Path
from typing import Any, cast

from langchain.agents.middleware.types import (
    AgentMiddleware,
    AgentState,
    ExtendedModelResponse,
    ModelRequest,
    ModelResponse,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    convert_to_messages,
)
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, ToolException
from langchain_core.utils.function_calling import convert_to_openai_tool

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec, Usage, as_parts
from ctxfold.compaction.archive import (
    READ_ARCHIVE,
    SEARCH_ARCHIVE,
    ArchiveStore,
    answer_recall_call,
    recall_tools_openai,
)
from ctxfold.compaction.archive.marker import MARKER_PREFIX
from ctxfold.compaction.compactor import AsyncCompactor, CompactionEvent, Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.effects import Step
from ctxfold.compaction.summarize import CallableSummarizer, Summarizer, SummaryResult, TokenCallback
from ctxfold.compaction.summarize.request import SummaryRequest, to_openai_messages
from ctxfold.tokens.counting import DEFAULT_TOKENIZER, TokenCounter, load_counter
from ctxfold.tokens.templates import ChatTemplate
from ctxfold.tokens.templates.jinja import JinjaChatTemplate

log = logging.getLogger("ctxfold.langchain")

DEFAULT_THREAD = "default"  # the key of a conversation run without a thread_id
SOURCE = "ctxfold"  # additional_kwargs["lc_source"] of the messages ctxfold writes (LangChain's own: "summarization")
# The recall tools' OpenAI function definitions by name: ctxfold's own schemas, as the proxy offers them.
_RECALL_SPECS: Mapping[str, Mapping[str, Any]] = {t["function"]["name"]: t["function"] for t in recall_tools_openai()}
# Summary calls are internal: LangGraph does not stream their tokens to the agent's caller.
_SUMMARY_CONFIG: RunnableConfig = {"metadata": {"lc_source": SOURCE}, "tags": ["nostream"]}


class BadInput(ValueError):
    """A message of the agent's state that the middleware cannot read; the request passes through."""


# -- messages: LangChain <-> ctxfold ------------------------------------------------------------------------

def _content(raw: Any) -> str | tuple[Any, ...]:
    if isinstance(raw, str):
        return raw
    return as_parts([b if isinstance(b, dict) else {"type": "text", "text": str(b)} for b in raw])


def _lc_content(m: Message) -> Any:
    if isinstance(m.content, str):
        return m.content
    return [{"type": "text", "text": p.text} if p.text is not None else dict(p.data) for p in m.content]


def _calls(m: AIMessage, where: str) -> tuple[ToolCall, ...]:
    raw = {c.get("id"): c.get("function", {}).get("arguments") for c in m.additional_kwargs.get("tool_calls") or []
           if isinstance(c, dict)}  # the provider's own argument text, where it kept it
    calls = []
    for c in m.tool_calls:
        if not c.get("id"):
            raise BadInput(f"{where}: tool call {c.get('name')!r} has no id, so no result can answer it")
        args = raw.get(c["id"])
        calls.append(ToolCall(id=str(c["id"]), name=c["name"],
                              arguments=args if isinstance(args, str) else json.dumps(c["args"], ensure_ascii=False)))
    return tuple(calls)


def to_ctxfold(m: BaseMessage, index: int = 0) -> Message:
    """One LangChain message as a ctxfold :class:`~ctxfold.chat.messages.Message` (the LangChain id kept, else
    ``lc-<index>``). Raises :class:`BadInput` naming a message type it does not know."""
    mid = m.id or f"lc-{index}"
    where = f"message {index} ({type(m).__name__}, id {m.id!r})"
    content = _content(m.content)
    name = m.name if isinstance(m.name, str) else None
    if isinstance(m, ChatMessage):  # a role given as a string: the four ctxfold knows
        roles = {"user": HumanMessage, "human": HumanMessage, "assistant": AIMessage, "ai": AIMessage,
                 "system": SystemMessage}
        if m.role not in roles:
            raise BadInput(f"{where}: role {m.role!r} is not one of {', '.join(roles)}")
        return to_ctxfold(roles[m.role](content=m.content, id=m.id, name=m.name), index)
    if isinstance(m, HumanMessage):
        return Message(role=Role.USER, content=content, id=mid, name=name)
    if isinstance(m, SystemMessage):
        return Message(role=Role.SYSTEM, content=content, id=mid, name=name)
    if isinstance(m, AIMessage):
        reasoning = m.additional_kwargs.get("reasoning_content")
        u = m.usage_metadata
        return Message(role=Role.ASSISTANT, content=content, id=mid, name=name, tool_calls=_calls(m, where),
                       reasoning=reasoning if isinstance(reasoning, str) else None,
                       usage=Usage(prompt_tokens=u.get("input_tokens"), completion_tokens=u.get("output_tokens"))
                       if u else None)
    if isinstance(m, ToolMessage):
        return Message(role=Role.TOOL, content=content, id=mid, tool_call_id=m.tool_call_id, name=name,
                       is_error=m.status == "error")
    raise BadInput(f"{where}: a message type ctxfold does not know (it reads Human, AI, System, Tool and "
                   "Chat messages)")


def from_ctxfold(m: Message) -> BaseMessage:
    """A ctxfold message as the LangChain message of its role (what ctxfold wrote into a view: a summary,
    an archive marker, a resume instruction, an acknowledgement)."""
    content = _lc_content(m)
    kwargs: dict[str, Any] = {"id": m.id or None, "name": m.name, "additional_kwargs": {"lc_source": SOURCE}}
    if m.role is Role.TOOL:
        return ToolMessage(content=content, tool_call_id=m.tool_call_id or "", status="error" if m.is_error else
                           "success", **kwargs)
    if m.role is Role.ASSISTANT:
        return AIMessage(content=content, tool_calls=[
            {"id": c.id, "name": c.name, "args": a if isinstance(a := c.parsed_arguments(), dict) else {"input": a}}
            for c in m.tool_calls], **kwargs)
    cls = SystemMessage if m.role is Role.SYSTEM else HumanMessage
    return cls(content=content, **kwargs)


def tool_spec(tool: BaseTool | dict[str, Any]) -> ToolSpec:
    """A tool as the request offers it, in ctxfold's neutral shape (what the compactor counts)."""
    fn = convert_to_openai_tool(tool).get("function", {})
    return ToolSpec(name=str(fn.get("name", "")), description=str(fn.get("description", "")),
                    parameters=fn.get("parameters") or {})


# -- summaries from a LangChain chat model ---------------------------------------------------------------

class ChatModelSummarizer:
    """A ctxfold :class:`~ctxfold.compaction.summarize.Summarizer` over a LangChain chat model: the summary request
    (the transcript and ctxfold's contract) streamed through ``model.stream`` / ``model.astream``, cut and
    checked as every ctxfold summary is. The model is not given tools: it must not call any."""

    def __init__(self, model: BaseChatModel, *, counter: TokenCounter | None = None, timeout_s: float = 120.0,
                 name: str | None = None) -> None:
        self.model = model
        label = name or f"langchain:{getattr(model, 'model_name', None) or getattr(model, 'model', None) or type(model).__name__}"
        self._sync = CallableSummarizer(self._stream, name=label, counter=counter, timeout_s=timeout_s)
        self._async = CallableSummarizer(self._astream, name=label, counter=counter, timeout_s=timeout_s)

    @property
    def name(self) -> str:
        return self._sync.name

    @staticmethod
    def messages(request: SummaryRequest) -> list[BaseMessage]:
        return convert_to_messages(to_openai_messages(request.messages, system=request.system))

    def _stream(self, request: SummaryRequest) -> Iterator[str]:
        for chunk in self.model.stream(self.messages(request), config=_SUMMARY_CONFIG):
            yield chunk.text

    async def _astream(self, request: SummaryRequest) -> AsyncIterator[str]:
        async for chunk in self.model.astream(self.messages(request), config=_SUMMARY_CONFIG):
            yield chunk.text

    def summarize(self, request: SummaryRequest, *, on_token: TokenCallback | None = None,
                  cancel: threading.Event | None = None, timeout_s: float | None = None) -> SummaryResult:
        return self._sync.summarize(request, on_token=on_token, cancel=cancel, timeout_s=timeout_s)

    async def asummarize(self, request: SummaryRequest, *, on_token: TokenCallback | None = None,
                         cancel: Any = None, timeout_s: float | None = None) -> SummaryResult:
        return await self._async.asummarize(request, on_token=on_token, cancel=cancel, timeout_s=timeout_s)


# -- the recall tools ---------------------------------------------------------------------------------------

class RecallTool(BaseTool):
    """One of ctxfold's recall tools, ``read_archive`` or ``search_archive``, as a LangChain tool: ctxfold's
    schema, answered by ``answer_recall_call`` over the archive of the conversation (thread) that calls it.
    A mistake in the arguments (a bad id, a bad regular expression) is a tool error the model reads
    (``status="error"``), never an exception in the agent loop. An async agent runs it in a worker thread
    (LangChain's default for a tool without ``_arun``); the archive's search index is thread-safe."""

    handle_tool_error: bool = True
    store_for: Any = None  # (thread key) -> ArchiveStore | None: the middleware's conversations

    def __init__(self, name: str, *, store_for: Callable[[str], ArchiveStore | None] | None = None) -> None:
        spec = _RECALL_SPECS.get(name)
        if spec is None:
            raise ValueError(f"{name!r} is not a recall tool; ctxfold's are {READ_ARCHIVE!r} and {SEARCH_ARCHIVE!r}")
        super().__init__(name=name, description=str(spec["description"]), args_schema=dict(spec["parameters"]),
                         store_for=store_for)

    def _run(self, *args: Any, config: RunnableConfig, **arguments: Any) -> str:  # config: LangChain passes it
        store = self.store_for(thread_key(config)) if self.store_for is not None else None
        if store is None:
            raise ToolException("Error: nothing was archived in this conversation; there is nothing to "
                                f"{'search' if self.name == SEARCH_ARCHIVE else 'read'}.")
        answer = answer_recall_call(store, ToolCall(id="", name=self.name, arguments=json.dumps(arguments)))
        if answer.is_error:
            raise ToolException(answer.text)
        return answer.text


def thread_key(config: RunnableConfig | None) -> str:
    """The conversation a LangGraph run belongs to: its ``thread_id``, else :data:`DEFAULT_THREAD`."""
    tid = ((config or {}).get("configurable") or {}).get("thread_id")
    return str(tid) if tid is not None else DEFAULT_THREAD


def _request_thread(request: ModelRequest[Any]) -> str:
    info = getattr(request.runtime, "execution_info", None)
    tid = getattr(info, "thread_id", None)
    if tid is not None:
        return str(tid)
    try:
        from langgraph.config import get_config
        return thread_key(get_config())
    except RuntimeError:  # called outside a graph run
        return DEFAULT_THREAD


# -- the middleware ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Thread:
    """One conversation: its compactor, and what the middleware knows of it."""

    compactor: Compactor
    driver: AsyncCompactor
    call_ids: set[str]  # ids of every tool call in the originals: a new result must answer one
    recall: bool  # there is something to find and read back: the recall tools are offered
    warned: set[str] = field(default_factory=set)  # reasons already logged for this thread
    # The LangChain form of each message ctxfold wrote into the view (summary, markers), by id() of the
    # ctxfold message (kept alive beside it): converted once, not at every call.
    written: dict[int, tuple[Message, BaseMessage]] = field(default_factory=dict)


@dataclass(slots=True)
class _Plan:
    """What one model call does: the new messages to store, or why it passes through uncompacted."""

    thread: _Thread | None
    new: list[Message]
    passed: str | None = None


_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


class CtxfoldMiddleware(AgentMiddleware[AgentState[Any], Any, Any]):
    """Context compaction for ``create_agent``, before every model call. See the module docstring.

    ``context_tokens``: the model's window (or ``config.context_tokens``). ``counter``: a ctxfold token
    counter or its name (``load_counter``; default ``auto:deepseek-v4``: exact where installed, else the estimate), ``template``: the chat
    template requests are counted with. ``summarizer``: a ctxfold summarizer or a LangChain chat model
    (wrapped in :class:`ChatModelSummarizer`); default the extractive summary, no model. ``session_dir``:
    where each thread's session lives, to resume after a restart; default memory.
    """

    def __init__(self, context_tokens: int | None = None, *, config: CompactConfig | None = None,
                 counter: TokenCounter | str | None = None, template: ChatTemplate | JinjaChatTemplate | None = None,
                 summarizer: Summarizer | BaseChatModel | None = None, session_dir: str | Path | None = None,
                 durable: bool = True) -> None:
        super().__init__()
        config = config if config is not None else CompactConfig()
        if context_tokens is not None:
            config = replace(config, context_tokens=context_tokens)
        if config.context_tokens is None:
            raise ValueError("CtxfoldMiddleware needs the model's window: pass context_tokens= (or a config "
                             "with context_tokens)")
        self.config = config
        self.counter = load_counter(counter or DEFAULT_TOKENIZER) if counter is None or isinstance(counter, str) \
            else counter
        self.template = template
        self.summarizer = ChatModelSummarizer(summarizer, counter=self.counter) \
            if isinstance(summarizer, BaseChatModel) else summarizer
        self.session_dir = Path(session_dir) if session_dir is not None else None
        self.durable = durable
        self.passed_through: Counter[str] = Counter()  # requests sent uncompacted, by reason
        self.events: list[CompactionEvent] = []  # every compaction of every thread, in order
        self._threads: dict[str, _Thread] = {}
        self._lock = threading.Lock()
        self._tool_specs: tuple[tuple[int, ...], tuple[ToolSpec, ...]] | None = None  # see _specs
        # Registered with the agent through self.tools; _request offers them only once there is something to find.
        self.recall_tools = tuple(RecallTool(name, store_for=self._store_for) for name in _RECALL_SPECS)
        self._recall_ids = frozenset(map(id, self.recall_tools))  # identity: tools compare by value
        self.tools = list(self.recall_tools)

    def compactor(self, thread_id: str = DEFAULT_THREAD) -> Compactor | None:
        """The compactor of a thread, once it has made a model call in this process."""
        t = self._threads.get(thread_id)
        return t.compactor if t is not None else None

    def _store_for(self, key: str) -> ArchiveStore | None:
        t = self._threads.get(key)
        return t.compactor.store if t is not None else None

    # -- the hooks -----------------------------------------------------------------------------------------
    def wrap_model_call(self, request: ModelRequest[Any], handler: Callable[[ModelRequest[Any]], ModelResponse[Any]],
                        ) -> ModelResponse[Any] | AIMessage | ExtendedModelResponse[Any]:
        return handler(self._request(request, self.compact_messages(
            request.messages, system=request.system_message, tools=request.tools,
            thread_id=_request_thread(request), max_reply_tokens=_max_reply_tokens(request))))

    async def awrap_model_call(self, request: ModelRequest[Any],
                               handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]],
                               ) -> ModelResponse[Any] | AIMessage | ExtendedModelResponse[Any]:
        return await handler(self._request(request, await self.acompact_messages(
            request.messages, system=request.system_message, tools=request.tools,
            thread_id=_request_thread(request), max_reply_tokens=_max_reply_tokens(request))))

    def _request(self, request: ModelRequest[Any], messages: list[BaseMessage]) -> ModelRequest[Any]:
        t = self._threads.get(_request_thread(request))
        tools = request.tools
        if t is None or not t.recall:  # registered with the agent, offered once there is something to find
            tools = [x for x in tools if id(x) not in self._recall_ids]
        return request.override(messages=cast("list[AnyMessage]", messages), tools=tools)

    # -- the transformation, without a graph -----------------------------------------------------------------
    def compact_messages(self, messages: Sequence[BaseMessage], *, system: SystemMessage | str | None = None,
                         tools: Sequence[BaseTool | dict[str, Any]] = (), thread_id: str = DEFAULT_THREAD,
                         max_reply_tokens: int | None = None) -> list[BaseMessage]:
        """What the model is sent for ``messages`` (the agent's state, system prompt apart): the
        conversation's compacted view, after storing what is new. Synchronous: summaries block."""
        plan = self._plan(messages, system, tools, thread_id, max_reply_tokens)
        if plan.thread is None:
            return list(messages)
        events = plan.thread.compactor.run(self._step(plan.thread, plan.new))
        return self._view(plan.thread, messages, events)

    async def acompact_messages(self, messages: Sequence[BaseMessage], *, system: SystemMessage | str | None = None,
                                tools: Sequence[BaseTool | dict[str, Any]] = (), thread_id: str = DEFAULT_THREAD,
                                max_reply_tokens: int | None = None) -> list[BaseMessage]:
        """:meth:`compact_messages` on the event loop: summaries awaited, the core's work in a thread."""
        import asyncio
        plan = await asyncio.to_thread(self._plan, messages, system, tools, thread_id, max_reply_tokens)
        if plan.thread is None:
            return list(messages)
        events = await plan.thread.driver.run(self._step(plan.thread, plan.new))
        return self._view(plan.thread, messages, events)

    def _plan(self, messages: Sequence[BaseMessage], system: SystemMessage | str | None,
              tools: Sequence[BaseTool | dict[str, Any]], key: str, max_reply_tokens: int | None) -> _Plan:
        system_text = system.text if isinstance(system, SystemMessage) else system
        specs = self._specs(tools)
        with self._lock:
            t = self._threads.get(key)
            if t is None or not _continues(t.compactor, messages):
                if t is not None:
                    try:
                        t.compactor.close()
                    except OSError as e:  # the thread is replaced all the same: its old session's loss is logged
                        log.error("thread %s: its replaced session could not be written: %s", key, e)
                t = self._threads[key] = self._open(key, messages, system_text, specs, replacing=t is not None)
        c = t.compactor
        known = len(c.originals)
        try:
            new = [to_ctxfold(m, known + i) for i, m in enumerate(messages[known:])]
            calls = set(t.call_ids)
            for i, m in enumerate(new, start=known):
                if m.role is Role.TOOL and m.tool_call_id not in calls:
                    raise BadInput(f"message {i} (ToolMessage, id {m.id!r}): it answers tool call "
                                   f"{m.tool_call_id!r}, which no earlier AIMessage made")
                calls.update(x.id for x in m.tool_calls)
        except BadInput as e:
            reason = str(e)
            self.passed_through[reason.split(": ", 1)[-1]] += 1
            if reason not in t.warned:
                t.warned.add(reason)
                log.warning("ctxfold: thread %r: %s; the request goes to the model uncompacted", key, reason)
            return _Plan(None, [], passed=reason)
        t.call_ids = calls
        c.update_system(system_text)
        c.update_tools(specs)
        c.expect_reply(max_reply_tokens)
        return _Plan(t, new)

    def _specs(self, tools: Sequence[BaseTool | dict[str, Any]]) -> tuple[ToolSpec, ...]:
        """The tools the requests count: those offered, and the recall tools always (they may be offered at
        any call, so the window keeps room for them). Converted again only when the list changes."""
        ids = tuple(map(id, tools))
        if self._tool_specs is None or ids != self._tool_specs[0]:
            specs = tuple(tool_spec(x) for x in tools if id(x) not in self._recall_ids)
            self._tool_specs = (ids, (*specs, *map(tool_spec, self.recall_tools)))
        return self._tool_specs[1]

    def _open(self, key: str, messages: Sequence[BaseMessage], system: str | None, specs: tuple[ToolSpec, ...],
              *, replacing: bool) -> _Thread:
        """The thread's compactor: resumed from its session where that continues ``messages``, else new."""
        folder = None
        if self.session_dir is not None:
            folder = self.session_dir / (key if _SAFE_NAME.fullmatch(key) else "t-" + sha256(key.encode()).hexdigest()[:32])
        kwargs: dict[str, Any] = {"config": self.config, "counter": self.counter, "template": self.template,
                                  "summarizer": self.summarizer, "durable": self.durable}
        if folder is not None and (folder / "events.jsonl").exists():
            c = Compactor(Conversation([]), session_dir=folder, **kwargs)
            if _continues(c, messages):
                return self._thread(c, scan=True)
            c.close()
            n = 1
            while folder.with_name(f"{folder.name}.replaced-{n}").exists():
                n += 1
            folder.rename(folder.with_name(f"{folder.name}.replaced-{n}"))
            log.warning("ctxfold: thread %r: the agent's messages do not continue the session in %s; it is kept "
                        "as %s.replaced-%d and a new one starts", key, folder, folder.name, n)
        elif replacing:
            log.warning("ctxfold: thread %r: the agent's messages no longer continue the conversation ctxfold "
                        "holds (rewritten by something else?); a new one starts", key)
        # Built with the history at once, but the tool results that end it go in through the hard trigger.
        head: list[Message] = []
        try:
            history = [to_ctxfold(m, i) for i, m in enumerate(messages)]
            k = len(history)
            while k > 0 and history[k - 1].role is Role.TOOL:
                k -= 1
            head = history[:k] if not _orphans(history[:k]) else []
        except BadInput:
            pass  # _plan reads them again and passes the request through
        c = Compactor(Conversation(head, id=key, system=system, tools=specs), session_dir=folder, **kwargs)
        return self._thread(c, scan=False)

    @staticmethod
    def _thread(c: Compactor, *, scan: bool) -> _Thread:
        recall = scan and any(m.summary or (m.role is Role.TOOL and m.text.startswith(MARKER_PREFIX)) for m in c.view)
        return _Thread(c, AsyncCompactor(c), {x.id for m in c.originals for x in m.tool_calls}, recall)

    @staticmethod
    def _step(t: _Thread, new: list[Message]) -> Step[list[CompactionEvent]]:
        """Store the call's new messages (tool results through the hard trigger), then the request's passes."""
        return t.compactor.request_step(new)

    def _view(self, t: _Thread, messages: Sequence[BaseMessage], events: list[CompactionEvent]) -> list[BaseMessage]:
        """The view as LangChain messages: an original the view shows unchanged is the agent's own object."""
        self.events.extend(events)
        if any(e.applied and (e.archived or e.kind == "summary") for e in events):
            t.recall = True
        c = t.compactor
        originals = c.originals
        if c.view == originals:  # nothing compacted yet: identity comparisons, no copy of a message
            return list(messages)
        out: list[BaseMessage] = []
        written: dict[int, tuple[Message, BaseMessage]] = {}
        for m, o in zip(c.view, c.view_origins, strict=True):
            if o >= 0 and m is originals[o]:
                out.append(messages[o])
                continue
            known = t.written.get(id(m))
            written[id(m)] = known if known is not None and known[0] is m else (m, from_ctxfold(m))
            out.append(written[id(m)][1])
        t.written = written
        return out

    def close(self) -> None:
        """Close every thread's session (its log's file). A session whose log could not be written
        (``Compactor.close`` raises) does not keep the others open: the first such error is raised
        once all are closed."""
        first: OSError | None = None
        with self._lock:
            for t in self._threads.values():
                try:
                    t.compactor.close()
                except OSError as e:
                    first = first or e
            self._threads.clear()
        if first is not None:
            raise first


def _continues(c: Compactor, messages: Sequence[BaseMessage]) -> bool:
    """Whether ``messages`` begin with the compactor's originals (the same ids, in order)."""
    originals = c.originals
    if len(messages) < len(originals):
        return False
    return all(o.id == (m.id or f"lc-{i}") for i, (o, m) in enumerate(zip(originals, messages, strict=False)))


def _orphans(messages: Sequence[Message]) -> bool:
    calls: set[str] = set()
    for m in messages:
        if m.role is Role.TOOL and m.tool_call_id not in calls:
            return True
        calls.update(x.id for x in m.tool_calls)
    return False


def _max_reply_tokens(request: ModelRequest[Any]) -> int | None:
    """The request's own limit on the answer, where the model or its settings give one."""
    for n in (request.model_settings.get("max_tokens"), getattr(request.model, "max_tokens", None)):
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            return n
    return None
