"""Inductor's own buffer plan in a CPU prediction (_private_inductor.py): the peak inside compiled code, to the byte.

The real fit is a compiled CPU fit measured by the callback, whose tracker counts inductor's ``empty_strided_cpu``
buffers (checked against PyTorch's profiler in ``tests/test_compiled_source.py``). At ``activation_memory_budget``
0.5 the partitioner recomputes part of the forward in the backward, and the buffers of that recomputation decide the
peak: a rule for which values inductor fuses misses them, inductor's own wrapper does not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compiled_models import GatedLM, gated_blocks, square_loss
from conftest import CollectedEachStep, make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback, predict

pytestmark = pytest.mark.slow

BATCH = torch.Size([256, 256])


def process_state() -> dict[str, Any]:
    """What a compile leaves in the process that the user's later compiles or tools read."""
    from torch._dynamo import utils
    from torch._functorch import config as functorch_config
    from torch._inductor import config, metrics
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.graph import GraphLowering

    return {
        "counters": {name: dict(counter) for name, counter in utils.counters.items() if counter},
        "times": {name: len(values) for name, values in utils.compilation_time_metrics.items()},
        "kernels": metrics.generated_kernel_count,
        "modules": len(PyCodeCache.modules),
        "config": (config.fx_graph_cache, config.cpp_wrapper, config.autotune_local_cache),
        "functorch": (functorch_config.force_non_lazy_backward_lowering, functorch_config.enable_autograd_cache),
        "loader": GraphLowering._compile_to_module_lines,
    }


@pytest.fixture(scope="module")
def half() -> dict[str, Any]:
    """A compiled fit and its prediction at activation_memory_budget 0.5, and the process before and after.

    Every wrapper inductor writes to its code cache goes through ``PyCodeCache.write``: the prediction's are counted.
    """
    from torch._inductor.codecache import PyCodeCache

    result: dict[str, Any] = {"written": []}
    write = PyCodeCache.write
    with (
        pytest.MonkeyPatch.context() as patch,
        torch._functorch.config.patch(activation_memory_budget=0.5),
    ):
        torch._dynamo.reset()
        callback = MemoryTenantsCallback(print_summary=False)
        data = DataLoader(TensorDataset(torch.randn(4 * BATCH[0], BATCH[1])), batch_size=BATCH[0])
        make_trainer([CollectedEachStep(), callback], steps=2).fit(GatedLM(compiled=True), data)
        result["fit"] = callback.latest
        result["before"] = process_state()
        patch.setattr(PyCodeCache, "write", lambda *a, **k: result["written"].append(a) or write(*a, **k))
        result["prediction"] = predict(GatedLM(compiled=True), (BATCH,), steps=2)
        result["after"] = process_state()
    torch._dynamo.reset()
    return result


def test_the_peak_inside_compiled_code_is_inductors_own_plan(half: dict[str, Any]) -> None:
    fit, prediction = half["fit"], half["prediction"]
    assert fit.memory_source.startswith("live-tensor tracker")
    assert prediction.tenants_bytes == fit.tenants_bytes
    assert prediction.peak_bytes == fit.peak_bytes == 45_224_032  # measured on torch 2.13 CPU
    note = next(n for n in prediction.notes if "predicted as compiled" in n)
    assert "activation_memory_budget=0.5" in note
    assert "as inductor's own generated wrapper does" in note


def test_planning_leaves_the_users_process_as_it_was(half: dict[str, Any]) -> None:
    before, after = half["before"], half["after"]
    assert after == before  # no counter, metric, cached module or setting changed
    assert half["written"] == []  # no wrapper written to inductor's code cache
    assert before["modules"] > 0  # the fit's own compile is cached; the plan added none


def test_options_that_time_kernels_are_set_aside_with_a_note() -> None:
    torch._dynamo.reset()
    plain = predict(torch.compile(gated_blocks(1)), BATCH, loss_fn=square_loss)
    tuned = predict(torch.compile(gated_blocks(1), mode="max-autotune-no-cudagraphs"), BATCH, loss_fn=square_loss)
    assert tuned.tenants_bytes == plain.tenants_bytes
    assert tuned.peak_bytes == plain.peak_bytes
    note = next(n for n in tuned.notes if "predicted as compiled" in n)
    assert "set aside in the plan: coordinate_descent_tuning, max_autotune (kernels chosen by timing them" in note
    assert not any("set aside" in n for n in plain.notes)
