"""mistral-common's own Tekkenizer: the reference ctxfold's tekken counter is checked against.

ctxfold builds its tekken counter from the JSON file without importing mistral_common; the tests and the
benchmark load the same file through mistral-common, exactly as a Mistral deployment encodes text
(``encode(text, bos=False, eos=False)``: control-token strings typed in text are plain text).
"""

from __future__ import annotations

import functools
from typing import Any

from ctxfold.tokens.exact_counters import _package_file


@functools.cache
def tekkenizer(name: str) -> Any:
    """The Tekkenizer of ``tekken-<date>`` (the counter's name), from the file mistral-common ships."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    date = name.removeprefix("tekken-")
    return Tekkenizer.from_file(_package_file("mistral_common", "data", f"tekken_{date}.json", what=name))


def reference_count(name: str, text: str) -> int:
    """Tokens of ``text`` as mistral-common counts them, without BOS or EOS."""
    return len(tekkenizer(name).encode(text, bos=False, eos=False))
