from __future__ import annotations

import pytest
from gpt import TinyGPT

from lightning_memtenants import activation_check, korthikanti_bytes


def test_korthikanti_formula() -> None:
    # s*b*h*(34 + 5*a*s/h) for s=2048, b=1, h=4096, a=32
    assert korthikanti_bytes(2048, 1, 4096, 32) == 2048 * 4096 * 34 + 5 * 32 * 2048 * 2048


def test_fp32_gpt_layer_is_explained_to_the_byte() -> None:
    s, b, h, a = 128, 4, 128, 4
    model = TinyGPT(n_layer=3, n_embd=h, n_head=a)
    check = activation_check(model, model.example_batch(b, s))
    # worked out by hand: LN1 input 4, QKV input 4, Q/K/V 12, attention output 4, LN2 input 4,
    # fc input 4, GELU input 16, fc_proj input 16 (x s*b*h bytes, fp32); two LayerNorms keep
    # mean and rstd (2 x 4 bytes per token each); fused attention keeps a 4-byte log-sum-exp per head.
    per_layer = 64 * s * b * h + 2 * 8 * s * b + 4 * a * s * b
    assert check.per_layer_bytes == [per_layer] * 3
    assert check.formula_bytes == s * b * h * 34 + 5 * a * s * s * b
    assert check.ratio == pytest.approx(per_layer / check.formula_bytes)
    assert check.explained_bytes == per_layer
    text = check.summary()
    assert "100% of the saved bytes are 4-byte floats" in text
    assert "stores no a*s*s score matrix" in text
    assert "no dropout" in text
    assert f"measured {per_layer:,} (1.000x)" in text


def test_bf16_gpt_layer() -> None:
    s, b, h, a = 64, 2, 64, 4
    model = TinyGPT(n_layer=2, n_embd=h, n_head=a, block_size=64)
    check = activation_check(model, model.example_batch(b, s), precision="bf16-true")
    assert check.per_layer_bytes[0] == check.explained_bytes == 32 * s * b * h + 2 * 4 * s * b + 4 * a * s * b
    assert "4-byte floats" not in check.summary()


def test_attributes_must_be_found_or_given() -> None:
    from torch import nn

    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]))
    with pytest.raises(ValueError, match="hidden and heads"):
        activation_check(model, lambda: None)
