"""A model's own Jinja template's render session (:class:`ctxfold.tokens.templates.session.RenderSession`).

A Jinja template is a program over the whole message list: segments are derived from renders of a few
messages around the changed ones (:meth:`ctxfold.tokens.templates.jinja.JinjaRenderer.segments`). A segment
once derived is kept, as a preset's could be rendered again, so the session holds every message's segment,
the prefix and the generation prompt as last derived. The derivation is checked against a whole render
when the conversation reaches 4 messages, then 8, and so on (O(1) amortized per message); a template it
does not hold for is rendered whole from then on (``renderer.separable`` False, with a warning) and
checked on every request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ctxfold.chat.messages import Conversation, Message, ToolSpec
from ctxfold.tokens.templates.jinja import JinjaRenderer, TemplateRenderError, renderer_for
from ctxfold.tokens.templates.jinja_loading import JinjaChatTemplate
from ctxfold.tokens.templates.presets import Segment, segment_text

if TYPE_CHECKING:
    from ctxfold.tokens.counting import TokenCounter

# The derived segments are checked against a whole render of the request when the conversation reaches
# this many messages, then at twice as many, and so on.
_FIRST_CHECK_MESSAGES = 4


class _JinjaRendering:
    """Segments of one message list: those derived for it from ``start`` on, and the kept ones before."""

    __slots__ = ("_kept", "_suffix", "derived", "prefix", "start")

    def __init__(self, prefix: Segment, start: int, derived: list[Segment], kept: list[Segment],
                 suffix: Segment) -> None:
        self.prefix = prefix
        self.start = start
        self.derived = derived
        self._kept = kept
        self._suffix = suffix

    def segment(self, index: int) -> Segment:
        # Before the first changed message: the segment derived when it was new.
        return self.derived[index - self.start] if index >= self.start else self._kept[index]

    def suffix(self) -> Segment:
        return self._suffix


class JinjaSession:
    """One conversation's renders under a Jinja template. Thread safety: none; one per accounting (the
    renderer it uses is shared, and thread-safe)."""

    def __init__(self, template: JinjaChatTemplate, counter: TokenCounter) -> None:
        self.renderer: JinjaRenderer = renderer_for(template, counter)
        self.template: JinjaChatTemplate = self.renderer.template
        self.alternates_roles = self.renderer.alternates_roles
        self.special_extra: dict[int, int] = {}  # its control tokens come from the model's own tokenizer
        self._system: str | None = None
        self._tools: tuple[ToolSpec, ...] = ()
        self._segs: list[Segment] = []  # every message's segment, as last derived
        self.prefix: Segment = ()
        self._suffix: Segment = ()
        self._next_check = _FIRST_CHECK_MESSAGES

    def _segments(self, msgs: Sequence[Message], start: int, system: str | None = None,
                  tools: Sequence[ToolSpec] | None = None) -> tuple[Segment, list[Segment], Segment]:
        """Prefix, segments of messages ``start``.., and suffix (under the session's header unless
        ``tools`` is given). An empty conversation that the template refuses (one that needs a user turn)
        is an empty request."""
        r = self.renderer
        sys_, tls = (self._system, self._tools) if tools is None else (system, tools)
        if not msgs:
            try:
                prefix, _, suffix = r.segments(sys_, tls, msgs, 0)
            except TemplateRenderError:
                return (), [], ()
            return r.split(prefix), [], r.split(suffix)
        prefix, texts, suffix = r.segments(sys_, tls, msgs, start)
        return r.split(prefix), [r.split(t) for t in texts], r.split(suffix)

    def set_header(self, system: str | None, tools: Sequence[ToolSpec]) -> bool:
        # A Jinja template may fold the header into the first messages (Gemma's system prompt, Llama's
        # tools): every message is derived again.
        self._system, self._tools = system, tuple(tools)
        self._segs = []
        self.prefix, _, self._suffix = self._segments([], 0)
        return True

    def rethink(self, messages: Sequence[Message], first_new: int, appended: bool) -> bool:
        del messages, first_new, appended  # a Jinja template's switches are its variables
        return False

    def rerenders_turn(self, messages: Sequence[Message]) -> bool:
        return self.renderer.rerenders_turn(messages)  # probed when the template was loaded

    def render(self, messages: Sequence[Message], start: int, last_user: int) -> _JinjaRendering:
        del last_user  # the template finds it itself
        prefix, derived, suffix = self._segments(messages, start)
        return _JinjaRendering(prefix if start == 0 else self.prefix, start, derived, self._segs, suffix)

    def keep(self, rendering: object) -> None:
        assert isinstance(rendering, _JinjaRendering)  # this session's own
        if rendering.start == 0:
            self.prefix = rendering.prefix
        self._segs[rendering.start:] = rendering.derived
        self._suffix = rendering.suffix()

    def render_appended(self, messages: Sequence[Message], last_user: int) -> _JinjaRendering:
        del last_user
        start = len(messages) - 1
        return _JinjaRendering(self.prefix, start, self._segments(messages, start)[1], self._segs, ())

    def request(self, system: str | None, tools: Sequence[ToolSpec], messages: Sequence[Message]) -> _JinjaRendering:
        prefix, derived, suffix = self._segments(messages, 0, system, tuple(tools))
        return _JinjaRendering(prefix, 0, derived, self._segs, suffix)

    def suffix(self, messages: Sequence[Message], last_user: int) -> Segment:
        del messages, last_user  # derived with the messages, and kept
        return self._suffix

    def request_text(self, messages: Sequence[Message]) -> str:
        del messages  # the kept segments are the request
        return "".join(segment_text(s, self.renderer.specials) for s in (self.prefix, *self._segs, self._suffix))

    def settled(self, messages: Sequence[Message]) -> bool:
        """Compares the derived segments with a whole render, when due; where they differ, the template is
        not separable: it is rendered whole from now on, and every message must be derived again."""
        if self.renderer.separable and len(messages) < self._next_check:
            return True
        # Not separable: every request is checked (the messages before the changed ones may render
        # differently now), and derived again from the start where they do.
        self._next_check = 2 * len(messages)
        if not messages:
            return True
        want = self.renderer.render_text(Conversation(messages=list(messages), system=self._system, tools=self._tools))
        if self.request_text(messages) == want:
            return True
        self.renderer.mark_not_separable(f"derived segments differ from the whole render of {len(messages)} messages")
        self._segs = []
        return False


__all__ = ["JinjaSession"]
