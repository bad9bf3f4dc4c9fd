"""A tiktoken BPE as a ``tokenizer.json``: the form the fast exact counter reads for Llama 3.

Llama 3's ranks hold tokens that no merge of two other tokens makes (``./.`` style runs among its 28k
additions to cl100k). tiktoken still emits such a token where a whole pre-token is one: it looks the
pre-token up before merging. fastokens rebuilds merges from a ``.tiktoken`` ranks file and refuses one
with such tokens, but it reads a Hugging Face ``tokenizer.json`` whose BPE has ``ignore_merges`` (a
whole pre-token found in the vocabulary is one token: tiktoken's lookup) and every merge of two tokens
into a third, ordered by the third's rank (what ``transformers``' TikTokenConverter writes). Counts
through it equal tiktoken's on every message of the shared traces and on the property tests; the file
is built once per ranks file, with the ``tokenizers`` library, and kept in ctxfold's cache.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping


@functools.cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte (``bytes_to_unicode``), which byte-level BPE files spell
    their tokens with: printable Latin-1 as itself, the rest from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return tuple(out[b] for b in range(256))


def _spelled(token: bytes) -> str:
    chars = _byte_chars()
    return "".join(chars[b] for b in token)


def tokenizer_json(ranks: Mapping[bytes, int], pattern: str) -> bytes:
    """The ``tokenizer.json`` of the tiktoken BPE with ``ranks`` and pre-tokenizer ``pattern``, without
    special tokens (their text is counted as text, as ``encode_ordinary`` does)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges: list[tuple[int, int, int]] = []  # (rank of the result, rank of the left, rank of the right)
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None:
                merges.append((rank, left, right))
    merges.sort()
    by_rank = {rank: token for token, rank in ranks.items()}
    vocab = {_spelled(token): rank for token, rank in ranks.items()}
    bpe = models.BPE(vocab=vocab, merges=[(_spelled(by_rank[a]), _spelled(by_rank[b])) for _, a, b in merges],
                     ignore_merges=True, byte_fallback=False, fuse_unk=False)
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    # Sorted keys: the same ranks give the same bytes, so the cached file is named by its content.
    return json.dumps(json.loads(tk.to_str()), sort_keys=True, ensure_ascii=False).encode()
