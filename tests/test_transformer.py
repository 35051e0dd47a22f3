from __future__ import annotations

import pytest
from gpt import TinyGPT

from lightning_memtenants import ActivationCheck, activation_check, korthikanti_bytes


def test_korthikanti_formula() -> None:
    # s*b*h*(34 + 5*a*s/h) for s=2048, b=1, h=4096, a=32
    assert korthikanti_bytes(2048, 1, 4096, 32) == 2048 * 4096 * 34 + 5 * 32 * 2048 * 2048


def terms(check: ActivationCheck) -> dict[str, tuple[int, int]]:
    return {t.name: (t.formula_bytes, t.measured_bytes) for t in check.terms}


def test_fp32_gpt_layer_is_explained_to_the_byte() -> None:
    s, b, h, a = 128, 4, 128, 4
    sbh, assb = s * b * h, a * s * s * b
    model = TinyGPT(n_layer=3, n_embd=h, n_head=a)
    check = activation_check(model, model.example_batch(b, s))
    # worked out by hand: LN1 input 4, QKV input 4, Q/K/V 12, attention output 4, LN2 input 4,
    # fc input 4, GELU input 16, fc_proj input 16 (x s*b*h bytes, fp32); two LayerNorms keep
    # mean and rstd (2 x 4 bytes per token each); fused attention keeps a 4-byte log-sum-exp per head.
    per_layer = 64 * sbh + 2 * 8 * s * b + 4 * a * s * b
    assert check.per_layer_bytes == [per_layer] * 3
    assert check.formula_bytes == s * b * h * 34 + 5 * a * s * s * b
    assert check.ratio == pytest.approx(per_layer / check.formula_bytes)
    assert terms(check) == {
        "hidden activations": (32 * sbh, 64 * sbh),
        "dropout masks": (2 * sbh, 0),
        "attention scores": (4 * assb, 0),
        "attention mask": (assb, 0),
        "per-token values": (0, 16 * s * b + 4 * a * s * b),
    }
    assert sum(f for f, _ in terms(check).values()) == check.formula_bytes
    assert check.explained_bytes == per_layer
    text = check.summary()
    assert "16 float32 values of s*b*h; the formula counts 16 at 2 bytes" in text
    assert "keeps no a*s*s score matrix" in text
    assert "no dropout in this layer" in text
    assert "8 float32 values per token" in text


def test_dropout_layer_keeps_float_masks_and_the_score_matrix() -> None:
    # With dropout the CPU's attention takes its math path: scores and softmax are kept, and both
    # dropouts draw float masks with bernoulli_, 4 bytes where the formula assumes 1.
    s, b, h, a = 64, 2, 96, 4
    sbh, assb = s * b * h, a * s * s * b
    model = TinyGPT(n_layer=2, n_embd=h, n_head=a, block_size=64, dropout=0.1)
    check = activation_check(model, model.example_batch(b, s))
    assert terms(check) == {
        "hidden activations": (32 * sbh, 16 * 4 * sbh),
        "dropout masks": (2 * sbh, 2 * 4 * sbh),
        "attention scores": (4 * assb, 2 * 4 * assb),
        "attention mask": (assb, 4 * assb),
        "per-token values": (0, 4 * 4 * s * b),
    }
    assert check.per_layer_bytes == [check.explained_bytes] * 2
    text = check.summary()
    assert "2 float32 masks of s*b*h; the formula counts 2 at 1 byte" in text
    assert "2 float32 tensors of a*s*s*b" in text
    assert "1 float32 masks of a*s*s*b" in text


def test_bf16_mixed_layer_names_both_dtypes_and_the_weight_casts() -> None:
    # Under autocast the residual stream (the LayerNorm inputs) stays fp32, the matmul inputs are
    # bf16, and each linear keeps its bf16 weight cast: 12*h*h values of 2 bytes per layer.
    s, b, h, a = 64, 2, 96, 4
    sbh = s * b * h
    model = TinyGPT(n_layer=2, n_embd=h, n_head=a, block_size=64)
    check = activation_check(model, model.example_batch(b, s), precision="bf16-mixed")
    assert terms(check) == {
        "hidden activations": (32 * sbh, 2 * 4 * sbh + 14 * 2 * sbh),
        "dropout masks": (2 * sbh, 0),
        "attention scores": (4 * a * s * s * b, 0),
        "attention mask": (a * s * s * b, 0),
        "per-token values": (0, (2 * 2 + a) * 4 * s * b),
        "weight casts": (0, 12 * h * h * 2),
    }
    assert check.per_layer_bytes == [check.explained_bytes] * 2
    text = check.summary()
    assert "2 float32, 14 bfloat16 values of s*b*h" in text
    assert f"autocast's {12 * h * h:,} bfloat16 values of weights cast for matmuls" in text


def test_bf16_gpt_layer() -> None:
    s, b, h, a = 64, 2, 64, 4
    model = TinyGPT(n_layer=2, n_embd=h, n_head=a, block_size=64)
    check = activation_check(model, model.example_batch(b, s), precision="bf16-true")
    assert check.per_layer_bytes[0] == check.explained_bytes == 32 * s * b * h + 2 * 4 * s * b + 4 * a * s * b
    assert "16 bfloat16 values of s*b*h" in check.summary()


def test_attributes_must_be_found_or_given() -> None:
    from torch import nn

    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]))
    with pytest.raises(ValueError, match="hidden and heads"):
        activation_check(model, lambda: None)
