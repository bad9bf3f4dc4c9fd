"""llama.cpp as a ctxfold engine: a GGUF model, its tokenizer, and sequences whose KV cache follows the plan.

Through llama-cpp-python's low-level API (the ctypes bindings of ``llama.h``, not its ``Llama`` class, so that
the KV cache is edited directly). ``pip install 'ctxfold[llama]'``.

- :class:`LlamaCppModel`: a GGUF file loaded by llama.cpp, with its weights or its vocabulary alone; tokenizes
  as llama.cpp does a rendered chat prompt (special-token text parsed into its id, nothing added).
- :class:`LlamaCppContext`: a llama.cpp context (one KV cache) over a model: evaluate ids at given positions,
  remove, move and share KV ranges. One lock serialises every call into it.
- :class:`LlamaCppSequence`: an :class:`~ctxfold.engine.EngineSequence` bound to one sequence of a context.
  :meth:`~LlamaCppSequence.append` evaluates what it appends; :meth:`~LlamaCppSequence.write_summary` has the
  same model write the summary as a suffix of the live KV, then rolls it back (ds4's way);
  :meth:`~LlamaCppSequence.compact` rebuilds and executes the KV plan: keeps the planned prefix, removes
  what the plan drops (``llama_memory_seq_rm``), moves the verbatim tail (``llama_memory_seq_add``) when the
  cache can shift positions, and evaluates only the prefill ranges.

Exactness: keeping the prefix and evaluating the rest gives the logits of a cold prefill of the rebuilt ids up
to float rounding (the attention sums run over cells in another order). Moving the tail is approximate: its
KV was computed attending to tokens that are gone, and its keys are rotated to the new positions; each
:class:`Compaction` says which was done.

The context is created with a unified, full-size KV cache, for two reasons. llama.cpp only accepts a batch
whose first position follows the last one the sequence holds, so a summary that goes *before* a moved tail is
evaluated on a scratch sequence that shares the prefix's cells (``llama_memory_seq_cp``, bookkeeping only in
a unified cache) and then handed to the live sequence. And a sliding-window model (Gemma 3) keeps only the
last window of positions in a default cache: a kept prefix would lack the positions its window needs, and
the cache could not shift at all (``llama_memory_can_shift`` is false); a full-size window cache keeps them.
Even then llama.cpp hands out again a cell whose position has left the window of its sequence's newest token,
so each sequence has a pin sequence holding the same cells (a cell two sequences hold is never handed out).
Flash attention is off by default: on the CPU it computes a token differently depending on its batch.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ctxfold.compaction.config import CompactConfig
from ctxfold.core._arrays import ids_view
from ctxfold.core.tail import Boundary, TokenTail
from ctxfold.engine import EngineSequence, Rebuild, SegmentKind, TokenTemplate
from ctxfold.errors import EngineError
from ctxfold.tokens.llama_model import (  # re-exported: the engine's model is this one
    LlamaCppModel,
)

#: Gemma 3's turn markers, in order of preference for a tail start: a turn's first token, else right
#: after a turn's last one.
GEMMA3_MARKERS: tuple[tuple[str, bool], ...] = (("<start_of_turn>", False), ("<end_of_turn>", True))

_DECODE_ERRORS = {
    1: "no free KV slot: the window is full",
    2: "aborted",
    -1: "invalid batch (a position out of order, or a token id outside the vocabulary)",
}


def token_template(model: LlamaCppModel, name: str, markers: Sequence[tuple[str, bool]] = GEMMA3_MARKERS
                   ) -> TokenTemplate:
    """A :class:`~ctxfold.engine.TokenTemplate` from its boundary markers' text, each (text, cut_after), in
    order of preference; ValueError when a marker is not one token of this model's vocabulary."""
    boundaries = []
    for text, cut_after in markers:
        tid = model.token_id(text)
        if tid is None:
            raise ValueError(f"{text!r} is not one token in the vocabulary of {model.path.name}; "
                             "pass the markers of this model's chat template")
        boundaries.append(Boundary(tid, cut_after=cut_after))
    return TokenTemplate(name, tuple(boundaries))


class _Batch:
    """One llama_batch of ``capacity`` tokens, reused, with numpy views of its arrays."""

    def __init__(self, lib: Any, capacity: int) -> None:
        self.raw = lib.llama_batch_init(capacity, 0, 1)
        self.capacity = capacity
        self.token = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        np.ctypeslib.as_array(self.raw.n_seq_id, shape=(capacity,))[:] = 1
        self.seq_id = -1

    def fill(self, ids: npt.NDArray[np.int32], pos: int, seq_id: int, want_logits: bool) -> None:
        n = len(ids)
        self.token[:n] = ids
        self.pos[:n] = np.arange(pos, pos + n, dtype=np.int32)
        self.logits[:n] = 0
        if want_logits:
            self.logits[n - 1] = 1
        if seq_id != self.seq_id:
            for i in range(self.capacity):
                self.raw.seq_id[i][0] = seq_id
            self.seq_id = seq_id
        self.raw.n_tokens = n


def _free_context(lib: Any, handle: Any, batch: Any) -> None:
    lib.llama_batch_free(batch)
    lib.llama_free(handle)


class LlamaCppContext:
    """A llama.cpp context over a loaded model: one KV cache of ``n_ctx`` cells shared by ``n_sequences``
    sequences (ids 0 .. n_sequences - 1), plus one scratch sequence the adapter uses for itself.

    Every method takes ``lock`` (a llama.cpp context is not thread-safe); positions are token indices.

    flash_attn: off unless asked for. llama.cpp's CPU flash attention computes a token differently
    depending on how many tokens share its batch (measured on Gemma 3 270M: up to 1.7 in a logit when the
    same ids are split into other batches), so a kept prefix could never match a cold prefill; without it
    the result does not depend on the batching, and prefix reuse is exact.
    """

    def __init__(self, model: LlamaCppModel, *, n_ctx: int, n_batch: int = 512, n_threads: int | None = None,
                 n_sequences: int = 1, flash_attn: bool = False) -> None:
        if model.vocab_only:
            raise ValueError(f"{model.path.name} was loaded with vocab_only=True; load it with its weights to "
                             "evaluate tokens")
        if n_ctx <= 0 or n_batch <= 0 or n_sequences <= 0:
            raise ValueError(f"n_ctx, n_batch and n_sequences must be positive, got {n_ctx}, {n_batch}, {n_sequences}")
        lib = model._lib
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = 2 * n_sequences + 1  # each sequence's pin (see pin_id), and the scratch sequence
        params.n_threads = params.n_threads_batch = n_threads or os.cpu_count() or 1
        params.kv_unified = True  # sequences share cells: seq_cp is bookkeeping, not a copy (module docstring)
        params.swa_full = True  # a sliding-window cache keeps every position: prefixes can be kept and shifted
        params.no_perf = True
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        handle = lib.llama_init_from_model(model.handle, params)
        if not handle:
            raise EngineError(f"llama.cpp could not create a {n_ctx}-token context for {model.path.name} (out of "
                              "memory?); lower n_ctx")
        self._lib = lib
        self._handle = handle
        self._mem = lib.llama_get_memory(handle)
        self._batch = _Batch(lib, n_batch)
        self._finalizer = weakref.finalize(self, _free_context, lib, handle, self._batch.raw)
        self.model = model  # the model must outlive the context
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_sequences = n_sequences
        self.scratch_seq_id = 2 * n_sequences
        self.lock = threading.RLock()
        self.can_shift = bool(lib.llama_memory_can_shift(self._mem))

    def pin_id(self, seq_id: int) -> int:
        """The sequence that holds the same cells as ``seq_id``, so that none of them is ever reused.

        A sliding-window cache hands a cell out again once its position has left the window of its only
        sequence's newest token (even a full-size one). A later compaction that keeps a prefix and evaluates
        right after it needs those cells again; a cell two sequences hold is never handed out.
        """
        return self.n_sequences + seq_id

    @property
    def handle(self) -> Any:
        """The raw ``llama_context *``."""
        return self._handle

    def close(self) -> None:
        """Free the context now."""
        with self.lock:
            self._finalizer()

    def decode(self, ids: Any, *, pos: int, seq_id: int, logits: bool = True) -> npt.NDArray[np.float32] | None:
        """Evaluate int32 ids at positions [pos, pos + len(ids)) of ``seq_id``, ``n_batch`` at a time; the last
        one's logits (float32[n_vocab], a copy) when ``logits``. llama.cpp requires ``pos`` to follow the last
        position the sequence holds. On an EngineError, the chunks already evaluated stay in the cache."""
        v = ids_view(ids)
        n = len(v)
        if n == 0:
            raise ValueError("decode: no ids")
        if pos < 0 or pos + n > self.n_ctx:
            raise ValueError(f"decode: positions [{pos}, {pos + n}) are outside the {self.n_ctx}-token window")
        with self.lock:
            for start in range(0, n, self.n_batch):
                end = min(start + self.n_batch, n)
                self._batch.fill(v[start:end], pos + start, seq_id, logits and end == n)
                rc = int(self._lib.llama_decode(self._handle, self._batch.raw))
                if rc != 0:
                    why = _DECODE_ERRORS.get(rc, "fatal error")
                    raise EngineError(f"llama.cpp could not evaluate tokens [{pos + start}, {pos + end}) of sequence "
                                      f"{seq_id}: {why} (llama_decode returned {rc})")
            if not logits:
                return None
            ptr = self._lib.llama_get_logits_ith(self._handle, -1)
            return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def decode_before(self, ids: Any, *, pos: int, seq_id: int, also: Sequence[int] = ()) -> None:
        """Evaluate ids at [pos, pos + n) of ``seq_id`` when the sequence already holds later positions (a moved
        tail): on the scratch sequence, which shares the cells of [0, pos), then handed over to ``seq_id`` and
        the sequences in ``also``. No logits."""
        v = ids_view(ids)
        s = self.scratch_seq_id
        with self.lock:
            self.clear(s)
            try:
                if pos > 0:
                    self.share(seq_id, s, 0, pos)
                self.decode(v, pos=pos, seq_id=s, logits=False)
                for dst in (seq_id, *also):
                    self.share(s, dst, pos, pos + len(v))
            finally:
                self.clear(s)

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """Drop the KV of positions [p0, p1) of ``seq_id`` (p1 < 0: to the end)."""
        with self.lock:
            if not self._lib.llama_memory_seq_rm(self._mem, seq_id, p0, p1):
                raise EngineError(f"llama.cpp cannot remove part of a sequence from this model's memory ({self.model.path.name} "
                                  "is recurrent or hybrid); ctxfold's KV plan needs a transformer KV cache")

    def clear(self, seq_id: int) -> None:
        """Drop every position of ``seq_id`` (cells another sequence shares stay)."""
        with self.lock:
            self._lib.llama_memory_seq_rm(self._mem, seq_id, -1, -1)

    def shift(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move the KV of positions [p0, p1) of ``seq_id`` by ``delta`` (keys are rotated at the next decode)."""
        if not self.can_shift:
            raise EngineError(f"the KV cache of {self.model.path.name} cannot shift positions (llama_memory_can_shift "
                              "is false); compact with shift=False")
        with self.lock:
            self._lib.llama_memory_seq_add(self._mem, seq_id, p0, p1, delta)

    def share(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Make the cells of positions [p0, p1) of ``src`` belong to ``dst`` too (no copy: the cache is unified)."""
        with self.lock:
            self._lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def positions(self, seq_id: int) -> tuple[int, int]:
        """(first, last) position ``seq_id`` holds; (-1, -1) when it holds none."""
        with self.lock:
            return (int(self._lib.llama_memory_seq_pos_min(self._mem, seq_id)),
                    int(self._lib.llama_memory_seq_pos_max(self._mem, seq_id)))


@dataclass(frozen=True, slots=True)
class SummaryDraft:
    """What :meth:`LlamaCppSequence.write_summary` got from the model."""

    ids: npt.NDArray[np.int32]  # int32[k]: the tokens written, without the stop token
    text: str  # their text, special tokens written out
    # "stop" (a stop or end-of-generation token), "length" (max_tokens), "room" (the window filled up),
    # "timeout", or "no_room" (the request itself does not fit after the sequence: nothing was written)
    finish: str
    bottom: int  # tokens of the sequence when the request was appended (BOTTOM)
    request_tokens: int  # tokens of the summary request
    seconds: float  # evaluating the request, writing and rolling back


@dataclass(frozen=True, slots=True)
class Compaction:
    """The result of :meth:`LlamaCppSequence.compact`."""

    rebuild: Rebuild  # the rebuilt ids, the tail kept and the KV plan (ctxfold.engine)
    shifted: bool  # True: the tail's KV was moved (approximate); False: the prefix alone was kept (exact)
    kept_tokens: int  # KV kept in place: the plan's prefix
    moved_tokens: int  # KV moved to new positions (llama_memory_seq_add), 0 without shifting
    prefilled_tokens: int  # tokens evaluated (llama_decode)
    seconds: float  # the KV edits and the evaluation, wall clock
    logits: npt.NDArray[np.float32]  # float32[n_vocab]: the next token's logits after the rebuilt ids

    @property
    def reused_tokens(self) -> int:
        """Tokens whose KV was not computed again."""
        return self.kept_tokens + self.moved_tokens


class LlamaCppSequence:
    """An :class:`~ctxfold.engine.EngineSequence` whose KV lives in sequence ``seq_id`` of a llama.cpp context.

    Invariant between calls: the cache holds exactly ``sequence.ids()``, token i at position i. The window
    is the context's ``n_ctx``; KV pages are single tokens. Thread-safe (the context's lock).
    """

    def __init__(self, context: LlamaCppContext, *, template: TokenTemplate, config: CompactConfig | None = None,
                 seq_id: int = 0, name: str | None = None) -> None:
        if not 0 <= seq_id < context.n_sequences:
            raise ValueError(f"seq_id {seq_id} is outside the context's sequences [0, {context.n_sequences})")
        self.context = context
        self.model = context.model
        self.seq_id = seq_id
        self.sequence = EngineSequence(name or f"llama-cpp-{seq_id}", context_tokens=context.n_ctx, config=config,
                                       template=template, page_size_tokens=1)
        self._logits: npt.NDArray[np.float32] | None = None
        self._pin = context.pin_id(seq_id)
        context.clear(seq_id)
        context.clear(self._pin)

    @property
    def num_tokens(self) -> int:
        return self.sequence.num_tokens

    @property
    def next_logits(self) -> npt.NDArray[np.float32] | None:
        """float32[n_vocab]: the next token's logits after the ids held (None before the first append)."""
        return self._logits

    def append(self, ids: Any, kind: SegmentKind | None = None) -> npt.NDArray[np.float32]:
        """Evaluate int32 ids after the ones held and append them (``kind`` starts a segment, as in
        :meth:`EngineSequence.append`); the next token's logits. ValueError when they do not fit the window
        (compact first: :meth:`EngineSequence.check` says HARD)."""
        v = ids_view(ids)
        with self.context.lock:
            n = self.sequence.num_tokens
            if len(v) == 0:
                raise ValueError("append: no ids")
            if kind is None and n == 0:
                raise ValueError("append: the first append must name its segment kind")
            if n + len(v) > self.context.n_ctx:
                raise ValueError(f"append: {len(v)} tokens do not fit after the {n} held in the {self.context.n_ctx}-token "
                                 "window; compact first")
            try:
                logits = self.context.decode(v, pos=n, seq_id=self.seq_id)
            except BaseException:
                self.context.remove(self.seq_id, n)  # what was evaluated of it leaves the cache again
                raise
            assert logits is not None
            self.context.share(self.seq_id, self._pin, n, n + len(v))
            self.sequence.append(v, kind)
            self._logits = logits
            return logits

    def write_summary(self, request_ids: Any, *, max_tokens: int, stop_ids: Iterable[int] = (),
                      timeout_s: float | None = None) -> SummaryDraft:
        """The model's answer to a summary request appended after the live KV, greedy, then rolled back.

        request_ids: int32[k], the request framed in the chat template (the contract as a user turn and the
        opening of the model's turn). Only the request is evaluated: the sequence's KV is reused as it is,
        and afterwards the cache holds the sequence again, unchanged (ds4 step 4). The answer stops at an
        end-of-generation token or one of ``stop_ids``, at ``max_tokens``, when the window is full, or after
        ``timeout_s``; an expected failure is a ``finish`` value, not an exception.
        """
        req = ids_view(request_ids, "request_ids")
        stop = frozenset(int(t) for t in stop_ids)
        with self.context.lock:
            bottom = self.sequence.num_tokens
            t0 = time.perf_counter()
            deadline = None if timeout_s is None else t0 + timeout_s
            if len(req) == 0 or bottom + len(req) >= self.context.n_ctx or max_tokens <= 0:
                return SummaryDraft(np.zeros(0, np.int32), "", "no_room", bottom, len(req), 0.0)
            out: list[int] = []
            finish = "length"
            try:
                logits = self.context.decode(req, pos=bottom, seq_id=self.seq_id)
                pos = bottom + len(req)
                while logits is not None:
                    tok = int(np.argmax(logits))
                    if tok in stop or self.model.is_eog(tok):
                        finish = "stop"
                        break
                    out.append(tok)
                    if len(out) >= max_tokens:
                        break
                    if pos >= self.context.n_ctx:
                        finish = "room"
                        break
                    if deadline is not None and time.perf_counter() > deadline:
                        finish = "timeout"
                        break
                    logits = self.context.decode(np.array([tok], np.int32), pos=pos, seq_id=self.seq_id)
                    pos += 1
            finally:
                # Roll back to BOTTOM: the request and its answer never enter the sequence.
                self.context.remove(self.seq_id, bottom)
            ids = np.array(out, dtype=np.int32)
            return SummaryDraft(ids, self.model.detokenize(ids, special=True), finish, bottom, len(req),
                                time.perf_counter() - t0)

    def compact(self, summary_ids: Any, *, bottom: int | None = None, tail: TokenTail | None = None,
                shift: bool | None = None, min_shift_tokens: int = 16) -> Compaction:
        """Rebuild (system prefix + summary + tail, see :meth:`EngineSequence.rebuild`) and execute the KV plan.

        summary_ids: int32[k], the summary framed in the chat template. bottom and tail: as for rebuild
        (default: the whole sequence, the default tail). shift: move the tail's KV instead of evaluating it
        again (approximate); None does so when the cache can shift (``llama_memory_can_shift``), False never;
        True where it cannot raises EngineError. min_shift_tokens: the shortest run worth moving (>= 4).
        """
        with self.context.lock:
            can = self.context.can_shift
            use_shift = can if shift is None else shift
            if use_shift and not can:
                raise EngineError(f"the KV cache of {self.model.path.name} cannot shift positions "
                                  "(llama_memory_can_shift is false); compact with shift=False")
            b = self.sequence.num_tokens if bottom is None else bottom
            rebuild = self.sequence.rebuild(summary_ids, bottom=b, tail=tail,
                                            min_shift_tokens=min_shift_tokens if use_shift else 0)
            t0 = time.perf_counter()
            try:
                logits, kept, moved, prefilled = self._execute(rebuild, use_shift)
            except BaseException:
                # The cache is in an unknown state: bring it back in line with the ids the sequence now holds.
                self._remove(0)
                self._logits = self.context.decode(rebuild.ids, pos=0, seq_id=self.seq_id)
                self.context.share(self.seq_id, self._pin, 0, -1)
                raise
            seconds = time.perf_counter() - t0
            self._logits = logits
            return Compaction(rebuild, use_shift and moved > 0, kept, moved, prefilled, seconds, logits)

    def _execute(self, rebuild: Rebuild, use_shift: bool) -> tuple[npt.NDArray[np.float32], int, int, int]:
        """The KV plan on the cache: (next-token logits, kept, moved, prefilled tokens)."""
        ctx, seq, ids, kv = self.context, self.seq_id, rebuild.ids, rebuild.kv
        new_n = len(ids)
        keep = kv.reuse_tokens
        spans = [(s.old_begin, s.new_begin, s.num_tokens) for s in kv.shifts] if use_shift else []
        if not spans:
            self._remove(keep)
            logits = ctx.decode(ids[keep:], pos=keep, seq_id=seq)
            assert logits is not None
            ctx.share(seq, self._pin, keep, new_n)
            self._check_positions(new_n)
            return logits, keep, 0, new_n - keep
        ranges = list(kv.prefill_ranges_with_shift)
        old, new, k = spans[-1]
        if new + k == new_n:  # the last token is evaluated all the same: it gives the next token's logits
            spans[-1] = (old, new, k - 1)
            ranges.append((new_n - 1, new_n))
        spans = [s for s in spans if s[2] > 0]
        # 1. Drop what the plan drops: every position after the kept prefix that no span moves.
        cursor = keep
        for old, _, k in spans:
            if old > cursor:
                self._remove(cursor, old)
            cursor = old + k
        self._remove(cursor)
        # 2. Move each span to its place, by way of positions past every real one, so that no span is moved
        #    onto one not yet moved (seq_add selects cells by their current position). The pin's cells are the
        #    same cells, so they move with them.
        stage = ctx.n_ctx + max(rebuild.tokens_before, new_n)
        moving = [(old, new, k) for old, new, k in spans if new != old]
        for old, _, k in moving:
            ctx.shift(seq, old, old + k, stage)
        for old, new, k in moving:
            ctx.shift(seq, old + stage, old + k + stage, new - old - stage)
        # 3. Evaluate the gaps. All but the last lie before a moved span, so they go through the scratch sequence.
        logits = None
        for begin, end in ranges:
            if end < new_n:
                ctx.decode_before(ids[begin:end], pos=begin, seq_id=seq, also=(self._pin,))
            else:
                logits = ctx.decode(ids[begin:end], pos=begin, seq_id=seq)
                ctx.share(seq, self._pin, begin, end)
        assert logits is not None
        self._check_positions(new_n)
        return logits, keep, sum(k for *_, k in spans), sum(e - b for b, e in ranges)

    def _remove(self, p0: int, p1: int = -1) -> None:
        """Drop positions [p0, p1) from the sequence and its pin."""
        self.context.remove(self.seq_id, p0, p1)
        self.context.remove(self._pin, p0, p1)

    def _check_positions(self, n: int) -> None:
        first, last = self.context.positions(self.seq_id)
        if (first, last) != (0, n - 1):
            raise EngineError(f"after the KV re-sync, sequence {self.seq_id} holds positions [{first}, {last}] instead "
                              f"of [0, {n - 1}]; the cache is re-filled from the rebuilt ids")
