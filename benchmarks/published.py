"""Our predictions beside published GPU measurements of well-known training set-ups.

Each set-up is re-created as its source ran it, from the source's own code and configuration of its date
(no download: models are built from their configs under fake tensors), and predicted on this CPU with the
public ``dry_run`` for the GPU the source used. Every row says what its source measured (nvidia-smi's used
memory, ``max_memory_reserved``, the peak of allocated or active bytes, or arithmetic) and sets our figure
of the same kind beside it; its assumptions are listed with it (``SetUp.assumptions``), and
``docs/published.md`` is the table with the sources, the assumptions and each residual's cause.

The sources (``SOURCES``):

- Hugging Face, "Model training anatomy" and "Efficient Training on a Single GPU" (v4.21.0): bert-large-uncased
  with the ``Trainer`` on a Tesla V100 16 GB (CUDA 11.2), nvidia-smi's used memory after ``trainer.train()``.
- Rajbhandari et al., "ZeRO" (SC20), section 3.1: 16 bytes per parameter for mixed-precision Adam, GPT-2 1.5B.
- torchtitan's Llama 3.1 8B benchmark of December 2024 (torch nightly of 2024-12-23, torchtitan 9dec370):
  FSDP2 over 8 and 128 H100s with selective (per-op) activation checkpointing, ``max_memory_reserved``.
- torchtitan's (then torchtrain's) pull request #165 of March 2024: Llama 2 7B, FSDP2 over 8 H100s with full and
  selective checkpointing, the peaks of active and reserved bytes.
- Lightning's FSDP guide (2023-08): its 1B demo Transformer with DDP over 2 A100s, ``memory_summary()``'s peak.
- LitGPT's config hub table (2024-04): a full bf16-true finetune of TinyLlama 1.1B on one A10G,
  ``max_memory_allocated``.
- torchtune's README "Optimization flags" table (2024-11-18): a full bf16 finetune of Llama 3.2 3B on an A100,
  the peak of active bytes per step.

Each row whose source published a reserved figure is predicted a second time under the other allocator setting
(the defaults, or ``expandable_segments:True``), printed as a note, to show what the setting changes.

Run: ``nice python benchmarks/published.py [--only ID ...] [--json PATH]``; it prints one line per row as it ends,
then the markdown table (about 2.5 minutes on 2 cores; the 8B model over 8 ranks takes 12 s). It is a benchmark,
not a test: no figure here is tuned to a row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memtenants import Prediction, dry_run
from lightning_memtenants.core.record import StepReport

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class Source:
    """Where a published figure comes from."""

    title: str
    url: str
    date: str


HF_ANATOMY = Source(
    "HF, Model training anatomy", "https://huggingface.co/docs/transformers/model_memory_anatomy", "2022 (v4.21)"
)
HF_SINGLE_GPU = Source(
    "HF, Efficient Training on a Single GPU (v4.21.0)",
    "https://huggingface.co/docs/transformers/v4.21.0/perf_train_gpu_one",
    "2022-07",
)
ZERO = Source("ZeRO (Rajbhandari et al.), section 3.1", "https://arxiv.org/abs/1910.02054", "2019-10 (SC20)")
TORCHTITAN = Source(
    "torchtitan, Llama 3.1 on H100, 2024-12 (benchmarks/llama3_h100_202412_torchtitan.md)",
    "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    "2024-12 (torch nightly 1963fc8 of 2024-12-23, torchtitan 9dec370)",
)
TORCHTUNE = Source(
    "torchtune README, Optimization flags",
    "https://github.com/pytorch/torchtune/blob/1814feb17/README.md#optimization-flags",
    "2024-11-18 (torchtune 1814feb17)",
)
TORCHTRAIN = Source(
    "torchtitan (then torchtrain) PR #165, Used per-parameter FSDP",
    "https://github.com/pytorch/torchtitan/pull/165",
    "2024-03-28 (torch nightly of 2024-03, commit 83c879f)",
)
LIGHTNING_FSDP = Source(
    "Lightning docs, Train models with billions of parameters using FSDP (Trainer)",
    "https://github.com/Lightning-AI/pytorch-lightning/blob/6df43685ee/docs/source-pytorch/advanced/model_parallel/fsdp.rst",
    "2023-08-17 (Lightning 2.1 and torch 2.1 pre-releases)",
)
LITGPT = Source(
    "LitGPT, config_hub/finetune/README.md",
    "https://github.com/Lightning-AI/litgpt/blob/43c44323/config_hub/finetune/README.md",
    "2024-04-24 (litgpt 43c44323)",
)
SOURCES = (HF_ANATOMY, HF_SINGLE_GPU, ZERO, TORCHTITAN, TORCHTRAIN, TORCHTUNE, LIGHTNING_FSDP, LITGPT)
PR165_GIB = 95.0396  # "Memory numbers reported as percentage ...; can convert against 95.0396 GiB GPU memory"
HF_CONTEXT_MIB = 1343  # "GPU memory occupied: 1343 MB" after torch.ones((1, 1)).to("cuda"), the same V100 and page

# The kinds of published figure, and ours of the same kind.
NVIDIA_SMI = "nvidia-smi"  # the device's used memory: the allocator's reserved segments + the CUDA context (+ NCCL)
RESERVED = "max_memory_reserved"  # reserved_bytes.all.peak
ALLOCATED = "max_memory_allocated"  # allocated (or active) bytes' peak
MODEL_STATES = "model states"  # arithmetic: weights + gradients + optimizer state
WEIGHTS_LOADED = "weights loaded"  # nvidia-smi after the model's .to("cuda"), before training


@dataclass(frozen=True)
class Run:
    """What ``dry_run`` is given for a set-up: the model, the batch and the options."""

    model: Callable[[], nn.Module]
    batch: Any
    options: dict[str, Any]
    environ: dict[str, str] = field(default_factory=dict)  # set during the dry run only, as the source's torch did
    allocator: str = ""  # PYTORCH_CUDA_ALLOC_CONF of the source's run ("" for the allocator's defaults)
    of_2022: bool = False  # BERT's attention as transformers 4.21 on torch 1.10 ran it (its backward kept the input)


@dataclass(frozen=True)
class SetUp:
    """A published measurement, how to predict it, and what was assumed to do so."""

    name: str
    setup: str
    gpu: str
    software: str
    source: Source
    published: str  # as the source prints it
    published_bytes: float
    kind: str  # NVIDIA_SMI, RESERVED, ALLOCATED, MODEL_STATES or WEIGHTS_LOADED
    measures: str  # how the source read it
    run: Callable[[], Run]
    assumptions: tuple[str, ...] = ()
    reuse: str | None = None  # the set-up whose dry run this one reads
    world_size: int = 1
    strategy: str | None = None
    cuda_version: str | None = None
    context_mib: float | None = None  # the CUDA context as the source itself measured it (nvidia-smi rows)


# --------------------------------------------------------------------------------------------------------------
# Hugging Face's bert-large rows (V100, 2022) and ZeRO's GPT-2 1.5B arithmetic


def keeping_grads(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` whose ``zero_grad`` zeroes the gradients in place, as ``model.zero_grad()`` did before torch 2.0."""

    class KeepsGrads(cls):  # type: ignore[valid-type,misc]
        def zero_grad(self, set_to_none: bool = True) -> None:
            super().zero_grad(set_to_none=False)

    KeepsGrads.__name__ = KeepsGrads.__qualname__ = cls.__name__
    return KeepsGrads


def adamw(params: Any) -> torch.optim.Optimizer:
    """The Trainer's AdamW (transformers' ``adamw_hf`` of 2022): lr 5e-5, one parameter at a time."""
    return keeping_grads(torch.optim.AdamW)(params, lr=5e-5, weight_decay=0.0, foreach=False)


def adafactor(params: Any) -> torch.optim.Optimizer:
    """``optim="adafactor"``: transformers' Adafactor with the Trainer's options of 2022."""
    from transformers.optimization import Adafactor

    return keeping_grads(Adafactor)(params, lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False)


def bert_large(checkpointing: bool) -> nn.Module:
    """bert-large-uncased for sequence classification (2 labels), from its config, eager attention."""
    import transformers as tf

    config = tf.BertConfig(
        vocab_size=30522,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=512,
        num_labels=2,
        attn_implementation="eager",
    )
    model = tf.BertForSequenceClassification(config)
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # transformers 4.21 called torch.utils.checkpoint.checkpoint(...), reentrant by default in torch 1.10
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


def bert_batch(batch: int) -> dict[str, torch.Tensor]:
    """The pages' dummy data: token ids in [100, 30000), 512 per sequence, a binary label each."""
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(100, 30000, (batch, 512), generator=generator),
        "labels": torch.randint(0, 2, (batch,), generator=generator),
    }


class _KeepsInput(torch.autograd.Function):
    """An identity whose backward node holds one more tensor, freed when backward reaches it."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(kept)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


_TENSOR_SOFTMAX = torch.Tensor.softmax


def softmax(self: torch.Tensor, dim: int, dtype: Any = None) -> torch.Tensor:
    """``Tensor.softmax`` whose backward keeps its input as well as its output, as torch 1.10's did.

    derivatives.yaml of 1.10 read ``self: _softmax_backward_data(grad, result, dim, self)``, so ``SoftmaxBackward``
    saved ``self``; torch 1.11 passes its dtype instead (pytorch#64000; transformers#16043 adapted to the change).
    ``F.softmax`` calls this method once autocast has chosen the dtype: under autocast (``fp32_set_opt_dtype``)
    softmax took the float16 input and gave a float32 result, and kept the float16 input.
    """
    out = _TENSOR_SOFTMAX(self, dim) if dtype is None else _TENSOR_SOFTMAX(self, dim, dtype=dtype)
    if not (torch.is_grad_enabled() and out.requires_grad):
        return out
    return _KeepsInput.apply(out, self.detach())


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def bert_run(batch: int, checkpointing: bool, optimizer: Callable[[Any], Any], precision: str) -> Callable[[], Run]:
    """A Trainer run of bert-large on the V100, as the HF pages ran it (second step, gradients kept)."""
    options = {"loss_fn": hf_loss, "optimizer": optimizer, "precision": precision, "target": "V100", "steps": 2}
    return lambda: Run(partial(bert_large, checkpointing), bert_batch(batch), options, of_2022=True)


HF_TRAINER = (
    "the Trainer of 2022 (torch 1.10) zeroed gradients with model.zero_grad(), then set_to_none=False: gradients"
    " stay allocated between steps; the second step is reported",
    "gradient accumulation 4 at batch 1 is predicted as batch 1 with the gradients kept (each micro-batch is a"
    " batch-1 step adding into the same gradients)",
    "AdamW is transformers' adamw_hf of 2022, one parameter at a time: torch.optim.AdamW(foreach=False)",
    "attention is BERT's eager attention of that time (the a*s*s scores, softmax and dropout mask kept); softmax's"
    " backward keeps its input as well as its output, as torch 1.10's did (pytorch#64000, changed in 1.11); the"
    " additive mask of zeros that 4.21's BertModel made from a mask of ones is added in float32 in every layer",
    "fp16 is 16-mixed with autocast's weight cache; gradient checkpointing is reentrant, as transformers 4.21 called"
    " torch.utils.checkpoint.checkpoint with torch 1.10's default",
    "not modelled: gradient clipping's temporaries (max_grad_norm 1.0), the learning-rate scheduler",
    f"nvidia-smi = our reserved high-water mark + the {HF_CONTEXT_MIB} MiB context the page itself measured"
    " (torch.ones((1, 1)).to('cuda') on the same V100, CUDA 11.2, before lazy module loading)",
)


def gpt2_xl() -> nn.Module:
    """GPT-2's 1.5B-parameter model (XL: 48 layers of width 1600, 25 heads), from its config."""
    import transformers as tf

    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=1600, n_layer=48, n_head=25, attn_implementation="sdpa"))


def zero_run() -> Run:
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8, dtype=torch.long)}
    options = {
        "loss_fn": hf_loss,
        "optimizer": lambda params: torch.optim.Adam(params, lr=1e-4),
        "precision": "16-mixed",
        "target": "V100",
        "steps": 1,
    }
    return Run(gpt2_xl, batch, options)


# --------------------------------------------------------------------------------------------------------------
# torchtitan's Llama 3.1 8B (commit 9dec370, 2024-12-26): its Transformer, SAC op policy, FSDP2 and AdamW


class RMSNorm(nn.Module):
    """torchtitan's (and torchtune's) RMSNorm: computed in float32, cast back, scaled."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class TitanAttention(nn.Module):
    """torchtitan's ``Attention``: wq/wk/wv/wo, rotary embedding by complex product, ``repeat_kv``, causal SDPA."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = (self._rotary(t, freqs_cis) for t in (q, k))
        repeat = self.heads // self.kv_heads
        k, v = (
            t[:, :, :, None, :].expand(b, s, self.kv_heads, repeat, self.head_dim).reshape(b, s, -1, self.head_dim)
            for t in (k, v)
        )
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))

    @staticmethod
    def _rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        complex_x = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, complex_x.shape[-1])
        return torch.view_as_real(complex_x * freqs).flatten(3).type_as(x)


class TitanBlock(nn.Module):
    """torchtitan's ``TransformerBlock``: attention and SwiGLU feed-forward, each after an RMSNorm, residuals."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.attention = TitanAttention(dim, heads, kv_heads)
        self.attention_norm, self.ffn_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TitanLlama(nn.Module):
    """torchtitan's ``Transformer``, flavor "8B" by default (Llama 3.1 8B's shapes, untied output)."""

    def __init__(
        self,
        layers: int = 32,
        dim: int = 4096,
        heads: int = 32,
        kv_heads: int = 8,
        ffn: int = 14336,
        vocab: int = 128256,
        max_seq_len: int = 8192,
        eps: float = 1e-5,
        rope_theta: float = 500000.0,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, heads, kv_heads, ffn, eps) for i in range(layers)})
        self.norm = RMSNorm(dim, eps)
        self.output = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        inverse = 1.0 / (rope_theta ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
        angles = torch.outer(
            torch.arange(max_seq_len * 2).float(), inverse
        )  # precompute_freqs_cis(.., max_seq_len * 2)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def titan_save_list() -> set[Any]:
    """torchtitan's ``_save_list`` of 2024-12: the ops whose outputs its selective checkpointing keeps."""
    ops = torch.ops
    return {
        ops.aten.mm.default,
        ops.aten._scaled_dot_product_efficient_attention.default,
        ops.aten._scaled_dot_product_flash_attention.default,
        ops._c10d_functional.reduce_scatter_tensor.default,
        ops.aten.abs.default,
        ops.aten.max.default,
    }


def titan_sac_context() -> Any:
    """torchtitan's ``selective_checkpointing_context_fn``: save every op of ``_save_list`` but every second mm."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save_list = titan_save_list()
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        save = func in save_list and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class TitanTraining(L.LightningModule):
    """torchtitan's ``train.py`` step as a LightningModule: AC, then FSDP2 per block and the root, AdamW.

    ``configure_model`` does what ``parallelize_llama`` did: ``checkpoint_wrapper`` with the op policy on every
    block, then ``fully_shard`` per block with bf16 parameters and float32 gradient reduction, the last block not
    resharded after forward, then the root.
    """

    def __init__(self, checkpointing: str = "op", **shapes: Any) -> None:
        super().__init__()
        self.checkpointing = checkpointing  # "op": selective per op; "full": every block
        self.model = TitanLlama(**shapes)

    def configure_model(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        layers = self.model.layers
        context = {"context_fn": titan_sac_context} if self.checkpointing == "op" else {}
        for name, block in list(layers.named_children()):
            layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **context))
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name, block in layers.items():
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=int(name) < len(layers) - 1)
        # torchtitan passed True for the root; the torch of 2024 never resharded a root after forward
        # (FSDPState._lazy_init set its post_forward_mesh_info to None); True is respected since pytorch#154704
        fully_shard(self.model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        tokens, labels = batch
        pred = self.model(tokens)
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=False, foreach=True
        )


def titan_run(world_size: int, allocator: str) -> Callable[[], Run]:
    """torchtitan's Llama 3.1 8B at local batch 2 x 8192 over ``world_size`` H100s."""
    tokens = (torch.zeros(2, 8192, dtype=torch.long), torch.zeros(2, 8192, dtype=torch.long))
    options = {"target": "H100", "strategy": "fsdp", "world_size": world_size, "steps": 2}
    # torch of 2024-12 tried flash attention first on H100; cuDNN attention led only from the CUDA 13 builds on
    environ = {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}
    return lambda: Run(TitanTraining, tokens, options, environ, allocator)


def torchtrain_run(checkpointing: str) -> Callable[[], Run]:
    """torchtrain's (torchtitan's of 2024-03) Llama 2 7B at local batch 8 x 2048 over 8 H100s, FSDP2."""
    tokens = (torch.zeros(8, 2048, dtype=torch.long), torch.zeros(8, 2048, dtype=torch.long))
    options = {"target": "H100", "strategy": "fsdp", "world_size": 8, "steps": 2}
    # Llama 2 7B: multi-head attention, ffn 11008 (multiple_of 256), vocab 32000, freqs_cis of 2 x 32768 positions
    shapes = {"kv_heads": 32, "ffn": 11008, "vocab": 32000, "max_seq_len": 32768, "rope_theta": 10000.0}
    model = partial(TitanTraining, checkpointing, **shapes)
    return lambda: Run(model, tokens, options, {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}, "")


TITAN = (
    "the model is torchtitan's Transformer of 9dec370 re-typed (flavor 8B: 32 layers, dim 4096, 32 heads, 8 kv heads,"
    " ffn 14336, vocab 128256, untied output, complex64 freqs_cis buffer of 2 x 8192 positions, RMSNorm in float32)",
    "the run is Table 1's: local batch 2 x 8192 (the toml says 1; the table 2), fp32 parameters built, FSDP2 with"
    " MixedPrecisionPolicy(bf16, reduce float32), per block then the root, the last block not resharded after"
    " forward, the root never resharded (the torch of that date ignored True for a root until pytorch#154704)",
    "selective activation checkpointing, option 'op': checkpoint_wrapper(context_fn=...) on every block with"
    " torchtitan's _save_list policy (every second mm recomputed): wq, wv, w1, w2 and the flash attention kept",
    "attention: flash (TORCH_CUDNN_SDPA_DEPRIORITIZED=1 for the run: the torch of 2024-12 tried flash first on H100;"
    " cuDNN attention, which the policy would not keep, led only in later builds)",
    "AdamW(lr 3e-4, betas (0.9, 0.95), weight decay 0.1, foreach=True, fused=False) on the float32 shards;"
    " zero_grad(set_to_none=True) before the step; the loss is cross_entropy on the float32 copy of the logits",
    "not modelled: clip_grad_norm_(foreach) (a float32 norm per gradient), the lr scheduler, float8 (off), compile"
    " (off), the profiler",
    "the figure is rank 0's reserved_bytes.all.peak over a 10-step window; ours is the highest reserved of the two"
    " steps predicted",
)


TORCHTRAIN_ASSUMED = (
    "the model is torchtrain's Transformer of 83c879f (flavor 7B = Llama 2 7B: 32 layers, dim 4096, 32 heads, no"
    " grouped-query attention, ffn 11008, vocab 32000, untied output cast .float(), freqs_cis of 2 x 32768"
    " positions)",
    "the run is the PR's: local batch 8 x 2048, FSDP2 with MixedPrecisionPolicy(bf16, reduce float32) per block"
    " (checkpoint-wrapped first) then the root, the last block not resharded after forward, the root never"
    " resharded (torch of that date); AdamW(lr 3e-4, betas (0.9, 0.95), weight decay 0.1, foreach=True)",
    "full AC is checkpoint_wrapper(NO_REENTRANT, preserve_rng_state=False) on every block",
    "attention: flash (the torch nightlies of 2024-03 tried flash first on H100)",
    "the allocator's defaults: run_llama_train.sh of 83c879f sets no PYTORCH_CUDA_ALLOC_CONF",
    "not modelled: clip_grad_norm_ (a float32 norm per gradient), the GradScaler (disabled for bf16)",
    "the figures are shares of 95.0396 GiB logged by the GPU memory monitor, reset at its start, over 1k steps;"
    " ours are the peaks of the two steps predicted; peak active is set beside our allocated peak",
)
TORCHTRAIN_SAC = (
    "selective AC: _pt2_selective_checkpoint_context_fn_gen(policy), saving mm (but every second), flash and"
    " efficient attention and reduce_scatter_tensor: predicted with today's create_selective_checkpoint_contexts and"
    " the same policy"
)


# --------------------------------------------------------------------------------------------------------------
# torchtune's Llama 3.2 3B full finetune (commit 1814feb17, 2024-11-18), packed 2 x 4096, bf16, on an A100


class TuneAttention(nn.Module):
    """torchtune's ``MultiHeadAttention`` for Llama: rotary in float32 by stacked halves, k/v expanded, SDPA."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.output_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self._rotary(self.q_proj(x).view(b, s, self.heads, self.head_dim), cache, input_pos).transpose(1, 2)
        k = self._rotary(self.k_proj(x).view(b, s, -1, self.head_dim), cache, input_pos).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        shape = (b, self.kv_heads, self.heads // self.kv_heads, -1, self.head_dim)
        k, v = (t.unsqueeze(2).expand(shape).flatten(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s, -1))

    @staticmethod
    def _rotary(x: torch.Tensor, cache: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        rope = cache[input_pos]
        shaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope = rope.view(-1, shaped.size(1), 1, shaped.size(3), 2)
        out = torch.stack(
            [
                shaped[..., 0] * rope[..., 0] - shaped[..., 1] * rope[..., 1],
                shaped[..., 1] * rope[..., 0] + shaped[..., 0] * rope[..., 1],
            ],
            -1,
        )
        return out.flatten(3).type_as(x)


class TuneLayer(nn.Module):
    """torchtune's ``TransformerSelfAttentionLayer`` with Llama's SwiGLU ``FeedForward``."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.attn = TuneAttention(dim, heads, kv_heads)
        self.sa_norm, self.mlp_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.sa_norm(x), cache, input_pos)
        y = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TuneLlama(nn.Module):
    """torchtune's ``llama3_2_3b()``: 28 layers, 3072 wide, 24 heads, 8 kv heads, ffn 8192, tied output."""

    def __init__(self, layers: int = 28, dim: int = 3072, heads: int = 24, kv_heads: int = 8, ffn: int = 8192) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(128256, dim)
        self.layers = nn.ModuleList([TuneLayer(dim, heads, kv_heads, ffn, 1e-5) for _ in range(layers)])
        self.norm = RMSNorm(dim, 1e-5)
        half = dim // heads // 2
        theta = 1.0 / (500000.0 ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))  # scaling keeps its size
        angles = torch.outer(torch.arange(131072).float(), theta)  # Llama3ScaledRoPE's cache of max_seq_len 131072
        self.register_buffer("cache", torch.stack([angles.cos(), angles.sin()], dim=-1), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cache, input_pos)
        return F.linear(self.norm(h), self.tok_embeddings.weight).float()  # TiedLinear, then .float()


def tune_model() -> nn.Module:
    """The model as the recipe makes it, under ``set_default_dtype(bf16)``: its rotary cache stays float32."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return TuneLlama()
    finally:
        torch.set_default_dtype(default)


def tune_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``_loss_step``: logits, labels shifted by an ignore index, ``CrossEntropyLoss``, ``del logits``."""
    labels = batch["labels"]
    logits = model(batch["tokens"], batch["input_pos"])
    labels = torch.hstack((labels[..., 1:], torch.full_like(labels[..., :1], -100)))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def tune_run() -> Run:
    batch = {
        "tokens": torch.zeros(2, 4096, dtype=torch.long),
        "labels": torch.zeros(2, 4096, dtype=torch.long),
        "input_pos": torch.arange(4096).repeat(2, 1),
    }
    options = {
        "loss_fn": tune_loss,
        "optimizer": lambda params: torch.optim.AdamW(params, lr=2e-5),
        "target": "A100",
        "steps": 2,
    }
    return Run(tune_model, batch, options)


TUNE = (
    "the model is torchtune's llama3_2_3b() of 1814feb17 re-typed: 28 layers, 3072 wide, 24 heads, 8 kv heads,"
    " ffn 8192, vocab 128256, output tied to the embedding (TiedLinear) and cast .float(), RMSNorm in float32,"
    " the rotary cache of 131,072 positions in float32 (64 MiB), rotary applied in float32 by stacked halves",
    "the run is the table's 'Baseline + Packed Dataset': batch 2 x 4096 packed, dtype bf16 (weights, gradients and"
    " AdamW's moments all bf16), torch.optim.AdamW(lr 2e-5) with torch's foreach default, no activation"
    " checkpointing, no compile, CrossEntropyLoss on the float32 logits, labels shifted with an ignore index",
    "attention: packing makes torchtune use flex_attention with a block-causal mask (a compiled kernel that keeps"
    " the output and a float32 log-sum-exp); predicted as causal flash SDPA, which keeps the same",
    "the figure is torchtune's get_memory_stats()['peak_memory_active'] (active_bytes.all.peak, reset each step):"
    " ours is the allocated peak, the same where no block waits on another stream",
    "A100 80 GB, torch 2.5 (the stable release of 2024-11; not stated)",
)


# --------------------------------------------------------------------------------------------------------------
# Lightning's FSDP guide (2023-08): the 1B demo Transformer, DDP over 2 A100s


class LanguageModel(L.LightningModule):
    """The guide's LightningModule: Lightning's demo Transformer at 1B parameters, NLL loss, Adam(lr 0.1)."""

    def __init__(self, vocab_size: int = 33278) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=vocab_size, nlayers=32, nhid=4096, ninp=1024, nhead=64)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, target = batch
        output = self.model(inputs, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.1)


def lightning_ddp_run() -> Run:
    batch = (torch.zeros(1, 35, dtype=torch.long), torch.zeros(1, 35, dtype=torch.long))
    return Run(LanguageModel, batch, {"target": "A100", "strategy": "ddp", "world_size": 2, "steps": 2})


LIGHTNING_ASSUMED = (
    "the model is lightning.pytorch.demos.Transformer(vocab 33278 (WikiText2), nlayers=32, nhid=4096, ninp=1024,"
    " nhead=64): 1.01B parameters, float32, its positional table made in forward (a frozen parameter in 2023: the"
    " same 20 MiB)",
    "the run is the guide's: WikiText2 blocks of 35 tokens, batch 1, Trainer(devices=2, strategy='ddp'), 32-true,"
    " Adam(lr 0.1) with torch's foreach default, DDP with its defaults (25 MiB buckets, gradient_as_bucket_view"
    " False: the buckets are a second copy of the gradients)",
    "the figure is torch.cuda.memory_summary()'s peak allocated, printed in MiB by rank 0 after fit; ours is the"
    " allocated peak of the two steps predicted",
    "Adam's foreach step keeps one all-parameter temporary (torch 2.1's, after pytorch#104780; the 2.0 step kept two),"
    " as torch 2.13's does",
)


# --------------------------------------------------------------------------------------------------------------
# LitGPT's full finetune of TinyLlama 1.1B on one A10G (2024-04)


class LitAttention(nn.Module):
    """LitGPT's ``CausalSelfAttention``: one fused qkv projection, k/v expanded to every head, rotary, causal SDPA."""

    def __init__(self, dim: int, heads: int, groups: int) -> None:
        super().__init__()
        self.heads, self.groups, self.head_size = heads, groups, dim // heads
        self.attn = nn.Linear(dim, (heads + 2 * groups) * self.head_size, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        per_group = self.heads // self.groups
        qkv = self.attn(x).view(b, t, self.groups, per_group + 2, self.head_size).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((per_group, 1, 1), dim=2)
        k = k.expand(b, self.groups, per_group, t, self.head_size)
        v = v.expand(b, self.groups, per_group, t, self.head_size)
        q, k, v = (z.reshape(b, -1, t, self.head_size) for z in (q, k, v))
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=self.head_size**-0.5, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.size(-1) // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)


class LitRMSNorm(nn.Module):
    """LitGPT's ``RMSNorm``: in float32, cast back, then scaled."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt(torch.mean(y * y, dim=-1, keepdim=True) + 1e-5)).to(dtype=x.dtype) * self.weight


class LitBlock(nn.Module):
    """LitGPT's ``Block`` for Llama (sequential residual) with ``LLaMAMLP``."""

    def __init__(self, dim: int, heads: int, groups: int, ffn: int) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = LitRMSNorm(dim), LitRMSNorm(dim)
        self.attn = LitAttention(dim, heads, groups)
        self.fc_1 = nn.Linear(dim, ffn, bias=False)
        self.fc_2 = nn.Linear(dim, ffn, bias=False)
        self.proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.norm_1(x), cos, sin) + x
        y = self.norm_2(x)
        return self.proj(F.silu(self.fc_1(y)) * self.fc_2(y)) + x


class LitGPT(nn.Module):
    """LitGPT's ``GPT`` for ``tiny-llama-1.1b``: 22 layers, 2048 wide, 32 heads, 4 query groups, ffn 5632."""

    def __init__(self, max_seq_length: int = 512) -> None:
        super().__init__()
        self.lm_head = nn.Linear(2048, 32000, bias=False)
        self.wte = nn.Embedding(32000, 2048)
        self.h = nn.ModuleList(LitBlock(2048, 32, 4, 5632) for _ in range(22))
        self.ln_f = LitRMSNorm(2048)
        theta = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
        angles = torch.outer(torch.arange(max_seq_length) / 1, theta).repeat(1, 2)  # build_rope_cache, float32
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        x = self.wte(idx)
        for block in self.h:
            x = block(x, self.cos[:t], self.sin[:t])
        return self.lm_head(self.ln_f(x))


def litgpt_model() -> nn.Module:
    """The model under ``fabric.init_module()`` of bf16-true: parameters bf16, the rotary cache float32."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LitGPT()
    finally:
        torch.set_default_dtype(default)


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """LitGPT's ``chunked_cross_entropy``: the logits in rows of 128, one ``cross_entropy`` each, then the mean."""
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    losses = [
        F.cross_entropy(chunk, target, ignore_index=-100, reduction="none")
        for chunk, target in zip(logits.split(chunk_size), targets.split(chunk_size), strict=True)
    ]
    return torch.cat(losses).sum() / max(1, (targets != -100).sum())


def litgpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``fit``'s micro-step: logits, the chunked loss of the shifted targets, over the accumulation steps."""
    input_ids, targets = batch
    logits = model(input_ids)
    return chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:]) / 8


def litgpt_run() -> Run:
    batch = (torch.zeros(4, 512, dtype=torch.long), torch.zeros(4, 512, dtype=torch.long))
    options = {
        "loss_fn": litgpt_loss,
        "optimizer": lambda params: torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0, betas=(0.9, 0.95)),
        "target": "A10G",
        "steps": 2,
        "accumulate_grad_batches": 2,
    }
    return Run(litgpt_model, batch, options)


LITGPT_ASSUMED = (
    "the model is LitGPT's GPT of 43c44323 for tiny-llama-1.1b, re-typed: 22 layers, 2048 wide, 32 heads, 4 query"
    " groups (head size 64), LLaMAMLP 5632, vocab 32000, untied lm_head, RMSNorm in float32, a fused qkv projection,"
    " k and v expanded to every head, rotary with a float32 cos/sin cache of max_seq_length 512",
    "the run is config_hub/finetune/tiny-llama/full.yaml: one device, bf16-true (weights, gradients and AdamW's"
    " moments bf16), micro batch 4, max_seq_length 512, AdamW(lr 2e-4, weight decay 0, betas (0.9, 0.95)) with the"
    " foreach default, no gradient clipping, chunked_cross_entropy (128-row chunks) of the shifted logits",
    "global batch 32 is 8 micro-batches a step: predicted as 2 micro-batches a step with the gradients kept between"
    " them, whose peak is that of any later micro-batch",
    "the peak micro-batch is padded to 512 tokens: Alpaca2k has samples longer than 512 tokens, cut to 512",
    "attention: flash (bf16 on sm86, causal)",
    "the figure is torch.cuda.max_memory_allocated() / 1e9 after the whole fit, validation and the sample generation"
    " included (both under no_grad, far below a training step); ours is the allocated peak of the steps predicted",
)


# --------------------------------------------------------------------------------------------------------------
# The rows


def _bert(name: str, setup: str, published: int, source: Source, run: Callable[[], Run]) -> SetUp:
    return SetUp(
        name,
        setup,
        "V100",
        "torch 1.10, transformers 4.21, CUDA 11.2",
        source,
        f"{published} MB",
        published * MiB,
        NVIDIA_SMI,
        "nvidia-smi used after trainer.train() (nvmlDeviceGetMemoryInfo(handle).used // 1024**2)",
        run,
        HF_TRAINER,
        cuda_version="11.2",
        context_mib=HF_CONTEXT_MIB,
    )


SETUPS = [
    SetUp(
        "bert-loaded",
        "bert-large-uncased loaded with .to('cuda') (before training)",
        "V100",
        "torch 1.10, transformers 4.21, CUDA 11.2",
        HF_ANATOMY,
        "2631 MB",
        2631 * MiB,
        WEIGHTS_LOADED,
        "nvidia-smi used (context + weights)",
        bert_run(4, False, adamw, "32-true"),
        (
            "ours: reserved at the first batch_start (the weights and a 16 KiB batch) + the page's"
            f" {HF_CONTEXT_MIB} MiB context",
        ),
        reuse="bert-vanilla",
        cuda_version="11.2",
        context_mib=HF_CONTEXT_MIB,
    ),
    _bert(
        "bert-vanilla",
        "bert-large-uncased, batch 4 x 512, fp32, AdamW (Trainer defaults)",
        14949,
        HF_ANATOMY,
        bert_run(4, False, adamw, "32-true"),
    ),
    _bert(
        "bert-accumulation",
        "same, batch 1, gradient accumulation 4",
        8681,
        HF_SINGLE_GPU,
        bert_run(1, False, adamw, "32-true"),
    ),
    _bert(
        "bert-checkpointing",
        "same, batch 1, accumulation 4, gradient checkpointing",
        6775,
        HF_SINGLE_GPU,
        bert_run(1, True, adamw, "32-true"),
    ),
    _bert(
        "bert-fp16",
        "bert-large-uncased, batch 4 x 512, fp16 mixed precision",
        13939,
        HF_SINGLE_GPU,
        bert_run(4, False, adamw, "16-mixed"),
    ),
    _bert(
        "bert-fp16-checkpointing",
        "same, batch 1, accumulation 4, checkpointing, fp16",
        7275,
        HF_SINGLE_GPU,
        bert_run(1, True, adamw, "16-mixed"),
    ),
    _bert(
        "bert-adafactor",
        "bert-large-uncased, batch 4 x 512, fp32, Adafactor",
        12295,
        HF_SINGLE_GPU,
        bert_run(4, False, adafactor, "32-true"),
    ),
    _bert(
        "bert-all-adafactor",
        "same, batch 1, accumulation 4, checkpointing, fp16, Adafactor",
        4847,
        HF_SINGLE_GPU,
        bert_run(1, True, adafactor, "16-mixed"),
    ),
    SetUp(
        "zero-gpt2-1.5b",
        "GPT-2 1.5B, mixed-precision Adam: model states (2 + 2 + 12 bytes per parameter)",
        "V100",
        "(arithmetic)",
        ZERO,
        "24 GB",
        24e9,
        MODEL_STATES,
        "arithmetic (16 bytes x 1.5B), not a measurement",
        zero_run,
        ("ours: weights + gradients + optimizer state of a GPT-2 XL config (1.56B parameters) under 16-mixed Adam",),
    ),
    SetUp(
        "titan-8b-fsdp8",
        "Llama 3.1 8B, FSDP2 x 8, selective (op) AC, batch 2 x 8192, bf16 / fp32 reduce, AdamW, expandable segments",
        "H100",
        "torch nightly 2024-12-23, torchtitan 9dec370",
        TORCHTITAN,
        "82.4 GiB",
        82.4 * GiB,
        RESERVED,
        "Table 1, FSDP row: rank 0's memory_stats()['reserved_bytes.all.peak'] / 2**30, logged every 10 steps",
        titan_run(8, "expandable_segments:True"),
        (
            *TITAN,
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as run_llama_train.sh of 9dec370 sets it for torchrun"
            " on one host",
        ),
        world_size=8,
        strategy="fsdp",
    ),
    SetUp(
        "titan-8b-fsdp128",
        "same over 128 GPUs (16 hosts), default allocator",
        "H100",
        "torch nightly 2024-12-23, torchtitan 9dec370",
        TORCHTITAN,
        "67.0 GiB",
        67.0 * GiB,
        RESERVED,
        "Table 3, FSDP row: as Table 1",
        titan_run(128, ""),
        (
            *TITAN,
            "the allocator's defaults: multinode_trainer.slurm of 9dec370 launches the 128-GPU runs without"
            " PYTORCH_CUDA_ALLOC_CONF (whether Meta's own launcher set it is not said)",
        ),
        world_size=128,
        strategy="fsdp",
    ),
    *[
        SetUp(
            f"pr165-fsdp2-{ac}-{kind_id}",
            f"Llama 2 7B, FSDP2 x 8, {'full' if ac == 'full' else 'selective (op)'} AC, batch 8 x 2048, bf16 / fp32"
            " reduce, AdamW",
            "H100",
            "torch nightly 2024-03, torchtrain 83c879f",
            TORCHTRAIN,
            f"{pct}% of {PR165_GIB} GiB = {pct / 100 * PR165_GIB:.2f} GiB",
            pct / 100 * PR165_GIB * GiB,
            kind,
            f"'FSDP2 ({'AC' if ac == 'full' else 'SAC'})': {what} as a share of total_memory, rank 0, 1k steps",
            torchtrain_run(ac),
            (*TORCHTRAIN_ASSUMED, *((TORCHTRAIN_SAC,) if ac == "op" else ())),
            reuse=None if kind == RESERVED else f"pr165-fsdp2-{ac}-reserved",
            world_size=8,
            strategy="fsdp",
        )
        for ac, kind, kind_id, pct, what in (
            ("full", RESERVED, "reserved", 32.64, "peak reserved (reserved_bytes.all.peak)"),
            ("full", ALLOCATED, "active", 23.92, "peak active (active_bytes.all.peak)"),
            ("op", RESERVED, "reserved", 62.51, "peak reserved (reserved_bytes.all.peak)"),
            ("op", ALLOCATED, "active", 52.13, "peak active (active_bytes.all.peak)"),
        )
    ],
    SetUp(
        "lightning-ddp-1b",
        "Lightning demo Transformer 1B, DDP x 2, fp32, Adam, batch 1 x 35",
        "A100",
        "torch 2.1 and Lightning 2.1 pre-releases (2023-08)",
        LIGHTNING_FSDP,
        "23'125 MB",
        23125 * MiB,
        ALLOCATED,
        "table 'DDP | FSDP', Memory (MB), DDP column: memory_summary()'s peak usage (MiB)",
        lightning_ddp_run,
        LIGHTNING_ASSUMED,
        world_size=2,
        strategy="ddp",
    ),
    SetUp(
        "litgpt-tinyllama-full",
        "TinyLlama 1.1B full finetune, bf16-true, AdamW, micro batch 4 x 512, accumulation 8",
        "A10G",
        "torch 2.2 or 2.3 (not stated), LitGPT 43c44323",
        LITGPT,
        "14.10 GB",
        14.10e9,
        ALLOCATED,
        "'Peak GPU RAM' of tiny-llama/full.yaml on 1xA10G: torch.cuda.max_memory_allocated() / 1e9 after fit",
        litgpt_run,
        LITGPT_ASSUMED,
    ),
    SetUp(
        "tune-3b-packed",
        "Llama 3.2 3B full finetune, bf16, AdamW, packed batch 2 x 4096, no AC, no compile",
        "A100",
        "torch 2.5 (not stated), torchtune 1814feb17",
        TORCHTUNE,
        "60.0 GiB",
        60.0 * GiB,
        ALLOCATED,
        "'Peak Memory Active (GiB)', row '+ Packed Dataset': memory_stats()['active_bytes.all.peak'] / 2**30 per step",
        tune_run,
        TUNE,
    ),
]


# --------------------------------------------------------------------------------------------------------------
# Running a row and reading our figures


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block, the previous values restored after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def software_of_2022(on: bool) -> Iterator[None]:
    """BERT's attention as transformers 4.21 and torch 1.10 ran it, for the block where ``on``; restored after.

    torch 1.10's softmax kept its input (:func:`softmax`). transformers 4.21's ``BertModel`` made a mask of ones
    where none was given, turned it into an additive mask of zeros in the parameters' dtype (float32 under AMP)
    and added it to the scores in every layer; transformers 5 skips a mask without padding. So the scores are
    float32 from that addition on, under AMP too, which is what softmax received and kept.
    """
    if not on:
        yield
        return
    import transformers.models.bert.modeling_bert as bert

    eager = bert.eager_attention_forward

    def eager_421(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if mask is None:
            mask = torch.zeros(query.shape[0], 1, 1, key.shape[-2], dtype=module.query.weight.dtype)
        return eager(module, query, key, value, mask, *args, **kwargs)

    torch.Tensor.softmax = softmax  # type: ignore[method-assign]
    bert.eager_attention_forward = eager_421
    try:
        yield
    finally:
        torch.Tensor.softmax = _TENSOR_SOFTMAX  # type: ignore[method-assign]
        bert.eager_attention_forward = eager


ES = "expandable_segments:True"


@dataclass
class Done:
    """A set-up's dry run: the prediction and its seconds; for a source that published a reserved figure, the
    reserved peak of the same run under the other allocator setting (the defaults where the source ran with
    expandable segments, expandable segments where it ran with the defaults), to show what the setting changes."""

    prediction: Prediction
    seconds: float
    other_allocator: str | None = None
    other_reserved: int | None = None


def run(setup: SetUp, reserved_too: bool) -> Done:
    """The dry run of a set-up as its source ran it; with ``reserved_too``, again under the other allocator setting."""
    spec = setup.run()
    begin = time.perf_counter()
    with environment(spec.environ), software_of_2022(spec.of_2022):
        prediction = dry_run(spec.model, spec.batch, **spec.options, allocator=spec.allocator)
        seconds = time.perf_counter() - begin
        if not reserved_too or spec.allocator not in ("", ES):
            return Done(prediction, seconds)
        other = "" if spec.allocator else ES
        again = dry_run(spec.model, spec.batch, **spec.options, allocator=other)
    return Done(prediction, seconds, other, max(reserved_peak(report) for report in again.reports))


def reserved_peak(report: StepReport) -> int:
    """The report's reserved high-water mark: ``peak_reserved_bytes``, else the highest phase's reserved bytes."""
    value = getattr(report, "peak_reserved_bytes", None)
    if value is not None:
        return int(value)
    return max(phase.reserved_bytes or 0 for phase in report.phases.values())


@dataclass
class Ours:
    """Our figures for one set-up, in bytes."""

    allocated: int  # the allocated peak (for "weights loaded": allocated at the first batch_start)
    reserved: int  # the reserved peak (for "weights loaded": reserved at the first batch_start)
    compared: float  # the bytes set beside the published figure
    how: str  # what ``compared`` is
    seconds: float  # of the dry run
    smi: int | None = None  # our estimate of nvidia-smi's figure, where the source's figure is nvidia-smi's
    context: int | None = None  # the context in ``smi``
    nccl: int | None = None  # NCCL's buffers in ``smi``
    other_allocator: str | None = None  # the other allocator setting a reserved row is also predicted under
    other_reserved: int | None = None  # the reserved peak under it
    tenants: dict[str, int] = field(default_factory=dict)  # the last step's high-water mark of each tenant
    notes: list[str] = field(default_factory=list)


def footprint(setup: SetUp, report: StepReport) -> tuple[int, int, str] | None:
    """``device_footprint``'s context and NCCL buffers for the set-up, where ``predict.footprint`` exists."""
    try:
        from lightning_memtenants.predict.cuda_model import resolve_target
        from lightning_memtenants.predict.footprint import device_footprint
    except ImportError:
        return None
    found = device_footprint(
        report,
        resolve_target(setup.gpu),
        world_size=setup.world_size,
        strategy=setup.strategy,
        cuda_version=setup.cuda_version,
        lazy_loading=setup.context_mib is None,
    )
    return found.context_bytes, found.nccl_bytes, "device_footprint"


def figures(setup: SetUp, done: Done) -> Ours:
    """What we set beside the published figure: the same kind of figure as the source's."""
    reports, seconds = done.prediction.reports, done.seconds
    if setup.kind == WEIGHTS_LOADED:
        first = reports[0].phases["batch_start"]
        reserved = first.reserved_bytes or 0
        context = int((setup.context_mib or 0) * MiB)
        how = f"reserved at the first batch_start + the page's {setup.context_mib:.0f} MiB context"
        return Ours(
            first.allocated_bytes or 0,
            reserved,
            float(reserved + context),
            how,
            seconds,
            reserved + context,
            context,
            0,
        )
    allocated = max(report.peak_bytes or 0 for report in reports)
    reserved = max(reserved_peak(report) for report in reports)
    ours = _figures(setup, done, allocated, reserved)
    ours.tenants = dict(reports[-1].tenants_bytes)
    return ours


def _figures(setup: SetUp, done: Done, allocated: int, reserved: int) -> Ours:
    """:func:`figures` for a set-up that trained: ours of the kind the source published."""
    reports, seconds = done.prediction.reports, done.seconds
    if setup.kind == MODEL_STATES:
        tenants = reports[-1].phases["batch_end"].tenants_bytes
        states = tenants["weights"] + tenants["gradients"] + tenants["optimizer_state"]
        return Ours(allocated, reserved, float(states), "weights + gradients + optimizer state", seconds)
    if setup.kind == RESERVED:
        ours = Ours(allocated, reserved, float(reserved), "reserved peak", seconds)
        if done.other_reserved is not None:
            ours.other_allocator, ours.other_reserved = done.other_allocator, done.other_reserved
            change = done.other_reserved - setup.published_bytes
            setting = "the allocator's defaults" if not done.other_allocator else done.other_allocator
            ours.notes.append(
                f"the same run under {setting}: reserved peak {done.other_reserved / MiB:,.0f}"
                f" MiB, {change / MiB:+,.0f} MiB ({100 * change / setup.published_bytes:+.1f}%)"
            )
        return ours
    if setup.kind == ALLOCATED:
        return Ours(allocated, reserved, float(allocated), "allocated peak", seconds)
    # nvidia-smi: the reserved high-water mark (nothing empties the cache) + the context (+ NCCL's buffers)
    found = footprint(setup, reports[-1])
    if setup.context_mib is not None:
        context, nccl = int(setup.context_mib * MiB), found[1] if found else 0
        how = f"reserved peak + the page's {setup.context_mib:.0f} MiB context"
    elif found is not None:
        context, nccl = found[0], found[1]
        how = "reserved peak + device_footprint's context and NCCL buffers"
    else:
        raise ValueError(f"{setup.name}: an nvidia-smi figure needs a measured context or predict.footprint")
    smi = reserved + context + nccl
    ours = Ours(allocated, reserved, float(smi), how, seconds, smi, context, nccl)
    if found is not None and setup.context_mib is not None:
        ours.notes.append(f"device_footprint's own context for this GPU and CUDA: {found[0] / MiB:,.0f} MiB")
    return ours


def row(setup: SetUp, ours: Ours) -> dict[str, Any]:
    """One row as JSON: the set-up, the published figure and ours, in bytes and MiB."""
    published = setup.published_bytes
    return {
        "id": setup.name,
        "setup": setup.setup,
        "gpu": setup.gpu,
        "software": setup.software,
        "source": {"title": setup.source.title, "url": setup.source.url, "date": setup.source.date},
        "published": setup.published,
        "published_bytes": published,
        "kind": setup.kind,
        "measures": setup.measures,
        "ours_allocated_peak_bytes": ours.allocated,
        "ours_reserved_peak_bytes": ours.reserved,
        "ours_nvidia_smi_bytes": ours.smi,
        "ours_context_bytes": ours.context,
        "ours_nccl_bytes": ours.nccl,
        "ours_other_allocator": ours.other_allocator,
        "ours_reserved_peak_under_other_allocator_bytes": ours.other_reserved,
        "ours_compared_bytes": ours.compared,
        "ours_compared_is": ours.how,
        "difference_bytes": ours.compared - published,
        "difference_pct": 100 * (ours.compared - published) / published,
        "ours_tenants_bytes": ours.tenants,
        "assumptions": list(setup.assumptions),
        "notes": ours.notes,
        "seconds": round(ours.seconds, 1),
    }


def line(setup: SetUp, ours: Ours) -> str:
    """The row as one line, printed as it ends."""
    smi = f", nvidia-smi {ours.smi / MiB:,.0f} MiB" if ours.smi is not None else ""
    if "activations" in ours.tenants:
        smi += f" (activations {ours.tenants['activations'] / MiB:,.0f} MiB)"
    difference = ours.compared - setup.published_bytes
    return (
        f"{setup.name} ({setup.gpu}): published {setup.published} ({setup.kind}); ours allocated"
        f" {ours.allocated / MiB:,.0f} MiB, reserved {ours.reserved / MiB:,.0f} MiB{smi}; {ours.how}"
        f" {ours.compared / MiB:,.0f} MiB: {difference / MiB:+,.0f} MiB"
        f" ({100 * difference / setup.published_bytes:+.1f}%) [{ours.seconds:.1f} s]"
    )


def table(rows: list[tuple[SetUp, Ours | str]]) -> str:
    """The markdown table of docs/published.md."""
    lines = [
        "| set-up | GPU | software | source | published | ours: allocated peak | ours: reserved peak"
        " | ours: nvidia-smi | difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setup, ours in rows:
        head = (
            f"| `{setup.name}`: {setup.setup} | {setup.gpu} | {setup.software} | [{setup.source.title}]"
            f"({setup.source.url}) | {setup.published} ({setup.kind}) |"
        )
        if isinstance(ours, str):
            lines.append(f"{head} failed: {ours} | | | |")
            continue
        difference = ours.compared - setup.published_bytes
        pct = f"{100 * difference / setup.published_bytes:+.1f}%"
        if setup.kind == MODEL_STATES:  # the paper's GB are 10**9 bytes
            delta = f"{difference / 1e9:+.1f} GB ({pct}), states {ours.compared / 1e9:.1f} GB"
        else:
            delta = f"{difference / MiB:+,.0f} MiB ({pct})"
        smi = f"{ours.smi / MiB:,.0f} MiB" if ours.smi is not None else ""
        lines.append(f"{head} {ours.allocated / MiB:,.0f} MiB | {ours.reserved / MiB:,.0f} MiB | {smi} | {delta} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help=f"set-ups to run, of {[s.name for s in SETUPS]}")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args()
    names = [s.name for s in SETUPS]
    unknown = [name for name in args.only or [] if name not in names]
    if unknown:
        parser.error(f"--only: unknown set-ups {unknown}; known: {names}")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    chosen = [s for s in SETUPS if not args.only or s.name in args.only]
    begin = time.perf_counter()
    rows: list[tuple[SetUp, Ours | str]] = []
    runs: dict[str, Done] = {}
    for setup in chosen:
        name = setup.reuse or setup.name
        try:
            if name not in runs:
                reserved_too = any(s.kind == RESERVED and (s.reuse or s.name) == name for s in chosen)
                runs[name] = run(next(s for s in SETUPS if s.name == name), reserved_too)
            ours = figures(setup, runs[name])
            rows.append((setup, ours))
            print(line(setup, ours) + "".join(f"\n    note: {note}" for note in ours.notes), flush=True)
        except Exception as error:  # a set-up that fails is a row that says so
            rows.append((setup, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
            print(f"{setup.name}: FAILED {type(error).__name__}: {error}", flush=True)
    print()
    print(table(rows))
    elapsed = time.perf_counter() - begin
    print(f"\n{len(chosen)} rows, {len(runs)} dry runs, in {elapsed:.0f} s on this CPU (torch {torch.__version__})")
    if args.json:
        finished = [row(setup, ours) for setup, ours in rows if not isinstance(ours, str)]
        failed = [{"id": setup.name, "failed": ours} for setup, ours in rows if isinstance(ours, str)]
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "seconds": round(elapsed), "rows": finished + failed}, out, indent=1)


if __name__ == "__main__":
    main()
