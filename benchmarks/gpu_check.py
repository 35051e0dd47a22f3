"""The prepared CUDA check: measured on the device beside the callback's readings and our predictions.

Run: ``make gpu-check OUT=dir`` (or ``PYTHONPATH=src python benchmarks/gpu_check.py --out dir``) on a machine with
a CUDA device; it installs nothing. It is sized for a short lease: the whole run, process start-ups included, is
planned to take about three minutes on one H100 or H200, and once ``--budget-s`` (default 420 s) is nearly spent
it starts no further section (nor fresh process) and says which it skipped. It writes ``results.json`` (every
figure measured and predicted, per section, set-up, step and phase) and ``results.md`` (the tables) into ``--out``
(default ``build/gpu_check``), rewriting both as each section ends, so a run stopped by its lease keeps the earlier
ones. It prints each section's seconds. Each set-up is a fresh process (eight at a time), which measures on the
device and only then predicts itself on the CPU, ``predict(..., target=<this device's compute capability>)``. The
sections, in the order they run:

- ``models``: ``max_memory_allocated`` and ``max_memory_reserved`` of a fresh process training two steps (its
  counters start at zero), against the prediction's peak and reserved peak (the larger of its two steps), for the
  13 set-ups of ``benchmarks/gpu_models.py``: the article's MLP, HF GPT-2 in fp32 and in bf16 autocast, Llama,
  BERT, T5, ViT, a CNN, a cuDNN LSTM, Lightning's demo Transformer, Mixtral, and our GPT with and without
  selective activation checkpointing; with nvidia-smi's figure for the process and
  ``predict.footprint.device_footprint`` where that exists;
- ``fsdp``: the same under FSDP2 over one GPU (a one-rank NCCL group, ``fully_shard`` on each block and the
  root), predicted with ``strategy="fsdp", world_size=1``: Llama, our GPT, our GPT under SAC;
- ``sac``: what the forward leaves (allocated at ``before_backward`` minus ``batch_start``), with and without SAC
  (an op policy that saves the matmuls), measured and predicted, beside the predicted activations;
- ``expandable``: our GPT in two fresh processes, ``PYTORCH_CUDA_ALLOC_CONF`` unset and ``expandable_segments:True``
  (set in the child's environment), and Llama with it, predicted with ``allocator="expandable_segments:True"``;
- ``article``: the article's loop on the device beside the article's A6000 table and the prediction, per phase;
- ``windows``: ``CudaSource``'s window peaks against ``max_memory_allocated`` over the same windows, the seed model
  in a Trainer (batch 2048, 3 steps), the callback alone and an independent callback that resets the peak counter
  at the same five hooks, each in a fresh process, with the fixed-cost check 16P + 24 (exact);
- ``fits``: fits with the callback against predictions, every tenant, part and phase: the seed model (32-true),
  a 2-layer HF GPT-2 (width 768, batch 8 x 512, bf16-mixed) and a 2-layer ViT-B/16 (batch 32, 32-true);
- ``footprint``: our GPT alone on the device, plain and under FSDP2, one process at a time: nvidia-smi's change in
  the device's used memory from the process's start to its end, against its reserved bytes and the prediction;
- ``attention``: the attention kernel PyTorch picks on this device (``torch._fused_sdp_choice``) against the CUDA
  target's ``sdpa_kernel``, over dtypes, head dimensions, masks, dropout and the causal flag;
- ``recurrent``: what cuDNN's LSTM and GRU save for backward (its reserve space apart) against the prediction;
- ``tests``: the cuda-marked tests (exact);
- ``strategies``: Lightning's FSDPStrategy (fixed cost 16P/N + 24, N = 1) and 16-mixed with a real GradScaler
  (12 bytes) (exact);
- ``overhead``: the callback's per-step cost, CUDA-synchronized: no callback, the default, every step tracked.

Every section is guarded: one that fails (a set-up whose process failed included) prints its error and the others
still run. The exit code is 0 where every exact check held and no section failed, else 1; 2 where there is no
CUDA device. Comparisons with predictions and timings are recorded and printed, not judged.

``--smoke`` runs the same code on the CPU with tiny models and zero counters (its set-ups sharing two processes),
to check that it runs and writes its files; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_models  # noqa: E402
from gpu_models import CASES  # noqa: E402
from gpu_results import Results  # noqa: E402
from seed_mlp import SeedMLP, seed_loader, seed_model  # noqa: E402

from lightning_memtenants import MemoryTenantsCallback, StepReport, dry_run, format_table  # noqa: E402
from lightning_memtenants.names import PHASES, TENANTS  # noqa: E402

MiB = 1024**2
ARTICLE = {  # RTX A6000, torch 2.5.1, batch 2048 (the article's anatomy_gpu.py)
    "after model.cuda()": 96.0,
    "after forward": 184.2,
    "after backward": 216.3,
    "after first opt.step()": 408.4,
    "peak during all of this": 504.4,
}
# The article's rows at the dry run's phases.
ARTICLE_PHASES = {
    "after forward": "before_backward",
    "after backward": "after_backward",
    "after first opt.step()": "batch_end",
}
SMOKE = False  # set by --smoke: the CPU, tiny models, zero counters
# The fits with the callback compared with predictions: set-up name -> precisions.
FITS = {"seed": ("32-true",), "gpt2": ("bf16-mixed",), "vit": ("32-true",)}
WINDOW_STEPS = 3
# The fresh processes of the peak sections: FSDP2 over one rank, and expandable segments off and on.
FSDP_KINDS = ("fsdp:llama", "fsdp:gpt", "fsdp:gpt-sac")
EXPANDABLE_KINDS = ("es-off:gpt", "es-on:gpt", "es-on:llama")
EXPANDABLE = "expandable_segments:True"
# Run one at a time after the others, so that the change in the device's used memory is the process's footprint.
ALONE_KINDS = ("alone:gpt", "alone-fsdp:gpt")
PEAK_MODES = ("peak", "fsdp", "es-on", "es-off", "alone", "alone-fsdp")
ALLOC_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# Seconds a section is expected to take on an H200 after its processes ended (the budget skips one that would
# not fit), and the most one fresh process may take.
ESTIMATE_S = {"tests": 40.0, "strategies": 25.0, "overhead": 40.0, "attention": 10.0, "recurrent": 10.0}
CHILD_TIMEOUT_S = 150.0


# -- the device's counters (zeros in a smoke run) -----------------------------------------------------------


def device() -> str:
    return "cpu" if SMOKE else "cuda"


def accelerator() -> str:
    return "cpu" if SMOKE else "gpu"


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def allocated() -> int:
    return 0 if SMOKE else int(torch.cuda.memory_allocated())


def reserved() -> int:
    return 0 if SMOKE else int(torch.cuda.memory_reserved())


def window_peak() -> int:
    """The peak since the last reset, as ``CudaSource`` reads it: never below what is allocated now."""
    return 0 if SMOKE else max(int(torch.cuda.max_memory_allocated()), allocated())


def reset_peak() -> None:
    if not SMOKE:
        torch.cuda.reset_peak_memory_stats()


def target() -> str:
    """This device's compute capability, as ``predict(target=...)`` takes it (an H100's in a smoke run).

    A fresh process reads it from its parent (``GPU_CHECK_TARGET``), so that it touches CUDA only when it measures.
    """
    if SMOKE:
        return "9.0"
    if os.environ.get("GPU_CHECK_TARGET"):
        return os.environ["GPU_CHECK_TARGET"]
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


# -- the set-ups of the fits ------------------------------------------------------------------------------


class HFModule(L.LightningModule):
    """A Hugging Face model trained on its own loss with AdamW: the batch's keys are its keyword arguments."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def sizes(name: str) -> dict[str, int]:
    """The batch and model sizes of a set-up (tiny in a smoke run)."""
    if name == "gpt2":
        return (
            {"batch": 8, "seq": 512, "width": 768, "heads": 12}
            if not SMOKE
            else {"batch": 2, "seq": 16, "width": 32, "heads": 2}
        )
    if name == "vit":
        return (
            {"batch": 32, "image": 224, "width": 768, "heads": 12}
            if not SMOKE
            else {"batch": 2, "image": 32, "width": 32, "heads": 2}
        )
    return {"batch": 2048 if not SMOKE else 16}


def build(name: str) -> L.LightningModule:
    """The set-up's LightningModule, from configs (no download), the same parameters on every call."""
    torch.manual_seed(0)
    if name == "seed":
        return SeedMLP()
    if name == "gpt2":  # GPT-2 small but 2 layers: vocabulary 50,257, 1,024 positions, dropout 0.1
        return HFModule(gpu_models.gpt2(SMOKE))
    if name == "vit":  # ViT-B/16 but 2 layers: patch 16, 1,000 classes, no dropout
        return HFModule(gpu_models.vit(SMOKE))
    raise ValueError(f"no set-up named {name!r}")


def samples(name: str, steps: int) -> list[Any]:
    """``steps`` batches' worth of samples, one per row, as a DataLoader collates them."""
    s = sizes(name)
    rows = s["batch"] * steps
    generator = torch.Generator().manual_seed(1)
    if name == "seed":
        return [(x,) for x in torch.randn(rows, 1024, generator=generator)]
    if name == "gpt2":
        ids = torch.randint(0, 50257, (rows, s["seq"]), generator=generator)
        mask = torch.ones_like(ids)
        return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i]} for i in range(rows)]
    pixels = torch.randn(rows, 3, s["image"], s["image"], generator=generator)
    labels = torch.randint(0, 1000, (rows,), generator=generator)
    return [{"pixel_values": pixels[i], "labels": labels[i]} for i in range(rows)]


def loader(name: str, steps: int) -> DataLoader:
    return DataLoader(samples(name, steps), batch_size=sizes(name)["batch"])


def first_batch(name: str) -> Any:
    """The batch the DataLoader gives the first ``training_step``: what the prediction runs on."""
    return default_collate(samples(name, 1))


def trainer(callbacks: list[L.Callback], steps: int, **options: Any) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator(),
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )


# -- the fresh processes ----------------------------------------------------------------------------------


class Reports(L.Callback):
    """Keeps every step's report of the callback before it in the list, as a dict."""

    def __init__(self, cb: MemoryTenantsCallback) -> None:
        self.cb, self.reports = cb, []
        self.start_allocated = 0

    def on_train_start(self, *args: object) -> None:
        self.start_allocated = allocated()

    def on_train_batch_end(self, *args: object) -> None:
        if self.cb.latest is not None and (not self.reports or self.reports[-1]["step"] != self.cb.latest.step):
            self.reports.append(self.cb.latest.to_dict())


class PhaseWindows(L.Callback):
    """An independent reading of the callback's windows: the CUDA counters at the same five hooks.

    At each hook it reads ``memory_allocated``, ``max_memory_allocated`` (never below what is allocated)
    and ``memory_reserved``, then resets the peak counter, so each window's peak is its own. At
    ``on_train_batch_start`` it first keeps the peak since the last batch ended (``between``), then resets
    and reads, as ``CudaSource`` opens a step: the report's ``batch_start`` window starts there.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, list[int]]] = []
        self.between: list[int] = []
        self.start_allocated = 0

    def _read(self, phase: str) -> None:
        self.steps[-1][phase] = [allocated(), window_peak(), reserved()]
        reset_peak()

    def on_train_start(self, *args: object) -> None:
        self.start_allocated = allocated()
        reset_peak()

    def on_train_batch_start(self, *args: object) -> None:
        self.between.append(window_peak())
        reset_peak()
        self.steps.append({})
        self._read("batch_start")

    def on_before_backward(self, *args: object) -> None:
        self._read("before_backward")

    def on_after_backward(self, *args: object) -> None:
        self._read("after_backward")

    def on_before_optimizer_step(self, *args: object) -> None:
        self._read("before_optimizer_step")

    def on_train_batch_end(self, *args: object) -> None:
        self._read("batch_end")


def article_child() -> dict[str, Any]:
    """The article's loop in a fresh process, read at the dry run's phase boundaries (peak reset at each)."""
    torch.manual_seed(0)
    start = [allocated(), reserved()]
    model = seed_model().to(device())
    after_model = allocated()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(sizes("seed")["batch"], 1024, device=device())
    phases: dict[str, list[int]] = {}
    setup_peak = window_peak()

    def phase(name: str) -> None:
        phases[name] = [allocated(), window_peak(), reserved()]
        reset_peak()

    reset_peak()  # the dry run opens its window at batch_start
    phase("batch_start")
    loss = model(x).pow(2).mean()
    phase("before_backward")
    loss.backward()
    phase("after_backward")
    phase("before_optimizer_step")
    opt.step()
    phase("batch_end")
    sync()
    return {"start": start, "after_model": after_model, "setup_peak": setup_peak, "phases": phases}


def fit_child(name: str, precision: str, steps: int = 2) -> dict[str, Any]:
    """A fit of ``steps`` steps with the callback measuring every step; its reports as dicts."""
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    keep = Reports(cb)
    trainer([cb, keep], steps, precision=precision).fit(build(name), loader(name, steps))
    sync()
    return {"reports": keep.reports, "start_allocated": keep.start_allocated, "end_reserved": reserved()}


def windows_child() -> dict[str, Any]:
    """The seed model's fit with the independent callback alone, no MemoryTenantsCallback."""
    windows = PhaseWindows()
    trainer([windows], WINDOW_STEPS).fit(build("seed"), loader("seed", WINDOW_STEPS))
    sync()
    return {"steps": windows.steps, "between": windows.between, "start_allocated": windows.start_allocated}


def _predicted(data: dict[str, Any], make: Callable[[], list[StepReport]]) -> None:
    """The child's prediction, made after its measurement, into ``data`` (its error instead, where it fails)."""
    begin = time.perf_counter()
    try:
        data["predicted"] = [r.to_dict() for r in make()]
    except Exception:
        data["prediction_error"] = traceback.format_exc()[-3000:]
    data["prediction_seconds"] = time.perf_counter() - begin


def child_main(kinds: str, folder: str) -> int:
    """Fresh processes' work: for each of ``kinds`` (joined by ``+``), measure on the device, write
    ``folder/KIND.json``, then predict on the CPU and write it again. A kind that fails leaves its traceback in
    the output and the next still runs; the exit code is 1 if one failed."""
    quiet()
    failed = 0
    for kind in kinds.split("+"):
        try:
            one_child(kind, str(child_path(folder, kind, ".json")))
        except Exception:
            traceback.print_exc()
            print(f"!! child {kind!r} failed", flush=True)
            failed += 1
    return 1 if failed else 0


def child_path(folder: str | Path, kind: str, suffix: str) -> Path:
    """Where the child of ``kind`` writes: a file name of letters, digits, ``-``, ``_`` and ``.`` alone."""
    return Path(folder) / (kind.replace(":", "_").replace("/", "_") + suffix)


def one_child(kind: str, out: str) -> None:
    """One set-up's measurement, then its prediction, written to ``out`` after each."""

    def write(data: dict[str, Any]) -> None:
        Path(out + ".partial").write_text(json.dumps(data))
        Path(out + ".partial").replace(out)

    if kind.partition(":")[0] in PEAK_MODES:
        from gpu_peaks import child

        child(kind, SMOKE, target(), write)
        return
    if kind == "article":
        data = article_child()
        write(data)
        from anatomy_predicted import predicted_rows

        _predicted(data, lambda: [predicted_rows(target())[1]])
    elif kind == "windows":
        data = windows_child()
    elif kind == "windows-cb":
        data = fit_child("seed", "32-true", WINDOW_STEPS)
    elif kind.startswith("fit:"):
        name, precision = kind[4:].split("/")
        data = fit_child(name, precision)
        write(data)
        _predicted(
            data,
            lambda: (
                dry_run(lambda: build(name), first_batch(name), precision=precision, target=target(), steps=2).reports
            ),
        )
    else:
        raise ValueError(f"no child {kind!r}")
    write(data)


class Children:
    """Fresh processes, ``parallel`` at a time: each reads its own allocator's counters, which start from nothing.

    On the device each set-up has a process of its own. A smoke run, on the CPU where nothing is counted, shares
    ``parallel`` processes among the set-ups (``KIND+KIND``), to save the start-ups. A child's environment has no
    ``PYTORCH_CUDA_ALLOC_CONF`` but where the child is for expandable segments, and ``OMP_NUM_THREADS`` shares the
    CPU's cores among the children. None runs past ``deadline`` (a ``time.perf_counter()``).
    """

    def __init__(self, kinds: list[str], parallel: int, deadline: float, threads: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.parallel, self.deadline = parallel, deadline
        self.env = {k: v for k, v in os.environ.items() if k not in ALLOC_VARIABLES}
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), self.env.get("PYTHONPATH", "")) if p)
        self.env["OMP_NUM_THREADS"] = str(threads)
        self.env["GPU_CHECK_TARGET"] = target()
        self.pending: list[list[str]] = [[kind] for kind in kinds]
        if SMOKE:
            plain = [kind for kind in kinds if not kind.startswith("es-on:")]
            groups = [plain[i::parallel] for i in range(parallel)]
            self.pending = [g for g in groups if g] + [[k] for k in kinds if k.startswith("es-on:")]
        self.running: dict[str, tuple[subprocess.Popen[bytes], float, list[str]]] = {}
        self.results: dict[str, Any] = {}
        self.seconds: dict[str, float] = {}
        self._pump()

    def _pump(self) -> None:
        """Collect the children that ended (or ran out of time) and start pending ones in the free slots."""
        now = time.perf_counter()
        for name, (proc, started, group) in list(self.running.items()):
            late = now - started >= CHILD_TIMEOUT_S * len(group) or now >= self.deadline
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                why = f"killed after {now - started:.0f} s (the child's limit or the run's budget)"
            else:
                why = f"exit code {proc.returncode}"
            del self.running[name]
            log = (self.dir / f"{name}.log").read_text(errors="replace")
            for kind in group:
                self.seconds[kind] = (now - started) / len(group)
                out = child_path(self.dir, kind, ".json")
                if out.exists():  # a child that measured but did not finish predicting keeps its measurement
                    data = json.loads(out.read_text())
                    if proc.returncode != 0 and "predicted" not in data and "prediction_error" not in data:
                        data.setdefault("error", f"child {kind!r}: {why}; the end of its output:\n{log[-3000:]}")
                    self.results[kind] = data
                else:
                    self.results[kind] = RuntimeError(f"child {kind!r}: {why}; the end of its output:\n{log[-4000:]}")
        while self.pending and len(self.running) < self.parallel:
            group = self.pending.pop(0)
            if time.perf_counter() >= self.deadline:
                for kind in group:
                    self.results[kind] = RuntimeError(f"child {kind!r} not started: the run's budget is spent")
                continue
            env = dict(self.env)
            if group[0].startswith("es-on:"):
                env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
            name = child_path("", group[0], "").name + (f"_and_{len(group) - 1}" if len(group) > 1 else "")
            command = [sys.executable, str(Path(__file__).resolve()), *(["--smoke"] if SMOKE else [])]
            with (self.dir / f"{name}.log").open("wb") as log:
                proc = subprocess.Popen(
                    [*command, "--child", "+".join(group), str(self.dir)], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            self.running[name] = (proc, time.perf_counter(), group)

    def get(self, kind: str) -> Any:
        """The child's JSON; raises with the end of its output where it failed."""
        while kind not in self.results:
            self._pump()
            if kind not in self.results:
                time.sleep(0.1)
        result = self.results[kind]
        if isinstance(result, Exception):
            raise result
        return result

    def wait(self) -> None:
        while self.pending or self.running:
            self._pump()
            time.sleep(0.1)


# -- printing ---------------------------------------------------------------------------------------------


def mib(value: int | float | None, width: int = 12) -> str:
    return f"{'-':>{width}}" if value is None else f"{value / MiB:>{width}.1f}"


def diff(measured: int | None, predicted: int | None) -> str:
    """Predicted minus measured, in MiB and % of the measured value."""
    if measured is None or predicted is None:
        return f"{'':>10}{'':>9}"
    pct = f"{100 * (predicted - measured) / measured:+.1f}%" if measured else ("0%" if predicted == 0 else "inf")
    return f"{(predicted - measured) / MiB:>+10.1f}{pct:>9}"


def header(first: str, *columns: str, width: int = 40) -> None:
    print(f"{first:<{width}}" + "".join(f"{c:>12}" for c in columns) + f"{'diff MiB':>10}{'diff %':>9}")


def row(label: str, measured: int | None, predicted: int | None, width: int = 40) -> None:
    print(f"{label:<{width}}{mib(measured)}{mib(predicted)}{diff(measured, predicted)}")


def compare(measured: StepReport, predicted: StepReport) -> None:
    """Every tenant, part, per-phase counter and the peak: measured, predicted, and the difference."""
    header("MiB", "measured", "predicted")
    for tenant in TENANTS:
        row(f"tenant {tenant}", measured.tenants_bytes.get(tenant), predicted.tenants_bytes.get(tenant))
    parts_m, parts_p = measured.parts_bytes, predicted.parts_bytes
    for part in sorted(set(parts_m) | set(parts_p)):
        row(f"part {part}", parts_m.get(part), parts_p.get(part))
    for phase in PHASES:
        m, p = measured.phases.get(phase), predicted.phases.get(phase)
        for label, field in (("allocated", "allocated_bytes"), ("window peak", "window_peak_bytes")):
            row(f"{phase} {label}", getattr(m, field, None), getattr(p, field, None))
        row(f"{phase} reserved", getattr(m, "reserved_bytes", None), getattr(p, "reserved_bytes", None))
    row(f"peak ({measured.peak_phase} / {predicted.peak_phase})", measured.peak_bytes, predicted.peak_bytes)


def max_reserved(report: StepReport) -> int | None:
    """The predicted (or measured) reserved peak: ``peak_reserved_bytes``, else the phases' largest."""
    peak = getattr(report, "peak_reserved_bytes", None)
    if peak is not None:
        return int(peak)
    values = [p.reserved_bytes for p in report.phases.values() if p.reserved_bytes is not None]
    return max(values) if values else None


def quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# -- the sections -----------------------------------------------------------------------------------------
# Each takes ``data``, the dict its results go into (written to results.json when it ends), and returns False
# where an exact check did not hold, True where every one held, None where it checks nothing exactly.


def _first_line(error: BaseException | str) -> str:
    text = str(error).strip()
    return (
        f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
        if isinstance(error, BaseException)
        else text.splitlines()[0]
    )


def _peak_rows(data: dict[str, Any], children: Children, kinds: list[str] | tuple[str, ...]) -> None:
    """max_memory_allocated and max_memory_reserved of each fresh process against the prediction's peaks."""
    width = 22
    print(
        f"{'set-up (MiB)':<{width}}{'allocated':>11}{'predicted':>11}{'diff':>9}{'%':>8}"
        f"{'reserved':>11}{'predicted':>11}{'diff':>9}{'%':>8}{'smi':>9}{'pred s':>8}"
    )
    rows: dict[str, Any] = data.setdefault("rows", {})
    for kind in kinds:
        try:
            child = children.get(kind)
        except Exception as error:
            rows[kind] = {"error": str(error)[-3000:]}
            print(f"{kind:<{width}}FAILED: {_first_line(error)}")
            continue
        measured, predicted = child.get("measured") or {}, child.get("predicted") or {}
        rows[kind] = {k: v for k, v in child.items() if k != "kind"}
        m_alloc, p_alloc = measured.get("max_allocated_bytes"), predicted.get("peak_bytes")
        m_res, p_res = measured.get("max_reserved_bytes"), predicted.get("peak_reserved_bytes")
        print(
            f"{kind:<{width}}{mib(m_alloc, 11)}{mib(p_alloc, 11)}{diff(m_alloc, p_alloc)[1:]}"
            f"{mib(m_res, 11)}{mib(p_res, 11)}{diff(m_res, p_res)[1:]}{mib(measured.get('nvidia_smi_bytes'), 9)}"
            f"{predicted.get('seconds', float('nan')):>8.1f}"
        )
        for note in (predicted.get("allocator_note"), child.get("error")):
            if note:
                print(f"{'':<{width}}{_first_line(note)[:160]}")
    failed = [kind for kind, row in rows.items() if row.get("error")]
    if failed:  # their rows stay, with their errors; the section fails
        raise RuntimeError(f"set-ups that failed: {failed}")


def section_models(data: dict[str, Any], children: Children) -> None:
    """The models of gpu_models.CASES, each a fresh process: its peaks measured and predicted."""
    print(
        "\n== models: max_memory_allocated / max_memory_reserved of a fresh process (2 steps) against"
        f" predict(..., target={target()!r})"
    )
    _peak_rows(data, children, [f"peak:{name}" for name in CASES])


def section_fsdp(data: dict[str, Any], children: Children) -> None:
    """FSDP2 over one GPU (a one-rank NCCL group): measured against strategy="fsdp", world_size=1."""
    print("\n== fsdp: FSDP2 over one GPU (fully_shard per block and the root) against strategy='fsdp', world_size=1")
    _peak_rows(data, children, FSDP_KINDS)


def section_footprint(data: dict[str, Any], children: Children) -> None:
    """Our GPT alone on the device, plain and under FSDP2: nvidia-smi's change against the predicted footprint."""
    print("\n== footprint: one process alone on the device; nvidia-smi's change from its start to its end (smi)")
    _peak_rows(data, children, ALONE_KINDS)
    for kind, row in data["rows"].items():
        measured, predicted = row.get("measured") or {}, row.get("predicted") or {}
        smi, reserved = measured.get("nvidia_smi_bytes"), measured.get("end_reserved_bytes")
        outside = None if smi is None or reserved is None else smi - reserved
        row["outside_allocator_bytes"] = outside  # the CUDA context, cuBLAS/cuDNN handles, NCCL's buffers
        print(
            f"{kind}: nvidia-smi {mib(smi, 0)} MiB, reserved at the end {mib(reserved, 0)} MiB, outside the allocator"
            f" {mib(outside, 0)} MiB; predicted footprint {mib(predicted.get('footprint_bytes'), 0)} MiB"
        )


def section_expandable(data: dict[str, Any], children: Children) -> None:
    """Expandable segments off and on, each a fresh process, against allocator="expandable_segments:True"."""
    print(f"\n== expandable: PYTORCH_CUDA_ALLOC_CONF unset and {EXPANDABLE} in the child's environment")
    _peak_rows(data, children, EXPANDABLE_KINDS)
    # the process without them: our GPT's own, and Llama's of the models section (its environment had none either)
    for name, off_kind in (("gpt", "es-off:gpt"), ("llama", "peak:llama")):
        try:
            off, on = children.get(off_kind), children.get(f"es-on:{name}")
        except Exception:
            continue
        m = [r.get("measured", {}).get("max_reserved_bytes") for r in (off, on)]
        p = [(r.get("predicted") or {}).get("peak_reserved_bytes") for r in (off, on)]
        change = {
            "measured_bytes": None if None in m else m[1] - m[0],
            "predicted_bytes": None if None in p else p[1] - p[0],
        }
        data.setdefault("on_minus_off", {})[name] = change
        print(
            f"{name}: reserved with expandable segments minus without: measured"
            f" {mib(change['measured_bytes'], 0)} MiB, predicted {mib(change['predicted_bytes'], 0)} MiB"
        )


def section_sac(data: dict[str, Any], children: Children) -> None:
    """What the forward leaves with and without SAC, measured and predicted, beside the predicted activations."""
    print(
        "\n== sac: allocated at before_backward minus batch_start (the last step), with and without SAC (matmuls saved)"
    )
    print(
        f"{'set-up (MiB)':<20}{'measured':>12}{'predicted':>12}{'diff MiB':>10}{'diff %':>9}"
        f"{'activations':>13}{'other':>9}"
    )
    rows: dict[str, Any] = data.setdefault("rows", {})
    for kind in ("peak:gpt", "peak:gpt-sac", "fsdp:gpt", "fsdp:gpt-sac"):
        try:
            child = children.get(kind)
            measured = child["measured"]["steps"][-1]
            m = measured["before_backward"][0] - measured["batch_start"][0]
            predicted = child["predicted"]["steps"][-1]["phases"]
            p = predicted["before_backward"][0] - predicted["batch_start"][0]
            tenants = predicted["before_backward"][3]
            activations = tenants.get("activations")
            other = predicted["before_backward"][0] - sum(v for v in tenants.values() if v is not None)
        except Exception as error:
            rows[kind] = {"error": _first_line(error)}
            print(f"{kind:<20}FAILED: {_first_line(error)}")
            continue
        rows[kind] = {
            "measured_forward_bytes": m,
            "predicted_forward_bytes": p,
            "predicted_activations_bytes": activations,
            "predicted_other_bytes": other,
        }
        print(f"{kind:<20}{mib(m)}{mib(p)}{diff(m, p)}{mib(activations, 13)}{mib(other, 9)}")


def section_article(data: dict[str, Any], children: Children) -> None:
    """The article's loop on this device, a fresh process, beside the article and the prediction for this device."""
    print("\n== article: the article's loop (seed model, batch 2048, Adam, one step; MiB, a fresh process)")
    real = children.get("article")
    if "prediction_error" in real:
        raise RuntimeError(real["prediction_error"])
    report = StepReport.from_dict(real["predicted"][0])
    phases = real["phases"]
    ours = {"after model.cuda()": real["after_model"]}
    ours.update({row_name: phases[phase][0] for row_name, phase in ARTICLE_PHASES.items()})
    ours["peak during all of this"] = max([real["setup_peak"], *(p[1] for p in phases.values())])
    predicted = {"after model.cuda()": report.tenants_bytes["weights"]}
    predicted.update({row_name: report.phases[phase].allocated_bytes for row_name, phase in ARTICLE_PHASES.items()})
    predicted["peak during all of this"] = report.peak_bytes
    data["rows"] = {
        name: {"article_mib": ARTICLE[name], "measured_bytes": ours[name], "predicted_bytes": predicted[name]}
        for name in ARTICLE
    }
    data["phases"] = {
        phase: {
            "measured": phases[phase],
            "predicted": [
                getattr(report.phases.get(phase), f, None)
                for f in ("allocated_bytes", "window_peak_bytes", "reserved_bytes")
            ],
        }
        for phase in PHASES
    }
    t = target()
    print(f"{'row':<26}{'article A6000':>14}{'this device':>12}{f'predicted {t}':>15}{'diff MiB':>10}{'diff %':>9}")
    for name, value in ARTICLE.items():
        print(f"{name:<26}{value:>14.1f}{mib(ours[name])}{mib(predicted[name], 15)}{diff(ours[name], predicted[name])}")
    print(f"\nper phase (the dry run's boundaries), this device against predicted {t}:")
    header("phase", "measured", "predicted", width=34)
    for phase in PHASES:
        p = report.phases.get(phase)
        for i, (label, field) in enumerate(
            (("allocated", "allocated_bytes"), ("window peak", "window_peak_bytes"), ("reserved", "reserved_bytes"))
        ):
            row(f"{phase} {label}", phases[phase][i], getattr(p, field, None), width=34)


def section_windows(data: dict[str, Any], children: Children) -> bool:
    """CudaSource's windows against an independent reading of max_memory_allocated over the same windows."""
    print(
        "\n== windows: CudaSource's window peaks against max_memory_allocated"
        f" (seed model, batch 2048, {WINDOW_STEPS} steps)"
    )
    print(
        "two fresh processes: the callback alone, and an independent callback resetting the counter at the same hooks"
    )
    ours, theirs = children.get("windows-cb"), children.get("windows")
    reports = [StepReport.from_dict(r) for r in ours["reports"]]
    ok = len(reports) == len(theirs["steps"]) == WINDOW_STEPS
    if not ok:
        print(f"DIFFERENT: {len(reports)} reports, {len(theirs['steps'])} steps read independently")
    print(f"allocated at on_train_start: {ours['start_allocated']:,} B (callback run), {theirs['start_allocated']:,} B")
    width = 44
    print(f"{'step / phase / counter (bytes)':<{width}}{'callback':>16}{'independent':>16}  same")
    differing = data.setdefault("different", [])
    for index, (report, steps) in enumerate(zip(reports, theirs["steps"], strict=False)):
        for phase in PHASES:
            p, independent = report.phases.get(phase), steps.get(phase)
            for i, (label, field) in enumerate(
                (("allocated", "allocated_bytes"), ("window peak", "window_peak_bytes"), ("reserved", "reserved_bytes"))
            ):
                value = getattr(p, field, None)
                other = independent[i] if independent else None
                same = value == other
                ok = ok and same
                if not same:
                    differing.append([index + 1, phase, label, value, other])
                print(f"{f'{index + 1} {phase} {label}':<{width}}{value!s:>16}{other!s:>16}  {'yes' if same else 'NO'}")
        peak = max(s[1] for s in steps.values())
        same = report.peak_bytes == peak
        ok = ok and same
        if not same:
            differing.append([index + 1, "step", "peak", report.peak_bytes, peak])
        print(f"{f'{index + 1} step peak':<{width}}{report.peak_bytes!s:>16}{peak!s:>16}  {'yes' if same else 'NO'}")
        print(
            f"{'':<{width}}(peak between the batches before step {index + 1}: {theirs['between'][index]:,} B,"
            " outside the report's windows)"
        )
    print(f"window peaks, allocated and reserved equal the independent readings: {'yes' if ok else 'NO'}")
    data["same"] = ok
    if reports:
        print()
        print(format_table(reports[-1]))
        latest = reports[-1]
        fixed_ok = latest.expected_fixed_bytes == latest.measured_fixed_bytes == 402_800_664
        data["fixed_cost"] = {
            "expected_bytes": latest.expected_fixed_bytes,
            "measured_bytes": latest.measured_fixed_bytes,
        }
        print(
            f"fixed cost 16P + 24 = 402,800,664 B: {'exact' if fixed_ok else 'DIFFERENT'}"
            f" (expected {latest.expected_fixed_bytes}, measured {latest.measured_fixed_bytes})"
        )
        ok = ok and fixed_ok
    if SMOKE:  # the CPU has no counters: the independent readings are zeros
        print("not judged in a smoke run: the CPU has no allocator counters")
        return True
    return ok


def section_fits(data: dict[str, Any], children: Children) -> None:
    """Fits with the callback, each in a fresh process, against predictions for this device."""
    print(f"\n== fits: real fits with the callback against predict(..., target={target()!r}), AdamW (seed: Adam)")
    failed = []
    for name, precisions in FITS.items():
        for precision in precisions:
            key = f"{name}/{precision}"
            print(f"\n-- {key} {sizes(name)}")
            try:
                child = children.get(f"fit:{key}")
                if "prediction_error" in child:
                    raise RuntimeError(child["prediction_error"])
                real = [StepReport.from_dict(r) for r in child["reports"]]
                predicted = [StepReport.from_dict(r) for r in child["predicted"]]
                print(f"(the prediction took {child.get('prediction_seconds', float('nan')):.1f} s on the CPU)")
                for index, (m, p) in enumerate(zip(real, predicted, strict=False)):
                    print(f"step {index + 1}:")
                    compare(m, p)
                data[key] = [
                    {
                        "measured": {
                            "peak_bytes": m.peak_bytes,
                            "reserved_bytes": max_reserved(m),
                            "tenants_bytes": dict(m.tenants_bytes),
                            "parts_bytes": dict(m.parts_bytes),
                        },
                        "predicted": {
                            "peak_bytes": p.peak_bytes,
                            "reserved_bytes": max_reserved(p),
                            "tenants_bytes": dict(p.tenants_bytes),
                            "parts_bytes": dict(p.parts_bytes),
                        },
                    }
                    for m, p in zip(real, predicted, strict=False)
                ]
                summary = ", ".join(
                    f"step {i + 1}: peak {mib(m.peak_bytes, 0)} vs {mib(p.peak_bytes, 0)} MiB,"
                    f" reserved {mib(max_reserved(m), 0)} vs {mib(max_reserved(p), 0)} MiB"
                    for i, (m, p) in enumerate(zip(real, predicted, strict=False))
                )
                print(f"{key} measured vs predicted: {summary}")
            except Exception as error:
                failed.append(key)
                data[key] = {"error": str(error)[-3000:]}
                print(f"{key} FAILED:\n{error}")
    if failed:
        raise RuntimeError(f"set-ups that failed: {failed}")


def section_tests(data: dict[str, Any]) -> bool:
    """The cuda-marked tests, in their two files (collecting the whole suite would cost more than they do)."""
    print("\n== tests: the cuda-marked tests")
    if SMOKE:
        print("skipped in a smoke run")
        data["skipped"] = "smoke run"
        return True
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    files = [str(ROOT / "tests" / name) for name in ("test_sources.py", "test_alerts.py")]
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *files],
        check=False,
        env=env,
        timeout=120,
        capture_output=True,
        text=True,
    )
    print(tests.stdout[-4000:], tests.stderr[-2000:])
    data["returncode"] = tests.returncode
    data["summary"] = (tests.stdout.strip().splitlines() or [""])[-1]
    return tests.returncode == 0


class StepTimer(L.Callback):
    """Times the steps after ``warmup``, CUDA-synchronized: from the end of batch ``warmup - 1`` to the last end.

    Put it last, so that the callbacks before it have done their work at each ``on_train_batch_end``.
    """

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.begin = self.end = 0.0

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.warmup - 1:
            sync()
            self.begin = time.perf_counter()
        elif batch_idx == self.steps - 1:
            sync()
            self.end = time.perf_counter()

    @property
    def ms_per_step(self) -> float:
        return 1000 * (self.end - self.begin) / (self.steps - self.warmup)


def section_overhead(data: dict[str, Any]) -> None:
    """The callback's per-step cost on the device: fits with and without it, CUDA-synchronized."""
    warmup, steps = (3, 23) if not SMOKE else (1, 3)
    print(f"\n== overhead: the callback's per-step cost ({steps - warmup} timed steps after {warmup})")
    arms: dict[str, Callable[[], list[L.Callback]]] = {
        "no callback": list,
        "MemoryTenantsCallback()": lambda: [MemoryTenantsCallback(print_summary=False)],
        "track_every_step=True": lambda: [MemoryTenantsCallback(print_summary=False, track_every_step=True)],
    }
    for name, precision in (("seed", "32-true"), ("gpt2", "bf16-mixed")):
        times: dict[str, float] = {}
        batches = loader(name, steps)
        for arm, callbacks in arms.items():
            timer = StepTimer(warmup, steps)
            trainer([*callbacks(), timer], steps, precision=precision).fit(build(name), batches)
            times[arm] = timer.ms_per_step
        base = times["no callback"]
        data[f"{name}/{precision}"] = {"ms_per_step": times}
        print(f"{name} ({precision}, {sizes(name)}):")
        for arm, value in times.items():
            print(f"  {arm:<26}{value:>9.2f} ms/step   x{value / base:.3f}")


def section_strategies(data: dict[str, Any]) -> bool:
    """Lightning's FSDPStrategy (it refuses the CPU) and 16-mixed with a real GradScaler, on one device.

    With one device FSDP's shards are whole, so the fixed cost is fsdp_fixed_cost_bytes(P, 1) = 16P,
    plus Adam's 6 step counters; the GradScaler holds 8 bytes, 12 while it steps.
    """
    print("\n== strategies: FSDPStrategy and 16-mixed (GradScaler), the seed model, batch 256")
    if SMOKE:
        print("skipped in a smoke run (FSDP refuses the CPU)")
        data["skipped"] = "smoke run"
        return True
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_memtenants.analysis.formulas import fsdp_fixed_cost_bytes

    ok = True
    runs = {
        "fsdp, 32-true": {"strategy": FSDPStrategy()},
        "16-mixed (GradScaler)": {"precision": "16-mixed"},
    }
    for name, options in runs.items():
        cb = MemoryTenantsCallback(print_summary=False)
        trainer([cb], 2, **options).fit(SeedMLP(), seed_loader(256, 2))
        report = cb.latest
        assert report is not None
        print(f"\n-- the seed model, {name}")
        print(format_table(report))
        fixed = fsdp_fixed_cost_bytes(25_175_040, 1) + 24
        exact = report.expected_fixed_bytes == report.measured_fixed_bytes == fixed
        measured = report.measured_fixed_bytes
        data[name] = {"expected_fixed_bytes": fixed, "measured_fixed_bytes": measured, "peak_bytes": report.peak_bytes}
        print(f"fixed cost {fixed:,} B expected: {'exact' if exact else 'DIFFERENT'} (measured {measured:,} B)")
        if name.startswith("fsdp"):
            ok = ok and exact
        else:  # a GradScaler may skip the first steps on inf gradients, and Adam's state with them: print only
            print("- " + "\n- ".join(report.fixed_cost_notes or ["no deviation"]))
            scaler, copies = report.parts_bytes.get("grad_scaler"), report.parts_bytes.get("autocast_cache")
            data[name].update(grad_scaler_bytes=scaler, autocast_cache_bytes=copies)
            print(f"grad_scaler part {scaler} B (expected 12), autocast_cache {copies} B")
            ok = ok and scaler == 12
    return ok


def section_attention(data: dict[str, Any]) -> None:
    """PyTorch's own SDPA kernel choice on this device (``torch._fused_sdp_choice``) against ``sdpa_kernel``'s."""
    from lightning_memtenants.predict.cuda_kernels import sdpa_kernel

    print("\n== attention: the kernel PyTorch picks on this device against the CUDA target's")
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    capability = torch.cuda.get_device_capability() if not SMOKE else (9, 0)
    where = "cpu" if SMOKE else "cuda"
    agree = total = 0
    different = data.setdefault("different", [])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for dim in (64, 128, 200, 256):
            for mask in (None, "bool", "float"):
                for dropout, causal in ((0.0, False), (0.1, False), (0.0, True)):
                    if causal and mask:
                        continue
                    q, k, v = (
                        torch.randn(2, 4, 128, dim, device=where, dtype=dtype, requires_grad=True) for _ in "qkv"
                    )
                    m = None
                    if mask:
                        m = torch.ones(128, 128, device=where, dtype=torch.bool)
                        m = m if mask == "bool" else torch.zeros(128, 128, device=where, dtype=dtype)
                    ours = sdpa_kernel(q, k, v, m, dropout, causal, capability)
                    theirs = ours if SMOKE else names.get(torch._fused_sdp_choice(q, k, v, m, dropout, causal), "?")
                    total += 1
                    agree += ours == theirs
                    if ours != theirs:
                        case = [str(dtype)[6:], dim, mask, dropout, causal, theirs, ours]
                        different.append(case)
                        print(
                            f"  {case[0]:>9} d={dim:<3} mask={mask!s:<5} p={dropout:<5} causal={causal!s:<5}"
                            f" torch {theirs:<9} ours {ours}"
                        )
    data.update(agree=agree, total=total)
    print(f"  {agree} of {total} cases agree")


def section_recurrent(data: dict[str, Any]) -> None:
    """cuDNN's recurrent layers: the bytes they save for backward (weights and input left out), the reserve space
    apart, against the prediction's activations."""
    from torch import nn

    from lightning_memtenants import predict

    print("\n== recurrent: saved for backward on this device (cuDNN's reserve space apart) and predicted")
    columns = ("seq x batch x width x layers", "reserve MiB", "saved MiB", "predicted MiB")
    print(f"  {'layer':<5} {columns[0]:>28} {columns[1]:>12} {columns[2]:>10} {columns[3]:>14}")
    where = "cpu" if SMOKE else "cuda"
    for kind in (nn.LSTM, nn.GRU):
        for seq, batch, width, layers in ((16, 4, 64, 2), (128, 16, 512, 1)):
            if SMOKE and width > 64:
                continue
            layer = kind(width, width, layers).to(where)
            x = torch.randn(seq, batch, width, device=where, requires_grad=True)
            saved: list[Tensor] = []

            def pack(tensor: Tensor, saved: list[Tensor] = saved) -> Tensor:
                saved.append(tensor)
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out, _ = layer(x)
            reserve = sum(t.untyped_storage().nbytes() for t in saved if t.dtype == torch.uint8)
            held = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
            storages = {ptr: size for ptr, size in storages.items() if ptr not in held}  # no weight, no input
            del out, saved
            predicted = predict(
                layer.cpu(),
                (torch.Size([seq, batch, width]),),
                loss_fn=lambda m, b: m(b[0])[0].sum(),
                target="cpu" if SMOKE else target(),
            )
            shape = f"{seq} x {batch} x {width} x {layers}"
            activations = predicted.phases["before_backward"].tenants_bytes["activations"]
            data[f"{kind.__name__} {shape}"] = {
                "reserve_bytes": reserve,
                "saved_bytes": sum(storages.values()),
                "predicted_activations_bytes": activations,
            }
            print(
                f"  {kind.__name__:<5} {shape:>28} {reserve / MiB:>12.3f} {sum(storages.values()) / MiB:>10.3f}"
                f" {activations / MiB:>14.3f}"
            )


def guarded(
    results: Results, name: str, section: Callable[..., bool | None], *args: Any, estimate_s: float = 0.0
) -> bool:
    """Run a section unless the budget is nearly spent; an error is printed and fails it, and the next still runs.

    Its figures, seconds and status go into ``results`` (and so to the files) as soon as it ends.
    """
    left = results.remaining_s()
    if left < estimate_s:
        reason = f"{left:.0f} s of the budget left, the section needs about {estimate_s:.0f} s"
        print(f"\n== {name}: skipped ({reason})")
        results.add(name, {"seconds": 0.0, "status": "skipped", "reason": reason})
        return True
    data: dict[str, Any] = {}
    error = None
    begin = time.perf_counter()
    try:
        held = section(data, *args)
    except Exception:
        error = traceback.format_exc()
        print(f"\n!! section {name!r} failed:\n{error}")
        held = False
    seconds = time.perf_counter() - begin
    status = "ok" if held is not False else "failed"
    print(f"[{name}: {seconds:.1f} s, {status}]")
    results.add(name, {"seconds": seconds, "status": status, "exact": held, "error": error, **data})
    return held is not False


def main(out: str, budget_s: float, parallel: int) -> int:
    quiet()
    import transformers

    run_header = {
        "device": "cpu (smoke run)" if SMOKE else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "target": target(),
        "smoke": SMOKE,
        "alloc_conf": {k: os.environ[k] for k in ALLOC_VARIABLES if k in os.environ},
    }
    results = Results(out, budget_s, run_header)
    if SMOKE:
        print("smoke run on the CPU: tiny models, zero counters; the numbers mean nothing")
    print(
        f"device: {run_header['device']}, torch {torch.__version__}, lightning {L.__version__},"
        f" transformers {transformers.__version__}; results in {Path(out).resolve()}; budget {budget_s:.0f} s"
    )
    kinds = [
        *(f"peak:{name}" for name in CASES),
        *FSDP_KINDS,
        *EXPANDABLE_KINDS,
        "article",
        "windows",
        "windows-cb",
        *(f"fit:{n}/{p}" for n, ps in FITS.items() for p in ps),
    ]
    threads = max(1, (os.cpu_count() or 2) // parallel)
    # the fresh processes stop 30 s before the budget ends, so that the files are written in time
    children = Children(kinds, parallel, results.begin + budget_s - 30, threads)
    print(f"{len(kinds)} fresh processes, {parallel} at a time, {threads} CPU threads each")
    held: dict[str, bool] = {}
    for name, section in (
        ("models", section_models),
        ("fsdp", section_fsdp),
        ("sac", section_sac),
        ("expandable", section_expandable),
        ("article", section_article),
        ("windows", section_windows),
        ("fits", section_fits),
    ):
        held[name] = guarded(results, name, section, children)
    children.wait()
    alone = Children(list(ALONE_KINDS), 1, results.begin + budget_s - 30, os.cpu_count() or 1)
    held["footprint"] = guarded(results, "footprint", section_footprint, alone)
    alone.wait()
    results.data["children_seconds"] = {**children.seconds, **alone.seconds}
    print("fresh processes' seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in results.data["children_seconds"].items()))
    for name, section in (  # in this process, which uses the device only from here on
        ("attention", section_attention),
        ("recurrent", section_recurrent),
        ("tests", section_tests),
        ("strategies", section_strategies),
        ("overhead", section_overhead),
    ):
        held[name] = guarded(results, name, section, estimate_s=ESTIMATE_S[name])
    results.write()
    skipped = [k for k, v in results.data["sections"].items() if v.get("status") == "skipped"]
    print(
        f"\n== summary ({results.elapsed_s():.0f} s): "
        + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in held.items() if k not in skipped)
        + (f"; skipped for the budget: {', '.join(skipped)}" if skipped else "")
    )
    print(f"results: {Path(out).resolve() / 'results.json'}, {Path(out).resolve() / 'results.md'}")
    return 0 if all(held.values()) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="run on the CPU with tiny models (numbers mean nothing)")
    parser.add_argument("--out", default="build/gpu_check", help="the folder for results.json and results.md")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (420; 600 smoke)")
    parser.add_argument("--parallel", type=int, default=None, help="fresh processes at a time (8; 2 smoke)")
    parser.add_argument("--child", nargs=2, metavar=("KINDS", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    SMOKE = args.smoke
    if args.child:
        sys.exit(child_main(*args.child))
    if not SMOKE and not torch.cuda.is_available():
        print("gpu-check needs a CUDA device; none here, so nothing was checked.")
        sys.exit(2)
    budget = args.budget_s if args.budget_s is not None else (600.0 if SMOKE else 420.0)
    sys.exit(main(args.out, budget, args.parallel or (2 if SMOKE else 8)))
