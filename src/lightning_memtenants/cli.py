"""``memtenants``: predict a training step's memory from the command line, before renting a GPU.

Example::

    memtenants predict examples/gpt.py:TinyGPT --batch-size 8 --seq-len 512 --precision bf16-mixed --budget 24GiB
    memtenants predict examples/gpt.py:TinyGPT --batch-size 8 --target A6000
    memtenants predict examples/gpt.py:TinyGPT --batch-size 8 --target H100 --allocator expandable_segments:True
    memtenants predict examples/seed_mlp.py:SeedMLP --input-shape 2048,1024 --json - | jq .report.peak_bytes

The target names a file or module and a class (or a function building the model). The batch comes from
the model's ``example_batch(batch_size, seq_len=None)``, which builds a batch for its ``training_step``, or
from ``--input-shape 8,1024`` (one per tensor) for a model without one; the model is built under fake
tensors, so its size costs nothing here. ``--json -`` writes only the JSON to stdout (the table to stderr).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from lightning_memtenants.analysis.budget import Budget
from lightning_memtenants.checks import brief
from lightning_memtenants.core.storage import batch_tensors
from lightning_memtenants.predict.advise import BUDGET_GRID, Advice, advise
from lightning_memtenants.predict.allocator import AllocatorSettings
from lightning_memtenants.predict.cuda_model import TARGET_HELP, CudaTarget, resolve_gpu, resolve_target
from lightning_memtenants.predict.dryrun import PredictOptions, dry_run, largest_batch_size
from lightning_memtenants.predict.fake import PRECISIONS
from lightning_memtenants.predict.footprint import DeviceFootprint
from lightning_memtenants.predict.routing import parse_routing
from lightning_memtenants.predict.values import is_unknown_value
from lightning_memtenants.render.table import fits_text, format_table
from lightning_memtenants.render.timeline import write_snapshot
from lightning_memtenants.units import MiB, parse_bytes

# What --target cuda predicts for when no GPU is named.
DEFAULT_GPU = resolve_gpu(None)
# One --input-shape: the sizes, batch first, and the dtype (None: float32, cast to the precision's).
Shape = tuple[tuple[int, ...], torch.dtype | None]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A bad argument, or the user's own code failing: reported on stderr, exit code 2.

    Raised rather than printed where it is found, so that every such error leaves by one door,
    as one message, before anything else is printed.
    """


class _UserCodeFailed(Exception):
    """The user's code raised ``error`` while the command ran ``what``; carried out of the dry run as it is."""

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(what)
        self.what, self.error = what, error


def build_parser() -> argparse.ArgumentParser:
    """The ``memtenants`` command's arguments, so the console script and ``python -m`` parse alike.

    Every option's help says its default (``tests/test_cli.py`` walks the parser to check it).

    Returns:
        The parser, whose errors print one line and exit with code 2.
    """
    parser = _Parser(prog="memtenants", description="What will use your training memory, predicted on a CPU.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    run = commands.add_parser(
        "predict",
        help="predict one training step's tenants and peak under fake tensors",
        description="Predict one training step's memory under fake tensors: the tenants at every phase, the peak,"
        " the fixed-cost check; no memory is allocated and no GPU is needed. The batch comes from the model's"
        " example_batch(batch_size, seq_len=None), or from --input-shape.",
    )
    run.add_argument(
        "target", help="FILE.py:NAME or package.module:NAME: a LightningModule class, or a function building one"
    )
    run.add_argument(
        "--batch-size",
        type=_positive,
        default=None,
        help="samples per batch, passed to example_batch (default: 1; with --input-shape, the shapes' first dimension)",
    )
    run.add_argument(
        "--seq-len",
        type=_positive,
        default=None,
        help="sequence length, passed to example_batch as its second argument (default: none, example_batch's own)",
    )
    run.add_argument(
        "--input-shape",
        type=_shape,
        action="append",
        default=None,
        metavar="SHAPE[:DTYPE]",
        help="the shape of one tensor of the batch, batch dimension first, e.g. 8,1024 or 8,512:int64, for a model"
        " without example_batch; repeat it for each tensor. The batch is the tuple of them, as a DataLoader over a"
        " TensorDataset gives it; a shape without a dtype is float32, cast to the precision's dtype (default: none:"
        " example_batch builds the batch)",
    )
    run.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="32-true",
        metavar="PRECISION",
        help="Lightning's precision: one of %(choices)s (default: %(default)s)",
    )
    run.add_argument(
        "--budget",
        default=None,
        help="device memory to plan for, e.g. 24GiB; gives the largest batch whose steady-state step fits it less"
        " the margin (default: none, no largest batch)",
    )
    run.add_argument(
        "--margin",
        type=_fraction,
        default=0.05,
        help="the fraction of --budget kept free, as the callback keeps it (default: %(default)s)",
    )
    run.add_argument(
        "--steps", type=_positive, default=1, help="steps to run; the report is of the last (default: %(default)s)"
    )
    run.add_argument(
        "--init",
        default="{}",
        help="constructor keyword arguments as JSON, e.g. '{\"n_layer\": 4}' (default: %(default)s, none)",
    )
    run.add_argument(
        "--target",
        dest="device",
        default="cpu",
        metavar="DEVICE",
        help=f"device to predict for (default: %(default)s): one of {TARGET_HELP.replace('%', '%%')}; 'cuda' alone"
        f" assumes an {DEFAULT_GPU.name} (compute capability {_capability(DEFAULT_GPU)}), and the output's first"
        " line says which GPU was assumed",
    )
    run.add_argument(
        "--allocator",
        default=None,
        metavar="CONF",
        help="the CUDA caching allocator's settings for a GPU --target, in PYTORCH_CUDA_ALLOC_CONF's syntax, e.g."
        " expandable_segments:True or max_split_size_mb:512,garbage_collection_threshold:0.8 (default: none, read"
        " from the environment's PYTORCH_CUDA_ALLOC_CONF, as torch does)",
    )
    run.add_argument(
        "--gpu",
        default=None,
        help="deprecated, to be removed in the next release: write --target A6000 instead (default: none)",
    )
    run.add_argument(
        "--strategy",
        choices=("ddp", "fsdp"),
        default=None,
        help="predict every rank of a data-parallel run in this process, over a fake process group: 'ddp', or"
        " 'fsdp' (FSDP2's fully_shard; the model's own configure_model, else per block, its repeated layers, and"
        " each module the step calls); the table is rank 0's (default: none, one device)",
    )
    run.add_argument(
        "--world-size",
        type=_positive,
        default=1,
        help="the ranks of --strategy (default: %(default)s)",
    )
    run.add_argument(
        "--tensor-parallel",
        type=_positive,
        default=1,
        metavar="T",
        help="with --strategy fsdp, the ranks of one tensor-parallel group: the mesh is (world size / T, T), and the"
        " model's configure_model applies its plan over self.device_mesh['tensor_parallel'] (default: %(default)s)",
    )
    run.add_argument(
        "--routing",
        type=_routing,
        default="balanced",
        metavar="ROUTING",
        help="the routing assumed where a mixture of experts chooses experts from values a dry run does not have:"
        " balanced (each expert gets tokens x top_k / experts), worst (every token the same top_k experts),"
        " capacity:F (as concentrated as a capacity factor F >= 1 allows) or counts:C0,C1,... per expert (several"
        " routers' counts separated by /) (default: %(default)s)",
    )
    run.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the report as JSON to PATH; '-' writes only the JSON to stdout, and the table to stderr"
        " (default: none, no JSON)",
    )
    run.add_argument(
        "--snapshot",
        default=None,
        metavar="PATH",
        help="also write the step as a PyTorch memory snapshot (a pickle) that"
        " 'python -m torch.cuda._memory_viz trace_plot PATH -o step.html' renders (default: none)",
    )
    _add_advise(commands, run)
    return parser


def _routing(text: str) -> Any:
    """``--routing``'s value as a ``Routing``, or argparse's one-line error naming the flag."""
    try:
        return parse_routing(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memtenants``: predict a step's memory and print the table (and the JSON, with ``--json``).

    Bad input is one line naming the argument, and a failure in the user's own code shows their
    frames, never ours, so what to fix is the first thing read. A bare ``memtenants`` (or
    ``memtenants predict``) prints its help.

    Args:
        argv: the arguments after the program's name; ``None`` reads ``sys.argv``.

    Returns:
        The exit code: 0, or 2 for a bad argument or the user's code failing (on stderr), or for a bare
        command (its help on stdout).
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv in (["predict"], ["advise"]):  # nothing to do: say what the command takes
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        print((commands.choices[argv[0]] if argv else parser).format_help(), end="")
        return 2
    args = parser.parse_args(argv)
    try:
        return _advise(args) if args.command == "advise" else _predict(args)
    except UsageError as error:
        print(f"memtenants: error: {error}", file=sys.stderr)
        return 2
    except _UserCodeFailed as failed:
        print(f"memtenants: error: {failed.what} failed:\n{_user_traceback(failed.error)}", file=sys.stderr)
        return 2


def _predict(args: argparse.Namespace) -> int:
    budget = None
    if args.budget is not None:
        try:
            budget = parse_bytes(args.budget, "--budget")
        except ValueError as error:
            raise UsageError(error) from None
    init = _init_of(args)
    shapes: list[Shape] | None = args.input_shape
    batch_size = _batch_size(args.batch_size, args.seq_len, shapes)
    target, device, gpu = _device(args.device, args.gpu)
    gpu_target = resolve_target(target)
    _check_allocator(args.allocator, gpu_target)
    json_path = _output_path(args.json, "--json")
    snapshot_path = _output_path(args.snapshot, "--snapshot")
    out = sys.stderr if args.json == "-" else sys.stdout  # with --json -, stdout holds the JSON alone
    build, make_batch = _model_source(args, init, shapes)
    if args.world_size > 1 and args.strategy is None:
        raise UsageError(f"--world-size {args.world_size} needs --strategy ddp or --strategy fsdp")
    if args.tensor_parallel > 1 and (args.strategy != "fsdp" or args.world_size % args.tensor_parallel):
        raise UsageError(
            f"--tensor-parallel {args.tensor_parallel} needs --strategy fsdp and a --world-size it divides"
        )
    options: PredictOptions = {"precision": args.precision, "steps": args.steps, "target": target}
    options["routing"] = args.routing
    if args.allocator is not None:
        options["allocator"] = args.allocator
    if args.strategy is not None:
        options = {**options, "strategy": args.strategy, "world_size": args.world_size}
        if args.tensor_parallel > 1:
            options["tensor_parallel"] = args.tensor_parallel
    prediction = _run_step(lambda: dry_run(build, make_batch(batch_size), **options), batch_size)
    report = prediction.report
    print(_header(args, batch_size, shapes, gpu_target), file=out)
    print(format_table(report), file=out)  # the report's notes include the prediction's own
    if prediction.footprint is not None:
        print(_footprint_text(prediction.footprint), file=out)
    if args.strategy is not None:
        print(_ranks_text(prediction.ranks, prediction.footprints), file=out)
    largest = None
    if budget is not None:
        # the steady state must fit (the optimizer state and the previous gradients resident), whatever --steps shows
        steady: PredictOptions = {**options, "steps": max(args.steps, 2)}
        largest = _run_step(
            lambda: largest_batch_size(build, make_batch, budget, margin=args.margin, start=batch_size, **steady),
            batch_size,
        )
        print(
            f"largest batch for a budget of {budget / MiB:,.0f} MiB: {largest}"
            f" (a steady-state step {fits_text(budget, args.margin)})",
            file=out,
        )
    if args.json is not None:
        document = {
            **_step_fields(args, batch_size, shapes, device),
            "gpu": gpu if gpu is not None or gpu_target is None else gpu_target.name,
            "gpu_assumed": gpu_target is not None and gpu is None,
            "budget_bytes": budget,
            "margin": args.margin,
            "limit_bytes": None if budget is None else Budget(budget, args.margin).limit_bytes,
            "largest_batch_size": largest,
            "allocator": args.allocator,
            "reserved_by_stream_bytes": prediction.reserved_by_stream_bytes,
            "footprint": _footprint_dict(prediction.footprint),
            "notes": prediction.notes,
            "report": report.to_dict(),
        }
        if args.strategy is not None:
            document["strategy"] = args.strategy
            document["world_size"] = args.world_size
            document["tensor_parallel"] = args.tensor_parallel
            document["ranks"] = [
                {
                    "rank": rank,
                    "peak_bytes": r.peak_bytes,
                    "peak_reserved_bytes": r.peak_reserved_bytes,
                    "peak_phase": r.peak_phase,
                    "tenants_bytes": r.tenants_bytes,
                    "footprint": _footprint_dict(prediction.footprints[rank] if prediction.footprints else None),
                }
                for rank, r in enumerate(prediction.ranks)
            ]
        _write_json(document, json_path)
    if snapshot_path is not None:  # written last: a path that cannot be written loses nothing printed before it
        try:
            write_snapshot(prediction, snapshot_path)
        except OSError as error:
            raise UsageError(f"--snapshot: cannot write {snapshot_path}: {error.strerror or error}") from None
    return 0


def _step_fields(args: argparse.Namespace, batch_size: int, shapes: list[Shape] | None, device: str) -> dict[str, Any]:
    """What both commands' JSON says of the step asked for: the target, the batch, the precision, the device."""
    return {
        "target": args.target,
        "batch_size": batch_size,
        "seq_len": args.seq_len,
        "input_shapes": None if shapes is None else [_shape_text(s) for s in shapes],
        "precision": args.precision,
        "device": device,
    }


def _write_json(document: dict[str, Any], path: Path | None) -> None:
    """The command's JSON: to ``path``, or alone on stdout where ``--json -`` (``path`` None) asked for it."""
    text = json.dumps(document, indent=2)
    if path is None:
        print(text, flush=True)
        return
    try:
        path.write_text(text + "\n")
    except OSError as error:
        raise UsageError(f"--json: cannot write {path}: {error.strerror or error}") from None


def _ranks_text(ranks: Sequence[Any], footprints: Sequence[DeviceFootprint] = ()) -> str:
    """One line per group of ranks that hold the same: their peaks (allocated, reserved, and what nvidia-smi will
    show, for a GPU) and their tenants' high-water marks, in MiB."""
    lines = ["per rank (ranks that hold the same are one line):"]
    start = 0
    for rank in range(1, len(ranks) + 1):
        if rank == len(ranks) or ranks[rank] is not ranks[start]:
            who = f"rank {start}" if rank - start == 1 else f"ranks {start}-{rank - 1}"
            r = ranks[start]
            tenants = ", ".join(f"{name} {value / MiB:,.2f}" for name, value in r.tenants_bytes.items())
            reserved = (
                "" if r.peak_reserved_bytes is None else f", peak reserved {r.peak_reserved_bytes / MiB:,.2f} MiB"
            )
            if footprints:
                reserved += f", nvidia-smi {footprints[start].total_bytes / MiB:,.2f} MiB"
            lines.append(
                f"  {who}: peak {(r.peak_bytes or 0) / MiB:,.2f} MiB at {r.peak_phase}{reserved}; {tenants} (MiB)"
            )
            start = rank
    return "\n".join(lines)


def _footprint_text(footprint: DeviceFootprint) -> str:
    """What nvidia-smi will show (rank 0's under a strategy), its three parts, and what each assumes."""
    parts = (
        f"reserved peak {footprint.reserved_peak_bytes / MiB:,.2f} + CUDA context {footprint.context_bytes / MiB:,.2f}"
        f" + NCCL {footprint.nccl_bytes / MiB:,.2f}"
    )
    lines = [f"nvidia-smi will show about {footprint.total_bytes / MiB:,.2f} MiB: {parts} (MiB)"]
    return "\n".join([*lines, *(f"  - {note}" for note in footprint.notes)])


def _footprint_dict(footprint: DeviceFootprint | None) -> dict[str, Any] | None:
    """The footprint's parts, their sum and its notes, as JSON types; None for the CPU."""
    if footprint is None:
        return None
    return {
        "reserved_peak_bytes": footprint.reserved_peak_bytes,
        "context_bytes": footprint.context_bytes,
        "nccl_bytes": footprint.nccl_bytes,
        "total_bytes": footprint.total_bytes,
        "notes": list(footprint.notes),
    }


def _check_allocator(allocator: str | None, gpu: CudaTarget | None) -> None:
    """``--allocator`` checked before any dry run: settings torch accepts, for a GPU target.

    Raises:
        UsageError: naming ``--allocator``: given for the CPU, or not in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax.
    """
    if allocator is None:
        return
    if gpu is None:
        raise UsageError(
            f"--allocator applies to a GPU target (--target H100, --target cuda...), got --allocator {allocator}"
            " for the CPU"
        )
    try:
        AllocatorSettings.parse(allocator, "--allocator")
    except ValueError as error:
        raise UsageError(str(error).replace("\n", " ")) from None


def _init_of(args: argparse.Namespace) -> dict[str, Any]:
    """``--init``: the constructor's keyword arguments, a JSON object."""
    try:
        init = json.loads(args.init)
    except json.JSONDecodeError as error:
        raise UsageError(f"--init must be a JSON object of keyword arguments: {error}") from None
    if not isinstance(init, dict):
        raise UsageError(f"--init must be a JSON object of keyword arguments, got {args.init!r}")
    return init


def _model_source(
    args: argparse.Namespace, init: dict[str, Any], shapes: list[Shape] | None
) -> tuple[Callable[[], Any], Callable[[int], Any]]:
    """The target loaded: a builder of the model (under the dry run's fake tensors) and the batch for a size.

    Both ``predict`` and ``advise`` build the model and its batch so, and refuse what cannot be built in one line.

    Raises:
        UsageError: for a target that does not load or is not a LightningModule.
    """
    factory = load_target(args.target)
    if inspect.isclass(factory) and not issubclass(factory, nn.Module):
        raise UsageError(f"{args.target} is a class but not an nn.Module: the command needs a LightningModule")

    def build() -> Any:
        try:
            module = factory(**init)
        except TypeError as error:
            if _raised_here(error):  # the call itself: a keyword the constructor does not take, or one missing
                raise UsageError(f"{args.target} cannot be built with --init {json.dumps(init)}: {error}") from None
            raise _UserCodeFailed(f"building {args.target}", error) from None
        except Exception as error:
            if is_unknown_value(error):  # the dry run builds it again on the meta device
                raise
            raise _UserCodeFailed(f"building {args.target}", error) from None
        if not isinstance(module, nn.Module) or not callable(getattr(module, "training_step", None)):
            raise UsageError(
                f"{args.target} built {type(module).__name__}, not a LightningModule with training_step (and"
                " example_batch(batch_size, seq_len=None), or --input-shape for the batch)"
            )
        return module

    def make_batch(size: int) -> Any:
        if shapes is not None:
            return lambda: _shaped_batch(shapes, size)

        def batch(module: Any) -> Any:
            example = getattr(module, "example_batch", None)
            if not callable(example):
                raise UsageError(
                    f"{type(module).__name__} has no example_batch(batch_size, seq_len=None) method to build a batch:"
                    " give the batch's shapes instead, one --input-shape per tensor, e.g. --input-shape 8,1024"
                )
            if args.seq_len is not None and not _takes_two(example):
                raise UsageError(f"--seq-len: {type(module).__name__}.example_batch takes no seq_len argument")
            call = f"{type(module).__name__}.example_batch({size}{'' if args.seq_len is None else f', {args.seq_len}'})"
            try:
                made = example(size) if args.seq_len is None else example(size, args.seq_len)
            except Exception as error:
                raise _UserCodeFailed(call, error) from None
            if not batch_tensors(made):
                raise UsageError(f"{call} must return the batch for training_step (tensors), got {brief(made)}")
            return made

        return batch

    return build, make_batch


def _header(args: argparse.Namespace, batch_size: int, shapes: list[Shape] | None, gpu: CudaTarget | None) -> str:
    """The output's first line: what was predicted, for which device, and which GPU ``--target cuda`` assumed."""
    if shapes is not None:
        batch = "input shapes " + " ".join(_shape_text(s) for s in shapes)
    else:
        batch = f"example_batch({batch_size}{'' if args.seq_len is None else f', {args.seq_len}'})"
    steps = f"{args.steps} step{'s' if args.steps > 1 else ''}"
    if gpu is None:
        device = "the CPU"
    else:
        device = f"CUDA on {gpu.name} (compute capability {_capability(gpu)})"
        if args.gpu is None and args.device.strip().lower() == "cuda":
            device += ", which --target cuda assumes: name your GPU with --target, e.g. --target H100"
    return f"memtenants predict {args.target}: {batch}, {args.precision}, {steps}, for {device}"


def _capability(gpu: CudaTarget) -> str:
    return f"{gpu.capability[0]}.{gpu.capability[1]}"


def _batch_size(batch_size: int | None, seq_len: int | None, shapes: list[Shape] | None) -> int:
    """The batch size: ``--batch-size`` (1 when not given), or with ``--input-shape`` the shapes' first dimension.

    Raises:
        UsageError: for shapes of different batch sizes, a ``--batch-size`` that differs from theirs, or a
            ``--seq-len`` beside them.
    """
    if shapes is None:
        return 1 if batch_size is None else batch_size
    if seq_len is not None:
        raise UsageError("--seq-len goes to example_batch; with --input-shape, write the sequence into the shape")
    if any(not shape for shape, _ in shapes):
        raise UsageError("--input-shape needs a batch dimension first, e.g. 8,1024, got a shape with no dimension")
    firsts = sorted({shape[0] for shape, _ in shapes})
    if len(firsts) > 1:
        raise UsageError(f"--input-shape: every shape's first dimension is the batch size, got {firsts}")
    if batch_size is not None and batch_size != firsts[0]:
        raise UsageError(
            f"--batch-size {batch_size} differs from the first dimension of --input-shape, {firsts[0]}: give one"
        )
    return firsts[0]


def _shaped_batch(shapes: list[Shape], size: int) -> tuple[Any, ...]:
    """The batch of ``--input-shape``, its batch dimension set to ``size``: shapes, and meta tensors for dtypes."""
    out: list[Any] = []
    for shape, dtype in shapes:
        full = (size, *shape[1:])
        out.append(torch.Size(full) if dtype is None else torch.empty(full, dtype=dtype, device="meta"))
    return tuple(out)


def _shape_text(shape: Shape) -> str:
    dims, dtype = shape
    return ",".join(str(d) for d in dims) + ("" if dtype is None else f":{str(dtype).removeprefix('torch.')}")


def _device(target: str, gpu: str | None) -> tuple[str, str, str | None]:
    """``--target`` (and the deprecated ``--gpu``) checked: what ``dry_run`` takes, and the device and GPU as written.

    Returns:
        The ``target`` for ``dry_run``; ``"cpu"`` or ``"cuda"``; the GPU as the user named it, or None.

    Raises:
        UsageError: naming ``--target`` or ``--gpu`` and what it accepts.
    """
    try:
        found = resolve_target(target, "--target")
    except ValueError as error:
        raise UsageError(str(error)) from None
    if gpu is None:
        written = None
        if found is not None and target.strip().lower() != "cuda":
            written = target.strip()[5:].strip() if target.strip().lower().startswith("cuda:") else target.strip()
        return target, "cpu" if found is None else "cuda", written
    if target.strip().lower() != "cuda":
        raise UsageError(f"--gpu needs --target cuda, got --target {target}; --gpu is deprecated: write --target {gpu}")
    try:
        resolve_gpu(gpu, "--gpu")
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(
        f"memtenants: warning: --gpu is deprecated and will be removed in the next release: write --target {gpu}"
        f" instead of --target cuda --gpu {gpu}",
        file=sys.stderr,
    )
    return f"cuda:{gpu}", "cuda", gpu


def _output_path(value: str | None, option: str = "--json") -> Path | None:
    """Where ``option`` writes, checked before any work is done; None for no file (or '-', stdout, for --json)."""
    if value is None or (value == "-" and option == "--json"):
        return None
    if not value.strip():
        accepts = "a file path or '-' for stdout" if option == "--json" else "a file path"
        raise UsageError(f"{option} must be {accepts}, got ''")
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{option} must be a file path, and {value} is a directory")
    if path.parent.exists() and not path.parent.is_dir():
        raise UsageError(f"{option}: {path.parent} is not a directory")
    if not path.parent.is_dir():
        raise UsageError(f"{option}: the directory {path.parent} does not exist")
    return path


def _run_step(run: Any, batch_size: int) -> Any:
    """Run the dry run; a failure of the user's step is theirs (their traceback), ours stays a traceback."""
    try:
        return run()
    except (UsageError, _UserCodeFailed):
        raise
    except Exception as error:
        if not _raised_here(error):
            raise _UserCodeFailed(f"the training step at batch size {batch_size}, under fake tensors,", error) from None
        if isinstance(error, ValueError):  # our own validation of what the user's code handed us
            raise UsageError(str(error)) from None
        raise


def _raised_here(error: BaseException) -> bool:
    """Whether ``error`` was raised in this package's own code (its innermost frame is ours)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and _ours(frames[-1].filename)


def _user_traceback(error: BaseException) -> str:
    """The user's frames of ``error`` and the error itself: none of ours, of importlib's, or of installed packages'."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _theirs(f.filename)]
    return ("".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(error))).rstrip()


def _theirs(filename: str) -> bool:
    return not (_ours(filename) or "site-packages" in filename or filename.startswith(sysconfig.get_path("stdlib")))


def _takes_two(method: Any) -> bool:
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return True
    return len([p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 2


def load_target(target: str) -> Any:
    """Import ``FILE.py:NAME`` or ``module:NAME``; an import that fails shows the user's own traceback.

    Args:
        target: the model's place, ``FILE.py:NAME`` or ``package.module:NAME``.

    Returns:
        The class or function named, a callable.

    Raises:
        UsageError: if ``target`` is not of that form, the file does not exist, its import fails
            (with the user's traceback), or it has no callable of that name.
    """
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise UsageError(f"target must look like FILE.py:NAME or package.module:NAME, got {target!r}")
    try:
        if path.endswith(".py"):
            file = Path(path)
            if not file.is_file():
                raise UsageError(f"no such file: {path}")
            sys.path.insert(0, str(file.resolve().parent))
            spec = importlib.util.spec_from_file_location(file.stem, file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[file.stem] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(path)
    except UsageError:
        raise
    except (Exception, KeyboardInterrupt) as error:  # the user's module at import: their code, their traceback
        raise UsageError(f"cannot import {path}:\n{_user_traceback(error)}") from None
    found = getattr(module, name, None)
    if found is None or not callable(found):
        names = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and not n.startswith("_"))
        raise UsageError(f"{path} has no class or function {name!r}; it defines {', '.join(names) or 'no classes'}")
    return found


def _ours(filename: str) -> bool:
    return filename.startswith(str(Path(__file__).parent)) or "importlib" in filename or filename.startswith("<frozen")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text!r}")
    return value


def _shape(text: str) -> Shape:
    """``--input-shape``: ``8,1024`` or ``8,512:int64``, positive sizes and a torch dtype's name."""
    dims, _, dtype_name = text.partition(":")
    try:
        shape = tuple(int(d) for d in dims.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be sizes separated by commas, e.g. 8,1024, got {text!r}") from None
    if any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"sizes must be positive integers, got {text!r}")
    dtype = None
    if dtype_name:
        dtype = getattr(torch, dtype_name.strip(), None)
        if not isinstance(dtype, torch.dtype):
            raise argparse.ArgumentTypeError(
                f"the dtype after ':' must be a torch dtype such as float32, bfloat16 or int64, got {dtype_name!r}"
            )
    return shape, dtype


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


# -- memtenants advise: the fixes for a budget, measured by dry runs ---------------------------------------------

# The options ``advise`` shares with ``predict``: the model, its batch, the precision and the device.
_SHARED = ("target", "batch_size", "seq_len", "input_shape", "precision", "init", "device", "allocator")


def _add_advise(commands: Any, predict: argparse.ArgumentParser) -> None:
    """``memtenants advise``: the same model and batch options as ``predict``, a budget, and the fixes' table."""
    run = commands.add_parser(
        "advise",
        help="measure fixes for a step over a memory budget by dry runs: each fix's exact peak",
        description="Measure candidate fixes for one training step against a memory budget, each by two-step dry runs"
        " under fake tensors: bf16-mixed, activation checkpointing of the fewest blocks that fit, a smaller"
        " micro-batch with accumulate_grad_batches, the optimizer's implementation, cheaper optimizers (they change"
        " training), and combinations where no single fix fits. The model and batch options are predict's.",
    )
    for action in predict._actions:
        if action.dest in _SHARED:
            run._add_action(action)
    run.add_argument(
        "--budget",
        required=True,
        help="device memory a step may use, e.g. 24GiB; a fix fits where its peak is within it less --margin"
        " (default: none, required)",
    )
    run.add_argument(
        "--margin",
        type=_fraction,
        default=0.05,
        help="the fraction of --budget kept free, as the callback keeps it (default: %(default)s)",
    )
    run.add_argument(
        "--fsdp-ranks",
        type=_rank_counts,
        default=None,
        metavar="N[,N...]",
        help="also measure FSDP2 over these rank counts, e.g. 2,4,8, each rank taking its share of the batch"
        " (default: none)",
    )
    run.add_argument(
        "--accumulate-grad-batches",
        type=_positive,
        default=1,
        help="the micro-batches per optimizer step the run uses now, as the Trainer's argument (default: %(default)s)",
    )
    run.add_argument(
        "--compile-fixes",
        action="store_true",
        help="also measure torch.compile of the model where nothing is compiled yet; each compiled dry run takes"
        " seconds (default: %(default)s)",
    )
    run.add_argument(
        "--activation-memory-budgets",
        type=_memory_budgets,
        default=None,
        metavar="X[,X...]|grid",
        help="also measure these values of torch._functorch.config.activation_memory_budget for the compiled step,"
        f" each in [0, 1], the largest that fits advised; 'grid' is {','.join(f'{b:g}' for b in BUDGET_GRID)}"
        " (default: none)",
    )
    run.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the advice as JSON to PATH; '-' writes only the JSON to stdout, and the table to stderr"
        " (default: none, no JSON)",
    )


def _advise(args: argparse.Namespace) -> int:
    """Run ``memtenants advise``: every argument checked first, then the dry runs, then the table."""
    try:
        budget = parse_bytes(args.budget, "--budget")
    except ValueError as error:
        raise UsageError(error) from None
    init = _init_of(args)
    shapes: list[Shape] | None = args.input_shape
    batch_size = _batch_size(args.batch_size, args.seq_len, shapes)
    target, device, _ = _device(args.device, None)
    gpu_target = resolve_target(target)
    _check_allocator(args.allocator, gpu_target)
    json_path = _output_path(args.json, "--json")
    out = sys.stderr if args.json == "-" else sys.stdout
    build, make_batch = _model_source(args, init, shapes)
    options: PredictOptions = {
        "precision": args.precision,
        "target": target,
        "accumulate_grad_batches": args.accumulate_grad_batches,
    }
    if args.allocator is not None:
        options["allocator"] = args.allocator
    advice: Advice = _run_step(
        lambda: advise(
            build,
            make_batch(batch_size),
            budget,
            margin=args.margin,
            make_batch=make_batch,
            fsdp_ranks=args.fsdp_ranks or (),
            compile_fixes=args.compile_fixes,
            activation_memory_budgets=args.activation_memory_budgets or (),
            **options,
        ),
        batch_size,
    )
    where = (
        "the CPU" if gpu_target is None else f"CUDA on {gpu_target.name} (compute capability {_capability(gpu_target)})"
    )
    batch = (
        "input shapes " + " ".join(_shape_text(s) for s in shapes)
        if shapes is not None
        else f"example_batch({batch_size}{'' if args.seq_len is None else f', {args.seq_len}'})"
    )
    print(f"memtenants advise {args.target}: {batch}, {args.precision}, for {where}", file=out)
    verdict = "fits" if advice.fits else "does not fit"
    print(
        f"the step peaks at {advice.baseline_peak_bytes / MiB:,.2f} MiB (two steps, the first optimizer step"
        f" included) and {verdict}; a fix {fits_text(budget, args.margin)}",
        file=out,
    )
    print(_advice_table(advice), file=out)
    for note in advice.notes:
        # a candidate whose dry run failed says so itself: the step without it ran, so the step is not to blame
        print(note if ": left out" in note else f"not tried: {note}", file=out)
    if args.json is not None:
        document = {
            **_step_fields(args, batch_size, shapes, device),
            "gpu": None if gpu_target is None else gpu_target.name,
            "accumulate_grad_batches": args.accumulate_grad_batches,
            "allocator": args.allocator,
            "fsdp_ranks": list(args.fsdp_ranks or ()),
            "budget_bytes": budget,
            "margin": args.margin,
            "limit_bytes": advice.limit_bytes,
            "baseline_peak_bytes": advice.baseline_peak_bytes,
            "fits": advice.fits,
            "fixes": [{**fix.to_dict(), "applies_to_the_module": fix.apply is not None} for fix in advice.fixes],
            "notes": advice.notes,
        }
        _write_json(document, json_path)
    return 0


def _memory_budgets(text: str) -> tuple[float, ...]:
    """``--activation-memory-budgets``: values in [0, 1] separated by commas, or ``grid``."""
    if text.strip() == "grid":
        return BUDGET_GRID
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be values in [0, 1] separated by commas, or grid, got {text!r}"
        ) from None
    if any(not 0 <= value <= 1 for value in values):
        raise argparse.ArgumentTypeError(f"each value must be in [0, 1], got {text!r}")
    return values


def _rank_counts(text: str) -> tuple[int, ...]:
    """``--fsdp-ranks``: rank counts of 2 or more, separated by commas."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be rank counts separated by commas, e.g. 2,4,8, got {text!r}") from None
    if any(n < 2 for n in counts):
        raise argparse.ArgumentTypeError(f"rank counts must be 2 or more, got {text!r}")
    return counts


def _advice_table(advice: Advice) -> str:
    """The fixes, one row each: name, peak and saving in MiB, whether it fits, and how (fits first, then by peak)."""
    width = max([len("fix"), *(len(fix.name) for fix in advice.fixes)])
    lines = [f"{'fix':<{width}}  {'peak MiB':>12}  {'saves MiB':>12}  {'fits':<4}  how"]
    for fix in advice.fixes:
        fits = "yes" if fix.fits else "no"
        figures = f"{fix.peak_bytes / MiB:>12,.2f}  {fix.saves_bytes / MiB:>12,.2f}"
        lines.append(f"{fix.name:<{width}}  {figures}  {fits:<4}  {fix.how}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
