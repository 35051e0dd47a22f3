"""The kernels a fake step does not follow by itself: oneDNN's LSTM, CTC loss, max pooling on a GPU target.

- **LSTM.** The CPU's LSTM runs oneDNN's ``mkldnn_rnn_layer`` where oneDNN is on (the default), and keeps a
  workspace for backward whose size torch's meta kernel leaves at 0. The prediction equals a real CPU fit to
  the byte, oneDNN on and off, for Lightning's demo LSTM and 2-layer ``nn.LSTM`` and ``nn.GRU`` modules, with an
  initial state given and without one (then ``nn.LSTM`` makes it with ``torch.zeros``, a constant the dry run
  computes for real, and autograd saves it); the workspace's size is worked out here from oneDNN's layout and
  checked against the real operator.
- **CTC loss.** Its ``log_alpha`` is sized by the longest target, a value; the batch's integer lengths are
  known to a dry run. ``F.ctc_loss``, ``nn.CTCLoss`` and Hugging Face's ``Wav2Vec2ForCTC`` equal a real CPU
  fit to the byte, ``Wav2Vec2ForCTC`` with an attention mask and without one (its lengths then come from
  ``torch.ones_like`` of the audio); on a GPU target the CUDA kernel's scratch is counted too.
- **``self.log``.** A Trainer keeps what a step logs (the demo LSTM's loss; a module that logs on step and on epoch,
  with ``log_dict`` too) from batch to batch: two steps equal a real fit's to the byte.
- **Max pooling** on a GPU target (it recursed for ever): Lightning's MNIST demo net and a BatchNorm CNN
  predict for an A100 and an H100, the int64 indices counted.

The real runs are this file's own, run as a script in a fresh process so the tracker sees only them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hf_models import HFModule
from lightning.pytorch.demos.boring_classes import Net
from lightning.pytorch.demos.lstm import LightningLSTM
from torch import Tensor, nn

from lightning_memtenants import PHASES, dry_run, predict
from lightning_memtenants.predict.kernels import onednn_lstm_workspace
from lightning_memtenants.predict.values import PredictionError

HERE = Path(__file__).resolve().parent
BATCH, STEPS, VOCAB, WIDTH = 4, 16, 100, 64
# CTC: time steps, batch, classes (0 is the blank), the targets' padded length and their lengths
T, N, C, S = 20, 3, 8, 5
TARGET_LENGTHS = (5, 4, 3)
INPUT_LENGTHS = (20, 18, 15)


class DemoLSTM(LightningLSTM):
    """Lightning's demo LSTM (4 layers of 512), less its download: the batch is built here. Its step logs the loss
    with ``self.log(..., prog_bar=True)``."""

    def prepare_data(self) -> None:
        pass


class Recurrent(L.LightningModule):
    """Embedding, a 2-layer ``nn.LSTM`` or ``nn.GRU`` of width 64, a linear head; SGD.

    The initial state is made from the embedding (``new_zeros``), as the demo makes it, or, with ``default``, left
    to ``nn.LSTM`` and ``nn.GRU``, which make it with ``torch.zeros``: a constant that a dry run computes for real,
    and that autograd saves (each layer's slice of it), so an activation.
    """

    def __init__(self, kind: str = "lstm", default: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.default = default
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(WIDTH, WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        x = self.embed(tokens)
        if self.default:
            out, _ = self.rnn(x)
        else:
            h0 = x.new_zeros(2, x.size(0), WIDTH)
            out, _ = self.rnn(x, (h0, h0.clone()) if self.kind == "lstm" else h0)
        return F.cross_entropy(self.head(out).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CTC(L.LightningModule):
    """Features to log-probabilities, CTC loss on padded targets (``F.ctc_loss``) or concatenated ones
    (``nn.CTCLoss``, summed); the lengths are the batch's."""

    def __init__(self, module: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(16, C)
        self.loss = nn.CTCLoss(reduction="sum", zero_infinity=True) if module else None

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        features, targets, input_lengths, target_lengths = batch
        log_probs = self.linear(features.transpose(0, 1)).log_softmax(-1)  # (time, batch, classes)
        if self.loss is None:
            return F.ctc_loss(log_probs, targets, input_lengths, target_lengths)
        flat = torch.cat([row[:n] for row, n in zip(targets, target_lengths.tolist(), strict=True)])
        return self.loss(log_probs, flat, input_lengths, target_lengths)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Logged(L.LightningModule):
    """A linear model whose step logs what users log: the loss on step and on epoch (a mean over the epoch, in
    bfloat16, which Lightning keeps as float32), a sum on epoch alone, a Python number, and a ``log_dict``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, _ = batch
        loss = self.linear(features).pow(2).mean()
        self.log("loss", loss.to(torch.bfloat16), on_step=True, on_epoch=True, prog_bar=True)
        self.log("total", loss.detach() * 2, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("rate", 0.5)
        self.log_dict({"a": loss.detach().abs(), "b": loss.detach() + 1}, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def wav2vec2() -> HFModule:
    """A tiny ``Wav2Vec2ForCTC`` from its config (2 conv layers of 32, 2 transformer layers of 32); its attention
    mask is the batch's (without one, the CTC lengths come from ``ones_like`` of the audio, which a dry run does
    not know)."""
    import transformers as tf

    config = tf.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0,
        ctc_loss_reduction="mean",
        pad_token_id=0,
    )
    return HFModule(tf.Wav2Vec2ForCTC(config))


def build(name: str) -> L.LightningModule:
    torch.manual_seed(0)
    if name == "demo":
        return DemoLSTM(vocab_size=VOCAB)
    if name in ("lstm", "gru", "lstm_default", "gru_default"):
        return Recurrent(name.removesuffix("_default"), default=name.endswith("_default"))
    if name in ("ctc", "ctcloss"):
        return CTC(module=name == "ctcloss")
    if name in ("wav2vec2", "wav2vec2_unmasked"):
        return wav2vec2()
    if name == "logged":
        return Logged()
    raise ValueError(f"no model named {name!r}")


def batch(name: str) -> Any:
    """The batch the DataLoader gives ``training_step``, the same on every call."""
    generator = torch.Generator().manual_seed(1)
    if name in ("ctc", "ctcloss"):
        features = torch.randn(N, T, 16, generator=generator)
        targets = torch.randint(1, C, (N, S), generator=generator)
        return features, targets, torch.tensor(INPUT_LENGTHS), torch.tensor(TARGET_LENGTHS)
    if name in ("wav2vec2", "wav2vec2_unmasked"):
        values = torch.randn(2, 400, generator=generator)
        labels = torch.randint(1, 16, (2, 6), generator=generator)
        labels[1, 4:] = -100  # a shorter transcript, padded
        if name == "wav2vec2_unmasked":  # the input lengths come from ones_like(input_values)
            return {"input_values": values, "labels": labels}
        mask = torch.ones(2, 400, dtype=torch.long)
        mask[1, 300:] = 0  # shorter audio, padded: the CTC input lengths come from the mask
        return {"input_values": values, "attention_mask": mask, "labels": labels}
    if name == "logged":
        return torch.randn(BATCH, WIDTH, generator=generator), torch.zeros(BATCH)
    tokens = torch.randint(0, VOCAB, (BATCH, STEPS + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as a DataLoader collates WikiText2's pairs


def real_run(spec: str) -> dict:
    """A real Trainer fit on the CPU with the callback (``name`` or ``name@off``: oneDNN off), of ``steps(name)``
    steps on the same batch: every step's report."""
    from conftest import make_trainer
    from torch.utils.data import DataLoader

    from lightning_memtenants import MemoryTenantsCallback

    name, _, option = spec.partition("@")
    L.seed_everything(0, verbose=False)
    module = build(name)
    data = batch(name)
    loader = DataLoader([data] * steps(name), batch_size=None)  # the batch as it is, already collated
    callback = MemoryTenantsCallback(memory_source="tracker", track_every_step=True, print_summary=False)
    with onednn(option):
        make_trainer([callback], steps=steps(name), logger=False, precision=precision(option)).fit(module, loader)
    assert callback.first is not None and callback.latest is not None
    reports = [callback.first, callback.latest][-steps(name) :]
    return {"spec": spec, "reports": [dataclasses.asdict(report) for report in reports]}


def steps(name: str) -> int:
    """Two steps where what a step keeps for the next matters (what ``self.log`` keeps), else one."""
    return 2 if name in ("demo", "logged") else 1


# ``@off``: oneDNN off; ``@bf16-mixed``: that precision (oneDNN's LSTM then runs in bfloat16, as CPU autocast casts it)
SPECS = [
    "demo", "demo@off", "lstm", "lstm@off", "lstm@bf16-mixed", "gru", "lstm_default", "lstm_default@off",
    "gru_default", "ctc", "ctcloss", "wav2vec2", "wav2vec2_unmasked", "logged",
]  # fmt: skip


@cache
def real_process() -> subprocess.CompletedProcess[str]:
    """The real fits, once for every test (a failed run too)."""
    return subprocess.run([sys.executable, __file__, *SPECS], capture_output=True, text=True, timeout=600)


def real_runs() -> dict[str, dict]:
    out = real_process()
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {run["spec"]: run for run in runs}


def differences(predicted: Any, report: dict) -> list[str]:
    """Every field where the prediction differs from the real run's report, with the bytes by which it does."""
    found: list[str] = []

    def compare(what: str, mine: Any, theirs: Any) -> None:
        if mine != theirs:
            found.append(f"{what}: predicted {mine!r}, real {theirs!r}")

    compare("tenants_bytes", predicted.tenants_bytes, report["tenants_bytes"])
    for name in PHASES:
        phase, mine = report["phases"][name], predicted.phases[name]
        compare(f"{name}.tenants_bytes", mine.tenants_bytes, phase["tenants_bytes"])
        compare(f"{name}.allocated_bytes", mine.allocated_bytes, phase["allocated_bytes"])
        compare(f"{name}.window_peak_bytes", mine.window_peak_bytes, phase["window_peak_bytes"])
    compare("peak_bytes", predicted.peak_bytes, report["peak_bytes"])
    compare("peak_phase", predicted.peak_phase, report["peak_phase"])
    return found


def onednn(option: str) -> Any:
    """oneDNN off for ``@off``; left as it is (on, the default) otherwise."""
    return torch.backends.mkldnn.flags(enabled=False) if option == "off" else contextlib.nullcontext()


def precision(option: str) -> str:
    return option if option.endswith("mixed") else "32-true"


def predicted(spec: str, target: str = "cpu") -> Any:
    return predicted_steps(spec, target)[-1]


def predicted_steps(spec: str, target: str = "cpu") -> list[Any]:
    name, _, option = spec.partition("@")
    with onednn(option):
        return dry_run(build(name), batch(name), target=target, precision=precision(option), steps=steps(name)).reports


def activations(report: Any, phase: str = "before_backward") -> int:
    return report.phases[phase].tenants_bytes["activations"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_prediction_equals_a_real_cpu_fit_to_the_byte(spec: str) -> None:
    if spec.startswith("wav2vec2"):
        pytest.importorskip("transformers")
    real = real_runs()[spec]["reports"]
    mine = predicted_steps(spec)
    assert len(mine) == len(real)
    found = [f"step {i + 1}: {d}" for i, (p, r) in enumerate(zip(mine, real, strict=True)) for d in differences(p, r)]
    assert not found, f"{spec}:\n" + "\n".join(found)


def test_a_gpu_target_says_its_lstm_is_not_cudnns() -> None:
    report = predicted("lstm", "A100")
    assert any("cuDNN runs them (_cudnn_rnn)" in note for note in report.notes)
    assert not any("_cudnn_rnn" in note for note in predicted("ctc", "A100").notes)


def pages(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def test_the_workspace_is_onednns_layout_and_the_real_operators_size() -> None:
    # time 16, batch 4, width 64, float32: the gates (16 x 4 rows of 4 x 64, padded to 272 floats against 4K
    # aliasing), the hidden states (16 x 4 x 64), then 5 blocks of 2 x 17 x 4 rows of 64: the layer and cell
    # states and the three float32 gradients; each part starts on a page of 4096 bytes
    parts = [16 * 4 * 272 * 4, 16 * 4 * 64 * 4] + [2 * 17 * 4 * 64 * 4] * 5
    offset = 0
    for part in parts:
        offset = pages(offset) + part
    assert pages(offset) == onednn_lstm_workspace(16, 4, 64, 64, 4, 4) == 270_336
    for steps, batch_size, inputs, hidden in [(16, 4, 64, 64), (7, 3, 33, 20), (5, 2, 512, 64), (16, 4, 64, 256)]:
        layer = nn.LSTM(inputs, hidden)
        x = torch.randn(steps, batch_size, inputs, requires_grad=True)
        h = torch.zeros(batch_size, hidden)
        weights = (layer.weight_ih_l0, layer.weight_hh_l0, layer.bias_ih_l0, layer.bias_hh_l0)
        out = torch.ops.aten.mkldnn_rnn_layer(x, *weights, h, h, False, [], 2, hidden, 1, True, False, False, True)
        assert out[3].numel() == onednn_lstm_workspace(steps, batch_size, inputs, hidden, 4, 4)


class Unlogged(Logged):
    """``Logged``'s step without its logs."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, _ = batch
        return self.linear(features).pow(2).mean()


class Silent(Logged):
    """``Logged`` whose class overrides ``log`` with one that keeps nothing, as a real fit then runs it."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass


def test_what_self_log_keeps_is_lightning_s_result_collection_to_the_byte() -> None:
    def ends(module: L.LightningModule) -> list[int | None]:
        reports = dry_run(module, batch("logged"), steps=2).reports
        return [report.phases["batch_end"].allocated_bytes for report in reports]

    plain = ends(Unlogged())
    assert ends(Silent()) == plain  # a class's own log is the one that runs
    logged = ends(Logged())
    # per name: a metric's state and its default, a 0-d float each, and for a mean a 0-d int64 count and its default;
    # the step's detached clone where it is logged on step (there, the state is that clone); the running value on epoch
    on_step_and_epoch = (4 + 4) + (8 + 8) + 4  # "loss": the default, the running sum, the count (2) and the clone
    on_epoch_sum = 4 + 4  # "total": the default and the running sum, no count
    on_step = 4 + (8 + 8) + 4  # "rate", "a", "b": the float's default, the count and its default, the clone
    kept = on_step_and_epoch + on_epoch_sum + 3 * on_step
    assert kept == 108
    # the second step's batch_end: the first step's four clones are still the Trainer's callback_metrics
    assert [mine - theirs for mine, theirs in zip(logged, plain, strict=True)] == [kept, kept + 4 * 4]  # type: ignore[operator]


class Logits(nn.Module):
    """The log-probabilities' logits are the parameter: what the loss keeps is all the activations there are."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(T, N, C))


@pytest.mark.parametrize("target", ["cpu", "A100"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ctc_keeps_log_alpha_sized_by_the_longest_target(reduction: str, target: str) -> None:
    def loss(module: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
        return F.ctc_loss(module.logits.log_softmax(-1), *batch, reduction=reduction)

    data = (torch.ones(N, S, dtype=torch.long), torch.tensor(INPUT_LENGTHS), torch.tensor(TARGET_LENGTHS))
    report = predict(Logits(), data, loss_fn=loss, optimizer=torch.optim.SGD, target=target)
    log_probs = T * N * C * 4  # log_softmax's output, kept by it and by the loss
    log_alpha = N * T * (2 * max(TARGET_LENGTHS) + 1) * 4  # (batch, time, 2 x 5 + 1)
    divisor = N * 8 if reduction == "mean" else 0  # the int64 target lengths clamped to 1, kept by the division
    assert activations(report) == log_probs + N * 4 + log_alpha + divisor


def test_cudnn_takes_int32_ctc_on_a_gpu_and_keeps_the_gradient() -> None:
    """int32 targets and lengths, blank 0, float32: CUDA runs cuDNN's CTC, which computes the gradient in the
    forward and keeps it instead of log_alpha; with cuDNN off, or on the CPU, the native kernel runs."""

    def loss(module: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
        return F.ctc_loss(module.logits.log_softmax(-1), *batch, reduction="sum")

    i32 = torch.int32
    data = (torch.ones(sum(TARGET_LENGTHS), dtype=i32), torch.tensor(INPUT_LENGTHS, dtype=i32))
    data += (torch.tensor(TARGET_LENGTHS, dtype=i32),)
    log_probs, loss_bytes = T * N * C * 4, N * 4
    log_alpha = N * T * (2 * max(TARGET_LENGTHS) + 1) * 4
    targets_int64 = sum(TARGET_LENGTHS) * 8  # the native kernel's targets.to(torch.long), which it keeps
    gpu = predict(Logits(), data, loss_fn=loss, optimizer=torch.optim.SGD, target="A100")
    assert activations(gpu) == log_probs + loss_bytes + log_probs  # the gradient, the log-probabilities' size
    cpu = predict(Logits(), data, loss_fn=loss, optimizer=torch.optim.SGD)
    assert activations(cpu) == log_probs + loss_bytes + log_alpha + targets_int64
    with torch.backends.cudnn.flags(enabled=False):
        native = predict(Logits(), data, loss_fn=loss, optimizer=torch.optim.SGD, target="A100")
    assert activations(native) == activations(cpu)


@pytest.mark.parametrize(("steps", "longest"), [(20, 5), (400, 100)])
def test_ctc_backward_on_a_gpu_holds_log_beta_while_it_runs(steps: int, longest: int) -> None:
    """CUDA's backward allocates the lengths, the offsets and log_beta beside the gradient; a large problem
    (2 x 400 time steps > 450) also the blanks' logsumexp."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_memtenants.core.tracker import LiveTensorTracker
    from lightning_memtenants.predict.cuda_kernels import fused_attention_rewrite

    batch_size, classes = 2, 8
    with FakeTensorMode():
        log_probs = torch.empty(steps, batch_size, classes)
        log_alpha = torch.empty(batch_size, steps, 2 * longest + 1)
        targets = torch.ones(batch_size, longest, dtype=torch.long)
        loss, grad_out = torch.empty(batch_size), torch.empty(batch_size)
        tracker = LiveTensorTracker("cpu", scan=False, count_fake=True)
        tracker.rewrite = fused_attention_rewrite(tracker)
        lengths = [longest] * batch_size
        with tracker:
            grad = torch.ops.aten._ctc_loss_backward(
                grad_out, log_probs, targets, [steps] * batch_size, lengths, loss, log_alpha, 0, False
            )
            current, peak = tracker.read()
    assert grad.shape == log_probs.shape and current == steps * batch_size * classes * 4
    scratch = 3 * batch_size * 8 + batch_size * steps * (2 * longest + 1) * 4  # 2 lengths, the offsets; log_beta
    if steps == 400:
        scratch += 2 * batch_size * steps * (longest + 1) * 4 + 2 * batch_size * steps * 4
    assert peak == current + scratch


def test_ctc_lengths_the_dry_run_does_not_know_are_refused_by_name() -> None:
    shapes = (torch.Size([N, T, 16]), torch.Size([N, S]), torch.Size([N]), torch.Size([N]))
    with pytest.raises(PredictionError, match="input_lengths must be known"):
        predict(CTC(), shapes)


class BatchNormCNN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 13 * 13, 10)
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


class MNISTDemo(BatchNormCNN):
    """Lightning's MNIST demo net (two convolutions, ``F.max_pool2d``, dropout), on its log-likelihood."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.net = Net()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return F.nll_loss(self.net(batch[0]), batch[1])


# what a LightningModule's step keeps besides its loss's graph (predicted and measured alike: a step returning
# ``F.nll_loss(self.w.log_softmax(-1), labels)`` keeps the log-softmax, the total weight and these 8 bytes)
LIGHTNING_STEP = 8


@pytest.mark.parametrize("target", ["A100", "H100"])
def test_max_pooling_predicts_for_a_gpu_with_its_int64_indices(target: str) -> None:
    # the pooled tensor is the parameter itself: what max pooling keeps is only its int64 indices
    def loss(module: nn.Module, batch: object) -> Tensor:
        return F.max_pool2d(module.pooled, 2).sum()

    holder = nn.Module()
    holder.register_parameter("pooled", nn.Parameter(torch.zeros(2, 3, 10, 10)))
    report = predict(holder, torch.Size([1]), loss_fn=loss, target=target)
    assert activations(report) == 2 * 3 * 5 * 5 * 8  # int64
    images, labels = (torch.Size([2, 1, 28, 28]), torch.zeros(2, dtype=torch.long))
    demo = predict(MNISTDemo(), (images, labels), target=target)
    # the MNIST net (batch 2) keeps: relu(conv1) 32x26x26 and relu(conv2) 64x24x24 (float32), the pooling's
    # int64 indices 64x12x12, dropout's 1-byte masks (9216 and 128), fc1's input 9216, relu(fc1) 128, fc2's
    # input 128, the log-softmax 10, and nll_loss's total weight
    kept = 2 * (32 * 26 * 26 * 4 + 64 * 24 * 24 * 4 + 64 * 12 * 12 * 8 + 9216 + 128 + 9216 * 4 + 128 * 4 * 2 + 10 * 4)
    assert activations(demo) == kept + 4 + LIGHTNING_STEP
    cnn = predict(BatchNormCNN(), (images, labels), target=target)
    # conv's output (kept by BatchNorm), BatchNorm's two saved statistics of 8, relu's output (kept by the
    # pooling), the int64 indices of 8x13x13, the flattened pooled input of the linear, log-softmax's output
    # and the cross-entropy's total weight
    bn = 2 * (8 * 26 * 26 * 4 * 2 + 8 * 13 * 13 * (8 + 4) + 10 * 4) + 2 * 8 * 4
    assert activations(cnn) == bn + 4 + LIGHTNING_STEP


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    for spec in sys.argv[1:]:
        print(json.dumps(real_run(spec)), flush=True)
