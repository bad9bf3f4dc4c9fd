"""What a request carries besides its messages: the system prompt and the tool definitions.

Many traces do not record them (mini-swe-agent trajectories leave out the tool definitions, Claude
Code transcripts leave out both), yet a model request's token count includes them. Two ways to
supply what a trace lacks:

- known defaults: where a trace names its agent and version, and that agent sends a fixed header,
  the importer fills it in (:func:`fill_known_defaults`) and says so in ``meta[FILLED_IN]``;
- files: :func:`read_tools` and :func:`read_system` read a user's own definitions, and
  :func:`apply_header` puts them on a conversation; an explicit file wins over what the trace
  records, and over a filled-in default.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxfold.chat.formats import anthropic, openai
from ctxfold.chat.formats._common import type_name
from ctxfold.chat.messages import Conversation, Role, ToolSpec
from ctxfold.errors import FormatError

# Conversation.meta key: {"tools": why, "system": why} for each part of the header an importer
# filled in from the agent's known defaults, "why" being a phrase a report can print as it is.
FILLED_IN = "filled_in"
# Conversation.meta key: {"tools": path, "system": path} for each part taken from a file the user gave.
SUPPLIED = "supplied"

# The one tool mini-swe-agent 2.x offers the model in tool-call mode (BASH_TOOL in
# minisweagent/models/utils/actions_toolcall.py, the same in the 2.0.0, 2.2.7 and 2.4.6 wheels); its trajectories
# do not record it. Rendered by DeepSeek's DSML template it is the 300 tokens by which every
# recorded prompt of a mini-swe-agent DeepSeek run exceeds a count without it.
MINI_SWE_AGENT_BASH = ToolSpec(
    name="bash",
    description="Execute a bash command",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
        "required": ["command"],
    },
)


def _major_version(value: Any) -> int | None:
    m = re.match(r"\s*v?(\d+)\.", value) if isinstance(value, str) else None
    return int(m.group(1)) if m else None


def fill_known_defaults(conv: Conversation) -> Conversation:
    """``conv`` with the header its agent is known to send filled in where the trace lacks it.

    mini-swe-agent: from version 2 its tool-call models (every model class but the ``textbased``
    ones) send the ``bash`` tool with each request. Filled in when the trajectory lacks tool
    definitions, its messages call ``bash`` through the tool-call API (which needs the definition),
    and the version and model class it records, if any, agree.
    """
    if conv.source_format != "mini_swe_agent" or conv.tools:
        return conv
    if not any(c.name == "bash" for m in conv.messages if m.role is Role.ASSISTANT for c in m.tool_calls):
        return conv
    info = conv.meta.get("mini_swe_agent", {}).get("info")
    info = info if isinstance(info, dict) else {}
    version = info.get("mini_version")
    major = _major_version(version)
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if (major is not None and major < 2) or (isinstance(model_type, str) and "textbased" in model_type):
        return conv
    conv.tools = (MINI_SWE_AGENT_BASH,)
    agent = f"mini-swe-agent {version}" if isinstance(version, str) else "mini-swe-agent 2"
    conv.meta.setdefault(FILLED_IN, {})["tools"] = (f"the bash tool {agent} sends with every request "
                                                    "(the trajectory does not record it)")
    return conv


# -- files the user gives ------------------------------------------------------------------------------

_TOOLS_SHAPES = ("expected a JSON list of tool definitions, or an object with a 'tools' list, in OpenAI "
                 "({\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}) or Anthropic "
                 "({\"name\", \"input_schema\"}) shape")


def tools_from_value(value: Any) -> tuple[ToolSpec, ...]:
    """Tool definitions from a parsed JSON value: a list, or an object with a ``tools`` list; each
    item in OpenAI shape (nested ``function``, or flat as in the Responses API) or Anthropic shape
    (``input_schema``). Raises FormatError naming the item and what is wrong."""
    if isinstance(value, dict):
        if "tools" not in value:
            raise FormatError(f"an object without a 'tools' key; {_TOOLS_SHAPES}")
        value = value["tools"]
        where = "'tools'"
    else:
        where = "document"
    if not isinstance(value, list):
        raise FormatError(f"{where} is a JSON {type_name(value)}; {_TOOLS_SHAPES}")
    out: list[ToolSpec] = []
    for k, item in enumerate(value):
        if isinstance(item, dict) and "input_schema" in item:
            spec = anthropic.tool_spec(item, k)
        else:
            spec = openai.tool_spec(item, k)
        if not spec.name:
            raise FormatError(f"'tools'[{k}] has an empty name")
        out.append(spec)
    names = [t.name for t in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise FormatError(f"tool {dup!r} is defined twice")
    return tuple(out)


def _read_text(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.exists():
        raise FormatError(f"no such file; expected {what}", source=str(path))
    if p.is_dir():
        raise FormatError(f"is a directory; expected {what}", source=str(path))
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise FormatError(f"cannot read the file: {exc.strerror}", source=str(path)) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FormatError(f"not UTF-8 text (byte {exc.start}); expected {what}", source=str(path)) from None


def read_tools(path: str | Path) -> tuple[ToolSpec, ...]:
    """Tool definitions from a JSON file (see :func:`tools_from_value`). An empty list is allowed:
    it says the model was offered no tools."""
    text = _read_text(path, "a JSON file of tool definitions")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); {_TOOLS_SHAPES}",
                          source=str(path)) from None
    try:
        return tools_from_value(value)
    except FormatError as exc:
        raise FormatError(exc.reason, source=str(path)) from None


def read_system(path: str | Path) -> str:
    """A system prompt from a text file, as it is but for one final newline (which editors add and
    a prompt rarely ends with). An empty file is an error: it is more likely a mistake than a prompt."""
    text = _read_text(path, "a text file holding the system prompt")
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    if not text.strip():
        raise FormatError("is empty; expected the system prompt as text", source=str(path))
    return text


@dataclass(frozen=True, slots=True)
class HeaderFiles:
    """A system prompt and tool definitions read from files, each None where no file was given."""

    system: str | None = None
    system_path: str | None = None
    tools: tuple[ToolSpec, ...] | None = None
    tools_path: str | None = None

    @classmethod
    def read(cls, system_path: str | None, tools_path: str | None) -> HeaderFiles:
        return cls(system=None if system_path is None else read_system(system_path), system_path=system_path,
                   tools=None if tools_path is None else read_tools(tools_path), tools_path=tools_path)

    def __bool__(self) -> bool:
        return self.system is not None or self.tools is not None


def apply_header(conv: Conversation, files: HeaderFiles) -> list[str]:
    """Puts the files' system prompt and tools on ``conv`` (the files win); returns what they
    replaced that the trace itself recorded ("system prompt", "tool definitions")."""
    replaced: list[str] = []
    filled = conv.meta.get(FILLED_IN, {})
    if files.system is not None:
        if conv.system is not None and "system" not in filled:
            replaced.append("system prompt")
        conv.system = files.system
        filled.pop("system", None)
        conv.meta.setdefault(SUPPLIED, {})["system"] = files.system_path
    if files.tools is not None:
        if conv.tools and "tools" not in filled:
            replaced.append("tool definitions")
        conv.tools = files.tools
        filled.pop("tools", None)
        conv.meta.setdefault(SUPPLIED, {})["tools"] = files.tools_path
    if FILLED_IN in conv.meta and not filled:
        del conv.meta[FILLED_IN]
    return replaced
