"""Agent trajectories whose messages are OpenAI chat: tau-bench, mini-swe-agent, SWE-agent.

Each keeps its run-level fields (reward, info, environment) in ``Conversation.meta`` and lets the
OpenAI converter read the messages. Their raw data does not always pair every result with a call,
so pairing is checked by :func:`ctxfold.chat.integrity.validate`, not enforced here.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from ctxfold.chat.formats._common import Reader, expect_dict, expect_list
from ctxfold.chat.formats.header import fill_known_defaults
from ctxfold.chat.formats.openai import conversation_from_messages, message_from_openai
from ctxfold.chat.messages import Conversation, Message
from ctxfold.errors import FormatError

TAU_BENCH = "tau_bench"
MINI_SWE_AGENT = "mini_swe_agent"
SWE_AGENT = "swe_agent"


def load_tau_bench(value: Any, reader: Reader, conv_id: str) -> list[Conversation]:
    """A JSON list of ``{task_id, trial, reward, info, traj[]}``: one conversation per item."""
    out: list[Conversation] = []
    for i, raw in enumerate(expect_list(value, "document")):
        def one(raw: Any = raw, i: int = i) -> Conversation:
            run = expect_dict(raw, "trajectory")
            traj = expect_list(run.get("traj"), "'traj'")
            meta = {k: v for k, v in run.items() if k != "traj"}
            cid = f"{conv_id}:task{run.get('task_id')}-trial{run.get('trial')}"
            return conversation_from_messages(traj, reader, where=f"index {i}", conv_id=cid,
                                              source_format=TAU_BENCH, require_pairing=False,
                                              meta={"tau_bench": meta})

        conv = reader.guard(f"index {i}", one)
        if conv is not None:
            out.append(conv)
    return out


def load_mini_swe_agent(value: Any, reader: Reader, conv_id: str) -> list[Conversation]:
    """``{info, messages[], trajectory_format, instance_id}``; the final ``exit`` message goes to meta.
    The ``bash`` tool definition mini-swe-agent 2 sends is filled in (see :func:`fill_known_defaults`)."""
    d = expect_dict(value, "document")
    items = expect_list(d.get("messages"), "'messages'")
    # "exit" is mini-swe-agent's record of how the run ended (status, submitted patch): never sent
    # to the model, so it is not a message.
    exits = [m for m in items if isinstance(m, dict) and m.get("role") == "exit"]
    msgs = [m for m in items if not (isinstance(m, dict) and m.get("role") == "exit")]
    meta: dict[str, Any] = {k: v for k, v in d.items() if k != "messages"}
    if exits:
        meta["exit"] = exits[-1]
    cid = d["instance_id"] if isinstance(d.get("instance_id"), str) else conv_id
    conv = conversation_from_messages(msgs, reader, where="", conv_id=cid, source_format=MINI_SWE_AGENT,
                                      require_pairing=False, meta={"mini_swe_agent": meta})
    # The trajectory leaves out the tool definition the agent sent with every request.
    return [fill_known_defaults(conv)]


_SWE_KEEP = ("agent", "message_type", "thought", "action", "is_demo", "tool_call_ids")


def _swe_message(raw: Any) -> Message:
    d = expect_dict(raw, "history item")
    ids = d.get("tool_call_ids")
    oa = {k: v for k, v in d.items() if k in ("role", "content", "tool_calls", "name")}
    if d.get("role") == "tool":
        ids = expect_list(ids, "'tool_call_ids'") if ids is not None else []
        if not ids:
            raise FormatError("tool message has no 'tool_call_ids'; expected the id of the call it answers")
        oa["tool_call_id"] = ids[0]  # SWE-agent runs one call per step; the list has one id
    m = message_from_openai(oa)
    kept = {k: d[k] for k in _SWE_KEEP if k in d}
    return replace(m, extra={**m.extra, "swe_agent": kept} if kept else m.extra)


def load_swe_agent(value: Any, reader: Reader, conv_id: str) -> list[Conversation]:
    """A ``.traj``: the model's view is ``history``; ``trajectory`` (per-step state) goes to meta."""
    d = expect_dict(value, "document")
    history = expect_list(d.get("history"), "'history'")
    messages: list[Message] = []
    for i, raw in enumerate(history):
        m = reader.guard(f"history[{i}]", partial(_swe_message, raw))
        if m is not None:
            messages.append(m if m.id else replace(m, id=f"m{i}"))
    system = None
    if messages and messages[0].role.value == "system" and isinstance(messages[0].content, str):
        system = messages[0].content
        messages.pop(0)
    meta = {k: v for k, v in d.items() if k in ("info", "environment", "replay_config")}
    return [Conversation(messages=messages, id=conv_id, system=system, source_format=SWE_AGENT,
                         source=reader.source, meta={"swe_agent": meta})]
