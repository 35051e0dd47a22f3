"""Our predictions beside published GPU measurements of well-known training set-ups.

Each set-up is built from its config (no download: transformers' ``BertConfig`` and ``GPT2Config``)
and predicted on this CPU with the public ``predict``/``dry_run`` for the GPU the source used. The
published figures:

- Hugging Face, "Model training anatomy" and "Efficient Training on a Single GPU" (v4.21.0): bert-large-uncased
  for sequence classification (2 labels), sequences of 512 random tokens, the ``Trainer`` with its defaults
  (AdamW, fp32) on a Tesla V100-SXM2 16 GB (driver 460.91.03, CUDA 11.2). The figure is
  ``nvmlDeviceGetMemoryInfo(handle).used // 1024**2`` ("GPU memory occupied: ... MB", so MiB) after
  ``trainer.train()``: nvidia-smi's number, the whole device's used memory, which holds the caching
  allocator's reserved segments (their high-water mark, as nothing empties the cache) and the CUDA context.
  The same page measures that context: ``torch.ones((1, 1)).to("cuda")`` alone shows 1343 MB, and the
  model's weights loaded on top 2631 MB. Our estimate of nvidia-smi is the predicted reserved bytes plus
  that 1343 MiB (the source's own reading of the context on its set-up; on a current CUDA with lazy
  module loading the context is smaller, 300 to 600 MiB, as the package's OUTSIDE_ALLOCATOR note says).
- Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC20,
  arXiv:1910.02054), section 3.1: mixed-precision Adam holds 2 + 2 + 12 = 16 bytes per parameter, "at least
  24 GB" for GPT-2's 1.5B parameters. That is arithmetic, not a measurement; we set our model-state tenants
  (weights, gradients, optimizer state) of a real GPT-2 XL config beside it.

How the Trainer's loop is modelled through ``predict``'s options:

- the Trainer of 2022 (torch 1.10) zeroed gradients with ``model.zero_grad()``, whose default was then
  ``set_to_none=False``: gradients stay allocated between steps. The optimizer's ``zero_grad`` here keeps
  them too, and the report is of the second step (``steps=2``), the steady state.
- ``gradient_accumulation_steps=4`` at batch 1 is predicted as batch 1 with the gradients kept: accumulating
  adds into the same gradient tensors, so each micro-batch's memory is that of a batch-1 step.
- Trainer's AdamW was transformers' own (``adamw_hf``), one parameter at a time: ``torch.optim.AdamW(foreach=False)``
  holds the same state and one temporary per parameter. ``optim="adafactor"`` is transformers' ``Adafactor``
  with the Trainer's ``scale_parameter=False, relative_step=False``.
- attention is BERT's eager attention of that time (``attn_implementation="eager"``: the a*s*s scores, their
  softmax and dropout mask are kept); ``fp16=True`` is ``16-mixed`` with autocast's weight cache on, as the
  Trainer's autocast ran it; gradient checkpointing is ``gradient_checkpointing_enable()`` (today's default,
  non-reentrant; 2022's was reentrant).
- not modelled: gradient clipping (``max_grad_norm=1.0``, small temporaries), the learning-rate scheduler,
  and whatever else the process held on the device.

Run: ``python benchmarks/published.py [--only NAME ...]``; it prints a markdown table (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memtenants import Prediction, dry_run

MiB = 2**20
HF_ANATOMY = "https://huggingface.co/docs/transformers/model_memory_anatomy"
HF_SINGLE_GPU = "https://huggingface.co/docs/transformers/v4.21.0/perf_train_gpu_one"
ZERO = "https://arxiv.org/abs/1910.02054"
HF_CONTEXT_MIB = 1343  # "GPU memory occupied: 1343 MB" after torch.ones((1, 1)).to("cuda"), the same V100 and page


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


def bert_large(checkpointing: bool) -> Callable[[], nn.Module]:
    """bert-large-uncased for sequence classification (2 labels), from its config, eager attention."""

    def build() -> nn.Module:
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
                model.gradient_checkpointing_enable()
        return model

    return build


def bert_batch(batch: int) -> dict[str, torch.Tensor]:
    """The pages' dummy data: token ids in [100, 30000), 512 per sequence, a binary label each."""
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(100, 30000, (batch, 512), generator=generator),
        "labels": torch.randint(0, 2, (batch,), generator=generator),
    }


def gpt2_xl() -> nn.Module:
    """GPT-2's 1.5B-parameter model (XL: 48 layers of width 1600, 25 heads), from its config."""
    import transformers as tf

    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=1600, n_layer=48, n_head=25, attn_implementation="sdpa"))


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


@dataclass
class SetUp:
    """A published measurement and how to predict it."""

    name: str
    setup: str
    gpu: str
    published: str  # as the source prints it
    published_mib: float  # the same in MiB (or bytes / 2**20 for a GB figure)
    measures: str
    source: str
    model: Callable[[], nn.Module]
    batch: Any
    optimizer: Callable[[Any], torch.optim.Optimizer]
    precision: str = "32-true"
    steps: int = 2
    compare: str = "nvidia-smi"  # or "model states", "weights loaded"
    reuse: str | None = None  # the set-up whose dry run this one reads


SETUPS = [
    SetUp(
        "bert-vanilla",
        "bert-large-uncased, batch 4 x 512, fp32, AdamW (Trainer defaults)",
        "V100",
        "14949 MB",
        14949,
        "nvidia-smi used after `trainer.train()`",
        HF_ANATOMY,
        bert_large(False),
        bert_batch(4),
        adamw,
    ),
    SetUp(
        "bert-loaded",
        "bert-large-uncased loaded with `.to('cuda')` (before training)",
        "V100",
        "2631 MB",
        2631,
        "nvidia-smi used (context + weights)",
        HF_ANATOMY,
        bert_large(False),
        bert_batch(4),
        adamw,
        compare="weights loaded",
        reuse="bert-vanilla",
    ),
    SetUp(
        "bert-accumulation",
        "same, batch 1, gradient accumulation 4",
        "V100",
        "8681 MB",
        8681,
        "nvidia-smi used after `trainer.train()`",
        HF_SINGLE_GPU,
        bert_large(False),
        bert_batch(1),
        adamw,
    ),
    SetUp(
        "bert-checkpointing",
        "same, batch 1, accumulation 4, gradient checkpointing",
        "V100",
        "6775 MB",
        6775,
        "nvidia-smi used after `trainer.train()`",
        HF_SINGLE_GPU,
        bert_large(True),
        bert_batch(1),
        adamw,
    ),
    SetUp(
        "bert-fp16",
        "bert-large-uncased, batch 4 x 512, fp16 mixed precision",
        "V100",
        "13939 MB",
        13939,
        "nvidia-smi used after `trainer.train()`",
        HF_SINGLE_GPU,
        bert_large(False),
        bert_batch(4),
        adamw,
        precision="16-mixed",
    ),
    SetUp(
        "bert-fp16-checkpointing",
        "same, batch 1, accumulation 4, checkpointing, fp16",
        "V100",
        "7275 MB",
        7275,
        "nvidia-smi used after `trainer.train()`",
        HF_SINGLE_GPU,
        bert_large(True),
        bert_batch(1),
        adamw,
        precision="16-mixed",
    ),
    SetUp(
        "bert-adafactor",
        "bert-large-uncased, batch 4 x 512, fp32, Adafactor",
        "V100",
        "12295 MB",
        12295,
        "nvidia-smi used after `trainer.train()`",
        HF_SINGLE_GPU,
        bert_large(False),
        bert_batch(4),
        adafactor,
    ),
    SetUp(
        "bert-all-adafactor",
        "same, batch 1, accumulation 4, checkpointing, fp16, Adafactor",
        "V100",
        "4847 MB",
        4847,
        "nvidia-smi used after `trainer.train()`",
        HF_SINGLE_GPU,
        bert_large(True),
        bert_batch(1),
        adafactor,
        precision="16-mixed",
    ),
    SetUp(
        "zero-gpt2-1.5b",
        "GPT-2 1.5B, mixed-precision Adam: model states (2 + 2 + 12 bytes per parameter)",
        "V100",
        "24 GB",
        24e9 / MiB,
        "arithmetic (16 bytes x 1.5B), not a measurement",
        ZERO,
        gpt2_xl,
        {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8, dtype=torch.long)},
        lambda params: torch.optim.Adam(params, lr=1e-4),
        precision="16-mixed",
        steps=1,
        compare="model states",
    ),
]


@dataclass
class Ours:
    """Our figures for one set-up, in bytes."""

    peak: int  # the highest window peak of the steps (for "weights loaded": allocated at the first batch_start)
    reserved: int  # the reserved high-water mark (for "weights loaded": reserved at the first batch_start)
    compared: float  # the bytes set beside the published figure
    how: str  # what ``compared`` is
    seconds: float  # of the dry run


def run(setup: SetUp) -> tuple[Prediction, float]:
    """The dry run of a set-up, and the seconds it took."""
    begin = time.perf_counter()
    prediction = dry_run(
        setup.model,
        setup.batch,
        loss_fn=hf_loss,
        optimizer=setup.optimizer,
        precision=setup.precision,
        target=setup.gpu,
        steps=setup.steps,
    )
    return prediction, time.perf_counter() - begin


def figures(setup: SetUp, prediction: Prediction, seconds: float) -> Ours:
    """What we set beside the published figure: nvidia-smi's estimate, the weights loaded, or the model states."""
    context = HF_CONTEXT_MIB * MiB
    if setup.compare == "weights loaded":
        first = prediction.reports[0].phases["batch_start"]
        reserved = first.reserved_bytes or 0
        how = f"reserved at the first batch_start (weights, a 16 KiB batch) + {HF_CONTEXT_MIB} MiB context"
        return Ours(first.allocated_bytes or 0, reserved, float(reserved + context), how, seconds)
    phases = [phase for report in prediction.reports for phase in report.phases.values()]
    reserved = max(phase.reserved_bytes or 0 for phase in phases)
    peak = max(report.peak_bytes or 0 for report in prediction.reports)
    if setup.compare == "model states":
        tenants = prediction.reports[-1].phases["batch_end"].tenants_bytes
        states = tenants["weights"] + tenants["gradients"] + tenants["optimizer_state"]
        return Ours(peak, reserved, float(states), "weights + gradients + optimizer state", seconds)
    how = f"reserved high-water mark + {HF_CONTEXT_MIB} MiB context"
    return Ours(peak, reserved, float(reserved + context), how, seconds)


def source_name(setup: SetUp) -> str:
    return {
        HF_ANATOMY: "HF, Model training anatomy",
        HF_SINGLE_GPU: "HF, Efficient Training on a Single GPU (v4.21.0)",
        ZERO: "ZeRO (Rajbhandari et al.), section 3.1",
    }[setup.source]


def table(rows: list[tuple[SetUp, Ours | str]]) -> str:
    """The markdown table the README takes."""
    lines = [
        "| set-up | GPU | published | what it measures | source | ours: peak allocated | ours: reserved"
        " | ours, set beside it | difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setup, ours in rows:
        source = f"[{source_name(setup)}]({setup.source})"
        head = f"| {setup.setup} | {setup.gpu} | {setup.published} | {setup.measures} | {source} |"
        if isinstance(ours, str):
            lines.append(f"{head} failed: {ours} | | | |")
            continue
        published = setup.published_mib * MiB
        pct = f"{100 * (ours.compared - published) / published:+.1f}%"
        if setup.compare == "model states":  # the paper's GB are 10**9 bytes
            beside = f"{ours.compared / 1e9:.1f} GB ({ours.how})"
            delta = f"{(ours.compared - published) / 1e9:+.1f} GB ({pct})"
        else:
            beside = f"{ours.compared / MiB:,.0f} MiB ({ours.how})"
            delta = f"{(ours.compared - published) / MiB:+,.0f} MiB ({pct})"
        lines.append(f"{head} {ours.peak / MiB:,.0f} MiB | {ours.reserved / MiB:,.0f} MiB | {beside} | {delta} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help=f"set-ups to run, of {[s.name for s in SETUPS]}")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    chosen = [s for s in SETUPS if not args.only or s.name in args.only]
    begin = time.perf_counter()
    rows: list[tuple[SetUp, Ours | str]] = []
    runs: dict[str, tuple[Prediction, float]] = {}
    for setup in chosen:
        name = setup.reuse or setup.name
        try:
            if name not in runs:
                runs[name] = run(next(s for s in SETUPS if s.name == name))
            ours = figures(setup, *runs[name])
            rows.append((setup, ours))
            print(
                f"{setup.name}: peak {ours.peak / MiB:,.1f} MiB, reserved {ours.reserved / MiB:,.1f} MiB;"
                f" {ours.compared / MiB:,.1f} MiB beside {setup.published} ({ours.seconds:.1f} s)",
                flush=True,
            )
        except Exception as error:  # a set-up that fails is a row that says so
            rows.append((setup, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
            print(f"{setup.name}: FAILED {type(error).__name__}: {error}", flush=True)
    print()
    print(table(rows))
    print(f"\n{len(chosen)} set-ups in {time.perf_counter() - begin:.0f} s on this CPU (torch {torch.__version__})")


if __name__ == "__main__":
    main()
