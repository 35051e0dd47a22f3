"""Run in a fresh process: torch.compile'd training under the callback, against the same run without it.

``tests/test_real_programs.py`` runs ``python compile_check.py``; it prints one JSON line per fit. Each fit
resets Dynamo first and counts the graphs compiled with a backend of its own: ``eager`` runs each graph as
FX code (``gm.forward``), ``inductor`` hands it to inductor, as ``torch.compile``'s default does. After the
inductor fits it also reports how many FakeTensors inductor left alive, and trains an uncompiled model with
a budget under ``strict=True``: those fakes must not count as memory.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import make_trainer

from lightning_memtenants import MemoryTenantsCallback

GRAPHS: list[Any] = []
BACKEND = {"name": "eager"}


def counting(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
    GRAPHS.append(gm)
    if BACKEND["name"] == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)
    return gm.forward


class Net(L.LightningModule):
    """Linear(6, 16), Tanh, Linear(16, 1): compiled as a module, or as a function the step calls."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net: nn.Module = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        if where == "module":
            self.net = torch.compile(self.net, backend=counting)
        self.loss = torch.compile(self._loss, backend=counting) if where == "function" else self._loss
        self.losses: list[torch.Tensor] = []

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch[0])
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 6, generator=torch.Generator().manual_seed(0))), batch_size=2)


def fit(backend: str, where: str, arm: str, validate: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    GRAPHS.clear()
    BACKEND["name"] = backend
    callbacks: list[L.Callback] = []
    if arm != "none":
        callbacks.append(MemoryTenantsCallback(print_summary=False, track_every_step=arm == "every_step"))
    options: dict[str, Any] = {"limit_val_batches": 1, "num_sanity_val_steps": 1, "val_check_interval": 2}
    model = Net(where)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(callbacks, steps=4, **(options if validate else {}))
        trainer.fit(model, loader(), loader() if validate else None)
    result: dict[str, Any] = {
        "backend": backend,
        "where": where,
        "arm": arm,
        "validate": validate,
        "graphs": len(GRAPHS),
        "losses": [loss.numpy().tobytes().hex() for loss in model.losses],
        "ours": [str(w.message) for w in caught if str(w.message).startswith("memtenants")],
    }
    if callbacks:
        report = callbacks[0].latest  # type: ignore[attr-defined]
        result.update(
            peak=report.peak_bytes,
            explanation=report.peak_explanation,
            tenants=report.tenants_bytes,
            source=report.memory_source,
        )
    return result


def phantom() -> dict[str, Any]:
    """After inductor: the fakes it left, and an uncompiled fit with a budget that only real memory can break."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    fakes = [o for o in gc.get_objects() if type(o) is FakeTensor]
    fake_bytes = sum(f.untyped_storage().nbytes() for f in fakes)
    del fakes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters())

    cb = MemoryTenantsCallback(budget_bytes="64MiB", strict=True, print_summary=False)
    error = None
    try:
        make_trainer([cb], steps=2).fit(Plain(), loader())
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    report = cb.latest_measured
    return {
        "fake_bytes": fake_bytes,
        "error": error,
        "other": None if report is None else report.other_bytes,
        "max_batch_size": cb.max_batch_size(),
    }


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    runs = [
        (backend, where, arm, validate)
        for backend in ("eager", "inductor")
        for where in ("module", "function")
        for validate in (False, True)
        for arm in ("none", "default", "every_step")
        if backend == "eager" or where == "function" or (not validate and arm != "every_step")
    ]
    for run in runs:
        print(json.dumps(fit(*run)), flush=True)
    print(json.dumps({"phantom": phantom()}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
