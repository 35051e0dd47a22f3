"""Fixes for a step over budget, measured by dry runs: each candidate's exact peak, never an estimate.

``analysis.fixes`` guesses what a remedy saves from the tenants of one step; here each remedy is applied to a
fake copy of the model and the step is run again under fake tensors, two steps (the first optimizer step, where
the optimizer state is born, and a steady-state one). A fix's peak is the highest of the two step peaks, so it
holds in a real fit from its first step on, to the byte on the CPU.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.checkpoint import checkpoint
from typing_extensions import Unpack

from lightning_memtenants._private import (
    FakeTensor,
    TorchDispatchMode,
    activation_memory_budget,
    activation_memory_budget_set,
    compiled_by_lightning,
    compiled_in_place,
    compiled_original,
)
from lightning_memtenants.analysis.forecast import limit_bytes
from lightning_memtenants.checks import brief
from lightning_memtenants.core.storage import batch_tensors, storage_key
from lightning_memtenants.predict.cluster import hf_layer, named_blocks
from lightning_memtenants.predict.dryrun import DEFAULTS, ModelArg, Prediction, PredictOptions, _frozen, batch_at
from lightning_memtenants.predict.fake import check_precision, preserving_globals
from lightning_memtenants.units import parse_bytes

# The names of the candidates, as ``MeasuredFix.name`` starts with them.
BF16 = "bf16-mixed"
CHECKPOINTING = "activation checkpointing"
MICRO_BATCH = "smaller micro-batch"
FOREACH = "foreach=False"
FUSED = "fused=True"
SGD = "SGD with momentum"
ADAFACTOR = "Adafactor"
COMPILE = "torch.compile"
MEMORY_BUDGET = "activation_memory_budget"
# A grid of activation_memory_budget values to search, as the note suggests where none is given: each is a compiled
# dry run of its own, the peak not being monotone in the budget (pytorch issue 197838).
BUDGET_GRID = (0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
# Adafactor's learning rate where the model's optimizer gives none (torch's default).
ADAFACTOR_LR = 1e-2

_T = TypeVar("_T")


@dataclass(frozen=True)
class MeasuredFix:
    """One remedy, measured: the peak of a two-step dry run with the fix applied, and how to apply it.

    Args:
        name: what the fix is, e.g. ``"bf16-mixed"`` or ``"activation checkpointing (2 of 4 blocks)"``.
        peak_bytes: the highest step peak of a two-step dry run with the fix (the first optimizer step included),
            as the callback measures a real fit's steps.
        saves_bytes: the baseline's peak less ``peak_bytes`` (below 0 where the fix costs memory).
        fits: whether ``peak_bytes`` is within the budget less the margin (``Budget(budget, margin).limit_bytes``,
            the rule of ``largest_batch_size``).
        trainer_kwargs: what to pass to the ``Trainer``, e.g. ``{"precision": "bf16-mixed"}``.
        batch_size: the micro-batch the fix assumes (the ``DataLoader``'s ``batch_size``), or None for the batch
            as given.
        apply: changes a LightningModule in place (wraps blocks in checkpointing, changes the optimizers that
            ``configure_optimizers`` returns), or None where the fix needs no change to the module;
            ``apply(module)`` raises ValueError naming ``module`` for anything but an ``nn.Module``.
        how: one sentence of the code the user writes.
        changes_training: the fix changes what training computes, not only its memory: another optimizer, or a
            smaller micro-batch where the step's result depends on the batch as a whole (BatchNorm's statistics, a
            loss that compares each sample with the others, as a contrastive loss does).
        training_note: why the fix changes training, one sentence (also the end of ``how``); empty where it does not.
    """

    name: str
    peak_bytes: int
    saves_bytes: int
    fits: bool
    trainer_kwargs: dict[str, Any]
    batch_size: int | None
    apply: Callable[[nn.Module], None] | None
    how: str
    changes_training: bool = False
    training_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The fix as JSON holds it (the command's, the postmortem's): every field but ``apply``, a callable.

        Returns:
            ``name``, ``peak_bytes``, ``saves_bytes``, ``fits``, ``trainer_kwargs``, ``batch_size``,
            ``changes_training``, ``training_note`` and ``how``.
        """
        return {
            "name": self.name,
            "peak_bytes": self.peak_bytes,
            "saves_bytes": self.saves_bytes,
            "fits": self.fits,
            "trainer_kwargs": self.trainer_kwargs,
            "batch_size": self.batch_size,
            "changes_training": self.changes_training,
            "training_note": self.training_note,
            "how": self.how,
        }


@dataclass(frozen=True)
class Advice:
    """The baseline step against the budget, and every candidate fix, measured: fits first, then the lowest peak.

    Args:
        baseline_peak_bytes: the highest step peak of the two-step dry run without a fix.
        budget_bytes: the budget, before the margin.
        margin: the fraction of the budget kept free.
        limit_bytes: what a step may reach: the budget less the margin.
        batch_size: the batch's samples (the leading size of its first tensor).
        fixes: the measured fixes, those that fit first, then by peak.
        notes: the candidates that were not tried, or were tried and left out (their dry run failed), and why: one
            sentence each.
    """

    baseline_peak_bytes: int
    budget_bytes: int
    margin: float
    limit_bytes: int
    batch_size: int
    fixes: list[MeasuredFix]
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether the step fits without a fix."""
        return self.baseline_peak_bytes <= self.limit_bytes


@preserving_globals
def advise(
    model: ModelArg,
    batch: Any,
    budget_bytes: int | str,
    *,
    margin: float = 0.05,
    make_batch: Callable[[int], Any] | None = None,
    fsdp_ranks: Sequence[int] = (),
    compile_fixes: bool = False,
    activation_memory_budgets: Sequence[float] = (),
    **options: Unpack[PredictOptions],
) -> Advice:
    """Measure each candidate fix for a step by dry runs, against a budget: what each one's peak would be.

    The candidates: ``bf16-mixed`` (from ``32-true``); activation checkpointing of the blocks that save the most
    (the model's repeated layers, :func:`~lightning_memtenants.predict.cluster.named_blocks`, else its top-level
    children; a transformers layer through its own ``gradient_checkpointing``, the KV cache off; never a block whose
    BatchNorm would update its running statistics again in the recomputation), the fewest that fit; a smaller
    micro-batch with ``accumulate_grad_batches`` keeping the effective batch, the largest that fits (not under
    manual optimization, where Lightning refuses the accumulation); the optimizer's implementation
    (``foreach=False``, ``fused=True``) where it takes them; cheaper optimizers (SGD with momentum, Adafactor),
    marked as changing training, the schedulers moved onto them; FSDP2 over ``fsdp_ranks`` ranks; ``torch.compile``
    (with ``compile_fixes``, where nothing is compiled yet), and ``activation_memory_budget = x`` for the compiled
    step, the largest of ``activation_memory_budgets`` that fits (every value its own dry run: the peak is not
    monotone in it); and where no fix that keeps the batch and the training fits, combinations of bf16-mixed,
    checkpointing and the micro-batch.
    Where the baseline fits already, each candidate shows what it would save: checkpointing every block, half the
    micro-batch. A smaller batch per device is marked as changing training where the step sees the batch as a
    whole (BatchNorm in training mode, a batch x batch product such as a contrastive loss's).

    Each fix is measured by a dry run of the step with the fix applied, as ``fix.apply`` applies it: a candidate
    whose dry runs fail (a recomputation that differs, a step that cannot run sharded) is left out, with one
    sentence in ``notes``; one failing candidate never fails the others. Only the step without a fix failing
    fails ``advise``, with the step's own error.

    The user's step runs under fake tensors, once per candidate and size tried: what it does that reads no tensor
    value runs again each time (a ``print``, a counter, a line written to a log file). The caller's objects are
    not changed: every dry run steps a copy of the model whose tensors are fakes and whose containers (lists,
    dicts) are copies, and a fix is applied to that copy; other objects the model holds (a numpy array, a
    Dataset) are shared, not copied, and left as they are unless the step itself changes them. The random
    generators, the modes, the saved-tensor hooks, the default dtype, grad mode, autocast and the deterministic
    flag are as they were on return. Only ``fix.apply(model)``, called by the user, changes a module.

    Args:
        model: as for :func:`~lightning_memtenants.predict.dryrun.predict`; never changed.
        batch: as for ``predict``: the batch of one step (its leading size is the batch size).
        budget_bytes: the memory a step may use: a positive number of bytes (at least 1), or a string like
            ``"24GiB"``, as the callback's ``budget_bytes``.
        margin: the fraction of ``budget_bytes`` kept free, in [0, 1) (default 5%, as ``largest_batch_size``).
        make_batch: builds the batch for a batch size, for the micro-batch candidates; by default the given
            batch's tensors are cut along their leading size (a callable ``batch`` then has no micro-batch).
        fsdp_ranks: the rank counts to try FSDP2 over (e.g. ``(2, 4, 8)``), the effective batch kept; none by
            default (each is a dry run of every class of ranks).
        compile_fixes: measure ``torch.compile`` (where nothing is compiled yet) and, with
            ``activation_memory_budgets``, the budget for it; off by default, as a compiled dry run costs several
            eager ones.
        activation_memory_budgets: the values of ``torch._functorch.config.activation_memory_budget`` to try for
            the compiled step, each in [0, 1] (e.g. ``BUDGET_GRID``, ``(0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0)``);
            none by default, as each is a compiled dry run, several times an eager one. The user's budget is as it
            was after.
        **options: see :class:`~lightning_memtenants.predict.dryrun.PredictOptions`, the step's own settings
            (``loss_fn``, ``optimizer``, ``precision``, ``target``, ``accumulate_grad_batches``...); every dry
            run is of two steps, so ``steps`` is not one of them.

    Returns:
        The baseline's peak, the budget and the measured fixes.

    Raises:
        ValueError: naming the argument, for a bad ``budget_bytes``, ``margin``, ``make_batch``, ``fsdp_ranks``,
            ``activation_memory_budgets``, ``steps``, ``strategy`` or ``world_size``, or as ``dry_run`` for a bad
            model, batch or option.
        TypeError: for an option that does not exist.

    Example::

        advice = advise(SeedMLP(), (torch.Size([2048, 1024]),), "512MiB")
        for fix in advice.fixes:
            print(fix.name, fix.peak_bytes, fix.fits, fix.how)
    """
    total = parse_bytes(budget_bytes, "budget_bytes")  # the callback's rule and message
    limit = limit_bytes(total, margin)
    if make_batch is not None and not callable(make_batch):
        raise ValueError(
            f"make_batch must be None or a callable make_batch(batch_size) -> batch, got {brief(make_batch)}"
        )
    if "steps" in options:
        raise ValueError(
            f"steps is not an option of advise: every dry run is of two steps (the first optimizer step and a"
            f" steady-state one), got steps={brief(options['steps'])}"
        )
    ranks = tuple(fsdp_ranks) if isinstance(fsdp_ranks, (list, tuple)) else None
    if ranks is None or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in ranks):
        raise ValueError(f"fsdp_ranks must be a list of rank counts of 2 or more, got {brief(fsdp_ranks)}")
    budgets = _budgets(activation_memory_budgets)
    if not isinstance(compile_fixes, bool):
        raise ValueError(f"compile_fixes must be True or False, got {brief(compile_fixes)}")
    spread = options.get("strategy") is not None or options.get("world_size", 1) != 1
    if spread or options.get("tensor_parallel", 1) != 1:
        raise ValueError(
            "strategy, world_size and tensor_parallel: advise measures one device's step; give fsdp_ranks for FSDP"
        )
    runner = _Runner(model, batch, make_batch, dict(options), limit, tuple(sorted(set(ranks))), budgets)
    runner.compile_fixes = compile_fixes
    baseline = runner.baseline()  # the user's own step: where it fails, advise fails with its error
    fixes, notes = _candidates(runner)
    measured = _measure_all(runner, baseline, limit, fixes, notes)
    keeping = [fix for fix in measured if fix.fits and fix.batch_size is None and not fix.changes_training]
    if baseline > limit and not keeping:  # no fix that keeps the batch and the training fits: combine them
        measured += _measure_all(runner, baseline, limit, _combinations(runner, notes, measured), notes)
    measured.sort(key=lambda fix: (not fix.fits, fix.peak_bytes, fix.name))
    return Advice(baseline, int(total), float(margin), limit, runner.samples, measured, notes)


# -- a setting of the step: what a fix changes -----------------------------------------------------------------------


@dataclass(frozen=True)
class _OptimizerChange:
    """What a fix does to the optimizers: new flags in place (``foreach``, ``fused``), or another optimizer."""

    name: str
    flags: tuple[tuple[str, Any], ...] = ()
    replace: str | None = None  # "sgd" or "adafactor"

    def change(self, optimizer: Optimizer, *, dry: bool) -> Optimizer:
        """``optimizer`` changed (in place for flags), or its replacement over the same parameters."""
        if self.replace is None:
            for group in optimizer.param_groups:
                group.update(self.flags)
            optimizer.defaults.update(self.flags)
            return optimizer
        groups = [{"params": group["params"], "lr": group.get("lr", ADAFACTOR_LR)} for group in optimizer.param_groups]
        if self.replace == "sgd":
            return torch.optim.SGD(groups, lr=groups[0]["lr"], momentum=0.9)
        made = torch.optim.Adafactor(groups, lr=groups[0]["lr"])
        if dry:  # its step reads parameter norms (``.item()``), which fake tensors have not
            made.step = functools.partial(_any_scalar_step, made.step)  # type: ignore[method-assign]
        return made


class _AnyScalar(TorchDispatchMode):
    """Answers a fake tensor's ``.item()`` with 1: Adafactor's step reads norms only to scale its update, and the
    scale changes no tensor's size, so the step's memory is what a real step allocates."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return 1.0 if args[0].is_floating_point() else 1
        return func(*args, **(kwargs or {}))


# the operators whose result is an n x n matrix of their operands' rows, and batch norm's (a bool argument: training)
_PRODUCTS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "_cdist_forward": (0, 1)}
_BATCH_NORMS = {"native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm", "miopen_batch_norm"}


class _BatchWide(TorchDispatchMode):
    """Notes, and never changes, what makes a step's result depend on its batch as a whole: a batch norm in training
    mode over more than one row, and the sizes of square products of two tensors computed from the batch (an
    activation times a weight, or an autocast copy of one, is not one).

    What is computed from the batch is followed by storage: the batch's tensors, then every output of an operator
    that reads one of them.
    """

    def __init__(self, batch: Any, squares: set[int]) -> None:
        super().__init__()
        self.squares = squares
        self.from_batch = {_key(t) for t in batch_tensors(batch)}
        self.batch_norm = False  # a batch norm in training mode, over more than one row
        self.running_stats = False  # one that updates running statistics: a recomputation would update them again

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.from_batch and any(_key(t) in self.from_batch for t in batch_tensors((args, kwargs))):
            self.from_batch.update(_key(t) for t in batch_tensors(out))
        name = func.overloadpacket.__name__
        if name in _BATCH_NORMS:
            training = next((a for a in args if isinstance(a, bool)), False)
            if training and isinstance(args[0], Tensor) and args[0].dim() and args[0].shape[0] > 1:
                self.batch_norm = True
            self.running_stats |= training and len(args) > 3 and isinstance(args[3], Tensor)
        elif name in _PRODUCTS and isinstance(out, Tensor) and out.dim() >= 2 and out.shape[-1] == out.shape[-2]:
            operands = [args[i] for i in _PRODUCTS[name]]
            if all(isinstance(t, Tensor) and _key(t) in self.from_batch for t in operands):
                self.squares.add(int(out.shape[-1]))
        return out


def _key(tensor: Tensor) -> int:
    """The storage's key, or the tensor's own for a tensor without one (a wrapper subclass): ids only, so that no
    storage is kept alive by being watched."""
    try:
        return storage_key(tensor)
    except (RuntimeError, NotImplementedError, TypeError):
        return id(tensor)


def _any_scalar_step(step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with _AnyScalar():
        return step(*args, **kwargs)


@dataclass(frozen=True)
class _Setting:
    """One configuration of the step: the precision, the checkpointed blocks, the micro-batch, the optimizer."""

    precision: str
    accumulate: int
    blocks: tuple[str, ...] = ()
    micro: int | None = None  # None: the batch as given
    optimizer: _OptimizerChange | None = None
    ranks: int = 1  # above 1: FSDP2 over this many ranks, each with the micro-batch
    compiled: tuple[str, ...] | None = None  # the modules compiled in place (``module.compile()``); "" is the root
    budget: float | None = None  # torch._functorch.config.activation_memory_budget in the dry run; None: as it is


@dataclass(frozen=True)
class _Candidate:
    name: str
    setting: _Setting
    how: str
    changes_training: bool = False


class _Runner:
    """Dry runs of the step in each setting, each run once; the blocks and optimizers found on the way."""

    def __init__(
        self,
        model: ModelArg,
        batch: Any,
        make_batch: Callable[[int], Any] | None,
        options: dict,
        limit: int,
        fsdp_ranks: tuple[int, ...] = (),
        budgets: tuple[float, ...] = (),
    ) -> None:
        self.model, self.batch, self.make_batch, self.limit = model, batch, make_batch, limit
        self.fsdp_ranks, self.budgets = fsdp_ranks, budgets
        self.compile_fixes = False  # torch.compile measured where nothing is compiled yet
        self.options = options
        precision = options.get("precision", DEFAULTS["precision"])
        accumulate = options.get("accumulate_grad_batches", DEFAULTS["accumulate_grad_batches"])
        # the optimizers come from the module's configure_optimizers, else from the ``optimizer`` factory
        self.configured = options.get("loss_fn") is None and options.get("optimizer") is None
        self.base = _Setting(precision, accumulate)  # checked by the first dry run
        self.peaks: dict[_Setting, int] = {}
        self.samples = 1
        self.blocks: list[tuple[str, int]] = []  # (name, bytes saved for backward), most first
        self.optimizers: list[tuple[type, dict[str, Any]]] = []  # (class, the first group's flags)
        self.manual = False  # the LightningModule optimizes by hand (automatic_optimization=False)
        self.batch_norm = False  # a step normalizes over the batch (BatchNorm in training mode)
        self.squares: dict[int | None, set[int]] = {}  # by micro-batch (None: as given): n of n x n products seen
        self.unsafe_blocks: list[str] = []  # blocks whose recomputation would differ: never checkpointed
        self.bad_argument: BaseException | None = None  # what make_batch raised, raised by advise as it is
        self.compiled = isinstance(model, nn.Module) and _has_compiled(model)  # the user compiled parts already
        self.lightning = options.get("loss_fn") is None

    def baseline(self) -> int:
        """The step's own peak; its dry run checks every argument, finds the batch size and sees the optimizers."""
        prediction = self._run(self.base, steps=2, record=True)
        self.samples = prediction.batch_size
        self.peaks[self.base] = max(r.peak_bytes or 0 for r in prediction.reports)
        return self.peaks[self.base]

    def peak(self, setting: _Setting) -> int:
        """The highest step peak of a two-step dry run in ``setting``."""
        if setting not in self.peaks:
            prediction = self._run(setting, steps=2)
            reports = [*prediction.reports, *prediction.ranks]  # rank 0's steps, and every rank's last
            self.peaks[setting] = max(r.peak_bytes or 0 for r in reports)
        return self.peaks[setting]

    def fits(self, setting: _Setting) -> bool:
        return self.peak(setting) <= self.limit

    def _run(
        self,
        setting: _Setting,
        *,
        steps: int,
        record: bool = False,
        prepare: Callable[[nn.Module], None] | None = None,
    ) -> Prediction:
        """One dry run in ``setting``; ``record`` keeps the optimizers' classes and flags as the step makes them."""
        options: dict[str, Any] = {
            **self.options,
            "steps": steps,
            "precision": setting.precision,
            "accumulate_grad_batches": setting.accumulate,
        }
        if setting.ranks > 1:
            options.update(strategy="fsdp", world_size=setting.ranks)
        change = setting.optimizer
        if not self.configured and (change is not None or record):  # the optimizer factory, changed or watched
            factory = self.options.get("optimizer") or torch.optim.Adam
            seen = self._seen if record else _same
            if change is None:
                options["optimizer"] = lambda params: seen(factory(params))
            else:
                options["optimizer"] = lambda params: seen(change.change(factory(params), dry=True))
        modules = _module_change(setting.blocks, change if self.configured else None, dry=True)
        squares = self.squares.setdefault(setting.micro, set())
        lightning = self.options.get("loss_fn") is None
        if not lightning:
            loss_fn = self.options["loss_fn"]
            options["loss_fn"] = lambda module, batch: self._watched(batch, squares, lambda: loss_fn(module, batch))

        def prepared(fake: nn.Module) -> None:
            if record:
                self.manual = lightning and getattr(fake, "automatic_optimization", True) is False
            step = getattr(fake, "training_step", None)
            if lightning and callable(step):
                fake.training_step = lambda *a, **k: self._watched((a, k), squares, lambda: step(*a, **k))  # type: ignore[method-assign]
            modules(fake)
            if record:
                self.compiled |= _has_compiled(fake)
            if setting.compiled is not None:
                _compile_in_place(fake, setting.compiled)
            if prepare is not None:
                prepare(fake)
            configure = getattr(fake, "configure_optimizers", None)
            if record and self.configured and callable(configure):
                fake.configure_optimizers = lambda: _map_optimizers(configure(), self._seen)  # type: ignore[method-assign]

        batch = self.batch if setting.micro is None else self.micro_batch(setting.micro)
        if setting.budget is None:
            return _frozen(self.model, batch, options, timeline=False, prepare=prepared)  # type: ignore[arg-type]
        with activation_memory_budget_set(setting.budget):  # the user's config as it was after
            return _frozen(self.model, batch, options, timeline=False, prepare=prepared)  # type: ignore[arg-type]

    def _watched(self, batch: Any, squares: set[int], run: Callable[[], Any]) -> Any:
        """``run()``, the user's step on ``batch``, with what makes its result depend on the whole batch noted."""
        watch = _BatchWide(batch, squares)
        with watch:
            out = run()
        self.batch_norm |= watch.batch_norm
        return out

    def training_change(self, setting: _Setting) -> str:
        """Why ``setting``'s smaller batch a device changes what the step computes, one sentence; empty if it does
        not: BatchNorm in training mode, or an n x n product of activations at the whole batch and the micro-batch
        (a contrastive or in-batch loss; an n x n product at one size alone is a square weight or attention)."""
        if setting.micro is None:
            return ""
        reasons = []
        if self.batch_norm:
            reasons.append("BatchNorm normalizes over the batch in training")
        whole, micro = self.squares.get(None, set()), self.squares.get(setting.micro, set())
        if self.samples in whole and setting.micro in micro:
            reasons.append("the step multiplies the batch by itself (a batch x batch matrix, as in a contrastive loss)")
        if not reasons:
            return ""
        return (
            f"it changes training: {' and '.join(reasons)}, so a batch of {setting.micro} samples a device computes"
            f" other values than {self.samples}"
        )

    def _seen(self, optimizer: Optimizer) -> Optimizer:
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        flags = {key: group.get(key) for key in ("foreach", "fused") if key in optimizer.defaults}
        self.optimizers.append((type(optimizer), flags))
        return optimizer

    def micro_batch(self, size: int) -> Any:
        """The batch at ``size`` samples: ``make_batch(size)``, else the given batch cut along its leading size."""
        if self.make_batch is not None:
            try:
                return batch_at(self.make_batch, size)
            except Exception as error:  # the caller's make_batch: raised by advise as it is, never a note
                self.bad_argument = error
                raise
        return _resized(self.batch, self.samples, size)

    def rank_blocks(self) -> None:
        """What each block saves for backward, in a one-step dry run: the storages made inside it and kept."""
        saved: dict[str, int] = {}
        unsafe: set[str] = set()

        def measure(fake: nn.Module) -> None:
            for name, block in _blocks(fake):
                saved[name] = 0
                block.forward = _Measured(block, name, saved, unsafe)  # type: ignore[method-assign]

        self._run(self.base, steps=1, prepare=measure)
        ranked = sorted(saved.items(), key=lambda item: -item[1])
        self.blocks = [(name, nbytes) for name, nbytes in ranked if nbytes > 0 and name not in unsafe]
        self.unsafe_blocks = [name for name in saved if name in unsafe]


def _same(optimizer: Optimizer) -> Optimizer:
    return optimizer


# -- the fixes a user applies: checkpointed blocks, changed optimizers ----------------------------------------------


class _Checkpointed:
    """A block's forward under non-reentrant activation checkpointing: what it saves is recomputed in backward.

    Set as the block's own ``forward``, so that its parameters keep their names (a checkpoint loads as before).
    """

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.inner = block.__dict__.get("forward")  # a forward the instance was given, else the class's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.inner if self.inner is not None else type(self.block).forward.__get__(self.block)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


class _Measured:
    """A block's forward that adds up the bytes of the storages it makes and saves for backward, and notes a block
    whose recomputation would differ: a batch norm updating its running statistics would update them twice."""

    def __init__(self, block: nn.Module, name: str, saved: dict[str, int], unsafe: set[str]) -> None:
        self.block, self.name, self.saved, self.unsafe = block, name, saved, unsafe

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kept = {storage_key(t) for t in (*self.block.parameters(), *self.block.buffers())}
        kept |= {storage_key(t) for t in batch_tensors((args, kwargs))}  # checkpointing keeps the inputs
        seen: set[int] = set()

        def pack(tensor: Tensor) -> Tensor:
            key = storage_key(tensor)
            if key not in kept and key not in seen:
                seen.add(key)
                self.saved[self.name] += int(tensor.untyped_storage().nbytes())
            return tensor

        watch = _BatchWide(None, set())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), watch:
            out = type(self.block).forward(self.block, *args, **kwargs)
        if watch.running_stats:
            self.unsafe.add(self.name)
        return out


def checkpoint_blocks(module: nn.Module, names: Sequence[str]) -> None:
    """Wrap the named blocks of ``module`` in non-reentrant activation checkpointing, in place; twice is once.

    A transformers layer (a ``GradientCheckpointingLayer``) is switched by its own ``gradient_checkpointing`` flag,
    as ``gradient_checkpointing_enable()`` switches every layer, with the models above it, so that the step runs
    with the KV cache off: wrapped from outside, its recomputation would write the cache again.

    Args:
        module: the model (a LightningModule or any ``nn.Module``).
        names: the blocks' names in ``module.named_modules()``, e.g. ``"blocks.3"``.

    Raises:
        ValueError: naming ``module`` if it is not an ``nn.Module``, ``names`` if it is not a list of names, or a
            name ``module`` has no submodule of.
    """
    _check_module(module)
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"names must be a list of block names such as ['blocks.0'], got {brief(names)}")
    for name in names:
        try:
            block = module.get_submodule(name)
        except AttributeError:
            raise ValueError(f"names: {type(module).__name__} has no block {name!r}") from None
        if hf_layer(block):
            _hf_checkpointing(module, name, block)
        elif not isinstance(block.__dict__.get("forward"), _Checkpointed):
            block.forward = _Checkpointed(block)  # type: ignore[method-assign]


def _hf_checkpointing(module: nn.Module, name: str, block: nn.Module) -> None:
    """Hugging Face's own checkpointing of one layer, as ``gradient_checkpointing_enable()`` sets it for every layer.

    The layer's ``gradient_checkpointing`` flag makes it checkpoint itself and drop the KV cache it is handed; the
    same flag on the models above it (``MistralModel``, T5's stacks) turns ``use_cache`` off for the step, so that
    the recomputation does not write the cache again; modules inside the layer that read the flag (T5's attention)
    get it too. Other layers keep theirs.
    """
    func = functools.partial(checkpoint, use_reentrant=False)
    parts = name.split(".")
    above = [module.get_submodule(".".join(parts[:i])) for i in range(len(parts))]
    for m in [*above, *block.modules()]:
        if isinstance(getattr(m, "gradient_checkpointing", None), bool):
            m.gradient_checkpointing = True
            m._gradient_checkpointing_func = func


def _module_change(
    blocks: tuple[str, ...], change: _OptimizerChange | None, *, dry: bool
) -> Callable[[nn.Module], None]:
    """What a fix does to a module: checkpoint ``blocks``, and change the optimizers ``configure_optimizers`` makes."""

    def apply(module: nn.Module) -> None:
        _check_module(module)
        checkpoint_blocks(module, blocks)
        if change is None:
            return
        configure = getattr(module, "configure_optimizers", None)
        if not callable(configure):
            raise ValueError(
                f"module: the fix {change.name} changes the optimizers of configure_optimizers, which"
                f" {type(module).__name__} does not have"
            )
        module.configure_optimizers = functools.partial(_changed_optimizers, configure, change, dry)  # type: ignore[method-assign]

    return apply


def _check_module(module: Any) -> None:
    """Every fix's ``apply`` takes the model: one clear error for anything else (``None``, the Trainer, a batch)."""
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"module must be the model to fix, an nn.Module (a LightningModule), got {brief(module)}; call"
            " fix.apply(model) before trainer.fit(model)"
        )


def _changed_optimizers(configure: Callable[[], Any], change: _OptimizerChange, dry: bool) -> Any:
    return _map_optimizers(configure(), lambda optimizer: change.change(optimizer, dry=dry))


def _map_optimizers(returned: Any, fn: Callable[[Optimizer], Optimizer]) -> Any:
    """What ``configure_optimizers`` returned, each optimizer passed through ``fn``, each scheduler moved to its
    optimizer's replacement: every form Lightning takes (an optimizer, lists of optimizers and schedulers, dicts)."""
    replaced: dict[int, tuple[Optimizer, Optimizer]] = {}

    def walk(item: Any) -> Any:
        if isinstance(item, Optimizer):
            if id(item) not in replaced:
                replaced[id(item)] = (item, fn(item))
            return replaced[id(item)][1]
        if isinstance(item, dict):
            return {key: walk(value) for key, value in item.items()}
        if isinstance(item, list):
            return [walk(value) for value in item]
        if isinstance(item, tuple) and not hasattr(item, "_fields"):
            return tuple(walk(value) for value in item)
        return item

    out = walk(returned)
    if any(new is not old for old, new in replaced.values()):
        for scheduler in _schedulers(out):
            old = scheduler.optimizer
            if id(old) in replaced and replaced[id(old)][1] is not old:
                _follow(scheduler, old, replaced[id(old)][1])
    return out


def _schedulers(item: Any) -> Iterator[Any]:
    """The learning-rate schedulers in what ``configure_optimizers`` returned, those that chain others included."""
    if isinstance(item, dict):
        for value in item.values():
            yield from _schedulers(value)
    elif isinstance(item, (list, tuple)):
        for value in item:
            yield from _schedulers(value)
    elif isinstance(getattr(item, "optimizer", None), Optimizer):
        yield item
        for inner in getattr(item, "_schedulers", None) or ():  # SequentialLR's and ChainedScheduler's
            yield from _schedulers(inner)


def _follow(scheduler: Any, old: Optimizer, new: Optimizer) -> None:
    """``scheduler``, made for ``old``, moved to its replacement ``new``: what the scheduler wrote in the parameter
    groups (``initial_lr``; ``max_lr``, ``min_lr`` and the momenta for OneCycleLR) and the current learning rate
    go over with it, so that its next ``step()`` finds them; a cycled momentum follows the new optimizer's own
    (SGD's ``momentum``, Adam's first beta), or stops where it has none (Adafactor)."""
    # a scheduler's constructor marks its optimizer's step() as stepped before its own (else torch warns that the
    # step was overridden): a throwaway LambdaLR's does that for ``new``; the learning rates are set again below (a
    # dry run's Adafactor, whose step is a wrapper and not a method, is left as it is)
    if inspect.ismethod(new.step):
        torch.optim.lr_scheduler.LambdaLR(new, lambda _: 1.0)
    for before, after in zip(old.param_groups, new.param_groups, strict=False):
        for key, value in before.items():
            if key != "params" and key not in old.defaults:
                after[key] = value
        after["lr"] = before["lr"]
    if getattr(scheduler, "cycle_momentum", False):  # OneCycleLR, CyclicLR: the momentum the new optimizer has
        scheduler.use_beta1 = "betas" in new.defaults
        scheduler.cycle_momentum = scheduler.use_beta1 or "momentum" in new.defaults
    scheduler.optimizer = new


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks to checkpoint: the model's repeated layers (``named_blocks``, FSDP's units too), else the top-level
    children (a lone child stands for its own children)."""
    listed = named_blocks(module)
    if listed:
        return listed
    prefix, current = "", module
    while True:
        children = list(current.named_children())
        if len(children) != 1:
            return [(prefix + child, block) for child, block in children]
        child, current = children[0]
        prefix += child + "."


def _resized(batch: Any, samples: int, size: int) -> Any:
    """``batch`` at ``size`` samples: every tensor and shape whose leading size is ``samples`` cut to ``size``.

    Floating tensors become meta stand-ins (a dry run needs their shape alone); integer and boolean ones keep
    their first rows' values, so token ids and masks stay real.
    """
    if isinstance(batch, torch.Size):
        return torch.Size([size, *batch[1:]]) if len(batch) and batch[0] == samples else batch
    if isinstance(batch, Tensor):
        if batch.dim() == 0 or int(batch.shape[0]) != samples:
            return batch
        if batch.is_meta or batch.is_floating_point() or batch.is_complex():
            return torch.empty((size, *batch.shape[1:]), dtype=batch.dtype, device="meta")
        return batch[:size].clone()
    if isinstance(batch, dict):
        return {key: _resized(value, samples, size) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_resized(value, samples, size) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_resized(value, samples, size) for value in batch)
    return batch


# -- the candidates ------------------------------------------------------------------------------------------------


def _candidates(runner: _Runner) -> tuple[list[_Candidate], list[str]]:
    """Every single fix that applies to this step, with its setting searched where it has a size (blocks, batch).

    A candidate whose dry runs fail is left out with a note: one failing candidate never fails the others.
    """
    base, notes = runner.base, []
    found: list[_Candidate | None] = []
    if check_precision(base.precision) == "32-true":
        found.append(_Candidate(BF16, _Setting(BF16, base.accumulate), "Trainer(precision='bf16-mixed')"))
    else:
        notes.append(f"{BF16}: the step runs in {base.precision} already")
    found.append(_attempt(runner, notes, CHECKPOINTING, lambda: _checkpoint_candidate(runner, base, notes)))
    found.append(_attempt(runner, notes, MICRO_BATCH, lambda: _micro_candidate(runner, base, notes)))
    found += _attempt(runner, notes, "the optimizer", lambda: _optimizer_candidates(runner, base, notes)) or []
    found.append(_attempt(runner, notes, "FSDP over N ranks", lambda: _fsdp_candidate(runner, base, notes)))
    found += _attempt(runner, notes, COMPILE, lambda: _compile_candidates(runner, base, notes)) or []
    return [candidate for candidate in found if candidate is not None], notes


def _attempt(runner: _Runner, notes: list[str], name: str, run: Callable[[], _T]) -> _T | None:
    """``run()``, or None with a note where it raises: a fix whose dry run fails is not offered. A bad argument of
    the caller's (``make_batch`` failing for a size) is raised as it is: it is no candidate's failure."""
    try:
        return run()
    except Exception as error:  # any failure of one candidate's dry runs: the others go on
        if error is runner.bad_argument:
            raise
        notes.append(failed_note(name, error))
        return None


def failed_note(name: str, error: BaseException) -> str:
    """The one sentence of a candidate left out because a dry run of the step with it failed.

    Args:
        name: the candidate, e.g. ``"activation checkpointing (2 of 2 blocks)"``.
        error: what its dry run raised.

    Returns:
        ``"<name>: left out, as a dry run of the step with it failed (<error type>: <its first line>)"``.
    """
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    first = first if len(first) <= 200 else first[:197] + "..."
    detail = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return f"{name}: left out, as a dry run of the step with it failed ({detail})"


def _measure_all(
    runner: _Runner, baseline: int, limit: int, candidates: list[_Candidate], notes: list[str]
) -> list[MeasuredFix]:
    """Each candidate measured by its own dry run, the fix applied; one that fails there is left out with a note."""
    measured = []
    for candidate in candidates:
        fix = _attempt(runner, notes, candidate.name, functools.partial(_measured, runner, baseline, limit, candidate))
        if fix is not None:
            measured.append(fix)
    return measured


def _fewest_blocks(runner: _Runner, setting: _Setting) -> _Setting:
    """``setting`` with the fewest of the largest-saving blocks checkpointed that fit; every block where even
    all do not fit, or where the step fits without any (the most checkpointing saves)."""
    names = [name for name, _ in runner.blocks]
    every = _with(setting, blocks=tuple(names))
    if runner.fits(setting) or not runner.fits(every):
        return every
    lo, hi = 0, len(names)  # lo blocks do not fit, hi blocks fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runner.fits(_with(setting, blocks=tuple(names[:mid]))):
            hi = mid
        else:
            lo = mid
    return _with(setting, blocks=tuple(names[:hi]))


def _checkpoint_candidate(runner: _Runner, base: _Setting, notes: list[str]) -> _Candidate | None:
    runner.rank_blocks()
    if runner.unsafe_blocks:
        listed = ", ".join(runner.unsafe_blocks)
        notes.append(
            f"{CHECKPOINTING}: {listed} left out, as their BatchNorm would update its running statistics again when"
            " checkpointing recomputes the block"
        )
    if not runner.blocks:
        notes.append(f"{CHECKPOINTING}: the model has no blocks that save tensors for backward")
        return None
    setting = _fewest_blocks(runner, base)
    return _Candidate(_checkpoint_name(runner, setting), setting, _checkpoint_how(setting.blocks))


def _checkpoint_name(runner: _Runner, setting: _Setting) -> str:
    return f"{CHECKPOINTING} ({len(setting.blocks)} of {len(runner.blocks)} blocks)"


def _checkpoint_how(blocks: tuple[str, ...]) -> str:
    listed = ", ".join(blocks) if len(blocks) <= 4 else f"{', '.join(blocks[:3])} and {len(blocks) - 3} more"
    return (
        f"wrap {listed} in torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False), as fix.apply(model) does"
    )


def _micro_sizes(samples: int) -> list[int]:
    """The micro-batches that keep the effective batch: the divisors of ``samples`` below it, largest first."""
    return [samples // k for k in range(2, samples + 1) if samples % k == 0]


def _largest_micro(runner: _Runner, setting: _Setting) -> _Setting | None:
    """``setting`` with the largest micro-batch that fits, accumulating the rest; None for a batch of one sample.

    The micro-batch is halved (to the largest divisor of the batch at most half the last) until it fits, then
    the divisors between the last two tried are searched. The halving stops early where the peak cannot reach the
    limit: each halving of a micro-batch saves about half what the one before it saved, so a peak above the limit by
    more than its last saving stays above it (the smallest size tried is then the answer, and it does not fit).
    Where the step fits as it is, the answer is half the batch, to show what that saves.
    """
    sizes = _micro_sizes(runner.samples)
    if not sizes:
        return None

    def at(size: int) -> _Setting:
        return _with(setting, micro=size, accumulate=setting.accumulate * (runner.samples // size))

    if runner.fits(setting):
        return at(sizes[0])
    failed, previous = runner.samples, runner.peak(setting)
    while True:
        size = max(s for s in sizes if s <= failed // 2) if failed > 1 else None
        if size is None:
            return at(failed)
        peak = runner.peak(at(size))
        if peak <= runner.limit:
            break
        if peak - (previous - peak) > runner.limit or size == sizes[-1]:
            return at(size)
        failed, previous = size, peak
    between = [s for s in sizes if size < s < failed]  # largest first: the first that fits is the answer
    fits_at, left, right = size, 0, len(between) - 1
    while left <= right:
        mid = (left + right) // 2
        if runner.fits(at(between[mid])):
            fits_at, right = between[mid], mid - 1
        else:
            left = mid + 1
    return at(fits_at)


def _micro_candidate(runner: _Runner, base: _Setting, notes: list[str]) -> _Candidate | None:
    if runner.manual:
        notes.append(
            f"{MICRO_BATCH}: the module optimizes by hand (automatic_optimization=False), where Lightning's"
            " accumulate_grad_batches must be 1; accumulate in training_step to step on smaller micro-batches"
        )
        return None
    if callable(runner.batch) and runner.make_batch is None:
        notes.append(f"{MICRO_BATCH}: the batch is a callable; give make_batch(batch_size) to try smaller ones")
        return None
    setting = _largest_micro(runner, base)
    if setting is None:
        notes.append(f"{MICRO_BATCH}: a batch of {runner.samples} cannot be cut smaller")
        return None
    return _Candidate(_micro_name(setting), setting, _micro_how(runner, setting))


def _micro_name(setting: _Setting) -> str:
    return f"{MICRO_BATCH} ({setting.micro} x accumulate_grad_batches={setting.accumulate})"


def _micro_how(runner: _Runner, setting: _Setting) -> str:
    return (
        f"DataLoader(..., batch_size={setting.micro}) and Trainer(accumulate_grad_batches={setting.accumulate}),"
        f" which keeps the effective batch of {runner.samples * runner.base.accumulate}"
    )


def _optimizer_candidates(runner: _Runner, base: _Setting, notes: list[str]) -> list[_Candidate]:
    """The optimizer's own implementations, where its class takes them, and the cheaper optimizers."""
    if not runner.optimizers:
        notes.append("the optimizer: the step makes none that a dry run could see")
        return []
    kinds = {cls for cls, _ in runner.optimizers}
    cuda = str(runner.options.get("target", "cpu")).strip().lower() != "cpu"
    found = []
    where = "configure_optimizers" if runner.configured else "the optimizer factory"
    takes_foreach = [flags for _, flags in runner.optimizers if "foreach" in flags]
    # foreach keeps a temporary for every parameter at once; the single-tensor loop, torch's default on the CPU,
    # one parameter's
    if any(flags.get("foreach") or (flags.get("foreach") is None and cuda) for flags in takes_foreach):
        change = _OptimizerChange(FOREACH, (("foreach", False),))
        how = f"pass foreach=False to the optimizer in {where}"
        found.append(_Candidate(FOREACH, _with(base, optimizer=change), how))
    elif takes_foreach:
        notes.append(f"{FOREACH}: the optimizer runs its single-tensor loop already (torch's default on the CPU)")
    if any("fused" in flags and not flags["fused"] for _, flags in runner.optimizers):
        change = _OptimizerChange(FUSED, (("fused", True), ("foreach", False)))
        how = f"pass fused=True to the optimizer in {where}, e.g. torch.optim.AdamW(self.parameters(), fused=True)"
        found.append(_Candidate(FUSED, _with(base, optimizer=change), how))
    for name, kind, cls, written in (
        (SGD, "sgd", torch.optim.SGD, "torch.optim.SGD(self.parameters(), lr=..., momentum=0.9)"),
        (ADAFACTOR, "adafactor", torch.optim.Adafactor, "torch.optim.Adafactor(self.parameters(), lr=...)"),
    ):
        if kinds == {cls}:
            notes.append(f"{name}: the step uses it already")
            continue
        if runner.configured:
            how = f"return {written} from configure_optimizers, and tune its learning rate: it trains differently"
        else:
            made = written.replace("self.parameters()", "params")
            how = f"make the optimizer factory return {made}, and tune its learning rate: it trains differently"
        found.append(_Candidate(name, _with(base, optimizer=_OptimizerChange(name, replace=kind)), how, True))
    return found


def _fsdp_candidate(runner: _Runner, base: _Setting, notes: list[str]) -> _Candidate | None:
    """FSDP over N ranks, the effective batch kept: the fewest of ``fsdp_ranks`` whose every rank fits.

    Each rank takes ``samples / N`` of the batch (with the same accumulation), so the effective batch is the
    same; its peak is the highest of rank 0's two steps and every rank's last (``dry_run(...).ranks``), by
    ``dry_run(strategy="fsdp", world_size=N)``: FSDP2's ``fully_shard``, the module's own ``configure_model``
    where it shards, else per block (its repeated layers) and the root. Where none fits, the most ranks.
    """
    if not runner.fsdp_ranks:
        notes.append("FSDP over N ranks: give fsdp_ranks=(2, 4, 8) to measure it (one dry run per rank class)")
        return None
    if callable(runner.batch) and runner.make_batch is None:
        notes.append("FSDP over N ranks: the batch is a callable; give make_batch(batch_size) to split it over ranks")
        return None
    usable = [n for n in runner.fsdp_ranks if runner.samples % n == 0]
    for n in runner.fsdp_ranks:
        if n not in usable:
            notes.append(f"FSDP over {n} ranks: a batch of {runner.samples} does not split over {n} ranks")
    if not usable:
        return None
    setting = base
    for n in usable:
        setting = _with(base, ranks=n, micro=runner.samples // n)
        if runner.fits(setting):
            break
    n, micro = setting.ranks, setting.micro
    how = (
        f"Trainer(strategy=ModelParallelStrategy(data_parallel_size={n}, tensor_parallel_size=1), devices={n})"
        f" with DataLoader(..., batch_size={micro}) per rank, the model sharded by FSDP2's fully_shard in"
        " configure_model (per block and each module the step calls, as the dry run does for a model that shards"
        " nothing itself)"
    )
    return _Candidate(f"FSDP over {n} ranks", setting, how)


def _combinations(runner: _Runner, notes: list[str], measured: list[MeasuredFix]) -> list[_Candidate]:
    """Where no single fix fits: bf16-mixed with checkpointing, with the micro-batch, and all three; each of
    checkpointing and the micro-batch only where its single fix was measured, and each combination searched on its
    own (one whose dry runs fail is left out with a note)."""
    base, found = runner.base, []
    bf16 = check_precision(base.precision) == "32-true"
    kinds = {fix.name.split(" (")[0] for fix in measured}
    splittable = MICRO_BATCH in kinds
    every = tuple(name for name, _ in runner.blocks) if CHECKPOINTING in kinds else ()
    low = _with(base, precision=BF16) if bf16 else base
    parts_bf16 = ["Trainer(precision='bf16-mixed')"] if bf16 else []

    def checkpointed() -> _Candidate:
        setting = _fewest_blocks(runner, low)
        name = f"{BF16} + {_checkpoint_name(runner, setting)}"
        return _Candidate(name, setting, "; ".join([*parts_bf16, _checkpoint_how(setting.blocks)]))

    def micro(blocks: tuple[str, ...]) -> _Candidate | None:
        setting = _largest_micro(runner, _with(low, blocks=blocks))
        if setting is None:
            return None
        parts = [*([BF16] if bf16 else []), *([_checkpoint_name(runner, setting)] if blocks else [])]
        hows = [*parts_bf16, *([_checkpoint_how(blocks)] if blocks else []), _micro_how(runner, setting)]
        return _Candidate(" + ".join([*parts, _micro_name(setting)]), setting, "; ".join(hows))

    if bf16 and every:
        found.append(_attempt(runner, notes, f"{BF16} + {CHECKPOINTING}", checkpointed))
    if bf16 and splittable:
        found.append(_attempt(runner, notes, f"{BF16} + {MICRO_BATCH}", lambda: micro(())))
    if every and splittable:
        name = " + ".join([*([BF16] if bf16 else []), CHECKPOINTING, MICRO_BATCH])
        found.append(_attempt(runner, notes, name, lambda: micro(every)))
    if not (bf16 and every) and not (bf16 and splittable) and not (every and splittable):
        notes.append("combinations: no two candidates apply to this step")
    return [candidate for candidate in found if candidate is not None]


def _with(setting: _Setting, **changes: Any) -> _Setting:
    return replace(setting, **changes)


def _measured(runner: _Runner, baseline: int, limit: int, candidate: _Candidate) -> MeasuredFix:
    """The candidate's fix, with the peak of its dry run."""
    setting, base = candidate.setting, runner.base
    peak = runner.peak(setting)
    kwargs: dict[str, Any] = {}
    if setting.precision != base.precision:
        kwargs["precision"] = setting.precision
    if setting.accumulate != base.accumulate:
        kwargs["accumulate_grad_batches"] = setting.accumulate
    if setting.ranks > 1:
        kwargs["devices"] = setting.ranks
    change = setting.optimizer if runner.configured else None
    apply = _module_change(setting.blocks, change, dry=False) if setting.blocks or change is not None else None
    if setting.compiled is not None:
        apply = _compile_change(setting.compiled)
    batch_note = runner.training_change(setting)
    notes = [*(["it changes training: another optimizer trains differently"] if candidate.changes_training else [])]
    notes += [batch_note] if batch_note else []
    return MeasuredFix(
        name=candidate.name,
        peak_bytes=peak,
        saves_bytes=baseline - peak,
        fits=peak <= limit,
        trainer_kwargs=kwargs,
        batch_size=setting.micro,
        apply=apply,
        how=f"{candidate.how}; {batch_note}" if batch_note else candidate.how,
        changes_training=bool(notes),
        training_note="; ".join(notes),
    )


# -- torch.compile, and inductor's activation_memory_budget -----------------------------------------------------------


def _has_compiled(module: nn.Module) -> bool:
    """Whether any part of ``module`` is ``torch.compile``'d: a module compiled in place or wrapped, a compiled
    method or helper kept in an attribute, a LightningModule Lightning compiled."""
    return any(
        compiled_in_place(m)
        or compiled_by_lightning(m)
        or any(compiled_original(v) is not None for v in vars(m).values())
        for m in module.modules()
    )


def _compile_targets(runner: _Runner) -> tuple[str, ...]:
    """What to compile as a user would: the whole model where the step calls it (a loss function's model), else each
    of the LightningModule's blocks (its ``training_step`` need not call ``forward``, and Lightning runs the step
    itself eagerly)."""
    if not runner.lightning:
        return ("",)
    model = runner.model
    if not isinstance(model, nn.Module):
        return ("",)
    return tuple(name for name, _ in _blocks(model))


def _compile_in_place(module: nn.Module, names: tuple[str, ...]) -> None:
    """``target.forward = torch.compile(target.forward)`` on each named submodule ("" is ``module`` itself), as the
    user's fix does; its parameters keep their names. Not ``Module.compile()``: on torch 2.13 Dynamo skips the
    frame it compiles where the module's forward is torch's own (an ``nn.Sequential`` of ``nn.Linear``), which then
    runs eagerly. Nothing is compiled until it is called; a dry run traces the compiled calls (``predict.compiled``).
    """
    for name in names:
        target = module.get_submodule(name) if name else module
        if not compiled_in_place(target) and compiled_original(target.__dict__.get("forward")) is None:
            target.forward = torch.compile(target.forward)  # type: ignore[method-assign]


def _compile_change(names: tuple[str, ...]) -> Callable[[nn.Module], None]:
    """The ``torch.compile`` fix's ``apply``: the named submodules compiled in place."""

    def apply(module: nn.Module) -> None:
        _check_module(module)
        _compile_in_place(module, names)

    return apply


def _compile_how(names: tuple[str, ...]) -> str:
    if names == ("",):
        return "model.forward = torch.compile(model.forward) before the step runs, as fix.apply(model) does"
    listed = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} and {len(names) - 3} more"
    return f"block.forward = torch.compile(block.forward) for {listed}, as fix.apply(model) does"


def _budget_how(budget: float) -> str:
    return (
        f"set torch._functorch.config.activation_memory_budget = {budget:g} before the fit (inductor's partitioner"
        " then recomputes more of the forward in backward instead of saving it)"
    )


def _budgets(given: Any) -> tuple[float, ...]:
    """``activation_memory_budgets`` checked: values in [0, 1], largest first, each once."""
    values = tuple(given) if isinstance(given, (list, tuple)) else None
    if values is None or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1 for b in values):
        raise ValueError(f"activation_memory_budgets must be a list of values in [0, 1], got {brief(given)}")
    return tuple(sorted({float(b) for b in values}, reverse=True))


def _budget_to_set(runner: _Runner, setting: _Setting, fits_now: bool) -> float:
    """The ``activation_memory_budget`` to set: the largest of ``runner.budgets`` whose step fits.

    The peak is not monotone in the budget (pytorch issue 197838: a smaller budget can peak higher), so no budget
    is taken to fit because another does: each is a dry run of its own, largest first, until one fits (every larger
    one was run and does not). Where none fits, or the step fits already (``fits_now``: what each would save), the
    budget with the lowest peak, the largest of equals.
    """
    current = activation_memory_budget()

    def at(budget: float) -> _Setting:
        return _with(setting, budget=None if budget == current else budget)  # the budget set now: the setting's own

    if not fits_now:
        for budget in runner.budgets:
            if runner.fits(at(budget)):
                return budget
    return min(runner.budgets, key=lambda budget: (runner.peak(at(budget)), -budget))


def _compile_candidates(runner: _Runner, base: _Setting, notes: list[str]) -> list[_Candidate]:
    """``torch.compile`` (where nothing is compiled yet), and the ``activation_memory_budget`` to set for the
    compiled step where ``activation_memory_budgets`` are given.

    The compiled step is predicted as inductor compiles it (``predict.compiled``: AOT autograd, inductor's
    partitioner and, on a CPU target, its own buffer planning, under the dry run's fake tensors); a budget's dry
    run sets it only while it runs.
    """
    found = []
    setting = base
    if not runner.compiled:
        if not runner.compile_fixes:
            notes.append(f"{COMPILE}: give compile_fixes=True to measure it (a compiled dry run, several eager ones)")
            return []
        names = _compile_targets(runner)
        if not names:
            notes.append(f"{COMPILE}: the model has no blocks a dry run could compile")
            return []
        setting = _with(base, compiled=names)
        found.append(_Candidate(COMPILE, setting, _compile_how(names)))
    current = activation_memory_budget()
    if not runner.budgets:
        grid = ", ".join(f"{budget:g}" for budget in BUDGET_GRID)
        notes.append(
            f"{MEMORY_BUDGET}: give activation_memory_budgets=({grid}) to search the budget for the compiled step"
            f" (now {current:g}), one compiled dry run each"
        )
        return found
    fits_now = runner.fits(base)
    if not fits_now and runner.fits(setting):
        notes.append(f"{MEMORY_BUDGET}: the compiled step fits at the budget set now ({current:g})")
        return found
    budget = _budget_to_set(runner, setting, fits_now)
    if budget == current or runner.peak(_with(setting, budget=budget)) >= runner.peak(setting):
        notes.append(f"{MEMORY_BUDGET}: no budget tried peaks lower than the one set now ({current:g})")
        return found
    name = f"{MEMORY_BUDGET} = {budget:g}"
    how = _budget_how(budget)
    if setting.compiled is not None:
        name, how = f"{COMPILE} + {name}", f"{_compile_how(setting.compiled)}; {how}"
    found.append(_Candidate(name, _with(setting, budget=budget), how))
    return found
