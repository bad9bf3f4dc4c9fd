"""The DeepSeek sample runs as conversations, with the tool definition their agent offered."""

from __future__ import annotations

from pathlib import Path

from ctxfold.chat import formats
from ctxfold.chat.formats.header import MINI_SWE_AGENT_BASH
from ctxfold.chat.messages import Conversation

__all__ = ["MINI_SWE_AGENT_BASH", "deepseek_runs"]


def deepseek_runs(traces_dir: Path) -> list[tuple[str, Conversation, bool]]:
    """(name, conversation with its tool, thinking mode) for each run, in a stable order."""
    runs = []
    for path in sorted((traces_dir / "deepseek_sample").glob("*/*.traj.json")):
        conv = formats.load(path)[0]
        # The trajectories do not record the bash tool mini-swe-agent sent; the importer fills it in.
        assert conv.tools == (MINI_SWE_AGENT_BASH,), path
        runs.append((f"{path.parent.name}/{path.name}", conv, "reasoner" in path.parent.name))
    return runs
