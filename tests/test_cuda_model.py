"""The CUDA target: each modelled effect on a tiny model, worked out by hand; then the article's table."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from anatomy_predicted import ARTICLE, predicted_rows
from torch import nn

from lightning_memtenants import TenantMonitor, predict
from lightning_memtenants.predict.cuda_model import (
    GPUS,
    CachingAllocatorModel,
    cublas_workspace_bytes,
    host_state_names,
    resolve_gpu,
    resolve_target,
    round_block,
)

A6000_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 bytes


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 5)  # weight 60 bytes, bias 20 bytes


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def run(target: str = "A6000", **kwargs: object):  # type: ignore[no-untyped-def]
    return predict(tiny(), torch.Size([2, 3]), loss_fn=loss, target=target, **kwargs)  # type: ignore[arg-type]


def test_the_article_table_to_the_printed_precision() -> None:
    rows, report = predicted_rows("A6000")
    assert {name: f"{value:.1f}" for name, value in rows.items()} == {k: f"{v:.1f}" for k, v in ARTICLE.items()}
    assert report.peak_phase == "batch_end"
    assert report.parts_bytes["cublas_workspace"] == 2 * A6000_WORKSPACE
    assert "Adam (foreach)" in report.peak_explanation


def test_blocks_are_rounded_to_512_bytes() -> None:
    assert [round_block(n) for n in (1, 4, 511, 512, 513, 8 * 2**20)] == [512, 512, 512, 512, 1024, 8 * 2**20]
    start = run().phases["batch_start"]
    assert start.tenants_bytes["weights"] == 80  # tenants stay the tensors' own bytes
    assert start.allocated_bytes == 3 * 512  # weight, bias and the 24-byte batch, one block each
    assert start.parts_bytes["allocator_rounding"] == (512 - 60) + (512 - 20) + (512 - 24)


def test_one_cublas_workspace_per_thread() -> None:
    report = run()
    assert report.phases["batch_start"].parts_bytes["cublas_workspace"] == 0
    assert report.phases["before_backward"].parts_bytes["cublas_workspace"] == A6000_WORKSPACE  # forward
    assert report.phases["after_backward"].parts_bytes["cublas_workspace"] == 2 * A6000_WORKSPACE  # autograd's thread
    assert run("H100").phases["after_backward"].parts_bytes["cublas_workspace"] == 2 * 32 * 2**20


def test_workspace_size_by_architecture_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cublas_workspace_bytes((8, 6), {}) == A6000_WORKSPACE
    assert cublas_workspace_bytes((9, 0), {}) == 32 * 2**20
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * 2**20
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    assert run().phases["after_backward"].parts_bytes["cublas_workspace"] == 2 * 8 * 2**20


def test_foreach_temporaries_and_host_step_counters() -> None:
    report = run()
    before, end = report.phases["before_optimizer_step"], report.phases["batch_end"]
    # exp_avg and exp_avg_sq: four blocks of 512; the step counters stay on the host
    assert end.tenants_bytes["optimizer_state"] == 2 * 80
    assert end.allocated_bytes == before.allocated_bytes + 4 * 512  # type: ignore[operator]
    # foreach keeps one sqrt(exp_avg_sq) list for all parameters: two more blocks at the peak
    assert end.window_peak_bytes == before.allocated_bytes + 4 * 512 + 2 * 512  # type: ignore[operator]
    assert "Adam runs foreach, torch's default on CUDA" in report.notes
    assert any("step counters live on the host" in note for note in report.notes)
    assert any(note.startswith("outside the allocator") for note in report.notes)
    assert report.measured_fixed_bytes == report.expected_fixed_bytes == 80 + 80 + 160


def test_nadam_keeps_its_mu_product_on_the_host_as_well() -> None:
    """NAdam's step and mu_product are CPU tensors unless capturable: neither is in a CUDA figure."""
    report = run(optimizer=lambda params: torch.optim.NAdam(params))
    end = report.phases["batch_end"]
    assert end.tenants_bytes["optimizer_state"] == 2 * 80  # exp_avg and exp_avg_sq, no 4-byte scalars
    assert report.measured_fixed_bytes == report.expected_fixed_bytes == 80 + 80 + 160
    on_cpu = run("cpu", optimizer=lambda params: torch.optim.NAdam(params)).phases["batch_end"]
    assert on_cpu.tenants_bytes["optimizer_state"] == 2 * 80 + 2 * (4 + 4)  # step and mu_product per tensor


def test_an_explicit_choice_is_kept() -> None:
    report = run(optimizer=lambda p: torch.optim.Adam(p, foreach=False))
    assert not any("foreach" in note for note in report.notes)
    assert "Adam (single-tensor)" in report.peak_explanation


def test_cpu_target_is_unchanged() -> None:
    report = run(target="cpu")
    assert report.phases["batch_start"].allocated_bytes == 60 + 20 + 24
    assert report.tenants_bytes["optimizer_state"] == 2 * 80 + 2 * 4
    assert report.parts_bytes == {}


def test_gpu_names() -> None:
    for name in ("A6000", "A100", "H100", "L4", "RTX4090"):
        assert name in GPUS
    assert resolve_gpu("rtx 4090").capability == (8, 9)
    assert resolve_gpu("8.6").capability == (8, 6)
    assert resolve_gpu("sm_90").capability == (9, 0)
    with pytest.raises(ValueError, match=r"gpu must be one of \[.*'A6000'.*\]"):
        resolve_gpu("Voodoo3")
    with pytest.raises(ValueError, match=r"^target must be one of"):
        run("Voodoo3")


def test_caching_allocator_segments_and_blocks() -> None:
    mib = 2**20
    model = CachingAllocatorModel()
    assert model.malloc(1, 100) == 512  # small pool: a 2 MiB segment, split
    assert model.malloc(2, 600) == 1024
    assert (model.reserved_bytes, model.allocated_bytes, model.segments) == (2 * mib, 1536, 1)
    model.free(1)
    assert model.malloc(3, 512) == 512  # best fit: the freed 512-byte block, no new segment
    assert model.reserved_bytes == 2 * mib
    assert model.malloc(4, 3 * mib // 2) == 3 * mib // 2  # large pool: a 20 MiB segment
    assert model.reserved_bytes == 22 * mib
    assert model.malloc(5, 12 * mib) == 12 * mib  # from the 18.5 MiB left, which splits
    assert model.malloc(6, 6 * mib) == 6 * mib + mib // 2  # 0.5 MiB left is not worth a split: counted whole
    assert model.allocated_bytes == 1536 + 3 * mib // 2 + 12 * mib + 6 * mib + mib // 2
    for key in (4, 5, 6):
        model.free(key)
    assert model.malloc(7, 20 * mib) == 20 * mib  # the three blocks merged back into the segment
    assert model.reserved_bytes == 22 * mib
    assert model.malloc(8, 30 * mib + 1) == 30 * mib + 512  # above 10 MiB: a segment rounded to 2 MiB
    assert model.reserved_bytes == 22 * mib + 32 * mib


def test_predictions_have_reserved_bytes_on_cuda_only() -> None:
    end = run().phases["batch_end"]
    assert end.reserved_bytes is not None and end.fragmentation_bytes is not None
    assert end.reserved_bytes >= end.allocated_bytes  # type: ignore[operator]
    # the tiny model: one small segment, and one 20 MiB segment that both cuBLAS workspaces split
    assert end.reserved_bytes == 2 * 2**20 + 20 * 2**20
    assert run(target="cpu").phases["batch_end"].reserved_bytes is None


def test_a_gpu_named_in_target_is_the_deprecated_gpu_argument_to_the_byte() -> None:
    new = run("A6000")
    with pytest.warns(DeprecationWarning, match=r"write target='A6000' instead of target='cuda', gpu='A6000'") as seen:
        old = run("cuda", gpu="A6000")
    assert [Path(w.filename).name for w in seen] == [Path(__file__).name]  # it points at the caller's line
    # two workspaces; weight, bias, batch, two gradients, the loop's loss; two moments each; foreach's two temporaries
    assert old.peak_bytes == new.peak_bytes == 2 * A6000_WORKSPACE + (6 + 4 + 2) * 512
    assert old.peak_phase == new.peak_phase == "batch_end"
    tenants = {"weights": 80, "gradients": 80, "optimizer_state": 160, "activations": 2 * 5 * 4}  # pow keeps 2 x 5
    assert old.tenants_bytes == new.tenants_bytes == tenants
    for name, phase in new.phases.items():
        assert old.phases[name].tenants_bytes == phase.tenants_bytes, name
        assert old.phases[name].allocated_bytes == phase.allocated_bytes, name
        assert old.phases[name].window_peak_bytes == phase.window_peak_bytes, name
        assert old.phases[name].parts_bytes == phase.parts_bytes, name
    assert old.to_dict() == new.to_dict()
    assert run("cuda:A6000").to_dict() == new.to_dict()

    def numbers(report: object) -> dict:  # a capability is named sm_86 in the notes and the source's label
        return {k: v for k, v in report.to_dict().items() if k not in ("notes", "memory_source")}  # type: ignore[attr-defined]

    assert numbers(run("8.6")) == numbers(new)


def test_target_names_the_gpu_in_every_spelling() -> None:
    hopper = run("cuda:H100")
    assert hopper.phases["after_backward"].parts_bytes["cublas_workspace"] == 2 * 32 * 2**20
    assert any(note.startswith("predicted for CUDA on H100 (compute capability 9.0)") for note in hopper.notes)
    ampere = run("cuda")  # a bare "cuda" is an A100, as before
    assert ampere.phases["after_backward"].parts_bytes["cublas_workspace"] == 2 * A6000_WORKSPACE
    assert any(note.startswith("predicted for CUDA on A100 (compute capability 8.0)") for note in ampere.notes)
    assert resolve_target("cpu") is None
    assert resolve_target("sm_90") == resolve_gpu("9.0")
    assert resolve_target("cuda: rtx 4090") == resolve_gpu("RTX4090")
    assert resolve_target("CUDA") == resolve_gpu(None)


@pytest.mark.parametrize("target", ["TPU", 3, "sm_99", "cuda:0", "cuda:", None])
def test_a_bad_target_is_one_error_naming_target_and_what_it_accepts(target: object) -> None:
    with pytest.raises(ValueError, match=r"^target must be one of 'cpu', 'cuda' \(an A100\), or a GPU: .*'A6000'.*"
                       r" or a compute capability like '8.6' or 'sm_90', also written 'cuda:A6000', got "):  # fmt: skip
        run(target)  # type: ignore[arg-type]


def test_gpu_needs_a_plain_cuda_target() -> None:
    for target in ("cpu", "H100"):
        with pytest.raises(ValueError, match=r"^gpu \(deprecated\) names a CUDA architecture and needs target='cuda'"):
            run(target, gpu="A6000")


def test_the_census_and_the_formula_are_told_which_state_lives_on_the_host() -> None:
    """A real CPU step, told that Adam's step counters live on the host: both leave out their 2 x 4 bytes."""
    for host_state, state in ((None, 2 * 80 + 2 * 4), (host_state_names, 2 * 80)):
        model = tiny()
        optimizer = torch.optim.Adam(model.parameters())
        monitor = TenantMonitor(model, [optimizer], source=None, host_state=host_state)
        monitor.phase("batch_start")
        loss(model, torch.randn(2, 3)).backward()
        optimizer.step()
        monitor.phase("batch_end")
        report = monitor.end_step()
        assert report is not None
        assert report.tenants_bytes["optimizer_state"] == state
        assert report.measured_fixed_bytes == report.expected_fixed_bytes == 80 + 80 + state
    with pytest.raises(ValueError, match=r"^host_state must be None or a callable"):
        TenantMonitor(tiny(), source=None, host_state={"step"})  # type: ignore[arg-type]


class TwoOptimizers(L.LightningModule):
    """Manual optimization with two Adams: the second's phase sees the first's new state, and only that."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 1)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (x,) = batch
        one, two = self.optimizers()  # type: ignore[misc]
        self.manual_backward(self.first(x).pow(2).mean())
        one.step()
        self.manual_backward(self.second(self.first(x).detach()).pow(2).mean())
        two.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.first.parameters()), torch.optim.Adam(self.second.parameters())]


def test_host_counters_are_left_out_only_once_they_exist() -> None:
    report = predict(TwoOptimizers(), (torch.Size([2, 3]),), target="A6000")
    # before the second optimizer's step: the first's moments (2 x 80 bytes) and none of anyone's counters
    assert report.phases["before_optimizer_step"].tenants_bytes["optimizer_state"] == 2 * 80
    assert report.phases["batch_end"].tenants_bytes["optimizer_state"] == 2 * 80 + 2 * 24
    assert report.measured_fixed_bytes == report.expected_fixed_bytes == (80 + 24) * 4
