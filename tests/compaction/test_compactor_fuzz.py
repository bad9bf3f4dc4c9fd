"""Random agent loops against the compactor's structural invariants.

Parallel tool calls, results of every size (some too big to fit), users who interject between a
call and its results, queued messages, empty messages, manual compactions at odd moments, and
resumes from the session directory at random points. After every step:

- no tool result without its call earlier in the view;
- no message written by a compaction (summary, resume instruction) between a call and its results;
- a compactor resumed from the session shows exactly the view the live one had.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall
from ctxfold.compaction import archive_pass
from ctxfold.compaction.archive import ArchiveParams, turn_start_cutoff
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.tokens.counting import load_counter

WORDS = ["alpha", "beta", "gamma", "delta", "file.py", "error", "1234", "def", "class", "return", "import", "path", "/usr/lib", "value"]


def problems(view: list[Message]) -> list[str]:
    found = []
    called: set[str] = set()
    for k, m in enumerate(view):
        called.update(c.id for c in m.tool_calls)
        if m.role is Role.TOOL and m.tool_call_id not in called:
            found.append(f"orphan result {m.id} at {k}")
        if m.tool_calls:
            waiting = {c.id for c in m.tool_calls}
            for later in view[k + 1:]:
                if not waiting:
                    break
                if later.role is Role.TOOL:
                    waiting.discard(later.tool_call_id or "")
                elif later.summary or later.resume:
                    found.append(f"{later.id} between call {m.id} and its results {sorted(waiting)}")
                    break
    return found


def signature(view: list[Message]) -> list[tuple[str, str, str]]:
    return [(m.role.value, m.id, m.text) for m in view]


# The fast tier draws ten loops of each kind; the slow tier the thirty after them.
SEEDS = [pytest.param(range(10), id="first"), pytest.param(range(10, 40), marks=pytest.mark.slow, id="more")]


@pytest.mark.parametrize("seeds", SEEDS)
@pytest.mark.parametrize("interjections", [0.0, 0.15])
def test_random_agent_loops_keep_the_view_whole(tmp_path: Path, interjections: float, seeds: range) -> None:
    counter = load_counter("estimate:deepseek-v4")
    config = CompactConfig.preset("both", context_tokens=8000, reply_reserve_tokens=1000)
    for seed in seeds:
        rng = random.Random(seed)

        def text(n: int) -> str:
            return " ".join(rng.choice(WORDS) + str(rng.randint(0, 999)) for _ in range(n))  # noqa: B023

        root = tmp_path / f"s{interjections}-{seed}"

        def fresh() -> Compactor:
            return Compactor(Conversation([], system="You are an agent."), config=config, counter=counter,
                             session_dir=root, durable=False)  # noqa: B023

        c = fresh()
        for n in range(60):
            op = rng.random()
            if op < 0.15:
                c.append(Message(Role.USER, "user " + text(rng.randint(0, 40)), id=f"u{n}"))
                c.before_request()
            elif op < 0.55:
                ids = [f"c{n}.{j}" for j in range(rng.choice([1, 1, 2, 3]))]
                c.append(Message(Role.ASSISTANT, text(rng.randint(0, 20)), id=f"a{n}",
                                 tool_calls=tuple(ToolCall(i, "bash", json.dumps({"cmd": "ls"})) for i in ids)))
                for j, cid in enumerate(ids):
                    if rng.random() < interjections:
                        c.append(Message(Role.USER, "wait, also check the logs", id=f"i{n}.{j}"))
                    size = rng.choice([5, 50, 300, 800, 3000])
                    c.append_tool_result(Message(Role.TOOL, text(size), id=f"t{n}.{j}", tool_call_id=cid, name="bash"))
                if rng.random() < 0.7:
                    queued = [Message(Role.USER, "queued " + text(5), id=f"q{n}")] if rng.random() < 0.1 else []
                    c.before_request(queued)
            elif op < 0.7:
                c.append(Message(Role.ASSISTANT, "answer " + text(rng.randint(0, 60)), id=f"a{n}"))
            elif op < 0.75:
                c.compact_now()
            elif op < 0.8:
                c.append(Message(Role.USER, "", id=f"e{n}"))
            else:
                c.before_request()
            assert problems(c.view) == [], f"seed {seed}, step {n}"
            # The index of user turns follows every append, rewrite and resume of the view.
            assert c.state.user_turns == [i for i, m in enumerate(c.view) if m.is_user_turn], f"seed {seed}, step {n}"
            extra = [Message(Role.USER, "next", id=f"x{n}")] * rng.randint(0, 2)
            for k in (0, 1, 2):
                c._archive_params = replace(c._archive_params, keep_recent_user_turns=k)
                assert archive_pass.turn_start_cutoff(c, extra) == turn_start_cutoff([*c.view, *extra], k), f"seed {seed}, step {n}"
            c._archive_params = ArchiveParams.from_config(config.minor)
            if rng.random() < 0.2:
                live = signature(c.view)
                c.close()
                c = fresh()
                assert signature(c.view) == live, f"seed {seed}, step {n}: the resumed view differs"
        c.close()
