from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

# The article's reference model: P = 25,175,040 parameters.
SEED_P = 25_175_040
SEED_WEIGHTS = 4 * SEED_P  # 100,700,160
SEED_SAVED_PER_SAMPLE = (4096 + 4096 + 1024) * 4  # relu1, relu2 outputs and the final output (for pow)
# Lightning's closure divides the loss by the accumulation factor, a Python int: autograd keeps that divisor
# for backward as a 0-d int64 tensor, 8 bytes, in every automatically optimized step.
CLOSURE_DIVISOR = 8


_CUDA_FUNCTIONS = ("is_available", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")


@pytest.fixture
def _torch_cuda_restored() -> Any:
    """``torch.cuda``'s functions, which the simulated device and the tests' fake counters patch, are torch's own
    again after each test. Set up before ``monkeypatch`` (the fixture below asks for this one first), it checks
    after every patch of the test's has been undone."""
    cuda = {name: getattr(torch.cuda, name) for name in _CUDA_FUNCTIONS}
    yield
    left = [name for name, function in cuda.items() if getattr(torch.cuda, name) is not function]
    for name in left:
        setattr(torch.cuda, name, cuda[name])
    if left:
        pytest.fail(f"the test left torch.cuda.{', torch.cuda.'.join(left)} patched (undone for the tests after it)")


@pytest.fixture(autouse=True)
def _each_test_leaves_the_process_as_it_found_it(_torch_cuda_restored: None, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Keep tests independent of their order: what one test leaves behind is undone, and the test fails for it.

    ``L.seed_everything`` sets ``PL_GLOBAL_SEED``, which Lightning's DDP setup reads to reseed later fits: it
    stays inside the test that set it. A dispatch mode, a saved-tensor hook or the ``resize_`` patch left by a
    test that failed half-way would change what every later test measures; the default dtype, the thread
    count, garbage collection and the working directory are put back too.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    dtype, threads, cwd = torch.get_default_dtype(), torch.get_num_threads(), os.getcwd()
    yield
    left = []
    for _ in range(16):
        mode = _get_current_dispatch_mode()
        if mode is None:
            break
        left.append(f"dispatch mode {type(mode).__name__}")
        mode.__exit__(None, None, None)
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        left.append("saved-tensor hooks")
        torch._C._autograd._pop_saved_tensors_default_hooks()
    if "resize_" in torch.UntypedStorage.__dict__:
        left.append("UntypedStorage.resize_ patch")
        del torch.UntypedStorage.resize_
    if torch.get_default_dtype() != dtype:
        left.append(f"default dtype {torch.get_default_dtype()}")
        torch.set_default_dtype(dtype)
    if torch.get_num_threads() != threads:
        left.append(f"{torch.get_num_threads()} threads")
        torch.set_num_threads(threads)
    if not gc.isenabled():
        left.append("garbage collection disabled")
        gc.enable()
    if os.getcwd() != cwd:
        left.append(f"working directory {os.getcwd()}")
        os.chdir(cwd)
    if left:
        pytest.fail(f"the test left {', '.join(left)} behind (undone for the tests after it)")


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker (``make test`` runs one per core of CI's two) computes on one torch thread: two workers
    of two intra-op threads each would oversubscribe the cores. ``OMP_NUM_THREADS`` says so to Lightning, whose DDP
    launcher would otherwise set the thread count back to the cores' (and the fixture above would fail the test for
    it), and to the scripts the worker's tests run in fresh processes. Memory is counted the same at any thread count.
    """
    if hasattr(config, "workerinput"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


import lightning as L  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402


def recording_logger_class(base: type) -> type:
    """A logger on ``base`` (``lightning.pytorch``'s or ``pytorch_lightning``'s ``Logger``) that keeps every metric."""

    class Recording(base):  # type: ignore[misc,valid-type]
        """Keeps every logged metric in memory, to check what the callback sends to any logger."""

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.logged.append((step, dict(metrics)))

    return Recording


RecordingLogger = recording_logger_class(Logger)
RecordingLogger.__name__ = RecordingLogger.__qualname__ = "RecordingLogger"  # picklable by name, as before


def make_trainer(callbacks: list[L.Callback], steps: int = 2, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": steps,
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **options)


def nothing_registered() -> bool:
    """No saved-tensor hook, no dispatch mode and no ``UntypedStorage.resize_`` patch of ours is left."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is None and _get_current_dispatch_mode() is None and "resize_" not in torch.UntypedStorage.__dict__


@contextmanager
def no_collection() -> Iterator[None]:
    """No garbage collection inside: a tracker that scanned counts every live CPU tensor, and garbage that earlier
    tests left in reference cycles, freed by a collection in the middle of a measured step, would lower the readings
    after it (and could move the step's peak to an earlier phase)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CollectedEachStep(L.Callback):
    """Collects garbage before each training step, ahead of the callbacks after it. Dynamo's tracers and their
    ``OutputGraph`` reference each other, and the graph's ``local_scope`` holds the traced frame's real tensors: after
    a compile, such a cycle keeps its inputs alive until a collection, and a tracker rightly counts them. When one comes
    depends on every allocation before it (pytest's log capture and a cold inductor cache moved it by a step in
    tests/test_compiled_breaks.py): a compiled fit's measured step, with this first, is the model's own."""

    def on_train_batch_start(self, *args: Any) -> None:
        gc.collect()


def fail_in_backward(tensor: torch.Tensor, error: BaseException) -> torch.Tensor:
    """``tensor`` unchanged, except that backward through it raises ``error``."""

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise error

    return Fail.apply(tensor)


def adam_that_fails(params: Any, should_fail: Any, error: BaseException) -> torch.optim.Optimizer:
    """Adam whose step raises ``error`` after Lightning's closure (forward and backward) ran."""

    class Adam(torch.optim.Adam):
        def step(self, closure: Any = None) -> Any:
            loss = closure() if closure is not None else None
            if should_fail():
                raise error
            super().step()
            return loss

    return Adam(params)


def plain_step(monitor: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    """One step of the article's loop (``model(x).pow(2).mean()``) with the monitor's five phases."""
    monitor.phase("batch_start", batch=x)
    loss = model(x).pow(2).mean()
    monitor.phase("before_backward", output=loss)
    loss.backward()
    monitor.phase("after_backward")
    monitor.phase("before_optimizer_step")
    optimizer.step()
    monitor.phase("batch_end")
    optimizer.zero_grad()
    return monitor.end_step(), loss.item()


def assert_equals_the_real_run(predicted: Any, real: dict[str, Any]) -> None:
    """A prediction against a real run's report (a JSON line of a check script): every tenant at every phase, the
    allocated bytes and window peaks, the named parts, the peak and its phase, and the expected fixed cost. The real
    run's tracker counts the training's tensors, as the prediction does: the data set is in neither."""
    from lightning_memtenants import PHASES

    report = real["report"]
    assert predicted.tenants_bytes == report["tenants_bytes"]
    for name in PHASES:
        phase, mine = report["phases"][name], predicted.phases[name]
        assert mine.tenants_bytes == phase["tenants_bytes"], name
        assert mine.allocated_bytes == phase["allocated_bytes"], name
        assert mine.window_peak_bytes == phase["window_peak_bytes"], name
        assert mine.parts_bytes == phase["parts_bytes"], name  # the autocast cache under bf16-mixed
    assert predicted.peak_bytes == report["peak_bytes"]
    assert predicted.peak_phase == report["peak_phase"]
    assert predicted.expected_fixed_bytes == report["expected_fixed_bytes"]


@pytest.fixture()
def cli(capsys: pytest.CaptureFixture[str]) -> Any:
    """The command in this process (a new one costs seconds of imports): returns code, stdout and stderr."""
    import subprocess

    from lightning_memtenants.cli import main

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's own errors
            code = int(exit.code or 0)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return run
