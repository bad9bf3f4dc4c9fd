"""A model's own Jinja chat template (:class:`JinjaChatTemplate`), loaded from where models ship it.

A ``tokenizer_config.json`` (``chat_template``, or a ``chat_template.jinja`` / ``.json`` beside it) with
its special tokens (``hf:``), a GGUF file (``tokenizer.chat_template``, ``gguf:``), a plain template
file (``file:``), or a preset kept as data (:mod:`ctxfold.tokens.templates.sources`). Loaded here in this
process, unchecked: :func:`ctxfold.tokens.templates.loader.load_checked` loads and probes a file in a child
process first; :mod:`ctxfold.tokens.templates.jinja` renders.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ctxfold.errors import ConfigError


@dataclass(frozen=True, slots=True)
class JinjaChatTemplate:
    """One model's Jinja chat template and what it is rendered with."""

    name: str  # a preset name, or where it was loaded from
    source: str  # the Jinja text
    # The text used when the request offers tools, where the model ships a separate one (a config's
    # named "tool_use" template, a GGUF's tokenizer.chat_template.tool_use), as transformers picks it.
    tool_use_source: str = ""
    # Variables every render gets: the config's special tokens (bos_token, eos_token, ...), then
    # template switches (enable_thinking, date_string, ...); transformers passes both as keyword arguments.
    variables: Mapping[str, Any] = field(default_factory=dict)
    # Control tokens: name -> (text, id), as ChatTemplate.specials. Rendered text is split on them, so
    # each counts as one token and the text between them is counted on its own, as tokenizers do.
    specials: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    object_arguments: bool = True  # tool-call arguments that parse as JSON objects are passed as objects
    description: str = ""
    # The accounting and the compactor read these of any template: a Jinja template places its tools
    # block itself (derived from renders), never before the last user message as Mistral v7's does.
    tools_with_last_user: bool = False

    def with_specials(self, specials: Mapping[str, int]) -> JinjaChatTemplate:
        """This template with ``specials`` (text -> id) added to its control tokens, keeping those that
        its source can write (or that are its BOS/EOS): a vocabulary has thousands it never writes."""
        written = self.source + self.tool_use_source
        keep = {t: i for t, i in specials.items() if t and (t in written or t in self.variables.values())}
        merged = dict(self.specials)
        merged.update({t: (t, i) for t, i in keep.items()})
        return replace(self, specials=merged)


def _special_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _pick(source: Any, what: str) -> tuple[str, str]:
    """The template texts of a ``chat_template`` value: a string, or a list of named templates
    ("default", and "tool_use" for requests with tools, as transformers picks them)."""
    if isinstance(source, str):
        return source, ""
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        default, tool_use = named.get("default"), named.get("tool_use")
        if not isinstance(default, str):
            default = tool_use if isinstance(tool_use, str) else None
        if isinstance(default, str):
            return default, tool_use if isinstance(tool_use, str) else ""
        raise ConfigError(f"chat template: {what} has no chat template named 'default' "
                          f"(it has {sorted(map(str, named))})")
    raise ConfigError(f"chat template: {what} has no chat template")


def from_tokenizer_config(path: str | Path) -> JinjaChatTemplate:
    """The template of a ``tokenizer_config.json`` (or a ``chat_template.json`` /
    ``chat_template.jinja`` beside it, where newer models keep it), with its special tokens."""
    p = Path(path)
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"chat template: {p} does not exist") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"chat template: {p} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"chat template: {p} is not a tokenizer config (a JSON object)")
    source = config.get("chat_template")
    if source is None:
        jinja_file = p.with_name("chat_template.jinja")
        json_file = p.with_name("chat_template.json")
        if jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        elif json_file.is_file():
            source = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    if source is None:
        raise ConfigError(f"chat template: {p} has no chat_template")
    text, tool_use = _pick(source, str(p))
    variables = {k: v for k in _SPECIAL_NAMES if (v := _special_text(config.get(k))) is not None}
    specials: dict[str, int] = {}
    for tid, tok in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(tok, dict) and tok.get("special") and isinstance(tok.get("content"), str):
            specials[tok["content"]] = int(tid)
    loaded = JinjaChatTemplate(name=f"hf:{p}", source=text, tool_use_source=tool_use, variables=variables,
                               description=f"the chat template of {p}")
    return loaded.with_specials(specials)


def from_gguf(path: str | Path) -> JinjaChatTemplate:
    """The template a GGUF model carries (``tokenizer.chat_template``), with its BOS/EOS and control tokens."""
    from ctxfold.tokens.gguf import TOKEN_TYPE_CONTROL, GGUFError, read_metadata

    p = Path(path)
    keys = {"tokenizer.chat_template", "tokenizer.chat_template.tool_use", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "general.name", "general.architecture"}
    try:
        meta = read_metadata(p, keys)
    except FileNotFoundError:
        raise ConfigError(f"chat template: {p} does not exist") from None
    except (OSError, GGUFError) as e:
        raise ConfigError(f"chat template: {e}") from None
    source = meta.get("tokenizer.chat_template")
    if not isinstance(source, str):
        model = meta.get("general.name") or p.name
        preset = _ARCHITECTURE_PRESETS.get(str(meta.get("general.architecture", "")))
        hint = f"--template {preset} (its instruct template)" if preset else "--template file:PATH or a preset"
        raise ConfigError(f"chat template: the GGUF file {p} ({model}) carries no chat template "
                          f"(tokenizer.chat_template); give one with {hint}")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type")
    variables: dict[str, str] = {}
    for key, var in (("tokenizer.ggml.bos_token_id", "bos_token"), ("tokenizer.ggml.eos_token_id", "eos_token")):
        tid = meta.get(key)
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            variables[var] = tokens[tid]
    specials: dict[str, int] = {}
    if types is not None:
        for tid in (types == TOKEN_TYPE_CONTROL).nonzero()[0].tolist():
            specials.setdefault(tokens[tid], int(tid))
    tool_use = meta.get("tokenizer.chat_template.tool_use")
    t = JinjaChatTemplate(name=f"gguf:{p}", source=source, variables=variables,
                          tool_use_source=tool_use if isinstance(tool_use, str) else "",
                          description=f"the chat template of {p}")
    return t.with_specials(specials)


# A model architecture (GGUF general.architecture) -> the preset of its instruct template, where one
# template serves every model of it.
_ARCHITECTURE_PRESETS = {"gemma3": "gemma-3"}


def load_model_template(spec: str) -> JinjaChatTemplate:
    """The template ``spec`` names (``hf:PATH`` a tokenizer config or its directory, ``gguf:PATH``,
    ``file:PATH``), loaded in this process, unchecked: :func:`ctxfold.tokens.templates.get_template` loads it
    through :func:`ctxfold.tokens.templates.loader.load_checked`, which calls this in a child process first."""
    kind, _, rest = spec.partition(":")
    if kind == "gguf":
        return from_gguf(rest)
    if kind == "file":
        return from_file(rest)
    if kind != "hf" or not rest:
        raise ConfigError(f"chat template {spec!r}: not hf:PATH, gguf:PATH or file:PATH")
    path = Path(rest)
    return from_tokenizer_config(path / "tokenizer_config.json" if path.is_dir() else path)


def from_file(path: str | Path) -> JinjaChatTemplate:
    """A plain Jinja template file: no special tokens known (give them with :meth:`JinjaChatTemplate.with_specials`,
    or let the accounting take them from an exact tokenizer)."""
    p = Path(path)
    try:
        source = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"chat template: {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"chat template: {p} is not readable text ({e})") from None
    return JinjaChatTemplate(name=f"file:{p}", source=source, description=f"the chat template in {p}")


def jinja_presets() -> dict[str, JinjaChatTemplate]:
    """The presets kept as the models' own Jinja text (:mod:`ctxfold.tokens.templates.sources`)."""
    from ctxfold.tokens.templates import sources as src

    gemma = {"<bos>": 2, "<eos>": 1, "<start_of_turn>": 105, "<end_of_turn>": 106, "<start_of_image>": 255999}
    llama = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|start_header_id|>": 128006,
             "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009, "<|python_tag|>": 128010}
    out = {
        "gemma-3": JinjaChatTemplate(
            name="gemma-3", source=src.GEMMA3, variables={"bos_token": "<bos>", "eos_token": "<eos>"},
            description="Gemma 3 instruct's own template: system prompt folded into the first user turn, "
            "contents trimmed, no tool role (it refuses anything but alternating user/model turns)"),
        "llama-3.1": JinjaChatTemplate(
            name="llama-3.1", source=src.LLAMA31,
            variables={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            description="Llama 3.1 instruct's own template: tools in the first user turn, one call per "
            "message as JSON with parameters, results as JSON strings in ipython turns"),
        "llama-3.2": JinjaChatTemplate(
            name="llama-3.2", source=src.LLAMA32,
            variables={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            description="Llama 3.2 instruct's own template: 3.1's, with today's date in the system turn"),
    }
    out = {k: v.with_specials(gemma if k.startswith("gemma") else llama) for k, v in out.items()}
    out["gemma3"] = out["gemma-3"]
    out["llama-3"] = out["llama3"] = out["llama-3.1"]
    return out
