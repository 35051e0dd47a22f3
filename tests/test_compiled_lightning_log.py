"""A LightningModule with a ``torch.compile``'d part whose ``training_step`` calls ``self.log``: predicted, not crashed.

The AOT trace of the compiled part lifts constants into the dry run's fake mode (the Philox state's
``torch.tensor(())``), which its converter keys by ``StorageWeakRef``. Lightning's ``self.log`` deep-copies a known
tensor (``add_state``'s default), and with it its fake twin; torch's deep copy of a fake tensor copied the whole mode,
those keys included without their weak references, so the copies freed the storages a second time and the process
crashed (a segfault or "corrupted double-linked list") at ``predict(steps=2)``. The prediction runs in a subprocess,
so a crash fails the test instead of killing pytest, and must give the activations a real compiled fit measures.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_memtenants.predict.kernels import KernelFakeMode

TESTS = Path(__file__).resolve().parent

CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from compiled_models import WIDTH, gated_blocks
    from lightning_memtenants import MemoryTenantsCallback, predict

    class Logged(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.compile(gated_blocks(1), backend={backend!r})

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters())

    callback = MemoryTenantsCallback(print_summary=False)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(4 * 8, WIDTH, generator=torch.Generator().manual_seed(1))), 8)
    trainer.fit(Logged(), data)
    predicted = [predict(Logged(), (torch.Size([8, WIDTH]),), steps=2).tenants_bytes for _ in range(3)]
    print(json.dumps({{
        "fit": callback.latest.tenants_bytes["activations"],
        "logged": "loss" in trainer.callback_metrics,
        "predicted": [p["activations"] for p in predicted],
    }}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # AOT autograd's trace; inductor's own compile_fx
def test_a_compiled_part_and_self_log_are_predicted_as_a_real_compiled_fit_measures(backend: str) -> None:
    child = CHILD.format(tests=str(TESTS), backend=backend)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["logged"]
    assert result["predicted"] == [result["fit"]] * 3


def test_a_deep_copy_of_a_fake_tensor_stays_in_the_dry_runs_mode() -> None:
    mode = KernelFakeMode(allow_non_fake_inputs=True)
    with mode:  # no constant lifted: a regression copies the mode without crashing pytest (the subprocess's case)
        tensor = torch.empty(3)
    copied = copy.deepcopy(tensor)
    assert copied.fake_mode is mode
    assert copied.shape == (3,) and copied is not tensor
