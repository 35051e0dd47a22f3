"""No BaseException raised inside our callbacks, finalizers or hooks is ever swallowed (issue 28, item 5).

Python swallows what a weak reference's callback raises ("Exception ignored in ..."), and a Ctrl+C that arrives
while a C operator runs is raised at the first Python instruction after it: often the entry of the callback of a
storage that operator freed. The tracker's callbacks therefore run no Python code; its bookkeeping of the freed
storages runs at the next operator (or read), and what a ``BaseException`` raised there is raised once the
operator's outputs are counted, or at the callback's next hook.

Run as a script, the file runs the Ctrl+C trials of a real fit: ``python tests/test_interrupts.py [trials]``.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import gc
import operator
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_memtenants.core import tracker as tracker_module
from lightning_memtenants.core.tracker import LiveTensorTracker, raise_pending

F32 = 4
TRIALS = 40


@pytest.fixture
def unraisable(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What Python would print as "Exception ignored in ...": recorded instead, and asserted empty."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


class RaisingRecorder:
    """A timeline recorder whose ``free`` raises ``error`` once."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error
        self.freed: list[int] = []
        self.ops = 0

    def begin_op(self, func: Any) -> None:
        self.ops += 1

    def alloc(self, key: int, nbytes: int) -> None:
        pass

    def free(self, key: int) -> None:
        self.freed.append(key)
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def test_every_weak_reference_callback_of_the_tracker_runs_no_python_code() -> None:
    """The callbacks are partials of C methods: no Python frame, so no Ctrl+C can land inside one."""
    with LiveTensorTracker(scan=False) as tracker:
        a = torch.ones(10)
        b = torch.ones(3)
        tracker.add(b)
        tracker.host(a)
        refs = [ref for ref, _ in tracker._storages.values()] + list(tracker._host.values())
    assert len(refs) == 2 + 1  # a's and b's storages; a's host mark
    for ref in refs:
        callback = ref.__callback__
        assert isinstance(callback, functools.partial)
        assert type(callback.func).__name__ in ("method-wrapper", "builtin_function_or_method"), callback.func
    del a, b


def test_a_ctrl_c_that_arrives_as_a_tracked_storage_is_freed_reaches_the_caller(unraisable: list[Any]) -> None:
    """The signal is noted while C code runs, then a tracked storage is freed before any Python instruction: where the
    callback was Python, its first instruction took the KeyboardInterrupt, and Python swallowed it."""
    with LiveTensorTracker(scan=False) as tracker:
        holder = {"x": torch.ones(1000), "y": torch.ones(24)}
        kept = holder.pop("y")
        with pytest.raises(KeyboardInterrupt):
            # all in C: the interrupt is noted (as a signal's handler notes it), then the storage is freed
            list(map(operator.call, [_thread.interrupt_main, holder.clear]))
            pytest.fail("the KeyboardInterrupt was lost")  # pragma: no cover
        assert tracker.current_bytes == 24 * F32  # the freed storage is off the figures
        assert len(tracker._storages) == 1
    assert unraisable == []
    del kept


def test_a_ctrl_c_as_a_host_marked_storage_is_freed_reaches_the_caller(unraisable: list[Any]) -> None:
    tracker = LiveTensorTracker(scan=False)
    holder = {"x": torch.ones(100)}
    tracker.host(holder["x"])
    with pytest.raises(KeyboardInterrupt):
        list(map(operator.call, [_thread.interrupt_main, holder.clear]))
        pytest.fail("the KeyboardInterrupt was lost")  # pragma: no cover
    assert tracker._host == {}
    assert unraisable == []


def test_an_interrupt_raised_in_the_bookkeeping_of_a_free_reaches_the_caller_at_the_next_operator(
    unraisable: list[Any],
) -> None:
    recorder = RaisingRecorder(KeyboardInterrupt())
    with LiveTensorTracker(scan=False) as tracker:
        kept = torch.ones(1000)
        doomed = torch.ones(500)
        tracker.recorder = recorder
        key = id(doomed.untyped_storage())
        del doomed  # the free is only noted: nothing of ours runs here
        assert recorder.freed == []
        with pytest.raises(KeyboardInterrupt) as raised:
            torch.zeros(250)  # the next operator runs, its output is counted, then the interrupt goes on
        assert recorder.freed == [key]
        # the figures are whole: the freed storage is off, the operator's output (alive in the traceback) is on
        assert tracker.current_bytes == (1000 + 250) * F32
        assert tracker.peak_bytes == (1000 + 500) * F32
        assert tracker.error is None
        del raised
        gc.collect()  # the traceback's frames and the exception hold each other
        assert tracker.current_bytes == 1000 * F32  # the output was freed with the traceback
        later = torch.ones(10)  # the tracker goes on counting, and nothing is pending any more
        assert tracker.current_bytes == 1010 * F32
        tracker.recorder = None
    assert unraisable == []
    del kept, later


def test_an_error_in_the_bookkeeping_of_a_free_is_the_trackers_error_not_the_users(unraisable: list[Any]) -> None:
    recorder = RaisingRecorder(RuntimeError("the recorder broke"))
    with LiveTensorTracker(scan=False) as tracker:
        doomed = torch.ones(500)
        tracker.recorder = recorder
        del doomed
        out = torch.zeros(250)  # the user's operator does not fail
        assert out.shape == (250,)
        assert isinstance(tracker.error, RuntimeError) and "the recorder broke" in str(tracker.error)
        # the free is off the figures; from then on the tracker only passes operators through, as after any
        # failure inside an operator (the memory source then refuses to read it)
        assert tracker.current_bytes == 0
        tracker.recorder = None
    assert unraisable == []
    del out


def test_an_interrupt_kept_outside_an_operator_is_raised_by_the_next_operator_or_raise_pending() -> None:
    recorder = RaisingRecorder(KeyboardInterrupt())
    with LiveTensorTracker(scan=False) as tracker:
        doomed = torch.ones(500)
        tracker.recorder = recorder
        del doomed
        assert tracker.read() == (0, 500 * F32)  # a read takes the free off, and keeps the interrupt for later
        with pytest.raises(KeyboardInterrupt):
            torch.zeros(3)
        tracker.recorder = None
    recorder.error = SystemExit(3)
    with LiveTensorTracker(scan=False) as tracker:
        doomed = torch.ones(5)
        tracker.recorder = recorder
        del doomed
        tracker.read()
        tracker.recorder = None
    with pytest.raises(SystemExit) as raised:
        raise_pending()
    assert raised.value.code == 3
    raise_pending()  # raised once: nothing is pending any more


def test_the_callbacks_next_hook_raises_an_interrupt_kept_for_it() -> None:
    from lightning_memtenants import MemoryTenantsCallback

    callback = MemoryTenantsCallback(print_summary=False)
    tracker_module._keep_pending(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        callback.on_after_backward(None, None)  # type: ignore[arg-type]
    callback.on_after_backward(None, None)  # type: ignore[arg-type]  # raised once


def test_the_weak_reference_of_a_storage_freed_and_its_key_reused_is_not_confused() -> None:
    """A storage freed, and a new one at the same address, before the next operator: the new one is counted."""
    with LiveTensorTracker(scan=False) as tracker:
        for _ in range(200):
            a = torch.ones(100)
            del a
        assert tracker.current_bytes == 0
        assert tracker._storages == {} and tracker._dead == {}
        b = torch.ones(100)
        assert tracker.current_bytes == 100 * F32
        assert isinstance(tracker._storages[id(b.untyped_storage())][0], weakref.ref)
    del b


@pytest.mark.slow
def test_ctrl_c_stops_a_fit_tracked_every_step_in_every_trial() -> None:
    """A SIGINT at a random moment of a fit with ``track_every_step=True`` stops it, in every one of 40 trials."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__)), str(TRIALS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout.strip())
    assert f"stopped early: {TRIALS} of {TRIALS}" in done.stdout, done.stdout + done.stderr[-4000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-4000:]


def _trials(count: int, max_steps: int = 3000, seed: int = 0) -> int:
    """Fits, each sent a SIGINT at a random moment after training starts; the number that stopped early."""
    import logging
    import random
    import signal
    import threading
    import warnings

    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memtenants import MemoryTenantsCallback

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Alarm(pl.Callback):
        """Sends SIGINT to the process a random time after training starts, from another thread."""

        def __init__(self, delay: float) -> None:
            self.timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.timer.start()

    rng = random.Random(seed)
    data = TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
    stopped = 0
    for _ in range(count):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning leaves it ignored after a Ctrl+C
        alarm = Alarm(rng.uniform(0.01, 0.3))
        trainer = pl.Trainer(
            max_steps=max_steps,
            max_epochs=-1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[MemoryTenantsCallback(track_every_step=True, print_summary=False), alarm],
        )
        try:
            # Lightning's graceful shutdown after a KeyboardInterrupt ends in sys.exit(1); one that landed outside
            # Lightning's handling still stopped the fit
            with contextlib.suppress(SystemExit, KeyboardInterrupt):
                trainer.fit(Model(), DataLoader(data, batch_size=8, shuffle=True))
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            alarm.timer.cancel()
            alarm.timer.join()
        stopped += trainer.interrupted or trainer.global_step < max_steps
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return stopped


if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else TRIALS
    print(f"stopped early: {_trials(trials)} of {trials}")
