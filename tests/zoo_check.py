"""Run in a fresh process: each zoo configuration named on the command line through every entry point, as JSON.

For each configuration (``zoo_models``' names, every one without a name), one JSON line on stdout: per entry point
the figures it gave, or its failure in one line (the exception's type and first line), and its seconds. A failing
entry point never stops the others, nor the next configuration. The entry points:

- ``callback``: a real CPU fit of ``STEPS`` optimizer steps with ``MemoryTenantsCallback`` (the live-tensor
  tracker on every step), its first and latest reports; beside them, read from the trained module and its
  optimizer without the package, the bytes of the parameters and buffers, of the gradients and of the state;
- ``predict_cpu``: ``dry_run(..., steps=STEPS)``, a report per step;
- ``predict_gpu``: ``dry_run(..., target="A100")``, one step;
- ``cli``: ``memtenants predict tests/zoo_models.py:zoo_module --init '{"name": ...}'``, one step, in this
  process (``cli.main``), the JSON it wrote;
- ``advise``: ``advise`` with a budget of 90% of the predicted peak (no margin), then a real fit with its first fix
  applied (``trainer_kwargs``, ``batch_size``, ``apply``): the fix's predicted peak and the fit's measured one;
- ``ddp``, ``fsdp``: ``dry_run(..., strategy=..., world_size=2)``, every rank's report.

Run: ``python tests/zoo_check.py [--all] [NAME ...]``; ``--all`` runs ``advise`` on the models of ``SLOW_ADVICE``
too.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from torch import Tensor  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from zoo_models import BATCH, MOE, ZOO, Config, build, samples  # noqa: E402

from lightning_memtenants import MemoryTenantsCallback, advise, dry_run  # noqa: E402
from lightning_memtenants.cli import main as memtenants  # noqa: E402

STEPS = 2  # the first optimizer step, where the state is born, and a steady-state one
RANKS = 2
GPU = "A100"
BUDGET_FRACTION = 0.9  # advise's budget: this much of the predicted peak, no margin
ENTRY_POINTS = ("callback", "predict_cpu", "predict_gpu", "cli", "advise", "ddp", "fsdp")
# The models whose ``advise`` is the slowest (encoder-decoders and mixtures of experts: no single fix fits, so the
# combinations are measured too; 50 to 120 s of the zoo's 1,500 on a busy 2-core machine): skipped unless ``--all``
# is given, so that CI's zoo stays within its time; ``advise`` still runs on the 20 others.
SLOW_ADVICE = ("t5", "bart", "switch", "mixtral", "qwen2_moe", "distilbert")


def one_line(error: BaseException) -> str:
    """The exception's type and the first line of its message."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0].strip() if lines else ''}"[:300]


def summary(report: Any) -> dict[str, Any]:
    """What the zoo compares of a report: each tenant's high-water mark and at the step's end, the named parts, the
    peak and its phase."""
    return {
        "tenants": dict(report.tenants_bytes),
        "end": dict(report.phases["batch_end"].tenants_bytes),
        "parts": {k: int(v) for k, v in report.parts_bytes.items()},
        "peak": report.peak_bytes,
        "peak_phase": report.peak_phase,
    }


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No garbage collection during a measured fit: garbage freed in the middle of a step would lower it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def storage_bytes(tensors: Any) -> int:
    """The bytes of the distinct storages of ``tensors`` (real CPU tensors: a storage is its address)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class RouterCounts(TorchFunctionMode):
    """The choices per expert of every router call of a real fit, in call order, as a dry run counts router calls:
    each ``topk``, ``argmax`` or ``max`` along a dimension of a floating tensor (the router's logits or
    probabilities), its int64 indices counted per option of that dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[int]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name not in ("topk", "argmax", "max"):
            return out
        source = args[0] if args else kwargs.get("input")
        indices = out if isinstance(out, Tensor) else (out[1] if isinstance(out, tuple) and len(out) == 2 else None)
        position = 2 if name == "topk" else 1
        dim = args[position] if len(args) > position else kwargs.get("dim", -1 if name == "topk" else None)
        chosen = isinstance(indices, Tensor) and indices.dtype == torch.int64 and isinstance(dim, int)
        if chosen and isinstance(source, Tensor) and source.is_floating_point() and source.dim() > 0:
            experts = source.size(dim)
            self.calls.append(torch.bincount(indices.flatten(), minlength=experts).tolist())
        return out


def real_fit(
    config: Config,
    batch_size: int = BATCH,
    trainer_kwargs: dict[str, Any] | None = None,
    apply: Any = None,
    measured: bool = True,
) -> dict[str, Any]:
    """``STEPS`` optimizer steps of a real CPU fit, the tracker measuring every step; the trained module read after.

    Unmeasured (``measured=False``), the fit runs without the callback, under :class:`RouterCounts`: the same
    steps, whose router calls it returns.
    """
    L.seed_everything(0, verbose=False)
    module = build(config)
    if apply is not None:
        apply(module)
    kwargs = {**config.trainer_kwargs, "precision": config.precision, **(trainer_kwargs or {})}
    accumulate = kwargs.get("accumulate_grad_batches", 1)
    data = DataLoader(samples(module, batch_size * accumulate * STEPS), batch_size=batch_size)
    cb = MemoryTenantsCallback(memory_source="tracker", track_every_step=True, print_summary=False)
    trainer = L.Trainer(
        callbacks=[cb] if measured else [],
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    if not measured:
        with RouterCounts() as router:
            trainer.fit(module, data)
        return {"routing": router.calls}
    with no_collection():
        trainer.fit(module, data)
    if cb.first is None or cb.latest is None:
        raise RuntimeError("the callback measured no step")
    state = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    steps = [
        t for t in state if t.dim() == 0
    ]  # Adam's step counters: on the host under CUDA (neither fused nor capturable)
    return {
        "first": summary(cb.first),
        "latest": summary(cb.latest),
        "weights_bytes": storage_bytes([*module.parameters(), *module.buffers()]),
        "gradients_bytes": storage_bytes([p.grad for p in module.parameters() if p.grad is not None]),
        "optimizer_bytes": storage_bytes(state),
        "step_counter_bytes": storage_bytes(steps),
        "parameters": sum(p.numel() for p in module.parameters()),
    }


def predicted(config: Config, **options: Any) -> dict[str, Any]:
    module = build(config)
    prediction = dry_run(module, module.example_batch(BATCH), precision=config.precision, **options)
    out: dict[str, Any] = {"reports": [summary(r) for r in prediction.reports]}
    if options.get("strategy"):
        out["ranks"] = [summary(r) for r in prediction.ranks]
    return out


def command(config: Config, routing: list[list[int]] | None = None) -> dict[str, Any]:
    """``memtenants predict`` in this process, its table swallowed; its JSON read back."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        argv = [
            "predict",
            f"{HERE / 'zoo_models.py'}:zoo_module",
            "--init",
            json.dumps({"name": config.model}),
            "--batch-size",
            str(BATCH),
            "--precision",
            config.precision,
            "--json",
            str(path),
        ]
        if routing:
            argv += ["--routing", "counts:" + "/".join(",".join(str(c) for c in call) for call in routing)]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = memtenants(argv)
        if code != 0:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            # a failure of the step: the error's own line is the last unindented one, after the user's frames
            last = [line for line in lines if not line.startswith(" ")]
            line = (last[-1] if len(lines) > 1 else lines[0]) if lines else ""
            raise RuntimeError(f"exit {code}: {line.removeprefix('memtenants: error: ')}")
        report = json.loads(path.read_text())["report"]
    return {
        "tenants": report["tenants_bytes"],
        "end": report["phases"]["batch_end"]["tenants_bytes"],
        "parts": report.get("parts_bytes", {}),
        "peak": report["peak_bytes"],
        "peak_phase": report["peak_phase"],
    }


def advised(config: Config, baseline: int | None) -> dict[str, Any]:
    """``advise`` under a budget below the predicted peak, and a real fit with its first fix applied."""
    if baseline is None:
        raise RuntimeError("no baseline: neither the CPU prediction nor the real fit ran")
    budget = int(baseline * BUDGET_FRACTION)
    module = build(config)
    advice = advise(
        module,
        module.example_batch(BATCH),
        budget,
        margin=0.0,
        make_batch=module.example_batch,
        precision=config.precision,
    )
    if not advice.fixes:
        raise RuntimeError(f"advise found no fix ({'; '.join(advice.notes)})")
    fix = advice.fixes[0]
    real = real_fit(config, fix.batch_size or BATCH, fix.trainer_kwargs, fix.apply)
    return {
        "budget": budget,
        "baseline": advice.baseline_peak_bytes,
        "fix": fix.name,
        "fits": fix.fits,
        "fixes": len(advice.fixes),
        "predicted_peak": fix.peak_bytes,
        "real_peak": max(real["first"]["peak"], real["latest"]["peak"]),
    }


# -- the verdicts: what test_zoo.py asserts and benchmarks/zoo.py prints ------------------------------------------

TENANTS = ("weights", "gradients", "optimizer_state", "activations")
FIXED = ("weights", "gradients", "optimizer_state")


def signed(n: int) -> str:
    return f"{n:+,} B"


def differences(mine: dict[str, Any], truth: dict[str, Any], what: tuple[str, ...] = TENANTS) -> list[str]:
    """``tenant +N B`` for each tenant (and the peak) where ``mine`` differs from ``truth``, ``mine`` less ``truth``."""
    out = [
        f"{t} {signed(mine['tenants'][t] - truth['tenants'][t])}"
        for t in what
        if mine["tenants"][t] != truth["tenants"][t]
    ]
    if "peak" in mine and "peak" in truth and mine["peak"] != truth["peak"]:
        out.insert(0, f"peak {signed(mine['peak'] - truth['peak'])}")
    return out


def verdict(result: dict[str, Any], entry: str) -> tuple[str, str]:
    """One cell of the zoo: ``("exact" | "ok" | "diff" | "error" | "skipped", one line)``.

    ``exact``: equal to the byte where exactness is claimed (``predict`` for the CPU against the real fit, every
    tenant and the peak of both steps; the command against ``predict``; the fix's peak against the real fit with the
    fix); ``ok``: a sanity check passed (the callback's tenants are the module's own bytes; a GPU, DDP or FSDP
    prediction holds the weights, gradients and optimizer state it should); ``diff``: how far off, in bytes;
    ``error``: the exception's type and first line.
    """
    cells = result["cells"]
    cell = cells[entry]
    if "error" in cell:
        return "error", cell["error"]
    if "skipped" in cell:
        return "skipped", cell["skipped"]
    real, cpu = cells["callback"], cells["predict_cpu"]
    if entry == "callback":
        latest = real["latest"]
        truth = {
            "weights": real["weights_bytes"],
            "gradients": real["gradients_bytes"],
            "optimizer_state": real["optimizer_bytes"],
        }
        off = [f"{t} {signed(latest['tenants'][t] - truth[t])}" for t in FIXED if latest["tenants"][t] != truth[t]]
        if sum(truth.values()) > latest["peak"]:  # the steady step holds the state and the last gradients at its start
            off.append(f"peak {latest['peak']:,} B below weights + gradients + state")
        return ("diff", "; ".join(off)) if off else ("ok", f"peak {latest['peak']:,} B")
    if "error" in cpu and entry != "advise":
        return "error", f"(no CPU prediction to compare) {cpu['error']}"
    if entry == "predict_cpu":
        if "error" in real:
            return "error", f"(no real fit to compare) {real['error']}"
        steps = [differences(p, r) for p, r in zip(cpu["reports"], (real["first"], real["latest"]), strict=True)]
        if not any(steps):
            return "exact", f"peak {cpu['reports'][-1]['peak']:,} B"
        return "diff", "; ".join(f"step {i + 1}: {', '.join(d)}" for i, d in enumerate(steps) if d)
    first = cpu["reports"][0]
    if entry == "cli":
        off = differences(cell, first)
        return ("diff", ", ".join(off)) if off else ("exact", f"peak {cell['peak']:,} B")
    if entry == "predict_gpu":
        gpu = cell["reports"][0]
        off = differences(gpu, first, ("weights", "gradients"))
        off = [d for d in off if not d.startswith("peak")]
        host = real.get("step_counter_bytes", 0)  # Adam's step counters stay on the host on CUDA
        state = first["tenants"]["optimizer_state"] - gpu["tenants"]["optimizer_state"]
        if state not in (0, host):
            off.append(f"optimizer_state {signed(-state)} (the host's step counters are {host:,} B)")
        if gpu["peak"] < sum(gpu["tenants"][t] for t in FIXED):
            off.append("peak below weights + gradients + state")
        parts = ", ".join(f"{k} {v:,} B" for k, v in gpu["parts"].items())
        return ("diff", "; ".join(off)) if off else ("ok", f"peak {gpu['peak']:,} B ({parts})")
    if entry == "advise":
        off = cell["predicted_peak"] - cell["real_peak"]
        text = f"{cell['fix']}: {cell['predicted_peak']:,} B"
        if not cell["fits"]:
            return "diff", f"no fix fits the budget of {cell['budget']:,} B; {text}"
        return ("exact", text) if off == 0 else ("diff", f"{text}, predicted {signed(off)} against the real fit")
    ranks = cell["ranks"]
    if entry == "ddp":
        off = sorted({d for r in ranks for d in differences(r, first, FIXED) if not d.startswith("peak")})
        buckets = {r["parts"].get("ddp_buckets", 0) for r in ranks}
        if buckets != {first["tenants"]["gradients"]}:
            off.append(f"ddp_buckets {sorted(buckets)} B, not the gradients' {first['tenants']['gradients']:,} B")
        return ("diff", "; ".join(off)) if off else ("ok", f"rank 0 peak {ranks[0]['peak']:,} B")
    # fsdp: at the step's end (the gathered parameters freed) rank 0 holds about half the weights
    weights, held = first["end"]["weights"], ranks[0]["end"]["weights"]
    share = held / weights if weights else 0.0
    text = f"rank 0 holds {share:.1%} of the weights ({held:,} of {weights:,} B), peak {ranks[0]['peak']:,} B"
    return ("ok", text) if abs(share - 0.5) <= FSDP_TOLERANCE else ("diff", text)


# How far from half of the weights rank 0 of 2 may hold under FSDP: the padding of dimensions that do not split.
FSDP_TOLERANCE = 0.05


def timed(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one entry point: its figures, or its failure in one line; its seconds either way."""
    began = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = run()
    except Exception as error:  # a cell's failure is its result; the next cell runs
        out = {"error": one_line(error)}
    out["seconds"] = round(time.perf_counter() - began, 2)
    return out


def run(config: Config, everything: bool = False) -> dict[str, Any]:
    """Every entry point on ``config``; ``advise`` on a model of ``SLOW_ADVICE`` only with ``everything``."""
    cells: dict[str, Any] = {}
    cells["callback"] = timed(lambda: real_fit(config))
    routing = None
    if config.model in MOE:  # the real fit's choices per expert, so that the prediction's routing is the fit's
        counted = timed(lambda: real_fit(config, measured=False))
        routing = counted.get("routing")
        cells["callback"]["routing"] = routing if routing is not None else counted["error"]
    options: dict[str, Any] = {"routing": {"counts": routing}} if routing else {}
    cells["predict_cpu"] = timed(lambda: predicted(config, steps=STEPS, **options))
    cpu = cells["predict_cpu"]
    real = cells["callback"]
    # the budget is below the predicted peak; where the prediction failed, below the real one (advise fails its own way)
    baseline = (
        max(r["peak"] for r in cpu["reports"])
        if "reports" in cpu
        else max(real["first"]["peak"], real["latest"]["peak"])
        if "first" in real
        else None
    )
    cells["predict_gpu"] = timed(lambda: predicted(config, target=GPU))
    cells["cli"] = timed(lambda: command(config, routing))
    if config.model in SLOW_ADVICE and not everything:
        cells["advise"] = {"skipped": "not run in CI, for time: benchmarks/zoo.py runs it", "seconds": 0.0}
    else:
        cells["advise"] = timed(lambda: advised(config, baseline))
    cells["ddp"] = timed(lambda: predicted(config, strategy="ddp", world_size=RANKS))
    cells["fsdp"] = timed(lambda: predicted(config, strategy="fsdp", world_size=RANKS))
    return {"config": config.name, "kind": config.kind, "cells": cells}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    names = [arg for arg in sys.argv[1:] if arg != "--all"]
    configs = [Config.parse(name) for name in names] or ZOO
    for config in configs:
        print(json.dumps(run(config, everything="--all" in sys.argv[1:])), flush=True)
