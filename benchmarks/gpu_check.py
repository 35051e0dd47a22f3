"""The prepared CUDA check: measured on the device, side by side with the callback's readings and our predictions.

Run: ``make gpu-check`` (or ``PYTHONPATH=src python benchmarks/gpu_check.py``) on a machine with a CUDA
device; it installs nothing and takes about two minutes on an H200 (under five). It prints, in order:

1. the article's loop measured on the device (a fresh process) beside the article's A6000 table and
   ``predict(..., target=<this device's compute capability>)``, per phase: allocated, window peak, reserved;
2. ``CudaSource``'s window peaks against ``max_memory_allocated`` over the same windows: the seed model
   in a Trainer (batch 2048, 3 steps) once with the callback alone and once with an independent callback
   that resets the peak counter at the same five hooks, each in a fresh process, compared per step and
   phase (allocated, window peak, reserved), with the fixed-cost check 16P + 24;
3. ``memory_reserved`` against the allocator model: the prediction's ``reserved_bytes`` per phase beside
   ``torch.cuda.memory_reserved`` of a fresh process, for every set-up of 1 and 4;
4. real fits against predictions, each in a fresh process: the seed model (32-true), a 2-layer HF GPT-2
   (width 768, batch 8 x 512; bf16-mixed and 32-true) and a 2-layer ViT-B/16 (batch 32 of 224 x 224;
   32-true and bf16-mixed): every tenant, part, per-phase allocated / window peak / reserved and the
   peak, first and second step, with the differences in MiB and %;
5. the cuda-marked tests;
6. the callback's per-step cost: fits of N steps with no callback, the default callback and
   ``track_every_step=True``, CUDA-synchronized, in ms/step and as a ratio;
7. Lightning's FSDPStrategy (fixed cost 16P/N + 24, N = 1) and 16-mixed with a real GradScaler (12 bytes);
8. the attention kernel PyTorch picks on this device (``torch._fused_sdp_choice``) against the CUDA
   target's ``sdpa_kernel``, over dtypes, head dimensions, masks, dropout and the causal flag;
9. recurrent layers: what cuDNN's LSTM and GRU save for backward (its reserve space included, which the
   CUDA target does not model yet) against the prediction's activations, per shape: the figures to model it by.

Every section is guarded: one that fails prints its error and the others still run. The exit code is 0
where every exact check held (the tests; the callback's window peaks, allocated and reserved bytes equal
to the independent readings; the fixed costs; the GradScaler's bytes) and no section failed, else 1;
2 where there is no CUDA device. The comparisons with predictions and the timings are printed, not judged.

``--smoke`` runs the same code on the CPU with tiny models and zero counters, to check that it runs;
its numbers mean nothing.
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
# The fits compared with predictions: set-up name -> (model, precisions).
FITS = {"seed": ("32-true",), "gpt2": ("bf16-mixed", "32-true"), "vit": ("32-true", "bf16-mixed")}
WINDOW_STEPS = 3


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
    """This device's compute capability, as ``predict(target=...)`` takes it."""
    if SMOKE:
        return "9.0"
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


# -- the set-ups ------------------------------------------------------------------------------------------


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
    import transformers as tf

    s = sizes(name)
    if name == "gpt2":  # GPT-2 small but 2 layers: vocabulary 50,257, 1,024 positions, dropout 0.1
        config = tf.GPT2Config(n_layer=2, n_embd=s["width"], n_head=s["heads"], attn_implementation="sdpa")
        return HFModule(tf.GPT2LMHeadModel(config))
    if name == "vit":  # ViT-B/16 but 2 layers: patch 16, 1,000 classes, no dropout
        config = tf.ViTConfig(
            num_hidden_layers=2,
            hidden_size=s["width"],
            num_attention_heads=s["heads"],
            intermediate_size=4 * s["width"],
            image_size=s["image"],
            num_labels=1000,
            attn_implementation="sdpa",
        )
        return HFModule(tf.ViTForImageClassification(config))
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


def child_main(kind: str, out: str) -> int:
    quiet()
    if kind == "article":
        data = article_child()
    elif kind == "windows":
        data = windows_child()
    elif kind == "windows-cb":
        data = fit_child("seed", "32-true", WINDOW_STEPS)
    elif kind.startswith("fit:"):
        name, precision = kind[4:].split("/")
        data = fit_child(name, precision)
    else:
        raise ValueError(f"no child {kind!r}")
    Path(out).write_text(json.dumps(data))
    return 0


class Children:
    """Fresh processes, ``parallel`` at a time: each reads its own allocator's counters, which start from nothing."""

    def __init__(self, kinds: list[str], parallel: int, timeout: float = 240.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.parallel, self.timeout = parallel, timeout
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), self.env.get("PYTHONPATH", "")) if p)
        self.pending = list(kinds)
        self.running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
        self.results: dict[str, Any] = {}
        self._pump()

    def _path(self, kind: str, suffix: str) -> Path:
        return self.dir / (kind.replace(":", "_").replace("/", "_") + suffix)

    def _pump(self) -> None:
        """Collect the children that ended (or ran out of time) and start pending ones in the free slots."""
        for kind, (proc, started) in list(self.running.items()):
            if proc.poll() is None and time.perf_counter() - started < self.timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                why = f"no result in {self.timeout:.0f} s"
            else:
                why = f"exit code {proc.returncode}"
            del self.running[kind]
            out = self._path(kind, ".json")
            if proc.returncode == 0 and out.exists():
                self.results[kind] = json.loads(out.read_text())
            else:
                log = self._path(kind, ".log").read_text(errors="replace")
                self.results[kind] = RuntimeError(f"child {kind!r}: {why}; the end of its output:\n{log[-4000:]}")
        while self.pending and len(self.running) < self.parallel:
            kind = self.pending.pop(0)
            command = [sys.executable, str(Path(__file__).resolve()), *(["--smoke"] if SMOKE else [])]
            with self._path(kind, ".log").open("wb") as log:
                proc = subprocess.Popen(
                    [*command, "--child", kind, str(self._path(kind, ".json"))],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                )
            self.running[kind] = (proc, time.perf_counter())

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
    values = [p.reserved_bytes for p in report.phases.values() if p.reserved_bytes is not None]
    return max(values) if values else None


# -- the sections -----------------------------------------------------------------------------------------


def quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


class Predictions:
    """The dry runs for this device, made on this machine's CPU while the fresh processes run."""

    def __init__(self) -> None:
        self.article: Any = None
        self.fits: dict[str, list[StepReport]] = {}
        self.errors: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def run(self) -> None:
        from anatomy_predicted import predicted_rows

        begin = time.perf_counter()
        try:
            self.article = predicted_rows(target())[1]
        except Exception:
            self.errors["article"] = traceback.format_exc()
        self.seconds["article"] = time.perf_counter() - begin
        for name, precisions in FITS.items():
            for precision in precisions:
                key = f"{name}/{precision}"
                begin = time.perf_counter()
                try:  # a callable is built under fake tensors: nothing real is allocated
                    built = dry_run(
                        lambda n=name: build(n), first_batch(name), precision=precision, target=target(), steps=2
                    )
                    self.fits[key] = built.reports
                except Exception:
                    self.errors[key] = traceback.format_exc()
                self.seconds[key] = time.perf_counter() - begin

    def fit(self, key: str) -> list[StepReport]:
        if key in self.errors:
            raise RuntimeError(f"the prediction of {key} failed:\n{self.errors[key]}")
        return self.fits[key]


def section_article(children: Children, predictions: Predictions) -> bool | None:
    """The article's loop on this device, a fresh process, beside the article and the prediction for this device."""
    print("\n== 1. the article's loop (seed model, batch 2048, Adam, one step; MiB, a fresh process)")
    real = children.get("article")
    if "article" in predictions.errors:
        raise RuntimeError(predictions.errors["article"])
    report = predictions.article
    phases = real["phases"]
    ours = {"after model.cuda()": real["after_model"]}
    ours.update({row_name: phases[phase][0] for row_name, phase in ARTICLE_PHASES.items()})
    ours["peak during all of this"] = max([real["setup_peak"], *(p[1] for p in phases.values())])
    predicted = {"after model.cuda()": report.tenants_bytes["weights"]}
    predicted.update({row_name: report.phases[phase].allocated_bytes for row_name, phase in ARTICLE_PHASES.items()})
    predicted["peak during all of this"] = report.peak_bytes
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
    return None


def section_windows(children: Children) -> bool:
    """CudaSource's windows against an independent reading of max_memory_allocated over the same windows."""
    print(
        f"\n== 2. CudaSource's window peaks against max_memory_allocated (seed model, batch 2048, {WINDOW_STEPS} steps)"
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
                print(f"{f'{index + 1} {phase} {label}':<{width}}{value!s:>16}{other!s:>16}  {'yes' if same else 'NO'}")
        peak = max(s[1] for s in steps.values())
        same = report.peak_bytes == peak
        ok = ok and same
        print(f"{f'{index + 1} step peak':<{width}}{report.peak_bytes!s:>16}{peak!s:>16}  {'yes' if same else 'NO'}")
        print(
            f"{'':<{width}}(peak between the batches before step {index + 1}: {theirs['between'][index]:,} B,"
            " outside the report's windows)"
        )
    print(f"window peaks, allocated and reserved equal the independent readings: {'yes' if ok else 'NO'}")
    if reports:
        print()
        print(format_table(reports[-1]))
        latest = reports[-1]
        fixed_ok = latest.expected_fixed_bytes == latest.measured_fixed_bytes == 402_800_664
        print(
            f"fixed cost 16P + 24 = 402,800,664 B: {'exact' if fixed_ok else 'DIFFERENT'}"
            f" (expected {latest.expected_fixed_bytes}, measured {latest.measured_fixed_bytes})"
        )
        ok = ok and fixed_ok
    return ok


def section_reserved(children: Children, predictions: Predictions) -> bool | None:
    """memory_reserved of a fresh process against the allocator model's reserved bytes."""
    print("\n== 3. memory_reserved (a fresh process) against the allocator model's reserved_bytes")
    header("set-up / step / phase", "measured", "predicted", width=44)
    try:
        phases = children.get("article")["phases"]
        report = predictions.article
        for phase in PHASES:
            row(f"article loop / 1 / {phase}", phases[phase][2], report.phases[phase].reserved_bytes, width=44)
    except Exception as error:
        print(f"article loop: {type(error).__name__}: {str(error).splitlines()[0]}")
    for name, precisions in FITS.items():
        for precision in precisions:
            key = f"{name}/{precision}"
            try:
                real = [StepReport.from_dict(r) for r in children.get(f"fit:{key}")["reports"]]
                for index, (m, p) in enumerate(zip(real, predictions.fit(key), strict=False)):
                    for phase in PHASES:
                        mp, pp = m.phases.get(phase), p.phases.get(phase)
                        row(
                            f"{key} / {index + 1} / {phase}",
                            getattr(mp, "reserved_bytes", None),
                            getattr(pp, "reserved_bytes", None),
                            width=44,
                        )
            except Exception as error:
                print(f"{key}: {type(error).__name__}: {str(error).splitlines()[0]}")
    return None


def section_fits(children: Children, predictions: Predictions) -> bool | None:
    """Real fits, each in a fresh process, against predictions for this device."""
    print(f"\n== 4. real fits against predict(..., target={target()!r}), AdamW (seed: Adam), fresh processes")
    failed = []
    for name, precisions in FITS.items():
        for precision in precisions:
            key = f"{name}/{precision}"
            print(
                f"\n-- {key} {sizes(name)}"
                f" (prediction took {predictions.seconds.get(key, float('nan')):.1f} s on the CPU)"
            )
            try:
                data = children.get(f"fit:{key}")
                real = [StepReport.from_dict(r) for r in data["reports"]]
                predicted = predictions.fit(key)
                for index, (m, p) in enumerate(zip(real, predicted, strict=False)):
                    print(f"step {index + 1}:")
                    compare(m, p)
                summary = ", ".join(
                    f"step {i + 1}: peak {mib(m.peak_bytes, 0)} vs {mib(p.peak_bytes, 0)} MiB,"
                    f" reserved {mib(max_reserved(m), 0)} vs {mib(max_reserved(p), 0)} MiB"
                    for i, (m, p) in enumerate(zip(real, predicted, strict=False))
                )
                print(f"{key} measured vs predicted: {summary}")
            except Exception:
                failed.append(key)
                print(f"{key} FAILED:\n{traceback.format_exc()}")
    if failed:
        raise RuntimeError(f"set-ups that failed: {failed}")
    return None


def section_tests() -> bool:
    print("\n== 5. cuda-marked tests")
    if SMOKE:
        print("skipped in a smoke run")
        return True
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(ROOT / "tests")], check=False, env=env, timeout=240
    )
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


def section_overhead() -> bool | None:
    """The callback's per-step cost on the device: fits with and without it, CUDA-synchronized."""
    warmup, steps, repeats = (5, 45, 2) if not SMOKE else (1, 3, 1)
    print(f"\n== 6. the callback's per-step cost ({steps - warmup} timed steps after {warmup}, best of {repeats})")
    arms: dict[str, Callable[[], list[L.Callback]]] = {
        "no callback": list,
        "MemoryTenantsCallback()": lambda: [MemoryTenantsCallback(print_summary=False)],
        "track_every_step=True": lambda: [MemoryTenantsCallback(print_summary=False, track_every_step=True)],
    }
    for name, precision in (("seed", "32-true"), ("gpt2", "bf16-mixed")):
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        data = loader(name, steps)
        for repeat in range(repeats):
            order = list(arms)[repeat % len(arms) :] + list(arms)[: repeat % len(arms)]
            for arm in order:
                timer = StepTimer(warmup, steps)
                trainer([*arms[arm](), timer], steps, precision=precision).fit(build(name), data)
                times[arm].append(timer.ms_per_step)
        base = min(times["no callback"])
        print(f"{name} ({precision}, {sizes(name)}):")
        for arm, values in times.items():
            print(f"  {arm:<26}{min(values):>9.2f} ms/step   x{min(values) / base:.3f}")
    return None


def section_strategies() -> bool:
    """Lightning's FSDPStrategy (it refuses the CPU) and 16-mixed with a real GradScaler, on one device.

    With one device FSDP's shards are whole, so the fixed cost is fsdp_fixed_cost_bytes(P, 1) = 16P,
    plus Adam's 6 step counters; the GradScaler holds 8 bytes, 12 while it steps.
    """
    print("\n== 7. FSDPStrategy and 16-mixed (GradScaler), the seed model, batch 256")
    if SMOKE:
        print("skipped in a smoke run (FSDP refuses the CPU)")
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
        print(f"fixed cost {fixed:,} B expected: {'exact' if exact else 'DIFFERENT'} (measured {measured:,} B)")
        if name.startswith("fsdp"):
            ok = ok and exact
        else:  # a GradScaler may skip the first steps on inf gradients, and Adam's state with them: print only
            print("- " + "\n- ".join(report.fixed_cost_notes or ["no deviation"]))
            scaler, copies = report.parts_bytes.get("grad_scaler"), report.parts_bytes.get("autocast_cache")
            print(f"grad_scaler part {scaler} B (expected 12), autocast_cache {copies} B")
            ok = ok and scaler == 12
    return ok


def section_attention() -> bool | None:
    """PyTorch's own SDPA kernel choice on this device (``torch._fused_sdp_choice``) against ``sdpa_kernel``'s."""
    from lightning_memtenants.predict.cuda_kernels import sdpa_kernel

    print("\n== 8. attention kernels: PyTorch's choice on this device against the CUDA target's")
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    capability = torch.cuda.get_device_capability() if not SMOKE else (8, 0)
    where = "cpu" if SMOKE else "cuda"
    agree = total = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for dim in (64, 96, 128, 200, 256):
            for mask in (None, "bool", "float"):
                for dropout, causal in ((0.0, False), (0.1, False), (0.125, True)):
                    if causal and mask:
                        continue
                    q, k, v = (
                        torch.randn(2, 4, 256, dim, device=where, dtype=dtype, requires_grad=True) for _ in "qkv"
                    )
                    m = None
                    if mask:
                        m = torch.ones(256, 256, device=where, dtype=torch.bool)
                        m = m if mask == "bool" else torch.zeros(256, 256, device=where, dtype=dtype)
                    ours = sdpa_kernel(q, k, v, m, dropout, causal, capability)
                    theirs = ours if SMOKE else names.get(torch._fused_sdp_choice(q, k, v, m, dropout, causal), "?")
                    total += 1
                    agree += ours == theirs
                    if ours != theirs:
                        print(
                            f"  {str(dtype)[6:]:>9} d={dim:<3} mask={mask!s:<5} p={dropout:<5} causal={causal!s:<5}"
                            f" torch {theirs:<9} ours {ours}"
                        )
    print(f"  {agree} of {total} cases agree")
    return None


def section_recurrent() -> bool | None:
    """cuDNN's recurrent layers: the bytes they save for backward (weights and input left out), the reserve space
    apart, against the prediction's activations."""
    from torch import nn

    from lightning_memtenants import predict

    print("\n== 9. recurrent layers: saved for backward on this device (cuDNN's reserve space apart) and predicted")
    columns = ("seq x batch x width x layers", "reserve MiB", "saved MiB", "predicted MiB")
    print(f"  {'layer':<5} {columns[0]:>28} {columns[1]:>12} {columns[2]:>10} {columns[3]:>14}")
    where = "cpu" if SMOKE else "cuda"
    for kind in (nn.LSTM, nn.GRU):
        for seq, batch, width, layers in ((16, 4, 64, 2), (64, 8, 256, 2), (128, 16, 512, 1)):
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
            print(
                f"  {kind.__name__:<5} {shape:>28} {reserve / MiB:>12.3f} {sum(storages.values()) / MiB:>10.3f}"
                f" {predicted.phases['before_backward'].tenants_bytes['activations'] / MiB:>14.3f}"
            )
    return None


def guarded(name: str, section: Callable[..., bool | None], *args: Any) -> bool:
    """Run a section; an error is printed and fails the check, and the next section still runs."""
    begin = time.perf_counter()
    try:
        held = section(*args)
    except Exception:
        print(f"\n!! section {name!r} failed:\n{traceback.format_exc()}")
        held = False
    print(f"[{name}: {time.perf_counter() - begin:.1f} s, {'ok' if held is not False else 'FAILED'}]")
    return held is not False


def main() -> int:
    quiet()
    begin = time.perf_counter()
    if SMOKE:
        print("smoke run on the CPU: tiny models, zero counters; the numbers mean nothing")
    else:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, lightning {L.__version__}")
    kinds = ["article", "windows", "windows-cb", *(f"fit:{n}/{p}" for n, ps in FITS.items() for p in ps)]
    children = Children(kinds, parallel=1 if SMOKE else len(kinds))
    predictions = Predictions()
    predictions.run()  # on the CPU, while the fresh processes use the device
    print(
        f"predictions for target {target()!r}: " + ", ".join(f"{k} {v:.1f} s" for k, v in predictions.seconds.items())
    )
    results = {
        "article": guarded("article", section_article, children, predictions),
        "windows": guarded("windows", section_windows, children),
        "reserved": guarded("reserved", section_reserved, children, predictions),
        "fits": guarded("fits", section_fits, children, predictions),
    }
    children.wait()
    results["tests"] = guarded("tests", section_tests)
    results["overhead"] = guarded("overhead", section_overhead)
    results["strategies"] = guarded("strategies", section_strategies)
    results["attention"] = guarded("attention", section_attention)
    results["recurrent"] = guarded("recurrent", section_recurrent)
    print(
        f"\n== summary ({time.perf_counter() - begin:.0f} s): "
        + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in results.items())
    )
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="run on the CPU with tiny models (numbers mean nothing)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    SMOKE = args.smoke
    if args.child:
        sys.exit(child_main(*args.child))
    if not SMOKE and not torch.cuda.is_available():
        print("gpu-check needs a CUDA device; none here, so nothing was checked.")
        sys.exit(2)
    sys.exit(main())
