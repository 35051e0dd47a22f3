"""The CUDA target runs CUDA's choices: the attention kernel, dropout's mask, autocast's op lists.

Every figure is worked out by hand from the tensors each kernel keeps for backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_memtenants import predict
from lightning_memtenants.core.tracker import LiveTensorTracker
from lightning_memtenants.predict.cuda_kernels import fused_attention_rewrite, priority_order
from lightning_memtenants.predict.cuda_kernels import sdpa_kernel as choose
from lightning_memtenants.predict.values import PredictionError

A100, A10, T4, V100, H100 = (8, 0), (8, 6), (7, 5), (7, 0), (9, 0)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def qkv(b: int = 2, h: int = 4, s: int = 128, d: int = 64, dtype: torch.dtype = BF16, grad: bool = True) -> list:
    return [torch.empty(b, h, s, d, dtype=dtype, device="meta", requires_grad=grad) for _ in range(3)]


@pytest.mark.parametrize(
    ("case", "capability", "dtype", "mask", "dropout", "head_dim", "expected"),
    [
        ("half on Ampere", A100, BF16, None, 0.1, 64, "flash"),
        ("fp32 has no flash kernel", A100, FP32, None, 0.1, 64, "efficient"),
        ("a mask rules flash out", A100, BF16, "float", 0.0, 64, "efficient"),
        ("bf16 before Ampere: math", T4, BF16, None, 0.0, 64, "math"),
        ("fp16 on Turing: memory-efficient", T4, FP16, None, 0.0, 64, "efficient"),
        ("Volta fp32", V100, FP32, None, 0.1, 64, "efficient"),
        ("fp32 head dim off the GEMM alignment", A100, FP32, None, 0.0, 30, "math"),
        ("sm86 training with head dim 208", A10, BF16, None, 0.0, 208, "efficient"),
        ("sm86 training with head dim 256, no dropout", A10, BF16, None, 0.0, 256, "flash"),
        ("sm86 training with head dim 256 and dropout", A10, BF16, None, 0.1, 256, "efficient"),
        ("Hopper prefers cuDNN", H100, BF16, None, 0.0, 64, "cudnn"),
        ("cuDNN dropout only in 1/16 steps", H100, BF16, None, 0.1, 64, "flash"),
        ("cuDNN with dropout 1/8", H100, BF16, None, 0.125, 64, "cudnn"),
        ("cuDNN head dim over 128", H100, BF16, None, 0.0, 160, "flash"),
    ],
)
def test_the_kernel_pytorch_would_pick(case, capability, dtype, mask, dropout, head_dim, expected) -> None:
    q, k, v = qkv(d=head_dim, dtype=dtype)
    attn_mask = torch.empty(128, 128, dtype=dtype, device="meta") if mask else None
    assert choose(q, k, v, attn_mask, dropout, False, capability, environ={}) == expected, case


def test_the_switches_and_the_environment_are_read() -> None:
    q, k, v = qkv()
    assert priority_order(H100, environ={}) == ["cudnn", "flash", "efficient", "math"]
    deprioritized = {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}
    assert priority_order(H100, environ=deprioritized) == ["flash", "efficient", "math", "cudnn"]
    assert priority_order(A100, environ={}) == ["flash", "efficient", "math", "cudnn"]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert choose(q, k, v, None, 0.0, False, A100, environ={}) == "efficient"
    with sdpa_kernel([SDPBackend.MATH]):
        assert choose(q, k, v, None, 0.0, False, H100, environ={}) == "math"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="no available kernel"):
        choose(*qkv(dtype=FP32), None, 0.0, False, A100, environ={})
    causal_rectangle = [torch.empty(2, 4, n, 64, dtype=BF16, device="meta") for n in (64, 128, 128)]
    assert choose(*causal_rectangle, None, 0.0, True, A100, environ={}) == "efficient"
    assert torch.backends.cuda.flash_sdp_enabled()  # the context managers put the switches back


class QKV(nn.Module):
    """The attention's inputs are the parameters, so the activations are what the kernel alone keeps."""

    def __init__(self, b: int, h: int, s: int, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(torch.randn(b, h, s, d)) for _ in range(3))


def attention(dropout: float):
    def loss(module: QKV, batch: object) -> torch.Tensor:
        return F.scaled_dot_product_attention(module.q, module.k, module.v, dropout_p=dropout).float().sum()

    return loss


def activations(report, phase: str = "before_backward") -> int:
    return report.phases[phase].tenants_bytes["activations"]


def test_flash_keeps_the_output_and_the_log_sum_exp() -> None:
    b, h, s, d = 2, 4, 128, 64
    report = predict(QKV(b, h, s, d), torch.Size([1]), loss_fn=attention(0.1), target="A100", precision="bf16-true")
    output, logsumexp = b * h * s * d * 2, b * h * s * 4  # bf16 output, a float32 per query; the philox seed is host
    assert activations(report) == output + logsumexp == 135_168
    assert any("flash x1" in note for note in report.notes)


def test_memory_efficient_pads_the_log_sum_exp_to_32_queries() -> None:
    b, h, s, d = 2, 4, 100, 64
    report = predict(QKV(b, h, s, d), torch.Size([1]), loss_fn=attention(0.1), target="A100")
    output, logsumexp = b * h * s * d * 4, b * h * 128 * 4  # 100 queries padded to 128 in the log-sum-exp
    rounded = sum(-(-n // 512) * 512 for n in (output, logsumexp))
    assert activations(report) == output + logsumexp == 208_896 and rounded == output + logsumexp
    assert any("efficient x1" in note for note in report.notes)


def test_attention_dropout_grows_quadratically_on_the_cpu_and_linearly_on_an_a100() -> None:
    b, h, d = 2, 4, 64
    sizes = (64, 128, 192)
    grown = {}
    for target in ("cpu", "A100"):
        runs = [predict(QKV(b, h, s, d), torch.Size([1]), loss_fn=attention(0.1), target=target) for s in sizes]
        kept = [activations(run) for run in runs]
        grown[target] = (kept[1] - kept[0], kept[2] - kept[1])
        if target == "A100":  # output and log-sum-exp: (d + 1) float32 per query and head
            assert kept == [b * h * s * (d + 1) * 4 for s in sizes]
    assert grown["A100"][0] == grown["A100"][1] == b * h * 64 * (d + 1) * 4
    cpu_first, cpu_second = grown["cpu"]
    # the math path keeps the softmax and the dropout's float mask and product, three s*s float32 matrices
    assert cpu_second - cpu_first == 3 * b * h * 4 * (192**2 - 2 * 128**2 + 64**2)


def test_dropout_keeps_a_one_byte_mask_on_cuda() -> None:
    def loss(module: QKV, batch: object) -> torch.Tensor:
        return F.dropout(module.q, 0.1).sum()

    n = 64 * 64
    assert activations(predict(QKV(1, 1, 64, 64), torch.Size([1]), loss_fn=loss, target="cpu")) == n * 4
    assert activations(predict(QKV(1, 1, 64, 64), torch.Size([1]), loss_fn=loss, target="A100")) == n


def test_autocast_runs_softmax_in_float32_on_cuda() -> None:
    def loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return torch.softmax(module(batch), -1).sum()

    rows, width = 8, 64
    batch = torch.Size([rows, width])
    cpu = predict(nn.Linear(width, width), batch, loss_fn=loss, precision="bf16-mixed")
    a100 = predict(nn.Linear(width, width), batch, loss_fn=loss, precision="bf16-mixed", target="A100")
    cast_input = rows * width * 2  # what the linear keeps: its input, cast to bf16
    assert activations(cpu) == cast_input + rows * width * 2  # the CPU's softmax keeps a bf16 output
    assert activations(a100) == cast_input + rows * width * 4  # CUDA's softmax runs in float32 (set_opt_dtype)


def test_autocast_runs_layer_norm_in_float32_on_cuda() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))

    def loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return module(batch).float().sum()

    rows = 8
    cpu = predict(model, torch.Size([rows, 64]), loss_fn=loss, precision="bf16-mixed")
    a100 = predict(model, torch.Size([rows, 64]), loss_fn=loss, precision="bf16-mixed", target="A100")
    linear_input = rows * 64 * 2
    # the CPU's layer norm keeps its bf16 input and float32 mean and rstd; CUDA's keeps a float32 copy of the input
    assert activations(cpu) == linear_input + rows * 64 * 2 + 2 * rows * 4
    assert activations(a100) == linear_input + rows * 64 * 4 + 2 * rows * 4


def test_binary_cross_entropy_under_cuda_autocast_is_refused_as_cuda_refuses_it() -> None:
    def loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy(torch.sigmoid(module(batch)), torch.zeros(4, 1))

    with pytest.raises(PredictionError, match="binary_cross_entropy_with_logits"):
        predict(nn.Linear(8, 1), torch.Size([4, 8]), loss_fn=loss, precision="bf16-mixed", target="A100")
    assert predict(nn.Linear(8, 1), torch.Size([4, 8]), loss_fn=loss, precision="bf16-mixed").peak_bytes


def test_multi_head_attention_inside_torch_is_seen_too() -> None:
    def loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return module(batch).sum()

    kept = []
    for s in (64, 128, 192):
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        report = predict(layer, torch.Size([2, s, 64]), loss_fn=loss, target="A100")
        assert any("efficient x1" in note for note in report.notes)
        kept.append(activations(report))
    assert kept[2] - kept[1] == kept[1] - kept[0]  # nothing grows with s*s


def test_flash_backward_holds_its_float32_accumulators_while_it_runs() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    b, h, s, d = 2, 4, 100, 64
    with FakeTensorMode():
        q, k, v, out, grad = (torch.empty(b, h, s, d, dtype=BF16) for _ in range(5))
        lse = torch.empty(b, h, s)
        seed, offset = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
        tracker = LiveTensorTracker("cpu", scan=False, count_fake=True)
        tracker.rewrite = fused_attention_rewrite(tracker)
        with tracker:
            grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad, q, k, v, out, lse, None, None, s, s, 0.0, False, seed, offset, scale=0.125
            )
            current, peak = tracker.read()
    assert len(grads) == 3
    assert current == 3 * b * h * s * d * 2
    dq_accum, softmax_d = b * 128 * h * 64 * 4, b * h * 128 * 4  # the queries rounded to 128, the head dim to 32
    assert peak == current + dq_accum + softmax_d


def test_a_checkpointed_region_recomputes_with_cudas_kernels_too() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inner = lambda t: F.dropout(torch.softmax(self.lin(t), -1), 0.1)  # noqa: E731
            return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)

    def loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return module(batch).float().sum()

    for precision in ("32-true", "bf16-mixed"):  # the recomputed mask is bool and the softmax float32, as saved
        report = predict(Block(), torch.Size([8, 64]), loss_fn=loss, precision=precision, target="A100")
        assert activations(report) == 0  # the region keeps only its input, the batch


@pytest.mark.parametrize(
    ("spec", "kernel"),
    [
        ("gpt2/ones/bf16-mixed", "flash x2"),  # an all-ones mask becomes is_causal: flash
        ("gpt2/padded/bf16-mixed", "efficient x2"),  # a padding mask rules flash out
        ("llama/ones/32-true", "efficient x2"),  # grouped-query heads, fp32
        ("bert/padded/bf16-mixed/ckpt", "efficient x4"),  # recomputed under checkpointing: each layer twice
        ("vit/bf16-mixed", "flash x2"),
        ("demo/32-true", "efficient x6"),  # nn.Transformer: attention inside F.multi_head_attention_forward
    ],
)
def test_hugging_face_and_lightning_models_predict_for_an_a100(spec: str, kernel: str) -> None:
    pytest.importorskip("transformers")
    from hf_models import Spec, build_batch, build_module

    parsed = Spec.parse(spec)
    report = predict(build_module(parsed), build_batch(parsed), precision=parsed.precision, target="A100")
    note = next(n for n in report.notes if n.startswith("attention as CUDA runs it on A100"))
    assert f"(PyTorch's kernel choice): {kernel};" in note
    assert report.peak_bytes > report.tenants_bytes["weights"] > 0


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_the_math_path_is_atens_own_step_by_step(dtype: torch.dtype) -> None:
    """Without dropout and mask, our math path keeps and allocates what ATen's CPU math path does, to the byte."""
    from lightning_memtenants.predict.cuda_kernels import _math_attention

    def run(attention) -> tuple[int, int, int]:
        q, k, v = (torch.randn(2, 4, 48, 32, dtype=dtype, requires_grad=True) for _ in range(3))
        kept: list[int] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            kept.append(tensor.untyped_storage().nbytes())
            return tensor

        with (
            LiveTensorTracker("cpu", scan=False) as tracker,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = attention(q, k, v)
            current, peak = tracker.read()
        assert out.shape == q.shape
        return sum(kept), current, peak

    ours = run(lambda q, k, v: _math_attention(q, k, v, None, 0.0, False, None, False))
    atens = run(lambda q, k, v: torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0])
    assert ours == atens


def test_the_casts_a_checkpointed_region_recomputes_die_with_its_autocast() -> None:
    class Blocks(nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(3))
            self.checkpointed = checkpointed

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
            return x

    def loss(module: nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
        return module(batch[0]).float().pow(2).mean()

    allocated = []
    for checkpointed in (False, True):
        report = predict(
            Blocks(checkpointed), (torch.Size([32, 256]),), loss_fn=loss, precision="16-mixed", target="A100"
        )
        allocated.append(report.phases["after_backward"].allocated_bytes)
    parameters = 3 * (256 * 256 * 4 + 256 * 4)  # float32 weights and biases, each a multiple of 512 bytes
    batch, loss_scalar = 32 * 256 * 4, 512  # the loss's 4 bytes in a 512-byte block
    cublas = 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)  # torch's default workspace on Ampere, forward's and autograd's
    # the recomputation's fp16 weight and bias copies (3 * (131,072 + 512) bytes) went when its autocast exited
    assert allocated == [2 * parameters + batch + loss_scalar + cublas] * 2


def test_the_casts_of_an_autocast_region_die_when_it_exits_in_the_forward() -> None:
    def loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = module(batch)
        torch.empty(2**20).sum()  # after the region: its fp16 weight and bias copies are gone
        return out.float().sum()

    report = predict(nn.Linear(256, 256), torch.Size([32, 256]), loss_fn=loss, target="A100")
    parameters, batch = 256 * 256 * 4 + 256 * 4, 32 * 256 * 4
    kept = 2 * 32 * 256 * 2  # the fp16 input linear keeps, and its fp16 output
    cublas = 4096 * 1024 * 2 + 16 * 1024 * 8
    assert report.phases["before_backward"].window_peak_bytes == parameters + batch + kept + cublas + 2**22 + 512
