"""How the proxy builds a conversation's compactor: one counter and template for all (both stateless and
thread-safe), the summarizer the configuration asks for (the upstream model by default), and its journal
in the session store (whose commit puts the archive where it lives: serve.stored_sessions)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxfold.chat.messages import Conversation, Message
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.store import BufferedLog
from ctxfold.serve.config import ProxyConfig
from ctxfold.serve.upstream import UpstreamClient
from ctxfold.tokens.counting import TokenCounter

if TYPE_CHECKING:
    from ctxfold.serve.sessions import SessionStore


class Compactors:
    """The proxy's compactor factory (``SessionStore``'s ``make_compactor``: :meth:`for_store`)."""

    def __init__(self, config: ProxyConfig, counter: TokenCounter, template: Any,
                 client: Callable[[], UpstreamClient]) -> None:
        self.config = config
        self.counter = counter
        self.template = template
        self._client = client
        self.sessions: SessionStore | None = None  # set once it exists: a summary's model is its key's
        self.models: dict[str, str] = {}  # session key -> model of its first request, for upstream summaries

    def _sessions(self) -> SessionStore:
        if self.sessions is None:  # not an assert: python -O must not turn this into an AttributeError
            raise RuntimeError("a compactor is asked for before the session store exists")
        return self.sessions

    def for_store(self, header: Conversation, path: Path, session_log: BufferedLog) -> Compactor:
        """A compactor whose log and archive go to the session store through ``session_log`` (the proxy
        commits it: its archived outputs to the key's archive, or to ``archive_url``'s object storage)."""
        return Compactor(header, config=self.config.compact, counter=self.counter, template=self.template,
                         summarizer=self.summarizer(path), session_log=session_log)

    def count_view(self, header: Conversation, messages: list[Message]) -> int:
        """Tokens of the request ``header`` and ``messages`` make, with the proxy's counter and template."""
        from ctxfold.tokens.accounting import RequestAccounting

        return RequestAccounting(self.counter, self.template).count_view(header, messages)

    def summarizer(self, path: Path) -> Any:
        """The summarizer the configuration asks for; None: the compactor's extractive one."""
        if self.config.summarizer == "config":
            from ctxfold.compaction.summarize import make_summarizer

            return make_summarizer(self.config.compact)
        if self.config.summarizer == "upstream":
            from ctxfold.serve.summaries import UpstreamSummarizer

            model = self.config.summary_model or self.models.get(self._sessions().key_of(path)) or "default"
            return UpstreamSummarizer(self.config.base_url, model, client=self._client,
                                      api_key=self.config.summary_api_key,
                                      timeout_s=self.config.compact.summary.timeout_s)
        return None
