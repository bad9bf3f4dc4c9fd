"""A preset's render session (:class:`ctxfold.tokens.templates.session.RenderSession`).

A preset renders each message's segment from the message, its neighbours' roles and where the last user
turn is: nothing of the conversation is kept, and a segment before the changed messages (the text run a
new one continues) is rendered again when asked for. The session holds the header (system prompt, tools,
their prefix) and the thinking mode, which ``RenderOptions(thinking=None)`` turns on once a message
carries reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ctxfold.chat.messages import Conversation, Message, ToolSpec
from ctxfold.tokens.templates.presets import ChatTemplate, Renderer, RenderOptions, Segment, last_user_index

if TYPE_CHECKING:
    from ctxfold.tokens.counting import TokenCounter


def _special_extra_tokens(counter: TokenCounter, specials: Mapping[int, str]) -> dict[int, int]:
    """The template's control tokens that the counter's vocabulary lacks (a template paired with another
    model's tokenizer): the model reads their text as text, so each costs its text's tokens, not one.
    Id -> tokens beyond the one a control token is counted as; empty where every one is in the
    vocabulary, or where the counter cannot say (the estimate, tiktoken)."""
    token_id = getattr(counter, "token_id", None)
    if token_id is None or not counter.exact:
        return {}
    return {i: counter.count(text) - 1 for i, text in specials.items() if token_id(text) is None and counter.count(text) > 1}


class _PresetRendering:
    """Segments of one message list under one header and thinking mode, rendered when first asked for."""

    __slots__ = ("_keep_all", "_last_user", "_messages", "_opts", "_renderer", "_segs", "_tools", "prefix")

    def __init__(self, renderer: Renderer, prefix: Segment, messages: Sequence[Message], last_user: int,
                 keep_all: bool, opts: RenderOptions, tools: Sequence[ToolSpec]) -> None:
        self.prefix = prefix
        self._renderer = renderer
        self._messages = messages
        self._last_user = last_user
        self._keep_all = keep_all
        self._opts = opts
        self._tools = tools
        self._segs: dict[int, Segment] = {}

    def segment(self, index: int) -> Segment:
        seg = self._segs.get(index)
        if seg is None:
            seg = self._renderer.message(self._messages, index, last_user=self._last_user,
                                         keep_all_reasoning=self._keep_all, opts=self._opts, tools=self._tools)
            self._segs[index] = seg
        return seg

    def suffix(self) -> Segment:
        return self._renderer.suffix(self._messages, last_user=self._last_user, keep_all_reasoning=self._keep_all,
                                     opts=self._opts)


class PresetSession:
    """One conversation's renders under a preset. Thread safety: none; one per accounting."""

    alternates_roles = False  # ctxfold's presets accept any order of roles

    def __init__(self, template: ChatTemplate, counter: TokenCounter, options: RenderOptions) -> None:
        self.template = template
        self.renderer = Renderer(template)
        self.options = options
        self.special_extra = _special_extra_tokens(counter, self.renderer.specials)
        self._opts = options.resolved(())  # with thinking decided for the current messages
        self._system: str | None = None
        self._tools: tuple[ToolSpec, ...] = ()
        self._keep_all = False
        self.prefix: Segment = self.renderer.prefix(None, ())

    def set_header(self, system: str | None, tools: Sequence[ToolSpec]) -> bool:
        keep_all = self.renderer.keeps_all_reasoning(bool(tools))
        # Every message renders again where the reasoning rules changed, or where the template writes the
        # tools into the last user message (Mistral v7) and they changed.
        changed = keep_all != self._keep_all or (self.template.tools_with_last_user and tuple(tools) != self._tools)
        self._system, self._tools, self._keep_all = system, tuple(tools), keep_all
        self.prefix = self.renderer.prefix(system, tools)
        return changed

    def rethink(self, messages: Sequence[Message], first_new: int, appended: bool) -> bool:
        if self.options.thinking is not None:
            return False
        # Auto thinking mode: on once any message carries reasoning.
        if appended:
            thinking = bool(self._opts.thinking) or any(m.reasoning for m in messages[first_new:])
        else:
            thinking = any(m.reasoning for m in messages)
        if thinking == self._opts.thinking:
            return False
        self._opts = RenderOptions(thinking=thinking)
        return True

    def rerenders_turn(self, messages: Sequence[Message]) -> bool:
        del messages  # thinking markers and kept reasoning depend on where the last user turn is
        return True

    def render(self, messages: Sequence[Message], start: int, last_user: int) -> _PresetRendering:
        del start  # every segment is rendered when asked for
        return _PresetRendering(self.renderer, self.prefix, messages, last_user, self._keep_all, self._opts,
                                self._tools)

    def keep(self, rendering: object) -> None:
        del rendering  # nothing kept: a preset renders every segment from the messages when asked

    def render_appended(self, messages: Sequence[Message], last_user: int) -> _PresetRendering:
        opts = self._opts
        if self.options.thinking is None and messages[-1].reasoning and not opts.thinking:
            opts = RenderOptions(thinking=True)  # auto mode: this message would turn it on
        return _PresetRendering(self.renderer, self.prefix, messages, last_user, self._keep_all, opts, self._tools)

    def request(self, system: str | None, tools: Sequence[ToolSpec], messages: Sequence[Message]) -> _PresetRendering:
        return _PresetRendering(self.renderer, self.renderer.prefix(system, tools), messages, last_user_index(messages),
                                self.renderer.keeps_all_reasoning(bool(tools)), self.options.resolved(messages),
                                tuple(tools))

    def suffix(self, messages: Sequence[Message], last_user: int) -> Segment:
        return self.renderer.suffix(messages, last_user=last_user, keep_all_reasoning=self._keep_all, opts=self._opts)

    def request_text(self, messages: Sequence[Message]) -> str:
        view = Conversation(messages=list(messages), system=self._system, tools=self._tools)
        return self.renderer.render(view, self._opts).text()

    def settled(self, messages: Sequence[Message]) -> bool:
        del messages  # segments rendered from the messages add up to the whole render by construction
        return True


__all__ = ["PresetSession"]
