"""A model's own Jinja chat template, rendered as transformers' ``apply_chat_template`` renders it.

A :class:`JinjaChatTemplate` is loaded (:mod:`ctxfold.tokens.templates.jinja_loading`, re-exported here) from where
models ship their template: a ``tokenizer_config.json`` (``chat_template``), a GGUF file
(``tokenizer.chat_template``), a plain template file, or a preset kept as data
(:mod:`ctxfold.tokens.templates.sources`). It renders in the same sandbox as transformers
(:mod:`ctxfold.tokens.templates.sandbox`): ``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension and the ``{% generation %}`` tag, transformers' ``tojson`` filter,
``raise_exception``, ``strftime_now``, its ``dict`` and ``namespace``; the config's special tokens
(``bos_token``, ``eos_token``, ...) as variables; messages in OpenAI form, tool-call arguments as
objects where they parse as JSON (what transformers' and vLLM's servers pass).

Incremental accounting needs one segment per message. A Jinja template is a program over the
whole message list, so segments are derived from renders: the boundary before message ``j`` is
where the render of the messages before ``j`` stops agreeing with the render of the whole request
(their longest common prefix). Where a template renders the last message differently (Qwen3's empty
thinking block) or drops reasoning before a later user turn, the messages before ``j`` are rendered
again followed by a probe message (a tool result, then a user turn), and the cut is where that agrees,
short of the probe's own framing. The pieces add up to the whole request exactly, whatever the cut.
To keep the cost O(new messages), the renders are of a small window, not of the whole conversation:
the first message (what templates attach the system prompt or the tools to), the message before the
new ones (and back to the call a run of results answers), the new messages, and, inside the history,
the next message and the next user turn after them (templates look ahead: a tool result closes its
run, reasoning is dropped before the last user turn). Index parity is kept across every gap
(templates that check alternation count it).

That a template can be cut this way is checked, never assumed: on probe conversations when it is
loaded (which also tells whether a new user turn re-renders the turn before it: Qwen3's does when
that turn has reasoning), and by the accounting's render session
(:class:`ctxfold.tokens.templates.jinja_session.JinjaSession`) against a whole render each time the
conversation doubles in length. A template that fails (:attr:`JinjaRenderer.separable`
False) is cut on whole renders instead (O(messages) per message), with a logged warning, and checked
on every request.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.errors import (  # the template errors, re-exported where they were first defined
    TemplateBoundsError,
    TemplateRenderError,
)
from ctxfold.tokens.templates.jinja_loading import (
    JinjaChatTemplate,
    from_file,
    from_gguf,
    from_tokenizer_config,
    jinja_presets,
    load_model_template,
)
from ctxfold.tokens.templates.presets import RenderedRequest, RenderOptions, Segment, tool_schema
from ctxfold.tokens.templates.sandbox import compile_template

log = logging.getLogger(__name__)


# -- messages as the template sees them ----------------------------------------------------------------------

def _arguments(call: ToolCall, as_object: bool) -> Any:
    if not as_object:
        return call.arguments
    try:
        parsed = json.loads(call.arguments)
    except ValueError:
        return call.arguments
    return parsed if isinstance(parsed, dict) else call.arguments


def message_dict(m: Message, object_arguments: bool = True) -> dict[str, Any]:
    """``m`` in OpenAI chat form, as a client sends it and the template reads it (None fields left out)."""
    d: dict[str, Any] = {"role": m.role.value, "content": m.text}
    if m.reasoning is not None:
        # transformers passes reasoning as `reasoning_content` and, for templates that read it so, `thinking`.
        d = {"thinking": m.reasoning, **d, "reasoning_content": m.reasoning}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": _arguments(c, object_arguments)}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role is Role.TOOL:
        d["name"] = m.name
    return d


def tools_list(tools: Sequence[ToolSpec]) -> list[dict[str, Any]] | None:
    """The tool definitions as the template reads them (OpenAI function shape, with the fields a client
    sent beside name, description and parameters, such as ``strict``); None without tools."""
    out = []
    for t in tools:
        fn = tool_schema(t)
        kept = t.extra.get("openai")
        if isinstance(kept, dict) and isinstance(kept.get("function"), dict):
            fn.update(kept["function"])
        out.append({"type": "function", "function": fn})
    return out or None


def _lcp(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# Window shape. Every number is checked, not trusted: a template that needs more falls back to full renders.
_HEAD = 1  # the first messages, always in the window: templates attach the system prompt or tools to them
_CONTEXT = 1  # messages before the first new one (and back to the assistant message whose results they are)
_CHUNK = 4  # messages derived per window when many are new: windows of ~8 messages, ~1.5 renders a message
_LOOKBACK_LIMIT = 64  # how far back the context reaches for the call a run of results answers
# Messages put after those of a cut, so that the last of them renders as it does inside the conversation,
# not as the last message: a tool result (a template that marks its last message, as Qwen3's empty
# thinking block), a user turn (one that drops reasoning before the last user turn).
_PROBE_TEXT = "ctxfold boundary probe"
_PROBES = (Message(role=Role.TOOL, content=_PROBE_TEXT, tool_call_id="probe", name="probe"),
           Message(role=Role.USER, content=_PROBE_TEXT))


# Probe results per template (source, variables, control tokens, argument form): probing takes a few
# hundred renders, once per process.
_separable: dict[tuple[str, str, tuple[tuple[str, int], ...], bool], tuple[bool, str, bool]] = {}


def _probe_key(template: JinjaChatTemplate) -> tuple[str, str, tuple[tuple[str, int], ...], bool]:
    ids = {v[0]: v[1] for v in template.specials.values()}
    return (template.source + "\0" + template.tool_use_source,
            json.dumps(dict(template.variables), sort_keys=True, default=str), tuple(sorted(ids.items())),
            template.object_arguments)


def remember_probe(template: JinjaChatTemplate, known: tuple[bool, str, bool]) -> None:
    """Probe results (separable, turn sensitivity, alternating roles) found for ``template`` elsewhere (in
    the child process that checked it, :func:`ctxfold.tokens.templates.loader.load_checked`): its renderers in this
    process take them instead of probing again."""
    if not known[0] and _probe_key(template) not in _separable:
        log.warning("chat template %s cannot be cut into per-message segments; every boundary is rendered "
                    "whole (O(messages) per message)", template.name)
    _separable[_probe_key(template)] = known


class JinjaRenderer:
    """Renders conversations with one Jinja template, whole or as segments. Thread-safe: no mutable
    state but the ``separable`` flag, which only ever goes from True to False."""

    def __init__(self, template: JinjaChatTemplate) -> None:
        self.template = template
        self._compiled = compile_template(template.source)
        self._compiled_tools = compile_template(template.tool_use_source) if template.tool_use_source else self._compiled
        self.specials = {v[1]: v[0] for v in template.specials.values()}
        ids = {v[0]: v[1] for v in template.specials.values()}
        self._ids = ids
        self._split_re = (re.compile("|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True)))
                          if ids else None)
        self.separable = True
        self.alternates_roles = False  # user and assistant turns must alternate (probed)
        # When a new last user turn re-derives the turn before it: "never", "reasoning" (when one of its
        # messages has reasoning), "always". Probed, as is separability.
        self.turn_sensitive = "always"
        key = _probe_key(template)
        known = _separable.get(key)
        probed = known is None
        if known is None:
            known = (*self._probe(), self._refuses_consecutive_users())
        self.separable, self.turn_sensitive, self.alternates_roles = known
        _separable[key] = known
        if not self.separable and probed:
            log.warning("chat template %s cannot be cut into per-message segments; every boundary is rendered "
                        "whole (O(messages) per message)", template.name)

    # -- whole renders -------------------------------------------------------------------------------------

    def _render(self, system: str | None, tools: Sequence[ToolSpec], msgs: Sequence[Message],
                generation_prompt: bool) -> str:
        import jinja2

        dicts = [message_dict(m, self.template.object_arguments) for m in msgs]
        if system is not None:
            dicts = [{"role": "system", "content": system}, *dicts]
        name = self.template.name
        try:
            compiled = self._compiled_tools if tools else self._compiled
            return str(compiled.render(messages=dicts, tools=tools_list(tools), documents=None,
                                             add_generation_prompt=generation_prompt, **self.template.variables))
        except TemplateBoundsError as e:
            raise TemplateBoundsError(e.what, reason=e.reason, template=name) from None
        except RecursionError:
            raise TemplateBoundsError("it recursed too deep (a macro or loop that calls itself without end)",
                                      reason="recursion", template=name) from None
        except MemoryError:
            raise TemplateBoundsError("it ran out of memory", reason="oom", template=name) from None
        except jinja2.exceptions.TemplateError as e:
            raise TemplateRenderError(f"chat template {name}: {e.message or type(e).__name__}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
            raise TemplateRenderError(f"chat template {name} failed: {e}") from None

    def render_text(self, conversation: Conversation, *, generation_prompt: bool = True) -> str:
        """The whole request as text, as ``apply_chat_template(..., tokenize=False)`` returns it."""
        return self._render(conversation.system, conversation.tools, conversation.messages, generation_prompt)

    def split(self, text: str) -> Segment:
        """``text`` as segment parts: control tokens as ids, the text between them as str."""
        if not text:
            return ()
        if self._split_re is None:
            return (text,)
        out: list[str | int] = []
        pos = 0
        for mt in self._split_re.finditer(text):
            if mt.start() > pos:
                out.append(text[pos:mt.start()])
            out.append(self._ids[mt.group()])
            pos = mt.end()
        if pos < len(text):
            out.append(text[pos:])
        return tuple(out)

    # -- segments ------------------------------------------------------------------------------------------

    def segments(self, system: str | None, tools: Sequence[ToolSpec], msgs: Sequence[Message],
                 start: int = 0) -> tuple[str, list[str], str]:
        """The prefix text, the texts of messages ``start``.. and the generation-prompt text of the request
        ``system + tools + msgs``. Their concatenation, after the texts of messages before ``start`` from an
        earlier call, is the whole request. Cost: O(len(msgs) - start) renders of a few messages each
        (O(len(msgs)) renders of the whole conversation when the template is not separable)."""
        n = len(msgs)
        if not 0 <= start <= n:
            raise IndexError(f"segments: start {start} out of range [0, {n}]")
        if not self.separable:
            return self._segments_whole(system, tools, msgs, start)
        try:
            return self._segments_windowed(system, tools, msgs, start)
        except TemplateBoundsError:
            raise
        except TemplateRenderError:
            # A window can fail where the whole request does not (a gap the template notices): then the
            # template is not separable. Where the whole request fails too, that is the error to report.
            self._render(system, tools, msgs, True)
            self.mark_not_separable("a window of the conversation fails to render where the whole does not")
            return self._segments_whole(system, tools, msgs, start)

    def mark_not_separable(self, why: str) -> None:
        if self.separable:
            log.warning("chat template %s is not separable at message boundaries (%s): falling back to whole "
                        "renders, O(messages) per message", self.template.name, why)
        self.separable = False

    def _boundaries(self, system: str | None, tools: Sequence[ToolSpec], window: Sequence[Message],
                    cuts: Sequence[int], generation_prompt: bool) -> tuple[str, list[int]]:
        """The render of ``window`` and, for each cut k, where messages k.. start in it.

        The cut is where the render of ``window[:k]`` stops agreeing with the whole. Where that render
        differs before its end (the template renders its last message, or the messages before the last
        user turn, differently), the messages before k are rendered again with a probe message after them
        (:data:`_PROBES`), and the cut is where that agrees, short of the probe's own rendering.
        """
        whole = self._render(system, tools, window, generation_prompt)
        out: list[int] = []
        last = 0
        for k in cuts:
            try:
                head = self._render(system, tools, window[:k], False)
            except TemplateBoundsError:
                raise
            except TemplateRenderError:
                out.append(last)  # this prefix alone does not render (a template that needs a user turn)
                continue
            b = _lcp(head, whole)
            if b < len(head):
                for probe in _PROBES:
                    try:
                        agreed, full = self._agreement(self._render(system, tools, [*window[:k], probe], False), whole)
                    except TemplateBoundsError:
                        raise
                    except TemplateRenderError:
                        continue
                    b = max(b, agreed)
                    if full:
                        break  # it agrees up to the probe itself: no other probe can do better
            last = max(b, last)
            out.append(last)
        return whole, out

    def _agreement(self, probed: str, whole: str) -> tuple[int, bool]:
        """How far ``probed`` (messages, then a probe) agrees with ``whole``, never into the probe's own
        rendering: not past the control token that opens it (or its text, for a template without any);
        and whether it agrees all the way there."""
        at = probed.rfind(_PROBE_TEXT)
        cap = len(probed) if at < 0 else at
        if self._split_re is not None:
            opening = [mt.start() for mt in self._split_re.finditer(probed, 0, cap)]
            if opening:
                cap = opening[-1]
        agreed = _lcp(probed, whole)
        return min(agreed, cap), agreed >= cap

    def _segments_whole(self, system: str | None, tools: Sequence[ToolSpec], msgs: Sequence[Message],
                        start: int) -> tuple[str, list[str], str]:
        n = len(msgs)
        cuts = [0, *range(start, n + 1)] if start else list(range(n + 1))
        whole, b = self._boundaries(system, tools, msgs, cuts, True)
        if start:
            b = b[1:]
        prefix = whole[: b[0]] if start == 0 else ""
        texts = [whole[b[k]: b[k + 1]] for k in range(n - start)]
        return prefix, texts, whole[b[-1]:]

    def _segments_windowed(self, system: str | None, tools: Sequence[ToolSpec], msgs: Sequence[Message],
                           start: int) -> tuple[str, list[str], str]:
        n = len(msgs)
        prefix = ""
        texts: list[str] = []
        suffix = ""
        p = start
        if n == 0:
            whole, b = self._boundaries(system, tools, [], [0], True)
            return whole[: b[0]], [], whole[b[0]:]
        while p < n:
            q = min(p + _CHUNK, n)
            idx = self._window(msgs, p, q)
            window = [msgs[i] for i in idx]
            pos = {i: k for k, i in enumerate(idx)}
            last = q == n
            end = len(idx) if last else pos[q]
            cuts = [pos[i] for i in range(p, q)] + [end]
            whole, b = self._boundaries(system, tools, window, cuts, last)
            if p == 0:
                prefix = whole[: b[0]]  # the window starts at message 0: its first cut ends the prefix
            texts.extend(whole[b[k]: b[k + 1]] for k in range(q - p))
            if last:
                suffix = whole[b[-1]:]
            p = q
        return prefix, texts, suffix

    def _window(self, msgs: Sequence[Message], p: int, q: int) -> list[int]:
        """Indexes of the messages rendered to derive messages p..q-1 (sorted, parity kept across gaps)."""
        n = len(msgs)
        s = max(p - _CONTEXT, 0)
        floor = max(s - _LOOKBACK_LIMIT, 0)
        while s > floor and msgs[s].role is Role.TOOL:
            s -= 1  # back to the call a run of results answers
        idx: list[int] = list(range(min(_HEAD, s)))
        if s > len(idx) and (s - len(idx)) % 2:
            s -= 1  # an even gap keeps every index's parity
        idx.extend(range(s, q))
        if q < n:
            idx.append(q)  # the next message: it decides how the last one closes
            u = next((i for i in range(q + 1, n) if msgs[i].role is Role.USER), -1)
            if msgs[q].role is not Role.USER and u > 0:
                if (u - q - 1) % 2:
                    idx.append(u - 1)
                idx.append(u)  # the next user turn: templates drop or keep reasoning by it
        return idx

    def render(self, conversation: Conversation, opts: RenderOptions | None = None) -> RenderedRequest:
        """The whole request, as segments (``opts`` is unused: a Jinja template's switches are its
        ``variables``)."""
        del opts
        prefix, texts, suffix = self.segments(conversation.system, conversation.tools, conversation.messages)
        return RenderedRequest(prefix=self.split(prefix), messages=tuple(self.split(t) for t in texts),
                               suffix=self.split(suffix), specials=self.specials)

    # -- what the compactor and the accounting ask of any renderer -------------------------------------------

    def keeps_all_reasoning(self, has_tools: bool) -> bool:
        del has_tools
        return False

    def tools_block(self, tools: Sequence[ToolSpec]) -> list[str | int]:
        del tools
        return []

    # -- the load-time check ---------------------------------------------------------------------------------

    def rerenders_turn(self, messages: Sequence[Message]) -> bool:
        """Whether a new last user turn can change how ``messages`` (the turn before it) render: the
        accounting then derives them again. Qwen3's template drops reasoning before the last user turn."""
        if self.turn_sensitive == "always":
            return True
        return self.turn_sensitive == "reasoning" and any(_has_reasoning(m) for m in messages)

    def check(self, conversation: Conversation, *, incremental: bool = True,
              turn_rule: bool | None = None) -> str | None:
        """Where the derived segments disagree with a whole render of ``conversation`` (None: nowhere).
        ``incremental``: also derive them as an append-only conversation would, one message at a time,
        from the message before the new one, and from the previous user turn when a new one comes and
        ``turn_rule`` (default: :meth:`rerenders_turn`) says so."""
        msgs = conversation.messages
        want = self.render_text(conversation)
        prefix, texts, suffix = self.segments(conversation.system, conversation.tools, msgs)
        if prefix + "".join(texts) + suffix != want:
            return f"segments of {len(msgs)} messages"
        if incremental:
            held: list[str] = []
            pre = ""
            last_user = -1
            for k in range(1, len(msgs) + 1):
                sub = msgs[:k]
                # As the accounting does: from the message before the new one, and from the last user
                # turn when a new one moves it (templates render the turn before it differently).
                a = max(k - 2, 0)
                if sub[-1].role is Role.USER:
                    again = self.rerenders_turn(sub[max(last_user, 0):]) if turn_rule is None else turn_rule
                    if again:
                        a = min(a, max(last_user, 0))
                    last_user = k - 1
                p2, t2, s2 = self.segments(conversation.system, conversation.tools, sub, a)
                if a == 0:
                    pre = p2
                held = held[:a] + t2
                got = pre + "".join(held) + s2
                if got != self._render(conversation.system, conversation.tools, sub, True):
                    return f"appending message {k - 1}"
        return None

    def _refuses_consecutive_users(self) -> bool:
        """Whether the template wants user and assistant turns to alternate (Gemma's, Llama 2's,
        Mistral's raise on two user messages in a row): a rewrite must then keep them alternating."""
        u, a = Role.USER, Role.ASSISTANT
        try:
            self._render(None, (), [Message(u, "one"), Message(a, "two"), Message(u, "three")], True)
        except TemplateBoundsError:
            raise
        except TemplateRenderError:
            return False  # it refuses plain turns too: nothing a rewrite could keep
        try:
            self._render(None, (), [Message(u, "one"), Message(u, "two")], True)
        except TemplateBoundsError:
            raise
        except TemplateRenderError:
            return True
        return False

    def _probe(self) -> tuple[bool, str]:
        """(separable, turn sensitivity) on the probe conversations: separable at all (with every earlier
        turn derived again), then whether that is needed with reasoning, then without."""
        convs = []
        for conv in _probes():
            try:
                self._render(conv.system, conv.tools, conv.messages, True)
            except TemplateBoundsError:
                raise  # not a refusal: a template that does this is not used at all
            except TemplateRenderError:
                continue  # a shape this template refuses: nothing to check on it
            convs.append(conv)

        def passes(rule: bool, cs: Sequence[Conversation]) -> bool:
            try:
                return all(self.check(c, turn_rule=rule) is None for c in cs) and self.separable
            except TemplateBoundsError:
                raise
            except TemplateRenderError:
                return False

        if not passes(True, convs):
            return False, "always"
        if passes(False, convs):
            return True, "never"
        plain = [Conversation(messages=[replace(m, reasoning=None) for m in c.messages], system=c.system,
                              tools=c.tools) for c in convs]
        return True, ("reasoning" if passes(False, plain) else "always")


_renderers: dict[tuple[int, int], tuple[JinjaChatTemplate, Any, JinjaRenderer]] = {}
_renderers_lock = threading.Lock()
_MAX_RENDERERS = 64


def renderer_for(template: JinjaChatTemplate, counter: Any = None) -> JinjaRenderer:
    """The shared renderer of ``template`` as ``counter`` counts it: a template that names no control
    tokens (a plain file) takes the special tokens of an exact tokenizer's vocabulary (a ``tokenizers``
    one), so the text between them is counted on its own, as the tokenizer does."""
    key = (id(template), id(counter))
    with _renderers_lock:
        hit = _renderers.get(key)
        if hit is not None and hit[0] is template and hit[1] is counter:
            return hit[2]
    t = template
    tokenizer = getattr(counter, "tokenizer", None)
    if not t.specials and tokenizer is not None and hasattr(tokenizer, "get_added_tokens_decoder"):
        added = tokenizer.get_added_tokens_decoder()
        t = t.with_specials({tok.content: int(i) for i, tok in added.items() if getattr(tok, "special", False)})
    r = JinjaRenderer(t)
    with _renderers_lock:
        # The template and counter are held by the entry, so their ids are not reused while it lives.
        if len(_renderers) >= _MAX_RENDERERS:
            _renderers.clear()  # templates made on the fly (dataclasses.replace) must not pile up
        _renderers[key] = (template, counter, r)
    return r


def _has_reasoning(m: Message) -> bool:
    # Templates read reasoning from reasoning_content, or from a <think> block left in the content (Qwen3).
    return m.reasoning is not None or "</think>" in m.text


def _probes() -> Iterator[Conversation]:
    """Small conversations of the shapes templates treat apart: alternating turns, an agent loop with
    tool calls, parallel results and reasoning."""
    u, a, t = Role.USER, Role.ASSISTANT, Role.TOOL
    alt = [Message(role=u if i % 2 == 0 else a, content=f" turn {i} text \n") for i in range(12)]
    yield Conversation(messages=alt, system="Be brief.")
    yield Conversation(messages=alt)
    tool = ToolSpec(name="bash", description="Run a command.",
                    parameters={"type": "object", "properties": {"command": {"type": "string"}}})

    def call(i: int) -> ToolCall:
        return ToolCall(id=f"c{i}", name="bash", arguments=f'{{"command": "ls {i}"}}')

    loop: list[Message] = [Message(role=u, content="Fix the bug.")]
    for i in range(4):
        loop.append(Message(role=a, content="Looking." if i % 2 else "", tool_calls=(call(i),),
                            reasoning="think" if i == 3 else None))
        loop.append(Message(role=t, content=f"out {i}\n", tool_call_id=f"c{i}", name="bash"))
    loop.append(Message(role=a, content="", tool_calls=(call(8), call(9))))
    loop += [Message(role=t, content="a", tool_call_id="c8"), Message(role=t, content="b", tool_call_id="c9")]
    loop += [Message(role=a, content="Done.", reasoning="ok"), Message(role=u, content="Thanks. Again?"),
             Message(role=a, content="", tool_calls=(call(10),)), Message(role=t, content="x", tool_call_id="c10")]
    yield Conversation(messages=loop, system="You are an agent.", tools=(tool,))
    yield Conversation(messages=[m for m in loop if not (m.role is a and len(m.tool_calls) > 1)
                                 and not (m.role is t and m.tool_call_id in ("c8", "c9"))], tools=(tool,))


__all__ = [
    "JinjaChatTemplate",
    "JinjaRenderer",
    "TemplateBoundsError",
    "TemplateRenderError",
    "from_file",
    "from_gguf",
    "from_tokenizer_config",
    "jinja_presets",
    "load_model_template",
    "message_dict",
    "remember_probe",
    "renderer_for",
    "tools_list",
]
