"""Whole-request token accounting, incremental, over the C++ ledger.

:class:`RequestAccounting` keeps, for one conversation, the token count of every message as the
chat template renders it, plus the fixed part of a request (BOS, system prompt, tool definitions,
generation prompt). Counting the next request costs only the messages that changed or are new:

- each rendered segment is keyed by a 64-bit hash of its parts; the ledger's count cache maps the
  key to its count, so a message seen before (in this conversation or an earlier view of it) is
  never tokenized again;
- :meth:`RequestAccounting.sync` takes the new message list, finds where it diverges from the
  last one (by identity, then equality), re-renders from there (and the one message before, whose
  framing can depend on what follows it), and rewrites the ledger's tail.

The template renders through one :class:`ctxfold.tokens.templates.session.RenderSession` per accounting,
whichever kind it is (a preset, a model's own Jinja template): the accounting asks it for the segments of
the messages from the first changed one on, and of the one before (the text run a new segment continues),
and never tells the kinds apart.

Segment counts add up to the count of the whole rendered prompt exactly: where two segments meet
without a control token between them (two tool results in one run), the second one's count is
taken as count(run so far + its text) - count(run so far), so a token that spans the seam is
counted once.

Memory per message: the ledger's 28 bytes, one cache entry, and one reference in the message list (and,
under a Jinja template, its segment, which the session keeps).
Thread safety: none; one accountant per conversation, used by its owner.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ctxfold import _core
from ctxfold.chat.messages import Conversation, Message, Role, ToolSpec
from ctxfold.core.ledger import SegmentFlag, message_flags
from ctxfold.tokens.counting import TokenCounter
from ctxfold.tokens.templates import (
    ChatTemplate,
    Reasoning,
    RenderOptions,
    Segment,
    get_template,
    last_user_index,
)
from ctxfold.tokens.templates.jinja_loading import JinjaChatTemplate
from ctxfold.tokens.templates.session import ConversationRenderer, Rendering, render_session

_KEY_MASK = (1 << 64) - 1

# Text only, no framing: what "count the message texts" means. The default when no template is
# given and the counter names no framing of its own (an exact tokenizer, chars/4).
PLAIN = ChatTemplate(
    name="plain",
    specials={},
    system="{system}{tools}",
    tool_call="{name}{arguments}",
    keep_reasoning=Reasoning.AFTER_LAST_USER,
    description="message texts only: content, reasoning, tool-call names and arguments; no framing",
)


def default_template(counter: TokenCounter) -> ChatTemplate | JinjaChatTemplate:
    """The template an accounting renders with when it is given none.

    An estimator's calibration names the chat template of the model it stands for (``template``):
    its framing (role markers, tool-call markup, the tools block) is part of every request, and a
    count without it is under the truth on every request. Any other counter: :data:`PLAIN`.
    """
    name = getattr(counter, "template", "")
    return get_template(name) if isinstance(name, str) and name else PLAIN


# How far back a result's call is looked for. Calls and results sit a few messages apart; the bound
# keeps a result whose call is gone (an orphan in the recording) from costing a scan to the start.
_OPENER_LOOKBACK = 256


def _opener(messages: Sequence[Message], i: int) -> int:
    """Index of the assistant message that made the call ``messages[i]`` answers, else ``i``.

    Found by call id, walking back over whatever sits between a call and its result (other results,
    queued inserts, resume messages, a user who interjected), so the call and every result share one
    atomic group and a tail can never start between them.
    """
    call_id = messages[i].tool_call_id
    for j in range(i - 1, max(i - 1 - _OPENER_LOOKBACK, -1), -1):
        m = messages[j]
        if m.role is Role.ASSISTANT and any(c.id == call_id for c in m.tool_calls):
            return j
    return i


def _first_difference(old: Sequence[Message], new: Sequence[Message]) -> int:
    """The index of the first message where ``old`` and ``new`` differ (identity first, then equality);
    the shorter length when one is the other's start."""
    n = min(len(old), len(new))
    if all(map(operator.is_, old[:n], new[:n])):  # the agent-loop case, at C speed
        return n
    d = 0
    while d < n and (old[d] is new[d] or old[d] == new[d]):
        d += 1
    return d


def segment_key(segment: Segment, join_tail: str | None = None) -> int:
    """64-bit cache key of a rendered segment (and the text run it continues, if any).

    Python's hash of str is salted per process: keys are good for this process's cache only.
    """
    return hash((join_tail, segment)) & _KEY_MASK


def _leading_text(seg: Segment) -> bool:
    return bool(seg) and isinstance(seg[0], str)


def _trailing_run(seg: Segment) -> tuple[str, bool]:
    """The text after the last control token of ``seg``, and whether ``seg`` has a control token."""
    run: list[str] = []
    for p in reversed(seg):
        if isinstance(p, int):
            return "".join(reversed(run)), True
        run.append(p)
    return "".join(reversed(run)), False


@dataclass(frozen=True, slots=True)
class _Pending:
    """One segment to count: its text runs (the first possibly joined), control tokens, key."""

    key: int
    runs: tuple[str, ...]
    num_specials: int
    join_tail: str | None  # the run this segment's first text continues; its count is subtracted


class RequestAccounting:
    """Token accounting of one conversation's requests under one counter and chat template.

    With a model's own Jinja template (:class:`ctxfold.tokens.templates.jinja_loading.JinjaChatTemplate`) the
    segments are derived from renders of a few messages around the changed ones; the derivation is
    checked against a whole render as the conversation doubles in length, and a template it does
    not hold for is rendered whole from then on (``renderer.separable`` False, with a warning), every
    message derived again (:mod:`ctxfold.tokens.templates.jinja_session`). A template that refuses the
    conversation raises :class:`ctxfold.tokens.templates.jinja.TemplateRenderError`.
    """

    def __init__(
        self,
        counter: TokenCounter,
        template: ChatTemplate | JinjaChatTemplate | None = None,
        *,
        options: RenderOptions | None = None,
    ) -> None:
        self.counter = counter
        chosen = template if template is not None else default_template(counter)
        self.options = options if options is not None else RenderOptions()
        self._session = render_session(chosen, counter, self.options)
        self.template: ChatTemplate | JinjaChatTemplate = self._session.template
        self.renderer: ConversationRenderer = self._session.renderer
        # Whether the template refuses two user messages in a row: a rewrite then frames its summary
        # as a user/assistant pair (ctxfold's presets accept any order).
        self.alternates_roles = self._session.alternates_roles
        self._special_extra = self._session.special_extra
        self._rederiving = False
        self.ledger = _core.Ledger()
        self._messages: list[Message] = []
        self._last_user = -1
        self._system: str | None = None
        self._tools: tuple[ToolSpec, ...] = ()
        self._prefix: Segment = ()
        self.prefix_tokens = 0
        self.suffix_tokens = 0
        self._set_header(None, ())

    # -- header (system prompt and tools) -----------------------------------------------------------

    def _set_header(self, system: str | None, tools: Sequence[ToolSpec]) -> None:
        specs = tuple(t for t in tools if isinstance(t, ToolSpec))
        self._system, self._tools = system, specs
        if self._session.set_header(system, specs):
            # A Jinja template may fold the header into the first messages (Gemma's system prompt, Llama's
            # tools); a preset's reasoning rules may change with the tools, or its tools be written into the
            # last user message: every message renders again.
            self._messages = []
            self._last_user = -1
            self.ledger.truncate(0)
        self._prefix = self._session.prefix
        self.prefix_tokens = self._count_segments([self._prefix], [None])[0]
        self._update_suffix()  # the generation prompt may follow the header (a sync with no change does not)

    def reset(self, header: Conversation, messages: Sequence[Message] | None = None) -> int:
        """Sets the system prompt and tools from ``header`` and syncs to ``messages`` (default: the
        header's own messages). Returns the request's total tokens."""
        if header.system != self._system or tuple(header.tools) != self._tools:
            self._set_header(header.system, header.tools)
        return self.sync(header.messages if messages is None else messages)

    # -- figures ------------------------------------------------------------------------------------

    @property
    def total_tokens(self) -> int:
        """Tokens of the whole request: prefix + every message + generation prompt. O(1)."""
        return self.prefix_tokens + int(self.ledger.total_tokens) + self.suffix_tokens

    @property
    def fixed_tokens(self) -> int:
        """Tokens that do not belong to any message: BOS, system, tools, generation prompt."""
        return self.prefix_tokens + self.suffix_tokens

    @property
    def messages(self) -> Sequence[Message]:
        return self._messages

    def __len__(self) -> int:
        return len(self._messages)

    def tokens(self) -> npt.NDArray[np.int64]:
        """Per-message token counts (framing included), int64[len(self)]."""
        return self.ledger.tokens()

    def flags(self) -> npt.NDArray[np.uint32]:
        return self.ledger.flags()

    def group_starts(self) -> npt.NDArray[np.int32]:
        return self.ledger.group_starts()

    def message_tokens(self, message: Message | int) -> int:
        """Tokens of one message: by index, or a message object (one of this conversation's, found
        by identity; otherwise counted as if appended next, without changing anything)."""
        if isinstance(message, int):
            n = len(self._messages)
            if not -n <= message < n:
                raise IndexError(f"message_tokens: index {message} out of range for {n} messages")
            return self.ledger.num_tokens_at(message % n)  # one value, not a copy of the column
        for i in range(len(self._messages) - 1, -1, -1):
            if self._messages[i] is message:
                return self.ledger.num_tokens_at(i)
        msgs = [*self._messages, message]
        r = self._session.render_appended(msgs, last_user_index(msgs))
        seg = r.segment(len(msgs) - 1)
        tail = self._tail_before(r, len(msgs) - 1, self._prefix) if _leading_text(seg) else None
        return self._count_segments([seg], [tail])[0]

    # -- updates ------------------------------------------------------------------------------------

    def append(self, message: Message) -> int:
        """Appends one message; returns its tokens. Costs the rendering of it and its predecessor."""
        self.sync([*self._messages, message])
        return self.ledger.num_tokens_at(len(self.ledger) - 1)

    def truncate(self, num_messages: int) -> None:
        if not 0 <= num_messages <= len(self._messages):
            raise IndexError(f"truncate: num_messages must be in [0, {len(self._messages)}], got {num_messages}")
        self.sync(self._messages[:num_messages])

    def replace(self, index: int, message: Message) -> int:
        """Replaces one message (an archived tool output, a rewritten message); returns its tokens."""
        if not 0 <= index < len(self._messages):
            raise IndexError(f"replace: index {index} out of range [0, {len(self._messages)})")
        msgs = list(self._messages)
        msgs[index] = message
        self.sync(msgs)
        return self.ledger.num_tokens_at(index)

    def sync(self, messages: Sequence[Message]) -> int:
        """Makes the ledger describe ``messages``; returns the request's total tokens.

        Cost: rendering and hashing the messages from the first changed one (and, when the last
        user turn moved, from the previous last user turn), plus tokenizing the segments whose key
        the cache has not seen. Messages are compared by identity first, so an append-only agent
        loop costs O(new messages) tokenizer work.
        """
        new = list(messages)
        old = self._messages
        d = _first_difference(old, new)
        if d == len(old) == len(new):
            return self.total_tokens
        if d == len(old):  # only appended: the last user turn is the old one or a new one
            grown = last_user_index(new[d:])
            last_user = d + grown if grown >= 0 else self._last_user
        else:
            last_user = last_user_index(new)
        start = self._rerender_start(new, d, last_user)
        self._ledger_from(new, start, last_user)
        self._messages = new
        self._last_user = last_user
        self._update_suffix()
        if not self._rederiving and not self._session.settled(new):
            self._rederive()
        return self.total_tokens

    def _rerender_start(self, new: Sequence[Message], d: int, last_user: int) -> int:
        """The first message of ``new`` to render again, ``d`` being the first that changed and
        ``last_user`` the new last user turn; switches the auto thinking mode where it flips."""
        old = self._messages
        start = max(d - 1, 0)  # the previous message's framing can depend on what follows it
        if self._session.rethink(new, d, d == len(old)):  # auto thinking mode flipped: every message again
            start = 0
        if last_user != self._last_user:
            # Thinking markers and kept reasoning depend on where the last user turn is: every
            # message from the earlier of the two positions on may render differently (from the
            # start when there was no user message). A Jinja template says whether it does (probed).
            turn = max(min(self._last_user, last_user), 0)
            if self._session.rerenders_turn(new[turn:d]):
                start = min(start, turn)
        return start

    def _ledger_from(self, new: Sequence[Message], start: int, last_user: int) -> None:
        """Renders and counts messages ``start``.. of ``new`` and puts them in the ledger in place of
        those it had from ``start`` on (the prefix too, when ``start`` is 0 and a Jinja template derived
        another one)."""
        # Everything is counted before anything is kept: a count that fails (a text no tokenizer can
        # encode) leaves the session, the prefix and the ledger as they were.
        r = self._session.render(new, start, last_user)
        prefix, prefix_tokens = self._prefix, self.prefix_tokens
        if start == 0 and r.prefix != prefix:
            prefix, prefix_tokens = r.prefix, self._count_segments([r.prefix], [None])[0]
        segs: list[Segment] = []
        tails: list[str | None] = []
        for i in range(start, len(new)):
            seg = r.segment(i)
            segs.append(seg)
            tails.append(self._tail_before(r, i, prefix) if _leading_text(seg) else None)
        counts = self._count_segments(segs, tails)
        group_start = np.empty(len(segs), dtype=np.int64)
        flags = np.empty(len(segs), dtype=np.uint32)
        keys = np.empty(len(segs), dtype=np.uint64)
        for k, i in enumerate(range(start, len(new))):
            m = new[i]
            group_start[k] = _opener(new, i) if m.role is Role.TOOL else i
            flags[k] = int(message_flags(m))
            keys[k] = segment_key(segs[k], tails[k])
        self.ledger.truncate(start)
        self.ledger.append_batch(keys, np.asarray(counts, dtype=np.int64), flags, group_start)
        self._prefix, self.prefix_tokens = prefix, prefix_tokens
        self._session.keep(r)

    def request_text(self) -> str:
        """The whole request as this accounting has it rendered (control tokens as their text). O(request)."""
        return self._session.request_text(self._messages)

    def _rederive(self) -> None:
        """Renders every message again, the session's segments having failed its check (a Jinja template
        that is not separable after all: it is rendered whole from now on)."""
        msgs = self._messages
        self._messages, self._last_user = [], -1
        self.ledger.truncate(0)
        self._rederiving = True  # from the start, cut on whole renders: the segments add up by construction
        try:
            self.sync(msgs)
        finally:
            self._rederiving = False

    def count_view(self, header: Conversation, messages: Sequence[Message]) -> int:
        """Total tokens of the request ``header`` + ``messages`` would make, without changing this
        accountant (counts it learns are cached)."""
        msgs = list(messages)
        r = self._session.request(header.system, header.tools, msgs)
        segs: list[Segment] = [r.prefix]
        tails: list[str | None] = [None]
        for i in range(len(msgs)):
            seg = r.segment(i)
            segs.append(seg)
            tails.append(self._tail_before(r, i, r.prefix) if _leading_text(seg) else None)
        segs.append(r.suffix())
        tails.append(None)
        return int(sum(self._count_segments(segs, tails)))

    # -- internals ----------------------------------------------------------------------------------

    def _tail_before(self, r: Rendering, i: int, prefix: Segment) -> str | None:
        """The text run that segment ``i`` continues: the text after the last control token before it.

        None for a template without control tokens (plain texts): there every message is counted on
        its own, as "count the texts" means; joining would make the whole conversation one run and
        every append cost a walk back to its start. None for an estimator too: it counts byte
        classes, so a seam changes nothing it could see, and each run is counted as the text it was
        calibrated on.
        """
        if not self.template.specials or not self.counter.exact:
            return None
        runs: list[str] = []
        j = i - 1
        while j >= -1:
            seg = prefix if j < 0 else r.segment(j)
            run, closed = _trailing_run(seg)
            runs.append(run)
            if closed:
                break
            j -= 1
        tail = "".join(reversed(runs))
        return tail or None

    def _update_suffix(self) -> None:
        suffix = self._session.suffix(self._messages, self._last_user)
        self.suffix_tokens = self._count_segments([suffix], [None])[0]

    def _count_segments(self, segs: Sequence[Segment], tails: Sequence[str | None]) -> list[int]:
        """Counts of segments through the cache; the misses go to the counter in one batch."""
        out = [0] * len(segs)
        todo: list[tuple[int, _Pending]] = []
        for k, (seg, tail) in enumerate(zip(segs, tails, strict=True)):
            if not seg:
                continue
            key = segment_key(seg, tail)
            hit = self.ledger.cached_count(key)
            if hit >= 0:
                out[k] = int(hit)
                continue
            # Rendered segments never hold two text parts in a row: each str is one run.
            runs = tuple(p for p in seg if isinstance(p, str))
            num_specials = len(seg) - len(runs)
            if self._special_extra:
                num_specials += sum(self._special_extra.get(p, 0) for p in seg if isinstance(p, int))
            todo.append((k, _Pending(key, runs, num_specials, tail)))
        if not todo:
            return out
        texts: list[str] = []
        for _, p in todo:
            if p.join_tail is not None:
                texts.append(p.join_tail + p.runs[0])
                texts.append(p.join_tail)
                texts.extend(p.runs[1:])
            else:
                texts.extend(p.runs)
        # A list: the segments are a few runs each, and numpy's per-call cost is more than the sums.
        counts: list[int] = self.counter.count_batch(texts).tolist() if texts else []
        pos = 0
        for k, p in todo:
            n = len(p.runs) + (1 if p.join_tail is not None else 0)
            c = counts[pos : pos + n]
            pos += n
            total = sum(c) + p.num_specials
            if p.join_tail is not None:
                total -= 2 * c[1]  # c[1] is the tail alone: subtract it, not add it
            total = max(total, 0)
            self.ledger.remember_count(p.key, total)
            out[k] = total
        return out


def count_request(counter: TokenCounter, template: ChatTemplate | JinjaChatTemplate | None, conversation: Conversation,
                  options: RenderOptions | None = None) -> int:
    """Tokens of the whole request ``conversation`` makes under ``template`` (a one-off count)."""
    acc = RequestAccounting(counter, template, options=options)
    return acc.reset(conversation)


__all__ = ["PLAIN", "RequestAccounting", "SegmentFlag", "count_request", "default_template", "segment_key"]
