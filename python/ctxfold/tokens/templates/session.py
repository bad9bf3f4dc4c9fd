"""One protocol for rendering a conversation incrementally, whatever the kind of chat template.

:class:`ctxfold.tokens.accounting.RequestAccounting` keeps one :class:`RenderSession` per conversation and
drives it through the calls below only. Two kinds implement it:

- :class:`ctxfold.tokens.templates.preset_session.PresetSession` (ctxfold's presets, templates as data):
  a message's segment is rendered from the message and its neighbours, so nothing is kept but the
  header's prefix and the thinking mode; a segment before the changed ones is rendered again when asked for.
- :class:`ctxfold.tokens.templates.jinja_session.JinjaSession` (a model's own Jinja template): segments are
  derived from renders of a few messages around the changed ones, so the session keeps every message's
  segment as last derived, and checks them against a whole render as the conversation doubles in length.

:func:`render_session` is the one place that tells the two kinds of template apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ctxfold.chat.messages import Conversation, Message, ToolSpec
from ctxfold.tokens.templates.jinja_session import JinjaSession
from ctxfold.tokens.templates.preset_session import PresetSession
from ctxfold.tokens.templates.presets import ChatTemplate, RenderedRequest, RenderOptions, Segment

if TYPE_CHECKING:
    from ctxfold.tokens.counting import TokenCounter
    from ctxfold.tokens.templates.jinja_loading import JinjaChatTemplate


class ConversationRenderer(Protocol):
    """What the compactor asks of a template's renderer (a whole request, the tools block)."""

    @property
    def template(self) -> ChatTemplate | JinjaChatTemplate: ...

    def render(self, conversation: Conversation, opts: RenderOptions = ...) -> RenderedRequest: ...

    def tools_block(self, tools: Sequence[ToolSpec]) -> list[str | int]: ...


class Rendering(Protocol):
    """The segments of one message list under one header: those rendered for it, and those before the
    first rendered one as the session has them (rendered again, or kept)."""

    @property
    def prefix(self) -> Segment:
        """The request's start: BOS, system prompt, tool definitions."""
        ...

    def segment(self, index: int) -> Segment:
        """The segment of message ``index``; a preset's is rendered once per rendering, then kept."""
        ...

    def suffix(self) -> Segment:
        """The request's end: the generation prompt."""
        ...


class RenderSession(Protocol):
    """One conversation's renders under one template. Thread safety: none; one per accounting."""

    @property
    def template(self) -> ChatTemplate | JinjaChatTemplate: ...

    @property
    def renderer(self) -> ConversationRenderer: ...

    @property
    def alternates_roles(self) -> bool:
        """Whether the template refuses two user messages in a row: a rewrite then frames its summary as
        a user/assistant pair (ctxfold's presets accept any order)."""
        ...

    @property
    def special_extra(self) -> Mapping[int, int]:
        """Control token id -> tokens it costs beyond one: a preset's control tokens that the counter's
        vocabulary lacks (a template paired with another model's tokenizer) are read as text."""
        ...

    @property
    def prefix(self) -> Segment:
        """The start of the session's request: BOS, system prompt, tool definitions."""
        ...

    def set_header(self, system: str | None, tools: Sequence[ToolSpec]) -> bool:
        """Takes a new system prompt and tools; True when every message must be rendered again."""
        ...

    def rethink(self, messages: Sequence[Message], first_new: int, appended: bool) -> bool:
        """Decides the auto thinking mode for ``messages`` (``first_new`` the first that changed, ``appended``
        whether the rest are unchanged); True when it flipped and every message renders again."""
        ...

    def rerenders_turn(self, messages: Sequence[Message]) -> bool:
        """Whether a new last user turn can change how ``messages`` (the turn before it) render."""
        ...

    def render(self, messages: Sequence[Message], start: int, last_user: int) -> Rendering:
        """Renders messages ``start``.. of ``messages``, without changing the session; ``last_user`` is the
        index of the last user message, -1 when none. :meth:`keep` makes them the session's conversation."""
        ...

    def keep(self, rendering: Rendering) -> None:
        """``rendering`` (from :meth:`render`) is the session's conversation from now on: called once it is
        counted, so that a count that fails leaves the session as it was."""
        ...

    def render_appended(self, messages: Sequence[Message], last_user: int) -> Rendering:
        """Renders the last of ``messages`` (the conversation and one message more) as if appended,
        without changing the session."""
        ...

    def request(self, system: str | None, tools: Sequence[ToolSpec], messages: Sequence[Message]) -> Rendering:
        """Renders a whole request under another header, without changing the session."""
        ...

    def suffix(self, messages: Sequence[Message], last_user: int) -> Segment:
        """The generation prompt after the session's conversation, ``messages``."""
        ...

    def request_text(self, messages: Sequence[Message]) -> str:
        """The session's whole request as rendered (control tokens as their text). O(request)."""
        ...

    def settled(self, messages: Sequence[Message]) -> bool:
        """Whether the session's segments still add up to the request a whole render makes; False: it
        renders whole from now on, and every message must be rendered again."""
        ...


def render_session(template: ChatTemplate | JinjaChatTemplate, counter: TokenCounter,
                   options: RenderOptions) -> RenderSession:
    """A render session for ``template`` as ``counter`` counts it, with ``options`` (a preset's
    switches; a Jinja template's are its ``variables``)."""
    if isinstance(template, ChatTemplate):
        return PresetSession(template, counter, options)
    return JinjaSession(template, counter)


__all__ = ["ConversationRenderer", "RenderSession", "Rendering", "render_session"]
