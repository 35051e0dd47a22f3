"""The models ``gpu_check.py`` measures on a device and predicts: plain ``nn.Module``s, each with its batch and loss.

Each is built from its config (no download) under ``torch.manual_seed(0)``, small enough that a step takes
milliseconds on an H100 and its prediction seconds on a CPU, large enough that its memory is tens to hundreds
of MiB. ``smoke=True`` gives the same code with tiny sizes, to check on a CPU that it runs. ``CASES`` lists them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


@dataclass(frozen=True)
class Case:
    """One model of the check: how to build it, its batch, its loss and how it trains.

    Args:
        name: the key of ``CASES``.
        what: one line for the table.
        build: ``build(smoke) -> nn.Module``, the same parameters on every call.
        batch: ``batch(smoke) -> batch`` of CPU tensors (a tuple or a dict).
        loss: ``loss(model, batch) -> Tensor``.
        optimizer: ``"adamw"`` or ``"adam"``.
        precision: Lightning's name for how the plain loop runs: ``"32-true"`` or ``"bf16-mixed"`` (autocast).
    """

    name: str
    what: str
    build: Callable[[bool], nn.Module]
    batch: Callable[[bool], Any]
    loss: Callable[[nn.Module, Any], Tensor]
    optimizer: str = "adamw"
    precision: str = "32-true"

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The optimizer the loop (and the prediction) uses, with PyTorch's defaults for the device.

        Args:
            params: the parameters.

        Returns:
            ``Adam`` or ``AdamW``.
        """
        if self.optimizer == "adam":
            return torch.optim.Adam(params)
        return torch.optim.AdamW(params, lr=1e-4)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _pick(smoke: bool, full: dict[str, int], tiny: dict[str, int]) -> dict[str, int]:
    return tiny if smoke else full


# -- the networks ---------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm Transformer block: causal SDPA attention and a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Checkpointed(nn.Module):
    """A block under selective activation checkpointing: the outputs of the matmuls are saved, the rest recomputed.

    ``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts`` and an op policy, as torchtitan's
    "op" SAC applies it per block (it uses ``checkpoint_wrapper``, which calls the same function).
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        context_fn = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=context_fn)


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """SAC's op policy: keep the outputs of the matrix multiplications, recompute everything else.

    Args:
        ctx: the checkpoint's context (unused).
        op: the ATen operator.
        *args: its arguments (unused).
        **kwargs: its keyword arguments (unused).

    Returns:
        ``CheckpointPolicy.MUST_SAVE`` for ``mm``, ``addmm`` and ``bmm``, else ``PREFER_RECOMPUTE``.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class TinyGPT(nn.Module):
    """A GPT of ``Block``s in an ``nn.ModuleList`` (FSDP2 shards each), each under SAC where ``sac``."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int, seq: int, sac: bool = False) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        blocks = [Block(width, heads) for _ in range(layers)]
        self.blocks = nn.ModuleList([Checkpointed(b) for b in blocks] if sac else blocks)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Tagger(nn.Module):
    """A 2-layer LSTM over token embeddings, a tag for each token (cuDNN's LSTM on a GPU)."""

    def __init__(self, vocab: int, width: int, tags: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, tags)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


def _conv(cin: int, cout: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


def cnn(width: int) -> nn.Module:
    """A VGG-like stack of 3 x 3 convolutions with BatchNorm, four stages, then a linear classifier of 1,000.

    Args:
        width: the first stage's channels (doubled at each stage).

    Returns:
        The network, for RGB images.
    """
    layers: list[nn.Module] = [*_conv(3, width, 2)]
    for stage in range(4):
        cin = width * 2 ** max(stage - 1, 0)
        layers += [*_conv(cin, width * 2**stage, 2 if stage else 1), *_conv(width * 2**stage, width * 2**stage, 1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width * 8, 1000))


# -- the builders and batches ---------------------------------------------------------------------------------------


def hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """A Hugging Face model's own loss: the batch's keys are its keyword arguments.

    Args:
        model: the model.
        batch: its keyword arguments, ``labels`` among them.

    Returns:
        The loss.
    """
    return model(**batch).loss


def token_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Cross-entropy of per-token logits against per-token targets.

    Args:
        model: a network from tokens to logits.
        batch: ``(tokens, targets)``.

    Returns:
        The loss.
    """
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def class_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Cross-entropy of a classifier.

    Args:
        model: a classifier.
        batch: ``(inputs, labels)``.

    Returns:
        The loss.
    """
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def seed_loss(model: nn.Module, batch: tuple[Tensor]) -> Tensor:
    """The article's loss, ``model(x).pow(2).mean()``.

    Args:
        model: the seed MLP.
        batch: ``(x,)``.

    Returns:
        The loss.
    """
    return model(batch[0]).pow(2).mean()


def demo_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Lightning's demo Transformer's own step: NLL of its log-softmax output against the target tokens.

    Args:
        model: ``lightning.pytorch.demos.Transformer``.
        batch: ``(inputs, targets)``.

    Returns:
        The loss.
    """
    inputs, targets = batch
    return F.nll_loss(model(inputs, targets), targets.view(-1))


def _lm_sizes(smoke: bool) -> dict[str, int]:
    return _pick(smoke, {"batch": 8, "seq": 512}, {"batch": 2, "seq": 16})


def _lm_batch(vocab: int, smoke: bool, labels: bool = True) -> dict[str, Tensor]:
    s = _lm_sizes(smoke)
    ids = torch.randint(0, vocab, (s["batch"], s["seq"]), generator=_generator())
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if labels:
        batch["labels"] = ids
    return batch


def _hf(name: str, **config: Any) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config_class, model_class = name.split(".")
    built = getattr(tf, model_class)(getattr(tf, config_class)(**config))
    assert isinstance(built, nn.Module)
    return built


GPT2_VOCAB, LLAMA_VOCAB, BERT_VOCAB, T5_VOCAB = 50257, 32000, 30522, 32128


def gpt2(smoke: bool) -> nn.Module:
    """GPT-2 small's shape but 2 layers: vocabulary 50,257, 1,024 positions, dropout 0.1."""
    s = _pick(smoke, {"width": 768, "heads": 12}, {"width": 32, "heads": 2})
    return _hf(
        "GPT2Config.GPT2LMHeadModel", n_layer=2, n_embd=s["width"], n_head=s["heads"], attn_implementation="sdpa"
    )


def llama(smoke: bool) -> nn.Module:
    """A small Llama: width 512, 4 layers, 8 heads over 4 key-value heads, SwiGLU 1,376, vocabulary 32,000."""
    s = _pick(
        smoke,
        {"width": 512, "layers": 4, "heads": 8, "kv": 4, "ffn": 1376},
        {"width": 32, "layers": 2, "heads": 2, "kv": 1, "ffn": 64},
    )
    return _hf(
        "LlamaConfig.LlamaForCausalLM",
        vocab_size=LLAMA_VOCAB if not smoke else 256,
        hidden_size=s["width"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )


def bert(smoke: bool) -> nn.Module:
    """BERT-base's shape but 2 layers, masked-LM head: vocabulary 30,522, dropout 0.1."""
    s = _pick(smoke, {"width": 768, "heads": 12}, {"width": 32, "heads": 2})
    return _hf(
        "BertConfig.BertForMaskedLM",
        vocab_size=BERT_VOCAB if not smoke else 256,
        hidden_size=s["width"],
        num_hidden_layers=2,
        num_attention_heads=s["heads"],
        intermediate_size=4 * s["width"],
        attn_implementation="sdpa",
    )


def t5(smoke: bool) -> nn.Module:
    """T5-small's shape but 2 + 2 layers: width 512, 8 heads, feed-forward 2,048, vocabulary 32,128."""
    s = _pick(smoke, {"width": 512, "heads": 8, "ffn": 2048}, {"width": 32, "heads": 2, "ffn": 64})
    return _hf(
        "T5Config.T5ForConditionalGeneration",
        vocab_size=T5_VOCAB if not smoke else 256,
        d_model=s["width"],
        d_kv=s["width"] // s["heads"],
        d_ff=s["ffn"],
        num_layers=2,
        num_decoder_layers=2,
        num_heads=s["heads"],
        decoder_start_token_id=0,
        pad_token_id=0,
    )


def vit(smoke: bool) -> nn.Module:
    """ViT-B/16's shape but 2 layers: patch 16, 1,000 classes, no dropout (transformers' ViT)."""
    s = _pick(smoke, {"width": 768, "heads": 12, "image": 224}, {"width": 32, "heads": 2, "image": 32})
    return _hf(
        "ViTConfig.ViTForImageClassification",
        num_hidden_layers=2,
        hidden_size=s["width"],
        num_attention_heads=s["heads"],
        intermediate_size=4 * s["width"],
        image_size=s["image"],
        num_labels=1000,
        attn_implementation="sdpa",
    )


def mixtral(smoke: bool) -> nn.Module:
    """A tiny Mixtral: width 256, 2 layers, 8 experts, top 2, vocabulary 32,000 (routing: the real router's)."""
    s = _pick(smoke, {"width": 256, "ffn": 512, "heads": 8, "kv": 4}, {"width": 32, "ffn": 64, "heads": 2, "kv": 1})
    return _hf(
        "MixtralConfig.MixtralForCausalLM",
        vocab_size=LLAMA_VOCAB if not smoke else 256,
        hidden_size=s["width"],
        intermediate_size=s["ffn"],
        num_hidden_layers=2,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )


def tiny_gpt(smoke: bool, sac: bool = False) -> nn.Module:
    """Our own GPT: width 1,024, 4 blocks, 16 heads, vocabulary 32,000, 1,024 positions."""
    s = _pick(
        smoke,
        {"width": 1024, "heads": 16, "layers": 4, "vocab": 32000},
        {"width": 32, "heads": 2, "layers": 2, "vocab": 256},
    )
    torch.manual_seed(0)
    return TinyGPT(s["vocab"], s["width"], s["heads"], s["layers"], 1024, sac=sac)


def _tokens(vocab: int, batch: int, seq: int) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=_generator())
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def gpt_batch(smoke: bool) -> tuple[Tensor, Tensor]:
    """8 sequences of 1,024 tokens and their next tokens (2 x 16 in a smoke run)."""
    return _tokens(256 if smoke else 32000, 2 if smoke else 8, 16 if smoke else 1024)


def seed(smoke: bool) -> nn.Module:
    """The article's MLP, Linear 1024 -> 4096 -> 4096 -> 1024."""
    from seed_mlp import seed_model

    torch.manual_seed(0)
    return seed_model()


def seed_batch(smoke: bool) -> tuple[Tensor]:
    """The article's batch of 2,048 rows (16 in a smoke run)."""
    return (torch.randn(16 if smoke else 2048, 1024, generator=_generator()),)


def t5_batch(smoke: bool) -> dict[str, Tensor]:
    """8 sources of 256 tokens and targets of 128 (2 x 16 and 8 in a smoke run)."""
    batch, source, target = (2, 16, 8) if smoke else (8, 256, 128)
    vocab = 256 if smoke else T5_VOCAB
    ids = torch.randint(0, vocab, (batch, source), generator=_generator())
    labels = torch.randint(0, vocab, (batch, target), generator=_generator())
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def image_batch(smoke: bool) -> dict[str, Tensor]:
    """32 images of 224 x 224 and their labels (2 of 32 x 32 in a smoke run)."""
    batch, image = (2, 32) if smoke else (32, 224)
    pixels = torch.randn(batch, 3, image, image, generator=_generator())
    return {"pixel_values": pixels, "labels": torch.randint(0, 1000, (batch,), generator=_generator())}


def cnn_batch(smoke: bool) -> tuple[Tensor, Tensor]:
    """64 images of 224 x 224 and their labels (2 of 32 x 32 in a smoke run)."""
    batch, image = (2, 32) if smoke else (64, 224)
    pixels = torch.randn(batch, 3, image, image, generator=_generator())
    return pixels, torch.randint(0, 1000, (batch,), generator=_generator())


def tagger(smoke: bool) -> nn.Module:
    """``Tagger``: vocabulary 10,000, width 512, 50 tags (256, 32 and 5 in a smoke run)."""
    torch.manual_seed(0)
    return Tagger(256, 32, 5) if smoke else Tagger(10000, 512, 50)


def tag_batch(smoke: bool) -> tuple[Tensor, Tensor]:
    """32 sequences of 256 tokens and a tag each (2 x 16 in a smoke run)."""
    batch, seq, vocab, tags = (2, 16, 256, 5) if smoke else (32, 256, 10000, 50)
    ids = torch.randint(0, vocab, (batch, seq), generator=_generator())
    return ids, torch.randint(0, tags, (batch, seq), generator=_generator())


def demo_transformer(smoke: bool) -> nn.Module:
    """Lightning's demo Transformer with its defaults (width 200, 2 + 2 layers, vocabulary 33,278, dropout 0.2)."""
    from lightning.pytorch.demos import Transformer

    torch.manual_seed(0)
    return Transformer(vocab_size=256) if smoke else Transformer()


def demo_batch(smoke: bool) -> tuple[Tensor, Tensor]:
    """20 sequences of 256 tokens and their next tokens (2 x 16 in a smoke run)."""
    return _tokens(256 if smoke else 33278, 2 if smoke else 20, 16 if smoke else 256)


def _lm(vocab: int, smoke_vocab: int = 256) -> Callable[[bool], dict[str, Tensor]]:
    return lambda smoke: _lm_batch(smoke_vocab if smoke else vocab, smoke)


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("seed", "the article's MLP, batch 2,048, Adam", seed, seed_batch, seed_loss, optimizer="adam"),
        Case("gpt2", "HF GPT-2, 2 layers of 768, batch 8 x 512", gpt2, _lm(GPT2_VOCAB, GPT2_VOCAB), hf_loss),
        Case(
            "gpt2-bf16",
            "HF GPT-2, 2 layers of 768, batch 8 x 512, bf16 autocast",
            gpt2,
            _lm(GPT2_VOCAB, GPT2_VOCAB),
            hf_loss,
            precision="bf16-mixed",
        ),
        Case("llama", "HF Llama, 4 layers of 512 (GQA 8/4), batch 8 x 512", llama, _lm(LLAMA_VOCAB), hf_loss),
        Case("bert", "HF BERT masked LM, 2 layers of 768, batch 8 x 512", bert, _lm(BERT_VOCAB), hf_loss),
        Case("t5", "HF T5, 2 + 2 layers of 512, batch 8 x 256 -> 128", t5, t5_batch, hf_loss),
        Case("vit", "HF ViT-B/16, 2 layers, batch 32 x 224 x 224", vit, image_batch, hf_loss),
        Case(
            "cnn",
            "VGG-like CNN with BatchNorm, width 64, batch 64 x 224 x 224",
            lambda s: _cnn(s),
            cnn_batch,
            class_loss,
        ),
        Case("lstm", "2-layer LSTM tagger of 512 (cuDNN), batch 32 x 256", tagger, tag_batch, token_loss),
        Case(
            "demo-transformer", "Lightning's demo Transformer, batch 20 x 256", demo_transformer, demo_batch, demo_loss
        ),
        Case(
            "mixtral", "HF Mixtral, 2 layers of 256, 8 experts top 2, batch 8 x 512", mixtral, _lm(LLAMA_VOCAB), hf_loss
        ),
        Case("gpt", "our GPT, 4 blocks of 1,024, batch 8 x 1,024", tiny_gpt, gpt_batch, token_loss),
        Case(
            "gpt-sac",
            "our GPT, 4 blocks of 1,024 under SAC (matmuls saved), batch 8 x 1,024",
            lambda s: tiny_gpt(s, sac=True),
            gpt_batch,
            token_loss,
        ),
    )
}


def _cnn(smoke: bool) -> nn.Module:
    torch.manual_seed(0)
    return cnn(8 if smoke else 64)
