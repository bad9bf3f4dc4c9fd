"""A model's chat template is hostile input: bounded at load (a child process with a timeout and a memory
limit) and on every render (sizes, loop iterations, output, time, memory, recursion).

Each hostile template is run in a subprocess of its own, under an address-space limit and a timeout:
should a bound fail, the test fails (the subprocess runs out of its memory or time) and the machine
running it does not. That subprocess is "the parent" the brief speaks of: it loads the template with
``get_template`` and renders it, as the proxy and the command line do; its peak memory (VmHWM) shows
that the template's work happened elsewhere or was stopped before it grew.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.errors import ConfigError
from ctxfold.tokens.templates import get_template
from ctxfold.tokens.templates.jinja import JinjaChatTemplate, JinjaRenderer, TemplateRenderError, from_file
from helpers.subprocess_env import ctxfold_env

pytest.importorskip("jinja2")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc and sets RLIMIT_AS (Linux)")

SAFETY_NET_S = 60  # a bounded load or render answers in a few seconds; this only catches a hang
MAX_PEAK_RSS_BYTES = 300 * 2**20  # the parent: an interpreter with ctxfold imported is ~70 MiB
# The subprocess's own address-space limit: should a bound fail, it runs out of memory, not the machine.
_SUBPROCESS_AS_BYTES = 3 * 2**30

# A template as models ship them (ChatML), that a payload is put in front of.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Loads the template with get_template, builds its renderer (compile and probe renders, as the proxy
# does at startup), renders a conversation of N messages; answers in one JSON line.
_PARENT = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[3]), int(sys.argv[3])))
from ctxfold.errors import CtxfoldError
from ctxfold.tokens.templates.jinja import JinjaRenderer, TemplateRenderError
from ctxfold.chat.messages import Conversation, Message, Role
from ctxfold.tokens.templates import get_template

start = time.monotonic()
answer = {}
try:
    renderer = JinjaRenderer(get_template(sys.argv[1]))
    answer["loaded_s"] = time.monotonic() - start
    n = int(sys.argv[2])
    msgs = [Message(role=Role.USER if i % 2 == 0 else Role.ASSISTANT, content=f"message {i}") for i in range(n)]
    if n:
        answer["rendered_chars"] = len(renderer.render_text(Conversation(messages=msgs)))
except CtxfoldError as e:
    answer.update(error=str(e), error_type=type(e).__name__, render_error=isinstance(e, TemplateRenderError))
answer["elapsed_s"] = time.monotonic() - start
status = open("/proc/self/status").read()
answer["peak_rss_bytes"] = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps(answer))
"""


def run_parent(spec: str, messages: int = 0) -> dict[str, Any]:
    """What a process that loads ``spec`` (and renders ``messages`` messages with it) ends with."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PARENT, spec, str(messages), str(_SUBPROCESS_AS_BYTES)],
                              capture_output=True, text=True, timeout=SAFETY_NET_S, env=ctxfold_env(), check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{spec}: no answer in {SAFETY_NET_S} s: the process hung")
    assert proc.returncode == 0, f"{spec}: the process failed:\n{proc.stderr[-3000:]}"
    answer: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["elapsed_s"] < SAFETY_NET_S
    assert answer["peak_rss_bytes"] < MAX_PEAK_RSS_BYTES, f"the process grew to {answer['peak_rss_bytes']:,} bytes"
    return answer


def write_template(tmp_path: Path, source: str, form: str) -> str:
    """``source`` as a model ships it: a template file (``file:``) or a tokenizer config (``hf:``)."""
    if form == "file":
        path = tmp_path / "chat_template.jinja"
        path.write_text(source, encoding="utf-8")
        return f"file:{path}"
    config = tmp_path / "model" / "tokenizer_config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"}),
                      encoding="utf-8")
    return f"hf:{config.parent}"


# -- the findings: each hung, grew or crashed the process that loaded it --------------------------------------

GIGABYTES = "{% for i in range(100000) %}{% for m in messages %}{{ m.content * 1000 }}{% endfor %}{% endfor %}"
HOSTILE = {
    # Before: constant folding at compile time computed it; the process never answered.
    "huge-power": ("{{ 9**999999999 }}", "a power of over 65,536 bits"),
    # Before: 10^10 iterations; the process never answered.
    "nested-ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "loops ran over 4,000,000 iterations"),
    # Before: 5e8 characters (constant folded, then written into the compiled code): gigabytes.
    "huge-string": ("{{ 'a' * 500000000 }}", "'*' would repeat a string to over 16,777,216 characters"),
    # Before: RecursionError, which nothing caught: every request failed with a traceback.
    "recursive-macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deep"),
    # Before: 15 KB a message, 100,000 times: gigabytes of output, joined at the end.
    "gigabytes-of-output": (GIGABYTES, "output went over 64 MiB"),
}
LOAD_CASES = [(name, "file") for name in HOSTILE] + [("nested-ranges", "hf"), ("recursive-macro", "hf")]


@pytest.mark.parametrize(("name", "form"), LOAD_CASES, ids=[f"{n}-{f}" for n, f in LOAD_CASES])
def test_a_hostile_template_is_refused_at_load_in_one_line(tmp_path: Path, name: str, form: str) -> None:
    """Refused by get_template, in one line naming the template, what it did and what to do; the process
    that loaded it stayed small and answered within seconds."""
    payload, what = HOSTILE[name]
    spec = write_template(tmp_path, payload + CHATML, form)
    answer = run_parent(spec)
    assert "loaded_s" not in answer, f"{spec} was loaded"
    message = answer["error"]
    assert answer["error_type"] == "ConfigError"
    assert "\n" not in message and message.startswith(f"chat template {spec}: refused: ")
    assert what in message and message.endswith("fix the template or choose another (a preset, or another "
                                                 "model's template)")


# A template that passes the load-time probes (conversations of up to 17 messages) and does the same
# on a longer conversation.
AT_RENDER = {
    "huge-string": ("{{ 'a' * 500000000 }}", "'*' would repeat a string"),
    "huge-string-of-input": ("{{ messages[0].content * 100000000 }}", "'*' would repeat a string"),
    "nested-ranges": (HOSTILE["nested-ranges"][0], "loops ran over 4,000,000 iterations"),
    "recursive-macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deep"),
    "gigabytes-of-output": (HOSTILE["gigabytes-of-output"][0], "output went over 64 MiB"),
}


@pytest.mark.parametrize("name", list(AT_RENDER))
def test_a_template_that_blows_up_on_a_longer_conversation_is_a_render_error(tmp_path: Path, name: str) -> None:
    payload, what = AT_RENDER[name]
    spec = write_template(tmp_path, "{% if messages|length > 20 %}" + payload + "{% endif %}" + CHATML, "file")
    assert run_parent(spec, messages=12)["rendered_chars"] > 0  # a short conversation renders
    answer = run_parent(spec, messages=30)
    assert answer["render_error"], answer  # a TemplateRenderError: the proxy passes the request on
    assert answer["error_type"] == "TemplateBoundsError"
    message = answer["error"]
    assert "\n" not in message and message.startswith(f"chat template {spec}: stopped: ")
    assert what in message and message.endswith("fix the template or choose another")


# -- other ways to build a big value in one step: each refused before it is built -----------------------------

_DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}"
# A list holding itself twice, forty levels deep: 2^40 leaves when printed, 40 lists in memory.
_SHARED = "{% set ns = namespace(l=['x']) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
FLAT_COMPARE = "{% set a = 'x' * 16000000 %}{% set b = 'x' * 16000000 %}{{ ([a] * 2000000) == ([b] * 2000000) }}"
GROWTH = {
    "tilde-doubling": (_DOUBLING.replace("OP", "~") + "{{ ns.s }}", "'~' would build a string"),
    "plus-doubling": (_DOUBLING.replace("OP", "+") + "{{ ns.s }}", "'+' would build a string"),
    "list-doubling": (_DOUBLING.replace("'ab'", "['ab']").replace("OP", "+") + "{{ ns.s|length }}",
                      "'+' would build a list of over 2,097,152 items"),
    "shared-list": (_SHARED + "{{ ns.l }}", "it built a list or mapping that prints as over"),
    "shared-dict": (_SHARED.replace("[ns.l, ns.l]", "dict(a=ns.l, b=ns.l)") + "{{ ns.l == ns.l.a }}",
                    "it built a list or mapping that prints as over"),
    # Equal, not identical, strings: the comparison reads all of them (hours) and cannot be interrupted.
    "flat-list-compare": (FLAT_COMPARE, "'*' would repeat a list to one that prints"),
    "tojson-indent": ("{{ messages|tojson(indent=16000000) }}", "the tojson filter would print"),
    "percent-width": ("{{ '%999999999d' % 1 }}", "'%' formatting has a width over"),
    "format-width": ("{{ '{:>999999999}'.format(1) }}", "a format string has a width over"),
    "format-nested-width": ("{{ '{:>{w}}'.format(1, w=999999999) }}", "a format string was given a number"),
    "format-repeat": ("{% set s = 'a' * 10000000 %}{{ '{0}{0}'.format(s) }}", "a format string would build"),
    "ljust": ("{{ 'a'.ljust(999999999) }}", "the ljust method was given a number"),
    "center-filter": ("{{ 'a'|center(999999999) }}", "the center filter was given a number"),
    "replace": ("{% set s = 'a' * 10000 %}{{ s.replace('a', s) }}", "a replace would build"),
    "join": ("{% set s = 'a' * 10000000 %}{{ (range(3)|map('string')|list)|join(s) }}", "a join would build"),
    "list-concat-prints-big": ("{% set s = 'a' * 10000000 %}{{ [s, 'b'] + [s] }}", "'+' would build a list that prints as over"),
    "to-bytes": ("{{ (1).to_bytes(999999999, 'big') }}", "the to_bytes method was given a number"),
    "slice-filter": ("{{ messages|slice(999999999)|list }}", "the slice filter was given a number"),
    "big-range": ("{{ range(999999999)|list }}", "a range of over 100,000 numbers"),
    "recursive-loop": ("{% for m in [1] recursive %}{{ loop([1]) }}{% endfor %}", "recursed too deep"),
    "product": ("{% set x = 7 ** 9000 %}{{ x * x * x }}", "a product of over 65,536 bits"),
    "lipsum": ("{{ lipsum(10000000) }}", "lipsum would build a string"),
    "batch-fill": ("{{ messages|batch(16000000, 'x')|list }}", "batch would fill a list"),
    "urlize-target": ("{% set s = 'x' * 1000000 %}{{ ('http://a.io ' * 100)|urlize(target=s) }}",
                      "urlize would build a string"),
}

# Renders each template with the renderer directly (no load check), under the same limits as above.
_DIRECT = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
from ctxfold.tokens.templates import guard
from ctxfold.tokens.templates.jinja import JinjaChatTemplate, JinjaRenderer
from ctxfold.chat.messages import Conversation, Message, Role

# These renders test the size bounds: on a loaded machine the time bound must not stop them first.
guard.RENDER_TIMEOUT_S = 120.0

out = {}
for name, source in json.loads(sys.stdin.read()).items():
    start = time.monotonic()
    try:
        text = JinjaRenderer(JinjaChatTemplate(name=name, source=source)).render_text(
            Conversation(messages=[Message(role=Role.USER, content="hi")]))
        out[name] = {"rendered_chars": len(text)}
    except Exception as e:  # a bound that failed shows as what it let through (MemoryError, RecursionError)
        out[name] = {"error": str(e), "error_type": type(e).__name__}
    out[name]["elapsed_s"] = time.monotonic() - start
status = open("/proc/self/status").read()
out["peak_rss_bytes"] = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def growth_outcomes() -> dict[str, Any]:
    sources = {name: source + CHATML for name, (source, _) in GROWTH.items()}
    try:
        proc = subprocess.run([sys.executable, "-c", _DIRECT, str(_SUBPROCESS_AS_BYTES)], input=json.dumps(sources),
                              capture_output=True, text=True, timeout=SAFETY_NET_S, env=ctxfold_env(), check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no answer in {SAFETY_NET_S} s: a render hung")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("name", list(GROWTH))
def test_a_value_too_big_to_build_is_refused_before_it_is_built(growth_outcomes: dict[str, Any], name: str) -> None:
    outcome = growth_outcomes[name]
    assert outcome.get("error_type") == "TemplateBoundsError", outcome
    assert GROWTH[name][1] in outcome["error"] and "\n" not in outcome["error"]
    assert outcome["elapsed_s"] < 60  # a safety net: the bound stops it within a second when the machine is idle
    assert growth_outcomes["peak_rss_bytes"] < MAX_PEAK_RSS_BYTES


# -- the child process: time and memory limits, and its answer -----------------------------------------------

def _peak_rss_reset() -> bool:
    """Resets this process's peak resident size (VmHWM) to what it is now (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{field}:")[1].split()[0]) * 1024


def test_a_template_that_takes_too_long_to_load_is_refused_after_the_timeout(tmp_path: Path) -> None:
    """Each render stays within its bounds (3.6 million iterations), but the probe renders hundreds:
    the child is stopped at the timeout; this process only waited."""
    from ctxfold.tokens.templates.loader import load_checked

    slow = "{% for i in range(90000) %}{% for j in range(40) %}{% endfor %}{% endfor %}"
    spec = write_template(tmp_path, slow + CHATML, "file")
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_checked(spec, timeout_s=2)
    assert time.monotonic() - start < 2 + 10
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"chat template {spec}: refused: ")
    assert "took over 2 s" in message


def hungry(strings: int, chars: int) -> str:
    """A template that keeps ``strings`` distinct strings of ``chars`` characters alive, each value within
    every bound on one value (a chain of namespaces, each holding one string and the one before)."""
    return ("{% set ns = namespace(last=none) %}"
            f"{{% for i in range({strings}) %}}{{% set ns.last = namespace(before=ns.last, text=('x' * {chars}) ~ i) %}}"
            "{% endfor %}")


def test_a_template_that_needs_too_much_memory_to_load_is_refused(tmp_path: Path) -> None:
    """400 MB of distinct strings in one render (under the render's own bound, 512 MiB): the child, limited
    to 128 MiB, runs out; this process does not grow."""
    from ctxfold.tokens.templates.loader import load_checked

    spec = write_template(tmp_path, hungry(40, 10_000_000) + CHATML, "file")
    reset = _peak_rss_reset()
    before = _status_bytes("VmRSS" if reset else "VmHWM")
    with pytest.raises(ConfigError) as e:
        load_checked(spec, max_memory_bytes=128 * 2**20)
    assert _status_bytes("VmHWM") - before < MAX_PEAK_RSS_BYTES
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"chat template {spec}: refused: ")
    assert "needed over 128 MiB of memory" in message


def test_a_render_that_grows_the_process_too_much_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many values, each under the size bound, kept together: the render stops once the process has grown
    past its bound (lowered here to 64 MiB so the test stays small)."""
    from ctxfold.tokens.templates import guard as template_guard

    monkeypatch.setattr(template_guard, "MAX_RENDER_GROWTH_BYTES", 64 * 2**20)
    source = "{% if messages|length > 20 %}" + hungry(1000, 4_000_000) + "{% endif %}"
    r = JinjaRenderer(JinjaChatTemplate(name="hungry", source=source))
    reset = _peak_rss_reset()
    before = _status_bytes("VmRSS" if reset else "VmHWM")
    msgs = [Message(role=Role.USER if i % 2 == 0 else Role.ASSISTANT, content=f"m{i}") for i in range(30)]
    with pytest.raises(TemplateRenderError, match=r"^chat template hungry: stopped: it needed over 64 MiB"):
        r.render_text(Conversation(messages=msgs))
    assert _status_bytes("VmHWM") - before < MAX_PEAK_RSS_BYTES


def test_a_template_the_sandbox_refuses_still_loads_and_is_refused_when_rendered(tmp_path: Path) -> None:
    for escape in ("{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__base__.__subclasses__() }}",
                   "{{ namespace.__init__.__globals__ }}", "{{ cycler.__init__.__globals__.os }}"):
        spec = write_template(tmp_path, escape + CHATML, "file")
        t = get_template(spec)
        assert isinstance(t, JinjaChatTemplate)
        with pytest.raises(TemplateRenderError):
            JinjaRenderer(t).render_text(Conversation(messages=[Message(role=Role.USER, content="a")]))


def test_a_checked_template_is_not_checked_again_until_its_file_changes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from ctxfold.tokens.templates import loader as template_loader

    spec = write_template(tmp_path, CHATML, "file")
    first = get_template(spec)
    started: list[str] = []
    run = subprocess.run

    def counting_run(*args: Any, **kwargs: Any) -> Any:
        started.append(spec)
        return run(*args, **kwargs)

    monkeypatch.setattr(template_loader.subprocess, "run", counting_run)
    assert get_template(spec) is first and not started
    Path(spec.removeprefix("file:")).write_text("changed " + CHATML, encoding="utf-8")
    changed = get_template(spec)
    assert isinstance(changed, JinjaChatTemplate) and changed.source.startswith("changed ") and started


def test_presets_need_no_child_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from ctxfold.tokens.templates import loader as template_loader

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a preset was loaded through a child process")

    monkeypatch.setattr(template_loader.subprocess, "run", refuse)
    for name in ("gemma-3", "llama-3.1", "llama-3.2", "chatml", "deepseek-v4"):
        assert get_template(name) is not None


# -- good templates: loaded and rendered exactly as before ---------------------------------------------------

def _conversations(tools: bool) -> list[Conversation]:
    u, a, t = Role.USER, Role.ASSISTANT, Role.TOOL
    alt = [Message(role=u if i % 2 == 0 else a, content=f" turn {i} «text»\n") for i in range(8)]
    out = [Conversation(messages=alt), Conversation(messages=alt, system="Be brief.")]
    if tools:
        spec = ToolSpec(name="bash", description="Run a command.",
                        parameters={"type": "object", "properties": {"command": {"type": "string"}}})
        call = ToolCall(id="c1", name="bash", arguments='{"command": "ls"}')
        loop = [Message(role=u, content="Fix it."), Message(role=a, content="", tool_calls=(call,)),
                Message(role=t, content="a.txt", tool_call_id="c1", name="bash"),
                Message(role=a, content="Done.", reasoning="It was simple."), Message(role=u, content="Thanks.")]
        out.append(Conversation(messages=loop, system="You are an agent.", tools=(spec,)))
    return out


def test_qwen3_loads_through_the_check_as_it_loads_in_process_and_renders_as_its_tokenizer() -> None:
    pytest.importorskip("transformers")
    from test_jinja_templates import qwen3_apply_chat_template, qwen3_config

    from ctxfold.tokens.templates.jinja import from_tokenizer_config

    loaded = get_template(f"hf:{qwen3_config()}")
    assert loaded == from_tokenizer_config(qwen3_config())
    assert isinstance(loaded, JinjaChatTemplate)
    r = JinjaRenderer(loaded)
    assert (r.separable, r.turn_sensitive, r.alternates_roles) == (True, "reasoning", False)
    reference = qwen3_apply_chat_template()
    for conv in _conversations(tools=True):
        assert r.render_text(conv) == reference(conv)
        prefix, texts, suffix = r.segments(conv.system, conv.tools, conv.messages)
        assert prefix + "".join(texts) + suffix == reference(conv)


@pytest.mark.parametrize("name", ["gemma-3", "llama-3.1", "llama-3.2"])
def test_the_jinja_presets_render_as_transformers_renders_them(name: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from test_jinja_templates import transformers_render

    preset = get_template(name)
    assert isinstance(preset, JinjaChatTemplate)
    reference = transformers_render(preset)
    r = JinjaRenderer(preset)
    assert r.separable
    for conv in _conversations(tools=not name.startswith("gemma")):
        assert r.render_text(conv) == reference(conv)
    # The same text as a file, loaded through the check: the template a load in this process gives.
    path = tmp_path / f"{name}.jinja"
    path.write_text(preset.source, encoding="utf-8")
    assert get_template(f"file:{path}") == from_file(path)
