"""Tensor values in a dry run: constants and the batch's integers are real, the rest is one sentence.

The bytes are worked out by hand in each test: fp32 is 4 bytes an element, a bool 1, int64 8.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memtenants import predict
from lightning_memtenants.cli import main
from lightning_memtenants.core.tracker import LiveTensorTracker
from lightning_memtenants.predict.fake import fake_session
from lightning_memtenants.predict.kernels import cpu_kernels
from lightning_memtenants.predict.values import PredictionError


@pytest.fixture()
def cli(capsys: pytest.CaptureFixture[str]) -> Any:
    """The command in this process: returns its code, stdout and stderr."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        try:
            code = main(list(args))
        except SystemExit as exit:
            code = int(exit.code or 0)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return run


def total(model: nn.Module, batch: Tensor) -> Tensor:
    return model(batch).sum()


class DropPathSchedule(nn.Module):
    """As timm's ViT: the depth's drop rates from ``torch.linspace``, read with ``.item()`` to choose each block."""

    def __init__(self, depth: int = 3, rate: float = 0.1) -> None:
        super().__init__()
        rates = [x.item() for x in torch.linspace(0, rate, depth)]
        self.blocks = nn.ModuleList(nn.Linear(8, 8) if r > 0.0 else nn.Identity() for r in rates)
        nn.init.trunc_normal_(self.blocks[1].weight)  # a random init, as timm's: the user's generator must not move

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_constructor_that_reads_its_constants_is_built_and_the_report_says_so() -> None:
    state = torch.random.get_rng_state()
    report = predict(DropPathSchedule, torch.Size([4, 8]), loss_fn=total)
    assert torch.equal(torch.random.get_rng_state(), state)
    # rates 0, 0.05, 0.1: the first block is an Identity, two Linear(8, 8) remain: 2 x (64 + 8) x 4 bytes
    assert report.tenants_bytes["weights"] == 2 * 72 * 4
    (note,) = [n for n in report.notes if "constructor" in n]
    assert "test_values.py" in note and "computed for real" in note


class MaskPaths(nn.Module):
    """A model whose path depends on values, as transformers' attention does.

    A generated causal mask is compared with ``torch.equal`` (``nn.Transformer``'s causal check), and an
    attention mask that masks nothing (``mask.all()``) is dropped; a padded one scales the scores.
    """

    def __init__(self, seq: int = 16, width: int = 8) -> None:
        super().__init__()
        self.seq = seq
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        causal = torch.triu(torch.ones(self.seq, self.seq, dtype=torch.bool), diagonal=1)
        assert torch.equal(causal, torch.triu(torch.ones_like(causal), diagonal=1))
        scores = self.proj(x) @ x.transpose(1, 2)  # (b, s, s)
        if not mask.all():
            keep = mask.to(x.dtype)  # (b, s) fp32, saved by the product for backward
            scores = scores * keep[:, None, :]
        return scores.masked_fill(causal, 0.0)


def mask_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return model(*batch).sum()


@pytest.mark.parametrize("padded", [False, True])
def test_the_model_takes_the_path_a_real_run_takes_from_the_batch_s_own_mask(padded: bool) -> None:
    b, s, w = 2, 16, 8
    mask = torch.ones(b, s, dtype=torch.long)
    if padded:
        mask[1, s // 2 :] = 0
    report = predict(MaskPaths(s, w), (torch.randn(b, s, w), mask), loss_fn=mask_loss)
    # saved for backward beside the batch (which is no activation): the causal mask for masked_fill (s*s bool),
    # and on the padded path the fp32 mask the product keeps (b*s*4); both are real tensors in the dry run
    saved = s * s + (b * s * 4 if padded else 0)
    forward = report.phases["before_backward"]
    assert forward.tenants_bytes["activations"] == saved
    # what the forward left allocated is those and the loss (4 bytes): the fake copies that the fake mode made of
    # the real masks, where they met fake tensors, are not memory
    start = report.phases["batch_start"].allocated_bytes
    assert start is not None and forward.allocated_bytes is not None
    assert forward.allocated_bytes - start == saved + 4


class Branches(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        if y.sum() > 0:  # the line the error names
            return y * 2
        return y


def test_a_branch_on_a_value_no_one_knows_is_one_sentence_naming_the_line() -> None:
    line = next(i for i, text in enumerate(inspect.getsource(Branches).splitlines()) if "if y.sum()" in text)
    lineno = inspect.getsourcelines(Branches)[1] + line
    with pytest.raises(PredictionError, match="training step cannot be predicted") as raised:
        predict(Branches(8, 8), torch.Size([4, 8]), loss_fn=total)
    assert f"test_values.py:{lineno} (forward): if y.sum() > 0:" in str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert isinstance(raised.value, ValueError)


def test_a_step_that_reads_a_loss_with_numpy_is_one_sentence_too() -> None:
    def loss(model: nn.Module, batch: Tensor) -> Tensor:
        out = model(batch).sum()
        print(out.detach().numpy())
        return out

    with pytest.raises(PredictionError, match=r"test_values.py:\d+ \(loss\): print\(out.detach\(\).numpy\(\)\)"):
        predict(nn.Linear(4, 4), torch.Size([2, 4]), loss_fn=loss)


def test_integer_tensors_given_as_shapes_are_said_to_have_no_values() -> None:
    ids = torch.empty(4, 8, dtype=torch.long, device="meta")
    report = predict(nn.Embedding(10, 4), ids, loss_fn=total)
    (note,) = [n for n in report.notes if "no values" in n]
    assert "[4, 8] int64" in note
    real = predict(nn.Embedding(10, 4), torch.zeros(4, 8, dtype=torch.long), loss_fn=total)
    assert not [n for n in real.notes if "no values" in n]
    assert real.tenants_bytes == report.tenants_bytes  # the embedding does not branch on its ids


def saved_dtypes(run: object) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t: Tensor) -> Tensor:
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()  # type: ignore[operator]
    return saved


@pytest.mark.parametrize("norm", ["batch", "layer", "group"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_a_norm_of_a_bf16_input_saves_the_statistics_the_cpu_saves(norm: str, weight_dtype: torch.dtype) -> None:
    """The CPU keeps a bf16 input's statistics in fp32 under fp32 weights (autocast); the meta kernels do not."""

    def make() -> tuple[Tensor, Tensor, Tensor]:
        x = torch.ones(4, 8, 6, 6, dtype=torch.bfloat16, requires_grad=True)
        return x, torch.ones(8, dtype=weight_dtype, requires_grad=True), torch.zeros(8, dtype=weight_dtype)

    def step(x: Tensor, w: Tensor, b: Tensor) -> None:
        if norm == "batch":
            out = F.batch_norm(x, torch.zeros(8, dtype=w.dtype), torch.ones(8, dtype=w.dtype), w, b, training=True)
        elif norm == "layer":
            out = F.layer_norm(x.transpose(1, 3), (8,), w, b)
        else:
            out = F.group_norm(x, 2, w, b)
        out.float().sum().backward()

    real = saved_dtypes(lambda: step(*make()))
    tracker = LiveTensorTracker("cpu", scan=False, count_fake=True)
    tracker.rewrite = cpu_kernels  # as a dry run sets it
    with fake_session(), tracker:
        fake = saved_dtypes(lambda: step(*make()))
    assert fake == real
    if weight_dtype == torch.float32:
        assert sum(dtype == torch.float32 and len(shape) <= 4 and shape[0] <= 8 for dtype, shape in real) >= 2


@pytest.mark.slow
def test_lightning_s_demo_transformer_is_predicted_without_a_word_from_torch() -> None:
    """Its causal-mask check runs on a real generated mask; torch's data-pointer warning never reaches the user."""
    code = textwrap.dedent(
        """
        import functools, torch
        from lightning.pytorch.demos import LightningTransformer
        from lightning_memtenants import predict
        idx = torch.randint(0, 100, (2, 16))
        report = predict(functools.partial(LightningTransformer, vocab_size=100), (idx, idx))
        print(report.tenants_bytes["weights"])
        """
    )
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # weights: embedding 100x200, decoder 200x100 + 100, nn.Transformer(200, 2 heads, 2+2 layers, ff 200)
    encoder_layer = (3 * 200 * 200 + 3 * 200) + (200 * 200 + 200) + (200 * 200 + 200) + (200 * 200 + 200) + 4 * 200
    decoder_layer = 2 * ((3 * 200 * 200 + 3 * 200) + (200 * 200 + 200)) + 2 * (200 * 200 + 200) + 6 * 200
    params = 100 * 200 + (200 * 100 + 100) + 2 * encoder_layer + 2 * decoder_layer + 2 * (2 * 200)
    assert int(out.stdout.split()[-1]) == 4 * params
    assert "data pointer" not in out.stderr and "FakeTensor" not in out.stderr


COMMAND_MODELS = '''
import lightning as L
import torch
from lightning.pytorch.demos import LightningTransformer
from torch import nn


class Scheduled(L.LightningModule):
    """timm's way: a drop-path schedule read with .item(), and torch's trunc_normal_ (which checks values)."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        rates = [x.item() for x in torch.linspace(0, 0.1, depth)]
        self.blocks = nn.ModuleList(nn.Linear(16, 16) if r > 0 else nn.Identity() for r in rates)
        for block in self.blocks:
            if isinstance(block, nn.Linear):
                nn.init.trunc_normal_(block.weight, std=0.02)

    def example_batch(self, batch_size: int, seq_len: int | None = None) -> torch.Tensor:
        return torch.randn(batch_size, 16)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        for block in self.blocks:
            batch = block(batch)
        return batch.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


class Demo(LightningTransformer):
    def __init__(self) -> None:
        super().__init__(vocab_size=100)

    def example_batch(self, batch_size: int, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(batch_size, seq_len or 16, dtype=torch.long)
        return ids, ids


class Unknowable(Scheduled):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.blocks[1](batch)
        if out.mean() > 0:
            out = out * 2
        return out.sum()
'''


def test_the_command_predicts_models_built_from_their_class(tmp_path: Path, cli: Any) -> None:
    source = tmp_path / "models.py"
    source.write_text(COMMAND_MODELS)
    done = cli("predict", f"{source}:Scheduled", "--batch-size", "4", "--json", str(tmp_path / "s.json"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["report"]["tenants_bytes"]["weights"] == 2 * (16 * 16 + 16) * 4
    assert any("built on the meta device" in note for note in report["notes"])
    done = cli("predict", f"{source}:Demo", "--batch-size", "2", "--seq-len", "16")
    assert done.returncode == 0, done.stderr
    done = cli("predict", f"{source}:Unknowable", "--batch-size", "4")
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert "cannot be predicted" in line and "models.py:" in line and "if out.mean() > 0:" in line
    assert "Traceback" not in done.stderr


class SavedConstant(nn.Module):
    """A constant made for real (``torch.full``) meets the model's tensors inside a composite operator (``einsum``
    permutes it first), so autograd saves the fake mode's copy of it, as ``nn.LSTM`` saves its default zero state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.einsum("bk,kn->bn", self.lin(x), torch.full((8, 8), 2.0))


def test_a_known_constant_that_autograd_saves_is_an_activation_counted_once() -> None:
    report = predict(SavedConstant(), torch.Size([4, 8]), loss_fn=total)
    forward = report.phases["before_backward"]
    constant = 8 * 8 * 4  # the product keeps the constant (fp32) for the gradient of lin's output, and nothing else
    assert forward.tenants_bytes["activations"] == constant
    start = report.phases["batch_start"].allocated_bytes
    assert start is not None and forward.allocated_bytes is not None
    assert forward.allocated_bytes - start == constant + 4  # and the loss: the constant is counted once


class Lengths(nn.Module):
    """Lengths from ``torch.ones_like`` of the float input, as Wav2Vec2ForCTC makes its CTC lengths without a mask:
    their value sizes the slice, and the product keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        lengths = torch.ones_like(x, dtype=torch.long).sum(-1)
        half = int(lengths[0]) // 2
        return self.lin(x[:, :half]) * lengths[:, None]


def test_an_integer_ones_like_of_a_fake_input_is_a_known_constant_counted_as_a_real_run_holds_it() -> None:
    report = predict(Lengths(), torch.Size([4, 16]), loss_fn=total)
    assert report.tenants_bytes["weights"] == (8 * 8 + 8) * 4  # the slice's width is 16 // 2 = 8, the Linear's
    forward = report.phases["before_backward"]
    assert forward.tenants_bytes["activations"] == 4 * 8  # the product keeps the int64 lengths (4), and nothing else
    start = report.phases["batch_start"].allocated_bytes
    assert start is not None and forward.allocated_bytes is not None and forward.window_peak_bytes is not None
    assert forward.allocated_bytes - start == 4 * 8 + 4  # the lengths and the loss
    # the peak: the int64 ones (4 x 16) while their sum, the lengths, is made
    assert forward.window_peak_bytes - start == 4 * 16 * 8 + 4 * 8


def test_a_floating_ones_like_stays_fake_and_a_branch_on_it_is_one_sentence() -> None:
    def loss(model: nn.Module, x: Tensor) -> Tensor:
        if torch.ones_like(x).sum() > 0:  # fp32: arithmetic, not a mask; its values are not made
            return model(x).sum()
        return model(x).mean()

    with pytest.raises(PredictionError, match=r"test_values.py:\d+ \(loss\): if torch.ones_like\(x\).sum\(\) > 0:"):
        predict(nn.Linear(4, 4), torch.Size([2, 4]), loss_fn=loss)


def test_a_known_tensor_written_with_unknown_values_is_unknown_from_then_on() -> None:
    def loss(model: nn.Module, x: Tensor) -> Tensor:
        seen = torch.zeros(2, 4)  # a constant, known
        seen.add_(model(x).detach())  # written with values no one knows: the zeros are no longer its values
        if seen.sum() > 0:
            return model(x).sum()
        return model(x).mean()

    with pytest.raises(PredictionError, match=r"test_values.py:\d+ \(loss\): if seen.sum\(\) > 0:"):
        predict(nn.Linear(4, 4), torch.Size([2, 4]), loss_fn=loss)
