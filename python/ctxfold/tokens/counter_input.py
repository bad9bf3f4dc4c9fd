"""What a token counter accepts: ``str``, or ``bytes`` decoded as strict UTF-8, with errors that say where.

A text that is not valid UTF-8 (or a ``str`` with lone surrogates) raises a ``ValueError`` naming the
offset, never a crash inside a tokenizer. Every counter (:mod:`ctxfold.tokens.exact_counters`,
:mod:`ctxfold.tokens.estimators`) takes its input through these.
"""

from __future__ import annotations

from collections.abc import Sequence

Text = str | bytes


def as_text(text: Text, where: str = "text") -> str:
    """``text`` as a str: bytes are decoded as strict UTF-8 with an error that names the offset."""
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{where}: not valid UTF-8 at byte {exc.start} ({exc.reason}); decode it yourself, "
                "e.g. data.decode('utf-8', errors='replace'), to count it"
            ) from None
    raise TypeError(f"{where}: expected str or bytes, got {type(text).__name__}")


def check_encodable(text: str, where: str) -> None:
    """Raise a clear ValueError for a str a tokenizer cannot take (lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}: contains a lone surrogate at character {exc.start}, which is not text any "
            "tokenizer can encode; clean it with s.encode('utf-8', 'replace').decode()"
        ) from None


def as_texts(texts: Sequence[Text]) -> list[str]:
    """Each text of a batch as a str (:func:`as_text`, named by its index); one text alone is refused."""
    if isinstance(texts, (str, bytes)):
        raise TypeError("count_batch takes a sequence of texts, not one text; use count() for one")
    return [as_text(t, f"texts[{i}]") for i, t in enumerate(texts)]


def check_each_encodable(texts: Sequence[str]) -> None:
    """:func:`check_encodable` on each text of a batch, named by its index."""
    for i, t in enumerate(texts):
        check_encodable(t, f"texts[{i}]")
