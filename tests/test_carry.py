"""Steps the memory source does not measure carry the tenants of the counted micro-batch they repeat."""

from __future__ import annotations

import gc
import json
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from conftest import CLOSURE_DIVISOR, make_trainer, plain_step
from hf_models import HFModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback, StepReport, TenantMonitor
from lightning_memtenants.core.carry import batch_key

F32 = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def saved_bytes(batch: int) -> int:
    """What the MLP's graph saves for backward, worked out by hand: tanh's output (batch x 8), which is also the last
    linear's input; the first linear's input is the batch itself (not an activation); and the output (batch x 1),
    which the loss's ``pow`` (the article's loop) or ``mse_loss`` (the LightningModule) saves."""
    return batch * 8 * F32 + batch * 1 * F32


def loop(monitor: TenantMonitor, model: nn.Module, sizes: list[int], measured: set[int]) -> list[StepReport]:
    reports = []
    for step, size in enumerate(sizes):
        monitor.measure = step in measured
        report, _ = plain_step(monitor, model, monitor.optimizers[0], torch.randn(size, 6))
        assert report is not None
        reports.append(report)
    return reports


def run(sizes: list[int], measured: set[int], every: bool) -> list[StepReport]:
    model = mlp()
    monitor = TenantMonitor(model, [torch.optim.Adam(model.parameters())], source=None)
    monitor.count_every_step = every
    return loop(monitor, model, sizes, measured)


def tenants(report: StepReport) -> list[dict[str, int]]:
    return [dict(p.tenants_bytes) for mb in report.micro_batches for p in mb.values()]


def test_carried_steps_report_what_counting_every_step_reports() -> None:
    sizes = [4, 4, 4, 8, 4, 8, 8]
    carried = run(sizes, measured={0}, every=False)
    counted = run(sizes, measured={0}, every=True)
    assert [tenants(r) for r in carried] == [tenants(r) for r in counted]
    # step 0 starts with no optimizer state, step 1 with Adam's: both new; a batch of 8 is new at step 3
    assert [r.tenants_from_step for r in carried] == [None, None, 1, None, 1, 3, 3]  # from the counted ones
    assert all(r.tenants_from_step is None for r in counted)
    for report, size in zip(carried, sizes, strict=True):
        assert report.phases["before_backward"].tenants_bytes["activations"] == saved_bytes(size)
        assert report.phases["after_backward"].tenants_bytes["activations"] == 0
    weights = (6 * 8 + 8 + 8 + 1) * F32
    assert carried[4].tenants_bytes == {
        "weights": weights,
        "gradients": weights,
        "optimizer_state": 2 * weights + 4 * F32,  # exp_avg and exp_avg_sq, and a 0-d step per parameter
        "activations": saved_bytes(4),
    }
    assert carried[4].to_dict()["tenants_from_step"] == 1
    assert StepReport.from_dict(carried[4].to_dict()) == carried[4]


def test_a_measured_step_always_counts() -> None:
    reports = run([4] * 5, measured={0, 3}, every=False)
    assert [r.tenants_from_step for r in reports] == [None, None, 1, None, 3]


def test_the_key_sees_what_decides_the_saved_tensors() -> None:
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    tensors = list(model.parameters())
    x = torch.randn(4, 6)
    key = batch_key(0, (x,), model, [optimizer], tensors)
    assert key == batch_key(0, (torch.randn(4, 6),), model, [optimizer], tensors)  # values do not count
    assert key != batch_key(1, (x,), model, [optimizer], tensors)  # another micro-batch of the step
    assert key != batch_key(0, (x.double(),), model, [optimizer], tensors)
    assert key != batch_key(0, (torch.randn(5, 6),), model, [optimizer], tensors)
    model.eval()
    assert key != batch_key(0, (x,), model, [optimizer], tensors)
    model.train()
    with torch.no_grad():
        assert key != batch_key(0, (x,), model, [optimizer], tensors)
    model(x).sum().backward()
    assert key != batch_key(0, (x,), model, [optimizer], tensors)  # gradients present
    model.zero_grad()
    optimizer.step()  # no gradient: Adam keeps no state
    assert key == batch_key(0, (x,), model, [optimizer], tensors)
    model(x).sum().backward()
    optimizer.step()
    model.zero_grad()
    assert key != batch_key(0, (x,), model, [optimizer], tensors)  # Adam's state now exists
    key = batch_key(0, (x,), model, [optimizer], tensors)
    model[0].bias.requires_grad_(False)
    assert key != batch_key(0, (x,), model, [optimizer], tensors)  # fewer trainable parameters
    model[0].bias.requires_grad_(True)
    assert key == batch_key(0, (x,), model, [optimizer], tensors)
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert key != batch_key(0, (x,), model, [optimizer], tensors)  # another parameter group
    assert key != batch_key(0, (x,), model, [torch.optim.Adam(model.parameters())], tensors)  # no state yet
    assert key != batch_key(0, (x,), model, [optimizer], [*tensors, torch.zeros(2)])  # a tensor more


def test_a_registration_on_any_module_is_seen_while_a_watch_is_open() -> None:
    from torch.nn.modules import module as torch_module

    from lightning_memtenants.core.carry import TreeWatch

    gc.collect()  # the monitors of earlier tests, which hold watches until they are collected
    hooks = (torch_module._global_parameter_registration_hooks, torch_module._global_module_registration_hooks)
    TreeWatch().close()  # a safe point: the collected watches are released there (their finalizers run no Python)
    assert not any(hooks)
    first, second = TreeWatch(), TreeWatch()
    assert all(len(h) == 1 for h in hooks)  # one hook of each kind, however many watches
    version = first.version
    holder = nn.Module()
    holder.head = nn.Linear(2, 2)  # the Linear's two parameters, then the module itself
    assert second.version == first.version == version + 3
    first.close()
    first.close()  # closing twice releases once
    assert all(len(h) == 1 for h in hooks) and first.closed and not second.closed
    del second  # a watch nobody closed goes with its owner, at the next safe point
    assert any(hooks) and first.version == version + 3  # reading a version is one
    assert not any(hooks)
    nn.Linear(2, 2)
    assert first.version == version + 3  # not counted while no watch is open


def test_a_phase_the_counted_batch_never_had_is_counted_and_said() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TenantMonitor(model, [optimizer], source=None)
    x = torch.randn(4, 6)

    def step(measure: bool, stepped: bool) -> StepReport:
        monitor.measure = measure
        monitor.phase("batch_start", batch=(x,))
        loss = model(x).pow(2).mean()
        monitor.phase("before_backward", output=loss)
        loss.backward()
        monitor.phase("after_backward")
        if stepped:
            monitor.phase("before_optimizer_step")
            optimizer.step()
        monitor.phase("batch_end")
        report = monitor.end_step()
        assert report is not None
        model.zero_grad()
        return report

    step(True, stepped=False)
    same = step(False, stepped=False)
    assert same.tenants_from_step == 0
    assert same.notes[0].startswith("tenants carried from step 0, not counted: this step repeats that step's")
    other = step(False, stepped=True)
    assert other.tenants_from_step == 0  # its first phases were carried from step 0
    assert other.notes == [
        "tenants carried from step 0, not counted, before before_optimizer_step: the sequence of phases (another"
        " backward or optimizer step) differed from step 0's there, so it was counted from before_optimizer_step on;"
        " its activations, read at before_backward, are step 0's, and its graph was not walked; this batch shape is"
        " counted on every step from now on"
    ]
    weights = (6 * 8 + 8 + 8 + 1) * F32
    assert other.phases["before_optimizer_step"].tenants_bytes["gradients"] == weights  # counted there
    assert other.phases["before_backward"].tenants_bytes["activations"] == 4 * 8 * F32 + 4 * F32  # carried
    again = step(False, stepped=True)
    assert again.tenants_from_step is None and again.notes == []  # a key that diverged is counted from then on
    back = step(False, stepped=False)
    assert back.tenants_from_step is None  # also the steps that would have carried before


class Steps(L.Callback):
    """Keeps every step's report, read after the callback's own batch end (it comes before this one)."""

    def __init__(self, source: MemoryTenantsCallback) -> None:
        self.source, self.reports = source, []

    def on_train_batch_end(self, *args: object) -> None:
        self.reports.append(self.source.latest)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


def fit(cb: MemoryTenantsCallback, accumulate: int = 1) -> list[StepReport]:
    steps = Steps(cb)
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(64, 6), torch.randn(64, 1))
    trainer = make_trainer([cb, steps], steps=6, log_every_n_steps=3, accumulate_grad_batches=accumulate)
    trainer.fit(Module(), DataLoader(data, batch_size=4))
    return [r for i, r in enumerate(steps.reports) if (i + 1) % accumulate == 0]


def test_a_fit_carries_between_its_logging_steps_what_tracking_every_step_counts() -> None:
    default = fit(MemoryTenantsCallback(print_summary=False))
    every = fit(MemoryTenantsCallback(track_every_step=True, print_summary=False))
    assert [tenants(r) for r in default] == [tenants(r) for r in every]
    # logged: steps 0 and 2 (measured, counted); step 1 is new (Adam's state); 3 and 4 repeat 2; 5 is logged
    assert [r.tenants_from_step for r in default] == [None, None, None, 2, 2, None]
    assert [r.peak_bytes is not None for r in default] == [True, False, True, False, False, True]
    assert default[3].phases["before_backward"].tenants_bytes["activations"] == saved_bytes(4) + CLOSURE_DIVISOR


def test_accumulated_micro_batches_are_carried_one_by_one() -> None:
    default = fit(MemoryTenantsCallback(print_summary=False), accumulate=2)
    every = fit(MemoryTenantsCallback(track_every_step=True, print_summary=False), accumulate=2)
    assert [tenants(r) for r in default] == [tenants(r) for r in every]
    assert all(len(r.micro_batches) == 2 for r in default)
    assert [r.tenants_from_step for r in default] == [None, None, None, 2, 2, None]


class FailsInForward(Module):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx == 3:  # a step that carries: neither measured nor new
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return loss


def test_a_postmortem_on_a_carried_step_reads_its_graph_without_the_batch(tmp_path) -> None:
    cb = MemoryTenantsCallback(print_summary=False, postmortem_dir=tmp_path)
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(64, 6), torch.randn(64, 1))
    with pytest.raises(torch.OutOfMemoryError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the postmortem's own warning
        make_trainer([cb], steps=6, log_every_n_steps=3).fit(FailsInForward(), DataLoader(data, batch_size=4))
    record = json.loads((tmp_path / "memtenants_oom.json").read_text())
    assert record["step"] == 3
    assert record["tenants_at_failure_bytes"]["activations"] == saved_bytes(4)  # the graph so far: not x, not y


# -- carried reports are never silently wrong: the models, carried against counted on every step ------------


def carried_and_counted(
    make: Any, data: Any, steps: int = 20, source: str = "auto", **kwargs: Any
) -> tuple[list[Any], list[Any]]:
    """The same seeded fit twice: the default callback logging every 50 steps (so most steps carry) and one that
    counts every step. Returns each step's report, in order, of both."""
    runs = []
    for every in (False, True):
        cb = MemoryTenantsCallback(
            track_every_step=every, log_every_n_steps=50, print_summary=False, memory_source=source
        )
        steps_seen = Steps(cb)
        torch.manual_seed(0)
        module = make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's: a few batches, no logger
            make_trainer([cb, steps_seen], steps=steps, **kwargs).fit(module, DataLoader(data(), batch_size=None))
        runs.append(steps_seen.reports)
    return runs[0], runs[1]


def says_carried(report: StepReport) -> bool:
    return any("tenants carried from step" in note for note in report.notes)


def wrong(carried: list[StepReport], counted: list[StepReport]) -> list[int]:
    """Where (the place in the lists) the tenants differ from counting's at some phase of some micro-batch."""
    assert [r.step for r in carried] == [r.step for r in counted]
    return [i for i, (a, b) in enumerate(zip(carried, counted, strict=True)) if tenants(a) != tenants(b)]


def check_never_silently_wrong(carried: list[StepReport], counted: list[StepReport]) -> list[int]:
    """Every step's tenants are counting's, or its notes say they were carried; where a step carried a tenant."""
    assert all(r.tenants_from_step is None and not says_carried(r) for r in counted)
    for report in carried:
        assert says_carried(report) == (report.tenants_from_step is not None), report.step
    assert [s for s in wrong(carried, counted) if not says_carried(carried[s])] == []
    return [i for i, r in enumerate(carried) if says_carried(r)]


def batches(count: int, *shape: int) -> Callable[[], list[tuple[torch.Tensor, ...]]]:
    def make() -> list[tuple[torch.Tensor, ...]]:
        generator = torch.Generator().manual_seed(2)
        return [tuple(torch.randn(*s, generator=generator) for s in shape) for _ in range(count)]  # type: ignore[arg-type]

    return make


class LayerDrop(L.LightningModule):
    """Four blocks of different widths, each skipped with p = 0.5 in training (``torch.rand([]) < 0.5``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for block in self.blocks:
            if torch.rand([]) < 0.5:
                continue
            x = torch.tanh(block(x))
        return nn.functional.mse_loss(self.head(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def test_layerdrop_carries_until_its_gradients_differ_then_counts_every_step() -> None:
    carried, counted = carried_and_counted(LayerDrop, batches(20, (8, 16), (8, 1)))
    marked = check_never_silently_wrong(carried, counted)
    diverged = [i for i, r in enumerate(carried) if any(", not counted, before after_backward" in n for n in r.notes)]
    assert diverged  # the blocks that ran differ: a carried step's gradients differ from its counted one's
    assert set(diverged) <= set(marked)
    # a batch shape whose carry diverged is counted from then on: after the last divergence, every step is counted
    last = max(diverged)
    assert all(r.tenants_from_step is None for r in carried[last + 1 :])
    assert wrong(carried[last + 1 :], counted[last + 1 :]) == []


class MixtureOfExperts(L.LightningModule):
    """Each token goes to the experts whose gate is positive: how many tokens each expert sees depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        gates = self.gate(x)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            tokens = (gates[:, index] > 0).nonzero().squeeze(1)
            if tokens.numel():
                out = out.index_add(0, tokens, expert(x[tokens]) * gates[tokens, index : index + 1])
        return nn.functional.mse_loss(out.sum(1, keepdim=True), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def test_routed_tokens_are_never_silently_carried() -> None:
    carried, counted = carried_and_counted(MixtureOfExperts, batches(20, (16, 8), (16, 1)))
    marked = check_never_silently_wrong(carried, counted)
    assert len(wrong(carried, counted)) >= 5  # the routing changes the activations; each such step says so
    assert len(marked) >= len(wrong(carried, counted))


class WassersteinGan(L.LightningModule):
    """A WGAN under manual optimization: the critic steps on every batch, the generator on every fifth."""

    N_CRITIC = 5

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
        self.critic = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        generator_optimizer, critic_optimizer = self.optimizers()
        z = torch.randn(real.shape[0], 4)
        critic_loss = self.critic(self.generator(z).detach()).mean() - self.critic(real).mean()
        critic_optimizer.zero_grad()
        self.manual_backward(critic_loss)
        critic_optimizer.step()
        if batch_idx % self.N_CRITIC == 0:
            generator_loss = -self.critic(self.generator(z)).mean()
            generator_optimizer.zero_grad()
            self.manual_backward(generator_loss)
            generator_optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.RMSprop(self.generator.parameters(), lr=5e-5),
            torch.optim.RMSprop(self.critic.parameters(), lr=5e-5),
        ]


def test_a_wgan_with_n_critic_counts_the_steps_whose_optimizers_differ() -> None:
    carried, counted = carried_and_counted(WassersteinGan, batches(20, (32, 8)))
    marked = check_never_silently_wrong(carried, counted)
    # one report per batch (an optimizer steps on each); Lightning counts each optimizer's steps in global_step
    assert [r.step for r in counted[:7]] == [0, 2, 3, 4, 5, 6, 8]
    # a batch whose generator steps has a second backward and optimizer step: another sequence of phases than the
    # critic's batches, so a carry diverges there, and its batch shape is counted from then on
    first = min(i for i in marked if any(", not counted, before before_backward" in n for n in carried[i].notes))
    assert first % WassersteinGan.N_CRITIC == 0
    assert wrong(carried[first + 1 :], counted[first + 1 :]) == []
    assert all(r.tenants_from_step is None for r in carried[first + 1 :])


class GrowsAHead(L.LightningModule):
    """At step 7 a 512 x 512 head (1 MiB of weights) joins the module and the optimizer, inside the training step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 512)
        self.out = nn.Linear(512, 1)
        self.head: nn.Module | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step == 7 and self.head is None:
            self.head = nn.Linear(512, 512)
            self.optimizers().optimizer.add_param_group({"params": list(self.head.parameters())})
        h = self.body(x)
        if self.head is not None:
            h = torch.tanh(self.head(h))
        return nn.functional.mse_loss(self.out(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def test_a_head_added_at_step_7_is_counted_where_it_is_added_and_after() -> None:
    carried, counted = carried_and_counted(GrowsAHead, batches(20, (4, 8), (4, 1)))
    check_never_silently_wrong(carried, counted)
    assert wrong(carried, counted) == []  # a change of structure counts: every step is exact
    head = (512 * 512 + 512) * F32
    body = (8 * 512 + 512 + 512 + 1) * F32
    for run in (carried, counted):
        step7 = run[7].phases
        assert step7["batch_start"].tenants_bytes["weights"] == body
        assert step7["before_backward"].tenants_bytes["weights"] == body + head  # read where it joined
        # saved for backward: the body's output (the head's input), the head's tanh output, the out's output, and
        # Lightning's loss divisor; never the head's 1 MiB weight
        saved = (4 * 512 + 4 * 512 + 4 * 1) * F32 + CLOSURE_DIVISOR
        assert step7["before_backward"].tenants_bytes["activations"] == saved
    # step 7 is counted from before_backward on, where the head joined; 8 has a new key (more parameters, Adam's
    # state for the head), which the steps after it carry
    assert [r.tenants_from_step for r in carried[6:11]] == [1, 1, None, 8, 8]
    assert any(", not counted, before before_backward" in n for n in carried[7].notes)


def switch_transformers() -> L.LightningModule:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=64,
        d_model=64,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        num_heads=4,
        num_experts=4,
        expert_capacity=6,
        decoder_start_token_id=0,
        pad_token_id=0,
        dropout_rate=0.0,
    )
    return HFModule(SwitchTransformersForConditionalGeneration(config))


def token_batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        {"input_ids": torch.randint(1, 64, (2, 12), generator=generator), "labels": torch.randint(1, 64, (2, 6))}
        for _ in range(12)
    ]


def test_switch_transformers_routing_is_never_silently_carried() -> None:
    pytest.importorskip("transformers")
    carried, counted = carried_and_counted(switch_transformers, token_batches, steps=12)
    marked = check_never_silently_wrong(carried, counted)
    assert marked  # the router decides the experts' batches: carried steps say so


def wav2vec2() -> L.LightningModule:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 8),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        layerdrop=0.5,
        mask_time_prob=0.0,
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
    )
    return HFModule(Wav2Vec2ForCTC(config))


def audio_batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    return [
        {"input_values": torch.randn(2, 1600, generator=generator), "labels": torch.randint(1, 16, (2, 8))}
        for _ in range(12)
    ]


def test_wav2vec2_with_layerdrop_is_never_silently_carried() -> None:
    pytest.importorskip("transformers")
    # no live-tensor tracker in either run: under its dispatch mode, torch's CTC loss takes the overload whose
    # lengths are tensors and saves them (32 bytes here), so a measured step saves more than an unmeasured one
    carried, counted = carried_and_counted(wav2vec2, audio_batches, steps=12, source="none")
    marked = check_never_silently_wrong(carried, counted)
    diverged = [s for s in marked if any(", not counted, before" in n for n in carried[s].notes)]
    assert diverged
    assert wrong(carried[max(diverged) + 1 :], counted[max(diverged) + 1 :]) == []


class GrowsATemporary(L.LightningModule):
    """64 -> 256 -> 64 with Adam; at step 4 the forward also makes a 1 MiB temporary, which it frees at once."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        if self.global_step == 4:
            x = x + torch.empty(1 << 20, dtype=torch.uint8)[:1].float()  # nothing of it is saved for backward
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def test_on_cuda_a_carried_step_that_reads_other_bytes_says_so_and_the_next_step_counts() -> None:
    from simcuda import simulated_cuda

    from lightning_memtenants.core.sources import source_for

    with simulated_cuda():
        ours = MemoryTenantsCallback(print_summary=False, memory_source=source_for("cuda:0"), log_every_n_steps=50)
        steps = Steps(ours)
        data = TensorDataset(torch.randn(32 * 8, 64))
        make_trainer([ours, steps], steps=8).fit(GrowsATemporary(), DataLoader(data, batch_size=32))
    reports = steps.reports
    # step 0 is logged (counted), step 1 new (Adam's state); 2 to 4 carry step 1's tenants; step 4 reads a window
    # peak 1 MiB above step 1's at before_backward, says so, and step 5 is counted, which 6 and 7 then carry
    assert [r.tenants_from_step for r in reports] == [None, None, 1, 1, 1, None, 5, 5]
    flagged = [i for i, r in enumerate(reports) if any("the memory source read other bytes" in n for n in r.notes)]
    assert flagged == [4]
    (note,) = [n for n in reports[4].notes if "read other bytes" in n]
    assert note.startswith("the memory source read other bytes at before_backward than on step 1, whose tenants this")
    peak, then = reports[4].phases["before_backward"].window_peak_bytes, reports[1].phases["before_backward"]
    # the window's peak is the moment of ``.float()``: the 1 MiB block and the 512-byte block of its copy on top of
    # what the step began with (the view of the 1 MiB goes as soon as the copy is made, before the add)
    assert peak == reports[4].phases["batch_start"].allocated_bytes + (1 << 20) + 512 > then.window_peak_bytes
    assert all(says_carried(reports[i]) for i in (2, 3, 4, 6, 7))
    assert reports[5].tenants_bytes == reports[4].tenants_bytes  # its tenants were right: only its readings moved


def test_latest_and_the_printed_summary_say_that_the_last_step_carried(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_memtenants import format_table

    cb = MemoryTenantsCallback()  # prints its summary
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(64, 6), torch.randn(64, 1))
    make_trainer([cb], steps=5, log_every_n_steps=3).fit(Module(), DataLoader(data, batch_size=4))
    latest = cb.latest
    assert latest is not None and latest.step == 4 and latest.tenants_from_step == 2  # steps 0 and 2 are logged
    assert latest.notes[0].startswith("tenants carried from step 2, not counted: this step repeats that step's")
    printed = capsys.readouterr().out
    assert "step 4's tenants were carried from step 2, not counted (track_every_step=True counts every step)" in printed
    table = format_table(latest)
    assert table.startswith("memtenants: optimizer step 4 (tenants carried from step 2, not counted) (memory source")
    assert "- tenants carried from step 2, not counted: this step repeats" in table
    assert "carried" not in format_table(cb.first)  # step 0 was counted
