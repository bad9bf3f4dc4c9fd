"""Adapters that bind ctxfold's engine API (:mod:`ctxfold.engine`) to a real inference engine.

Each adapter lives in its own module with its own optional extra, imported only when asked for:
``ctxfold.engines.llama_cpp`` (``pip install 'ctxfold[llama]'``) runs a GGUF model through llama.cpp
and executes ctxfold's KV plan on llama.cpp's own KV cache.
"""
