"""The message model every part of ctxfold works on, and the trace formats it is read from and written to.

- :mod:`~ctxfold.chat.messages`: ``Conversation``, ``Message``, tool calls and their results.
- :mod:`~ctxfold.chat.codec`: the lossless JSON form of the model (session logs, dumps).
- :mod:`~ctxfold.chat.integrity`: the structural checks (every tool call answered, no orphan results).
- :mod:`~ctxfold.chat.formats`: OpenAI, Anthropic, Claude Code, OpenHands and trajectory traces.
"""
