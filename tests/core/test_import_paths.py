"""The import paths users have keep working after the move into layer folders, and give the same objects."""

from __future__ import annotations

import importlib

import pytest

# public path -> where the code lives
KEPT = {
    "ctxfold.compactor": "ctxfold.compaction.compactor",
    "ctxfold.config": "ctxfold.compaction.config",
    "ctxfold.counting": "ctxfold.tokens.counting",
    "ctxfold.templates": "ctxfold.tokens.templates",
    "ctxfold.tail": "ctxfold.core.tail",
    "ctxfold.kvplan": "ctxfold.core.kvplan",
    "ctxfold.messages": "ctxfold.chat.messages",
    "ctxfold.archive": "ctxfold.compaction.archive",
    "ctxfold.summarize": "ctxfold.compaction.summarize",
}


@pytest.mark.parametrize(("public", "home"), sorted(KEPT.items()))
def test_public_path_exports_the_same_objects(public: str, home: str) -> None:
    shim = importlib.import_module(public)
    real = importlib.import_module(home)
    assert shim.__all__, public
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(real, name), f"{public}.{name}"
    # every public name of the real module is reachable through the kept path
    public_names = getattr(real, "__all__", None) or [
        n for n, v in vars(real).items() if not n.startswith("_") and getattr(v, "__module__", None) == home
    ]
    assert set(public_names) <= set(shim.__all__), set(public_names) - set(shim.__all__)


def test_names_the_docs_use() -> None:
    from ctxfold.compactor import AsyncCompactor, Compactor
    from ctxfold.config import CompactConfig
    from ctxfold.counting import load_counter
    from ctxfold.engine import EngineSequence
    from ctxfold.templates import get_template

    assert Compactor.__module__ == "ctxfold.compaction.compactor"
    assert AsyncCompactor is not None and EngineSequence is not None
    assert CompactConfig.__module__ == "ctxfold.compaction.config"
    assert callable(load_counter) and callable(get_template)
