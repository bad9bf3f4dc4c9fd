"""Wire formats both sides of the library speak: the proxy and the summarizers (:mod:`ctxfold.wire.sse`)."""
