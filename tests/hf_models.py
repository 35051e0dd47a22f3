"""Small Hugging Face models and Lightning's demo Transformer, as LightningModules with their batches.

One place for both sides of ``test_hf_predictions.py``: ``hf_check.py`` fits these modules for real
on the CPU and the test predicts the very same module and batch. Every model is built from its config
class (no hub download) under ``torch.manual_seed``, 2 layers of width 64 or 200, batch 4.

A spec names a model, its attention mask, the precision and whether gradient checkpointing is on:
``gpt2/padded/bf16-mixed/ckpt``, ``vit/32-true``, ``demo/bf16-mixed``.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch.demos import LightningTransformer
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

BATCH = 4
SEQ = 32
VOCAB = 256
HIDDEN = 64
IMAGE = 32
LABELS = 10

LANGUAGE_MODELS = ("gpt2", "llama", "bert")
MASKS = ("ones", "padded")
PRECISIONS = ("32-true", "bf16-mixed")


class Spec(NamedTuple):
    """A real run and its prediction: the model, its mask (``None`` where it takes none), precision, checkpointing."""

    model: str
    mask: str | None
    precision: str
    ckpt: bool

    @property
    def name(self) -> str:
        parts = [self.model, *([self.mask] if self.mask else []), self.precision, *(["ckpt"] if self.ckpt else [])]
        return "/".join(parts)

    @classmethod
    def parse(cls, name: str) -> Spec:
        parts = name.split("/")
        ckpt = parts[-1] == "ckpt"
        if ckpt:
            parts.pop()
        model, *mask, precision = parts
        return cls(model, mask[0] if mask else None, precision, ckpt)


SPECS: list[Spec] = [
    *(Spec(m, mask, p, c) for m in LANGUAGE_MODELS for mask in MASKS for p in PRECISIONS for c in (False, True)),
    *(Spec("vit", None, p, c) for p in PRECISIONS for c in (False, True)),
    *(Spec("demo", None, p, False) for p in PRECISIONS),
]


class HFModule(L.LightningModule):
    """A Hugging Face model trained on its own loss: the batch's keys are the model's keyword arguments."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class DemoTransformer(LightningTransformer):
    """Lightning's demo, less its ``prepare_data``, which downloads WikiText2: the batch is built here instead."""

    def prepare_data(self) -> None:
        pass


class Validated:
    """A validation step as users write it: the training loss on held-out batches, logged."""

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.training_step(batch, batch_idx)  # type: ignore[attr-defined]
        self.log("val_loss", loss)  # type: ignore[attr-defined]
        return loss


class ValidatedHFModule(Validated, HFModule):
    pass


class ValidatedDemoTransformer(Validated, DemoTransformer):
    pass


def hf_model(name: str) -> nn.Module:
    """The Hugging Face model, freshly initialised from its config (sdpa attention, the default)."""
    import transformers as tf

    common: dict[str, Any] = {"attn_implementation": "sdpa"}
    if name == "gpt2":  # tied input and output embeddings
        config = tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=2 * SEQ,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            bos_token_id=VOCAB - 1,  # GPT-2's 50256 is outside this vocabulary
            eos_token_id=VOCAB - 1,
            **common,
        )
        return tf.GPT2LMHeadModel(config)
    if name == "llama":  # grouped-query attention and rotary embeddings
        config = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2 * SEQ,
            **common,
        )
        return tf.LlamaForCausalLM(config)
    if name == "bert":
        config = tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=2 * HIDDEN,
            max_position_embeddings=2 * SEQ,
            **common,
        )
        return tf.BertForMaskedLM(config)
    if name == "vit":
        config = tf.ViTConfig(
            image_size=IMAGE,
            patch_size=8,
            num_channels=3,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=2 * HIDDEN,
            num_labels=LABELS,
            **common,
        )
        return tf.ViTForImageClassification(config)
    raise ValueError(f"no Hugging Face model named {name!r}")


def build_module(spec: Spec, validate: bool = False) -> L.LightningModule:
    """The LightningModule of ``spec``, the same parameters on every call; with ``validate``, a validation step."""
    torch.manual_seed(0)
    if spec.model == "demo":  # 2 layers of width 200, its own training step and SGD
        return (ValidatedDemoTransformer if validate else DemoTransformer)(vocab_size=VOCAB)
    model = hf_model(spec.model)
    if spec.ckpt:
        with warnings.catch_warnings():  # 5.x renamed it activation_checkpointing_enable; the old name still works
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()  # HF's default: use_reentrant=False
    return (ValidatedHFModule if validate else HFModule)(model)


def padding_mask() -> Tensor:
    """Ones, but for the last quarter of row 0 and the last half of row 1: right padding."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, SEQ - SEQ // 4 :] = 0
    mask[1, SEQ // 2 :] = 0
    return mask


def samples(spec: Spec) -> list[Any]:
    """The data set: one sample per row of the batch, as a DataLoader of batch size ``BATCH`` collates them."""
    generator = torch.Generator().manual_seed(1)
    if spec.model == "vit":
        pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator)
        labels = torch.randint(0, LABELS, (BATCH,), generator=generator)
        return [{"pixel_values": pixels[i], "labels": labels[i]} for i in range(BATCH)]
    if spec.model == "demo":  # WikiText2's pairs: the target is the input shifted by one token
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        return [(tokens[i, :-1], tokens[i, 1:]) for i in range(BATCH)]
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    mask = padding_mask() if spec.mask == "padded" else torch.ones(BATCH, SEQ, dtype=torch.long)
    ids = ids.masked_fill(mask == 0, 0)  # the pad token
    labels = ids.clone()
    if spec.model == "bert":  # masked LM: a loss on every fourth token only
        labels[:, torch.arange(SEQ) % 4 != 0] = -100
    labels = labels.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(BATCH)]


def build_batch(spec: Spec) -> Any:
    """The batch the DataLoader gives ``training_step``: the samples, collated."""
    return default_collate(samples(spec))


def loader(spec: Spec) -> DataLoader:
    return DataLoader(samples(spec), batch_size=BATCH)
