"""The zoo: third-party models as users write them, each a LightningModule, its batch and its Trainer settings.

``zoo_check.py`` runs every configuration through every entry point of the package (the callback in a real fit,
``predict`` for the CPU and for a GPU, the command, ``advise`` and its fix in a real fit, DDP and FSDP over two
ranks); ``test_zoo.py`` asserts on its figures and ``benchmarks/zoo.py`` prints them as a table.

Every Hugging Face model is built from its config class (no hub download) under ``torch.manual_seed(0)``: 2 layers,
width 64, a vocabulary of 256, batch 4. Every module keeps its network as ``self.model`` and calls
``self.model(...)`` in ``training_step``, as users write them, and has ``example_batch(batch_size, seq_len=None)``
so that ``memtenants predict tests/zoo_models.py:zoo_module --init '{"name": "gpt2"}'`` builds the same step.
A configuration is named by its model and precision, ``gpt2/32-true``; ``ZOO`` lists them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import Net
from lightning.pytorch.demos.lstm import LightningLSTM, SimpleLSTM
from torch import Tensor, nn
from torch.utils.data import default_collate

BATCH = 4
SEQ = 32
VOCAB = 256
HIDDEN = 64
LAYERS = 2
HEADS = 4
IMAGE = 32
LABELS = 10
MEL_BINS = 16  # Whisper's features: 16 mel bins over 2 x 32 frames (its encoder takes 2 x max_source_positions)
AUDIO = 1600  # Wav2Vec2's raw samples: 1600 give 159 frames after its two convolutions (kernels 10, 3; strides 5, 2)
CTC_VOCAB = 32
CTC_LABELS = 12


class Config(NamedTuple):
    """One row of the zoo: the model, its family (what it exercises) and the precision it trains in.

    Args:
        model: the key of ``MODELS``.
        precision: Lightning's precision.
    """

    model: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.model}/{self.precision}"

    @property
    def kind(self) -> str:
        return MODELS[self.model].kind

    @property
    def trainer_kwargs(self) -> dict[str, Any]:
        """The Trainer's own settings the configuration trains with, beside the precision."""
        return dict(MODELS[self.model].trainer_kwargs or {})

    @classmethod
    def parse(cls, name: str) -> Config:
        model, _, precision = name.partition("/")
        if model not in MODELS or not precision:
            raise ValueError(f"no zoo configuration named {name!r}: write MODEL/PRECISION, MODEL one of {list(MODELS)}")
        return cls(model, precision)


# -- the Hugging Face models -----------------------------------------------------------------------------------------


def _lm(config: Any, cls: str) -> nn.Module:
    import transformers as tf

    return getattr(tf, cls)(config)


def _hf(config_class: str, model_class: str, attention: str = "sdpa", **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers as tf

        return _lm(getattr(tf, config_class)(attn_implementation=attention, **config), model_class)

    return build


_DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "max_position_embeddings": 2 * SEQ,
}
_ENCODER = {**_DECODER, "max_position_embeddings": 2 * SEQ + 2}  # RoBERTa's positions start after its pad token
_SEQ2SEQ = {"vocab_size": VOCAB, "d_model": HIDDEN, "d_kv": HIDDEN // HEADS, "d_ff": 2 * HIDDEN, "num_heads": HEADS}
_BART = {
    "vocab_size": VOCAB,
    "d_model": HIDDEN,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "encoder_ffn_dim": 2 * HIDDEN,
    "decoder_ffn_dim": 2 * HIDDEN,
}


def _whisper() -> nn.Module:
    import transformers as tf

    config = tf.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=MEL_BINS,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        max_source_positions=SEQ,
        max_target_positions=2 * SEQ,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        attn_implementation="sdpa",
    )
    return tf.WhisperForConditionalGeneration(config)


def _wav2vec2() -> nn.Module:
    import transformers as tf

    config = tf.Wav2Vec2Config(
        vocab_size=CTC_VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,  # no SpecAugment: its masks are drawn with numpy
        ctc_loss_reduction="mean",
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    return tf.Wav2Vec2ForCTC(config)


# -- the modules ---------------------------------------------------------------------------------------------------


class ZooModule(L.LightningModule):
    """A network trained on a loss of its own output, written as users write it: ``self.model(...)`` in the step.

    Args:
        model: the network.
        loss: ``loss(model, batch) -> Tensor``, the step's loss (a Hugging Face model's ``.loss``, a criterion).
        make_samples: the data set of ``n`` samples (one batch's worth of rows each ``BATCH``).
        optimizer: ``"adamw"`` (the default), ``"adam"`` or ``"sgd"`` (with momentum, and a ``StepLR`` scheduler).
    """

    def __init__(
        self,
        model: nn.Module,
        loss: Callable[[nn.Module, Any], Tensor],
        make_samples: Callable[[int], list[Any]],
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.make_samples = make_samples
        self.optimizer_name = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(self.model, batch)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":  # a scheduler too, as ``[opt], [sched]``
            sgd = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
            return [sgd], [torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def example_batch(self, batch_size: int, seq_len: int | None = None) -> Any:
        """The batch ``training_step`` gets from a DataLoader of ``batch_size`` over the zoo's samples."""
        return default_collate(self.make_samples(batch_size))


class DemoTransformer(LightningTransformer):
    """Lightning's demo Transformer (2 layers of width 200, its own step and SGD), less its WikiText2 download."""

    def prepare_data(self) -> None:
        pass

    def example_batch(self, batch_size: int, seq_len: int | None = None) -> Any:
        return default_collate(token_pairs(batch_size))


class DemoLSTM(LightningLSTM):
    """Lightning's demo LSTM: its step carries the hidden state from batch to batch; its network made tiny."""

    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = SimpleLSTM(vocab_size=VOCAB, ninp=HIDDEN, nhid=HIDDEN, nlayers=LAYERS)

    def prepare_data(self) -> None:
        pass

    def example_batch(self, batch_size: int, seq_len: int | None = None) -> Any:
        return default_collate(token_pairs(batch_size))


class Tagger(nn.Module):
    """A 2-layer LSTM over token embeddings, a tag for each token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.lstm = nn.LSTM(HIDDEN, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.head = nn.Linear(HIDDEN, LABELS)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


def batchnorm_cnn() -> nn.Module:
    """Two convolutions with BatchNorm and max pooling, then a linear classifier: 32 x 32 RGB images."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (IMAGE // 4) ** 2, LABELS),
    )


# -- the samples ---------------------------------------------------------------------------------------------------


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def token_pairs(n: int) -> list[tuple[Tensor, Tensor]]:
    """WikiText2's pairs: the target is the input shifted by one token."""
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=_generator())
    return [(tokens[i, :-1].clone(), tokens[i, 1:].clone()) for i in range(n)]


def causal_lm_samples(n: int) -> list[dict[str, Tensor]]:
    """Token ids, an all-ones attention mask, and the ids as labels (the model shifts them)."""
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=_generator())
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids[i]} for i in range(n)
    ]


def masked_lm_samples(n: int) -> list[dict[str, Tensor]]:
    """Token ids, a mask with the last quarter of every other row padded, and a loss on every fourth token."""
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=_generator())
    out = []
    for i in range(n):
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % 2:
            mask[SEQ - SEQ // 4 :] = 0
        labels = ids[i].masked_fill(torch.arange(SEQ) % 4 != 0, -100).masked_fill(mask == 0, -100)
        out.append({"input_ids": ids[i].masked_fill(mask == 0, 1), "attention_mask": mask, "labels": labels})
    return out


def seq2seq_samples(n: int) -> list[dict[str, Tensor]]:
    """Source ids and their mask, and target ids half as long as labels (the model shifts them right)."""
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=_generator())
    labels = torch.randint(3, VOCAB, (n, SEQ // 2), generator=_generator())
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels[i]}
        for i in range(n)
    ]


def image_samples(n: int, key: str = "pixel_values") -> list[dict[str, Tensor]]:
    pixels = torch.randn(n, 3, IMAGE, IMAGE, generator=_generator())
    labels = torch.randint(0, LABELS, (n,), generator=_generator())
    return [{key: pixels[i], "labels": labels[i]} for i in range(n)]


def whisper_samples(n: int) -> list[dict[str, Tensor]]:
    features = torch.randn(n, MEL_BINS, 2 * SEQ, generator=_generator())
    labels = torch.randint(3, VOCAB, (n, SEQ // 2), generator=_generator())
    return [{"input_features": features[i], "labels": labels[i]} for i in range(n)]


def ctc_samples(n: int) -> list[dict[str, Tensor]]:
    """Raw audio and a CTC transcript of ``CTC_LABELS`` characters (no blank, id 0)."""
    audio = torch.randn(n, AUDIO, generator=_generator())
    labels = torch.randint(1, CTC_VOCAB, (n, CTC_LABELS), generator=_generator())
    return [{"input_values": audio[i], "labels": labels[i]} for i in range(n)]


def mnist_samples(n: int) -> list[tuple[Tensor, Tensor]]:
    images = torch.randn(n, 1, 28, 28, generator=_generator())
    labels = torch.randint(0, LABELS, (n,), generator=_generator())
    return [(images[i], labels[i]) for i in range(n)]


def tag_samples(n: int) -> list[tuple[Tensor, Tensor]]:
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=_generator())
    tags = torch.randint(0, LABELS, (n, SEQ), generator=_generator())
    return [(tokens[i], tags[i]) for i in range(n)]


def cnn_samples(n: int) -> list[tuple[Tensor, Tensor]]:
    return [(s["pixel_values"], s["labels"]) for s in image_samples(n)]


# -- the losses ----------------------------------------------------------------------------------------------------


def hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """A Hugging Face model's own loss: the batch's keys are its keyword arguments."""
    return model(**batch).loss


def nll_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    images, labels = batch
    return F.nll_loss(model(images), labels)


def cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    inputs, labels = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


# -- the table of models -------------------------------------------------------------------------------------------


class Model(NamedTuple):
    """How to build one model of the zoo: its network, samples, loss, optimizer and Trainer settings."""

    kind: str
    build: Callable[[], L.LightningModule]
    trainer_kwargs: dict[str, Any] | None = None


def _zoo(
    network: Callable[[], nn.Module],
    make_samples: Callable[[int], list[Any]],
    loss: Callable[[nn.Module, Any], Tensor] = hf_loss,
    optimizer: str = "adamw",
) -> Callable[[], L.LightningModule]:
    return lambda: ZooModule(network(), loss, make_samples, optimizer)


MODELS: dict[str, Model] = {
    # decoders: attention and norms of every kind
    "gpt2": Model(
        "decoder: learned positions, LayerNorm, tied embeddings",
        _zoo(
            _hf(
                "GPT2Config",
                "GPT2LMHeadModel",
                vocab_size=VOCAB,
                n_positions=2 * SEQ,
                n_embd=HIDDEN,
                n_layer=LAYERS,
                n_head=HEADS,
                bos_token_id=VOCAB - 1,
                eos_token_id=VOCAB - 1,
            ),
            causal_lm_samples,
        ),
    ),
    "llama": Model(
        "decoder: grouped-query attention, rotary, RMSNorm",
        _zoo(_hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_DECODER), causal_lm_samples),
    ),
    "mistral": Model(
        "decoder: sliding-window attention (16 of 32 tokens)",
        _zoo(
            _hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=SEQ // 2, **_DECODER),
            causal_lm_samples,
        ),
    ),
    "qwen2": Model(
        "decoder: biased q/k/v, grouped-query attention",
        _zoo(_hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_DECODER), causal_lm_samples),
    ),
    "gpt_neox": Model(
        "decoder: parallel attention and MLP, partial rotary",
        _zoo(_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **_DECODER), causal_lm_samples),
    ),
    "opt": Model(
        "decoder: ReLU MLP, learned offset positions",
        _zoo(
            _hf(
                "OPTConfig",
                "OPTForCausalLM",
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                ffn_dim=2 * HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                max_position_embeddings=2 * SEQ,
                word_embed_proj_dim=HIDDEN,
            ),
            causal_lm_samples,
        ),
    ),
    "gemma": Model(
        "decoder: multi-query attention, GeGLU, scaled embeddings",
        _zoo(_hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=16, **_DECODER), causal_lm_samples),
    ),
    "phi": Model(
        "decoder: parallel block, partial rotary, dense GELU",
        _zoo(_hf("PhiConfig", "PhiForCausalLM", **_DECODER), causal_lm_samples),
    ),
    # encoders
    "bert": Model(
        "encoder: masked LM, padded rows",
        _zoo(_hf("BertConfig", "BertForMaskedLM", **_ENCODER), masked_lm_samples),
    ),
    "distilbert": Model(
        "encoder: masked LM, no token types, padded rows",
        _zoo(
            _hf(
                "DistilBertConfig",
                "DistilBertForMaskedLM",
                vocab_size=VOCAB,
                dim=HIDDEN,
                hidden_dim=2 * HIDDEN,
                n_layers=LAYERS,
                n_heads=HEADS,
                max_position_embeddings=2 * SEQ,
            ),
            masked_lm_samples,
        ),
    ),
    "roberta": Model(
        "encoder: masked LM, positions from the padding, padded rows",
        _zoo(_hf("RobertaConfig", "RobertaForMaskedLM", **_ENCODER), masked_lm_samples),
    ),
    # encoder-decoders
    "t5": Model(
        "encoder-decoder: relative position buckets",
        _zoo(
            _hf(
                "T5Config",
                "T5ForConditionalGeneration",
                num_layers=LAYERS,
                num_decoder_layers=LAYERS,
                decoder_start_token_id=0,
                pad_token_id=0,
                **_SEQ2SEQ,
            ),
            seq2seq_samples,
        ),
    ),
    "bart": Model(
        "encoder-decoder: learned positions",
        _zoo(
            _hf("BartConfig", "BartForConditionalGeneration", max_position_embeddings=2 * SEQ, **_BART), seq2seq_samples
        ),
    ),
    # mixtures of experts: the memory depends on the routing
    "mixtral": Model(
        "mixture of experts: 4 experts, top 2",
        _zoo(
            _hf(
                "MixtralConfig",
                "MixtralForCausalLM",
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                **_DECODER,
            ),
            causal_lm_samples,
        ),
    ),
    "qwen2_moe": Model(
        "mixture of experts: 4 experts, top 2, a shared expert",
        _zoo(
            _hf(
                "Qwen2MoeConfig",
                "Qwen2MoeForCausalLM",
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=HIDDEN // 2,
                shared_expert_intermediate_size=HIDDEN,
                decoder_sparse_step=1,
                **_DECODER,
            ),
            causal_lm_samples,
        ),
    ),
    "switch": Model(
        "mixture of experts: SwitchTransformers, top 1 with capacity",
        _zoo(
            _hf(
                "SwitchTransformersConfig",
                "SwitchTransformersForConditionalGeneration",
                attention="eager",  # it has no sdpa
                num_layers=LAYERS,
                num_decoder_layers=LAYERS,
                num_experts=4,
                expert_capacity=SEQ,
                decoder_start_token_id=0,
                pad_token_id=0,
                **_SEQ2SEQ,
            ),
            seq2seq_samples,
        ),
    ),
    # audio
    "whisper": Model("audio: convolutions over mel features, encoder-decoder", _zoo(_whisper, whisper_samples)),
    "wav2vec2": Model("audio: convolutions over raw samples, CTC loss", _zoo(_wav2vec2, ctc_samples)),
    # vision
    "vit": Model(
        "vision: patches, encoder",
        _zoo(
            _hf(
                "ViTConfig",
                "ViTForImageClassification",
                image_size=IMAGE,
                patch_size=8,
                num_channels=3,
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                intermediate_size=2 * HIDDEN,
                num_labels=LABELS,
            ),
            image_samples,
        ),
    ),
    "resnet": Model(
        "vision: convolutions, BatchNorm, max pooling",
        _zoo(
            lambda: _lm(_resnet_config(), "ResNetForImageClassification"),
            image_samples,
        ),
    ),
    "convnext": Model(
        "vision: depthwise convolutions, LayerNorm, layer scale",
        _zoo(lambda: _lm(_convnext_config(), "ConvNextForImageClassification"), image_samples),
    ),
    # Lightning's demos
    "demo_transformer": Model(
        "Lightning demo: nn.Transformer, its own step and SGD", lambda: DemoTransformer(vocab_size=VOCAB)
    ),
    "demo_lstm": Model("Lightning demo: LSTM carrying its hidden state across steps", DemoLSTM),
    "demo_mnist": Model(
        "Lightning demo: the MNIST convnet (max pooling, dropout)", _zoo(Net, mnist_samples, nll_loss, "adam")
    ),
    # plain PyTorch
    "lstm": Model("plain: a 2-layer LSTM tagger", _zoo(Tagger, tag_samples, cross_entropy, "adam")),
    "bn_cnn": Model(
        "plain: BatchNorm CNN, max pooling, SGD with StepLR, gradient clipping",
        _zoo(batchnorm_cnn, cnn_samples, cross_entropy, "sgd"),
        {"gradient_clip_val": 1.0},
    ),
}


def _resnet_config() -> Any:
    import transformers as tf

    return tf.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=LABELS
    )


def _convnext_config() -> Any:
    import transformers as tf

    return tf.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=LABELS)


ZOO: list[Config] = [
    Config("gpt2", "32-true"),
    Config("llama", "bf16-mixed"),
    Config("mistral", "32-true"),
    Config("qwen2", "32-true"),
    Config("gpt_neox", "32-true"),
    Config("opt", "bf16-true"),
    Config("gemma", "bf16-true"),
    Config("phi", "32-true"),
    Config("bert", "32-true"),
    Config("distilbert", "bf16-mixed"),
    Config("roberta", "32-true"),
    Config("t5", "32-true"),
    Config("bart", "bf16-mixed"),
    Config("mixtral", "32-true"),
    Config("qwen2_moe", "32-true"),
    Config("switch", "32-true"),
    Config("whisper", "32-true"),
    Config("wav2vec2", "32-true"),
    Config("vit", "bf16-mixed"),
    Config("resnet", "32-true"),
    Config("convnext", "32-true"),
    Config("demo_transformer", "32-true"),
    Config("demo_lstm", "32-true"),
    Config("demo_mnist", "32-true"),
    Config("lstm", "32-true"),
    Config("bn_cnn", "32-true"),
]

MOE = ("mixtral", "qwen2_moe", "switch")


def build(config: Config | str) -> L.LightningModule:
    """The LightningModule of ``config``, the same parameters on every call."""
    config = Config.parse(config) if isinstance(config, str) else config
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[config.model].build()


def zoo_module(name: str) -> L.LightningModule:
    """The command's builder: ``memtenants predict tests/zoo_models.py:zoo_module --init '{"name": "gpt2"}'``."""
    return build(Config(name, "32-true"))


def samples(module: L.LightningModule, n: int) -> list[Any]:
    """The data set of ``n`` samples the module trains on, as its ``example_batch`` collates them."""
    if isinstance(module, (DemoTransformer, DemoLSTM)):
        return token_pairs(n)
    return module.make_samples(n)
