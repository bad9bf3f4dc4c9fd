"""Tokens: counting them, and the chat templates that turn messages into them.

- :mod:`~ctxfold.tokens.counting` (``load_counter``): the exact counters
  (:mod:`~ctxfold.tokens.exact_counters`) and the calibrated estimate (:mod:`~ctxfold.tokens.estimators`,
  fitted by :mod:`~ctxfold.tokens.calibration`).
- :mod:`~ctxfold.tokens.templates`: chat templates, built-in presets and Jinja ones from model files
  (:mod:`~ctxfold.tokens.gguf`, :mod:`~ctxfold.tokens.llama_model`), rendered in a sandbox.
- :mod:`~ctxfold.tokens.accounting`: a whole request's prompt tokens, message by message.
"""
