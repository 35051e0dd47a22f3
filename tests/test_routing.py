"""Mixtures of experts, random draws and data-dependent sizes in a dry run: the routing it assumes, to the byte.

The hand-written top-2 mixture routes by a fixed prior far above its gate's logits, so its real routing is known
by construction: round robin (balanced), or skewed to given counts per expert. A real CPU fit with the callback and
the dry run with that routing then agree on every tenant at every phase, to the byte.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from conftest import assert_equals_the_real_run, make_trainer, no_collection
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_memtenants import MemoryTenantsCallback, dry_run, predict
from lightning_memtenants.predict.fake import fake_session
from lightning_memtenants.predict.kernels import grouped_mm_output
from lightning_memtenants.predict.routing import Routing, check_routing, parse_routing, routed_indices
from lightning_memtenants.predict.values import PredictionError

WIDTH, EXPERTS, TOP_K, TOKENS = 32, 4, 2, 64


def balanced_choice(tokens: int = TOKENS) -> list[tuple[int, ...]]:
    """Token t chooses experts 2t and 2t + 1 (mod 4): each expert 32 of the 128 choices."""
    return [tuple((t * TOP_K + j) % EXPERTS for j in range(TOP_K)) for t in range(tokens)]


def skewed_choice(tokens: int = TOKENS) -> list[tuple[int, ...]]:
    """The first 48 tokens choose experts 0 and 1, the last 16 experts 2 and 3: counts 48, 48, 16, 16."""
    return [(0, 1) if t < 48 else (2, 3) for t in range(tokens)]


class TopTwo(L.LightningModule):
    """A top-2 mixture of experts with a ``torch.where`` per expert; a fixed prior decides its routing."""

    def __init__(self, choice: list[tuple[int, ...]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(EXPERTS)
        )
        self.head = nn.Linear(WIDTH, 1)
        prior = torch.zeros(len(choice), EXPERTS)
        for token, experts in enumerate(choice):
            for rank, expert in enumerate(experts):
                prior[token, expert] = 20.0 - 10.0 * rank  # far above the gate's logits: the routing is the prior's
        self.register_buffer("prior", prior)

    def forward(self, x: Tensor) -> Tensor:
        weights, chosen = torch.topk((self.gate(x) + self.prior).softmax(-1), TOP_K, dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return self.head(x + out)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.fixture(autouse=True, scope="module")
def quiet() -> Any:
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def real_fit(module: L.LightningModule) -> MemoryTenantsCallback:
    """Two optimizer steps of a real CPU fit, measured on every step (as ``test_advise.real_fit``)."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(WIDTH, generator=generator),) for _ in range(TOKENS * 2)]
    cb = MemoryTenantsCallback(track_every_step=True, print_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with no_collection():
            make_trainer([cb], steps=2).fit(module, DataLoader(data, batch_size=TOKENS))
    return cb


def real_counts(module: TopTwo) -> list[int]:
    """The choices per expert of the module's real routing, read from a real forward."""
    x = torch.randn(TOKENS, WIDTH)
    with torch.no_grad():
        _, chosen = torch.topk((module.gate(x) + module.prior).softmax(-1), TOP_K, dim=-1)
    return torch.bincount(chosen.flatten(), minlength=EXPERTS).tolist()


@pytest.mark.parametrize(
    ("choice", "routing"),
    [(balanced_choice(), "balanced"), (skewed_choice(), None)],
    ids=["balanced", "given-counts"],
)
def test_a_mixture_of_experts_is_predicted_to_the_byte_of_a_real_fit(choice: Any, routing: Any) -> None:
    if routing is None:
        counts = real_counts(TopTwo(choice))
        assert counts == [48, 48, 16, 16]  # the skew the prior makes
        routing = {"counts": counts}
    cb = real_fit(TopTwo(choice))
    prediction = dry_run(TopTwo(choice), (torch.Size([TOKENS, WIDTH]),), steps=2, routing=routing)
    for predicted, real in zip(prediction.reports, (cb.first, cb.latest), strict=True):
        assert real is not None
        assert_equals_the_real_run(predicted, {"report": dataclasses.asdict(real)})
        (note,) = [n for n in predicted.notes if "routing" in n]
        assert "mixture of experts" in note
        assert ("balanced routing" if routing == "balanced" else "[48, 48, 16, 16]") in note
    if routing != "balanced":  # the counts matter: assumed balanced, backward's window (largest expert last) differs
        assumed = dry_run(TopTwo(choice), (torch.Size([TOKENS, WIDTH]),), steps=1).report
        assert cb.first is not None
        window = cb.first.phases["after_backward"].window_peak_bytes
        assert assumed.phases["after_backward"].window_peak_bytes != window


def test_the_routing_decides_the_tokens_each_expert_takes() -> None:
    """Per expert, the forward keeps its input rows (fp32) and its hidden activations: sizes follow the routing."""

    class Largest(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(WIDTH, EXPERTS)

        def forward(self, x: Tensor) -> Tensor:
            _, chosen = torch.topk(self.gate(x), TOP_K, dim=-1)
            sizes = torch.bincount(chosen.flatten(), minlength=EXPERTS)
            biggest = int(sizes.max())
            return self.gate(x[:biggest] * 2).sum()  # the largest expert's rows, saved for the gate's backward

    def loss(model: nn.Module, batch: Tensor) -> Tensor:
        return model(batch)

    def saved(routing: Any) -> int:
        report = predict(Largest(), torch.Size([TOKENS, WIDTH]), loss_fn=loss, routing=routing)
        return report.phases["before_backward"].tenants_bytes["activations"]

    # the largest expert takes 32 rows balanced, all 64 in the worst case, 48 with counts 48/48/16/16,
    # and ceil(1.5 x 128 / 4) = 48 under a capacity factor of 1.5; the rest of the saved bytes is the same
    base = saved("balanced") - 32 * WIDTH * 4
    assert saved("worst") - base == 64 * WIDTH * 4
    assert saved({"counts": [48, 48, 16, 16]}) - base == 48 * WIDTH * 4
    assert saved({"capacity_factor": 1.5}) - base == 48 * WIDTH * 4


def test_routed_choices_are_distinct_per_token_and_count_as_asked() -> None:
    choice = routed_indices([48, 48, 16, 16], TOKENS, TOP_K)
    assert choice.shape == (TOKENS, TOP_K) and choice.dtype == torch.int64
    assert torch.bincount(choice.flatten()).tolist() == [48, 48, 16, 16]
    assert all(len(set(row)) == TOP_K for row in choice.tolist())
    assert Routing().counts_for(0, 10, 2, 4) == [5, 5, 5, 5]
    assert Routing().counts_for(0, 3, 2, 4) == [2, 2, 1, 1]
    assert Routing("worst").counts_for(0, 10, 2, 4) == [10, 10, 0, 0]
    assert Routing("capacity_factor", capacity_factor=1.5).counts_for(0, 10, 2, 4) == [8, 8, 4, 0]


def test_routing_is_checked_with_one_clear_error() -> None:
    for bad in ("even", 3, {"counts": []}, {"counts": [1, -1]}, {"capacity_factor": 0.5}, {"counts": [1.5]}, None):
        with pytest.raises(ValueError, match="routing must be"):
            check_routing(bad)
    with pytest.raises(ValueError, match="routing must be"):
        predict(TopTwo(balanced_choice()), (torch.Size([TOKENS, WIDTH]),), routing="uniform")
    with pytest.raises(ValueError, match=r"routing counts \[1, 2, 3, 4\] do not fit router call 0: its 4 experts"):
        predict(TopTwo(balanced_choice()), (torch.Size([TOKENS, WIDTH]),), routing={"counts": [1, 2, 3, 4]})
    # counts of 3 experts route no choice among 4: the expert loop's sizes are then unknown, one sentence
    with pytest.raises(PredictionError, match=r"torch\.where\(chosen == index\)"):
        predict(TopTwo(balanced_choice()), (torch.Size([TOKENS, WIDTH]),), routing={"counts": [64, 32, 32]})
    assert parse_routing("counts:48,48,16,16") == Routing("counts", counts=((48, 48, 16, 16),))
    assert parse_routing("capacity:1.25") == Routing("capacity_factor", capacity_factor=1.25)
    with pytest.raises(ValueError, match="--routing must be"):
        parse_routing("counts:a")


class DataDependent(nn.Module):
    """Keeps the rows where an activation is positive: a size no assumption can give."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        y = self.proj(x)
        rows, _ = torch.where(y > 0)
        return y[rows].sum()


class DispatchedDirectly(DataDependent):
    """The same size, from an operator called through ``torch.ops``, which no function mode sees: the tracker
    meets the unknown size first."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.proj(x)
        rows = torch.ops.aten.nonzero.default(y > 0)
        return y.sum() + rows.numel() * 0


@pytest.mark.parametrize(
    ("model", "line"),
    [(DataDependent, "rows, _ = torch.where(y > 0)"), (DispatchedDirectly, "torch.ops.aten.nonzero.default(y > 0)")],
)
def test_a_size_no_one_knows_is_one_sentence_naming_the_line(model: type[nn.Module], line: str) -> None:
    with pytest.raises(PredictionError) as raised:
        predict(model(), torch.Size([8, WIDTH]), loss_fn=lambda m, b: m(b))
    text = str(raised.value)
    assert text.startswith("the training step cannot be predicted: ") and "test_routing.py" in text and line in text
    assert "measuring memory source failed" not in text and "GuardOnDataDependent" not in text
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


class LayerDrop(nn.Module):
    """Skips its second layer when a draw falls under 0.5, as LayerDrop does in training."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers[:2]:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = layer(x)
        return self.layers[2](x).sum()


@pytest.mark.parametrize("seed", [3, 4])  # seed 3 draws 0.00, 0.11 (both layers dropped), seed 4 0.56, 0.56 (none)
def test_a_layer_drop_is_drawn_for_real_and_the_user_s_generator_stays(seed: int) -> None:
    model = LayerDrop()
    torch.manual_seed(seed)
    state = torch.random.get_rng_state()
    draws = [torch.rand([]), torch.rand([])]  # the two draws the step will take, from the same generator
    torch.random.set_rng_state(state)
    report = predict(model, torch.Size([8, WIDTH]), loss_fn=lambda m, b: m(b))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert any("drawn for real" in note for note in report.notes)
    # each layer that runs saves its 8 x 32 fp32 input for its weight's gradient, unless that input is the batch
    # (no activation); the last layer always runs; the loss's sum saves nothing
    ran = [bool(d >= 0.5) for d in draws] + [True]
    saved = sum(8 * WIDTH * 4 for i, on in enumerate(ran) if on and any(ran[:i]))
    assert report.phases["before_backward"].tenants_bytes["activations"] == saved
    assert saved == {3: 0, 4: 2 * 8 * WIDTH * 4}[seed]


def test_grouped_mm_in_float32_has_the_real_kernel_s_output() -> None:
    """The CPU kernel multiplies float32 and pads each row to 16 bytes; the meta kernel refuses float32."""
    a, w = torch.randn(10, 8), torch.randn(3, 12, 8)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    real = torch.nn.functional.grouped_mm(a, w.transpose(-2, -1), offs=offs)
    size, stride, dtype = grouped_mm_output(a, w.transpose(-2, -1), offs, None)
    assert (size, stride, dtype) == (list(real.shape), list(real.stride()), real.dtype)
    b = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    real = torch.nn.functional.grouped_mm(a.bfloat16(), b.transpose(-2, -1), offs=offs)
    assert grouped_mm_output(a.bfloat16(), b.transpose(-2, -1), offs, None)[1] == [8, 1] == list(real.stride())
    with fake_session():
        fa = torch.empty(10, 8, requires_grad=True)
        fw = torch.empty(3, 12, 8, requires_grad=True)
        out = torch.nn.functional.grouped_mm(fa, fw.transpose(-2, -1), offs=offs)
        assert out.shape == (10, 12) and out.dtype == torch.float32
        out.backward(torch.empty(10, 12))
        assert fa.grad is not None and fw.grad is not None and fw.grad.shape == fw.shape


class Classifier(L.LightningModule):
    """A classifier that logs its accuracy from ``argmax``: a choice that reaches no size and no model tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(WIDTH, EXPERTS)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.layer(x)
        self.log("accuracy", (logits.argmax(-1) == y).float().mean())
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_argmax_that_routes_nothing_adds_no_note() -> None:
    report = predict(Classifier(), (torch.Size([8, WIDTH]), torch.zeros(8, dtype=torch.long)))
    assert not any("routing" in note for note in report.notes)


class BalancedTopTwo(TopTwo):
    """The balanced mixture with no constructor argument, as the command builds a model."""

    def __init__(self) -> None:
        super().__init__(balanced_choice())


def test_the_command_takes_a_routing(cli: Any) -> None:
    done = cli("predict", f"{__file__}:BalancedTopTwo", "--input-shape", f"{TOKENS},{WIDTH}", "--routing", "worst")
    assert done.returncode == 0, done.stderr
    assert "worst-case routing" in done.stdout
    bad = cli("predict", f"{__file__}:BalancedTopTwo", "--input-shape", f"{TOKENS},{WIDTH}", "--routing", "even")
    assert bad.returncode == 2 and "--routing must be balanced, worst" in bad.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_mixture_of_experts_is_predicted_on_every_rank(strategy: str) -> None:
    prediction = dry_run(BalancedTopTwo(), (torch.Size([TOKENS, WIDTH]),), strategy=strategy, world_size=2)
    assert len(prediction.ranks) == 2
    assert all(any("balanced routing" in note for note in report.notes) for report in prediction.ranks)


# Hugging Face mixtures of experts: 2 layers of width 64, 4 experts, top-2 (Switch: top-1, capacity 64), batch 4 x 32.
MOE_MODELS = ("mixtral", "qwen2_moe", "switch")


def hf_moe(name: str, experts: str | None = None) -> nn.Module:
    """A tiny Hugging Face mixture of experts built from its config; ``experts`` sets transformers' implementation."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "mixtral":
        config: Any = transformers.MixtralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        )  # fmt: skip
        build = transformers.MixtralForCausalLM
    elif name == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        )  # fmt: skip
        build = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.SwitchTransformersConfig(
            vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            num_experts=4, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
            decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        build = transformers.SwitchTransformersForConditionalGeneration
    if experts is not None:
        config._experts_implementation = experts
    return build(config)


def hf_batches() -> list[dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(4):
        ids = torch.randint(1, 256, (32,), generator=generator)
        samples.append({"input_ids": ids, "labels": ids.clone()})
    return samples


def hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).loss


def routed_counts(model: nn.Module, batch: dict[str, Tensor]) -> list[list[int]]:
    """Each router's real choices per expert on ``batch``, in call order, read by forward hooks."""
    counts: list[list[int]] = []

    def seen(module: nn.Module, args: Any, out: Any) -> None:
        chosen = out[2].argmax(-1) if type(module).__name__.startswith("Switch") else out[2]
        counts.append(torch.bincount(chosen.flatten(), minlength=4).tolist())

    routers = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "SwitchTransformersTop1Router")
    hooks = [m.register_forward_hook(seen) for m in model.modules() if type(m).__name__ in routers]
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    return counts


@pytest.mark.parametrize(
    ("name", "experts", "precision"),
    [
        ("mixtral", "eager", "32-true"),
        ("mixtral", None, "32-true"),  # grouped_mm experts in float32, which torch's meta kernel alone refuses
        pytest.param("mixtral", None, "bf16-mixed", marks=pytest.mark.slow),
        pytest.param("qwen2_moe", "eager", "bf16-mixed", marks=pytest.mark.slow),
        ("switch", None, "bf16-mixed"),
        pytest.param("switch", None, "bf16-true", marks=pytest.mark.slow),
    ],
)
def test_hugging_face_mixtures_given_their_real_counts_equal_a_real_fit(
    name: str, experts: str | None, precision: str
) -> None:
    from hf_models import HFModule

    data = hf_batches()
    first = {key: torch.stack([sample[key] for sample in data]) for key in data[0]}
    counts = routed_counts(hf_moe(name, experts), first)
    assert len(counts) == 2 and all(sum(c) == 4 * 32 * (1 if name == "switch" else 2) for c in counts)
    cb = MemoryTenantsCallback(track_every_step=True, print_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with no_collection():
            make_trainer([cb], steps=1, precision=precision).fit(
                HFModule(hf_moe(name, experts)), DataLoader(data, batch_size=4)
            )
    predicted = predict(HFModule(hf_moe(name, experts)), first, precision=precision, routing={"counts": counts})
    assert cb.first is not None
    assert_equals_the_real_run(predicted, {"report": dataclasses.asdict(cb.first)})
    assert any(note.startswith("mixture of experts") for note in predicted.notes)


# Every model in every precision on the CPU, the eager experts, and each model for a GPU target, DDP and FSDP.
EVERYWHERE = [
    *((name, None, precision, "cpu") for name in MOE_MODELS for precision in ("32-true", "bf16-mixed", "bf16-true")),
    ("mixtral", "eager", "bf16-mixed", "cpu"),
    ("qwen2_moe", "eager", "bf16-true", "cpu"),
    ("mixtral", None, "bf16-mixed", "A100"),
    ("mixtral", "eager", "32-true", "ddp"),
    ("mixtral", "eager", "bf16-true", "fsdp"),
    ("qwen2_moe", "eager", "32-true", "A100"),
    ("qwen2_moe", None, "bf16-mixed", "ddp"),
    ("qwen2_moe", None, "32-true", "fsdp"),
    ("switch", None, "bf16-true", "A100"),
    ("switch", None, "bf16-mixed", "ddp"),
    ("switch", None, "32-true", "fsdp"),
]


@pytest.mark.parametrize(("name", "experts", "precision", "where"), EVERYWHERE)
@pytest.mark.slow
def test_hugging_face_mixtures_are_predicted_everywhere(
    name: str, experts: str | None, precision: str, where: str
) -> None:
    options: dict[str, Any] = {"precision": precision, "loss_fn": hf_loss}
    if where == "A100":
        options["target"] = "A100"
    elif where in ("ddp", "fsdp"):
        options.update(strategy=where, world_size=2)
    batch = {key: torch.stack([s[key] for s in hf_batches()]) for key in ("input_ids", "labels")}
    report = predict(hf_moe(name, experts), batch, **options)
    assert report.peak_bytes and report.tenants_bytes["weights"] > 0
    assert any(note.startswith("mixture of experts") and "balanced routing" in note for note in report.notes)


@pytest.mark.slow
def test_fsdp2_refuses_a_router_that_converts_itself_as_a_real_run_does() -> None:
    """SwitchTransformers' router converts itself to float32 inside its forward. In bf16-true, FSDP2's reduce-scatter
    then refuses the gradients' mixed dtypes: a real 2-process gloo run of this model fails with this error, and the
    prediction raises FSDP2's own error, not a figure for a run that cannot happen."""
    batch = {key: torch.stack([s[key] for s in hf_batches()]) for key in ("input_ids", "labels")}
    with pytest.raises(AssertionError, match="uniform gradient dtype"):
        predict(hf_moe("switch"), batch, precision="bf16-true", loss_fn=hf_loss, strategy="fsdp", world_size=2)
