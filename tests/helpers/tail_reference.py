"""Plain-Python references for the core's tail and KV-plan routines, written for clarity, not speed.

The property tests compare the C++ core against these on empty, single, at-the-limit and random
inputs. Segment flag values mirror cpp/include/ctxfold/core/ledger.hpp.
"""

from __future__ import annotations

from collections.abc import Sequence

SYSTEM = 1 << 0
USER = 1 << 1
USER_TURN = 1 << 2
ASSISTANT = 1 << 3
TOOL_CALL = 1 << 4
TOOL_RESULT = 1 << 5
THINKING = 1 << 6
QUEUED = 1 << 7
RESUME = 1 << 8
SUMMARY = 1 << 10

NONE, USER_RULE, ASSISTANT_RULE, GROUP_RULE = 0, 1, 2, 3
RAW_CUT, NO_TAIL = -1, -2


def system_floor(flags: Sequence[int], bottom: int) -> int:
    """One past the last system segment below bottom."""
    floor = 0
    for i in range(bottom):
        if flags[i] & SYSTEM:
            floor = i + 1
    return floor


def legal_starts(flags: Sequence[int], groups: Sequence[int], bottom: int) -> list[int]:
    """Segments a tail may start at: no orphaned result, no group split, above the system prefix."""
    out = []
    for i in range(system_floor(flags, bottom), bottom):
        if flags[i] & TOOL_RESULT:
            continue
        if any(groups[j] < i for j in range(i, bottom)):
            continue
        out.append(i)
    return out


def choose(
    tokens: Sequence[int], flags: Sequence[int], cands: list[int], bottom: int, min_fill: float
) -> tuple[int, int, int]:
    if not cands:
        return bottom, 0, NONE
    tail = {i: sum(tokens[i:bottom]) for i in cands}
    best = min(cands)
    want = min_fill * float(tail[best])
    users = [i for i in cands if flags[i] & USER_TURN]
    if users and float(tail[min(users)]) >= want:
        return min(users), tail[min(users)], USER_RULE
    assistants = [
        i for i in cands if not flags[i] & USER_TURN and flags[i] & (ASSISTANT | TOOL_CALL | THINKING)
    ]
    if assistants and float(tail[min(assistants)]) >= want:
        return min(assistants), tail[min(assistants)], ASSISTANT_RULE
    return best, tail[best], GROUP_RULE


def segment_tail(
    tokens: Sequence[int],
    flags: Sequence[int],
    groups: Sequence[int],
    bottom: int,
    budget: int,
    min_fill: float,
) -> tuple[int, int, int]:
    cands = [i for i in legal_starts(flags, groups, bottom) if sum(tokens[i:bottom]) <= budget]
    return choose(tokens, flags, cands, bottom, min_fill)


def segment_cut(
    tokens: Sequence[int],
    flags: Sequence[int],
    groups: Sequence[int],
    bottom: int,
    min_free: int,
    min_fill: float,
) -> tuple[bool, int, int, int]:
    floor = system_floor(flags, bottom)
    total = sum(tokens[floor:bottom])
    if total < min_free:
        return False, bottom, total, NONE
    start, kept, rule = segment_tail(tokens, flags, groups, bottom, total - min_free, min_fill)
    return True, start, total - kept, rule


def token_tail(
    ids: Sequence[int],
    bottom: int,
    floor: int,
    budget: int,
    boundary_ids: Sequence[int],
    cut_after: Sequence[bool],
    spans: Sequence[tuple[int, int]],
    min_fill: float,
) -> tuple[int, int, int]:
    def inside(c: int) -> bool:
        return any(b < c < e for b, e in spans)

    lowest = max(floor, bottom - budget)
    oldest: dict[int, int] = {}
    for c in range(lowest, bottom):
        if inside(c):
            continue
        for r, (tok, after) in enumerate(zip(boundary_ids, cut_after, strict=True)):
            hit = (c > 0 and ids[c - 1] == tok) if after else ids[c] == tok
            if hit and r not in oldest:
                oldest[r] = c
    if oldest:
        best = min(oldest.values())
        want = min_fill * float(bottom - best)
        for r in range(len(boundary_ids)):
            if r in oldest and float(bottom - oldest[r]) >= want:
                return oldest[r], bottom - oldest[r], r
    if lowest >= bottom:
        return bottom, 0, NO_TAIL
    raw = lowest
    for b, e in spans:
        if b < raw < e:
            raw = e
    raw = min(raw, bottom)
    if raw >= bottom:
        return bottom, 0, NO_TAIL
    return raw, bottom - raw, RAW_CUT


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def shifts(old: Sequence[int], new: Sequence[int], start: int, k: int) -> list[tuple[int, int, int]]:
    """Greedy verbatim runs: at each new position, the oldest old match after the previous run."""
    out = []
    min_old, q = start, start
    while q + k <= len(new):
        found = -1
        for p in range(min_old, len(old) - k + 1):
            if list(old[p : p + k]) == list(new[q : q + k]):
                found = p
                break
        if found < 0:
            q += 1
            continue
        n = k
        while found + n < len(old) and q + n < len(new) and old[found + n] == new[q + n]:
            n += 1
        out.append((found, q, n))
        min_old, q = found + n, q + n
    return out
