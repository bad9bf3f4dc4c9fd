"""The DeepSeek sample runs as conversations, with the tool definition their agent offered."""

from __future__ import annotations

from pathlib import Path

from ctxfold import formats
from ctxfold.messages import Conversation, ToolSpec

# The one tool mini-swe-agent (tool-call mode) offers the model; the trajectories do not record it.
MINI_SWE_AGENT_BASH = ToolSpec(
    name="bash",
    description="Execute a bash command",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
        "required": ["command"],
    },
)


def deepseek_runs(traces_dir: Path) -> list[tuple[str, Conversation, bool]]:
    """(name, conversation with its tool, thinking mode) for each run, in a stable order."""
    runs = []
    for path in sorted((traces_dir / "deepseek_sample").glob("*/*.traj.json")):
        conv = formats.load(path)[0]
        conv.tools = (MINI_SWE_AGENT_BASH,)
        runs.append((f"{path.parent.name}/{path.name}", conv, "reasoner" in path.parent.name))
    return runs
