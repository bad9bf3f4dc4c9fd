"""A model's own Jinja chat template, rendered as transformers' ``apply_chat_template`` renders it.

A :class:`JinjaChatTemplate` is loaded from where models ship their template: a
``tokenizer_config.json`` (``chat_template``), a GGUF file (``tokenizer.chat_template``), a plain
template file, or a preset kept as data (:mod:`ctxfold.template_sources`). It renders in the same
sandbox as transformers: ``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks``, the
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
that turn has reasoning), and by :class:`ctxfold.accounting.RequestAccounting` against a whole render
each time the conversation doubles in length. A template that fails (:attr:`JinjaRenderer.separable`
False) is cut on whole renders instead (O(messages) per message), with a logged warning, and checked
on every request.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from ctxfold.errors import (  # the template errors, re-exported where they were first defined
    ConfigError,
    TemplateBoundsError,
    TemplateRenderError,
)
from ctxfold.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.template_presets import RenderedRequest, RenderOptions, Segment, tool_schema

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JinjaChatTemplate:
    """One model's Jinja chat template and what it is rendered with."""

    name: str  # a preset name, or where it was loaded from
    source: str  # the Jinja text
    # The text used when the request offers tools, where the model ships a separate one (a config's
    # named "tool_use" template, a GGUF's tokenizer.chat_template.tool_use), as transformers picks it.
    tool_use_source: str = ""
    # Variables every render gets: the config's special tokens (bos_token, eos_token, ...), then
    # template switches (enable_thinking, date_string, ...); transformers passes both as keyword arguments.
    variables: Mapping[str, Any] = field(default_factory=dict)
    # Control tokens: name -> (text, id), as ChatTemplate.specials. Rendered text is split on them, so
    # each counts as one token and the text between them is counted on its own, as tokenizers do.
    specials: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    object_arguments: bool = True  # tool-call arguments that parse as JSON objects are passed as objects
    description: str = ""
    # The accounting and the compactor read these of any template: a Jinja template places its tools
    # block itself (derived from renders), never before the last user message as Mistral v7's does.
    tools_with_last_user: bool = False

    def with_specials(self, specials: Mapping[str, int]) -> JinjaChatTemplate:
        """This template with ``specials`` (text -> id) added to its control tokens, keeping those that
        its source can write (or that are its BOS/EOS): a vocabulary has thousands it never writes."""
        written = self.source + self.tool_use_source
        keep = {t: i for t, i in specials.items() if t and (t in written or t in self.variables.values())}
        merged = dict(self.specials)
        merged.update({t: (t, i) for t, i in keep.items()})
        return replace(self, specials=merged)


# -- the environment, as transformers builds it ------------------------------------------------------------

@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.parser
        import jinja2.utils
    except ImportError:
        raise ConfigError("a model's own chat template needs jinja2: pip install 'ctxfold[templates]'") from None

    class GenerationTag(jinja2.ext.Extension):
        # transformers marks assistant text with {% generation %}...{% endgeneration %}; rendering is
        # unchanged by it.
        tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares it so

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # transformers' filter: no HTML escaping (Jinja's own escapes <, >, &, ').
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Attributes that start with "_" are refused, as transformers does (no way to CPython internals).
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    from ctxfold import template_guard as guard

    # transformers' ImmutableSandboxedEnvironment, with bounds on what one render may spend.
    env = guard.bounded_environment(trim_blocks=True, lstrip_blocks=True,
                                    extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return guard.compile_bounded(env, source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None
    except RecursionError:
        raise ConfigError("the chat template does not parse: it nests deeper than Python can follow") from None


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
    the child process that checked it, :func:`ctxfold.template_loader.load_checked`): its renderers in this
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
        self._compiled = _compile(template.source)
        self._compiled_tools = _compile(template.tool_use_source) if template.tool_use_source else self._compiled
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


# -- loading -------------------------------------------------------------------------------------------------

def _special_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _pick(source: Any, what: str) -> tuple[str, str]:
    """The template texts of a ``chat_template`` value: a string, or a list of named templates
    ("default", and "tool_use" for requests with tools, as transformers picks them)."""
    if isinstance(source, str):
        return source, ""
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        default, tool_use = named.get("default"), named.get("tool_use")
        if not isinstance(default, str):
            default = tool_use if isinstance(tool_use, str) else None
        if isinstance(default, str):
            return default, tool_use if isinstance(tool_use, str) else ""
        raise ConfigError(f"chat template: {what} has no chat template named 'default' "
                          f"(it has {sorted(map(str, named))})")
    raise ConfigError(f"chat template: {what} has no chat template")


def from_tokenizer_config(path: str | Path) -> JinjaChatTemplate:
    """The template of a ``tokenizer_config.json`` (or a ``chat_template.json`` /
    ``chat_template.jinja`` beside it, where newer models keep it), with its special tokens."""
    p = Path(path)
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"chat template: {p} does not exist") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"chat template: {p} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"chat template: {p} is not a tokenizer config (a JSON object)")
    source = config.get("chat_template")
    if source is None:
        jinja_file = p.with_name("chat_template.jinja")
        json_file = p.with_name("chat_template.json")
        if jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        elif json_file.is_file():
            source = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    if source is None:
        raise ConfigError(f"chat template: {p} has no chat_template")
    text, tool_use = _pick(source, str(p))
    variables = {k: v for k in _SPECIAL_NAMES if (v := _special_text(config.get(k))) is not None}
    specials: dict[str, int] = {}
    for tid, tok in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(tok, dict) and tok.get("special") and isinstance(tok.get("content"), str):
            specials[tok["content"]] = int(tid)
    loaded = JinjaChatTemplate(name=f"hf:{p}", source=text, tool_use_source=tool_use, variables=variables,
                               description=f"the chat template of {p}")
    return loaded.with_specials(specials)


def from_gguf(path: str | Path) -> JinjaChatTemplate:
    """The template a GGUF model carries (``tokenizer.chat_template``), with its BOS/EOS and control tokens."""
    from ctxfold.gguf import TOKEN_TYPE_CONTROL, GGUFError, read_metadata

    p = Path(path)
    keys = {"tokenizer.chat_template", "tokenizer.chat_template.tool_use", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "general.name", "general.architecture"}
    try:
        meta = read_metadata(p, keys)
    except FileNotFoundError:
        raise ConfigError(f"chat template: {p} does not exist") from None
    except (OSError, GGUFError) as e:
        raise ConfigError(f"chat template: {e}") from None
    source = meta.get("tokenizer.chat_template")
    if not isinstance(source, str):
        model = meta.get("general.name") or p.name
        preset = _ARCHITECTURE_PRESETS.get(str(meta.get("general.architecture", "")))
        hint = f"--template {preset} (its instruct template)" if preset else "--template file:PATH or a preset"
        raise ConfigError(f"chat template: the GGUF file {p} ({model}) carries no chat template "
                          f"(tokenizer.chat_template); give one with {hint}")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type")
    variables: dict[str, str] = {}
    for key, var in (("tokenizer.ggml.bos_token_id", "bos_token"), ("tokenizer.ggml.eos_token_id", "eos_token")):
        tid = meta.get(key)
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            variables[var] = tokens[tid]
    specials: dict[str, int] = {}
    if types is not None:
        for tid in (types == TOKEN_TYPE_CONTROL).nonzero()[0].tolist():
            specials.setdefault(tokens[tid], int(tid))
    tool_use = meta.get("tokenizer.chat_template.tool_use")
    t = JinjaChatTemplate(name=f"gguf:{p}", source=source, variables=variables,
                          tool_use_source=tool_use if isinstance(tool_use, str) else "",
                          description=f"the chat template of {p}")
    return t.with_specials(specials)


# A model architecture (GGUF general.architecture) -> the preset of its instruct template, where one
# template serves every model of it.
_ARCHITECTURE_PRESETS = {"gemma3": "gemma-3"}


def load_model_template(spec: str) -> JinjaChatTemplate:
    """The template ``spec`` names (``hf:PATH`` a tokenizer config or its directory, ``gguf:PATH``,
    ``file:PATH``), loaded in this process, unchecked: :func:`ctxfold.templates.get_template` loads it
    through :func:`ctxfold.template_loader.load_checked`, which calls this in a child process first."""
    kind, _, rest = spec.partition(":")
    if kind == "gguf":
        return from_gguf(rest)
    if kind == "file":
        return from_file(rest)
    if kind != "hf" or not rest:
        raise ConfigError(f"chat template {spec!r}: not hf:PATH, gguf:PATH or file:PATH")
    path = Path(rest)
    return from_tokenizer_config(path / "tokenizer_config.json" if path.is_dir() else path)


def from_file(path: str | Path) -> JinjaChatTemplate:
    """A plain Jinja template file: no special tokens known (give them with :meth:`JinjaChatTemplate.with_specials`,
    or let the accounting take them from an exact tokenizer)."""
    p = Path(path)
    try:
        source = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"chat template: {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"chat template: {p} is not readable text ({e})") from None
    return JinjaChatTemplate(name=f"file:{p}", source=source, description=f"the chat template in {p}")


def jinja_presets() -> dict[str, JinjaChatTemplate]:
    """The presets kept as the models' own Jinja text (:mod:`ctxfold.template_sources`)."""
    from ctxfold import template_sources as src

    gemma = {"<bos>": 2, "<eos>": 1, "<start_of_turn>": 105, "<end_of_turn>": 106, "<start_of_image>": 255999}
    llama = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|start_header_id|>": 128006,
             "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009, "<|python_tag|>": 128010}
    out = {
        "gemma-3": JinjaChatTemplate(
            name="gemma-3", source=src.GEMMA3, variables={"bos_token": "<bos>", "eos_token": "<eos>"},
            description="Gemma 3 instruct's own template: system prompt folded into the first user turn, "
            "contents trimmed, no tool role (it refuses anything but alternating user/model turns)"),
        "llama-3.1": JinjaChatTemplate(
            name="llama-3.1", source=src.LLAMA31,
            variables={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            description="Llama 3.1 instruct's own template: tools in the first user turn, one call per "
            "message as JSON with parameters, results as JSON strings in ipython turns"),
        "llama-3.2": JinjaChatTemplate(
            name="llama-3.2", source=src.LLAMA32,
            variables={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            description="Llama 3.2 instruct's own template: 3.1's, with today's date in the system turn"),
    }
    out = {k: v.with_specials(gemma if k.startswith("gemma") else llama) for k, v in out.items()}
    out["gemma3"] = out["gemma-3"]
    out["llama-3"] = out["llama3"] = out["llama-3.1"]
    return out


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
