"""Chat templates as data, and the rendering of a conversation into per-message segments.

A request is what the model really reads: BOS, the system prompt with the tool definitions, every
message framed by its role markers, tool calls and results in the model's own markup, thinking
markers, and the generation prompt. Counting only the message texts misses all of that; counting
the rendered request through the model's tokenizer is exact.

A rendered request is a list of :class:`Segment`: one for the system prompt and tools, one per
message, one for the generation prompt. A segment is a tuple of parts: ``str`` for text that goes
through the tokenizer, ``int`` for a control token id emitted as such (SentencePiece models cannot
parse control tokens out of text). Concatenating the segments' texts gives the whole prompt; the
sum of their counts is its count (see :func:`count_segments` for text that joins across segments).

Presets: ``deepseek-v3.2`` (DeepSeek V3.2's DSML encoding), ``deepseek-v3.2-api`` (the same as the
hosted DeepSeek API counts it: one token fewer after a user message that directly follows tool
results; reproduces its recorded prompt_tokens exactly), ``deepseek-v4`` (the V4 encoding: ``<tool_result>`` inside user
turns, ``tool_calls`` DSML blocks), ``chatml`` (Qwen3), ``mistral-v7`` (Mistral instruct v7 control tokens);
``gemma-3``, ``llama-3.1``, ``llama-3.2``: those models' own Jinja templates, kept as data
(:mod:`ctxfold.tokens.templates.sources`). :func:`ctxfold.tokens.templates.get_template` also loads any model's own
Jinja template (:mod:`ctxfold.tokens.templates.jinja`).
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec

Part = str | int  # text, or a control token id
Segment = tuple[Part, ...]


class Reasoning(StrEnum):
    """Which assistant messages keep their reasoning in the prompt."""

    AFTER_LAST_USER = "after_last_user"  # only the current turn's (DeepSeek V3.2, Qwen3)
    WITH_TOOLS = "with_tools"  # all when tools are defined, else the current turn's (DeepSeek V4)
    NEVER = "never"


class Arguments(StrEnum):
    """How tool-call arguments are written."""

    RAW = "raw"  # the recorded JSON string, verbatim
    JSON = "json"  # parsed and written again with json.dumps defaults (Mistral)
    DSML = "dsml"  # one DSML <parameter> per top-level key (DeepSeek)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """One model's prompt format. Text fields are ``str.format`` patterns.

    Control tokens are written in the patterns as ``{NAME}`` and listed in ``specials`` (name ->
    (text, id)): they become ``int`` parts, so they count as one token whatever the tokenizer.
    ``{think}`` is the thinking marker: ``think_open`` where the model is to think (thinking mode,
    at or after the last user turn, or always when reasoning is kept), else ``think_close``.
    """

    name: str
    specials: Mapping[str, tuple[str, int]]  # control token name -> (its text, its id)
    begin: str = ""  # prompt start (BOS)
    system: str = "{system}"  # {system}: system text; {tools}: the tools block ("" without tools)
    system_and_tools: str = ""  # replaces `system` when there are both a system text and tools
    tools: str = "{schemas}"  # the tools block; {schemas}: the tool schemas as JSON
    tool_schema_separator: str = "\n"  # between two schemas
    tools_with_last_user: bool = False  # the tools block goes before the last user message (Mistral v7)
    json_ascii: bool = False  # JSON written with non-ASCII escaped (\uXXXX) instead of as is
    openai_tool_shape: bool = False  # schemas as {"type": "function", "function": {...}} (Qwen3)
    user: str = "{content}"  # a user message
    assistant_open: str = ""  # before an assistant message that follows a user or tool message
    assistant: str = "{reasoning}{content}{tool_calls}"  # an assistant message
    reasoning: str = "{reasoning}"  # kept reasoning, inside {reasoning} of `assistant`
    strip_newlines_around_reasoning: bool = False  # kept reasoning stripped of \n, content of leading \n
    tool_calls: str = "{calls}"  # the calls of one message; {calls}: the calls joined
    tool_call: str = "{name}:{arguments}"  # one call; {id} is the call's id
    tool_call_separator: str = "\n"
    tool_calls_after_content: str = ""  # between content and the calls when there is content
    arguments: Arguments = Arguments.RAW
    dsml_parameter: str = '<{DSML}parameter name="{key}" string="{is_str}">{value}</{DSML}parameter>'
    results_open: str = ""  # before the first tool result of a run of results
    result: str = "{content}"  # one tool result; {id} is the id of the call it answers
    result_separator: str = ""  # between two results of one run
    results_close: str = ""  # after the last result of a run
    # Replaces results_close when a user message directly follows the run (None: no difference).
    results_close_before_user: str | None = None
    generation_prompt: str = ""  # the end of every request: where the model starts writing
    think_open: str = ""
    think_close: str = ""
    keep_reasoning: Reasoning = Reasoning.AFTER_LAST_USER
    description: str = ""  # what the preset reproduces and how it was checked

    def special_id(self, name: str) -> int:
        return self.specials[name][1]


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """Per-request switches of a template."""

    # Thinking mode (deepseek-reasoner, Qwen3 with thinking). None: on when any message of the
    # conversation carries reasoning, which is how a recorded reasoner trace shows itself.
    thinking: bool | None = None

    def resolved(self, messages: Sequence[Message]) -> RenderOptions:
        """These options with ``thinking`` decided for ``messages``."""
        if self.thinking is not None:
            return self
        return RenderOptions(thinking=any(m.reasoning for m in messages))


@dataclass(frozen=True, slots=True)
class RenderedRequest:
    """A rendered request: the prefix (system + tools), one segment per message, the tail."""

    prefix: Segment  # BOS, system prompt and tool definitions
    messages: tuple[Segment, ...]  # one per message, in order
    suffix: Segment  # the generation prompt
    specials: Mapping[int, str] = field(default_factory=dict)  # id -> text, to print a prompt

    def segments(self) -> tuple[Segment, ...]:
        return (self.prefix, *self.messages, self.suffix)

    def text(self) -> str:
        """The whole prompt as text (control tokens written as their text)."""
        return "".join(segment_text(s, self.specials) for s in self.segments())


def segment_text(segment: Segment, specials: Mapping[int, str]) -> str:
    return "".join(p if isinstance(p, str) else specials[p] for p in segment)


class _Formatter:
    """Formats a template pattern into parts: control tokens become ids, everything else text."""

    def __init__(self, template: ChatTemplate) -> None:
        self.t = template
        self.ids = {k: v[1] for k, v in template.specials.items()}
        self._cache: dict[str, list[tuple[str, str | None]]] = {}

    def parts(self, pattern: str, **values: Any) -> list[Part]:
        # Control-token fields are resolved from the pattern itself, never from substituted text,
        # so message content can not be taken for a control token.
        out: list[Part] = []
        for literal, name in self._parsed(pattern):
            if literal:
                out.append(literal)
            if name is None:
                continue
            if name in self.ids:
                out.append(self.ids[name])
                continue
            v = values[name]
            if isinstance(v, list):
                out.extend(v)
            else:
                out.append(str(v))
        return _merge([p for p in out if p != ""])

    def _parsed(self, pattern: str) -> list[tuple[str, str | None]]:
        # Parsed once per pattern: rendering is on the path of every request.
        hit = self._cache.get(pattern)
        if hit is None:
            hit = [(lit, name) for lit, name, _spec, _conv in string.Formatter().parse(pattern)]
            self._cache[pattern] = hit
        return hit


def _merge(parts: Sequence[Part]) -> list[Part]:
    out: list[Part] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] = out[-1] + p
        else:
            out.append(p)
    return out


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_default(value: Any) -> str:
    return json.dumps(value)


def tool_schema(tool: ToolSpec) -> dict[str, Any]:
    """The OpenAI function shape of a tool definition."""
    d: dict[str, Any] = {"name": tool.name}
    if tool.description:
        d["description"] = tool.description
    d["parameters"] = dict(tool.parameters)
    return d


class Renderer:
    """Renders conversations with one template. Stateless; share it."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self._f = _Formatter(template)
        self.specials = {v[1]: v[0] for v in template.specials.values()}

    # -- pieces -----------------------------------------------------------------------------

    def _think(self, opts: RenderOptions, keep: bool) -> list[Part]:
        t = self.template
        return self._f.parts(t.think_open if opts.thinking and keep else t.think_close)

    def keeps_all_reasoning(self, has_tools: bool) -> bool:
        k = self.template.keep_reasoning
        return k is Reasoning.WITH_TOOLS and has_tools

    def tools_block(self, tools: Sequence[ToolSpec]) -> list[Part]:
        t = self.template
        if not tools:
            return []
        shaped = [
            {"type": "function", "function": tool_schema(x)} if t.openai_tool_shape else tool_schema(x) for x in tools
        ]
        dump = _json_default if t.json_ascii else _json
        return self._f.parts(t.tools, schemas=t.tool_schema_separator.join(dump(x) for x in shaped))

    def prefix(self, system: str | None, tools: Sequence[ToolSpec]) -> Segment:
        t = self.template
        tools_block = [] if t.tools_with_last_user else self.tools_block(tools)
        if system is None and not tools_block:
            return tuple(self._f.parts(t.begin))
        pattern = t.system_and_tools if (system and tools_block and t.system_and_tools) else t.system
        return tuple(_merge(self._f.parts(t.begin) + self._f.parts(pattern, system=system or "", tools=tools_block)))

    def _arguments(self, call: ToolCall) -> list[Part]:
        t = self.template
        if t.arguments is Arguments.RAW:
            return [call.arguments]
        if t.arguments is Arguments.JSON:
            try:
                return [(_json_default if t.json_ascii else _json)(json.loads(call.arguments))]
            except ValueError:
                return [call.arguments]
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):
            args = {"arguments": call.arguments}  # not a JSON object: one raw parameter
        out: list[Part] = []
        for i, (k, v) in enumerate(args.items()):
            if i:
                out.append("\n")
            out += self._f.parts(
                t.dsml_parameter,
                key=str(k),
                is_str="true" if isinstance(v, str) else "false",
                value=v if isinstance(v, str) else _json(v),
            )
        return _merge(out)

    def _calls(self, calls: Sequence[ToolCall]) -> list[Part]:
        t = self.template
        rendered: list[Part] = []
        for i, c in enumerate(calls):
            if i:
                rendered.extend(self._f.parts(t.tool_call_separator))
            rendered.extend(self._f.parts(t.tool_call, name=c.name, arguments=self._arguments(c), id=c.id))
        return self._f.parts(t.tool_calls, calls=_merge(rendered))

    def message(
        self,
        messages: Sequence[Message],
        index: int,
        *,
        last_user: int,
        keep_all_reasoning: bool,
        opts: RenderOptions,
        tools: Sequence[ToolSpec] = (),
    ) -> Segment:
        """The segment of ``messages[index]``; depends on its neighbours' roles and ``last_user``
        (the index of the last user message, -1 when none)."""
        t = self.template
        m = messages[index]
        prev = messages[index - 1].role if index > 0 else None
        nxt = messages[index + 1].role if index + 1 < len(messages) else None
        at_turn = index >= last_user  # in the current user turn
        parts: list[Part] = []
        if m.role is Role.USER or m.role is Role.SYSTEM:
            # A system message inside the conversation is framed as a user message: the templates
            # here have no mid-conversation system role.
            if t.tools_with_last_user and index == last_user:
                parts += self.tools_block(tools)
            parts += self._f.parts(t.user, content=m.text, think=self._think(opts, keep_all_reasoning or at_turn))
        elif m.role is Role.TOOL:
            if prev is not Role.TOOL:
                parts += self._f.parts(t.results_open)
            else:
                parts += self._f.parts(t.result_separator)
            parts += self._f.parts(t.result, content=m.text, id=m.tool_call_id or "")
            if nxt is not Role.TOOL:
                close = t.results_close
                if nxt is Role.USER and t.results_close_before_user is not None:
                    close = t.results_close_before_user
                parts += self._f.parts(close, think=self._think(opts, keep_all_reasoning or at_turn))
        else:
            if prev in (Role.USER, Role.TOOL, Role.SYSTEM) or prev is None:
                parts += self._f.parts(t.assistant_open, think=self._think(opts, keep_all_reasoning or at_turn))
            # Templates with thinking markers write the reasoning block in thinking mode (even an
            # empty one); ChatML writes it whenever the message has reasoning.
            wanted = opts.thinking if t.think_open else bool(m.reasoning)
            keep = t.keep_reasoning is not Reasoning.NEVER and wanted and (keep_all_reasoning or index > last_user)
            reasoning: list[Part] = []
            content = m.text
            if keep:
                text = m.reasoning or ""
                if t.strip_newlines_around_reasoning:
                    text, content = text.strip("\n"), content.lstrip("\n")
                reasoning = self._f.parts(t.reasoning, reasoning=text)
            calls: list[Part] = []
            if m.tool_calls:
                calls = self._calls(m.tool_calls)
                if content:
                    calls = self._f.parts(t.tool_calls_after_content) + calls
            parts += self._f.parts(t.assistant, reasoning=reasoning, content=content, tool_calls=calls)
        return tuple(_merge(parts))

    def suffix(self, messages: Sequence[Message], *, last_user: int, keep_all_reasoning: bool,
               opts: RenderOptions) -> Segment:
        if not self.template.generation_prompt:
            return ()
        keep = keep_all_reasoning or len(messages) - 1 >= last_user
        return tuple(self._f.parts(self.template.generation_prompt, think=self._think(opts, keep)))

    def render(self, conversation: Conversation, opts: RenderOptions = RenderOptions()) -> RenderedRequest:
        """The whole request for ``conversation``, ending with the generation prompt."""
        msgs = conversation.messages
        opts = opts.resolved(msgs)
        last_user = last_user_index(msgs)
        keep_all = self.keeps_all_reasoning(bool(conversation.tools))
        segs = tuple(
            self.message(msgs, i, last_user=last_user, keep_all_reasoning=keep_all, opts=opts, tools=conversation.tools)
            for i in range(len(msgs))
        )
        return RenderedRequest(
            prefix=self.prefix(conversation.system, conversation.tools),
            messages=segs,
            suffix=self.suffix(msgs, last_user=last_user, keep_all_reasoning=keep_all, opts=opts),
            specials=self.specials,
        )


def last_user_index(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role is Role.USER:
            return i
    return -1


# --- presets --------------------------------------------------------------------------------------

_DS_SPECIALS = {
    "BOS": ("<｜begin▁of▁sentence｜>", 0),
    "EOS": ("<｜end▁of▁sentence｜>", 1),
    "USER": ("<｜User｜>", 128803),
    "ASSISTANT": ("<｜Assistant｜>", 128804),
    "THINK": ("<think>", 128821),
    "ENDTHINK": ("</think>", 128822),
    "DSML": ("｜DSML｜", 128825),
}

_DS32_TOOLS = (
    "## Tools\n\nYou have access to a set of tools you can use to answer the user's question.\n"
    'You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of '
    "your reply to the user:\n<{DSML}function_calls>\n"
    '<{DSML}invoke name="$FUNCTION_NAME">\n'
    '<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n</{DSML}invoke>\n"
    '<{DSML}invoke name="$FUNCTION_NAME2">\n...\n</{DSML}invoke>\n</{DSML}function_calls>\n\n'
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists "
    'and objects should use JSON format. The "string" attribute should be set to "true" for string type '
    'parameters and "false" for other types (numbers, booleans, arrays, objects).\n\n'
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting "
    "a thinking block. Here is an example:\n\n<{DSML}function_calls>\n...\n</{DSML}function_calls>\n\n"
    "<function_results>\n...\n</function_results>\n\n{THINK}...thinking about results{ENDTHINK}\n\n"
    "Here are the functions available in JSONSchema format:\n<functions>\n{schemas}\n</functions>\n"
)

DEEPSEEK_V32 = ChatTemplate(
    name="deepseek-v3.2",
    specials=_DS_SPECIALS,
    begin="{BOS}",
    system="{system}{tools}",
    tools="\n\n" + _DS32_TOOLS,
    user="{USER}{content}{ASSISTANT}{think}",
    assistant="{reasoning}{content}{tool_calls}{EOS}",
    reasoning="{reasoning}{ENDTHINK}",
    tool_calls="\n\n<{DSML}function_calls>\n{calls}\n</{DSML}function_calls>",
    tool_call='<{DSML}invoke name="{name}">\n{arguments}\n</{DSML}invoke>',
    arguments=Arguments.DSML,
    results_open="\n\n<function_results>",
    result="\n<result>{content}</result>",
    results_close="\n</function_results>\n\n{think}",
    think_open="{THINK}",
    think_close="{ENDTHINK}",
    keep_reasoning=Reasoning.AFTER_LAST_USER,
    description="DeepSeek V3.2's DSML encoding (encoding_dsv32.py): the hosted DeepSeek API's recorded "
    "prompt_tokens exactly, but for a user message that directly follows tool results (see deepseek-v3.2-api).",
)

# The hosted API (deepseek-chat, deepseek-reasoner) counts one token fewer than encoding_dsv32.py
# from a user message that directly follows tool results on (measured on public mini-swe-agent
# DeepSeek runs). Counts cannot tell which token it leaves out; this preset leaves out the thinking
# marker that closes the results, which the user turn's own marker makes redundant.
DEEPSEEK_V32_API = replace(
    DEEPSEEK_V32,
    name="deepseek-v3.2-api",
    results_close_before_user="\n</function_results>\n\n",
    description="DeepSeek's DSML template as the hosted DeepSeek API counts it (deepseek-chat, "
    "deepseek-reasoner): deepseek-v3.2, one token fewer after a user message that directly follows tool "
    "results.",
)

_DS4_TOOLS = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools "
    'by writing a "<{DSML}tool_calls>" block like the following:\n\n<{DSML}tool_calls>\n'
    '<{DSML}invoke name="$TOOL_NAME">\n'
    '<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n</{DSML}invoke>\n"
    '<{DSML}invoke name="$TOOL_NAME2">\n...\n</{DSML}invoke>\n</{DSML}tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
    "{THINK}...{ENDTHINK} BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after {ENDTHINK} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

DEEPSEEK_V4 = ChatTemplate(
    name="deepseek-v4",
    specials=_DS_SPECIALS,
    begin="{BOS}",
    system="{tools}{system}",  # the tools block comes before the client's system text
    tools="\n\n" + _DS4_TOOLS,
    user="{USER}{content}",
    assistant_open="{ASSISTANT}{think}",
    assistant="{reasoning}{content}{tool_calls}{EOS}",
    reasoning="{reasoning}{ENDTHINK}",
    tool_calls="\n\n<{DSML}tool_calls>\n{calls}\n</{DSML}tool_calls>",
    tool_call='<{DSML}invoke name="{name}">\n{arguments}\n</{DSML}invoke>',
    arguments=Arguments.DSML,
    results_open="{USER}",
    result="<tool_result>{content}</tool_result>",
    result_separator="\n\n",
    generation_prompt="{ASSISTANT}{think}",
    think_open="{THINK}",
    think_close="{ENDTHINK}",
    keep_reasoning=Reasoning.WITH_TOOLS,
    description="DeepSeek V4 encoding: tool results as <tool_result> inside one user turn, DSML "
    "tool_calls blocks, reasoning kept across turns when tools are defined.",
)

_CHATML_SPECIALS = {"IM_START": ("<|im_start|>", 151644), "IM_END": ("<|im_end|>", 151645)}

CHATML_QWEN3 = ChatTemplate(
    name="chatml",
    specials=_CHATML_SPECIALS,
    system="{IM_START}system\n{system}{tools}{IM_END}\n",
    system_and_tools="{IM_START}system\n{system}\n\n{tools}{IM_END}\n",
    openai_tool_shape=True,
    tools=(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}"
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
        "<args-json-object>}}\n</tool_call>"
    ),
    user="{IM_START}user\n{content}{IM_END}\n",
    assistant="{IM_START}assistant\n{reasoning}{content}{tool_calls}{IM_END}\n",
    reasoning="<think>\n{reasoning}\n</think>\n\n",
    strip_newlines_around_reasoning=True,
    tool_calls="{calls}",
    tool_call='<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>',
    tool_calls_after_content="\n",
    results_open="{IM_START}user",
    result="\n<tool_response>\n{content}\n</tool_response>",
    results_close="{IM_END}\n",
    generation_prompt="{IM_START}assistant\n",
    keep_reasoning=Reasoning.AFTER_LAST_USER,
    description="ChatML as Qwen3's chat template renders it (tools in the system turn, <tool_call> "
    "JSON, <tool_response> in user turns).",
)

_MISTRAL_SPECIALS = {
    "BOS": ("<s>", 1),
    "EOS": ("</s>", 2),
    "INST": ("[INST]", 3),
    "END_INST": ("[/INST]", 4),
    "TOOL_CALLS": ("[TOOL_CALLS]", 5),
    "AVAILABLE_TOOLS": ("[AVAILABLE_TOOLS]", 6),
    "END_AVAILABLE_TOOLS": ("[/AVAILABLE_TOOLS]", 7),
    "TOOL_RESULTS": ("[TOOL_RESULTS]", 8),
    "END_TOOL_RESULTS": ("[/TOOL_RESULTS]", 9),
    "SYSTEM_PROMPT": ("[SYSTEM_PROMPT]", 16),
    "END_SYSTEM_PROMPT": ("[/SYSTEM_PROMPT]", 17),
    "TOOL_CONTENT": ("[TOOL_CONTENT]", 18),
}

MISTRAL_V7 = ChatTemplate(
    name="mistral-v7",
    specials=_MISTRAL_SPECIALS,
    begin="{BOS}",
    system="{SYSTEM_PROMPT}{system}{END_SYSTEM_PROMPT}",
    tools="{AVAILABLE_TOOLS}[{schemas}]{END_AVAILABLE_TOOLS}",
    tool_schema_separator=", ",
    tools_with_last_user=True,
    openai_tool_shape=True,
    user="{INST}{content}{END_INST}",
    assistant="{content}{tool_calls}{EOS}",
    tool_calls="{TOOL_CALLS}[{calls}]",
    tool_call='{{"name": "{name}", "arguments": {arguments}, "id": "{id}"}}',
    tool_call_separator=", ",
    arguments=Arguments.JSON,
    result="{TOOL_RESULTS}{id}{TOOL_CONTENT}{content}{END_TOOL_RESULTS}",
    keep_reasoning=Reasoning.NEVER,
    description="Mistral instruct v7 (SentencePiece, mistral_instruct_tokenizer_241114.model.v7): "
    "[SYSTEM_PROMPT], [AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS] JSON with ids, "
    "[TOOL_RESULTS] id [TOOL_CONTENT] content; each text run encoded on its own, as mistral-common does.",
)

PRESETS: dict[str, ChatTemplate] = {
    t.name: t for t in (DEEPSEEK_V32, DEEPSEEK_V32_API, DEEPSEEK_V4, CHATML_QWEN3, MISTRAL_V7)
}
PRESETS["qwen3"] = CHATML_QWEN3
PRESETS["mistral"] = MISTRAL_V7
