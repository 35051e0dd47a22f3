"""How fast and how light a prediction is, and how its fixed cost compares with accelerate's formula.

Prints, measured side by side in one run (every case in a fresh process of its own, so that its time and
its peak resident memory are its own; wall time and CPU time, the fastest and the median of repeats):

1. the time of ``predict`` over the time of one real first step of the same model and batch on this CPU
   (forward, ``zero_grad``, backward, the first AdamW step): Hugging Face GPT-2 and Llama of 2 layers at a
   realistic width, and the repository's GPT and seed MLP. A prediction process reports its first call
   (cold: PyTorch's fake-tensor cache and lazy imports are empty) and its warm calls after it; the real
   step runs in another process. Goals: 1 s for the 2-layer GPT-2 or Llama at batch 8 x 512, and 0.1x a
   real step wherever that step takes 2 s or more;
2. 7B and 70B shapes built under fake tensors by a zero-argument callable and predicted in a fresh process:
   seconds and peak RSS (the process's own ``VmHWM``). Goals: 7B in 10 s; 70B (80 layers, hidden 8192,
   GQA 64/8, vocab 128256, one 4096-token sequence) in 60 s and under 2 GiB;
3. our fixed cost beside accelerate's ``estimate-memory`` formula (weights 1x, gradients 1x,
   Adam 2x the fp32 model size; mixed precision adds an fp16 copy of the gradients).

Run: ``python benchmarks/predict.py [--repeats 3] [--real-repeats 2] [--big-repeats 2] [--processes 1]
[--cases "NAME;..."] [--src DIR,DIR]``; ``--list`` names the cases. ``--src`` times other source trees (each a
directory holding ``lightning_memtenants``) side by side, their processes taking turns, against the same real
steps. The machines this runs on are shared: read the fastest figures beside the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GiB = 2**30

# name: (model, batch size, sequence length); the model names a builder in ``_builder``
SPEED_CASES: dict[str, tuple[str, int, int]] = {
    "hf-gpt2-2L, 8 x 512": ("hf-gpt2-2L", 8, 512),
    "hf-llama-2L, 8 x 512": ("hf-llama-2L", 8, 512),
    "hf-gpt2-2L, 1 x 512": ("hf-gpt2-2L", 1, 512),
    "GPT 4x256, 8 x 512": ("gpt-4x256", 8, 512),
    "GPT 4x256, 32 x 512": ("gpt-4x256", 32, 512),
    "seed MLP, 256": ("seed", 256, 0),
    "seed MLP, 2048": ("seed", 2048, 0),
}
# name: (model, batch size, sequence length, goal in seconds); built under fake tensors by a callable
BIG_CASES: dict[str, tuple[str, int, int, float]] = {
    "7B GPT (repository's), 1 x 2048": ("gpt-7b", 1, 2048, 10.0),
    "7B Llama (HF), 1 x 2048": ("hf-llama-7b", 1, 2048, 10.0),
    "70B Llama (HF, GQA 64/8), 1 x 4096": ("hf-llama-70b", 1, 4096, 60.0),
    "70B GPT (repository's, no GQA), 1 x 4096": ("gpt-70b", 1, 4096, 60.0),
}
GOAL_SECONDS = 1.0  # the 2-layer Hugging Face models at 8 x 512
GOAL_RATIO = 0.1  # where a real step takes REAL_FLOOR seconds or more
REAL_FLOOR = 2.0
GOAL_RSS = 2 * GiB  # the 70B shape

GPT_7B = {"vocab_size": 32000, "n_layer": 32, "n_head": 32, "n_embd": 4096, "block_size": 2048}
GPT_70B = {"vocab_size": 128256, "n_layer": 80, "n_head": 64, "n_embd": 8192, "block_size": 4096}


# -- what a worker process runs -----------------------------------------------------------------------


def _builder(name: str) -> tuple[Callable[[], Any], bool]:
    """A zero-argument builder of the model, and whether it is a Hugging Face model (trained on its own loss)."""
    if name.startswith("hf-"):
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        configs: dict[str, Any] = {
            # GPT-2 small's width, 2 of its 12 layers
            "hf-gpt2-2L": (GPT2LMHeadModel, GPT2Config(n_layer=2, n_embd=768, n_head=12, n_positions=1024)),
            # TinyLlama-1.1B's width and grouped-query attention (32 heads, 4 of keys and values), 2 layers
            "hf-llama-2L": (
                LlamaForCausalLM,
                LlamaConfig(
                    num_hidden_layers=2,
                    hidden_size=2048,
                    intermediate_size=5632,
                    num_attention_heads=32,
                    num_key_value_heads=4,
                    vocab_size=32000,
                    max_position_embeddings=2048,
                ),
            ),
            "hf-llama-7b": (
                LlamaForCausalLM,
                LlamaConfig(
                    num_hidden_layers=32,
                    hidden_size=4096,
                    intermediate_size=11008,
                    num_attention_heads=32,
                    num_key_value_heads=32,
                    vocab_size=32000,
                    max_position_embeddings=4096,
                ),
            ),
            # Llama-3-70B's shape
            "hf-llama-70b": (
                LlamaForCausalLM,
                LlamaConfig(
                    num_hidden_layers=80,
                    hidden_size=8192,
                    intermediate_size=28672,
                    num_attention_heads=64,
                    num_key_value_heads=8,
                    vocab_size=128256,
                    max_position_embeddings=8192,
                    rope_theta=500000.0,
                ),
            ),
        }
        cls, config = configs[name]
        return partial(cls, config), True
    sys.path.insert(0, str(EXAMPLES))
    from gpt import TinyGPT
    from seed_mlp import SeedMLP

    gpts = {
        "gpt-4x256": {"n_layer": 4, "n_embd": 256, "n_head": 8, "vocab_size": 4096, "block_size": 512},
        "gpt-7b": GPT_7B,
        "gpt-70b": GPT_70B,
    }
    if name == "seed":
        return SeedMLP, False
    return partial(TinyGPT, **gpts[name]), False


def _batch(name: str, batch_size: int, seq_len: int) -> Any:
    import torch

    if name == "seed":
        return (torch.randn(batch_size, 1024),)
    ids = torch.randint(0, 1000, (batch_size, seq_len))
    if name.startswith("hf-"):
        return ids
    return ids, torch.roll(ids, -1, dims=1)


def _hf_loss(model: Any, ids: Any) -> Any:
    return model(input_ids=ids, labels=ids).loss


def _hf_optimizer(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params)


def _rss_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` (``ru_maxrss`` survives ``exec`` and may report the parent's)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _timed(run: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = run()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def _real_step(model: Any, batch: Any, optimizer: Any, hf: bool) -> None:
    """One real step as Lightning runs it: forward, ``zero_grad``, backward, the optimizer's step."""
    loss = _hf_loss(model, batch) if hf else model.training_step(batch, 0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One case in this fresh process: ``what`` is ``predict`` (first call, then warm calls) or ``real``."""
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    import torch

    from lightning_memtenants import predict

    imported = (time.perf_counter() - start_wall, time.process_time() - start_cpu)
    torch.manual_seed(0)
    make, hf = _builder(spec["model"])
    batch = _batch(spec["model"], spec["batch_size"], spec["seq_len"])
    options: dict[str, Any] = {"loss_fn": _hf_loss, "optimizer": _hf_optimizer} if hf else {}
    out: dict[str, Any] = {"import": imported}
    if spec["what"] == "real":
        model = make()
        times = []
        for _ in range(spec["repeats"]):
            optimizer = _hf_optimizer(model.parameters()) if hf else model.configure_optimizers()
            wall, cpu, _ = _timed(partial(_real_step, model, batch, optimizer, hf))
            times.append((wall, cpu))
            model.zero_grad(set_to_none=True)
            del optimizer
        out["times"] = times
    else:
        # the 2-layer models are built for real and copied as fakes, as a user's model is; big ones by the callable
        model = make if spec.get("callable") else make()
        wall, cpu, report = _timed(lambda: predict(model, batch, **options))
        out["first"] = (wall, cpu)
        out["times"] = [_timed(lambda: predict(model, batch, **options))[:2] for _ in range(spec["repeats"])]
        out["peak"] = report.peak_bytes
        out["peak_phase"] = report.peak_phase
        out["tenants"] = report.tenants_bytes
    out["rss_bytes"] = _rss_bytes()
    return out


def run_worker(spec: dict[str, Any], src: Path = ROOT / "src", timeout: float = 1800) -> dict[str, Any]:
    """``worker(spec)`` in a fresh Python process that imports ``lightning_memtenants`` from ``src``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"worker {spec} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _alternating(spec: dict[str, Any], trees: list[Path], processes: int) -> dict[Path, list[dict[str, Any]]]:
    """``processes`` fresh workers per source tree, the trees taking turns, so that a noisy spell hits them alike."""
    runs: dict[Path, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for index in range(processes):
        for tree in trees[index % len(trees) :] + trees[: index % len(trees)]:
            runs[tree].append(run_worker(spec, tree))
    return runs


# -- what the parent prints -----------------------------------------------------------------------------


def _stats(times: list[tuple[float, float]]) -> dict[str, float]:
    walls, cpus = [t[0] for t in times], [t[1] for t in times]
    return {
        "wall_min": min(walls),
        "wall_med": statistics.median(walls),
        "cpu_min": min(cpus),
        "cpu_med": statistics.median(cpus),
    }


def _cells(s: dict[str, float]) -> str:
    return f"{s['wall_min']:>7.2f}{s['wall_med']:>7.2f}{s['cpu_min']:>7.2f}{s['cpu_med']:>7.2f}"


def speed(names: list[str], repeats: int, real_repeats: int, trees: list[Path], processes: int) -> None:
    print("1. predict beside one real first step on this CPU (each in a fresh process of its own; seconds)")
    print("   real: min and median wall; first: predict's first call in its process, wall and CPU (median over")
    print("   processes); warm: the calls after it, wall min and median, CPU min and median; ratio: warm (first)")
    print("   median wall over the real step's median wall")
    print(
        f"{'case':<34}{'real':>7}{'med':>7} |{'first':>7}{'cpu':>7} |{'warm':>7}{'med':>7}{'cpu':>7}{'med':>7} |"
        f"{'ratio':>7}{'(first)':>9}{'rss GiB':>9}"
    )
    for name in names:
        model, batch_size, seq_len = SPEED_CASES[name]
        spec = {"model": model, "batch_size": batch_size, "seq_len": seq_len}
        real = _stats(run_worker({**spec, "what": "real", "repeats": real_repeats}, trees[0])["times"])
        runs = _alternating({**spec, "what": "predict", "repeats": repeats}, trees, processes)
        for tree in trees:
            warm = _stats([t for run in runs[tree] for t in run["times"]])
            first = _stats([run["first"] for run in runs[tree]])
            first_wall, first_cpu = first["wall_med"], first["cpu_med"]
            ratio, ratio_first = warm["wall_med"] / real["wall_med"], first_wall / real["wall_med"]
            label = name if len(trees) == 1 else f"{name} [{_label(tree, trees)}]"
            rss = max(run["rss_bytes"] for run in runs[tree])
            print(
                f"{label:<34}{real['wall_min']:>7.2f}{real['wall_med']:>7.2f} |{first_wall:>7.2f}{first_cpu:>7.2f} |"
                f"{_cells(warm)} |{ratio:>7.3f}{f'({ratio_first:.3f})':>9}{rss / GiB:>9.2f}"
            )
            goals = []
            if model.startswith("hf-") and (batch_size, seq_len) == (8, 512):
                goals.append(
                    f"{GOAL_SECONDS:.0f} s goal: warm {_met(warm['wall_med'] <= GOAL_SECONDS)},"
                    f" first call {_met(first_wall <= GOAL_SECONDS)}"
                )
            if real["wall_med"] >= REAL_FLOOR:
                goals.append(
                    f"{GOAL_RATIO}x goal (a real step of {REAL_FLOOR:.0f} s or more):"
                    f" warm {_met(ratio <= GOAL_RATIO)}, first call {_met(ratio_first <= GOAL_RATIO)}"
                )
            if goals:
                print(f"{'':<4}" + "; ".join(goals))


def _label(tree: Path, trees: list[Path]) -> str:
    """A source tree's name in the tables: its directory, or its parent's where that is ``src``."""
    name = tree.name if tree.name != "src" else tree.parent.name
    return name if [t.name for t in trees].count(tree.name) == 1 else str(tree)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def big(names: list[str], repeats: int, warm: bool, trees: list[Path]) -> dict[str, dict[str, Any]]:
    print("\n2. big shapes built under fake tensors by a callable, fp32 AdamW, each run a fresh process")
    print(f"{'case':<50}{'import s':>9}{'predict wall':>13}{'med':>6}{'cpu':>7}{'med':>6}{'rss GiB':>9}   goals")
    results = {}
    for name in names:
        model, batch_size, seq_len, goal = BIG_CASES[name]
        spec = {"model": model, "batch_size": batch_size, "seq_len": seq_len, "what": "predict", "callable": True}
        every = _alternating({**spec, "repeats": 1 if warm else 0}, trees, repeats)
        for tree in trees:
            runs = every[tree]
            first = _stats([r["first"] for r in runs])
            imported = min(r["import"][0] for r in runs)
            rss = max(r["rss_bytes"] for r in runs)
            goals = f"{goal:.0f} s {_met(first['wall_med'] <= goal)}"
            if model.endswith("70b"):
                goals += f", {GOAL_RSS / GiB:.0f} GiB {_met(rss < GOAL_RSS)}"
            label = name if len(trees) == 1 else f"{name} [{_label(tree, trees)}]"
            print(
                f"{label:<50}{imported:>9.2f}{first['wall_min']:>13.2f}{first['wall_med']:>6.2f}"
                f"{first['cpu_min']:>7.2f}{first['cpu_med']:>6.2f}{rss / GiB:>9.2f}   {goals}"
            )
            if warm:
                again = _stats([t for r in runs for t in r["times"]])
                print(f"{'  a second call in the same process':<59}{again['wall_min']:>13.2f}{again['wall_med']:>6.2f}")
        results[name] = every[trees[0]][0]
        tenants = results[name]["tenants"]
        print(
            f"{'':<4}predicted peak {results[name]['peak'] / GiB:.2f} GiB in {results[name]['peak_phase']}; "
            + ", ".join(f"{t} {v / GiB:.2f}" for t, v in tenants.items())
            + " GiB"
        )
    print("   predict: the first call in a fresh process (after the imports, which are beside it)")
    return results


def accelerate_formula(model_bytes: int, mixed: bool) -> dict[str, int]:
    """accelerate's estimate-memory training figures for an fp32 model of ``model_bytes``."""
    gradients = model_bytes + model_bytes // 2 if mixed else model_bytes
    return {"weights": model_bytes, "gradients": gradients, "optimizer_state": 2 * model_bytes}


def fixed_cost(tenants_32: dict[str, int]) -> None:
    sys.path.insert(0, str(EXAMPLES))
    from gpt import TinyGPT

    from lightning_memtenants import predict

    weights = tenants_32["weights"]
    mixed = predict(partial(TinyGPT, **GPT_7B), lambda m: m.example_batch(1, 128), precision="bf16-mixed")
    print("\n3. fixed cost (GiB) of the 7B GPT: ours, measured on fake tensors, beside accelerate's estimate-memory")
    print(f"{'':<34}{'weights':>10}{'gradients':>11}{'optimizer':>11}{'total':>10}")
    rows = [
        ("ours, 32-true", tenants_32),
        ("accelerate, float32", accelerate_formula(weights, mixed=False)),
        ("ours, bf16-mixed", mixed.tenants_bytes),
        ("accelerate, bfloat16 (mixed)", accelerate_formula(weights, mixed=True)),
    ]
    for name, tenants in rows:
        cells = [tenants["weights"], tenants["gradients"], tenants["optimizer_state"]]
        print(f"{name:<34}" + "".join(f"{c / GiB:>11.3f}" for c in cells) + f"{sum(cells) / GiB:>10.3f}")
    print("   ours adds AdamW's 4-byte step per parameter tensor; under Lightning's bf16-mixed the")
    print("   gradients stay fp32 (autocast casts copies, not the weights), so no fp16 gradient copy exists.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm predict calls per process")
    parser.add_argument("--real-repeats", type=int, default=2, help="real steps per case")
    parser.add_argument("--big-repeats", type=int, default=2, help="fresh processes per big shape")
    parser.add_argument("--big-warm", action="store_true", help="also time a second predict in each big process")
    parser.add_argument("--cases", default="", help="case names, or parts of them, separated by ';'")
    parser.add_argument("--processes", type=int, default=1, help="fresh predict processes per case and source tree")
    parser.add_argument(
        "--src",
        default=str(ROOT / "src"),
        help="source trees to time side by side, separated by ',' (each a directory holding lightning_memtenants)",
    )
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    every = [*SPEED_CASES, *BIG_CASES]
    if args.list:
        print("\n".join(every))
        return
    wanted = [part.strip() for part in args.cases.split(";") if part.strip()]
    chosen = [name for name in every if not wanted or any(part in name for part in wanted)]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start")
    trees = [Path(part).resolve() for part in args.src.split(",") if part.strip()]
    if len(trees) > 1:
        print("source trees, taking turns:", ", ".join(f"{_label(tree, trees)} = {tree}" for tree in trees))
    speeds = [name for name in chosen if name in SPEED_CASES]
    if speeds:
        speed(speeds, args.repeats, args.real_repeats, trees, args.processes)
    bigs = [name for name in chosen if name in BIG_CASES]
    if bigs:
        results = big(bigs, args.big_repeats, args.big_warm, trees)
        seven = results.get("7B GPT (repository's), 1 x 2048")
        if seven is not None:
            fixed_cost(seven["tenants"])
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
