"""ctxfold inside the agent frameworks people use, each behind its own extra.

- :mod:`ctxfold.integrations.langchain`: middleware for LangChain's ``create_agent`` (``pip install
  "ctxfold[langchain]"``), a drop-in for its ``SummarizationMiddleware``.

Nothing here is imported by the package root: a framework is loaded only when its module is.
"""
