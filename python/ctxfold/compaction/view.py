"""What a compactor holds of its conversation: the originals as they came, the view the model is shown,
which original each view entry shows, the user turns in the view, the first message the model has not
seen yet and the turn in progress. Pure state and its rules: no counting, no I/O.

Messages are found again in the view by identity: a rewrite that moves the turn's request or the first
unseen message keeps them, and one that summarizes them away makes them absent (index -1 or none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ctxfold.chat.messages import Message, Role

# Template tokens around one message, at most (role markers, thinking markers, a tool result's frame).
FRAME_TOKENS = 32
# Appending can re-render the messages of the previous user turn (thinking markers move with the last
# user message): what that can add, at most.
RERENDER_FRAME_TOKENS = 64


@dataclass(slots=True)
class TurnState:
    number: int = 0  # real user turns seen
    failures: int = 0  # consecutive failed compactions in this turn
    gave_up: bool = False  # automatic passes stopped for the rest of this turn
    request: Message | None = None  # the user message that started this turn (found in the view by identity)


@dataclass(slots=True)
class ViewState:
    """The view and its bookkeeping. ``origins[i]`` is the index in ``originals`` of what ``view[i]``
    shows (as it came, or as a stand-in such as an archive marker), -1 for a message ctxfold wrote."""

    originals: list[Message] = field(default_factory=list)
    view: list[Message] = field(default_factory=list)
    origins: list[int] = field(default_factory=list)
    user_turns: list[int] = field(default_factory=list)  # view indexes of the real user turns
    # The first message the model has not seen yet (appended since the last request), None when it saw all.
    first_unseen: Message | None = None
    turn: TurnState = field(default_factory=TurnState)

    @classmethod
    def resumed(cls, originals: list[Message], view: list[Message], origins: list[int]) -> ViewState:
        state = cls(originals, view, origins, user_turn_indexes(view))
        for m in view:  # a resumed session: the same rule over the whole view
            state.track_unseen(m)
        return state

    def add(self, originals: Sequence[Message], shown: Sequence[Message]) -> None:
        """``originals`` arrive; the view shows ``shown`` for them (the same, or stand-ins)."""
        first = len(self.originals)
        self.originals.extend(originals)
        for k, m in enumerate(shown):
            self.view.append(m)
            self.origins.append(first + k)
            if m.is_user_turn:
                self.turn.request = m
                self.user_turns.append(len(self.view) - 1)
            self.track_unseen(m)

    def replace(self, view: list[Message], origins: list[int]) -> None:
        """A rewrite: the new view and what each entry shows."""
        self.view = view
        self.origins = origins
        self.user_turns = user_turn_indexes(view)

    def unseen_start(self) -> int:
        """View index of the first message the model has not seen yet (len(view) when none)."""
        first = self.first_unseen
        if first is not None:
            for i in range(len(self.view) - 1, -1, -1):
                if self.view[i] is first:
                    return i
        return len(self.view)

    def track_unseen(self, m: Message) -> None:
        """The model has seen everything up to its own latest answer; what follows it is new."""
        if m.role is Role.ASSISTANT:
            self.first_unseen = None
        elif self.first_unseen is None:
            self.first_unseen = m

    def keep_unseen_position(self, unseen: int) -> None:
        """After a rewrite that keeps positions (an archive pass): the first unseen message is the one at
        ``unseen`` still, though it may be a marker now."""
        if unseen < len(self.view):
            self.first_unseen = self.view[unseen]

    def mark_unseen(self, first_original: int) -> None:
        """The view from the message of original ``first_original`` on counts as new again."""
        for i, origin in enumerate(self.origins):
            if origin >= first_original:
                self.first_unseen = self.view[i]
                return

    def seen_originals(self) -> int:
        """How many leading originals the model has seen: the first unseen message's original (the first
        one shown after it when ctxfold wrote it), every original when it saw all."""
        for origin in self.origins[self.unseen_start():]:
            if origin >= 0:
                return origin
        return len(self.originals)

    def mark_seen(self, num_originals: int) -> None:
        """The model has seen the first ``num_originals`` originals and none after them."""
        self.first_unseen = None  # stays so where the view shows no original from there on
        self.mark_unseen(num_originals)

    def at_turn_start(self) -> bool:
        return any(m.is_user_turn for m in self.view[self.unseen_start():])

    def new_turn(self) -> None:
        self.turn.number += 1
        self.turn.failures = 0
        self.turn.gave_up = False

    def request_index(self) -> int:
        """View index of this turn's request, -1 when it is not in the view (summarized away)."""
        request = self.turn.request
        if request is not None:
            for i in range(len(self.view) - 1, -1, -1):
                if self.view[i] is request:
                    return i
        return -1


def user_turn_indexes(view: Sequence[Message]) -> list[int]:
    return [i for i, m in enumerate(view) if m.is_user_turn]


def tokens_bound(m: Message) -> int:
    """An upper bound of a message's tokens: its UTF-8 bytes plus the template's frame."""
    n = utf8_len(m.text) + utf8_len(m.reasoning or "")
    n += sum(utf8_len(c.name) + utf8_len(c.arguments) + 16 for c in m.tool_calls)
    return n + FRAME_TOKENS


def utf8_len(text: str) -> int:
    # isascii() is O(1) on CPython's compact strings: most texts need no encoding to be measured.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
