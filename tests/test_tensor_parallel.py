"""Tensor parallelism with FSDP2 on a 2D mesh, predicted rank by rank in one process, against a real gloo run.

``tests/tp_script.py`` fits a small transformer under ``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=2)`` on 4 CPU processes, its ``configure_model`` applying torchtitan's plan (Colwise,
Rowwise, SequenceParallel) and then ``fully_shard``; the prediction runs each rank over PyTorch's fake process
group and a (2, 2) mesh. The byte counts the tests expect are worked out from the parameters' shapes and the plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from tp_script import FEATURES, HEADS, HIDDEN, SEQUENCE, WIDTH, TPBlocks

from lightning_memtenants import dry_run, predict
from lightning_memtenants.predict.cluster import parallel_of

SCRIPT = Path(__file__).resolve().parent / "tp_script.py"
BATCH = (torch.Size([2, SEQUENCE, FEATURES]),)
D, T = 2, 2
MEMORY = ("allocated_bytes", "window_peak_bytes")
# one sequence shard of the residual stream, (2, SEQUENCE / T, WIDTH) fp32: see the slow test's docstring
# one block's FSDP2 all-gather buffer: its numbers on a tensor-parallel rank (Colwise halves q, k, v and mlp.0;
# Rowwise halves o's and mlp.2's weights, not their biases; the norms whole), padded to D equal shards
BLOCK_BUFFER = 4 * ((3 * (WIDTH * WIDTH + WIDTH) + WIDTH * HIDDEN + HIDDEN) // T + (WIDTH + HIDDEN) * WIDTH // T
                    + 2 * WIDTH + 4 * WIDTH)  # fmt: skip

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def _plan_numbers() -> tuple[int, int]:
    """(numbers a rank holds, parameter tensors) of TPBlocks on the 2 x 2 mesh, from the plan.

    Colwise splits a Linear's weight rows and bias by T, Rowwise its weight columns (the bias whole), the
    norms are whole on every tensor-parallel rank; FSDP2 then halves each (every first dimension is even).
    """
    colwise = 3 * (WIDTH * WIDTH + WIDTH) + (WIDTH * HIDDEN + HIDDEN)  # q, k, v; mlp.0
    rowwise = WIDTH * WIDTH // T + WIDTH + HIDDEN * WIDTH // T + WIDTH  # o; mlp.2
    norms = 2 * 2 * WIDTH
    block = colwise // T + rowwise + norms
    whole = FEATURES * WIDTH // T + WIDTH + 2 * WIDTH + (WIDTH * FEATURES + FEATURES) // T  # inp, norm, out
    return (2 * block + whole) // D, 2 * 16 + 6


def launch(out: Path) -> list[list[dict[str, Any]]]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"tp_rank{rank}.json").read_text()) for rank in range(D * T)]


def _field(report: dict[str, Any], field: str) -> dict[str, Any]:
    return {phase: values[field] for phase, values in report["phases"].items()}


@pytest.mark.slow
def test_tensor_parallel_prediction_equals_every_rank_of_a_real_2x2_run(tmp_path: Path) -> None:
    """Every tenant, part and the fixed cost equal to the byte, every rank, both steps of rank 0.

    The allocated bytes and window peaks are equal too. SequenceParallel's final norm saves an
    ``AsyncCollectiveTensor`` (the reduce-scatter's output, waited lazily); the real run's graph walk counts
    the tensor it wraps, not the wrapper, which holds no memory of its own. gloo's worker thread lets go of a
    finished collective's buffer late at times, as in ``test_cluster.py``: a reading may then be higher by up
    to one block's all-gather buffer, never lower; at least 80 % of the readings are exact.
    """
    measured = launch(tmp_path)
    prediction = dry_run(TPBlocks(), BATCH, strategy="fsdp", world_size=D * T, tensor_parallel=T, steps=2)
    numbers, tensors = _plan_numbers()
    pairs = [(0, ours, theirs) for ours, theirs in zip(prediction.reports, measured[0], strict=True)]
    pairs += [(rank, prediction.ranks[rank], measured[rank][-1]) for rank in range(1, D * T)]
    exact = readings = 0
    for rank, ours, theirs in pairs:
        mine = ours.to_dict()
        for field in ("tenants_bytes", "parts_bytes"):
            assert _field(mine, field) == _field(theirs, field), (rank, theirs["step"], field)
        assert ours.measured_fixed_bytes == theirs["measured_fixed_bytes"]
        end = ours.phases["batch_end"].tenants_bytes
        assert end["weights"] == end["gradients"] == 4 * numbers
        assert end["optimizer_state"] == 8 * numbers + 4 * tensors  # Adam's two moments and a step per tensor
        for field in MEMORY:
            for phase, value in _field(mine, field).items():
                late = _field(theirs, field)[phase] - value
                assert 0 <= late <= BLOCK_BUFFER, (rank, theirs["step"], phase, field, late)
                exact += late == 0
                readings += 1
        assert 0 <= theirs["peak_bytes"] - ours.peak_bytes <= BLOCK_BUFFER
    assert exact >= 0.8 * readings, (exact, readings)


def test_the_prediction_shards_by_the_plan_and_the_mesh() -> None:
    prediction = dry_run(TPBlocks(), BATCH, strategy="fsdp", world_size=D * T, tensor_parallel=T, steps=2)
    numbers, tensors = _plan_numbers()
    for report in prediction.ranks:
        end = report.phases["batch_end"].tenants_bytes
        assert end["weights"] == end["gradients"] == 4 * numbers
        assert end["optimizer_state"] == 8 * numbers + 4 * tensors
    assert all(r is prediction.ranks[0] for r in prediction.ranks)  # every split is even: one dry run for all
    notes = " ".join(prediction.report.notes)
    assert "rank 0 of FSDP2 (fully_shard) and tensor parallelism over 4 ranks (a 2 x 2 mesh" in notes
    assert "sharded by the model's own configure_model() over a 2 x 2 mesh" in notes
    # the same from Lightning's own strategy object
    strategy = ModelParallelStrategy(data_parallel_size=D, tensor_parallel_size=T)
    again = predict(TPBlocks(), BATCH, strategy=strategy, world_size=D * T, steps=2)
    assert again.peak_bytes == prediction.report.peak_bytes


class _Colwise(L.LightningModule):
    """One Linear(8, 10) split by rows over the tensor-parallel ranks, then FSDP2 over the data-parallel ones."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(8, 10)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(self.model, self.device_mesh["tensor_parallel"], ColwiseParallel(output_layouts=Replicate()))
        if self.device_mesh["data_parallel"].size() > 1:
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters())


def test_uneven_tensor_parallel_splits_make_classes_of_ranks() -> None:
    """10 rows over 4 tensor-parallel ranks are 3, 3, 3 and 1 (torch.chunk's split, DTensor's). ``distribute_tensor``
    scatters chunks padded to 3 rows and narrows the last: every rank's weight storage holds 3 rows; the
    gradients and Adam's moments are made like the 1-row shard."""
    prediction = dry_run(_Colwise(), (torch.Size([4, 8]),), strategy="fsdp", world_size=4, tensor_parallel=4, steps=2)
    end = [r.phases["batch_end"].tenants_bytes for r in prediction.ranks]
    three, one = 4 * (3 * 8 + 3), 4 * (1 * 8 + 1)
    assert [e["weights"] for e in end] == [three] * 4
    assert [e["gradients"] for e in end] == [three] * 3 + [one]
    assert [e["optimizer_state"] for e in end] == [2 * three + 8] * 3 + [2 * one + 8]
    assert prediction.ranks[0] is prediction.ranks[1] is prediction.ranks[2] is not prediction.ranks[3]


def test_uneven_data_parallel_splits_of_tensor_parallel_shards_make_classes_of_ranks() -> None:
    """Each tensor-parallel rank holds 5 of Linear(8, 10)'s rows; FSDP2 splits them 3 and 2 (torch.chunk's split),
    padded to 3 in the weights, while Adam's moments follow the unpadded rows: the data-parallel rank decides."""
    two = dry_run(_Colwise(), (torch.Size([4, 8]),), strategy="fsdp", world_size=4, tensor_parallel=2, steps=2)
    state = [r.phases["batch_end"].tenants_bytes["optimizer_state"] for r in two.ranks]
    assert state == [2 * 4 * (3 * 8 + 3) + 8] * 2 + [2 * 4 * (2 * 8 + 2) + 8] * 2
    assert two.ranks[0] is two.ranks[1] and two.ranks[2] is two.ranks[3] and two.ranks[0] is not two.ranks[2]


def test_a_gpu_target_predicts_each_rank() -> None:
    cpu = dry_run(TPBlocks(), BATCH, strategy="fsdp", world_size=D * T, tensor_parallel=T, steps=2)
    gpu = dry_run(TPBlocks(), BATCH, strategy="fsdp", world_size=D * T, tensor_parallel=T, steps=2, target="A100")
    assert len(gpu.ranks) == D * T
    for ours, theirs in zip(gpu.ranks, cpu.ranks, strict=True):
        end, cpu_end = ours.phases["batch_end"].tenants_bytes, theirs.phases["batch_end"].tenants_bytes
        assert end["weights"] == cpu_end["weights"]
        # on a GPU, Adam's step counters are host tensors: in no tenant
        assert end["optimizer_state"] == cpu_end["optimizer_state"] - 4 * _plan_numbers()[1]
        # every block of the caching allocator is at least 512 bytes, and cuBLAS keeps its workspace
        assert ours.peak_bytes > theirs.peak_bytes
    assert any("NCCL" in note for note in gpu.report.notes)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "fsdp", "world_size": 4, "tensor_parallel": 3}, "tensor_parallel=3 must divide world_size=4"),
        ({"strategy": "ddp", "world_size": 4, "tensor_parallel": 2}, "tensor_parallel=2 needs strategy='fsdp'"),
        ({"world_size": 1, "tensor_parallel": 2}, "tensor_parallel=2 needs strategy='fsdp'"),
        ({"strategy": "fsdp", "world_size": 4, "tensor_parallel": 0}, "tensor_parallel must be a positive integer"),
        (
            {"strategy": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), "world_size": 8},
            "data_parallel_size=2 times tensor_parallel_size=2 must equal world_size=8",
        ),
        (
            {"strategy": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), "tensor_parallel": 4},
            "tensor_parallel=4 differs from the strategy's tensor_parallel_size=2",
        ),
    ],
)
def test_bad_tensor_parallel_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        predict(TPBlocks(), BATCH, **{"world_size": 4, **options})


def test_a_model_without_a_plan_is_refused_under_tensor_parallelism() -> None:
    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(8, 8)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters())

    with pytest.raises(ValueError, match=r"tensor_parallel=2: the model applies no tensor-parallel plan"):
        predict(Plain(), (torch.Size([2, 8]),), strategy="fsdp", world_size=4, tensor_parallel=2)
    assert not dist.is_initialized()


def test_lightning_auto_sizes_resolve_as_lightning_does() -> None:
    """On one node, ``ModelParallelStrategy()`` is all tensor parallel: data_parallel_size is the nodes (1)."""
    plan = parallel_of(ModelParallelStrategy(), 4)
    assert plan is not None and (plan.data_parallel, plan.tensor_parallel) == (1, 4)
    plan = parallel_of(ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1), 4)
    assert plan is not None and (plan.data_parallel, plan.tensor_parallel) == (4, 1)


TARGET = f"{SCRIPT}:TPBlocks"


def test_the_command_takes_tensor_parallel(cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    done = cli(
        "predict", TARGET, "--input-shape", f"2,{SEQUENCE},{FEATURES}", "--strategy", "fsdp", "--world-size", "4",
        "--tensor-parallel", "2", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert (document["strategy"], document["world_size"], document["tensor_parallel"]) == ("fsdp", 4, 2)
    expected = dry_run(TPBlocks(), BATCH, strategy="fsdp", world_size=4, tensor_parallel=2)
    assert [r["peak_bytes"] for r in document["ranks"]] == [r.peak_bytes for r in expected.ranks]
    done = cli("predict", TARGET, "--input-shape", "2,8,12", "--strategy", "fsdp", "--world-size", "4",
               "--tensor-parallel", "3")  # fmt: skip
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("--tensor-parallel 3 needs --strategy fsdp and a --world-size it divides")
    )


assert HEADS % T == 0  # the plan splits q, k and v by heads
