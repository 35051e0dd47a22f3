"""Fit-time overhead of MemoryTenantsCallback, every arm measured side by side in one process (issue #19).

Arms, each fitted with a fresh Trainer and a fresh module, both built outside the clock:

- ``none``: no callback, the baseline;
- ``default``: ``MemoryTenantsCallback(print_summary=False)`` (tenants every step, the live-tensor tracker
  on the first step and the steps Lightning logs), with a stopwatch around each of its Lightning hooks;
- ``every step``: ``MemoryTenantsCallback(track_every_step=True, print_summary=False)``;
- ``null dispatch mode``: a callback that enters a ``TorchDispatchMode`` doing nothing but calling the
  operator at ``on_train_batch_start`` and leaves it at ``on_train_batch_end``, every step: the floor any
  tracker built on a dispatch mode pays;
- with ``--compare`` (the default; ``--no-compare`` skips them): PyTorch's ``MemTracker``, ``torch.profiler``
  with ``profile_memory``, ``record_shapes`` and ``with_stack``, and Lightning's ``DeviceStatsMonitor``;
- with ``--every-step`` (the default; ``--no-every-step`` skips it), a separate pair on its own model
  (``--every-step-model``, ``micro`` by default) and length (``--every-step-steps``, 2,000 by default): a
  ``TensorBoardLogger`` with ``log_every_n_steps=1``, the callback with its defaults against the same fit without
  it. Beside the ratios it prints the share of the fit's wall time spent drawing the desk and timeline pictures,
  how many were drawn and left out, and the bytes of event files each fit wrote.

Each arm first fits once for 2 steps untimed (warm-up). Then every repeat fits each arm once, in ABBA order:
the arm list forward on even repeats, reversed on odd ones. Around ``trainer.fit`` alone the script reads both
``time.process_time()`` (CPU time of the process, all threads) and ``time.perf_counter()`` (wall time).

Per arm it reports:

- CPU ratio: the arm's fastest CPU time over the repeats divided by the fastest CPU time of ``none``;
- CPU paired: the median over repeats of the arm's CPU time divided by the CPU time of ``none`` in the same
  repeat (steadier where one fast run of ``none`` would set every fastest-of ratio);
- wall ratio: the median over repeats of the arm's wall time divided by the wall time of ``none`` in the
  same repeat;
- extra per step: (fastest CPU time of the arm - fastest CPU time of ``none``) / steps, in milliseconds;
- for ``default``, the median share of the fit's wall time spent inside the callback's own Lightning hooks
  (its forward hooks, optimizer hooks and the tracker's per-operator cost on measured steps are not in it).

Models (``--models``, a comma list, or ``none`` for the log-every-step pair alone): ``tiny`` (a transformer
encoder LM, 2 layers of width 128, 4 heads, batch 16 x 64 tokens), ``tiny3`` (3 layers of width 96, 4 heads,
batch 8 x 32 tokens), both by default; ``seed`` (the seed MLP of examples/seed_mlp.py, batch 256), ``small``
(4 layers of width 256, 8 heads, batch 16 x 128 tokens) and ``micro`` (an MLP of 3 layers of width 64, batch 32:
steps of well under a millisecond) on request.

Run: ``python benchmarks/overhead.py [--models tiny,tiny3] [--steps 120] [--repeats 6] [--threads 1]
[--log-every 50] [--no-compare] [--every-step-steps 2000] [--no-every-step] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from seed_mlp import SeedMLP, seed_loader

from lightning_memtenants import MemoryTenantsCallback

WARMUP_STEPS = 2


class TinyTransformer(L.LightningModule):
    """A small transformer encoder language model: many small operators per step."""

    def __init__(self, vocab: int = 1000, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.head(self.encoder(self.embed(tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


class Tiny3Transformer(TinyTransformer):
    """A tinier transformer: 3 layers of width 96 with 4 heads, fed 8 x 32 tokens; the operators are cheaper still."""

    def __init__(self) -> None:
        super().__init__(width=96, layers=3, heads=4)


class SmallTransformer(TinyTransformer):
    """A small transformer: 4 layers of width 256 over 128 tokens."""

    def __init__(self) -> None:
        super().__init__(width=256, layers=4, heads=8)


class MicroMLP(L.LightningModule):
    """An MLP of 3 layers of width 64 on batches of 32: a step of well under a millisecond, where logging dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def micro_loader(steps: int, batch_size: int = 32) -> DataLoader:
    """``steps`` batches of ``batch_size`` samples of 64 features and a target."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch_size, 64, generator=generator)
    return DataLoader(TensorDataset(x, torch.randn(steps * batch_size, 1, generator=generator)), batch_size=batch_size)


def transformer_loader(steps: int, batch_size: int = 16, seq_len: int = 65) -> DataLoader:
    """``steps`` batches of ``batch_size`` sequences of ``seq_len`` tokens (inputs are ``seq_len - 1`` long)."""
    tokens = torch.randint(0, 1000, (steps * batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=batch_size)


@dataclass(frozen=True)
class Model:
    """A model of the benchmark: its title, how to build its module, and its loader for a number of steps."""

    title: str
    make_module: Callable[[], L.LightningModule]
    make_loader: Callable[[int], DataLoader]


MODELS: dict[str, Model] = {
    "tiny": Model(
        "tiny transformer, 2 layers x 128, batch 16 x 64 tokens",
        TinyTransformer,
        lambda steps: transformer_loader(steps, batch_size=16, seq_len=65),
    ),
    "tiny3": Model(
        "tiny3 transformer, 3 layers x 96, batch 8 x 32 tokens",
        Tiny3Transformer,
        lambda steps: transformer_loader(steps, batch_size=8, seq_len=33),
    ),
    "seed": Model("seed MLP, batch 256", SeedMLP, lambda steps: seed_loader(256, steps)),
    "small": Model(
        "small transformer, 4 layers x 256, batch 16 x 128 tokens",
        SmallTransformer,
        lambda steps: transformer_loader(steps, batch_size=16, seq_len=129),
    ),
    "micro": Model("micro MLP, 3 layers x 64, batch 32", MicroMLP, micro_loader),
}


class TimedCallback(MemoryTenantsCallback):
    """The callback with a stopwatch around each of its Lightning hooks: its own cost, free of machine noise."""

    spent = 0.0
    depth = 0


def _timed(name: str) -> Callable[..., object]:
    hook = getattr(MemoryTenantsCallback, name)

    def timed(self: TimedCallback, *args: object, **kwargs: object) -> object:
        TimedCallback.depth += 1
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            TimedCallback.depth -= 1
            if TimedCallback.depth == 0:  # a hook calling another hook is counted once
                TimedCallback.spent += time.perf_counter() - start

    return timed


def _overridden_hooks() -> list[str]:
    """The Lightning hooks MemoryTenantsCallback overrides, read from the class so the list stays current."""
    names = [n for n in vars(L.Callback) if n.startswith("on_") or n in ("setup", "teardown")]
    return [n for n in names if getattr(MemoryTenantsCallback, n) is not getattr(L.Callback, n)]


for _hook in _overridden_hooks():
    setattr(TimedCallback, _hook, _timed(_hook))


class NullLogger(Logger):
    """Takes every metric and keeps none: the same cheap logger for every arm."""

    @property
    def name(self) -> str:
        return "null"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: object, **kwargs: object) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


class NullMode(TorchDispatchMode):
    """A dispatch mode that only calls each operator: what entering any dispatch mode costs per operator."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*args, **(kwargs or {}))


class NullDispatchArm(L.Callback):
    """Enters :class:`NullMode` at each batch's start and leaves it at the batch's end, every step."""

    def __init__(self) -> None:
        self.mode: NullMode | None = None

    def on_train_batch_start(self, *args: object) -> None:
        self.mode = NullMode()
        self.mode.__enter__()

    def on_train_batch_end(self, *args: object) -> None:
        self._leave()

    def on_exception(self, *args: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)


class MemTrackerArm(L.Callback):
    """PyTorch's MemTracker inside Lightning: enter at train start, reset per batch, exit at the end."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker = MemTracker()
        self.tracker.track_external(pl_module, *trainer.optimizers)
        self.tracker.__enter__()

    def on_train_batch_start(self, *args: object) -> None:
        self.tracker.reset_mod_stats()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.tracker.__exit__(None, None, None)


class ProfilerArm(L.Callback):
    """torch.profiler with profile_memory, record_shapes and with_stack: what its memory timeline needs."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
        )
        self.profiler.__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profiler.__exit__(None, None, None)


ARMS: dict[str, Callable[[], list[L.Callback]]] = {
    "none": lambda: [],
    "default": lambda: [TimedCallback(print_summary=False)],
    "every step": lambda: [MemoryTenantsCallback(track_every_step=True, print_summary=False)],
    "null dispatch mode": lambda: [NullDispatchArm()],
}
COMPARED: dict[str, Callable[[], list[L.Callback]]] = {
    "PyTorch MemTracker": lambda: [MemTrackerArm()],
    "profiler, profile_memory": lambda: [ProfilerArm()],
    "DeviceStatsMonitor": lambda: [DeviceStatsMonitor()],
}


@dataclass
class ArmTimes:
    """One arm's raw times on one model, in seconds, a value per repeat."""

    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    hook_share: list[float] = field(default_factory=list)


def fit_seconds(
    model: Model, loader: DataLoader, callbacks: list[L.Callback], steps: int, log_every: int
) -> tuple[float, float]:
    """CPU and wall time of ``trainer.fit`` alone: the Trainer and the module are built outside the clock."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        logger=NullLogger(),
        log_every_n_steps=log_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = model.make_module()
    gc.collect()
    TimedCallback.spent, TimedCallback.depth = 0.0, 0
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.fit(module, loader)
    return time.process_time() - cpu, time.perf_counter() - wall


def measure(model: Model, arms: dict[str, Callable[[], list[L.Callback]]], args: argparse.Namespace) -> dict[str, Any]:
    """Fit every arm on one model, print its table, and return the raw times and ratios."""
    loader = model.make_loader(args.steps)
    names = list(arms)
    for name in names:  # warm-up: imports, allocator, thread pools, each arm's first-use costs
        fit_seconds(model, loader, arms[name](), WARMUP_STEPS, args.log_every)
    times = {name: ArmTimes() for name in names}
    orders: list[list[str]] = []
    for repeat in range(args.repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        orders.append(order)
        for name in order:
            cpu, wall = fit_seconds(model, loader, arms[name](), args.steps, args.log_every)
            times[name].cpu.append(cpu)
            times[name].wall.append(wall)
            if name == "default":
                times[name].hook_share.append(TimedCallback.spent / wall)

    base = times["none"]
    base_cpu = min(base.cpu)
    results: dict[str, Any] = {}
    for name in names:
        arm = times[name]
        wall_ratios = [w / b for w, b in zip(arm.wall, base.wall, strict=True)]
        cpu_ratios = [c / b for c, b in zip(arm.cpu, base.cpu, strict=True)]
        results[name] = {
            "cpu_s": arm.cpu,
            "wall_s": arm.wall,
            "cpu_ratio": min(arm.cpu) / base_cpu,
            "cpu_ratio_paired": statistics.median(cpu_ratios),
            "cpu_ratios": cpu_ratios,
            "wall_ratio": statistics.median(wall_ratios),
            "wall_ratios": wall_ratios,
            "extra_ms_per_step": 1000 * (min(arm.cpu) - base_cpu) / args.steps,
        }
        if arm.hook_share:
            results[name]["hook_share"] = arm.hook_share
            results[name]["hook_share_median"] = statistics.median(arm.hook_share)

    print(
        f"\n{model.title}: {args.steps} steps, {args.repeats} repeats (ABBA),"
        f" fastest CPU time of 'none' {base_cpu:.3f} s ({1000 * base_cpu / args.steps:.2f} ms/step),"
        f" median wall {statistics.median(base.wall):.3f} s"
    )
    width = max(len(n) for n in names)
    print(
        f"  {'arm':<{width}}  {'CPU ratio':>9}  {'CPU paired':>10}  {'wall ratio':>10}  {'extra ms/step':>13}"
        "  wall ratio per repeat"
    )
    for name in names:
        r = results[name]
        per_repeat = ", ".join(f"{x:.3f}" for x in r["wall_ratios"])
        print(
            f"  {name:<{width}}  {r['cpu_ratio']:>9.3f}  {r['cpu_ratio_paired']:>10.3f}  {r['wall_ratio']:>10.3f}"
            f"  {r['extra_ms_per_step']:>13.3f}  {per_repeat}"
        )
    if "default" in results:
        r = results["default"]
        print(
            f"  default: {r['extra_ms_per_step']:.3f} ms extra CPU per step; median share of fit time inside"
            f" its own Lightning hooks {r['hook_share_median']:.4f} (the tracker's per-operator cost, forward"
            " and optimizer hooks are outside it)"
        )
    return {"title": model.title, "orders": orders, "arms": results}


class PanelsSpy(MemoryTenantsCallback):
    """The callback with its defaults; notes what its TensorBoard panels spent drawing before the fit lets them go."""

    drawing_s = 0.0
    pictures = 0
    skipped = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        panels = self._logs.panels
        PanelsSpy.drawing_s = panels.drawing_s if panels is not None else 0.0
        PanelsSpy.pictures = panels.pictures if panels is not None else 0
        PanelsSpy.skipped = panels.skipped if panels is not None else 0


def tensorboard_fit(model: Model, loader: DataLoader, callback: bool, steps: int) -> dict[str, float]:
    """One fit with a TensorBoardLogger logging every step, with or without the callback (its defaults).

    Returns:
        CPU and wall seconds of ``trainer.fit``, the seconds the panels spent drawing, the pictures drawn during the
        fit and left out, and the bytes of the event files written.
    """
    L.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as directory:
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=steps,
            callbacks=[PanelsSpy()] if callback else [],
            logger=TensorBoardLogger(directory, name="bench"),
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        module = model.make_module()
        gc.collect()
        PanelsSpy.drawing_s, PanelsSpy.pictures, PanelsSpy.skipped = 0.0, 0, 0
        cpu, wall = time.process_time(), time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the summary the callback prints at the end, kept quiet
            trainer.fit(module, loader)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        events = sum(path.stat().st_size for path in Path(directory).rglob("events.out.tfevents.*"))
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "drawing_s": PanelsSpy.drawing_s,
        "pictures": PanelsSpy.pictures,
        "skipped": PanelsSpy.skipped,
        "events_bytes": events,
    }


def measure_every_step_logging(model: Model, args: argparse.Namespace) -> dict[str, Any]:
    """The log-every-step pair: a TensorBoardLogger, ``log_every_n_steps=1``, with and without the callback."""
    steps = args.every_step_steps
    loader = model.make_loader(steps)
    names = {"tensorboard, no callback": False, "tensorboard, callback": True}
    for callback in names.values():  # warm-up
        tensorboard_fit(model, loader, callback, WARMUP_STEPS)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in list(names) if repeat % 2 == 0 else list(names)[::-1]:
            runs[name].append(tensorboard_fit(model, loader, names[name], steps))
    base, arm = runs["tensorboard, no callback"], runs["tensorboard, callback"]
    cpu_ratios = [a["cpu_s"] / b["cpu_s"] for a, b in zip(arm, base, strict=True)]
    shares = [a["drawing_s"] / a["wall_s"] for a in arm]
    result = {
        "title": model.title,
        "steps": steps,
        "runs": runs,
        "cpu_ratio": min(a["cpu_s"] for a in arm) / min(b["cpu_s"] for b in base),
        "cpu_ratio_paired": statistics.median(cpu_ratios),
        "cpu_ratios": cpu_ratios,
        "wall_ratio": statistics.median(a["wall_s"] / b["wall_s"] for a, b in zip(arm, base, strict=True)),
        "drawing_share_median": statistics.median(shares),
        "events_bytes": {name: statistics.median(r["events_bytes"] for r in runs[name]) for name in names},
    }
    print(
        f"\nlog every step, {model.title}: a TensorBoardLogger, log_every_n_steps=1, {steps} steps,"
        f" {args.repeats} repeats (ABBA); fastest CPU time without the callback {min(b['cpu_s'] for b in base):.3f} s"
        f" ({1000 * min(b['cpu_s'] for b in base) / steps:.2f} ms/step)"
    )
    print(
        f"  callback (defaults) against none: CPU ratio {result['cpu_ratio']:.3f} (fastest of each),"
        f" CPU paired {result['cpu_ratio_paired']:.3f}, wall ratio {result['wall_ratio']:.3f}"
    )
    last = arm[-1]
    print(
        f"  drawing the pictures: median share of the fit's wall time {result['drawing_share_median']:.4f}"
        f" ({last['drawing_s']:.2f} s of {last['wall_s']:.2f} s in the last repeat; {last['pictures']} in-fit"
        f" pictures drawn, {last['skipped']} left out by the budget, plus the end of fit's)"
    )
    print(
        "  event files written: " + ", ".join(f"{name} {int(b):,} bytes" for name, b in result["events_bytes"].items())
    )
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--models", default="tiny,tiny3", help=f"comma list of {', '.join(MODELS)}; none: the log-every-step pair only"
    )
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per timed fit")
    parser.add_argument("--repeats", type=int, default=6, help="timed fits per arm, in ABBA order")
    parser.add_argument("--log-every", type=int, default=50, help="the Trainer's log_every_n_steps")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add MemTracker, the profiler and DeviceStatsMonitor",
    )
    parser.add_argument(
        "--every-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add the log-every-step pair: a TensorBoardLogger, log_every_n_steps=1, with and without the callback",
    )
    parser.add_argument(
        "--every-step-model", default="micro", help=f"the log-every-step pair's model: one of {', '.join(MODELS)}"
    )
    parser.add_argument("--every-step-steps", type=int, default=2000, help="optimizer steps of the log-every-step fits")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write raw times and ratios here")
    args = parser.parse_args()
    args.model_names = [m.strip() for m in args.models.split(",") if m.strip() and m.strip() != "none"]
    unknown = [m for m in args.model_names if m not in MODELS]
    if unknown or not (args.model_names or args.every_step):
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    if args.every_step_model not in MODELS:
        parser.error(f"--every-step-model must be one of {', '.join(MODELS)}, got {args.every_step_model!r}")
    if args.steps < 1 or args.repeats < 1 or args.log_every < 1 or args.every_step_steps < 1:
        parser.error("--steps, --repeats, --log-every and --every-step-steps must be positive")
    return args


def main() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    arms = dict(ARMS)
    if args.compare:
        arms.update(COMPARED)
    print(
        f"torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads,"
        f" {args.steps} steps, {args.repeats} repeats, log_every_n_steps {args.log_every}"
    )
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "lightning": L.__version__,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "repeats": args.repeats,
        "log_every_n_steps": args.log_every,
        "warmup_steps": WARMUP_STEPS,
        "models": {},
    }
    for name in args.model_names:
        report["models"][name] = measure(MODELS[name], arms, args)
    if args.every_step:
        report["every_step_logging"] = measure_every_step_logging(MODELS[args.every_step_model], args)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nraw times and ratios: {args.json}")


if __name__ == "__main__":
    main()
