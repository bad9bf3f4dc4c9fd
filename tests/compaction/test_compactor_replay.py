"""The compactor over real traces, and killed mid-compaction.

Every conversation of every set in the traces, replayed at ctx 8k, 16k and 32k with the estimator
and the extractive summarizer: no request over the window, no orphaned tool result, and the
original restored byte for byte from the session. Then SIGKILL at random points of compactions:
the session resumes to a consistent view and nothing is lost.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from ctxfold.chat.formats import load
from ctxfold.chat.integrity import count_orphans
from ctxfold.chat.messages import Conversation
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session
from ctxfold.demo import demo_conversation
from ctxfold.replay import default_reply_reserve, feed_recorded, replay_conversation
from ctxfold.tokens.counting import load_counter
from helpers.subprocess_env import ctxfold_env


def all_conversations(traces_dir: Path) -> dict[str, list[Conversation]]:
    sets: dict[str, list[Conversation]] = {}
    for path in sorted(traces_dir.rglob("*")):
        if path.suffix in (".json", ".jsonl", ".traj") and path.is_file():
            sets.setdefault(path.relative_to(traces_dir).parts[0], []).extend(load(path))
    return sets


@pytest.mark.slow
@pytest.mark.parametrize("ctx", [8192, 16384, 32768])
def test_replay_every_trace(traces_dir: Path, ctx: int) -> None:
    counter = load_counter("estimate:deepseek-v4")
    rows = []
    for name, convs in all_conversations(traces_dir).items():
        kinds: Counter[str] = Counter()
        requests = overflows = orphans = inexact = 0
        for conv in convs:
            config = CompactConfig.preset("both", context_tokens=ctx,
                                          reply_reserve_tokens=default_reply_reserve(conv, counter.count, ctx))
            report = replay_conversation(conv, config=config, counter=counter)
            kinds.update(report.compactions)
            requests += len(report.requests)
            overflows += report.overflows
            orphans += report.orphans
            inexact += not report.restore_exact
        rows.append((name, len(convs), requests, dict(kinds), overflows, orphans, inexact))
        assert overflows == 0, f"{name} at ctx {ctx}: {overflows} requests over the window"
        assert orphans == 0, f"{name} at ctx {ctx}: {orphans} orphaned tool results"
        assert inexact == 0, f"{name} at ctx {ctx}: {inexact} conversations not restored byte for byte"
    print(f"\nctx {ctx}: set, conversations, requests, compactions, overflows, orphans, inexact restores")
    for row in rows:
        print("  ", *row)


CHILD = textwrap.dedent(
    """
    import sys, time
    from ctxfold.compaction.compactor import Compactor, NullObserver
    from ctxfold.compaction.config import CompactConfig
    from ctxfold.tokens.counting import load_counter
    from ctxfold.demo import demo_conversation
    from ctxfold.chat.messages import Conversation
    from ctxfold.replay import feed_recorded

    class Beacon(NullObserver):
        def compaction_started(self, reason, kind):
            print("compacting", flush=True)

    conv = demo_conversation()
    head = Conversation([], id=conv.id, system=conv.system, tools=conv.tools)
    config = CompactConfig.preset("both", context_tokens=8192, reply_reserve_tokens=512)
    c = Compactor(head, config=config, counter=load_counter("estimate:deepseek-v4"), session_dir=sys.argv[1],
                  durable=True, observer=Beacon())
    for m in conv.messages:
        feed_recorded(c, m)
    print("done", flush=True)
    """
)


def resume_and_finish(session_dir: Path, conv: Conversation) -> Compactor:
    config = CompactConfig.preset("both", context_tokens=8192, reply_reserve_tokens=512)
    head = Conversation([], id=conv.id, system=conv.system, tools=conv.tools)
    c = Compactor(head, config=config, counter=load_counter("estimate:deepseek-v4"), session_dir=session_dir,
                  durable=False)
    done = len(c.originals)
    assert [m.id for m in c.originals] == [m.id for m in conv.messages[:done]], "originals are a prefix"
    assert count_orphans(c.view) == 0, "the resumed view is whole"
    for m in conv.messages[done:]:
        feed_recorded(c, m)
    return c


@pytest.mark.slow
def test_kill_9_during_compactions_then_resume(tmp_path: Path) -> None:
    conv = demo_conversation()
    env = ctxfold_env()
    for trial, (compaction, delay_ms) in enumerate([(1, 0), (2, 1), (3, 3), (5, 0), (6, 2), (8, 5)]):
        root = tmp_path / f"s{trial}"
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        seen = 0
        while seen < compaction:
            line = proc.stdout.readline()
            if not line or line.startswith(b"done"):
                break
            seen += line.startswith(b"compacting")
        if delay_ms:
            os.sched_yield()
            import time

            time.sleep(delay_ms / 1000)
        proc.kill()
        proc.wait()
        proc.stdout.close()
        c = resume_and_finish(root, conv)
        c.close()
        assert count_orphans(c.view) == 0
        restored = Session(root).restore()
        assert restored.messages == conv.messages, f"trial {trial}: the full history survives"


@pytest.mark.parametrize(("tokenizer", "template"), [("estimate:deepseek-v4", "deepseek-v4"),
                                                     ("deepseek-v4", "deepseek-v3.2"), ("chars4", "chatml"),
                                                     ("estimate:mistral-v7", "mistral-v7")])
def test_the_occupancy_bound_holds_on_every_trace(traces_dir: Path, tokenizer: str, template: str) -> None:
    from ctxfold.tokens.templates import get_template

    counter = load_counter(tokenizer)
    checked = 0
    for convs in all_conversations(traces_dir).values():
        for conv in convs[:10]:
            c = Compactor(Conversation(messages=[], system=conv.system, tools=conv.tools), counter=counter,
                          template=get_template(template), config=CompactConfig(context_tokens=None))
            msgs = list(conv.messages)
            k = 0
            while k < len(msgs):
                batch = msgs[k:k + 1 + k % 3]  # one to three messages at a time, the answer left uncounted
                bound = c.occupancy_bound_tokens(batch)
                c.append(*batch)
                k += len(batch)
                if k % 2:  # else the next bound starts from messages nothing has counted yet
                    assert c.occupancy_tokens() <= bound, (conv.id, k)
                    checked += 1
    assert checked > 300
