"""Meta's own Llama tokenizers (the llama-models package): the reference ctxfold's ``llama3`` and
``llama4`` counters are checked against.

ctxfold builds its counters from the ranks files without importing llama_models; the tests and the
benchmark encode through Meta's ``Tokenizer`` itself, as its reference code does (``encode(text,
bos=False, eos=False)``: special-token strings typed in text are plain text). Meta's encode cuts runs of
more than 25,000 characters without (or of only) whitespace before encoding, which no engine does;
texts that long are left to the tiktoken reference.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def meta_tokenizer(name: str) -> Any:
    """Meta's Tokenizer of ``llama3`` or ``llama4`` (the counter's name)."""
    if name == "llama3":
        from llama_models.llama3.tokenizer import Tokenizer
    else:
        from llama_models.llama4.tokenizer import Tokenizer  # type: ignore[no-redef]
    return Tokenizer.get_instance()


def reference_count(name: str, text: str) -> int:
    """Tokens of ``text`` as Meta's tokenizer counts them, without BOS or EOS."""
    return len(meta_tokenizer(name).encode(text, bos=False, eos=False))
