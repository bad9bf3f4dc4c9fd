"""Loading a model's own chat template in a child process first: a template from a file (``hf:``,
``gguf:``, ``file:``) is hostile input, and its load (reading, compiling, the probe renders) is bounded
there.

:func:`load_checked` (what :func:`ctxfold.tokens.templates.get_template` does for those specs): the child reads
the file, compiles the template and runs the load-time probe renders under a wall-clock timeout and an
address-space limit (``RLIMIT_AS``). A template that hangs, eats memory, recurses without end or crashes
there is refused with one ``ConfigError``; the parent only waits (never longer than the timeout) and
reads a small JSON answer. One that passes is used in process, with the child's probe results, under the
per-render bounds of :mod:`ctxfold.tokens.templates.guard`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ctxfold
from ctxfold.errors import ConfigError
from ctxfold.tokens.templates.guard import MAX_TEMPLATE_CHARS, _mib
from ctxfold.tokens.templates.jinja import (
    JinjaRenderer,
    TemplateBoundsError,
    TemplateRenderError,
    remember_probe,
)
from ctxfold.tokens.templates.jinja_loading import JinjaChatTemplate, load_model_template

LOAD_TIMEOUT_S = 10.0  # loading a template from a file, compiling it and probing it, in the child
LOAD_MAX_MEMORY_BYTES = 512 * 2**20  # what the child may allocate past what it has after its imports
# The child's answer: a template of MAX_TEMPLATE_CHARS, JSON-escaped, with its special tokens.
_MAX_ANSWER_BYTES = 16 * 2**20


def _template_fields(t: JinjaChatTemplate) -> dict[str, Any]:
    return {"name": t.name, "source": t.source, "tool_use_source": t.tool_use_source,
            "variables": dict(t.variables), "specials": {k: list(v) for k, v in t.specials.items()},
            "object_arguments": t.object_arguments, "description": t.description,
            "tools_with_last_user": t.tools_with_last_user}


def _template_of(fields: Mapping[str, Any]) -> JinjaChatTemplate:
    return JinjaChatTemplate(
        name=str(fields["name"]), source=str(fields["source"]), tool_use_source=str(fields["tool_use_source"]),
        variables=dict(fields["variables"]),
        specials={str(k): (str(v[0]), int(v[1])) for k, v in fields["specials"].items()},
        object_arguments=bool(fields["object_arguments"]), description=str(fields["description"]),
        tools_with_last_user=bool(fields["tools_with_last_user"]))


def _vm_size_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _limit_child(max_memory_bytes: int, cpu_s: int) -> None:
    """This process's address space: what it has now (the interpreter and its imports) and
    ``max_memory_bytes`` more; its CPU time, in case its parent is gone and no one times it."""
    try:
        import resource
    except ImportError:  # not a POSIX system: the parent's timeout still bounds the check
        return
    for limit, value in ((resource.RLIMIT_AS, _vm_size_bytes() + max_memory_bytes),
                         (resource.RLIMIT_CPU, cpu_s)):
        _, hard = resource.getrlimit(limit)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        try:
            resource.setrlimit(limit, (value, hard if limit == resource.RLIMIT_CPU else value))
        except (ValueError, OSError):
            pass  # a platform that refuses it: the parent's timeout still bounds the check


def _check_here(spec: str) -> dict[str, Any]:
    """In the child: ``spec`` loaded, compiled and probed, as the parent will use it."""
    t = load_model_template(spec)
    if len(t.source) + len(t.tool_use_source) > MAX_TEMPLATE_CHARS:
        raise ConfigError(f"chat template {spec}: refused: its text is over {_mib(MAX_TEMPLATE_CHARS)} "
                          "(chat templates are a few KiB); check that the file is the model's chat template")
    try:
        r = JinjaRenderer(t)
    except ConfigError:
        # It does not parse: the parent says so where the renderer is built, as for any template.
        return {"ok": True, "template": _template_fields(t), "probe": None}
    return {"ok": True, "template": _template_fields(t),
            "probe": [r.separable, r.turn_sensitive, r.alternates_roles]}


def child_main(argv: Sequence[str]) -> int:
    """The child's entry: ``SPEC MAX_MEMORY_BYTES CPU_S``; writes one JSON answer on stdout."""
    spec, max_memory_bytes, cpu_s = argv[0], int(argv[1]), int(argv[2])
    try:  # imported before the limit, so that it measures what the template needs, not the imports
        import jinja2.sandbox  # noqa: F401

        import ctxfold.tokens.gguf  # noqa: F401
    except ImportError:
        pass  # the renderer says what is missing, in one line

    _limit_child(max_memory_bytes, cpu_s)
    answer: dict[str, Any]
    try:
        answer = _check_here(spec)
    except MemoryError:
        answer = {"ok": False, "reason": "memory"}
    except RecursionError:
        answer = {"ok": False, "reason": "recursion"}
    except TemplateBoundsError as e:
        answer = {"ok": False, "reason": "memory" if e.reason == "oom" else "bounds", "what": e.what}
    except (ConfigError, TemplateRenderError) as e:
        answer = {"ok": False, "reason": "config", "message": str(e)}
    text = json.dumps(answer)
    if len(text) > _MAX_ANSWER_BYTES:
        text = json.dumps({"ok": False, "reason": "config", "message":
                           f"chat template {spec}: refused: it and its special tokens are over "
                           f"{_mib(_MAX_ANSWER_BYTES)}; check that the file is the model's tokenizer config"})
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


_CHILD = "import sys; from ctxfold.tokens.templates.loader import child_main; sys.exit(child_main(sys.argv[1:]))"
_ADVICE = "fix the template or choose another (a preset, or another model's template)"


def _child_env() -> dict[str, str]:
    # The child imports the ctxfold this process imported (a source tree, an editable or a wheel install).
    root = str(Path(ctxfold.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _refused(spec: str, what: str) -> ConfigError:
    return ConfigError(f"chat template {spec}: refused: {what}; {_ADVICE}")


def _answer_error(spec: str, proc: subprocess.CompletedProcess[bytes], max_memory_bytes: int) -> ConfigError:
    """The one-line error for a child that did not pass the template."""
    try:
        answer = json.loads(proc.stdout) if proc.stdout else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and answer.get("reason") == "config":
        return ConfigError(str(answer.get("message")))
    if isinstance(answer, dict) and answer.get("reason") == "bounds":
        return _refused(spec, f"test-rendering it was stopped: {answer.get('what')}")
    if (isinstance(answer, dict) and answer.get("reason") == "memory") or b"MemoryError" in proc.stderr:
        return _refused(spec, f"loading and test-rendering it needed over {_mib(max_memory_bytes)} of memory")
    if isinstance(answer, dict) and answer.get("reason") == "recursion":
        return _refused(spec, "test-rendering it recursed too deep (a macro or loop that calls itself "
                              "without end)")
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        return _refused(spec, f"the process that loaded and test-rendered it was killed by {sig}")
    last = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return _refused(spec, f"the process that loaded and test-rendered it failed ({last[0][:300]})")


def _files_signature(spec: str) -> tuple[Any, ...] | None:
    """What ``spec`` reads, as the file system says it is now (None: it cannot say): a template loaded and
    checked once is not checked again until one of its files changes."""
    kind, _, rest = spec.partition(":")
    path = Path(rest)
    paths = [path]
    if kind == "hf":
        where = path if path.is_dir() else path.parent
        paths += [where / "tokenizer_config.json", where / "chat_template.jinja", where / "chat_template.json"]
    sig: list[Any] = []
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            sig.append(None)
            continue
        sig.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    return (cwd, *sig) if sig[0] is not None else None


_loaded: dict[tuple[Any, ...], JinjaChatTemplate] = {}
_MAX_LOADED = 32


def load_checked(spec: str, *, timeout_s: float = LOAD_TIMEOUT_S,
                 max_memory_bytes: int = LOAD_MAX_MEMORY_BYTES) -> JinjaChatTemplate:
    """The template ``spec`` (``hf:PATH``, ``gguf:PATH``, ``file:PATH``) names, once a child process has
    loaded it, compiled it and run the load-time probe renders within ``timeout_s`` seconds and
    ``max_memory_bytes`` of memory (past the child's own imports). Raises ConfigError with one line: what
    the file lacks (as :func:`ctxfold.tokens.templates.jinja_loading.from_tokenizer_config` and the others say), or what
    the template did (took over the time, needed over the memory, recursed, went past a render bound).
    This process only waits, at most ``timeout_s``, and reads the child's answer; the template is then
    used here with the child's probe results."""
    signature = _files_signature(spec)
    key = (spec, timeout_s, max_memory_bytes, signature)
    hit = _loaded.get(key) if signature is not None else None
    if hit is not None:
        return hit
    template = _load_in_child(spec, timeout_s, max_memory_bytes)
    if signature is not None:
        if len(_loaded) >= _MAX_LOADED:
            _loaded.clear()
        _loaded[key] = template
    return template


def _load_in_child(spec: str, timeout_s: float, max_memory_bytes: int) -> JinjaChatTemplate:
    if not sys.executable:
        raise ConfigError(f"chat template {spec}: cannot start a Python process to check it (no interpreter "
                          "path); use a preset")
    cmd = [sys.executable, "-P", "-c", _CHILD, spec, str(max_memory_bytes), str(int(timeout_s) + 2)]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s,
                              env=_child_env(), check=False)
    except subprocess.TimeoutExpired:
        raise _refused(spec, f"loading and test-rendering it took over {timeout_s:g} s (a loop without end, "
                             "or far more work than a chat template needs)") from None
    except OSError as e:
        raise ConfigError(f"chat template {spec}: cannot start a Python process to check it ({e}); "
                          "use a preset") from None
    try:
        answer = json.loads(proc.stdout) if proc.returncode == 0 else None
    except ValueError:
        answer = None
    if not (isinstance(answer, dict) and answer.get("ok")):
        raise _answer_error(spec, proc, max_memory_bytes)
    template = _template_of(answer["template"])
    probe = answer.get("probe")
    if probe is not None:
        remember_probe(template, (bool(probe[0]), str(probe[1]), bool(probe[2])))
    return template


__all__ = ["LOAD_MAX_MEMORY_BYTES", "LOAD_TIMEOUT_S", "child_main", "load_checked"]
