"""Explicit dry runs (``predict``, ``dry_run``, ``sweep``, ``largest_batch_size``, ``advise``, the cluster's):
modules with plain tensor attributes, a copy that copies no non-tensor attribute for real, every global state left
as found, and one clear error for each bad input (issue 28, items 2, 3, 6 and 9)."""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import numpy as np
import psutil
import pytest
import torch
from conftest import CLOSURE_DIVISOR, SEED_SAVED_PER_SAMPLE, SEED_WEIGHTS
from seed_mlp import SeedMLP
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

from lightning_memtenants import MemoryTenantsCallback, advise, dry_run, largest_batch_size, predict, sweep
from lightning_memtenants._private import FakeTensor
from lightning_memtenants.lightning.alerts import meta_copy
from lightning_memtenants.predict.fake import copy_module

WIDTH = 16
MiB = 2**20


class Tiny(L.LightningModule):
    """Two blocks in a ModuleList (FSDP shards them one by one), with the tensor attributes real modules keep."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, WIDTH)) for _ in "ab")
        self.example_input_array = torch.randn(2, WIDTH)  # Lightning's own attribute
        self.pe = torch.zeros(500, WIDTH)  # a buffer that is not a buffer, as Lightning's demo Transformer keeps
        self.outputs: list[torch.Tensor] = [torch.ones(3)]  # a list of step outputs that already holds a real tensor
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for block in self.blocks:
            x = x + block(x + self.pe[0])
        loss = x.pow(2).mean()
        self.outputs.append(loss.detach())
        self.steps += 1
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def tiny_batch(size: int) -> tuple[torch.Size]:
    return (torch.Size([size, WIDTH]),)


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    (x,) = batch
    return model(x).pow(2).mean()


def fakes_in(value: Any) -> int:
    """FakeTensors kept anywhere in a module's attributes (lists and dicts opened)."""
    if isinstance(value, FakeTensor):
        return 1
    if isinstance(value, nn.Module):
        return sum(fakes_in(v) for m in value.modules() for v in vars(m).values() if not isinstance(v, nn.Module))
    if isinstance(value, dict):
        return sum(fakes_in(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return sum(fakes_in(v) for v in value)
    return 0


# -- item 3: dry runs of a module with plain tensor attributes ------------------------------------------------------


class SeedWithAttributes(SeedMLP):
    """The article's model with the tensor attributes that broke every dry run; its step appends to a list."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(2, 1024)
        self.pe = torch.zeros(5000, 64)
        self.outputs = [torch.ones(3)]

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.outputs.append(self.pe[:1].sum())  # a new tensor kept in the user's own list, not the loss
        return loss


def test_a_module_with_tensor_attributes_is_predicted_as_the_article_and_its_list_is_untouched() -> None:
    model = SeedWithAttributes()
    kept = model.outputs[0]
    report = predict(model, (torch.Size([8, 1024]),))
    # the article's tenants (test_predict's values): the attributes are the CPU's, never the step's
    assert report.tenants_bytes == {
        "weights": SEED_WEIGHTS,
        "gradients": SEED_WEIGHTS,
        "optimizer_state": 2 * SEED_WEIGHTS + 6 * 4,
        "activations": 8 * SEED_SAVED_PER_SAMPLE + CLOSURE_DIVISOR,
    }
    assert model.outputs == [kept] and model.outputs[0] is kept and model.losses == []
    assert fakes_in(model) == 0 and not model.example_input_array.is_meta


def test_every_dry_run_entry_point_takes_a_module_with_tensor_attributes() -> None:
    model = Tiny()
    kept, pe, example = model.outputs[0], model.pe, model.example_input_array
    prediction = dry_run(model, tiny_batch(4), steps=2)
    assert len(prediction.reports) == 2
    assert largest_batch_size(model, tiny_batch, "4MiB", limit=64) == 64
    forecast, _ = sweep(model, tiny_batch, (2, 4))
    assert forecast.max_batch_size("4MiB") is not None
    advice = advise(model, tiny_batch(4), "4MiB")
    assert advice.fits and advice.fixes
    assert dry_run(model, tiny_batch(4), strategy="fsdp", world_size=2).ranks
    # the dry runs stepped copies: the caller's module, its list and its counter are as they were
    assert model.outputs == [kept] and model.outputs[0] is kept and model.steps == 0
    assert model.pe is pe and model.example_input_array is example and fakes_in(model) == 0


def test_the_copy_copies_containers_shares_other_objects_and_keeps_ties() -> None:
    model = Tiny()
    model.table = np.arange(10)
    model.lookup = {"ids": [torch.arange(4)], "name": "x"}
    model.alias = model.blocks[0][0].weight  # a plain attribute tied to a parameter

    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device="meta")

    copied = copy_module(model, meta)
    assert copied.table is model.table  # shared, not copied
    assert copied.outputs is not model.outputs and copied.lookup["ids"] is not model.lookup["ids"]
    assert copied.lookup["ids"][0].is_meta and copied.outputs[0].is_meta and copied.pe.is_meta
    assert copied.alias is copied.blocks[0][0].weight and isinstance(copied.alias, nn.Parameter)
    assert all(p.is_meta for p in copied.parameters())
    assert not any(p.is_meta for p in model.parameters()) and model.lookup["ids"][0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"model must be an nn.Module, got None"):
        copy_module(None, meta)  # type: ignore[arg-type]


# -- item 2: no non-tensor attribute is copied for real -------------------------------------------------------------


class HoldsLargeObjects(Tiny):
    """A 400 MB numpy lookup table, and a Dataset built in setup() that holds a 200 MB tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.table = np.ones(400_000_000 // 8)
        self.data = TensorDataset(torch.ones(200_000_000 // 4))


@contextmanager
def peak_rss_growth() -> Iterator[dict[str, float]]:
    """The highest RSS reached in the block less the RSS before it, in MiB, sampled every millisecond."""
    process, result = psutil.Process(), {"mib": 0.0, "seconds": 0.0}
    before = process.memory_info().rss
    peak, done = [before], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    try:
        yield result
    finally:
        result["seconds"] = time.perf_counter() - start
        done.set()
        sampler.join()
        peak[0] = max(peak[0], process.memory_info().rss)
        result["mib"] = (peak[0] - before) / MiB


def test_a_copy_shares_a_400_mb_table_and_a_200_mb_data_set() -> None:
    model = HoldsLargeObjects()
    predict(Tiny(), tiny_batch(4))  # torch's first-call caches, outside the measurement
    with peak_rss_growth() as copying:
        copied = meta_copy(model)
    assert copied.table is model.table and copied.data is model.data
    # a copy for real was +383 MiB and 1.4 s of meta_copy (+390 MiB for predict): now no memory, at once
    assert copying["mib"] < 50 and copying["seconds"] < 0.25, copying
    with peak_rss_growth() as predicting:
        predict(model, tiny_batch(4))
    assert predicting["mib"] < 50, predicting


# -- item 6: every global state as it was ---------------------------------------------------------------------------


def saved_hooks() -> list[tuple[Any, Any]]:
    hooks = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
        hooks.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in reversed(hooks):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return hooks


def snapshot() -> dict[str, Any]:
    """Every global state a dry run must leave as it found it, as values that compare with ==."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    dispatch = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
    function = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    return {
        "random": random.getstate(),
        "numpy": (kind, keys.tobytes(), pos, has_gauss, gauss),
        "torch": torch.random.get_rng_state().numpy().tobytes(),
        "cuda": [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else None,
        "dispatch modes": [id(mode) for mode in dispatch],
        "infra modes": [
            torch._C._get_dispatch_mode(key) for key in torch._C._TorchDispatchModeKey.__members__.values()
        ],
        "function modes": [id(mode) for mode in function],
        "saved-tensor hooks": [(id(pack), id(unpack)) for pack, unpack in saved_hooks()],
        "default dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "autocast": [(torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")],
        "autocast cache": torch.is_autocast_cache_enabled(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
    }


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class PassThroughFunctions(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@contextmanager
def a_users_process() -> Iterator[list[int]]:
    """A caller's process in the middle of its own work: seeded generators drawn from, a dispatch mode, a function
    mode and saved-tensor hooks of its own, deterministic algorithms (warn only), grad off, autocast's cache off.

    Yields:
        How many times the caller's pack hook ran (a dry run must never call it).
    """
    random.seed(0)
    random.random()
    np.random.seed(0)
    np.random.rand()
    torch.manual_seed(0)
    torch.rand(1)
    packed = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed[0] += 1
        return tensor

    deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    cache = torch.is_autocast_cache_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_autocast_cache_enabled(False)
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            PassThroughFunctions(),
            PassThrough(),
            torch.no_grad(),
        ):
            yield packed
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.set_autocast_cache_enabled(cache)


ENTRY_POINTS: dict[str, Callable[[nn.Module], Any]] = {
    "predict": lambda model: predict(model, tiny_batch(4)),
    "dry_run": lambda model: dry_run(model, lambda: (torch.randn(4, WIDTH),), steps=2),
    "sweep": lambda model: sweep(model, lambda n: (torch.randn(n, WIDTH),), (2, 4)),
    "sweep's forecast": lambda model: sweep(model, tiny_batch, (2, 4))[0].max_batch_size("1MiB"),
    "largest_batch_size": lambda model: largest_batch_size(model, lambda n: (torch.randn(n, WIDTH),), "1MiB"),
    "advise": lambda model: advise(model, tiny_batch(4), "1MiB"),
    "fsdp on 2 ranks": lambda model: dry_run(model, tiny_batch(4), strategy="fsdp", world_size=2, steps=2),
    "ddp on 2 ranks": lambda model: dry_run(model, tiny_batch(4), strategy="ddp", world_size=2, steps=2),
    "a model built by the call, 2 fsdp ranks": lambda model: predict(
        lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)),  # its init draws, and is put back
        tiny_batch(4),
        loss_fn=loss_of,
        strategy="fsdp",
        world_size=2,
    ),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_each_entry_point_leaves_every_global_state_as_it_found_it(entry: str) -> None:
    model = Tiny()
    with a_users_process() as packed:
        before = snapshot()
        ENTRY_POINTS[entry](model)
        after = snapshot()
    assert after == before
    assert packed == [0]  # the caller's saved-tensor hooks never saw a dry run's tensor


def test_fsdp_draws_from_random_and_a_seeded_shuffle_is_the_same_after_a_dry_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    draws = [0]
    randint = random.randint

    def counted(a: int, b: int) -> int:
        draws[0] += 1
        return randint(a, b)

    monkeypatch.setattr(random, "randint", counted)  # torch's fake collectives draw their work ids so
    random.seed(1234)
    expected = list(range(100))
    random.shuffle(expected)
    random.seed(1234)
    predict(Tiny(), tiny_batch(4), strategy="fsdp", world_size=2, steps=2)
    data = list(range(100))
    random.shuffle(data)
    assert draws[0] > 0  # the collectives drew (the state would have moved), and the state was put back
    assert data == expected


def test_a_step_that_fails_half_way_still_leaves_the_state() -> None:
    class Fails(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            # what a step may change, and leave changed, before it fails
            random.random()
            np.random.rand()
            torch.set_default_dtype(torch.float64)
            torch.set_grad_enabled(True)
            torch.set_autocast_enabled("cpu", True)
            torch.set_autocast_dtype("cpu", torch.float16)
            torch.use_deterministic_algorithms(False)
            PassThroughFunctions().__enter__()
            PassThrough().__enter__()
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t).__enter__()
            raise RuntimeError("the user's step failed")

    model = Fails()
    with a_users_process():
        before = snapshot()
        with pytest.raises(RuntimeError, match="the user's step failed"):
            predict(model, tiny_batch(4), strategy="fsdp", world_size=2)
        assert snapshot() == before


# -- item 9: bad input, one clear error naming the argument ---------------------------------------------------------


def our_frames(error: pytest.ExceptionInfo[BaseException]) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(error.tb) if "lightning_memtenants" in frame.filename]


def test_make_batch_is_a_callable_of_the_batch_size() -> None:
    # a batch where the callable belongs: the search called it, "'tuple' object is not callable"
    with pytest.raises(ValueError, match=r"make_batch must be a callable of the batch size .*a batch itself"):
        largest_batch_size(Tiny(), tiny_batch(4), "1MiB")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"make_batch must be a callable of the batch size .*a batch itself"):
        sweep(Tiny(), tiny_batch(4), (2, 4))  # type: ignore[arg-type]
    # the class tuple is callable, but not of a batch size: tuple(1) fails in the call itself
    with pytest.raises(ValueError, match=r"make_batch\(1\) raised TypeError: 'int' object is not iterable"):
        largest_batch_size(Tiny(), make_batch=tuple, budget_bytes="1MiB")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"make_batch\(2\) raised TypeError: .*positional argument"):
        sweep(Tiny(), lambda: tiny_batch(4), (2,))  # type: ignore[arg-type,misc]
    with pytest.raises(ValueError, match=r"make_batch\(1\) returned None, which holds no tensor"):
        largest_batch_size(Tiny(), lambda n: None, "1MiB")
    with pytest.raises(ValueError, match=r"make_batch\(2\) raised TypeError") as error:
        advise(Tiny(), tiny_batch(4), "1MiB", make_batch=lambda: tiny_batch(2))  # type: ignore[arg-type,misc]
    assert error.value.__cause__ is None and error.value.__suppress_context__

    def wrong_inside(size: int) -> Any:
        return (torch.Size([size, WIDTH]),) + 1  # type: ignore[operator]  # the user's own bug: goes through as is

    with pytest.raises(TypeError, match="can only concatenate tuple"):
        largest_batch_size(Tiny(), wrong_inside, "1MiB")


@pytest.mark.parametrize("budget", [0, 0.5, 1.5, -1, True, "0GiB", "0.5B", [1]])
def test_budget_bytes_follows_the_callbacks_rule_and_message(budget: Any) -> None:
    try:
        callback_bytes = MemoryTenantsCallback(budget_bytes=budget).budget_bytes
    except ValueError as refused:
        message = str(refused)
        with pytest.raises(ValueError) as by_search:
            largest_batch_size(Tiny(), tiny_batch, budget)
        with pytest.raises(ValueError) as by_advice:
            advise(Tiny(), tiny_batch(4), budget)
        assert str(by_search.value) == str(by_advice.value) == message and "budget_bytes" in message
        return
    assert callback_bytes is not None and callback_bytes >= 1
    # accepted as the callback accepts it: so few bytes fit no batch, and the advice says the step does not fit
    assert largest_batch_size(Tiny(), tiny_batch, budget) == 0
    assert advise(Tiny(), tiny_batch(4), budget).budget_bytes == callback_bytes


def test_budget_bytes_none_is_refused_by_the_explicit_calls() -> None:
    for call in (lambda: largest_batch_size(Tiny(), tiny_batch, None), lambda: advise(Tiny(), tiny_batch(4), None)):
        with pytest.raises(ValueError, match=r"budget_bytes must be a positive number of bytes .*got None"):
            call()  # type: ignore[arg-type]


def test_every_fix_apply_names_module() -> None:
    advice = advise(Tiny(), tiny_batch(4), "1MiB")
    applying = [fix for fix in advice.fixes if fix.apply is not None]
    assert {fix.name.split(" (")[0] for fix in applying} >= {"activation checkpointing", "SGD with momentum"}
    for fix in applying:
        for bad in (None, "model", tiny_batch(4)):
            with pytest.raises(ValueError, match=r"module must be the model to fix, an nn.Module") as error:
                fix.apply(bad)  # type: ignore[misc]
            assert our_frames(error) == ["apply", "_check_module"]
    model = Tiny()
    (checkpointing,) = [fix for fix in applying if fix.name.startswith("activation checkpointing")]
    checkpointing.apply(model)  # type: ignore[misc]
    assert model.blocks[0].__dict__.get("forward") is not None
