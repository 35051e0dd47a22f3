"""Predict a training step's memory before running it: the user's own step, under fake tensors.

Fake tensors carry shapes, dtypes and storages but no data, so a whole step (forward,
backward and the optimizer) runs in a fraction of a real step's time and allocates nothing.
The same :class:`TenantMonitor` as in training measures it, with the live-tensor tracker as
its memory source, so the prediction is a :class:`StepReport` read exactly as ``cb.latest``.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Unpack

from lightning_memtenants._private import (
    hidden_saved_tensors_hooks,
    lightning_optimizers,
    logging_levels,
    result_collection,
    step_metrics,
)
from lightning_memtenants.analysis.engines import ddp_notes_and_part, sharding_notes
from lightning_memtenants.analysis.forecast import UNBOUNDED, PeakForecast, limit_bytes
from lightning_memtenants.checks import brief
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.sources import Reading, TrackerSource
from lightning_memtenants.core.storage import batch_elements, batch_tensors
from lightning_memtenants.core.timeline import StepTimeline, timeline_of
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.predict.allocator import AllocatorSettings, CachingAllocatorModel
from lightning_memtenants.predict.cluster import (
    Parallel,
    StepModule,
    collective_waits,
    ddp_forward,
    fake_group,
    gloo_scratch,
    has_configure_model,
    parallel_of,
    rank_classes,
    shard,
    top_level_calls,
    wrap_ddp,
)
from lightning_memtenants.predict.compiled import predict_compiled
from lightning_memtenants.predict.cuda_kernels import (
    CudaKernels,
    attention_note,
    fused_attention_rewrite,
    recurrent_note,
)
from lightning_memtenants.predict.cuda_model import (
    HOST_OPS,
    OUTSIDE_ALLOCATOR,
    CublasWorkspaces,
    CudaTarget,
    cuda_optimizer_defaults,
    host_state_names,
    resolve_gpu,
    resolve_target,
)
from lightning_memtenants.predict.fake import (
    PRECISIONS,
    check_precision,
    eager,
    fake_batch,
    fake_module,
    fake_session,
    forward_context,
    preserved_globals,
    preserving_globals,
)
from lightning_memtenants.predict.footprint import DeviceFootprint, device_footprint
from lightning_memtenants.predict.kernels import CpuKernels, cpu_kernels
from lightning_memtenants.predict.routing import Routing, check_routing
from lightning_memtenants.predict.streams import (
    RoutedStreams,
    cuda_streams_routed,
    current_stream,
    reserved_by_stream_bytes,
    streams_note,
)
from lightning_memtenants.predict.values import RANDOM_ELEMENTS, KnownValues, unknown_value_error, unknown_value_in
from lightning_memtenants.units import parse_bytes

# The plain device names ``target`` takes; it also takes a GPU by name or compute capability (``resolve_target``).
TARGETS = ("cpu", "cuda")

ModelArg = nn.Module | Callable[[], nn.Module]

# What a cluster's prediction leaves out, or models, of the backend its collectives run on.
NCCL_NOTE = (
    "NCCL's own buffers are in no figure of the report: its communicators allocate their channels outside PyTorch's"
    " caching allocator (often a few hundred MiB a process, set by NCCL_BUFFSIZE and the channel count); the"
    " prediction's footprint, what nvidia-smi will show, estimates them from NCCL's defaults"
)
GLOO_NOTE = (
    "collectives are modelled as gloo runs them on the CPU: a reduce-scatter copies its whole input while it runs;"
    " gloo's worker thread may hold a finished collective's buffer a moment longer, which a real window then reads"
)
REBUILD_NOTE = (
    "DDP rebuilds its buckets once, in the second step's forward; with gradient_as_bucket_view=True the old and"
    " new buckets are briefly both alive, which this prediction does not model (that forward's window may read"
    " up to twice the buckets' bytes more)"
)
BatchArg = Any


class PredictOptions(TypedDict, total=False):
    """The options of every prediction, declared once: :func:`predict`, :func:`dry_run`, :func:`sweep` and
    :func:`largest_batch_size` all take them as keywords, each optional (its default in :data:`DEFAULTS`).

    Keys:
        loss_fn: ``loss_fn(model, batch) -> loss`` for a plain ``nn.Module``; ``None`` (the default) runs a
            LightningModule's own ``training_step``.
        optimizer: ``optimizer(params) -> Optimizer``; ``None`` (the default) runs a LightningModule's
            ``configure_optimizers``, else ``torch.optim.Adam``.
        precision: a Lightning precision name, a key of ``PRECISIONS`` (default ``"32-true"``).
        steps: how many steps to run; the report is of the last (default 1).
        target: the device predicted for (default ``"cpu"``): ``"cpu"``, ``"cuda"`` (an A100), or a
            GPU by name (``"A6000"``, ``"H100"``) or compute capability (``"8.6"``, ``"sm_90"``), also
            written ``"cuda:A6000"``.
        gpu: deprecated, to be removed in the next release: the GPU for ``target="cuda"``; write
            ``target="A6000"`` instead of ``target="cuda", gpu="A6000"``.
        accumulate_grad_batches: micro-batches per optimizer step, as the Trainer's argument (default 1):
            each step runs ``batch`` this many times, gradients kept between them, in Lightning's order.
        strategy: ``None`` (the default: one device), ``"ddp"`` or ``"fsdp"`` (FSDP2's ``fully_shard``), or a
            Lightning ``DDPStrategy`` / ``ModelParallelStrategy`` whose settings are read; every rank is
            predicted in this process, over a fake process group of ``world_size`` ranks.
        world_size: the ranks of ``strategy`` (default 1; more than 1 needs a strategy).
        tensor_parallel: the ranks of one tensor-parallel group (default 1): under ``strategy="fsdp"`` the mesh is
            ``(world_size // tensor_parallel, tensor_parallel)``, and the model's ``configure_model`` applies its
            plan over ``self.device_mesh["tensor_parallel"]``; a ``ModelParallelStrategy`` gives its own.
        routing: the routing assumed where a mixture of experts' router chooses from values a dry run does not
            have (``topk``, ``argmax`` or ``max`` indices over fake logits): ``"balanced"`` (the default, each expert
            gets tokens x top_k / experts), ``"worst"`` (every token the same top_k experts),
            ``{"capacity_factor": f}``, ``{"counts": [...]}`` per expert (or a list of them, one per router call),
            or a ``Routing``; see ``lightning_memtenants.predict.routing``. A report whose shapes followed it says
            so in its notes. Random draws in the step of up to 1,024 elements (LayerDrop's) are drawn for real,
            under ``torch.random.fork_rng``.
        allocator: the CUDA caching allocator's settings for a GPU target: a ``PYTORCH_CUDA_ALLOC_CONF`` string
            (``"expandable_segments:True"``, ``"max_split_size_mb:512,garbage_collection_threshold:0.8"``) or an
            ``AllocatorSettings``; ``None`` (the default) reads them from the environment (``PYTORCH_ALLOC_CONF``,
            else ``PYTORCH_CUDA_ALLOC_CONF``), as torch does. The notes say which settings were assumed. Given with
            ``target="cpu"`` it is refused: it applies to a GPU target.
    """

    loss_fn: Callable[[nn.Module, Any], Tensor] | None
    optimizer: Callable[..., Optimizer] | None
    precision: str
    steps: int
    target: str
    gpu: str | None
    accumulate_grad_batches: int
    strategy: Any
    world_size: int
    tensor_parallel: int
    routing: Any
    allocator: str | AllocatorSettings | None


DEFAULTS: PredictOptions = {
    "loss_fn": None,
    "optimizer": None,
    "precision": "32-true",
    "steps": 1,
    "target": "cpu",
    "gpu": None,
    "accumulate_grad_batches": 1,
    "strategy": None,
    "world_size": 1,
    "tensor_parallel": 1,
    "routing": "balanced",
    "allocator": None,
}


@dataclass
class Prediction:
    """Everything a dry run produced: one report per step, and what was assumed on the way.

    A forecast over batch sizes needs each run's batch size and elements beside its report, and a
    reader needs the assumptions (a precision run differently, a GPU modelled), so they are kept together.

    Args:
        reports: one report per step, in order.
        batch_elements: elements of the batch's tensors.
        batch_bytes: bytes of the batch's tensors.
        batch_size: the leading size of the batch's first tensor (1 for a scalar).
        notes: what the prediction assumed, also in every report's notes.
        ranks: under a ``strategy``, every rank's last report, in rank order (``reports`` are rank 0's); else the
            last report alone.
        reserved_by_stream_bytes: for a GPU target, what the caching allocator's pool of each stream reserved at the
            end of the last step, by the stream's name (``"default"``, ``"FSDP all-gather copy-in"``,
            ``"FSDP reduce-scatter"``, ``"side stream 1"``...), rank 0's under a strategy; empty for the CPU.
        footprint: for a GPU target, what nvidia-smi will show for the last step (rank 0's under a strategy): the
            reserved peak, the CUDA context and NCCL's buffers, and their sum (``total_bytes``); None for the CPU.
        footprints: for a GPU target, each rank's, in rank order (the ranks that hold the same share one); empty
            for the CPU.
    """

    reports: list[StepReport]
    batch_elements: int
    batch_bytes: int
    batch_size: int
    notes: list[str] = field(default_factory=list)
    ranks: list[StepReport] = field(default_factory=list)
    reserved_by_stream_bytes: dict[str, int] = field(default_factory=dict)
    footprint: DeviceFootprint | None = None
    footprints: list[DeviceFootprint] = field(default_factory=list)

    @property
    def report(self) -> StepReport:
        """The last step's report (the first step, with ``steps=1``)."""
        return self.reports[-1]

    @property
    def timeline(self) -> StepTimeline:
        """The last step's memory timeline: allocated bytes over its operators, stacked by tenant."""
        found = timeline_of(self.report)
        assert found is not None, "every dry-run step records its timeline"
        return found


@preserving_globals
def predict(model: ModelArg, batch: BatchArg, **options: Unpack[PredictOptions]) -> StepReport:
    """The memory report of a training step, predicted under fake tensors with no real memory.

    A step run on fake tensors allocates nothing, so a model too big for this machine, or a GPU
    this machine does not have, can be planned for before renting one. This is :func:`dry_run`'s
    last report.

    The user's step runs under fake tensors, on a copy of the model, and every global state is left as it
    was: see :func:`dry_run` for what runs again and what is shared.

    Args:
        model: a LightningModule (its own ``training_step`` and ``configure_optimizers`` run), a
            plain ``nn.Module`` with ``loss_fn`` (and ``optimizer``, default ``torch.optim.Adam``), or a
            zero-argument callable that builds either; a callable is built under fake tensors, so a
            model too big for this machine costs nothing. Nothing of the caller's model is changed:
            its parameters are copied as fake tensors.
        batch: real tensors, meta tensors or ``torch.Size`` shapes standing for tensors, or a
            callable that builds the batch (given the fake model if it takes one argument).
        **options: see :class:`PredictOptions`: ``loss_fn``, ``optimizer``, ``precision``, ``steps``
            (``steps=1`` shows the first optimizer step, where the optimizer state is born;
            ``steps=2`` a steady-state step), ``target`` (``"cpu"``, ``"cuda"``, ``"A6000"``,
            ``"cuda:H100"``, ``"8.6"``...) and the deprecated ``gpu``.

    Returns:
        The report of the last step, read exactly as ``cb.latest`` in training.

    Raises:
        ValueError: naming the argument, for a bad model, batch or option.
        TypeError: for an option that does not exist.

    Example::

        report = predict(SeedMLP(), (torch.Size([2048, 1024]),), target="A6000")
        report.peak_bytes, report.tenants_bytes["activations"]
    """
    return dry_run(model, batch, **options).report


@preserving_globals
def dry_run(model: ModelArg, batch: BatchArg, **options: Unpack[PredictOptions]) -> Prediction:
    """Run the user's training step under fake tensors, measured by the same monitor as in training.

    The one implementation behind :func:`predict`, :func:`sweep` and :func:`largest_batch_size`;
    call it for every step's report and the assumptions made on the way.

    The user's step runs under fake tensors: what it does that reads no tensor value runs again, each
    time (a ``print``, a counter, a line written to a log file). The caller's objects are not changed:
    the step runs on a copy of the model whose tensors are fakes and whose containers (lists, dicts) are
    copies, so a list the step appends to stays as it was; other objects the model holds (a numpy array, a
    Dataset) are shared, not copied, and left as they are unless the step itself changes them. Python's,
    numpy's and torch's random generators, the modes, the saved-tensor hooks, the default dtype, grad mode,
    autocast and the deterministic flag are as they were on return.

    Args:
        model: as for :func:`predict`.
        batch: as for :func:`predict`.
        **options: see :class:`PredictOptions`.

    Returns:
        Every step's report, the batch's size, and the notes on what was assumed.

    Raises:
        ValueError: naming the argument, for a bad model, batch or option; ``gpu`` with a target
            other than ``"cuda"``.
        TypeError: for an option that does not exist.

    Warns:
        DeprecationWarning: for ``gpu``, saying what to write instead.
    """
    return _frozen(model, batch, options, timeline=True)


def _frozen(
    model: ModelArg,
    batch: BatchArg,
    options: PredictOptions,
    *,
    timeline: bool,
    prepare: Callable[[nn.Module], None] | None = None,
) -> Prediction:
    """A dry run with the collector frozen; ``timeline=False`` for a search that reads only the peak.

    ``prepare`` changes the fake model before it runs (a fix under test, say), as it would change the real one.
    """
    # no full collection walks the caller's objects in the middle of a dry run; a caller's own freeze is left alone
    frozen = gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    try:
        # every dry run leaves the process's global state as it found it (a later answer of sweep's forecast too);
        # the caller's own saved-tensor hooks are not called on our fake tensors; a step trains with grad on, as
        # Lightning's fit loop turns it on, whatever the caller's mode
        with preserved_globals(), hidden_saved_tensors_hooks(), torch.enable_grad():
            return _dry_run(model, batch, options, timeline, prepare)
    finally:
        if frozen:
            gc.unfreeze()


def _dry_run(
    model: ModelArg,
    batch: BatchArg,
    options: PredictOptions,
    timeline: bool,
    prepare: Callable[[nn.Module], None] | None = None,
) -> Prediction:
    """:func:`dry_run`'s body: one device, or each class of ranks of a strategy once."""
    settings = _settings(model, batch, options)
    parallel = settings.parallel
    if parallel is None:
        only = _one_rank(model, batch, settings, timeline, prepare, None).prediction
        only.ranks = [only.report]
        return _with_footprints(only, settings)
    first = _one_rank(model, batch, settings, timeline, prepare, _Rank(parallel, 0))
    assert first.classes is not None
    by_rank: dict[int, StepReport] = {}
    for group in first.classes:
        leader = _Rank(parallel, group[0])
        done = first if group[0] == 0 else _one_rank(model, batch, settings, timeline, prepare, leader)
        for rank in group:
            by_rank[rank] = done.prediction.report
    prediction = first.prediction
    prediction.ranks = [by_rank[rank] for rank in range(parallel.world_size)]
    return _with_footprints(prediction, settings)


def _with_footprints(prediction: Prediction, settings: _Settings) -> Prediction:
    """For a GPU target, what nvidia-smi will show on each rank (each class of ranks computed once)."""
    if settings.gpu is None:
        return prediction
    parallel = settings.parallel
    world_size, strategy = (1, None) if parallel is None else (parallel.world_size, parallel.strategy)
    found: dict[int, DeviceFootprint] = {}
    for report in prediction.ranks:
        if id(report) not in found:
            found[id(report)] = device_footprint(report, settings.gpu, world_size=world_size, strategy=strategy)
    prediction.footprints = [found[id(report)] for report in prediction.ranks]
    prediction.footprint = prediction.footprints[0]
    return prediction


@dataclass
class _Rank:
    """The rank a dry run plays, and, once the first rank has run, the classes of ranks that hold the same."""

    parallel: Parallel
    rank: int


@dataclass
class _RankRun:
    prediction: Prediction
    classes: list[list[int]] | None


def _one_rank(
    model: ModelArg,
    batch: BatchArg,
    settings: _Settings,
    timeline: bool,
    prepare: Callable[[nn.Module], None] | None,
    rank: _Rank | None,
) -> _RankRun:
    """One dry run: the whole step on one device, or as one rank of a cluster over a fake process group."""
    group: Any = (
        contextlib.nullcontext()
        if rank is None
        else fake_group(rank.parallel.world_size, rank.rank, rank.parallel.tensor_parallel)
    )
    # for a GPU, the allocator model follows the stream of each allocation: FSDP2's, and the step's own torch.cuda
    # streams, routed to the CPU's stream stubs for this dry run only
    allocator = _allocator_model(settings.allocator) if settings.gpu is not None else None
    streams: Any = contextlib.nullcontext() if allocator is None else cuda_streams_routed(allocator)
    with group as mesh, streams as routes:
        return _run(model, batch, settings, timeline, prepare, rank, mesh, allocator, routes)


def _run(
    model: ModelArg,
    batch: BatchArg,
    settings: _Settings,
    timeline: bool,
    prepare: Callable[[nn.Module], None] | None,
    rank: _Rank | None,
    mesh: Any,
    allocator: CachingAllocatorModel | None = None,
    routes: RoutedStreams | None = None,
) -> _RankRun:
    """:func:`_one_rank`'s body, inside the fake group where there is one (and the routed streams, for a GPU)."""
    loss_fn, optimizer, precision, gpu_target = settings.loss_fn, settings.optimizer, settings.precision, settings.gpu
    notes: list[str] = []
    if precision == "16-mixed" and gpu_target is None:
        precision = "bf16-mixed"
        notes.append("16-mixed on the CPU runs as bf16-mixed, as Lightning does there")
    param_dtype, autocast_dtype = PRECISIONS[precision]
    with fake_session() as mode:
        fake = fake_module(model, mode, param_dtype, notes)
        fake.train()
        if prepare is not None:
            prepare(fake)
        lightning = loss_fn is None and _is_lightning(fake)
        if loss_fn is None and not lightning:
            raise ValueError("loss_fn is required for a plain nn.Module: loss_fn(model, batch) -> loss tensor")
        classes = None
        wrapped = None
        if rank is not None:
            notes.append(f"rank {rank.rank} of {rank.parallel.name}, predicted over a fake process group")
            if rank.parallel.strategy == "fsdp":
                called = _called_by_step(fake, batch, param_dtype, mode, settings.routing) if lightning else None
                notes.append(f"FSDP2: {shard(fake, mesh, lightning=lightning, called=called)}")
        faked = fake_batch(batch, fake, param_dtype, notes)
        elements, batch_bytes = batch_elements(faked)
        optimizers = _optimizers(fake, optimizer, lightning)
        if rank is not None:
            classes = rank_classes(fake, rank.parallel, optimizers)
        if rank is not None and rank.parallel.strategy == "ddp":  # built before the step, as Lightning's setup does
            wrapped = wrap_ddp(StepModule(fake, _step_runner(fake, lightning, loss_fn)), rank.parallel)
        if gpu_target is None:
            source = TrackerSource("cpu", scan=False, count_fake=True)
        else:  # CUDA modelled on the CPU: fake CUDA tensors cannot go through autograd on a CPU-only build
            label = f"predicted for CUDA ({gpu_target.name}): fake tensors and a model of the caching allocator"
            assert allocator is not None and routes is not None, "a GPU target has its allocator model"
            source = _PredictedCuda(
                "cpu",
                scan=False,
                host_ops=HOST_OPS,
                label=label,
                allocator=allocator,
                count_fake=True,
            )
            routes.settle = source.tracker.settle  # a synchronize in the step sees the frees made before it
        # compiled parts run as inductor's code allocates (predict/compiled.py) or eagerly: the tracker sees them
        source.sees_compiled_code = True
        compiled = predict_compiled(fake, model if isinstance(model, nn.Module) else None, gpu_target is not None)
        notes.extend(compiled.notes)
        # on a GPU the step counters are host tensors (the tracker's HOST_OPS): in no tenant, nor the formula
        host_state = host_state_names if gpu_target is not None else None
        monitor = TenantMonitor(fake, optimizers, source=source, warn=_raise, host_state=host_state)
        monitor.record_timeline = timeline
        threads: Any = contextlib.nullcontext()
        if gpu_target is not None:
            threads = CublasWorkspaces(source.tracker, gpu_target.workspace_bytes())
            monitor.add_part("cublas_workspace", lambda: threads.bytes)
            monitor.add_part("allocator_rounding", lambda: source.tracker.rounding_bytes)
            notes.append(
                f"predicted for CUDA on {gpu_target.name} (compute capability {gpu_target.capability[0]}."
                f"{gpu_target.capability[1]}): blocks rounded to 512 bytes, a cuBLAS workspace of"
                f" {threads.workspace_bytes:,} bytes per thread that multiplies matrices"
            )
            for opt in optimizers:
                notes.extend(cuda_optimizer_defaults(opt))
            notes.append(_allocator_note(settings))
            notes.append(OUTSIDE_ALLOCATOR)
        if rank is not None:
            notes.extend(sharding_notes(fake, rank.parallel.world_size))
            notes.append(NCCL_NOTE if gpu_target is not None else GLOO_NOTE)
            if rank.parallel.strategy == "ddp" and rank.parallel.gradient_as_bucket_view:
                notes.append(REBUILD_NOTE)
            ddp_notes, buckets = ddp_notes_and_part(wrapped, lambda: monitor.measure)
            notes.extend(ddp_notes)
            if buckets is not None:
                monitor.add_part("ddp_buckets", buckets)
        for note in notes:
            monitor.add_note(note)
        forward = forward_context(param_dtype, autocast_dtype, cache=not lightning)
        reports = []
        # a router's unknown choice follows the assumed routing; the step's small random draws are real (forked)
        known = KnownValues(mode, source.tracker, random=True, random_limit=RANDOM_ELEMENTS, routing=settings.routing)
        kernels: Any = CpuKernels()  # CTC loss, whose outputs no fake kernel can size
        if gpu_target is None:  # the CPU's dtypes where the fake kernels differ, before the tracker counts them
            source.tracker.rewrite = cpu_kernels if rank is None else gloo_scratch(source.tracker, cpu_kernels)
        else:  # CUDA's attention kernels, dropout masks and autocast lists, and the fused kernels' scratch
            kernels = CudaKernels(gpu_target.capability, source.tracker)
            forward = _clearing(forward, kernels)
            source.tracker.rewrite = fused_attention_rewrite(source.tracker)
            if rank is not None:  # DTensor's collectives' waits return their tensor, as for real
                source.tracker.rewrite = collective_waits(source.tracker.rewrite)
        logs = _Logs() if lightning else None  # what the Trainer keeps of self.log, from batch to batch
        try:
            with threads, eager(), torch.random.fork_rng(devices=[]), known, kernels:
                detach = logs.attach(fake) if logs is not None else None
                try:
                    for index in range(settings.steps):
                        step = _step(
                            fake, faked, index, optimizers, monitor, forward, loss_fn, lightning, threads,
                            accumulate=settings.accumulate, ddp=wrapped, logs=logs,
                        )  # fmt: skip
                        reports.append(step)
                finally:  # the tracker's dispatch mode leaves first (it is above the cuBLAS one), whatever was raised
                    monitor.close()
                    if detach is not None:
                        detach()
        except Exception as error:
            unknown = unknown_value_in(error, source.tracker)
            if unknown is not None:  # one sentence naming the line, never torch's exception or the monitor's
                raise unknown_value_error(unknown, "the training step") from None
            if rank is not None and rank.parallel.strategy == "fsdp" and MIXED_DTENSOR in str(error):
                raise ValueError(_mixed_dtensor(error)) from None
            raise
    if isinstance(kernels, CudaKernels) and kernels.kernels:
        note = attention_note(kernels.kernels, gpu_target)
        notes.append(note)
        for report in reports:
            report.notes.append(note)
    if isinstance(kernels, CudaKernels) and kernels.recurrent:
        note = recurrent_note(kernels.recurrent, gpu_target)
        notes.append(note)
        for report in reports:
            report.notes.append(note)
    for note in [*_value_notes(known, settings.routing), *compiled.refusals()]:
        notes.append(note)
        for report in reports:
            report.notes.append(note)
    by_stream: dict[str, int] = {}
    if allocator is not None:
        assert routes is not None, "a GPU target's streams are routed"
        by_stream = reserved_by_stream_bytes(allocator, fake, routes.default)
        note = streams_note(by_stream)
        notes.append(note)
        for report in reports:
            report.notes.append(note)
    prediction = Prediction(reports, elements, batch_bytes, _leading_size(faked), notes)
    prediction.reserved_by_stream_bytes = by_stream
    return _RankRun(prediction, classes)


def _allocator_note(settings: _Settings) -> str:
    """The notes' sentence on the caching allocator's settings assumed, and where they came from."""
    assert settings.allocator is not None, "a GPU target has its allocator settings"
    note = (
        f"allocator settings assumed: {settings.allocator.describe()} ({settings.allocator_from}); every"
        " allocation in the pool of the stream it was made on, and the events of blocks used on other streams"
        " taken as complete at each phase boundary and at the step's own synchronize calls"
    )
    if settings.allocator.gc_active:
        note += "; garbage_collection_threshold is not applied: a dry run does not know the GPU's memory"
    return note


class _PredictedCuda(TrackerSource):
    """The tracker as the source of a GPU-target dry run, the allocator model's events completed at each boundary.

    The GPU is taken to have caught up with the host at each of the callback's phase boundaries: a block freed
    after ``record_stream`` on another stream is free again for its own stream's next window.
    """

    def read(self) -> Reading:
        """The tracker's reading (:meth:`TrackerSource.read`), then the allocator model's events completed."""
        reading = super().read()
        allocator = self.tracker.allocator
        if allocator is not None and reading.allocated_bytes is not None:
            allocator.synchronize()
        return reading


# DTensor's refusal of an operator given a DTensor and a plain tensor, as a real FSDP2 run raises it
MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"


def _mixed_dtensor(error: BaseException) -> str:
    """The sentence for a step that a real FSDP2 run fails too: a sharded parameter's DTensor met a plain tensor."""
    operator = str(error).split(MIXED_DTENSOR)[0].strip() or "an operator"
    return (
        f"strategy='fsdp': the training step gives {operator} a DTensor and a plain tensor, which a real FSDP2 run"
        " refuses the same way: a tensor made from a parameter outside the sharded modules' forward (as"
        " `next(self.model.parameters()).new_zeros(...)` in training_step) is a DTensor shard, not a tensor; make"
        " it from the batch, or inside the model's forward"
    )


def _called_by_step(
    fake: nn.Module, batch: BatchArg, param_dtype: Any, mode: Any, routing: Routing
) -> list[str] | None:
    """The modules a LightningModule's ``training_step`` calls (see ``top_level_calls``): FSDP2's roots.

    Run once, without gradients, on a copy of the fake model that shares its fake tensors, so the copy's
    attributes made in the step (a cache) are not the dry run's; None where ``configure_model`` shards it. The
    constants are real as in the step itself (``KnownValues``: a causal mask's check branches on them), its random
    draws from a fork of the generator, and the kernels no fake kernel sizes (CTC loss) run as in the step.
    """
    if has_configure_model(fake):
        return None
    probe = fake_module(fake, mode)
    probe_batch = fake_batch(batch, probe, param_dtype, [])
    known = KnownValues(mode, random=True, random_limit=RANDOM_ELEMENTS, routing=routing)
    with eager(), torch.random.fork_rng(devices=[]), known, CpuKernels():
        calls = top_level_calls(probe, lambda: probe.training_step(probe_batch, 0))  # type: ignore[operator]
    return calls


def _value_notes(known: KnownValues, routing: Routing) -> list[str]:
    """What the step's values assumed: the routing its router's choices followed, random draws taken for real."""
    notes = []
    if known.routed:
        notes.append(
            f"mixture of experts: the router's choices ({known.router_calls} call(s) of topk, argmax or max over"
            f" values a dry run does not have) were assumed to follow {routing.describe()}; the tokens each expert"
            " receives, and every size after them, are those of a real run with that routing (pass routing= for"
            " another)"
        )
    if known.drew:
        notes.append(
            "the step's small random draws (a layer drop's torch.rand, say) were drawn for real from a fork of the"
            " generator, so the path they chose is one a real run may take, not the only one"
        )
    return notes


def _step_runner(module: nn.Module, lightning: bool, loss_fn: Any) -> Callable[[Any, int], Any]:
    """What the step's forward runs: the LightningModule's ``training_step``, or the caller's ``loss_fn``."""
    if lightning:
        return lambda batch, index: module.training_step(batch, index)  # type: ignore[operator]
    return lambda batch, index: loss_fn(module, batch)


def _clearing(forward: Callable[[], Any], kernels: CudaKernels) -> Callable[[], Any]:
    """The forward's context, which forgets CUDA autocast's cast weights on leaving, as torch.autocast does."""

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        try:
            with forward():
                yield
        finally:
            kernels.clear_cache()

    return context


@preserving_globals
def sweep(
    model: ModelArg,
    make_batch: Callable[[int], Any],
    batch_sizes: Sequence[int] = (1, 2),
    **options: Unpack[PredictOptions],
) -> tuple[PeakForecast, list[Prediction]]:
    """Predict at several batch sizes and fit the peak forecast: the largest batch for a budget, with no GPU.

    The forecast is the same as training fits from measured steps, so a plan made before training
    reads the same as one made during it. Its answers are exact: it keeps the model and
    ``make_batch``, so that ``forecast.max_batch_size`` is :func:`largest_batch_size`'s answer (the
    line only seeds the search) and ``forecast.predict_peak_bytes`` a dry run at that size.

    The user's step runs under fake tensors, on a copy of the model, and every global state is left as it
    was, after this call and after each of the forecast's later dry runs: see :func:`dry_run` for what runs
    again and what is shared.

    Args:
        model: as for :func:`predict`.
        make_batch: builds the batch for a batch size, as :func:`predict` takes it.
        batch_sizes: the sizes to predict at, positive integers.
        **options: see :class:`PredictOptions`, the same for every size; ``steps`` defaults to 2 here, so
            that each report is a steady-state step (the optimizer state and the previous gradients resident).

    Returns:
        The fitted forecast, and each size's prediction in order.

    Raises:
        ValueError: if ``make_batch`` is not a callable of the batch size that returns a batch, ``batch_sizes``
            is empty or holds anything but positive integers, or as :func:`dry_run`.

    Example::

        forecast, _ = sweep(SeedMLP(), lambda b: (torch.Size([b, 1024]),), (256, 512))
        forecast.max_batch_size("24GiB")  # 24 GiB less a 5% margin, as largest_batch_size answers
    """
    check_make_batch(make_batch)
    if len(batch_sizes) < 1 or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes!r}")
    options = {"steps": 2, **options}  # type: ignore[assignment]
    forecast = PeakForecast()
    predictions = []
    exact = _DryRunPeaks(model, make_batch, options, UNBOUNDED)
    for size in batch_sizes:
        prediction = dry_run(model, batch_at(make_batch, size), **options)
        forecast.observe(prediction.report, prediction.batch_elements, prediction.batch_bytes, size)
        exact.seen[size] = prediction.report.peak_bytes or 0
        exact.elements_per_sample = prediction.batch_elements / size
        predictions.append(prediction)
    forecast.exact = exact
    return forecast, predictions


@preserving_globals
def largest_batch_size(
    model: ModelArg,
    make_batch: Callable[[int], Any],
    budget_bytes: int | str,
    *,
    margin: float = 0.05,
    start: int = 1,
    limit: int = 2**24,
    **options: Unpack[PredictOptions],
) -> int:
    """The largest batch whose steady-state peak fits ``budget_bytes`` less the ``margin``: exact, by dry runs.

    The one rule of every answer to "what is the largest batch" (the callback's ``max_batch_size``,
    :func:`sweep`'s forecast, the command's ``--budget``): a step may reach
    ``Budget(budget_bytes, margin).limit_bytes``. A step's peak is a maximum of linear pieces in the
    batch size, and the piece that leads at small batches (the optimizer step, say) hides a steeper one
    that leads later (backward); so no line is trusted. The search reads the slope of the piece at a
    size off that size and the next, steps to where that piece meets the limit, and stops where a size
    fits and one more sample does not (halving where a step says nothing). Each size is one dry run;
    from a good ``start`` the answer takes two to four.

    The user's step runs under fake tensors, on a copy of the model, and every global state is left as it
    was: see :func:`dry_run` for what runs again and what is shared.

    Args:
        model: as for :func:`predict`.
        make_batch: builds the batch for a batch size, as :func:`predict` takes it.
        budget_bytes: the memory to fit: bytes, or a string like ``"24GiB"``.
        margin: the fraction of ``budget_bytes`` kept free, in [0, 1) (default 5%, the callback's); ``0`` fits
            ``budget_bytes`` itself.
        start: the first size to try, a positive integer (a good guess saves dry runs).
        limit: the largest size searched.
        **options: see :class:`PredictOptions`, the same for every size; ``steps`` defaults to 2 here, so that
            the steady-state step is what must fit (the first step holds no optimizer state in its forward
            and backward, and no previous gradients in its forward, so it fits larger batches).

    Returns:
        The largest batch size whose peak is at most the limit (``limit`` if that fits), or 0 if even a
        batch of 1 does not fit.

    Raises:
        ValueError: if ``make_batch`` is not a callable of the batch size that returns a batch, ``budget_bytes``
            not a positive number of bytes (at least 1) or such a string (as the callback's), ``margin`` not in
            [0, 1), ``start`` or ``limit`` not a positive integer, or as :func:`dry_run`.
    """
    check_make_batch(make_batch)
    budget = limit_bytes(parse_bytes(budget_bytes, "budget_bytes"), margin)
    for name, value in (("start", start), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    options = {"steps": 2, **options}  # type: ignore[assignment]
    return _DryRunPeaks(model, make_batch, options, limit).largest(budget, start)


MAKE_BATCH = "make_batch must be a callable of the batch size that returns a batch (as predict takes it)"


def check_make_batch(make_batch: Any) -> None:
    """``make_batch`` checked before any dry run: a callable, as :func:`sweep` and :func:`largest_batch_size` take.

    A batch itself (a tuple of tensors or shapes) where the callable belongs is the usual slip: it is named here,
    not at its first call.

    Args:
        make_batch: what the caller gave.

    Raises:
        ValueError: naming ``make_batch`` and what it accepts.
    """
    if not callable(make_batch):
        hint = " (a batch itself? write lambda n: ... of the batch size n)" if _holds_batch(make_batch) else ""
        raise ValueError(f"{MAKE_BATCH}, got {brief(make_batch)}{hint}")


def batch_at(make_batch: Callable[[int], Any], size: int) -> Any:
    """``make_batch(size)``, with one clear error where ``make_batch`` cannot be called so or returns no batch.

    A ``TypeError`` raised by the call itself (``tuple(8)``, a callable of no argument) is the caller's
    ``make_batch``, not its body; one raised inside the body is the caller's own error and goes through as it is.

    Args:
        make_batch: a callable of the batch size.
        size: the batch size.

    Returns:
        The batch, as :func:`predict` takes it.

    Raises:
        ValueError: naming ``make_batch``, where the call fails so or the result holds no tensor or shape.
    """
    try:
        batch = make_batch(size)
    except TypeError as error:
        if error.__traceback__ is not None and error.__traceback__.tb_next is None:
            raise ValueError(f"{MAKE_BATCH}, but make_batch({size}) raised TypeError: {error}") from None
        raise
    if not callable(batch) and not _holds_batch(batch):
        raise ValueError(f"{MAKE_BATCH}, but make_batch({size}) returned {brief(batch)}, which holds no tensor")
    return batch


def _holds_batch(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds a tensor or a ``torch.Size`` in any nesting of lists, tuples and dicts."""
    if isinstance(value, (Tensor, torch.Size)):
        return True
    if depth > 32:
        return False
    if isinstance(value, dict):
        return any(_holds_batch(item, depth + 1) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_batch(item, depth + 1) for item in value)
    return bool(batch_tensors(value))


class _DryRunPeaks:
    """Steady-state peaks by dry runs, each size run once: the exact answers of :func:`sweep`'s forecast."""

    def __init__(self, model: ModelArg, make_batch: Callable[[int], Any], options: PredictOptions, limit: int) -> None:
        self.model, self.make_batch, self.options, self.limit = model, make_batch, options, limit
        self.seen: dict[int, int] = {}
        self.elements_per_sample = 0.0

    def peak_bytes(self, batch_size: int) -> int:
        if batch_size not in self.seen:
            # the search reads only the peak: no timeline is recorded (it would change no figure)
            prediction = _frozen(self.model, batch_at(self.make_batch, batch_size), self.options, timeline=False)
            self.seen[batch_size] = prediction.report.peak_bytes or 0
        return self.seen[batch_size]

    def largest(self, limit_bytes: int, guess: int | None) -> int:
        return _bisect(self.peak_bytes, limit_bytes, max(1, min(guess or 1, self.limit)), self.limit)


def _secant(peak: Callable[[int], int], budget: int, at: int, lo: int, hi: int) -> tuple[int, int, int]:
    """Where the piece of the peak through ``at`` meets the budget, from the slope between ``at`` and a neighbour.

    The neighbour is the next size where ``at`` fits, the one before where it does not: that reading also
    tells whether ``at`` is the answer. A peak that is a maximum of linear pieces lies on or above each
    piece's line, so the size this returns is never far on the wrong side.

    Returns:
        The new ``lo`` (fits, or 0) and ``hi`` (does not fit), and the next size to try (may fall outside them).
    """
    here = peak(at)
    if here <= budget:
        lo = at
        if at + 1 >= hi:
            return lo, hi, at
        after = peak(at + 1)
        if after > budget:
            return lo, at + 1, at
        lo, slope = at + 1, after - here
        return lo, hi, (lo + (budget - after) // slope if slope > 0 else 2 * lo)
    hi = at
    if at - 1 <= lo:
        return lo, hi, at
    before = peak(at - 1)
    if before <= budget:
        return at - 1, hi, at
    hi, slope = at - 1, here - before
    return lo, hi, (hi - -(-(before - budget) // slope) if slope > 0 else (lo + hi) // 2)


def _bisect(peak: Callable[[int], int], budget: int, start: int, limit: int) -> int:
    """The largest size in [1, ``limit``] whose peak fits ``budget``, from ``start``: secant steps, else halving."""
    lo, hi, size = 0, limit + 1, start  # lo fits (0: none known to), hi does not (limit + 1: past the search)
    while hi - lo > 1:
        lo, hi, size = _secant(peak, budget, size, lo, hi)
        if size <= lo:  # the piece meets the budget right above lo: the next size says whether lo is the answer
            size = lo + 1
        elif size >= hi:
            size = (lo + hi) // 2
    return lo


@dataclass(frozen=True)
class _Settings:
    """The options of one dry run, checked: the GPU resolved, ``None`` for the CPU."""

    loss_fn: Callable[[nn.Module, Any], Tensor] | None
    optimizer: Callable[..., Optimizer] | None
    precision: str
    steps: int
    gpu: CudaTarget | None
    parallel: Parallel | None = None
    accumulate: int = 1  # micro-batches per optimizer step (``accumulate_grad_batches``)
    routing: Routing = field(default_factory=Routing)  # the routing assumed for a router's unknown choice
    allocator: AllocatorSettings | None = None  # the caching allocator's settings, for a GPU target
    allocator_from: str = ""  # where they came from, for the notes


def _settings(model: Any, batch: Any, options: PredictOptions) -> _Settings:
    """Every argument of a dry run checked once, before anything runs, each error naming its argument."""
    unknown = [name for name in options if name not in DEFAULTS]
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}: the options are {list(DEFAULTS)}")
    given: PredictOptions = {**DEFAULTS, **options}
    if not isinstance(model, nn.Module) and not callable(model):
        raise ValueError(f"model must be an nn.Module or a callable that builds one, got {type(model).__name__}")
    precision = check_precision(given["precision"])
    steps = given["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    accumulate = given["accumulate_grad_batches"]
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate_grad_batches must be a positive integer, got {brief(accumulate)}")
    gpu = _gpu_target(given["target"], given["gpu"])
    loss_fn, optimizer = given["loss_fn"], given["optimizer"]
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable loss_fn(model, batch) -> loss, got {loss_fn!r}")
    if optimizer is not None and not callable(optimizer):
        raise ValueError(f"optimizer must be a callable that takes the parameters, got {optimizer!r}")
    if batch is None:
        raise ValueError("batch must be tensors, shapes (torch.Size or meta tensors) or a callable, got None")
    parallel = parallel_of(given["strategy"], given["world_size"], given["tensor_parallel"])
    routing = check_routing(given["routing"])
    allocator, allocator_from = _allocator_settings(given["allocator"], gpu)
    return _Settings(
        loss_fn,
        optimizer,
        precision,
        steps,
        gpu,
        accumulate=accumulate,
        parallel=parallel,
        routing=routing,
        allocator=allocator,
        allocator_from=allocator_from,
    )


ALLOCATOR_HELP = (
    "a PYTORCH_CUDA_ALLOC_CONF string such as 'expandable_segments:True' or"
    " 'max_split_size_mb:512,roundup_power2_divisions:4,garbage_collection_threshold:0.8', an AllocatorSettings, or"
    " None to read the environment"
)


def _allocator_settings(allocator: Any, gpu: CudaTarget | None) -> tuple[AllocatorSettings | None, str]:
    """The caching allocator's settings for a GPU target, and where they came from; none for the CPU.

    Raises:
        ValueError: naming ``allocator``: a setting given for the CPU, or not a string nor an ``AllocatorSettings``,
            or a string ``AllocatorSettings.parse`` refuses.
    """
    if allocator is not None and gpu is None:
        raise ValueError(
            f"allocator applies to a GPU target (target='H100', 'cuda'...), got allocator={brief(allocator)} with"
            " target='cpu'"
        )
    if gpu is None:
        return None, ""
    if allocator is None:
        found = AllocatorSettings.from_environ()
        return found, _environment_source()
    if isinstance(allocator, AllocatorSettings):
        return allocator, "given as an AllocatorSettings"
    if isinstance(allocator, str):
        return AllocatorSettings.parse(allocator, "allocator"), f"given as allocator={allocator!r}"
    raise ValueError(f"allocator must be {ALLOCATOR_HELP}, got {brief(allocator)}")


def _environment_source() -> str:
    """Which variable the environment's settings came from, in words (torch reads ``PYTORCH_ALLOC_CONF`` first)."""
    for variable in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if variable in os.environ:
            return f"read from the environment's {variable}={os.environ[variable]!r}"
    return "PYTORCH_CUDA_ALLOC_CONF is not set"


def _allocator_model(settings: AllocatorSettings | None) -> CachingAllocatorModel:
    """The caching allocator's model for a GPU-target dry run, its pools keyed by the stream of each allocation."""
    return CachingAllocatorModel(settings, stream=current_stream)


def _gpu_target(target: Any, gpu: Any) -> CudaTarget | None:
    """The GPU that ``target`` names (``None`` for the CPU), or the deprecated ``gpu`` with ``target="cuda"``."""
    if gpu is None:
        return resolve_target(target)
    plain_cuda = isinstance(target, str) and target.strip().lower() == "cuda"
    if not plain_cuda:
        resolve_target(target)  # a bad target is named first
        raise ValueError(
            f"gpu (deprecated) names a CUDA architecture and needs target='cuda', got target={brief(target)};"
            f" name the GPU in target alone, e.g. target={brief(gpu)}"
        )
    found = resolve_gpu(gpu)
    warnings.warn(
        f"gpu= is deprecated and will be removed in the next release: write target={gpu!r} instead of"
        f" target='cuda', gpu={gpu!r}",
        DeprecationWarning,
        stacklevel=_outside_level(),
    )
    return found


def _outside_level() -> int:
    """The ``stacklevel`` that points a warning, given by this function's caller, at the first line outside the
    package's prediction modules (this one, and ``fake``'s wrapper of the entry points)."""
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the caller, level 1
    level = 1
    inside = (__name__, preserving_globals.__module__)
    while frame is not None and frame.f_globals.get("__name__") in inside:
        frame, level = frame.f_back, level + 1
    return level


def _is_lightning(module: nn.Module) -> bool:
    return callable(getattr(module, "training_step", None)) and callable(getattr(module, "configure_optimizers", None))


def _loss_of(out: Any, who: str) -> Tensor:
    """The loss a step returned, or one clear error naming who returned what."""
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, Tensor):
        raise ValueError(f"{who} must return a loss tensor (or a dict with 'loss'), got {brief(out)}")
    if not loss.requires_grad:
        raise ValueError(f"{who} returned a loss that does not require grad, so there is no backward to predict")
    return loss


def _leading_size(batch: Any) -> int:
    tensors = batch_tensors(batch)
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1


def _optimizers(module: nn.Module, factory: Callable[..., Optimizer] | None, lightning: bool) -> list[Optimizer]:
    if factory is not None or not lightning:
        made = (factory or torch.optim.Adam)([p for p in module.parameters() if p.requires_grad])
        if not isinstance(made, Optimizer):
            raise ValueError(f"optimizer(params) must return a torch.optim.Optimizer, got {brief(made)}")
        return [made]
    return lightning_optimizers(module)


def _step(
    module: nn.Module,
    batch: Any,
    index: int,
    optimizers: list[Optimizer],
    monitor: TenantMonitor,
    forward: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], Tensor] | None,
    lightning: bool,
    threads: Any = None,
    *,
    accumulate: int = 1,
    ddp: Any = None,
    logs: _Logs | None = None,
) -> StepReport:
    """One optimizer step in Lightning's order: ``accumulate`` micro-batches, then the optimizer.

    As Lightning's closure does, the gradients are zeroed after the forward of the first micro-batch of the
    window (``batch_idx % accumulate == 0``), each loss is divided by ``accumulate``, and the optimizer steps after
    the last; the monitor sees each micro-batch's phases as the callback gives them (``before_optimizer_step``
    in the last alone), and the step ends after the last ``batch_end``.
    """
    manual = lightning and not getattr(module, "automatic_optimization", True)
    if manual and accumulate > 1:  # Lightning refuses it too: a manual step accumulates by itself
        raise ValueError(
            "accumulate_grad_batches must be 1 under manual optimization (automatic_optimization=False), as"
            f" Lightning requires, got {accumulate}"
        )

    def before_step(*_: Any) -> None:
        monitor.phase("before_optimizer_step")

    hooks = [opt.register_step_pre_hook(before_step) for opt in optimizers]
    if not lightning:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
    restore = _attach_manual(module, optimizers, monitor, threads) if manual else None
    try:
        kept: Tensor | None = None
        for micro in range(accumulate):
            kept = None  # Lightning's previous batch output (the detached loss) is gone before the next batch
            batch_idx = index * accumulate + micro
            monitor.phase("batch_start", batch=batch)
            if logs is not None:
                logs.batch_start(batch)
            with forward():
                if ddp is not None:  # through DDP's forward, as Lightning's DDPStrategy runs the step
                    out = ddp_forward(ddp, batch, batch_idx)
                else:
                    out = module.training_step(batch, batch_idx) if lightning else loss_fn(module, batch)  # type: ignore[misc,operator]
            if not manual:
                loss = _loss_of(out, "training_step" if lightning else "loss_fn(model, batch)")
                if lightning:
                    # Lightning's closure divides the loss by the accumulation factor, an int (autograd keeps that
                    # 0-d int64 for backward), lets the undivided loss go, and keeps a detached copy
                    loss = loss / accumulate
                    out = {k: v for k, v in out.items() if k != "loss"} if isinstance(out, dict) else None
                    kept = loss.detach().clone()
                    if micro == 0:  # the first batch of the accumulation window
                        for opt in optimizers:
                            opt.zero_grad(set_to_none=True)
                elif accumulate > 1:  # a plain loop that accumulates averages its micro-batches' losses
                    loss = loss / accumulate
                monitor.phase("before_backward", output=loss)
                _backward(loss, threads)
                monitor.phase("after_backward")
                if micro == accumulate - 1:
                    for opt in optimizers:
                        opt.step()
                if lightning:  # the closure's output goes; a plain loop's ``loss`` lives on to the next step
                    del out, loss
            monitor.phase("batch_end")
            if logs is not None:  # after the callbacks' on_train_batch_end, as Lightning's logger connector
                logs.batch_end()
        report = monitor.end_step()
        del kept
    finally:
        for hook in hooks:
            hook.remove()
        if restore is not None:
            restore()
    assert report is not None
    return report


def _backward(loss: Tensor, threads: Any, *args: Any, **kwargs: Any) -> None:
    """Backward, on autograd's device thread where a CUDA target keeps one (its own cuBLAS handle)."""
    if isinstance(threads, CublasWorkspaces):
        threads.thread = "autograd"
    try:
        loss.backward(*args, **kwargs)
    finally:
        if isinstance(threads, CublasWorkspaces):
            threads.thread = "main"


def _attach_manual(
    module: nn.Module, optimizers: list[Optimizer], monitor: TenantMonitor, threads: Any = None
) -> Callable[[], None]:
    """Give the fake copy what manual optimization asks of a Trainer: its optimizers and a backward."""

    def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
        monitor.phase("before_backward", output=loss)
        _backward(loss, threads, *args, **kwargs)
        monitor.phase("after_backward")

    def get_optimizers(use_pl_optimizer: bool = True) -> Any:
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    module.manual_backward = manual_backward  # type: ignore[method-assign]
    module.optimizers = get_optimizers  # type: ignore[method-assign]

    def restore() -> None:
        del module.manual_backward
        del module.optimizers

    return restore


class _Logs:
    """What a Trainer keeps of a LightningModule's ``self.log`` (and ``log_dict``) in a fit, kept in a dry run too.

    A dry run has no Trainer, so Lightning's ``log`` would keep nothing; a real fit keeps, per logged name, in its
    result collection (Lightning's own code, run here): the metric's state and its defaults (a 0-d float and, for a
    mean, a 0-d int64 count), the step value's detached clone (``on_step``), the running sum of an epoch-level value
    (``on_epoch``), and a float32 copy of a value logged in another dtype; after each batch its logger connector holds
    that batch's values (``callback_metrics``, ``logged_metrics``) until the next batch's replace them. ``sync_dist``
    is not modelled (a collective under a strategy), nor what the progress bar holds (Python numbers).
    """

    def __init__(self) -> None:
        self.results = result_collection()
        self.held: dict[str, Tensor] = {}

    def attach(self, module: nn.Module) -> Callable[[], None] | None:
        """Give ``module`` a ``log`` that keeps what Lightning keeps, where its class uses Lightning's own.

        A class that overrides ``log`` keeps its own, as in a real fit. ``log_dict`` is Lightning's, which calls
        ``self.log``.

        Returns:
            What takes the module's own ``log`` back, or ``None`` where nothing was attached.
        """
        owner = next((c for c in type(module).__mro__ if "log" in vars(c)), None)
        lightning = owner is not None and owner.__name__ == "LightningModule" and owner.__module__.endswith(".module")
        if not lightning or "log" in vars(module):
            return None
        module.log = self.log  # type: ignore[method-assign]

        def detach() -> None:
            del module.log

        return detach

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """``LightningModule.log`` in ``training_step``, as a Trainer runs it on one device."""
        if isinstance(value, Tensor):  # LightningModule.log's own conversion (``__to_tensor``)
            value = value.clone().detach()
            if value.numel() != 1:
                raise ValueError(
                    f"`self.log({name}, ...)` was called with a tensor of {value.numel()} elements: it must have a"
                    f" single element (as Lightning requires); try `self.log({name}, value.mean())`"
                )
            value = value.squeeze()
        elif isinstance(value, (int, float)):
            dtype = torch.get_default_dtype()
            value = torch.tensor(value, dtype=dtype if dtype in (torch.float32, torch.float64) else torch.float32)
        on_step, on_epoch = logging_levels("training_step", on_step, on_epoch)
        self.results.log(
            "training_step",
            name,
            value,
            prog_bar=prog_bar,
            logger=True if logger is None else logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            enable_graph=enable_graph,
            add_dataloader_idx=add_dataloader_idx,
            batch_size=batch_size,
            metric_attribute=metric_attribute,
            rank_zero_only=rank_zero_only,
        )

    def batch_start(self, batch: Any) -> None:
        """The logger connector's ``on_batch_start``: the batch an epoch-level mean reads its size from."""
        self.results.batch = batch
        self.results.batch_size = None

    def batch_end(self) -> None:
        """The logger connector's ``on_batch_end``: the batch's values held until the next batch's replace them."""
        self.held.update(step_metrics(self.results))
        self.results.batch = None


def _raise(message: str) -> None:
    """In a dry run a failed measurement is the result, so it is raised, not warned."""
    raise RuntimeError(message)
