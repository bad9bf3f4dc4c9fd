"""Claude Code session logs (``~/.claude/projects/*/<session>.jsonl``).

One record a line. ``user`` and ``assistant`` records carry an Anthropic message; everything else
(progress, file-history-snapshot, queue-operation, system notices, summaries) is not conversation
and is counted in ``meta["ignored_records"]``. Claude Code writes one API response as several
records, one per content block, all with the same ``message.id``: they are merged back into one
assistant message, as Claude Code itself does before the next request. Message ids are the
record uuids.

A file may hold more than the main session: sidechain records (``isSidechain``) and a subagent's
messages relayed in ``agent_progress`` records. Each subagent becomes its own conversation, id
``<session>/agent-<agentId>``, with ``meta["parent_tool_use_id"]`` naming the Task call that ran it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ctxfold.chat.formats._common import (
    Document,
    Reader,
    anthropic_usage,
    expect_dict,
    iter_records,
    simple_content,
)
from ctxfold.chat.formats.anthropic import assistant_blocks, messages_from_anthropic
from ctxfold.chat.messages import IMPORTED_SUMMARY_KEY, ContentPart, Conversation, Message, Role

NAME = "claude_code"
RECORD_TYPES = frozenset({"user", "assistant", "progress", "file-history-snapshot", "queue-operation", "system",
                          "summary", "attachment"})


def _parts(m: Message) -> list[ContentPart]:
    if isinstance(m.content, str):
        return [ContentPart(type="text", text=m.content, data={"type": "text"})] if m.content else []
    return list(m.content)


class _Session:
    """Messages of one session or subagent, built record by record."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.last_assistant = -1  # index of the assistant message later records may extend
        self.seen_uuids: set[str] = set()

    def _mergeable(self, api_id: Any) -> bool:
        if self.last_assistant < 0 or not api_id:
            return False
        prev = self.messages[self.last_assistant]
        if prev.extra.get("claude_code", {}).get("message_id") != api_id:
            return False
        # Only results of this same response may sit in between (parallel calls finishing early).
        calls = {c.id for c in prev.tool_calls}
        return all(m.role is Role.TOOL and m.tool_call_id in calls
                   for m in self.messages[self.last_assistant + 1:])

    def add(self, rec: dict[str, Any]) -> None:
        raw_uuid = rec.get("uuid")
        uuid = raw_uuid if isinstance(raw_uuid, str) else ""
        if uuid and uuid in self.seen_uuids:  # subagent progress can relay the same record twice
            return
        msg = expect_dict(rec.get("message"), "'message'")
        cc: dict[str, Any] = {"uuids": [uuid] if uuid else [], "timestamp": rec.get("timestamp")}
        if rec.get("isMeta"):
            cc["is_meta"] = True
        if rec.get("type") == "assistant":
            content = msg.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            from ctxfold.chat.formats._common import expect_list

            parts, reasoning, calls, ex = assistant_blocks(expect_list(blocks, "'message.content'"))
            api_id = msg.get("id")
            if self._mergeable(api_id):
                prev = self.messages[self.last_assistant]
                pcc = dict(prev.extra["claude_code"])
                pcc["uuids"] = [*pcc["uuids"], *cc["uuids"]]
                pan = dict(prev.extra.get("anthropic", {}))
                for k, v in ex.items():
                    pan[k] = [*pan.get(k, []), *v]
                texts = [t for t in (prev.reasoning, *reasoning) if t is not None]
                self.messages[self.last_assistant] = replace(
                    prev,
                    content=simple_content(_parts(prev) + parts),
                    reasoning="\n".join(texts) if texts else None,
                    tool_calls=prev.tool_calls + tuple(calls),
                    # Each record repeats the response's usage as it stood when written: the last is final.
                    usage=anthropic_usage(msg.get("usage")) or prev.usage,
                    extra={"claude_code": pcc, **({"anthropic": pan} if pan else {})},
                )
            else:
                cc["message_id"] = api_id
                if "model" in msg:
                    cc["model"] = msg["model"]
                self.messages.append(Message(
                    role=Role.ASSISTANT, content=simple_content(parts), id=uuid, tool_calls=tuple(calls),
                    reasoning="\n".join(reasoning) if reasoning else None, usage=anthropic_usage(msg.get("usage")),
                    extra={"claude_code": cc, **({"anthropic": ex} if ex else {})},
                ))
                self.last_assistant = len(self.messages) - 1
        else:
            got = messages_from_anthropic({"role": "user", "content": msg.get("content")}, uuid)
            # Claude Code's own compaction summary, carried into the continued session as a user
            # message: another agent's summary, a turn start for the policy (messages.is_imported_summary).
            imported = {IMPORTED_SUMMARY_KEY: True} if rec.get("isCompactSummary") else {}
            for m in got:
                self.messages.append(replace(m, extra={**m.extra, "claude_code": cc,
                                                       **(imported if m.role is Role.USER else {})}))
            if any(m.role is Role.USER for m in got):
                self.last_assistant = -1  # a new user message closes the response
        if uuid:
            self.seen_uuids.add(uuid)


def load_document(doc: Document, reader: Reader, conv_id: str) -> list[Conversation]:
    main = _Session()
    agents: dict[str, _Session] = {}
    agent_parent: dict[str, Any] = {}
    session_id = ""
    info: dict[str, Any] = {}
    for where, rec in iter_records(doc):
        def one(rec: Any = rec) -> None:
            nonlocal session_id
            r = expect_dict(rec, "record")
            kind = r.get("type")
            if not session_id and isinstance(r.get("sessionId"), str):
                session_id = r["sessionId"]
                info.update({k: r[k] for k in ("cwd", "version", "gitBranch") if k in r})
            data = r.get("data")
            if kind == "progress" and isinstance(data, dict) and data.get("type") == "agent_progress":
                aid = str(data.get("agentId") or r.get("parentToolUseID") or "agent")
                inner = expect_dict(data.get("message"), "agent_progress 'data.message'")
                if inner.get("type") in ("user", "assistant"):
                    agents.setdefault(aid, _Session()).add(inner)
                    agent_parent.setdefault(aid, r.get("parentToolUseID"))
                return
            if kind not in ("user", "assistant"):
                reader.ignored[str(kind)] += 1
                return
            if r.get("isSidechain"):
                aid = str(r.get("agentId") or "sidechain")
                agents.setdefault(aid, _Session()).add(r)
                return
            main.add(r)

        reader.guard(where, one)
    base = session_id or conv_id
    # A subagent's own file (Claude Code writes one per subagent) holds sidechain records only: no
    # empty conversation for the parent session it came from.
    out = [] if agents and not main.messages else [
        Conversation(messages=main.messages, id=base, source_format=NAME, source=reader.source,
                     meta={"claude_code": info})]
    for aid, sess in agents.items():
        out.append(Conversation(messages=sess.messages, id=f"{base}/agent-{aid}", source_format=NAME,
                                source=reader.source,
                                meta={"claude_code": info, "parent_tool_use_id": agent_parent.get(aid)}))
    return out
