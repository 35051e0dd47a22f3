"""Two processes on CPU (gloo): per-rank tenants, cross-rank max and min, DDP's buckets, ZeroRedundancyOptimizer's
sharded state, FSDP2's shards, and no hang when a rank fails. Each run is ``tests/ddp_script.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from conftest import CLOSURE_DIVISOR
from torch import nn

from lightning_memtenants.analysis.formulas import StateSpec, fsdp_fixed_cost_bytes, zero_state_bytes

SCRIPT = Path(__file__).resolve().parent / "ddp_script.py"
P = 32 * 64 + 64 + 64 * 16 + 16  # 3,152 parameters in 4 tensors
MiB = 2**20

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.slow,  # every test launches two processes
]


def launch(mode: str, out: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """Run the script; a hang fails the test by the timeout instead of blocking the suite."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), mode, str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    done = launch("ddp", out)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_each_rank_measures_its_own_tenants(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        ddp = result["ddp"]
        assert ddp["end"]["weights"] == ddp["end"]["gradients"] == 4 * P
        assert ddp["end"]["optimizer_state"] == 8 * P + 4 * 4
        assert ddp["expected_fixed"] == ddp["measured_fixed"] == 16 * P + 16
        assert ddp["fixed_notes"] == []
        # rank r trains on 2 + 2r samples: Tanh keeps 64 numbers a sample, pow keeps the 16 outputs, and
        # Lightning's closure keeps its 8-byte divisor of the loss
        assert ddp["tenants"]["activations"] == (2 + 2 * rank) * (64 + 16) * 4 + CLOSURE_DIVISOR


def test_ddp_buckets_are_their_own_part(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["ddp"]["parts"] == {"ddp_buckets": 4 * P}
        assert "gradient_as_bucket_view=False" in result["ddp"]["notes"][0]
        # with gradient_as_bucket_view=True the gradients are views into the buckets: nothing more to count
        assert result["zero"]["parts"] == {}
        assert result["zero"]["end"]["gradients"] == 4 * P
        assert "gradient_as_bucket_view=True" in result["zero"]["notes"][0]


def test_zero_redundancy_optimizer_state_is_sharded_and_exact(ranks: list[dict[str, Any]]) -> None:
    states = [result["zero"]["end"]["optimizer_state"] for result in ranks]
    for result in ranks:
        assert result["zero"]["expected_fixed"] == result["zero"]["measured_fixed"]
        assert result["zero"]["fixed_notes"] == []
    # ZeRO shards whole tensors by size: rank 0 holds the 64 x 32 weight, rank 1 the other three tensors;
    # together one full copy of Adam's state (8P + a step per tensor), about 8P/N each
    assert states == [8 * 2048 + 4, 8 * (64 + 1024 + 16) + 3 * 4]
    params = list(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16)).parameters())
    assert states == zero_state_bytes([params], 2, StateSpec(("exp_avg", "exp_avg_sq"), ("step",)))


def test_rank_zero_logs_every_rank_and_the_cross_rank_max_and_min(ranks: list[dict[str, Any]]) -> None:
    logged = ranks[0]["ddp"]["logged"]
    assert [step for step, _ in logged] == [0, 1, 3]  # log_every_n_steps=2, 4 steps: (b + 1) % 2 == 0, and the first
    metrics = logged[-1][1]
    activations = [2 * 80 * 4 + CLOSURE_DIVISOR, 4 * 80 * 4 + CLOSURE_DIVISOR]
    for rank in (0, 1):
        assert metrics[f"memtenants/rank_{rank}/activations_MiB"] * MiB == pytest.approx(activations[rank])
        assert metrics[f"memtenants/rank_{rank}/optimizer_state_MiB"] * MiB == pytest.approx(8 * P + 16)
        assert f"memtenants/rank_{rank}/peak_MiB" in metrics
    assert metrics["memtenants/ranks_max/activations_MiB"] * MiB == pytest.approx(max(activations))
    assert metrics["memtenants/ranks_min/activations_MiB"] * MiB == pytest.approx(min(activations))
    # DDP replicates the weights: the same on both ranks
    weights = [metrics[f"memtenants/ranks_{kind}/weights_MiB"] * MiB for kind in ("max", "min")]
    assert weights == [4 * P, 4 * P]


def test_a_failing_measurement_on_one_rank_does_not_hang_the_others(tmp_path: Path) -> None:
    done = launch("fault", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text())["ddp"] for r in (0, 1))
    assert rank1["latest"] is None  # its census was disabled after the first failure
    assert rank0["end"]["optimizer_state"] == 8 * P + 16
    metrics = rank0["logged"][-1][1]
    assert "memtenants/rank_0/weights_MiB" in metrics and "memtenants/rank_1/weights_MiB" not in metrics
    assert metrics["memtenants/ranks_max/weights_MiB"] * MiB == 4 * P


def test_a_crashing_rank_ends_the_run_instead_of_hanging(tmp_path: Path) -> None:
    done = launch("crash", tmp_path, timeout=120)
    assert done.returncode != 0
    assert "rank 1 fails on purpose" in done.stderr
    assert not (tmp_path / "rank0.json").exists()


def test_fsdp2_on_cpu_holds_16p_over_n_per_rank(tmp_path: Path) -> None:
    """Lightning's FSDPStrategy refuses the CPU; its ModelParallelStrategy runs FSDP2 (``fully_shard``) with gloo."""
    done = launch("fsdp", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())["ddp"]
        end = result["end"]
        # every tensor here splits evenly over 2 ranks, so each rank holds exactly half: 4P/2, 4P/2, 8P/2 + 4 steps
        assert (end["weights"], end["gradients"], end["optimizer_state"]) == (2 * P, 2 * P, 4 * P + 16)
        assert result["expected_fixed"] == result["measured_fixed"] == fsdp_fixed_cost_bytes(P, 2) + 16
        assert result["fixed_notes"] == []
        assert result["notes"][0].startswith("FSDP: weights, gradients and optimizer state are this rank's shards")
        # the gathered parameters are freed again after forward: only the activations remain at its end
        assert result["tenants"]["activations"] == (2 + 2 * rank) * (64 + 16) * 4 + CLOSURE_DIVISOR
        # FSDP2 frees and re-grows gathered parameters by resizing storages; the tracker follows, so at
        # batch start "other" is only the batch (8 x 32 fp32): the tracker counts the training's tensors
        phases = result["measured"]["phases"]
        assert phases["batch_start"][2] == 8 * 32 * 4
        # the forward window peaks while the first Linear (32 x 64 + 64 = 2,112 fp32 numbers) is gathered:
        # FSDP2's all-gather buffer and the unsharded parameters copied out of it, plus its output
        unit = (32 * 64 + 64) * 4
        assert phases["before_backward"][1] - phases["batch_start"][0] == 2 * unit + (2 + 2 * rank) * 64 * 4
        assert "mostly FSDP's gathered parameters: the largest unit is" in result["measured"]["explanation"]
        assert f"the largest unit is {unit:,} bytes unsharded" in result["notes"][0]


def test_one_rank_out_of_memory_ends_the_run_as_fast_as_without_us(tmp_path: Path) -> None:
    """Rank 1 runs out of memory in its forward while rank 0 waits in backward's allreduce. The postmortem
    must not call a collective (``trainer.log_dir`` is a broadcast): the run ends, it does not hang."""
    import time

    times = {}
    for mode in ("oom-plain", "oom-one"):
        out = tmp_path / mode
        out.mkdir()
        began = time.perf_counter()
        done = launch(mode, out, timeout=120)
        times[mode] = time.perf_counter() - began
        assert done.returncode != 0 and "CUDA out of memory on rank 1 (injected)" in done.stderr
    assert times["oom-one"] < times["oom-plain"] + 30, times
    assert sorted(p.name for p in (tmp_path / "oom-one").iterdir()) == [
        "memtenants_oom_rank1.json",
        "memtenants_oom_rank1.txt",
    ]
    record = json.loads((tmp_path / "oom-one" / "memtenants_oom_rank1.json").read_text())
    assert record["rank"] == 1 and record["step"] == 2 and record["phase"] == "forward"
    # rank 1's forward of 4 samples had saved its Tanh output (64 a sample) and its output (16) when it failed
    assert record["tenants_at_failure_bytes"]["activations"] == 4 * (64 + 16) * 4


def test_each_failing_rank_writes_its_own_postmortem(tmp_path: Path) -> None:
    done = launch("oom-both", tmp_path, timeout=120)
    assert done.returncode != 0
    for rank in (0, 1):
        record = json.loads((tmp_path / f"memtenants_oom_rank{rank}.json").read_text())
        assert record["rank"] == rank
        assert record["error"] == f"OutOfMemoryError: CUDA out of memory on rank {rank} (injected)"
        assert (
            (tmp_path / f"memtenants_oom_rank{rank}.txt")
            .read_text()
            .startswith(f"memtenants OOM postmortem: step 2, rank {rank}, OutOfMemoryError")
        )


@pytest.mark.parametrize("mode", ["oom-val-one", "validate-oom"])
def test_a_rank_out_of_memory_in_validation_names_the_loop_and_its_rank(tmp_path: Path, mode: str) -> None:
    """Rank 1 fails in the second validation batch, in a fit's sanity check (before ``on_train_start``) or in a
    stand-alone ``trainer.validate``: the run ends, the file carries its rank (read in ``setup``), and the record
    names the loop and the batch."""
    done = launch(mode, tmp_path, timeout=120)
    assert done.returncode != 0 and "CUDA out of memory in validation on rank 1 (injected)" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("memtenants")) == [
        "memtenants_oom_rank1.json",
        "memtenants_oom_rank1.txt",
    ]
    record = json.loads((tmp_path / "memtenants_oom_rank1.json").read_text())
    assert (record["rank"], record["loop"], record["batch_index"], record["step"]) == (1, "validation", 1, 0)
    assert record["phase"] == "validation_step"
    # the weights of Net, nothing else: no gradient or optimizer state exists before the first training step
    assert record["tenants_at_failure_bytes"]["weights"] == P * 4
    assert record["tenants_at_failure_bytes"]["optimizer_state"] == 0


def test_the_largest_batch_logged_is_the_minimum_over_ranks(tmp_path: Path) -> None:
    """Rank 1 trains on sequences twice as long as rank 0's, so it fits about half the batch; rank zero logs that."""
    done = launch("budget", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text())["budget"] for r in (0, 1))
    assert rank1["own"] < rank0["own"] <= 2 * rank1["own"] + 2
    # steps 0 and 1, both logging steps: the minimum of the ranks' own answers then (each rank's answer is scaled
    # from its latest measured step, and DDP's second step differs from its first: it rebuilds its buckets)
    assert rank0["logged"] == [min(a, b) for a, b in zip(rank0["own_steps"], rank1["own_steps"], strict=True)]
    assert rank1["own_steps"][-1] == rank1["own"] and rank0["logged"][-1] == rank1["own"]
    assert rank0["all"] == rank1["all"] == rank1["own"]
