"""The KV plan on a real transformer: a tiny Llama-architecture model built from a config with
random weights (CPU torch, nothing downloaded).

"Keep the planned prefix KV, prefill the rest" must give the logits of a full prefill of the
rebuilt sequence. Moving the verbatim tail's KV by its position delta (llama.cpp cache reuse)
is only approximate; how far it drifts is measured and printed, not asserted to be small.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ctxfold.core.kvplan import plan_kv_resync

pytestmark = pytest.mark.slow  # imports transformers and runs a (tiny) model: ~10 s on 2 cores

VOCAB = 512


@pytest.fixture(scope="module")
def model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10_000.0,
    )
    torch.manual_seed(0)
    return (
        LlamaForCausalLM(config).eval().to(torch.float64)
    )  # float64: differences are the plan's, not rounding


def forward(model: Any, ids: np.ndarray, cache: Any = None) -> tuple[Any, Any]:
    from transformers import DynamicCache

    cache = DynamicCache() if cache is None else cache
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64))[None], cache=cache, use_cache=True)
    return out.logits[0], cache  # the cache is updated in place


def keep_prefix(cache: Any, num_tokens: int) -> None:
    """Drop every cached position from num_tokens on (DynamicCache.crop takes how many to remove)."""
    extra = cache.get_seq_length() - num_tokens
    if extra > 0:
        cache.crop(-extra)
    assert cache.get_seq_length() == num_tokens


def conversation() -> tuple[np.ndarray, np.ndarray]:
    """Cached: system + a long history. Rebuilt: system + summary + the last 96 tokens verbatim."""
    rng = np.random.default_rng(1)
    system = rng.integers(0, VOCAB, 37, dtype=np.int32)
    history = rng.integers(0, VOCAB, 300, dtype=np.int32)
    summary = rng.integers(0, VOCAB, 41, dtype=np.int32)
    return np.concatenate([system, history]), np.concatenate([system, summary, history[-96:]])


@pytest.mark.parametrize("page_size_tokens", [1, 16])
def test_planned_prefix_reuse_equals_full_prefill(model: Any, page_size_tokens: int) -> None:
    cached, rebuilt = conversation()
    plan = plan_kv_resync(cached, rebuilt, page_size_tokens=page_size_tokens)
    assert plan.common_prefix_tokens == 37
    assert plan.reuse_tokens == (37 if page_size_tokens == 1 else 32)

    full_logits, _ = forward(model, rebuilt)
    _, engine_cache = forward(model, cached)  # what the engine holds before the rewrite
    keep_prefix(engine_cache, plan.reuse_tokens)  # keep the planned prefix, drop the rest
    for begin, end in plan.prefill_ranges:
        logits, engine_cache = forward(model, rebuilt[begin:end], engine_cache)
    diff = (logits - full_logits[plan.reuse_tokens :]).abs().max().item()
    print(
        f"\npage {page_size_tokens}: reuse {plan.reuse_tokens}, prefill {plan.prefill_tokens}: max |logit diff| {diff:.2e}"
    )
    assert diff <= 1e-4

    # The check can fail: keeping one token past the common prefix changes the result.
    _, wrong = forward(model, cached)
    keep_prefix(wrong, plan.common_prefix_tokens + 1)
    logits_wrong, _ = forward(model, rebuilt[plan.common_prefix_tokens + 1 :], wrong)
    assert (logits_wrong[-1] - full_logits[-1]).abs().max().item() > 1e-3


def _rotate_keys(model: Any, keys: Any, delta: int) -> Any:
    """RoPE keys moved by `delta` positions: RoPE(x, p + d) = R(d) RoPE(x, p) (llama.cpp seq_add)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    positions = torch.full((1, keys.shape[2]), delta, dtype=torch.int64)
    cos, sin = model.model.rotary_emb(keys, positions)
    _, rotated = apply_rotary_pos_emb(keys, keys, cos, sin)
    return rotated


def test_shift_reuse_divergence_is_reported(model: Any) -> None:
    cached, rebuilt = conversation()
    plan = plan_kv_resync(cached, rebuilt, page_size_tokens=1, min_shift_tokens=16)
    assert len(plan.shifts) == 1 and plan.shifts[0].approximate
    span = plan.shifts[0]
    assert (span.old_begin, span.new_begin, span.num_tokens) == (37 + 300 - 96, 37 + 41, 96)

    full_logits, _ = forward(model, rebuilt)
    _, old_cache = forward(model, cached)
    old_kv = [(layer.keys.clone(), layer.values.clone()) for layer in old_cache.layers]

    # Exact prefix, then the summary computed, then the tail's KV moved into place (all but its
    # last token, which is computed to yield the next-token logits).
    keep_prefix(old_cache, plan.reuse_tokens)
    (gap_begin, gap_end), *_ = plan.prefill_ranges_with_shift
    assert (gap_begin, gap_end) == (37, 37 + 41)
    _, cache = forward(model, rebuilt[gap_begin:gap_end], old_cache)
    moved = slice(span.old_begin, span.old_begin + span.num_tokens - 1)
    for i, (k, v) in enumerate(old_kv):
        cache.update(_rotate_keys(model, k[:, :, moved], span.delta), v[:, :, moved], i)
    last_logits, _ = forward(model, rebuilt[-1:], cache)

    # The move itself is right: layer 0's keys and values depend only on token and position, so
    # there the moved KV equals a full prefill's; the drift lives in the deeper layers.
    _, full_cache = forward(model, rebuilt)
    target = slice(span.new_begin, span.new_begin + span.num_tokens - 1)
    layer_drift = []
    for i, layer in enumerate(cache.layers):
        k_diff = (layer.keys[:, :, target] - full_cache.layers[i].keys[:, :, target]).abs().max().item()
        v_diff = (layer.values[:, :, target] - full_cache.layers[i].values[:, :, target]).abs().max().item()
        layer_drift.append(max(k_diff, v_diff))
    # (RoPE angles are computed in float32 inside transformers: rotating by delta and rotating at
    # the new position agree to float32 rounding of the angle, not to float64.)
    assert layer_drift[0] < 1e-4
    assert max(layer_drift[1:]) > 100 * layer_drift[0]

    diff = (last_logits[-1] - full_logits[-1]).abs().max().item()
    scale = full_logits[-1].abs().max().item()
    top_same = int(last_logits[-1].argmax()) == int(full_logits[-1].argmax())
    print(
        f"\nshift reuse of {span.num_tokens - 1} tokens by {span.delta}: max |logit diff| at the last position "
        f"{diff:.3e} (logit scale {scale:.3e}, same argmax: {top_same}); saved {plan.shifted_tokens} of "
        f"{plan.prefill_tokens} prefill tokens; max |KV diff| per layer {[f'{d:.1e}' for d in layer_drift]}"
    )
    assert diff > 1e-6  # approximate, as the plan says: attention to the removed history is baked in
