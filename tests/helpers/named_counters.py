"""A named counter for a test, or a skip where its tokenizer file is one the project cannot install.

DeepSeek V3's tokenizer.json ships in no package (ctxfold.tokens.deepseek_v3): a fresh clone's tests skip
the V3 cases, saying how to get the file. Where ``CTXFOLD_DEEPSEEK_V3_TOKENIZER`` names it (CI:
.ci/fetch-deepseek-v3), a file that does not load is a failure, not a skip.
"""

from __future__ import annotations

import os

import pytest

from ctxfold.errors import TokenizerError
from ctxfold.tokens.counting import TokenCounter, load_counter
from ctxfold.tokens.deepseek_v3 import ENV_VAR


def load_or_skip(name: str) -> TokenCounter:
    """``load_counter(name)``; for ``deepseek-v3`` without its file, a skip that says how to get it."""
    if name != "deepseek-v3" or os.environ.get(ENV_VAR):
        return load_counter(name)
    try:
        return load_counter(name)
    except TokenizerError as exc:
        pytest.skip(str(exc))
