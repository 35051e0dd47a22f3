"""The activations by module: the split of the activations tenant by the module whose forward allocated each storage.

Every figure is worked out by hand from what each operator saves for backward (fp32, 4 bytes an element):
``Linear`` saves its input (the batch, which is never an activation, or the storage the module before it made) and
its weight (a weight); ``Tanh`` saves its output; ``x * w`` with ``w`` not requiring grad saves ``w``; ``pow(2)``
saves its input, the model's output, which the last module made. A storage is owned by the innermost module whose
forward allocated it, so the output of a ``Tanh`` that the next ``Linear`` saves is the ``Tanh``'s.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json

import lightning as L
import pytest
import torch
from conftest import CLOSURE_DIVISOR, make_trainer, no_collection, plain_step
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback, StepReport, TenantMonitor, dry_run, predict
from lightning_memtenants.core.timeline import OTHER_MODULES, OUTSIDE_MODULES, timeline_of, top_modules
from lightning_memtenants.render.table import format_table, summary_markdown
from lightning_memtenants.render.tensorboard import SUMMARY_MD

BATCH = 128
TANH_OUT = BATCH * 512 * 4  # 262,144 bytes: the Tanh's 128 x 512 output
HEAD_OUT = BATCH * 64 * 4  # 32,768 bytes: the last Linear's 128 x 64 output, which pow keeps


def mean_square(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class Gate(nn.Module):
    """Scales its input by a weight made without grad from a 64 x wider temporary: the step's peak, in its forward.

    It saves the weight (``x * w``, ``w`` needing no grad, keeps ``w``) and its output is what the next Linear saves.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            weight = x.unsqueeze(-1).expand(*x.shape, 64).exp().mean(-1)  # a 16 MiB temporary, freed at once
        return x * weight


def gated() -> nn.Sequential:
    return nn.Sequential(nn.Linear(128, 512), nn.Tanh(), Gate(), nn.Linear(512, 64))


def plain() -> nn.Sequential:
    return nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 64))


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Deep(nn.Module):
    """Twelve blocks, block i 16 (i + 1) wide, then a head of 4: more modules hold activations than a report names."""

    def __init__(self) -> None:
        super().__init__()
        widths = [16] + [16 * (i + 1) for i in range(12)]
        self.blocks = nn.ModuleList(Block(widths[i], widths[i + 1]) for i in range(12))
        self.head = nn.Linear(widths[-1], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class GatedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = gated()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_peak_in_the_optimizer_step_splits_the_activations_at_before_backward() -> None:
    report = predict(plain(), torch.Size([BATCH, 128]), loss_fn=mean_square, optimizer=torch.optim.Adam, steps=2)
    assert report.peak_phase == "batch_end"  # Adam's temporaries, when autograd holds nothing
    # the Tanh's output (saved by itself and by the Linear after it, one storage) and the head's output (pow's)
    assert report.activations_by_module_at == "before_backward"
    assert report.activations_by_module_bytes == {"1": TANH_OUT, "2": HEAD_OUT}
    assert list(report.activations_by_module_bytes) == ["1", "2"]  # largest first
    assert sum(report.activations_by_module_bytes.values()) == report.tenants_bytes["activations"] == 294_912
    assert report.phases["before_backward"].tenants_bytes["activations"] == 294_912


def test_autocast_s_casts_of_weights_are_no_module_s_activations() -> None:
    report = predict(
        plain(),
        torch.Size([BATCH, 128]),
        loss_fn=mean_square,
        optimizer=torch.optim.Adam,
        steps=2,
        precision="bf16-mixed",
    )
    # bf16: the first Linear's cast of the batch (its saved input: the cast, not the batch, is an activation), the
    # Tanh's output and the head's, 2 bytes an element; the head's cast weight (512 x 64) is the autocast cache
    assert report.activations_by_module_bytes == {"1": BATCH * 512 * 2, "0": BATCH * 128 * 2, "2": BATCH * 64 * 2}
    assert sum(report.activations_by_module_bytes.values()) == report.tenants_bytes["activations"] == 180_224
    assert report.parts_bytes == {"autocast_cache": 512 * 64 * 2}


def test_accumulated_micro_batches_split_at_the_last_one_s_before_backward() -> None:
    report = predict(
        plain(), torch.Size([BATCH, 128]), loss_fn=mean_square, optimizer=torch.optim.Adam, accumulate_grad_batches=2
    )
    assert report.peak_phase == "batch_end" and report.activations_by_module_at == "before_backward"
    # each micro-batch's loss is divided by 2, a Python number autograd keeps as an 8-byte 0-d tensor
    assert report.activations_by_module_bytes == {"1": TANH_OUT, "2": HEAD_OUT, OUTSIDE_MODULES: 8}
    last = report.micro_batches[-1]["before_backward"].tenants_bytes["activations"]
    assert sum(report.activations_by_module_bytes.values()) == last == 294_920


def test_a_peak_in_the_forward_splits_at_the_peak_and_names_its_module() -> None:
    prediction = dry_run(gated(), torch.Size([BATCH, 128]), loss_fn=mean_square, optimizer=sgd)
    report, line = prediction.report, prediction.timeline
    assert report.peak_phase == "before_backward"
    # at the peak the Gate's 16 MiB temporary is alive, with the mean of it just made: the weight it saves
    assert (line.peak_op, line.peak_module, line.peak_in_module) == ("aten.mean.dim", "2", True)
    assert report.peak_bytes - line.total_bytes[line.peak_point - 1] == TANH_OUT  # the mean: 128 x 512
    assert report.peak_explanation.startswith("peak inside the forward pass, at aten.mean.dim in 2: 0.78 MiB of")
    # alive at the peak: the Tanh's output, and the Gate's weight; not yet its output nor the head's
    assert report.activations_by_module_at == "peak"
    assert report.activations_by_module_bytes == {"1": TANH_OUT, "2": TANH_OUT}
    assert sum(report.activations_by_module_bytes.values()) == line.layers["activations"][line.peak_point] == 524_288
    # at before_backward, all of them: the Gate owns its weight and its output (the head's saved input)
    assert line.activations_before_backward_bytes == {"2": 2 * TANH_OUT, "1": TANH_OUT, "3": HEAD_OUT}
    assert sum(line.activations_before_backward_bytes.values()) == report.tenants_bytes["activations"] == 819_200


def test_more_modules_than_the_report_names_add_up_under_other_modules() -> None:
    prediction = dry_run(Deep(), torch.Size([4, 16]), loss_fn=mean_square, optimizer=torch.optim.Adam, steps=2)
    report, line = prediction.report, prediction.timeline
    assert report.activations_by_module_at == "before_backward"
    # every module: each block's Tanh output, 4 x 16 (i + 1) floats, and the head's 4 x 4 output
    every = {f"blocks.{i}.act": 256 * (i + 1) for i in range(12)} | {"head": 64}
    assert line.activations_before_backward_bytes == every
    assert sum(every.values()) == report.tenants_bytes["activations"] == 20_032
    # the report: the ten largest, then the rest (blocks.1.act, blocks.0.act and the head) together
    named = {f"blocks.{i}.act": 256 * (i + 1) for i in range(11, 1, -1)}
    assert report.activations_by_module_bytes == {**named, OTHER_MODULES: 512 + 256 + 64}
    assert list(report.activations_by_module_bytes) == [*named, OTHER_MODULES]
    assert sum(report.activations_by_module_bytes.values()) == report.tenants_bytes["activations"]
    (printed,) = [text for text in format_table(report).splitlines() if text.startswith("- activations by module")]
    assert printed.endswith(", blocks.2.act (0.00 MiB), other modules (0.00 MiB); 0.02 MiB in all")
    assert top_modules(every, 20) == dict(sorted(every.items(), key=lambda kv: -kv[1]))
    with pytest.raises(ValueError, match="top must be a positive int"):
        line.activations_by_module(0)


def test_what_no_module_made_is_outside_any_module() -> None:
    def scaled(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).exp().sum()  # exp saves its output, made outside the model

    report = predict(plain(), torch.Size([BATCH, 128]), loss_fn=scaled, optimizer=torch.optim.Adam, steps=2)
    # the head's output is now saved by nothing (exp keeps its result, not its input)
    assert report.activations_by_module_bytes == {"1": TANH_OUT, OUTSIDE_MODULES: HEAD_OUT}
    assert sum(report.activations_by_module_bytes.values()) == report.tenants_bytes["activations"]
    line = "- activations by module at before_backward (none was alive at the step's peak): 1 (0.25 MiB),"
    assert f"{line} outside any module (0.03 MiB); 0.28 MiB in all" in format_table(report).splitlines()


def test_the_split_round_trips_through_json_and_is_printed() -> None:
    report = predict(plain(), torch.Size([BATCH, 128]), loss_fn=mean_square, optimizer=torch.optim.Adam, steps=2)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["activations_by_module_bytes"] == {"1": 262_144, "2": 32_768}
    assert data["activations_by_module_at"] == "before_backward"
    again = StepReport.from_dict(data)
    assert again == report and list(again.activations_by_module_bytes) == ["1", "2"]
    line = "activations by module at before_backward (none was alive at the step's peak): 1 (0.25 MiB), 2 (0.03 MiB);"
    line += " 0.28 MiB in all"
    assert f"- {line}" in format_table(report).splitlines()
    assert f"- {line}" in summary_markdown(report).splitlines()
    # right under the peak's explanation
    lines = format_table(report).splitlines()
    assert lines[lines.index(f"- {line}") - 1] == f"- {report.peak_explanation}"
    forward = predict(gated(), torch.Size([BATCH, 128]), loss_fn=mean_square, optimizer=sgd)
    assert "- activations by module at the step's peak: 1 (0.25 MiB), 2 (0.25 MiB); 0.50 MiB in all" in (
        format_table(forward).splitlines()
    )


def test_an_old_record_and_a_step_without_a_timeline_have_no_split() -> None:
    report = predict(plain(), torch.Size([8, 128]), loss_fn=mean_square, optimizer=sgd)
    data = report.to_dict()
    del data["activations_by_module_bytes"], data["activations_by_module_at"]  # written before the field existed
    old = StepReport.from_dict(data)
    assert old.activations_by_module_bytes == {} and old.activations_by_module_at == ""
    assert not any(line.startswith("- activations by module") for line in format_table(old).splitlines())
    # a hand-written loop's steps that the tracker does not measure, and a monitor told not to record
    torch.manual_seed(0)
    model = plain()
    optimizer = sgd(model.parameters())
    monitor = TenantMonitor(model, [optimizer])
    monitor.record_timeline = False
    with no_collection():
        unrecorded, _ = plain_step(monitor, model, optimizer, torch.randn(8, 128))
        monitor.record_timeline = True
        monitor.measure = False
        unmeasured, _ = plain_step(monitor, model, optimizer, torch.randn(8, 128))
    monitor.close()
    for step in (unrecorded, unmeasured):
        assert timeline_of(step) is None
        assert step.activations_by_module_bytes == {} and step.activations_by_module_at == ""
        assert "activations by module" not in format_table(step)


def test_a_hand_written_loop_splits_as_the_prediction_does_from_its_second_step() -> None:
    gc.collect()
    torch.manual_seed(0)
    model = gated()
    optimizer = sgd(model.parameters())
    monitor = TenantMonitor(model, [optimizer])
    with no_collection():
        first, _ = plain_step(monitor, model, optimizer, torch.randn(BATCH, 128))
        second, _ = plain_step(monitor, model, optimizer, torch.randn(BATCH, 128))
    monitor.close()
    # the first step's graph is read before any hook goes on the model (a compiled function would show there)
    assert not timeline_of(first).module_paths and first.activations_by_module_bytes == {}
    assert first.activations_by_module_at == "" and "activations by module" not in format_table(first)
    assert first.peak_explanation.startswith("peak inside the forward pass: ")  # no module to name
    predicted = predict(gated(), torch.Size([BATCH, 128]), loss_fn=mean_square, optimizer=sgd)
    assert timeline_of(second).module_paths
    assert second.activations_by_module_at == predicted.activations_by_module_at == "peak"
    assert second.activations_by_module_bytes == predicted.activations_by_module_bytes == {"1": TANH_OUT, "2": TANH_OUT}
    assert second.peak_explanation.startswith("peak inside the forward pass, at aten.mean.dim in 2: ")
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # gone with the step


def test_a_compiled_function_calling_the_modules_compiles_as_without_us() -> None:
    graphs: list[object] = []

    def counting(gm: torch.fx.GraphModule, inputs: list[object]) -> object:
        graphs.append(gm)  # then AOT autograd, as torch.compile's default does, with eager kernels
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, inputs)

    counts = []
    for measured in (False, True):
        torch._dynamo.reset()
        graphs.clear()
        torch.manual_seed(0)
        model = plain()
        optimizer = sgd(model.parameters())
        step = torch.compile(lambda x, model=model: model(x).pow(2).mean(), backend=counting)
        monitor = TenantMonitor(model, [optimizer], warn=lambda _: None) if measured else None
        for _ in range(3):
            x = torch.randn(8, 128)
            if monitor is not None:
                monitor.phase("batch_start", batch=x)
            loss = step(x)
            if monitor is not None:
                monitor.phase("before_backward", output=loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if monitor is not None:
                report = monitor.end_step()
                assert report.activations_by_module_bytes == {}
                assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
        counts.append(len(graphs))
        if monitor is not None:
            assert monitor.unmeasured_reason is None  # compiled code on the CPU is measured
            monitor.close()
    torch._dynamo.reset()
    assert counts[0] == counts[1] >= 1


def test_a_compiled_model_gets_no_module_hook() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model[0].compile()  # compiled in place: nothing is compiled until it runs, and it never runs here
    monitor = TenantMonitor(model, [], warn=lambda _: None)
    monitor.phase("batch_start", batch=torch.randn(2, 4))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    monitor.skip_step()
    monitor.close()


def test_a_fit_with_the_panels_splits_as_the_prediction_and_says_so_in_every_output(tmp_path) -> None:
    gc.collect()
    torch.manual_seed(0)
    cb = MemoryTenantsCallback()
    loader = DataLoader(TensorDataset(torch.randn(2 * BATCH, 128)), batch_size=BATCH)
    module = GatedModule()
    with no_collection(), contextlib.redirect_stdout(io.StringIO()) as stdout:
        make_trainer([cb], steps=2, logger=TensorBoardLogger(tmp_path, name="gated")).fit(module, loader)
    predicted = predict(GatedModule(), (torch.Size([BATCH, 128]),), steps=2)
    # the first step reads its graph before any hook goes on the model: no module paths, no split, no line
    assert cb.first.activations_by_module_bytes == {} and not timeline_of(cb.first).module_paths
    # the second, at the peak, in the Gate's forward: the Tanh's output and the Gate's weight
    report = cb.latest
    assert report.peak_phase == predicted.peak_phase == "before_backward"
    assert report.activations_by_module_at == predicted.activations_by_module_at == "peak"
    assert report.activations_by_module_bytes == predicted.activations_by_module_bytes
    assert report.activations_by_module_bytes == {"net.1": TANH_OUT, "net.2": TANH_OUT}
    assert report.peak_explanation.startswith("peak inside the forward pass, at aten.mean.dim in net.2: ")
    assert report.peak_explanation == predicted.peak_explanation
    # before_backward, all of them, and Lightning's 8-byte divisor, which its closure makes outside any module
    line = timeline_of(cb.latest)
    assert line.activations_before_backward_bytes == {
        "net.2": 2 * TANH_OUT,
        "net.1": TANH_OUT,
        "net.3": HEAD_OUT,
        OUTSIDE_MODULES: CLOSURE_DIVISOR,
    }
    assert sum(line.activations_before_backward_bytes.values()) == cb.latest.tenants_bytes["activations"] == 819_208
    text = "activations by module at the step's peak: net.1 (0.25 MiB), net.2 (0.25 MiB); 0.50 MiB in all"
    assert stdout.getvalue().count(f"- {text}") == 1  # the printed summary: the last step's table
    (summary,) = tmp_path.rglob(SUMMARY_MD)  # TensorBoard's text panel, as markdown
    assert summary.read_text().count(f"- {text}") == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(summary.parent), size_guidance={"tensors": 0})
    events.Reload()
    (entry,) = events.Tensors("memtenants/summary/text_summary")
    assert text in entry.tensor_proto.string_val[0].decode()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in module.modules())  # gone with each step
