"""One fresh process's peaks: a model of ``gpu_models.CASES`` trained two steps on the device, then predicted.

``gpu_check.py`` starts one process per set-up, so each one's ``max_memory_allocated`` and
``max_memory_reserved`` count from zero. The process trains in a plain loop in the order the dry run follows for
a plain module (``zero_grad(set_to_none=True)``, forward, backward, ``step``; the previous step's loss alive
through the next forward), reading the counters at the dry run's five phases, then reads nvidia-smi's figure for
itself and only then predicts the same set-up on the CPU, with ``predict``'s CUDA model for this device. Under
``fsdp`` it joins a one-rank process group (NCCL; gloo in a smoke run) and shards each block and the root with
FSDP2's ``fully_shard``, as the prediction's ``strategy="fsdp", world_size=1`` does.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import subprocess
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
from gpu_models import CASES, Case

from lightning_memtenants import dry_run
from lightning_memtenants.names import PHASES

STEPS = 2
MiB = 1024**2
STATS = (
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
    "segment.all.peak",
    "inactive_split_bytes.all.peak",
)


class Counters:
    """The device's allocator counters (zeros on the CPU): ``[allocated, window peak, reserved, reserved peak]``."""

    def __init__(self, smoke: bool) -> None:
        self.cuda = not smoke

    def read(self) -> list[int]:
        """The four counters now, the peaks since the last reset; then the peaks are reset.

        Returns:
            ``[memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved]``.
        """
        if not self.cuda:
            return [0, 0, 0, 0]
        allocated = int(torch.cuda.memory_allocated())
        values = [
            allocated,
            max(int(torch.cuda.max_memory_allocated()), allocated),
            int(torch.cuda.memory_reserved()),
            int(torch.cuda.max_memory_reserved()),
        ]
        torch.cuda.reset_peak_memory_stats()
        return values


def _to(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(t.to(device) for t in batch)


def _forward_context(case: Case, device: str) -> Any:
    if case.precision == "bf16-mixed":  # a plain loop's autocast, its cache on, as the dry run's plain loop
        return torch.autocast(device, dtype=torch.bfloat16)
    return torch.autocast(device, enabled=False)


def _process_group(smoke: bool) -> Any:
    """A one-rank group over a file store: NCCL on the device, gloo on the CPU."""
    import torch.distributed as dist

    store = os.path.join(tempfile.mkdtemp(prefix="gpu_check_store_"), "store")
    backend = "gloo" if smoke else "nccl"
    if not smoke:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return dist


def _shard(model: torch.nn.Module, device: str) -> str:
    """FSDP2 as the prediction shards a plain module: each block of its longest ModuleList, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_memtenants.predict.cluster import blocks_of

    mesh = init_device_mesh(device, (1,))
    blocks = blocks_of(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return f"fully_shard on {len(blocks)} blocks and the root"


def measure(case: Case, smoke: bool, fsdp: bool, alone: bool = False) -> dict[str, Any]:
    """Train ``case`` for two steps on the device and read the counters at each phase.

    Args:
        case: the set-up.
        smoke: the CPU and tiny sizes.
        fsdp: shard with FSDP2 over a one-rank group first.
        alone: no other process of ours uses the device meanwhile, so the change in the device's used memory
            (nvidia-smi's) from this process's start to its end is its footprint.

    Returns:
        ``{"setup": [4 counters], "steps": [{phase: [4 counters]}], "max_allocated_bytes", "max_reserved_bytes",
        "end_reserved_bytes", "stats", "nvidia_smi"...}``.
    """
    device = "cpu" if smoke else "cuda"
    counters = Counters(smoke)
    device_before = device_used_bytes()  # before this process touches CUDA: the device without it
    dist = _process_group(smoke) if fsdp else None
    out: dict[str, Any] = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    model = case.build(smoke).to(device)
    if fsdp:
        out["sharding"] = _shard(model, device)
    batch = _to(case.batch(smoke), device)
    optimizer = case.make_optimizer(model.parameters())
    out["setup"] = counters.read()
    steps: list[dict[str, list[int]]] = []
    loss = None
    for _ in range(STEPS):
        phases: dict[str, list[int]] = {}
        optimizer.zero_grad(set_to_none=True)
        phases["batch_start"] = counters.read()
        with _forward_context(case, device):
            loss = case.loss(model, batch)
        phases["before_backward"] = counters.read()
        loss.backward()
        phases["after_backward"] = counters.read()
        phases["before_optimizer_step"] = counters.read()
        optimizer.step()
        phases["batch_end"] = counters.read()
        steps.append(phases)
    if not smoke:
        torch.cuda.synchronize()
    out["steps"] = steps
    windows = [out["setup"], *(p for s in steps for p in s.values())]
    out["max_allocated_bytes"] = max(w[1] for w in windows)
    out["max_reserved_bytes"] = max(w[3] for w in windows)
    out["steps_max_allocated_bytes"] = [max(p[1] for p in s.values()) for s in steps]
    out["steps_max_reserved_bytes"] = [max(p[3] for p in s.values()) for s in steps]
    out["end_reserved_bytes"] = int(torch.cuda.memory_reserved()) if not smoke else 0
    if not smoke:
        stats = torch.cuda.memory_stats()
        out["stats"] = {k: stats.get(k) for k in STATS}
    out["nvidia_smi"] = nvidia_smi()
    device_after = device_used_bytes()
    out["nvidia_smi_process_bytes"] = out["nvidia_smi"].get("used_bytes")
    delta = None if device_before is None or device_after is None else device_after - device_before
    out["nvidia_smi_device_delta_bytes"] = delta  # this process's whole footprint where it ran alone
    out["nvidia_smi_bytes"] = (
        out["nvidia_smi_process_bytes"] if out["nvidia_smi_process_bytes"] is not None else (delta if alone else None)
    )
    del model, optimizer, batch, loss
    if dist is not None:
        dist.destroy_process_group()
    return out


def device_used_bytes() -> int | None:
    """The device's used memory as nvidia-smi reads it (every process's), or ``None`` without nvidia-smi.

    Returns:
        Bytes (nvidia-smi's MiB times 2**20).
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return int(done.stdout.split()[0]) * MiB
    except Exception:
        return None


def nvidia_smi() -> dict[str, Any]:
    """nvidia-smi's used memory of this process (the CUDA context and NCCL's buffers included), where it runs.

    Returns:
        ``{"available": False}`` without nvidia-smi, else its rows, this process's pid and ``used_bytes`` (None
        where nvidia-smi does not list the pid: a container's own pid namespace).
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"available": False}
    try:
        done = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except Exception as error:
        return {"available": True, "error": f"{type(error).__name__}: {error}"}
    rows = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            rows.append([int(parts[0]), int(parts[1])])
    mine = [mib for pid, mib in rows if pid == os.getpid()]
    return {
        "available": True,
        "pid": os.getpid(),
        "rows": rows,
        "used_bytes": mine[0] * MiB if mine else None,
        "stderr": done.stderr[-500:],
    }


def reserved_peak(report: Any) -> int | None:
    """The report's predicted ``max_memory_reserved``: ``peak_reserved_bytes``, else the phases' largest.

    Args:
        report: a ``StepReport``.

    Returns:
        Bytes, or ``None`` where the report has no reserved figure.
    """
    peak = getattr(report, "peak_reserved_bytes", None)
    if peak is not None:
        return int(peak)
    values = [p.reserved_bytes for p in report.phases.values() if p.reserved_bytes is not None]
    return max(values) if values else None


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def footprint(made: Any, report: Any, target: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """What nvidia-smi will show, predicted: ``predict.footprint.device_footprint`` for this build's CUDA version.

    Args:
        made: the ``Prediction`` (its own ``footprint``, for the default CUDA version, is the fallback).
        report: the step whose reserved peak is the highest.
        target: the compute capability predicted for.
        options: the prediction's options (``strategy``, ``world_size``).

    Returns:
        Its parts as JSON-able values and ``total_bytes``; ``None`` where neither exists (another part of issue
        #30 adds them).
    """
    result, how, error = None, "", None
    try:
        from lightning_memtenants.predict.cuda_model import resolve_target
        from lightning_memtenants.predict.footprint import device_footprint

        candidates = {
            "target": resolve_target(target),
            "world_size": options.get("world_size", 1),
            "strategy": options.get("strategy"),
            "cuda_version": torch.version.cuda,
        }
        accepted = inspect.signature(device_footprint).parameters
        result = device_footprint(report, **{k: v for k, v in candidates.items() if k in accepted})  # type: ignore[arg-type]
        how = f"device_footprint(report of the highest reserved peak, cuda_version={torch.version.cuda!r})"
    except Exception as failure:
        error = f"{type(failure).__name__}: {str(failure)[:300]}"
    if result is None:
        result = getattr(made, "footprint", None)
        how = "the prediction's own footprint (last step, the default CUDA version)"
    if result is None:
        return {"error": error} if error else None
    total = getattr(result, "total_bytes", None)
    return {
        "how": how,
        "result": _jsonable(result),
        "total_bytes": total if isinstance(total, int) else None,
        "error": error,
    }


def prediction(case: Case, smoke: bool, fsdp: bool, target: str, allocator: str | None) -> dict[str, Any]:
    """The dry run of the same two steps for this device, every figure the comparison needs.

    Args:
        case: the set-up.
        smoke: tiny sizes.
        fsdp: ``strategy="fsdp", world_size=1``.
        target: the compute capability, ``"9.0"``.
        allocator: ``PYTORCH_CUDA_ALLOC_CONF``'s text for ``predict(allocator=...)``, or ``None``.

    Returns:
        ``{"peak_bytes", "peak_reserved_bytes", "steps": [...], "notes", "seconds"...}``.
    """
    import time

    options: dict[str, Any] = {
        "loss_fn": case.loss,
        "optimizer": case.make_optimizer,
        "precision": case.precision,
        "target": target,
        "steps": STEPS,
    }
    if fsdp:
        options.update(strategy="fsdp", world_size=1)
    out: dict[str, Any] = {"allocator": allocator}
    if allocator is not None:
        options["allocator"] = allocator
    begin = time.perf_counter()
    try:
        made = dry_run(lambda: case.build(smoke), case.batch(smoke), **options)  # type: ignore[arg-type]
    except TypeError as error:
        if "allocator" not in str(error):
            raise
        options.pop("allocator")
        out["allocator_note"] = "predict() has no allocator option yet: predicted with the allocator's defaults"
        made = dry_run(lambda: case.build(smoke), case.batch(smoke), **options)  # type: ignore[arg-type]
    out["seconds"] = time.perf_counter() - begin
    steps = []
    for report in made.reports:
        steps.append(
            {
                "peak_bytes": report.peak_bytes,
                "peak_phase": report.peak_phase,
                "peak_reserved_bytes": reserved_peak(report),
                "tenants_bytes": dict(report.tenants_bytes),
                "parts_bytes": dict(report.parts_bytes),
                "phases": {
                    phase: [p.allocated_bytes, p.window_peak_bytes, p.reserved_bytes, dict(p.tenants_bytes)]
                    for phase in PHASES
                    if (p := report.phases.get(phase)) is not None
                },
            }
        )
    out["steps"] = steps
    out["peak_bytes"] = max(s["peak_bytes"] for s in steps if s["peak_bytes"] is not None)
    reserved = [s["peak_reserved_bytes"] for s in steps if s["peak_reserved_bytes"] is not None]
    out["peak_reserved_bytes"] = max(reserved) if reserved else None
    out["notes"] = list(made.notes)
    kept = {k: v for k, v in options.items() if k not in ("loss_fn", "optimizer")}
    highest = max(made.reports, key=lambda r: reserved_peak(r) or 0)
    out["footprint"] = footprint(made, highest, target, kept)
    out["footprint_bytes"] = (out["footprint"] or {}).get("total_bytes")
    return out


def child(kind: str, smoke: bool, target: str, write: Callable[[dict[str, Any]], None]) -> None:
    """The child for ``peak:``, ``fsdp:``, ``es-on:``, ``es-off:``, ``alone:`` and ``alone-fsdp:CASE``: measure,
    write, predict, write.

    Args:
        kind: the set-up.
        smoke: the CPU and tiny sizes.
        target: the compute capability predicted for.
        write: writes the child's JSON (called twice, so a prediction that fails keeps the measurement).
    """
    mode, _, name = kind.partition(":")
    case = CASES[name]
    fsdp, alone = mode in ("fsdp", "alone-fsdp"), mode.startswith("alone")
    allocator = "expandable_segments:True" if mode == "es-on" else None
    what = case.what + (", FSDP2 over one rank" if fsdp else "") + (", alone on the device" if alone else "")
    data: dict[str, Any] = {"what": what, "kind": kind}
    data["measured"] = measure(case, smoke, fsdp, alone)
    write(data)
    try:
        data["predicted"] = prediction(case, smoke, fsdp, target, allocator)
    except Exception:
        data["error"] = "prediction failed: " + traceback.format_exc()[-3000:]
    write(data)
