"""OpenHands event streams: a JSON list of events, or JSONL of runs each with a ``history``.

An action with ``tool_call_metadata`` is an assistant tool call (the call itself is taken from
the recorded model response, so the arguments are what the model wrote); the observation with
the same ``tool_call_id`` is its result. Actions of one model response (same response id) form
one assistant message. Events without tool metadata (older runs, plain chat) become plain user
or assistant messages, as OpenHands rendered them. Bookkeeping events (agent state changes,
null observations, recall) are not conversation and are counted in ``meta["ignored_records"]``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from typing import Any

from ctxfold.chat.formats._common import (
    Document,
    Reader,
    expect_dict,
    expect_list,
    iter_records,
    openai_usage,
)
from ctxfold.chat.formats.openai import tool_spec
from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.errors import FormatError

NAME = "openhands"
_IGNORED_ACTIONS = frozenset({"change_agent_state", "recall", "null"})
_IGNORED_OBSERVATIONS = frozenset({"agent_state_changed", "null", "recall"})


def looks_like_event(v: Any) -> bool:
    return isinstance(v, dict) and ("action" in v or "observation" in v)


def _call(e: dict[str, Any], tcm: dict[str, Any]) -> tuple[ToolCall, str, Any, Any]:
    """The tool call, the assistant text, the usage and the response id of an action event."""
    cid = tcm.get("tool_call_id")
    if not isinstance(cid, str):
        raise FormatError("'tool_call_metadata.tool_call_id' is missing or not a string; expected the call id")
    name = str(tcm.get("function_name") or e.get("action"))
    raw_resp = tcm.get("model_response")
    resp: dict[str, Any] = raw_resp if isinstance(raw_resp, dict) else {}
    text = ""
    arguments = None
    raw_choices = resp.get("choices")
    choices: list[Any] = raw_choices if isinstance(raw_choices, list) else []
    msg = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    if isinstance(msg, dict):
        content = msg.get("content")
        text = content if isinstance(content, str) else ""
        for c in msg.get("tool_calls") or []:
            if isinstance(c, dict) and c.get("id") == cid and isinstance(c.get("function"), dict):
                arguments = c["function"].get("arguments")
    raw_args = e.get("args")
    args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
    if not text and isinstance(args.get("thought"), str):
        text = args["thought"]
    if not isinstance(arguments, str):
        arguments = json.dumps({k: v for k, v in args.items() if k != "thought"}, ensure_ascii=False)
    return ToolCall(id=cid, name=name, arguments=arguments), text, openai_usage(resp.get("usage")), resp.get("id")


def _plain_text(e: dict[str, Any]) -> str:
    raw_args = e.get("args")
    args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else e
    if e.get("action") == "message":
        for k in ("content", "message"):
            if isinstance(args.get(k), str):
                return str(args[k])
        return str(e.get("message") or "")
    if "observation" in e:
        return str(e.get("content") if e.get("content") is not None else e.get("message") or "")
    # An action outside function calling: the thought, then what it ran.
    body = [args.get("thought"), args.get("command"), args.get("code")]
    return "\n".join(str(x) for x in body if isinstance(x, str) and x) or str(e.get("message") or "")


class _Stream:
    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.messages: list[Message] = []
        self.system: str | None = None
        self.tools: tuple[ToolSpec, ...] = ()
        self.last_assistant = -1
        self.last_response: Any = None

    def add(self, raw: Any, k: int) -> None:
        e = expect_dict(raw, "event")
        action, obs = e.get("action"), e.get("observation")
        if action is None and obs is None:
            raise FormatError("event has neither 'action' nor 'observation'; expected an OpenHands event")
        if action in _IGNORED_ACTIONS or obs in _IGNORED_OBSERVATIONS:
            self.reader.ignored[f"{'action' if action else 'observation'}:{action or obs}"] += 1
            return
        eid = e.get("id")
        mid = f"e{eid}" if isinstance(eid, int) else (eid if isinstance(eid, str) and eid else f"e@{k}")
        kept = {"action": action} if action else {"observation": obs}
        if isinstance(e.get("timestamp"), str):
            kept["timestamp"] = e["timestamp"]
        if action == "system":
            args = expect_dict(e.get("args"), "system action 'args'")
            self.system = str(args.get("content") or e.get("message") or "")
            tools = args.get("tools") or []
            self.tools = tuple(tool_spec(t, i) for i, t in enumerate(expect_list(tools, "'args.tools'")))
            return
        tcm = e.get("tool_call_metadata")
        if tcm is not None and not isinstance(tcm, dict):
            raise FormatError("'tool_call_metadata' is not an object; expected {function_name, tool_call_id, ...}")
        if action is not None and tcm:
            call, text, usage, rid = _call(e, tcm)
            if self._mergeable(rid):
                prev = self.messages[self.last_assistant]
                self.messages[self.last_assistant] = replace(prev, tool_calls=prev.tool_calls + (call,))
                return
            self.messages.append(Message(role=Role.ASSISTANT, content=text, id=mid, tool_calls=(call,),
                                         usage=usage, extra={"openhands": {**kept, "response_id": rid}}))
            self.last_assistant, self.last_response = len(self.messages) - 1, rid
            return
        if obs is not None and tcm:
            cid = tcm.get("tool_call_id")
            if not isinstance(cid, str):
                raise FormatError("'tool_call_metadata.tool_call_id' is missing or not a string")
            content = e.get("content")
            self.messages.append(Message(role=Role.TOOL, content=content if isinstance(content, str) else "",
                                         id=mid, tool_call_id=cid, name=tcm.get("function_name"),
                                         is_error=obs == "error", extra={"openhands": kept}))
            return
        source = e.get("source")
        if source is None:  # older runs: the first message is the user's task, the rest are the agent's
            is_user = action == "message" and not any(m.role is Role.ASSISTANT for m in self.messages)
            role = Role.USER if is_user or obs is not None else Role.ASSISTANT
        else:
            role = Role.ASSISTANT if source == "agent" and action is not None else Role.USER
        self.messages.append(Message(role=role, content=_plain_text(e), id=mid, extra={"openhands": kept}))
        self.last_assistant = -1

    def _mergeable(self, rid: Any) -> bool:
        if self.last_assistant < 0 or not rid or rid != self.last_response:
            return False
        calls = {c.id for c in self.messages[self.last_assistant].tool_calls}
        return all(m.role is Role.TOOL and m.tool_call_id in calls
                   for m in self.messages[self.last_assistant + 1:])


def _conversation(events: list[Any], reader: Reader, where: str, conv_id: str,
                  meta: dict[str, Any]) -> Conversation:
    s = _Stream(reader)
    prefix = f"{where}, " if where else ""
    for k, raw in enumerate(events):
        reader.guard(f"{prefix}event {k}", partial(s.add, raw, k))
    return Conversation(messages=s.messages, id=conv_id, system=s.system, tools=s.tools, source_format=NAME,
                        source=reader.source, meta={"openhands": meta} if meta else {})


def load_document(doc: Document, reader: Reader, conv_id: str) -> list[Conversation]:
    # A JSON list is one event stream unless its items are runs (objects with a history).
    if not doc.is_jsonl and isinstance(doc.value, list) and not any(
            isinstance(v, dict) and "history" in v for v in doc.value[:50]):
        return [_conversation(doc.value, reader, "", conv_id, {})]
    out: list[Conversation] = []
    for where, rec in iter_records(doc):
        def one(rec: Any = rec, where: str = where) -> Conversation:
            run = expect_dict(rec, "run")
            history = expect_list(run.get("history"), "'history'")
            meta = {k: v for k, v in run.items() if k != "history"}
            cid = run.get("instance_id") if isinstance(run.get("instance_id"), str) else f"{conv_id}:{where}"
            return _conversation(history, reader, where, str(cid), meta)

        conv = reader.guard(where, one)
        if conv is not None:
            out.append(conv)
    return out
