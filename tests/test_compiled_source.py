"""A torch.compile'd CPU fit is measured: the tracker sees the buffers inductor's generated code allocates, in
training and in the validation loop, whose compiled forward under inference mode is a graph of its own.

Inductor's CPU wrapper allocates with ``torch._C._dynamo.guards._empty_strided_cpu``, outside the dispatcher. The
independent count is PyTorch's profiler: with ``profile_memory=True`` the CPU allocator reports every allocation and
every free of a block allocated while profiling, in order, so the running sum of those events, split at the phase
boundaries an oracle callback marks, gives each window's change and peak. The whole fit is profiled, so that every
block freed in the measured step was allocated under the profiler.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from conftest import CLOSURE_DIVISOR, make_trainer, nothing_registered
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import LiveTensorTracker, MemoryTenantsCallback

pytestmark = pytest.mark.slow

BATCH, IN, HIDDEN, OUT = 16, 8, 32, 4
P = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # Linear(8, 32), GELU, Linear(32, 4): 420 parameters in 4 tensors
PHASES = ("batch_start", "before_backward", "after_backward", "before_optimizer_step", "batch_end")
MARK = "memtenants-oracle:"


class Net(L.LightningModule):
    """A compiled Linear(8, 32), GELU, Linear(32, 4); loss ``out.pow(2).mean()``; Adam. Validation keeps nothing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.compile(nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT)))
        self.losses: list[bytes] = []
        self.validated: list[bytes] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch[0]).pow(2).mean()
        self.losses.append(loss.detach().numpy().tobytes())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated.append(self.net(batch[0]).sum().numpy().tobytes())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


class Marks(L.Callback):
    """Marks each phase boundary in the profiler's record, right after the callback under test measured it."""

    def _mark(self, phase: str) -> None:
        with record_function(MARK + phase):
            pass

    def on_train_batch_start(self, *args: Any) -> None:
        self._mark("batch_start")

    def on_before_backward(self, *args: Any) -> None:
        self._mark("before_backward")

    def on_after_backward(self, *args: Any) -> None:
        self._mark("after_backward")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._mark("before_optimizer_step")

    def on_train_batch_end(self, *args: Any) -> None:
        self._mark("batch_end")

    def on_validation_batch_start(self, *args: Any) -> None:
        self._mark("validation_start")

    def on_validation_batch_end(self, *args: Any) -> None:
        self._mark("validation_end")


def loader() -> DataLoader:
    data = torch.randn(3 * BATCH, IN, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=BATCH)


def profiled_windows(prof: Any, temporaries: bool) -> list[dict[str, tuple[int, int]]]:
    """Per step or validation batch, per boundary: (bytes allocated then, peak of the window ending there), from the
    profiler's CPU allocation events, relative to the fit's start.

    Without ``temporaries``, a block that an ATen operator called from Python allocates and frees again inside
    itself is left out: the live-tensor tracker counts what operators return, at their ends, and so sees none.
    """
    allocations: list[tuple[int, int, int]] = []  # (time, bytes: negative for a free, address)
    operators: list[tuple[int, int]] = []  # the time ranges of the outermost ATen operators
    marks: list[tuple[int, str]] = []

    def walk(nodes: Any, inside: bool) -> None:
        for node in nodes:
            fields = node.extra_fields
            if node.tag == _EventType.Allocation:
                if fields.device.type == "cpu":
                    allocations.append((node.start_time_ns, fields.alloc_size, fields.ptr))
                continue
            outermost = not inside and node.name.startswith("aten::")
            if outermost:
                operators.append((node.start_time_ns, node.end_time_ns))
            if node.name.startswith(MARK):
                marks.append((node.start_time_ns, node.name[len(MARK) :]))
            walk(node.children, inside or outermost)

    walk(prof.profiler.kineto_results.experimental_event_tree(), False)
    allocations.sort()
    if not temporaries:
        operators.sort()

        def operator_at(time: int) -> int | None:
            for index, (begin, end) in enumerate(operators):
                if begin <= time <= end:
                    return index
            return None

        dropped: set[int] = set()
        opened: dict[int, int] = {}  # address -> index of its allocation
        for index, (time, size, address) in enumerate(allocations):
            if size > 0:
                opened[address] = index
            elif address in opened:
                first = opened.pop(address)
                where = operator_at(allocations[first][0])
                if where is not None and where == operator_at(time):
                    dropped.update((first, index))
        allocations = [event for index, event in enumerate(allocations) if index not in dropped]
    events = sorted([(t, 0, size, "") for t, size, _ in allocations] + [(t, 1, 0, name) for t, name in marks])
    steps: list[dict[str, tuple[int, int]]] = []
    current = peak = 0
    for _, is_mark, size, name in events:
        if is_mark:
            if name in ("batch_start", "validation_start"):
                steps.append({})
            steps[-1][name] = (current, peak)
            peak = current
        else:
            current += size
            peak = max(peak, current)
    return steps


def fit(callback: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = Net()
    callbacks: list[L.Callback] = [MemoryTenantsCallback(print_summary=False, track_every_step=True), Marks()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if callback:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                make_trainer(callbacks, steps=3, num_sanity_val_steps=0).fit(model, loader(), loader())
        else:
            make_trainer([], steps=3, num_sanity_val_steps=0).fit(model, loader(), loader())
    return {
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "losses": model.losses,
        "validated": model.validated,
        "report": callbacks[0].latest if callback else None,  # type: ignore[attr-defined]
        "validation": callbacks[0].latest_validation if callback else None,  # type: ignore[attr-defined]
        "oracle": profiled_windows(prof, temporaries=False) if callback else None,
        "raw": profiled_windows(prof, temporaries=True) if callback else None,
        "ours": [str(w.message) for w in caught if "memtenants" in str(w.message)],
    }


def training(windows: list[dict[str, tuple[int, int]]]) -> list[dict[str, tuple[int, int]]]:
    return [w for w in windows if "batch_start" in w]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"plain": fit(callback=False), "measured": fit(callback=True)}
    finally:
        torch.set_num_threads(threads)


def test_a_compiled_step_is_measured_to_the_byte_at_every_phase(runs: dict[str, dict[str, Any]]) -> None:
    report = runs["measured"]["report"]
    oracle, raw = (training(runs["measured"][key])[-1] for key in ("oracle", "raw"))
    assert runs["measured"]["ours"] == []
    assert report.graph.compiled
    assert report.memory_source == "live-tensor tracker (cpu)"
    assert report.peak_phase == "after_backward" and report.peak_explanation.startswith("peak inside backward")
    base, base_oracle = report.phases["batch_start"].allocated_bytes, oracle["batch_start"][0]
    for before, phase in itertools.pairwise(PHASES):
        seen, start = report.phases[phase], report.phases[before].allocated_bytes
        assert seen.allocated_bytes - base == oracle[phase][0] - base_oracle == raw[phase][0] - base_oracle, phase
        # the optimizer step is eager: Adam hands an in-place operator a Python float, a 0-d double tensor (8 bytes)
        # while the call lasts, the operator's input and no operator's output, which the tracker never sees
        unseen = 8 if phase == "batch_end" else 0
        assert seen.window_peak_bytes - start + unseen == oracle[phase][1] - oracle[before][0], phase
    # the step's peak, against every block the CPU allocator handed out (blocks an operator frees inside itself too)
    raw_peak = max(raw[phase][1] for phase in PHASES[1:]) - base_oracle
    assert report.peak_bytes - base == raw_peak == raw["after_backward"][1] - base_oracle
    # by hand: the compiled forward saves Linear(8, 32)'s output and GELU's, 16 x 32 floats each; pow keeps the
    # 16 x 4 output and Lightning's closure its divisor; the loss and the closure's divided loss are 4 bytes each,
    # and zero_grad freed the last step's gradients
    saved = 2 * BATCH * HIDDEN * 4 + BATCH * OUT * 4 + CLOSURE_DIVISOR
    assert report.phases["before_backward"].tenants_bytes["activations"] == saved
    assert report.phases["before_backward"].allocated_bytes - base == saved + 4 + 4 - 4 * P


def test_measuring_compiles_the_same_graphs_and_leaves_nothing_behind(runs: dict[str, dict[str, Any]]) -> None:
    plain, measured = runs["plain"], runs["measured"]
    # the training graph, and the validation forward's under inference mode
    assert measured["graphs"] == plain["graphs"] == 2
    assert measured["losses"] == plain["losses"] and len(plain["losses"]) == 3
    assert measured["validated"] == plain["validated"] and len(plain["validated"]) == 3
    assert nothing_registered()
    guards = vars(torch._C._dynamo.guards)
    assert type(guards["_empty_strided_cpu"]).__name__ == "builtin_function_or_method"
    import torch._inductor.codecache as codecache

    bound = [vars(m).get("empty_strided_cpu") for m in codecache.PyCodeCache.modules]
    assert bound and all(function is guards["_empty_strided_cpu"] for function in bound)


def test_a_bare_tracker_sees_a_compiled_forward_and_backward_beside_a_patch_of_the_users() -> None:
    import torch._inductor.codecache as codecache

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))
    compiled = torch.compile(layers)
    x = torch.randn(BATCH, IN)
    compiled(x).sum().backward()  # compiled here, outside the tracker
    layers.zero_grad(set_to_none=True)
    # the user's own patch of every generated wrapper's allocator: it still runs, and it is what is left after
    calls: list[tuple[int, ...]] = []
    modules = [vars(m) for m in codecache.PyCodeCache.modules if "empty_strided_cpu" in vars(m)]
    original = modules[0]["empty_strided_cpu"]

    def users(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        calls.append(tuple(size))
        return original(size, stride, dtype)

    for namespace in modules:
        namespace["empty_strided_cpu"] = users
    tracker = LiveTensorTracker(scan=False)
    try:
        tracker.start([x, *layers.parameters()])
        base = tracker.current_bytes
        assert base == (BATCH * IN + P) * 4
        out = compiled(x)
        # the wrapper's three buffers: addmm's output, GELU's, the second addmm's
        assert tracker.current_bytes - base == tracker.peak_bytes - base == (2 * BATCH * HIDDEN + BATCH * OUT) * 4
        out.sum().backward()
        del out
        assert tracker.current_bytes - base == 4 * P  # the gradients alone
    finally:
        tracker.pause()
        assert all(namespace["empty_strided_cpu"] is users for namespace in modules)
        for namespace in modules:
            namespace["empty_strided_cpu"] = original
    assert calls[:3] == [(BATCH, HIDDEN), (BATCH, HIDDEN), (BATCH, OUT)]


def test_a_compiled_validation_batch_is_measured_to_the_byte(runs: dict[str, dict[str, Any]]) -> None:
    """The last validation batch's peak over its start, against the profiler's blocks in the same window."""
    report = runs["measured"]["validation"]
    (last_oracle, last_raw) = (
        [w for w in runs["measured"][key] if "validation_end" in w][-1] for key in ("oracle", "raw")
    )
    assert report is not None and report.stage == "validate" and report.batch_index == 2
    start = report.phases["batch_start"].allocated_bytes
    begin = last_raw["validation_start"][0]
    assert (
        report.peak_bytes - start == last_raw["validation_end"][1] - begin == last_oracle["validation_end"][1] - begin
    )
    # nothing outlives the step: validation_step appends bytes, no tensor
    assert report.phases["batch_end"].allocated_bytes == start
    assert last_raw["validation_end"][0] == begin
    assert report.tenants_bytes["activations"] == report.tenants_bytes["gradients"] == 0
    assert report.tenants_bytes["weights"] == 4 * P
