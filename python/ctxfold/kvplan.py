"""The import path ``ctxfold.kvplan``, kept for users; the code lives in :mod:`ctxfold.core.kvplan`."""

from ctxfold.core.kvplan import (
    KvPlan,
    ShiftSpan,
    common_prefix,
    plan_kv_resync,
)

__all__ = [
    "KvPlan",
    "ShiftSpan",
    "common_prefix",
    "plan_kv_resync",
]
