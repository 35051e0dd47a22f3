"""Measuring never changes the user's program: torch.compile, their own saved-tensor hooks, patches and tools
beside ours, a Hugging Face model, and exceptions of any shape. Each run is set against the same run without us."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import CLOSURE_DIVISOR, make_trainer, no_collection, nothing_registered
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback

HERE = Path(__file__).resolve().parent
P = 6 * 16 + 16 + 16 * 1 + 1  # Linear(6, 16), Tanh, Linear(16, 1): 129 parameters in 4 tensors
FIXED = {"weights": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P + 4 * 4}


class Net(L.LightningModule):
    """Linear(6, 16), Tanh, Linear(16, 1), loss ``out.pow(2).mean()``, batches of 2."""

    def __init__(self, hooks: Any = None, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.hooks = hooks  # entered around the forward inside training_step, where given
        self.automatic_optimization = not manual
        self.losses: list[bytes] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.hooks is None:
            loss = self.net(batch[0]).pow(2).mean()
        else:
            with self.hooks():
                loss = self.net(batch[0]).pow(2).mean()
                if not self.automatic_optimization:  # backward inside the user's hook, as offloading code does
                    self.manual_backward(loss)
        self.losses.append(loss.detach().numpy().tobytes())
        if self.automatic_optimization:
            return loss
        if self.hooks is None:
            self.manual_backward(loss)
        optimizer = self.optimizers()
        optimizer.step()
        optimizer.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 6, generator=torch.Generator().manual_seed(0))), batch_size=2)


# ---------------------------------------------------------------------------------------------- torch.compile


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str, bool], dict[str, Any]]:
    # a cold inductor cache, as on a user's first run: that is when inductor leaves its FakeTensors alive
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}
    done = subprocess.run(
        [sys.executable, str(HERE / "compile_check.py")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    out = {(r["backend"], r["where"], r["arm"], r["validate"]): r for r in runs if "phantom" not in r}
    out[("phantom", "", "", False)] = next(r["phantom"] for r in runs if "phantom" in r)
    return out


@pytest.mark.slow
def test_compile_compiles_the_same_graphs_and_losses_stay_bitwise_identical(compiled_runs: dict) -> None:
    arms = [key for key in compiled_runs if key[0] != "phantom" and key[2] != "none"]
    assert len(arms) == 13
    for backend, where, arm, validate in arms:
        run, plain = compiled_runs[(backend, where, arm, validate)], compiled_runs[(backend, where, "none", validate)]
        # one graph for training; with sanity validation a second, for eval mode, before training recompiles
        assert run["graphs"] == plain["graphs"] == (2 if validate else 1), (backend, where, arm, validate)
        assert run["losses"] == plain["losses"] and len(run["losses"]) == 4
        assert run["tenants"] == {**FIXED, "activations": (2 * 16 + 2 * 1) * 4 + CLOSURE_DIVISOR}


@pytest.mark.slow
def test_compiled_code_on_the_cpu_is_measured(compiled_runs: dict) -> None:
    for (backend, _, arm, _), run in compiled_runs.items():
        if backend == "phantom" or arm == "none":
            continue
        # FX code goes through the dispatcher; inductor's buffers through the allocator the tracker wraps
        assert run["peak"] is not None and run["ours"] == []
        assert run["source"] == "live-tensor tracker (cpu)"


@pytest.mark.slow
def test_fake_tensors_inductor_leaves_behind_are_not_memory(compiled_runs: dict) -> None:
    phantom = compiled_runs[("phantom", "", "", False)]
    assert phantom["fake_bytes"] > 64 * 2**20  # what inductor left alive in that process (about 300 MB)
    # a 64 MiB budget under strict=True: only the fakes could break it
    assert phantom["error"] is None
    assert phantom["other"] is not None and phantom["other"] < 2**20
    assert phantom["max_batch_size"] > 0


def test_fake_tensors_alive_in_the_process_are_not_memory_under_a_strict_budget() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fit_under_a_strict_budget() -> MemoryTenantsCallback:
        gc.collect()  # free what earlier fits left in cycles first
        cb = MemoryTenantsCallback(budget_bytes="32MiB", strict=True, print_summary=False)
        with warnings.catch_warnings(record=True) as caught, no_collection():
            warnings.simplefilter("always")
            make_trainer([cb], steps=2).fit(Net(), loader())
        assert not [w for w in caught if "memtenants" in str(w.message)]
        return cb

    without = fit_under_a_strict_budget()
    with FakeTensorMode():
        leftovers = [torch.empty(2**26) for _ in range(2)]  # 512 MiB that does not exist, as inductor leaves it
    cb = fit_under_a_strict_budget()
    # the fakes add nothing: "other" at every phase, and the largest batch that fits, are as without them
    assert [p.other_bytes for p in cb.latest.phases.values()] == [p.other_bytes for p in without.latest.phases.values()]
    assert cb.max_batch_size() == without.max_batch_size()
    del leftovers


# ----------------------------------------------------------------------------------- the user's saved-tensor hooks


class Counted:
    """A user's ``saved_tensors_hooks`` pair that counts its calls: ``save_on_cpu``, or a bf16 compressor."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.packs = self.unpacks = 0

    def __call__(self) -> torch.autograd.graph.saved_tensors_hooks:
        if self.kind == "save_on_cpu":
            inner = torch.autograd.graph.save_on_cpu()
            pack, unpack = inner.pack_hook, inner.unpack_hook
        else:
            pack = lambda t: (t.dtype, t.to(torch.bfloat16))  # noqa: E731
            unpack = lambda packed: packed[1].to(packed[0])  # noqa: E731

        def counted_pack(tensor: torch.Tensor) -> Any:
            self.packs += 1
            return pack(tensor)

        def counted_unpack(packed: Any) -> torch.Tensor:
            self.unpacks += 1
            return unpack(packed)

        return torch.autograd.graph.saved_tensors_hooks(counted_pack, counted_unpack)


class AroundTheForward(L.Callback):
    """A user's callback, listed before ours, that enters its hooks at batch start and leaves them before backward."""

    def __init__(self, hooks: Counted) -> None:
        self.hooks = hooks

    def on_train_batch_start(self, *args: Any) -> None:
        self.context = self.hooks()
        self.context.__enter__()

    def on_before_backward(self, *args: Any) -> None:
        self.context.__exit__(None, None, None)


def train_with_hooks(kind: str, placement: str, ours: bool, manual: bool = False) -> tuple[Counted, Net, Any]:
    hooks = Counted(kind)
    module = Net(hooks if placement == "inside training_step" else None, manual=manual)
    callbacks: list[L.Callback] = [AroundTheForward(hooks)] if placement == "a callback before ours" else []
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    if ours:
        callbacks.append(cb)
    trainer = make_trainer(callbacks, steps=4)
    if placement == "around fit":
        with hooks():
            trainer.fit(module, loader())
    else:
        trainer.fit(module, loader())
    return hooks, module, cb


# What the hooks keep of one step's 5 saved tensors (x, the Tanh output twice, the second weight, the output
# for pow): save_on_cpu on a CPU tensor keeps the tensor itself, so the activations are as without a hook (the
# Tanh output and pow's input); the compressor keeps a bf16 copy of each, the batch's and the weight's included.
# Lightning's divisor of the loss is a wrapped number, which autograd saves without calling any hook.
KEPT = {
    "save_on_cpu": (2 * 16 + 2 * 1) * 4 + CLOSURE_DIVISOR,
    "bf16": (2 * 6 + 2 * 2 * 16 + 16 * 1 + 2 * 1) * 2 + CLOSURE_DIVISOR,
}


@pytest.mark.parametrize("kind", ["save_on_cpu", "bf16"])
@pytest.mark.parametrize("placement", ["around fit", "inside training_step", "a callback before ours"])
def test_the_user_s_saved_tensor_hooks_run_as_without_us_and_what_they_keep_is_counted(kind, placement) -> None:
    plain, plain_module, _ = train_with_hooks(kind, placement, ours=False)
    hooks, module, cb = train_with_hooks(kind, placement, ours=True)
    assert plain.packs == 20 and plain.unpacks == 20  # 5 saved tensors in each of 4 steps
    assert (hooks.packs, hooks.unpacks) == (plain.packs, plain.unpacks)
    assert module.losses == plain_module.losses
    assert cb.latest.tenants_bytes == {**FIXED, "activations": KEPT[kind]}
    assert any(
        note.startswith("saved-tensor hooks: your saved_tensors_hooks packed 5 saved tensor(s)")
        for note in cb.latest.notes
    )
    assert nothing_registered()


def test_backward_inside_the_user_s_hooks_under_manual_optimization() -> None:
    plain, plain_module, _ = train_with_hooks("bf16", "inside training_step", ours=False, manual=True)
    hooks, module, cb = train_with_hooks("bf16", "inside training_step", ours=True, manual=True)
    assert (hooks.packs, hooks.unpacks) == (plain.packs, plain.unpacks) == (20, 20)
    assert module.losses == plain_module.losses
    # manual optimization: no closure, so no divisor
    assert cb.latest.tenants_bytes["activations"] == KEPT["bf16"] - CLOSURE_DIVISOR
    assert nothing_registered()


def test_an_opaque_pack_is_said_not_counted() -> None:
    store: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> int:  # keeps the tensor in a store of its own and hands autograd a key
        store[len(store)] = tensor
        return len(store) - 1

    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    module = Net(lambda: torch.autograd.graph.saved_tensors_hooks(pack, store.pop))
    make_trainer([cb], steps=2).fit(module, loader())
    assert cb.latest.tenants_bytes["activations"] == CLOSURE_DIVISOR
    [note] = [n for n in cb.latest.notes if n.startswith("saved-tensor hooks")]
    assert note.endswith(
        "5 were packed into objects that hold no tensor, whose bytes cannot be counted and are not in the tenant"
    )


# ------------------------------------------------------------------------------------ patches and tools beside ours


class Resizing(Net):
    """Frees and re-grows a scratch buffer with ``storage.resize_``, as FSDP2 does its gathered parameters."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        scratch = torch.ones(1024)
        scratch.untyped_storage().resize_(0)
        scratch.untyped_storage().resize_(4096 * 4)
        return super().training_step(batch, batch_idx)


def test_a_user_s_resize_patch_is_called_and_put_back_exactly() -> None:
    original = torch.UntypedStorage.resize_
    sizes: list[int] = []

    def users_resize(storage: torch.UntypedStorage, size: int) -> Any:
        sizes.append(size)
        return original(storage, size)

    torch.UntypedStorage.resize_ = users_resize  # type: ignore[method-assign]
    try:
        make_trainer([], steps=2).fit(Resizing(), loader())
        plain = list(sizes)
        sizes.clear()
        cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
        with no_collection():
            make_trainer([cb], steps=2).fit(Resizing(), loader())
        assert sizes == plain == [0, 16384] * 2
        assert torch.UntypedStorage.__dict__["resize_"] is users_resize
        # the tracker followed the re-grown 16 KiB buffer through the user's patch: the forward window holds it
        # (its first 4 KiB were freed by resize_(0)), and the forward's peak beside it: the first Linear's output
        # and the Tanh's output, 2 x 16 fp32 numbers each
        forward = cb.latest.phases["before_backward"]
        assert forward.window_peak_bytes - cb.latest.phases["batch_start"].allocated_bytes == 16384 + 2 * 2 * 16 * 4
    finally:
        del torch.UntypedStorage.resize_
    assert "resize_" not in torch.UntypedStorage.__dict__


@pytest.mark.slow
def test_memtracker_and_our_tracker_in_one_fit_agree_and_leave_nothing() -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / "memtracker_oracle.py"), "256", "together"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # MemTracker counts the dataset (3 MiB) the loader indexes; ours, the training's tensors (docs/sources.md)
    assert 0 <= result["memtracker"] - result["ours"] - result["dataset"] <= 8
    assert result["losses_equal"] and result["nothing_left"] and result["resize_restored"]


def test_device_stats_monitor_beside_ours() -> None:
    from conftest import RecordingLogger
    from lightning.pytorch.callbacks import DeviceStatsMonitor

    logger = RecordingLogger()
    cb = MemoryTenantsCallback(print_summary=False)
    module = Net()
    make_trainer([DeviceStatsMonitor(cpu_stats=True), cb], steps=3, logger=logger).fit(module, loader())
    plain = Net()
    make_trainer([DeviceStatsMonitor(cpu_stats=True)], steps=3, logger=RecordingLogger()).fit(plain, loader())
    assert module.losses == plain.losses
    tags = set().union(*(metrics for _, metrics in logger.logged))
    assert "memtenants/weights_MiB" in tags and any("cpu_percent" in tag for tag in tags)
    assert cb.latest.tenants_bytes == {**FIXED, "activations": (2 * 16 + 2 * 1) * 4 + CLOSURE_DIVISOR}


# --------------------------------------------------------------------------------------------- Hugging Face GPT-2


class HFGPT2(L.LightningModule):
    """transformers' GPT2LMHeadModel, 2 layers of width 32, trained on random tokens."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, eos_token_id=0)
        config.bos_token_id = 0
        self.model = GPT2LMHeadModel(config)
        self.losses: list[bytes] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(loss.detach().numpy().tobytes())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def saved_by_hooks(module: HFGPT2, tokens: torch.Tensor) -> int:
    """The bytes the forward saves, counted the other way: a pass-through pack hook over unique storages."""
    excluded = {id(t.untyped_storage()) for t in (*module.parameters(), *module.buffers(), tokens)}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in excluded:
            kept[id(storage)] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module.model(input_ids=tokens, labels=tokens).loss
    total = sum(kept.values())
    del loss
    return total


def test_hugging_face_gpt2_trains_the_same_and_its_activations_are_exact() -> None:
    pytest.importorskip("transformers")
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens), batch_size=4)
    expected = saved_by_hooks(HFGPT2(), tokens[:4])
    plain = HFGPT2()
    torch.manual_seed(1)  # the same dropout masks in both fits
    make_trainer([], steps=3).fit(plain, data)
    module = HFGPT2()
    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True)
    torch.manual_seed(1)
    make_trainer([cb], steps=3).fit(module, data)
    assert module.losses == plain.losses
    params = [p for p in module.parameters()]
    weights = sum({id(p.untyped_storage()): p.untyped_storage().nbytes() for p in params}.values())
    unique = {id(p.untyped_storage()): p for p in params}  # the tied lm_head is wte
    assert cb.latest.tenants_bytes["weights"] == weights
    assert cb.latest.tenants_bytes["optimizer_state"] == 2 * weights + 4 * len(unique)
    # Hooks never see wrapped numbers: new-GELU multiplies by three Python floats a layer, and autograd keeps each
    # as a float64 0-d tensor, as it keeps Lightning's divisor of the loss
    assert cb.latest.tenants_bytes["activations"] == expected + 2 * 3 * 8 + CLOSURE_DIVISOR
    assert cb.latest.fixed_deviation_bytes == 0
    assert nothing_registered()


# --------------------------------------------------------------------------------------- exceptions of any shape


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("cannot print myself")


@pytest.mark.parametrize(
    "error",
    [RuntimeError(42), RuntimeError(), RuntimeError(b"CUDA out of memory"), RuntimeError(None), Unprintable("x")],
    ids=["int", "no-args", "bytes", "None", "raising-str"],
)
def test_any_exception_reaches_the_caller_as_itself_and_nothing_stays(error: BaseException, tmp_path: Path) -> None:
    class Failing(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 1:
                raise error
            return super().training_step(batch, batch_idx)

    cb = MemoryTenantsCallback(print_summary=False, track_every_step=True, postmortem_dir=tmp_path)
    module = Failing()
    alive = weakref.ref(module)
    with pytest.raises(type(error)) as caught:
        make_trainer([cb], steps=4).fit(module, loader())
    assert caught.value is error
    assert nothing_registered()
    assert "log" not in cb.__dict__ and "log_dict" not in cb.__dict__
    error.__traceback__ = None  # the traceback's frames hold the trainer and the model, not the callback
    del module, caught
    gc.collect()
    assert alive() is None  # the callback keeps no reference to the model after a failed fit
    assert list(tmp_path.iterdir()) == []  # none of them is an out-of-memory error
