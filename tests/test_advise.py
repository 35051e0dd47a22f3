"""Fixes measured by dry runs: each predicted peak against a real CPU fit with the fix applied, to the byte.

A real fit here is two optimizer steps of a Trainer with ``MemoryTenantsCallback(track_every_step=True)``; its
peak is the higher of the two steps' (``cb.first`` and ``cb.latest``), as a fix's ``peak_bytes`` is the higher of
a two-step dry run's. The data set is a list of separate sample tensors: a ``TensorDataset`` hands out views of
one storage, which the tracker would count from the second micro-batch of an accumulated step on (it runs between
micro-batches), and the prediction holds no data set.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from compiled_models import GatedLM, gated_blocks, square_loss
from conftest import assert_equals_the_real_run, make_trainer, no_collection
from torch import nn
from torch.utils.data import DataLoader

from lightning_memtenants import MeasuredFix, MemoryTenantsCallback, advise, dry_run
from lightning_memtenants.analysis.budget import Budget
from lightning_memtenants.predict.advise import checkpoint_blocks

WIDTH, SAMPLES = 32, 256
HIDDEN = (64, 256, 128, 192)  # the blocks' hidden sizes: blocks.1 saves the most, then blocks.3


class Blocks(L.LightningModule):
    """Residual MLP blocks in an ``nn.ModuleList``, of different widths, so that they save different amounts."""

    def __init__(self, hidden: tuple[int, ...] = HIDDEN, foreach: bool | None = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, h), nn.Tanh(), nn.Linear(h, WIDTH)) for h in hidden)
        self.head = nn.Linear(WIDTH, 1)
        self.foreach = foreach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=self.foreach)


def shapes(size: int) -> tuple[torch.Size]:
    return (torch.Size([size, WIDTH]),)


@pytest.fixture(autouse=True, scope="module")
def quiet() -> Any:
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def real_fit(
    batch_size: int = SAMPLES,
    trainer_kwargs: dict[str, Any] | None = None,
    apply: Any = None,
    module: L.LightningModule | None = None,
) -> MemoryTenantsCallback:
    """Two optimizer steps of a real fit on the CPU, measured on every step."""
    kwargs = dict(trainer_kwargs or {})
    model = module if module is not None else Blocks()
    if apply is not None:
        apply(model)
    accumulate = kwargs.get("accumulate_grad_batches", 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(WIDTH, generator=generator),) for _ in range(batch_size * accumulate * 2)]
    cb = MemoryTenantsCallback(track_every_step=True, print_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with no_collection():
            make_trainer([cb], steps=2, **kwargs).fit(model, DataLoader(data, batch_size=batch_size))
    assert cb.first is not None and cb.latest is not None and cb.first.step == 0 and cb.latest.step == 1
    return cb


def measured_peak(fix: MeasuredFix) -> int:
    cb = real_fit(fix.batch_size or SAMPLES, fix.trainer_kwargs, fix.apply)
    return max(cb.first.peak_bytes, cb.latest.peak_bytes)  # type: ignore[union-attr,type-var]


def test_an_accumulated_step_is_predicted_as_lightning_runs_it_phase_by_phase() -> None:
    """accumulate_grad_batches=2: two micro-batches per optimizer step, zero_grad after the first one's forward."""
    cb = real_fit(64, {"accumulate_grad_batches": 2})
    prediction = dry_run(Blocks(), shapes(64), steps=2, accumulate_grad_batches=2)
    for predicted, real in zip(prediction.reports, (cb.first, cb.latest), strict=True):
        assert real is not None and len(predicted.micro_batches) == len(real.micro_batches) == 2
        assert_equals_the_real_run(predicted, {"report": dataclasses.asdict(real)})
        for mine, theirs in zip(predicted.micro_batches, real.micro_batches, strict=True):
            assert list(mine) == list(theirs)  # before_optimizer_step in the last micro-batch alone
            for name in mine:
                assert mine[name].tenants_bytes == theirs[name].tenants_bytes, name
                assert mine[name].allocated_bytes == theirs[name].allocated_bytes, name
                assert mine[name].window_peak_bytes == theirs[name].window_peak_bytes, name
    first, second = prediction.reports
    weights = first.tenants_bytes["weights"]
    # the second micro-batch starts with the first one's gradients; the steady step's first one with the last step's
    assert first.micro_batches[1]["batch_start"].tenants_bytes["gradients"] == weights
    assert second.micro_batches[0]["batch_start"].tenants_bytes["gradients"] == weights
    # zero_grad runs once per optimizer step, after the first micro-batch's forward
    assert second.micro_batches[0]["before_backward"].tenants_bytes["gradients"] == 0
    assert second.micro_batches[1]["before_backward"].tenants_bytes["gradients"] == weights


def test_accumulate_grad_batches_is_checked() -> None:
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="accumulate_grad_batches must be a positive integer"):
            dry_run(Blocks(), shapes(4), accumulate_grad_batches=bad)  # type: ignore[arg-type]

    class Manual(Blocks):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="accumulate_grad_batches must be 1 under manual optimization"):
        dry_run(Manual(), shapes(4), accumulate_grad_batches=2)


# The budget of the tests of single fixes: 1,615,000 bytes less the 5% margin, between the baseline's peak and one
# checkpointed block's (the largest saver's), so that the fewest blocks that fit is one.
BUDGET = 1_700_000


@pytest.fixture(scope="module")
def advice() -> Any:
    return advise(Blocks(), shapes(SAMPLES), BUDGET, fsdp_ranks=(2, 4), compile_fixes=True)


def test_each_measured_fix_holds_to_the_byte_in_a_real_fit(advice: Any) -> None:
    """On the CPU the prediction is exact: each fix's peak is the real fit's, not within 1% but equal."""
    baseline = real_fit()
    assert advice.baseline_peak_bytes == max(baseline.first.peak_bytes, baseline.latest.peak_bytes)
    names = [fix.name for fix in advice.fixes]
    assert sorted(names) == sorted(
        [
            "bf16-mixed",
            "activation checkpointing (1 of 4 blocks)",
            "smaller micro-batch (128 x accumulate_grad_batches=2)",
            "foreach=False",
            "fused=True",
            "SGD with momentum",
            "Adafactor",
            "FSDP over 2 ranks",
            "torch.compile",
        ]
    )  # one of each kind, and no combination: single fixes fit
    for fix in advice.fixes:
        assert fix.saves_bytes == advice.baseline_peak_bytes - fix.peak_bytes
        if fix.name.startswith("FSDP"):  # no second process here: the cluster's dry run, rank by rank
            cluster = dry_run(Blocks(), shapes(SAMPLES // 2), steps=2, strategy="fsdp", world_size=2)
            assert fix.peak_bytes == max(r.peak_bytes for r in [*cluster.reports, *cluster.ranks])  # type: ignore[type-var]
            assert (fix.trainer_kwargs, fix.batch_size) == ({"devices": 2}, SAMPLES // 2)
            continue
        assert measured_peak(fix) == fix.peak_bytes, fix.name


def test_each_fix_says_what_to_pass_and_what_to_write(advice: Any) -> None:
    fixes = {fix.name.split(" (")[0]: fix for fix in advice.fixes}
    bf16 = fixes["bf16-mixed"]
    assert (bf16.trainer_kwargs, bf16.batch_size, bf16.apply) == ({"precision": "bf16-mixed"}, None, None)
    micro = fixes["smaller micro-batch"]
    assert (micro.trainer_kwargs, micro.batch_size, micro.apply) == ({"accumulate_grad_batches": 2}, 128, None)
    assert "batch_size=128" in micro.how and "accumulate_grad_batches=2" in micro.how
    # the largest saver is the widest block, blocks.1 (256 hidden units); it alone is wrapped
    checkpointed = fixes["activation checkpointing"]
    assert checkpointed.trainer_kwargs == {} and "blocks.1 in torch.utils.checkpoint" in checkpointed.how
    model = Blocks()
    checkpointed.apply(model)
    checkpointed.apply(model)  # twice is once
    wrapped = [i for i, block in enumerate(model.blocks) if "forward" in block.__dict__]
    assert wrapped == [1]
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in Blocks().named_parameters()]
    for name in ("SGD with momentum", "Adafactor"):
        assert fixes[name].changes_training and "it trains differently" in fixes[name].how
    assert not any(fix.changes_training for key, fix in fixes.items() if key not in ("SGD with momentum", "Adafactor"))
    fused = Blocks()
    fixes["fused=True"].apply(fused)
    (optimizer,) = [fused.configure_optimizers()]
    assert optimizer.defaults["fused"] is True and optimizer.param_groups[0]["foreach"] is False
    sgd = Blocks()
    fixes["SGD with momentum"].apply(sgd)
    replaced = sgd.configure_optimizers()
    assert type(replaced) is torch.optim.SGD and replaced.defaults["momentum"] == 0.9
    compiled = Blocks()
    assert "torch.compile(block.forward) for blocks.0, blocks.1, blocks.2, blocks.3," in fixes["torch.compile"].how
    fixes["torch.compile"].apply(compiled)  # each block's forward compiled: training_step calls them
    assert [hasattr(block.forward, "_torchdynamo_orig_callable") for block in compiled.blocks] == [True] * 4
    assert "forward" not in compiled.head.__dict__  # the head is no block
    assert [name for name, _ in compiled.named_parameters()] == [name for name, _ in Blocks().named_parameters()]
    # without budgets to search, none is searched: a note says how
    assert any(n.startswith("activation_memory_budget: give activation_memory_budgets=(") for n in advice.notes)
    assert replaced.param_groups[0]["lr"] == 1e-3  # the model's own learning rate, to be tuned


def test_fixes_are_sorted_fits_first_then_by_peak_and_fit_the_budget_less_the_margin(advice: Any) -> None:
    limit = Budget(BUDGET, 0.05).limit_bytes
    assert limit == 1_615_000  # 1,700,000 x 0.95
    assert (advice.budget_bytes, advice.margin, advice.limit_bytes) == (BUDGET, 0.05, limit)
    assert advice.baseline_peak_bytes > limit and not advice.fits
    assert [fix.fits for fix in advice.fixes] == [fix.peak_bytes <= limit for fix in advice.fixes]
    keys = [(not fix.fits, fix.peak_bytes) for fix in advice.fixes]
    assert keys == sorted(keys)
    # the optimizer's implementation saves nothing here: the peak is in backward, not in the optimizer step
    unchanged = [fix for fix in advice.fixes if fix.name in ("foreach=False", "fused=True")]
    assert [(fix.fits, fix.saves_bytes) for fix in unchanged] == [(False, 0), (False, 0)]
    assert advice.fixes[-1].name in ("foreach=False", "fused=True")


def test_combinations_where_no_fix_that_keeps_the_batch_fits() -> None:
    """1.2 MB, no margin: neither bf16-mixed nor checkpointing every block fits alone; together, or with a
    micro-batch, they do, and each combination's peak is the real fit's."""
    advice = advise(Blocks(), shapes(SAMPLES), 1_200_000, margin=0.0)
    combined = [fix for fix in advice.fixes if " + " in fix.name]
    assert [fix.name for fix in combined] == [
        "bf16-mixed + activation checkpointing (4 of 4 blocks) + smaller micro-batch (128 x accumulate_grad_batches=2)",
        "bf16-mixed + smaller micro-batch (128 x accumulate_grad_batches=2)",
        "bf16-mixed + activation checkpointing (1 of 4 blocks)",
    ]
    single = {fix.name: fix for fix in advice.fixes if " + " not in fix.name}
    assert not single["bf16-mixed"].fits and not single["activation checkpointing (4 of 4 blocks)"].fits
    for fix in combined:
        assert fix.fits
        assert measured_peak(fix) == fix.peak_bytes, fix.name
    assert combined[0].trainer_kwargs == {"precision": "bf16-mixed", "accumulate_grad_batches": 2}


def test_a_plain_module_gets_its_optimizer_factory_changed() -> None:
    """With loss_fn and optimizer: the fixes change the factory; what they measure is a dry run with the flag."""
    model = nn.Sequential(nn.Linear(WIDTH, 512), nn.Tanh(), nn.Linear(512, WIDTH))

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).pow(2).mean()

    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, foreach=True)

    options: dict[str, Any] = {"loss_fn": loss, "optimizer": adam}
    advice = advise(model, torch.Size([8, WIDTH]), "1GiB", **options)
    assert advice.fits and all(fix.fits for fix in advice.fixes)
    fixes = {fix.name: fix for fix in advice.fixes}
    single = dry_run(model, torch.Size([8, WIDTH]), steps=2, loss_fn=loss, optimizer=torch.optim.Adam)
    fused = dry_run(
        model, torch.Size([8, WIDTH]), steps=2, loss_fn=loss, optimizer=lambda p: torch.optim.Adam(p, fused=True)
    )
    assert fixes["foreach=False"].peak_bytes == max(r.peak_bytes for r in single.reports)
    assert fixes["fused=True"].peak_bytes == max(r.peak_bytes for r in fused.reports)
    assert fixes["fused=True"].apply is None and "the optimizer factory" in fixes["fused=True"].how
    # a lone Sequential's children are the blocks; with room to spare, checkpointing shows what every block saves
    assert "activation checkpointing (1 of 1 blocks)" in fixes or "activation checkpointing (2 of 2 blocks)" in fixes
    # the batch fits: half of it is what a micro-batch would save
    assert fixes["smaller micro-batch (4 x accumulate_grad_batches=2)"].batch_size == 4


def test_a_callable_batch_needs_make_batch_for_micro_batches() -> None:
    small = Blocks(hidden=(16, 16))
    advice = advise(small, lambda: (torch.randn(8, WIDTH),), "1GiB")
    assert not any(fix.name.startswith("smaller micro-batch") for fix in advice.fixes)
    assert any("give make_batch(batch_size)" in note for note in advice.notes)
    advice = advise(small, lambda: (torch.randn(8, WIDTH),), "1GiB", make_batch=shapes)
    (micro,) = [fix for fix in advice.fixes if fix.name.startswith("smaller micro-batch")]
    expected = dry_run(small, shapes(4), steps=2, accumulate_grad_batches=2)
    assert micro.peak_bytes == max(r.peak_bytes for r in expected.reports) and micro.batch_size == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_bytes": -1}, "budget_bytes must be"),
        ({"budget_bytes": "12XB"}, "budget_bytes"),
        ({"margin": 1.0}, "margin must be a fraction"),
        ({"make_batch": 3}, "make_batch must be None or a callable"),
        ({"steps": 1}, "steps is not an option of advise"),
        ({"batch": None}, "batch must be"),
        ({"precision": "fp8"}, "precision"),
        ({"accumulate_grad_batches": 0}, "accumulate_grad_batches must be a positive integer"),
        ({"fsdp_ranks": (1, 2)}, "fsdp_ranks must be a list of rank counts of 2 or more"),
        ({"activation_memory_budgets": (0.5, 2)}, r"activation_memory_budgets must be a list of values in \[0, 1\]"),
        ({"activation_memory_budgets": 0.5}, "activation_memory_budgets must be a list"),
        ({"compile_fixes": "yes"}, "compile_fixes must be True or False"),
        ({"strategy": "fsdp", "world_size": 2}, "strategy, world_size and tensor_parallel: advise measures one"),
        ({"tensor_parallel": 2}, "strategy, world_size and tensor_parallel: advise measures one"),
    ],
)
def test_bad_input_is_one_value_error_naming_the_argument(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"batch": shapes(4), "budget_bytes": "1GiB", **kwargs}
    with pytest.raises(ValueError, match=message):
        advise(Blocks(hidden=(8,)), arguments.pop("batch"), arguments.pop("budget_bytes"), **arguments)
    with pytest.raises(TypeError, match="unexpected keyword argument 'gpus'"):
        advise(Blocks(hidden=(8,)), shapes(4), "1GiB", gpus=1)  # type: ignore[call-arg]


def test_checkpoint_blocks_refuses_a_block_that_is_not_there() -> None:
    with pytest.raises(ValueError, match=r"names: Blocks has no block 'blocks\.9'"):
        checkpoint_blocks(Blocks(), ["blocks.9"])


class FailsAtStep(Blocks):
    """Runs out of memory in the forward of step ``fail_step`` (an injected CUDA-style error)."""

    def __init__(self, fail_step: int = 1, unknowable: bool = False) -> None:
        super().__init__()
        self.fail_step, self.unknowable = fail_step, unknowable

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        (x,) = batch
        if self.unknowable and x.mean() > 10:  # a branch on a value: a dry run cannot take it
            x = x * 2
        return self(x).pow(2).mean()


def oom_fit(tmp_path: Any, module: Blocks, **kwargs: Any) -> tuple[dict[str, Any], str, list[str]]:
    """A fit that runs out of memory at step 1, with the budget of the tests; its postmortem and warnings."""
    import json

    cb = MemoryTenantsCallback(
        budget_bytes=BUDGET, postmortem_dir=tmp_path, print_summary=False, track_every_step=True, **kwargs
    )
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(WIDTH, generator=generator),) for _ in range(SAMPLES * 3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(torch.OutOfMemoryError), no_collection():
            make_trainer([cb], steps=3).fit(module, DataLoader(data, batch_size=SAMPLES))
    record = json.loads((tmp_path / "memtenants_oom.json").read_text())
    messages = [str(w.message) for w in caught if "memtenants" in str(w.message)]
    return record, (tmp_path / "memtenants_oom.txt").read_text(), messages


def test_the_postmortem_measures_the_fixes_after_the_fit_failed_and_the_warning_says_how(
    tmp_path: Any, advice: Any
) -> None:
    record, text, messages = oom_fit(tmp_path, FailsAtStep(), measure_fixes=True)
    assert record["fixes_kind"] == "measured" and "after the fit failed, never during it" in record["fixes_note"]
    # a dry run of a meta copy of the run's module and of its batch: the figures of advise() on a fresh model
    # the run measures no FSDP, nor torch.compile (advise's compile_fixes is off by default)
    single_device = [fix for fix in advice.fixes if not fix.name.startswith(("FSDP", "torch.compile"))]
    assert [(f["name"], f["peak_bytes"], f["fits"]) for f in record["fixes"]] == [
        (fix.name, fix.peak_bytes, fix.fits) for fix in single_device
    ]
    assert record["fixes"][0]["action"] == single_device[0].name and "saves_bytes" in record["fixes"][0]
    assert "fixes, measured by dry runs of the step" in text and "estimated" not in text
    # no dry run inside the fit: the budget warning gives the estimates and says how to get measured fixes
    assert not [m for m in messages if "measured by dry runs of this step" in m]
    over = [m for m in messages if "over the budget" in m]
    assert over and "these fixes are estimates" in over[0] and "MemoryTenantsCallback.advise() after fit" in over[0]


def test_without_measure_fixes_the_postmortem_says_its_fixes_are_estimates(tmp_path: Any) -> None:
    record, text, messages = oom_fit(tmp_path, FailsAtStep())
    assert record["fixes_kind"] == "estimated" and "measure_fixes=True" in record["fixes_note"]
    assert set(record["fixes"][0]) == {"action", "saves_bytes"}
    assert "fixes, estimated from the tenants (not measured)" in text
    assert not [m for m in messages if "measured by dry runs" in m]


def test_a_step_that_cannot_be_dry_run_falls_back_to_the_estimates_and_warns_once(tmp_path: Any) -> None:
    record, text, messages = oom_fit(tmp_path, FailsAtStep(unknowable=True), measure_fixes=True)
    assert record["fixes_kind"] == "estimated" and "failed" in record["fixes_note"]
    failed = [m for m in messages if "the fixes by dry runs of the step failed" in m]
    assert len(failed) == 1 and "cannot be predicted" in failed[0]
    assert "estimated from the tenants" in text


def test_measure_fixes_is_a_flag() -> None:
    with pytest.raises(ValueError, match="measure_fixes must be True or False"):
        MemoryTenantsCallback(measure_fixes="yes")  # type: ignore[arg-type]


def test_a_lightning_module_given_an_optimizer_factory_gets_the_factory_changed() -> None:
    """With ``optimizer=``, the dry run uses the factory, not configure_optimizers: the fixes change the factory."""
    small = Blocks(hidden=(16, 16))

    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, foreach=True)

    advice = advise(small, shapes(8), "1GiB", optimizer=adam)
    fixes = {fix.name: fix for fix in advice.fixes}
    single = dry_run(small, shapes(8), steps=2, optimizer=torch.optim.Adam)
    assert fixes["foreach=False"].peak_bytes == max(r.peak_bytes for r in single.reports)  # type: ignore[type-var]
    assert fixes["foreach=False"].apply is None and "the optimizer factory" in fixes["foreach=False"].how
    assert "make the optimizer factory return torch.optim.SGD(params" in fixes["SGD with momentum"].how


# -- advise that applies: whole blocks, Hugging Face's cache, schedulers, manual optimization, what a fix changes --


def tiny_hf(name: str) -> nn.Module:
    """A Hugging Face model of 2 layers of width 64 from its config, with the cache on (``use_cache=True``, as a
    config's default): T5, Mistral and Qwen2 with a sliding window, OPT, BART with stacks of 3 and 2 layers."""
    import transformers as tf
    from hf_models import HIDDEN as H
    from hf_models import SEQ, VOCAB

    torch.manual_seed(0)
    sizes: dict[str, Any] = {"vocab_size": VOCAB, "attn_implementation": "sdpa"}
    decoder = {"hidden_size": H, "intermediate_size": 2 * H, "num_hidden_layers": 2, "num_attention_heads": 4}
    decoder.update(num_key_value_heads=2, max_position_embeddings=2 * SEQ, **sizes)
    if name == "t5":
        config = tf.T5Config(
            d_model=H, d_kv=16, d_ff=2 * H, num_layers=2, num_heads=4, decoder_start_token_id=0, **sizes
        )
        return tf.T5ForConditionalGeneration(config)
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=16, **decoder))
    if name == "qwen2":
        config = tf.Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0, **decoder)
        return tf.Qwen2ForCausalLM(config)
    if name == "opt":
        config = tf.OPTConfig(
            hidden_size=H, ffn_dim=2 * H, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2 * SEQ,
            word_embed_proj_dim=H, **sizes,
        )  # fmt: skip
        return tf.OPTForCausalLM(config)
    assert name == "bart"
    config = tf.BartConfig(
        d_model=H, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=2 * H, decoder_ffn_dim=2 * H, max_position_embeddings=2 * SEQ, **sizes,
    )  # fmt: skip
    return tf.BartForConditionalGeneration(config)


def token_samples(padded: bool) -> list[dict[str, torch.Tensor]]:
    """4 sequences of 32 tokens, the labels the tokens, right padding masked where ``padded``."""
    from hf_models import BATCH, SEQ, VOCAB, padding_mask

    generator = torch.Generator().manual_seed(1)
    mask = padding_mask() if padded else torch.ones(BATCH, SEQ, dtype=torch.long)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator).masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(BATCH)]


def fit_peak(module: L.LightningModule, data: list[Any], fix: MeasuredFix | None = None) -> tuple[int, L.Trainer]:
    """The higher step peak of two optimizer steps of a real CPU fit, with ``fix`` applied; and the trainer."""
    kwargs = dict(fix.trainer_kwargs) if fix is not None else {}
    if fix is not None and fix.apply is not None:
        fix.apply(module)
    size = (fix.batch_size if fix is not None else None) or len(data) // 2
    cb = MemoryTenantsCallback(track_every_step=True, print_summary=False)
    trainer = make_trainer([cb], steps=2, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with no_collection():
            trainer.fit(module, DataLoader(data, batch_size=size))
    assert cb.first is not None and cb.latest is not None and (cb.first.step, cb.latest.step) == (0, 1)
    return max(cb.first.peak_bytes, cb.latest.peak_bytes), trainer  # type: ignore[type-var]


class SubLayers(nn.Module):
    """A block whose sub-layers of different classes are in a ModuleList, as T5's ``T5Block.layer``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([nn.Linear(4, 4), nn.Tanh()])


def test_the_blocks_are_the_whole_repeated_layers_not_their_sub_layers() -> None:
    from lightning_memtenants.predict.cluster import blocks_of, named_blocks

    t5 = tiny_hf("t5")
    # T5Block.layer (3 sub-layers) is longer than the 2-layer stacks: a list inside a block is never the blocks
    assert [name for name, _ in named_blocks(t5)] == [
        "encoder.block.0",
        "encoder.block.1",
        "decoder.block.0",
        "decoder.block.1",
    ]
    assert blocks_of(t5) == [*t5.encoder.block, *t5.decoder.block]  # FSDP shards the same units
    bart = tiny_hf("bart")  # stacks of 3 and 2 layers: transformers marks both as repeated layers
    assert [name for name, _ in named_blocks(bart)] == [
        *(f"model.encoder.layers.{i}" for i in range(3)),
        *(f"model.decoder.layers.{i}" for i in range(2)),
    ]
    # the only ModuleLists are sub-layers of two blocks of one class: the blocks are those two
    assert [name for name, _ in named_blocks(nn.Sequential(SubLayers(), SubLayers(), nn.Linear(4, 1)))] == ["0", "1"]
    # one block alone: its list's children are what there is
    lone = nn.Sequential(nn.Linear(4, 4), SubLayers())
    assert [name for name, _ in named_blocks(lone)] == ["1.layer.0", "1.layer.1"]
    # two lists as long, of other classes (test_cli's model): the first alone
    tie = nn.Module()
    tie.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))
    tie.out = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    assert [name for name, _ in named_blocks(tie)] == ["blocks.0", "blocks.1"]
    # the two stacks of an encoder-decoder that does not mark its layers: equal lists of one class
    stacks = nn.Module()
    stacks.encoder, stacks.decoder = nn.Module(), nn.Module()
    stacks.encoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    stacks.decoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    assert len(named_blocks(stacks)) == 4


@pytest.mark.parametrize(
    ("name", "padded"),
    [
        ("mistral", False),  # a sliding window, the cache on
        pytest.param("t5", False, marks=pytest.mark.slow),  # an encoder-decoder: both stacks
        pytest.param("qwen2", True, marks=pytest.mark.slow),  # a sliding window and padding
        pytest.param("opt", True, marks=pytest.mark.slow),  # padding
    ],
)
def test_checkpointing_a_transformers_model_turns_its_cache_off_and_holds_in_a_real_fit(
    name: str, padded: bool
) -> None:
    """Checkpointed with the cache on, the recomputation writes the KV cache again and fails; the fix checkpoints as
    transformers' gradient_checkpointing_enable() does, cache off, and a real step with it reaches its peak."""
    from hf_models import HFModule

    data = token_samples(padded) * 2
    advice = advise(HFModule(tiny_hf(name)), torch.utils.data.default_collate(data[:4]), "1GiB")
    assert not [note for note in advice.notes if "left out" in note]
    (fix,) = [fix for fix in advice.fixes if fix.name.startswith("activation checkpointing")]
    blocks = 4 if name == "t5" else 2
    assert fix.name == f"activation checkpointing ({blocks} of {blocks} blocks)"  # fits already: every block
    assert fix.saves_bytes > 0 and not fix.changes_training
    module = HFModule(tiny_hf(name))
    peak, _ = fit_peak(module, data, fix)
    assert peak == fix.peak_bytes
    layers = [m for m in module.modules() if type(m).__name__.endswith(("Block", "DecoderLayer"))]
    assert len(layers) == blocks and all(layer.gradient_checkpointing for layer in layers)


class Alternating(nn.Module):
    """A block that computes another way each time it runs: checkpointing's recomputation saves other tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(WIDTH, 16), nn.Linear(16, WIDTH), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.a(x)
        return self.b(h * h if self.calls % 2 else h + 1)


def test_a_fix_whose_dry_run_fails_is_left_out_with_a_note_and_the_rest_is_measured() -> None:
    model = Blocks(hidden=(16, 16))
    model.blocks[1] = Alternating()
    advice = advise(model, shapes(8), "1GiB")
    assert not any(fix.name.startswith("activation checkpointing") for fix in advice.fixes)
    (note,) = [note for note in advice.notes if note.startswith("activation checkpointing")]
    assert note.startswith(
        "activation checkpointing (2 of 2 blocks): left out, as a dry run of the step with it failed (CheckpointError:"
    )
    assert "\n" not in note
    assert {"bf16-mixed", "SGD with momentum", "Adafactor"} <= {fix.name for fix in advice.fixes}


class Distributed(Blocks):
    """A step that refuses to run under torch.distributed: the FSDP candidate's dry runs fail, the others do not."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError("this step runs on one device only")
        return super().training_step(batch, batch_idx)


def test_a_failing_fsdp_candidate_never_fails_advise() -> None:
    advice = advise(Distributed(hidden=(16, 16)), shapes(8), "1GiB", fsdp_ranks=(2,))
    assert not any(fix.name.startswith("FSDP") for fix in advice.fixes)
    assert (
        "FSDP over N ranks: left out, as a dry run of the step with it failed (RuntimeError: this step runs on one"
        " device only)"
    ) in advice.notes
    assert any(fix.name.startswith("smaller micro-batch") for fix in advice.fixes)


class WithScheduler(Blocks):
    """``configure_optimizers`` in each form a scheduler takes: ``[opt], [sched]``, or a dict with OneCycleLR or
    StepLR."""

    def __init__(self, form: str) -> None:
        super().__init__(hidden=(16, 16))
        self.form = form

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        if self.form == "list":
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]
        if self.form == "onecycle":
            scheduler: Any = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=10)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("form", ["list", "onecycle", "steplr"])
def test_another_optimizer_keeps_the_schedulers_working_in_a_real_fit(form: str) -> None:
    advice = advise(WithScheduler(form), shapes(8), "1GiB")
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(WIDTH, generator=generator),) for _ in range(16)]
    _, unchanged = fit_peak(WithScheduler(form), data)
    scheduled = unchanged.optimizers[0].param_groups[0]["lr"]  # the learning rate the schedule gives after 2 steps
    assert scheduled != pytest.approx(1e-2 / 25 if form == "onecycle" else 1e-3)  # it moved
    for name, kind in (("SGD with momentum", torch.optim.SGD), ("Adafactor", torch.optim.Adafactor)):
        (fix,) = [fix for fix in advice.fixes if fix.name == name]
        peak, trainer = fit_peak(WithScheduler(form), data, fix)
        assert peak == fix.peak_bytes, name
        (optimizer,) = trainer.optimizers
        (config,) = trainer.lr_scheduler_configs
        assert type(optimizer) is kind and config.scheduler.optimizer is optimizer
        assert optimizer.param_groups[0]["lr"] == pytest.approx(scheduled), name  # the same schedule


class Manual(Blocks):
    """Manual optimization: the step zeroes, backs up and steps its optimizer itself."""

    def __init__(self) -> None:
        super().__init__(hidden=(64, 256))
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        (x,) = batch
        self.manual_backward(self(x).pow(2).mean())
        optimizer.step()  # type: ignore[union-attr]


def test_manual_optimization_gets_the_fixes_that_apply_to_it() -> None:
    advice = advise(Manual(), shapes(64), "1GiB")
    names = {fix.name for fix in advice.fixes}
    assert not any(name.startswith("smaller micro-batch") for name in names)
    assert any("automatic_optimization=False" in note and "accumulate_grad_batches" in note for note in advice.notes)
    assert {"activation checkpointing (2 of 2 blocks)", "SGD with momentum", "bf16-mixed"} <= names
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(WIDTH, generator=generator),) for _ in range(128)]
    for fix in advice.fixes:
        if fix.name in ("activation checkpointing (2 of 2 blocks)", "SGD with momentum"):
            assert fit_peak(Manual(), data, fix)[0] == fix.peak_bytes, fix.name


class Normed(Blocks):
    """A BatchNorm inside block 0: its statistics are the batch's, and it updates running statistics."""

    def __init__(self) -> None:
        super().__init__(hidden=(16, 16))
        self.blocks[0].insert(1, nn.BatchNorm1d(16))


class Contrastive(Blocks):
    """An in-batch loss: each sample's embedding against every other's, a batch x batch matrix of logits."""

    def __init__(self) -> None:
        super().__init__(hidden=(16, 16))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        z = x
        for block in self.blocks:
            z = z + block(z)
        logits = z @ z.T
        return nn.functional.cross_entropy(logits, torch.arange(len(z)))


def test_a_smaller_batch_is_marked_where_the_step_sees_the_batch_as_a_whole() -> None:
    normed = advise(Normed(), shapes(8), "1GiB", fsdp_ranks=(2,))
    fixes = {fix.name.split(" (")[0]: fix for fix in normed.fixes}
    for name in ("smaller micro-batch", "FSDP over 2 ranks"):  # a rank's BatchNorm sees its own share too
        assert fixes[name].changes_training and "BatchNorm normalizes over the batch" in fixes[name].training_note
        assert fixes[name].training_note in fixes[name].how
    assert not fixes["bf16-mixed"].changes_training and fixes["bf16-mixed"].training_note == ""
    # checkpointing block 0 would update BatchNorm's running statistics twice: only block 1 is offered
    assert fixes["activation checkpointing"].name == "activation checkpointing (1 of 1 blocks)"
    assert "blocks.0 left out, as their BatchNorm would update its running statistics again" in " ".join(normed.notes)
    contrastive = advise(Contrastive(), shapes(8), "1GiB")
    (micro,) = [fix for fix in contrastive.fixes if fix.name.startswith("smaller micro-batch")]
    assert micro.changes_training and "a batch x batch matrix" in micro.training_note
    assert micro.to_dict()["training_note"] == micro.training_note
    # a square weight as wide as the batch is not an in-batch loss: Blocks at 16 samples, blocks 16 and 8 wide
    plain = advise(Blocks(hidden=(16, 8)), shapes(16), "1GiB")
    (micro,) = [fix for fix in plain.fixes if fix.name.startswith("smaller micro-batch")]
    assert micro.batch_size == 8 and not micro.changes_training and micro.training_note == ""


ONE_DEVICE_MODULE = """
import lightning as L
import torch
from torch import nn


class OneDevice(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(64, 16)

    def training_step(self, batch, batch_idx):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError("this step runs on one device only")
        x = batch[0]
        return self.out(self.blocks[1](self.out(self.blocks[0](x)))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())

    def example_batch(self, batch_size, seq_len=None):
        return (torch.randn(batch_size, 16),)
"""


def test_the_command_prints_the_advice_and_says_which_fix_failed_not_the_step(tmp_path: Any, cli: Any) -> None:
    path = tmp_path / "one_device.py"
    path.write_text(ONE_DEVICE_MODULE)
    run = cli("advise", f"{path}:OneDevice", "--batch-size", "8", "--budget", "1GiB", "--fsdp-ranks", "2")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert (
        "FSDP over N ranks: left out, as a dry run of the step with it failed (RuntimeError: this step runs on one"
        " device only)"
    ) in lines
    assert any(line.startswith("bf16-mixed  ") for line in lines) and "training step" not in run.stderr


# -- torch.compile and activation_memory_budget (issue #31) --------------------------------------------------------

# The gated blocks at a batch of 1024, compiled whole (GatedLM(compiled=True), Adam): at 64 the weights, gradients and
# Adam's state peak at the end of backward whatever is saved, and no budget changes the peak; at 1024 the saved
# activations set it. The limit lies below the compiled step's peak at the budget of 1 and above its peak at 0.4
# (a real fit's: 84,041,828 and 72,484,972 bytes); the budgets 0.8 and 0.5 peak between (74,574,956 and 75,607,148:
# not monotone), so the search must run each.
GATED_BATCH = (torch.Size([1024, 256]),)
GATED_GRID = (0.8, 0.5, 0.4)
GATED_LIMIT = 73_000_000


def compiled_fit(budget: float) -> MemoryTenantsCallback:
    """Two steps of a real CPU fit of ``GatedLM(compiled=True)`` at ``budget``, inductor's kernels compiled and run."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(256, generator=generator),) for _ in range(2 * GATED_BATCH[0][0])]
    cb = MemoryTenantsCallback(track_every_step=True, print_summary=False)
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=budget), warnings.catch_warnings(), no_collection():
        warnings.simplefilter("ignore")
        make_trainer([cb], steps=2).fit(GatedLM(compiled=True), DataLoader(data, batch_size=GATED_BATCH[0][0]))
    torch._dynamo.reset()
    assert cb.first is not None and cb.latest is not None
    return cb


@pytest.fixture(scope="module")
def budget_search() -> dict[str, Any]:
    """advise on the compiled gated blocks with budgets to search; the real fit at the budget it chose."""
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    graphs, before = stats["unique_graphs"], torch._functorch.config.activation_memory_budget
    advice = advise(GatedLM(compiled=True), GATED_BATCH, GATED_LIMIT, margin=0.0, activation_memory_budgets=GATED_GRID)
    result: dict[str, Any] = {"advice": advice, "graphs": (graphs, stats["unique_graphs"])}
    result["budget"] = (before, torch._functorch.config.activation_memory_budget)
    fix = next(f for f in advice.fixes if f.name.startswith("activation_memory_budget = "))
    chosen = float(fix.name.removeprefix("activation_memory_budget = "))
    above = min(b for b in (*GATED_GRID, before) if b > chosen)  # the next budget up: on the grid, or the one set
    with torch._functorch.config.patch(activation_memory_budget=above):
        result["above"] = max(r.peak_bytes or 0 for r in dry_run(GatedLM(compiled=True), GATED_BATCH, steps=2).reports)
    result.update(fix=fix, chosen=chosen, fit=compiled_fit(chosen))
    return result


@pytest.mark.slow
def test_the_budget_chosen_is_the_largest_that_fits_and_its_peak_is_a_real_compiled_fits(
    budget_search: dict[str, Any],
) -> None:
    advice, fix, chosen, fit = (budget_search[k] for k in ("advice", "fix", "chosen", "fit"))
    assert advice.baseline_peak_bytes > GATED_LIMIT == advice.limit_bytes  # compiled at the budget of 1: too big
    assert chosen in GATED_GRID and chosen < 1
    assert fit.latest.memory_source.startswith("live-tensor tracker")  # inductor's buffers counted
    assert fix.peak_bytes == fit.latest.peak_bytes >= fit.first.peak_bytes and fix.fits
    assert budget_search["above"] > GATED_LIMIT  # the next budget up does not fit: the largest that fits
    assert fix.saves_bytes == advice.baseline_peak_bytes - fix.peak_bytes
    assert fix.apply is None and fix.trainer_kwargs == {} and fix.batch_size is None and not fix.changes_training
    assert f"torch._functorch.config.activation_memory_budget = {chosen:g}" in fix.how
    assert not any(f.name.startswith("torch.compile") for f in advice.fixes)  # compiled already


@pytest.mark.slow
def test_the_budget_search_leaves_the_users_budget_and_dynamo_as_they_were(budget_search: dict[str, Any]) -> None:
    assert budget_search["budget"] == (1.0, 1.0)
    graphs_before, graphs_after = budget_search["graphs"]
    assert graphs_after == graphs_before  # no dry run went through Dynamo


@pytest.mark.slow
def test_compiling_is_a_fix_predicted_at_the_users_own_budget_which_advise_leaves_set() -> None:
    """A plain module, not compiled: ``torch.compile`` is a candidate, its dry run at the budget the user set (0.7),
    which is 0.7 after advise; ``apply`` compiles the user's module, advise only a fake copy."""
    batch = torch.Size([256, 256])
    model = gated_blocks(1)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._functorch.config.patch(activation_memory_budget=0.7):
        advice = advise(model, batch, "1GiB", loss_fn=square_loss, compile_fixes=True, activation_memory_budgets=(0.4,))
        assert torch._functorch.config.activation_memory_budget == 0.7
        expected = dry_run(torch.compile(gated_blocks(1)), batch, loss_fn=square_loss, steps=2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no dry run went through Dynamo
    fix = next(f for f in advice.fixes if f.name == "torch.compile")
    assert fix.peak_bytes == max(r.peak_bytes or 0 for r in expected.reports)
    assert fix.trainer_kwargs == {} and fix.batch_size is None
    assert fix.how.startswith("model.forward = torch.compile(model.forward)")
    assert "forward" not in model.__dict__  # advise compiled a fake copy only
    assert fix.apply is not None
    fix.apply(model)
    assert hasattr(model.__dict__["forward"], "_torchdynamo_orig_callable")
