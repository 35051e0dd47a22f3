"""What nvidia-smi shows: the CUDA context and NCCL's buffers worked out by hand from the published figures and
NCCL's defaults, and the three parts of the footprint adding up."""

from __future__ import annotations

import pytest

from lightning_memtenants.core.record import PhaseReport, StepReport
from lightning_memtenants.names import TENANTS
from lightning_memtenants.predict.cuda_model import resolve_target
from lightning_memtenants.predict.footprint import (
    DeviceFootprint,
    cuda_context_bytes,
    device_footprint,
    nccl_buffer_bytes,
)

MiB = 2**20
H100, A100, V100, A6000 = (resolve_target(g) for g in ("H100", "A100", "V100", "A6000"))
# The line through the two published bare contexts: 107 MiB at 34 x 1536 thread slots, 555 MiB at 188 x 1536.
H100_BARE = 107 * MiB + (132 * 2048 - 34 * 1536) * (448 * MiB) // (154 * 1536)
EAGER_11_7 = 666_632_192 - 287_047_680  # pytorch/pytorch#86509: eager minus lazy, same GPU and tensor
# ring channels x (send: 4 KiB header -> 2 MiB; receive: 4 KiB + LL 524,288 + LL128 4,915,200 + SIMPLE 4 MiB -> 10 MiB)
H100_RING = 24 * (2 * MiB + 10 * MiB)


def report(*reserved: int | None) -> StepReport:
    zero = dict.fromkeys(TENANTS, 0)
    names = ["batch_start", "before_backward", "after_backward", "batch_end"]
    pairs = zip(names[: len(reserved)], reserved, strict=True)
    phases = {n: PhaseReport(name=n, tenants_bytes=zero, reserved_bytes=r) for n, r in pairs}  # type: ignore[arg-type]
    return StepReport(0, phases, [phases], zero, None, 0)  # type: ignore[arg-type]


def test_the_context_is_the_line_through_the_bare_contexts_with_lazy_loading() -> None:
    assert H100_BARE == 545_354_845  # 520.1 MiB: 132 SMs x 2048 threads
    assert cuda_context_bytes(H100, "12.8", lazy_loading=True) == 545_354_845
    assert cuda_context_bytes(A100, lazy_loading=True) == 427 * MiB  # 108 x 2048 falls on a whole MiB
    assert cuda_context_bytes(resolve_target("sm_90"), lazy_loading=True) == 545_354_845  # an H100's SMs assumed


def test_eager_loading_adds_the_kernels_measured_for_that_cuda_version() -> None:
    assert cuda_context_bytes(H100, "12.8", lazy_loading=False) == H100_BARE + EAGER_11_7
    # HF's V100 on CUDA 11.2 read 1343 MiB with a 1x1 tensor in its 2 MiB segment: the context is the other 1341
    assert cuda_context_bytes(V100, "11.2", lazy_loading=False) == 1341 * MiB
    assert cuda_context_bytes(V100, "11.4", lazy_loading=True) == 1341 * MiB  # no lazy loading before 11.7


def test_old_cuda_and_bare_capabilities_fall_back_with_a_note() -> None:
    gtx1080_bare = 107 * MiB + (20 * 2048 - 34 * 1536) * (448 * MiB) // (154 * 1536)  # below the line's low point
    cu101_kernels = 719 * MiB - gtx1080_bare  # #55277: a GTX 1080 on torch 1.8.2+cu101 read 721 MiB
    old = device_footprint(report(MiB), V100, cuda_version="9.2", environ={})
    assert old.context_bytes == 333_860_243 + cu101_kernels  # V100: 80 x 2048 thread slots
    assert any("no published context for CUDA 9.2: CUDA 10.1's assumed" in note for note in old.notes)
    assert any("predates lazy module loading" in note for note in old.notes)
    pascal = device_footprint(report(MiB), resolve_target("sm_61"), lazy_loading=True)
    assert pascal.context_bytes == gtx1080_bare
    assert any("the SMs of a GTX 1080 assumed for sm_61" in note for note in pascal.notes)


def test_cuda_module_loading_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    assert cuda_context_bytes(H100) == H100_BARE + EAGER_11_7
    assert cuda_context_bytes(H100, lazy_loading=True) == H100_BARE  # given, it wins
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    assert cuda_context_bytes(H100) == H100_BARE


def test_nccl_buffers_for_world_sizes_1_2_and_8() -> None:
    assert nccl_buffer_bytes(1, None, H100, environ={}) == 0
    assert nccl_buffer_bytes(1, "ddp", H100, environ={}) == 0
    # NVLS: 16 channels x 2 x (128 KiB x 8 steps) x one head per rank, plus credits rounded up to 2 MiB
    assert nccl_buffer_bytes(2, "ddp", H100, environ={}) == H100_RING + 16 * 2 * MiB * 2 + 2 * MiB  # 354 MiB
    assert nccl_buffer_bytes(8, "ddp", H100, environ={}) == H100_RING + 16 * 2 * MiB * 8 + 2 * MiB  # 546 MiB
    assert nccl_buffer_bytes(8, "fsdp", H100, environ={}) == nccl_buffer_bytes(8, "ddp", H100, environ={})
    # A100: P2P read puts SIMPLE on the sender, 4 KiB + 4 MiB -> 6 MiB; receive 4 KiB + LL + LL128 -> 6 MiB; no NVLS
    assert nccl_buffer_bytes(8, "ddp", A100, environ={}) == 24 * (6 * MiB + 6 * MiB)
    assert nccl_buffer_bytes(2, "ddp", A6000, environ={}) == 2 * 12 * MiB  # PCIe peers: 2 channels


def test_nccl_variables_override_the_defaults() -> None:
    # 4 KiB + 524,288 + 4,915,200 + 8 MiB = 13,832,192 -> 14 MiB received, 2 MiB sent
    env = {"NCCL_BUFFSIZE": str(8 * MiB), "NCCL_NVLS_ENABLE": "0"}
    assert nccl_buffer_bytes(8, "ddp", H100, environ=env) == 24 * (2 * MiB + 14 * MiB)
    assert nccl_buffer_bytes(8, "ddp", A100, environ={"NCCL_BUFFSIZE": str(MiB)}) == 24 * (2 * MiB + 6 * MiB)
    assert nccl_buffer_bytes(8, "ddp", H100, environ={"NCCL_MAX_NCHANNELS": "8", "NCCL_NVLS_ENABLE": "0"}) == 96 * MiB
    nvls = {"NCCL_NVLS_NCHANNELS": "4", "NCCL_MIN_NCHANNELS": "32"}
    assert nccl_buffer_bytes(8, "fsdp", H100, environ=nvls) == 32 * 12 * MiB + 4 * 2 * MiB * 8 + 2 * MiB


def test_the_footprint_adds_its_three_parts() -> None:
    step = report(3 * MiB, 100 * MiB, 60 * MiB, None)
    env = {"CUDA_MODULE_LOADING": "LAZY"}
    footprint = device_footprint(step, H100, world_size=8, strategy="fsdp", environ=env)
    assert footprint == DeviceFootprint(100 * MiB, H100_BARE, H100_RING + 258 * MiB, footprint.notes)
    assert footprint.total_bytes == 100 * MiB + 545_354_845 + 546 * MiB
    assert any("estimate from NCCL's defaults" in note for note in footprint.notes)
    single = device_footprint(step, V100, cuda_version="11.2", environ={"CUDA_MODULE_LOADING": "EAGER"})
    assert (single.nccl_bytes, single.total_bytes) == (0, 100 * MiB + 1341 * MiB)


def test_the_reports_reserved_peak_is_preferred_to_its_phases() -> None:
    class Peaked(StepReport):
        @property
        def peak_reserved_bytes(self) -> int:  # type: ignore[override]
            return 140 * MiB

    step = report(3 * MiB, 100 * MiB)
    peaked = Peaked(step.step, step.phases, step.micro_batches, step.tenants_bytes, None, 0)
    assert device_footprint(peaked, A100, lazy_loading=True).reserved_peak_bytes == 140 * MiB


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: nccl_buffer_bytes(0, "ddp", H100), "world_size must be a positive integer"),
        (lambda: nccl_buffer_bytes(2, "zero3", H100), "strategy must be one of"),
        (lambda: nccl_buffer_bytes(2, None, H100), "strategy must be 'ddp' or 'fsdp' for world_size 2"),
        (lambda: nccl_buffer_bytes(2, "ddp", "H100"), "target must be a CudaTarget"),  # type: ignore[arg-type]
        (lambda: nccl_buffer_bytes(2, "ddp", H100, environ={"NCCL_BUFFSIZE": "4M"}), "NCCL_BUFFSIZE must be a whole"),
        (lambda: cuda_context_bytes(H100, "twelve"), "cuda_version must be None or a CUDA version"),
        (lambda: cuda_context_bytes(H100, lazy_loading="yes"), "lazy_loading must be True, False or None"),  # type: ignore[arg-type]
        (lambda: device_footprint(report(None), H100), "report must be a CUDA prediction's step"),
        (lambda: device_footprint({}, H100), "report must be a StepReport"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_are_named(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call()
