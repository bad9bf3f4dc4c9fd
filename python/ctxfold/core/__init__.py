"""The token level: the Python face of the C++ core.

- :mod:`~ctxfold.core.ledger`: per-message token counts, in the arrays the core reads.
- :mod:`~ctxfold.core.tail`: where a verbatim tail starts, at a clean chat boundary.
- :mod:`~ctxfold.core.kvplan`: which cached KV survives a rewrite.

Nothing here knows about messages, counters or templates; every layer above may use it.
"""
