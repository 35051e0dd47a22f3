"""How fast and how light a prediction is, and how its fixed cost compares with accelerate's formula.

Prints, measured side by side in one run:
1. the time of ``predict`` (one fake step, measured) over the time of one real first step of the
   same model on this CPU (median of ``--repeats``; goal 0.1x or less);
2. a 7B-shaped GPT (32 layers, hidden 4096, 32 heads, vocab 32000) predicted in a fresh process:
   seconds and peak resident memory of that process (goals 30 s and 2 GiB);
3. our fixed cost beside accelerate's ``estimate-memory`` formula (weights 1x, gradients 1x,
   Adam 2x the fp32 model size; mixed precision adds an fp16 copy of the gradients).

Run: ``python benchmarks/predict.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import TinyGPT  # noqa: E402
from seed_mlp import SeedMLP  # noqa: E402

from lightning_memtenants import predict  # noqa: E402

GiB = 2**30
BIG = {"vocab_size": 32000, "n_layer": 32, "n_head": 32, "n_embd": 4096, "block_size": 2048}


def real_first_step(make_model: Any, batch: Any) -> float:
    """One real step as Lightning runs it (forward, zero_grad, backward, first optimizer step)."""
    model = make_model()
    optimizer = model.configure_optimizers()
    start = time.perf_counter()
    loss = model.training_step(batch, 0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def predicted_step(make_model: Any, batch: Any) -> float:
    model = make_model()
    start = time.perf_counter()
    predict(model, batch)
    return time.perf_counter() - start


def speed(repeats: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    gpt = partial(TinyGPT, n_layer=4, n_embd=256, n_head=8, vocab_size=4096, block_size=512)
    cases = [
        ("seed MLP, batch 256", SeedMLP, (torch.randn(256, 1024),)),
        ("seed MLP, batch 2048", SeedMLP, (torch.randn(2048, 1024),)),
        ("GPT 4x256, batch 8 x 512", gpt, gpt().example_batch(8, 512)),
        ("GPT 4x256, batch 32 x 512", gpt, gpt().example_batch(32, 512)),
    ]
    rows = []
    for name, make, batch in cases:
        real = statistics.median(real_first_step(make, batch) for _ in range(repeats))
        fake = statistics.median(predicted_step(make, batch) for _ in range(repeats))
        rows.append((name, real, fake))
    return rows


BIG_SCRIPT = """
import json, resource, sys, time
from functools import partial
sys.path.insert(0, {examples!r})
start = time.perf_counter()
from gpt import TinyGPT
from lightning_memtenants import predict
config = {config!r}
report = predict(partial(TinyGPT, **config), lambda m: m.example_batch(1, 2048))
# VmHWM belongs to this program alone; ru_maxrss survives exec and would report the parent's peak
try:
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
except OSError:
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{
    "seconds": time.perf_counter() - start,
    "rss_bytes": hwm * 1024,
    "tenants": report.tenants_bytes,
    "peak": report.peak_bytes,
    "peak_phase": report.peak_phase,
}}))
"""


def big_model() -> dict[str, Any]:
    script = BIG_SCRIPT.format(examples=str(ROOT / "examples"), config=BIG)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def accelerate_formula(model_bytes: int, mixed: bool) -> dict[str, int]:
    """accelerate's estimate-memory training figures for an fp32 model of ``model_bytes``."""
    gradients = model_bytes + model_bytes // 2 if mixed else model_bytes
    return {"weights": model_bytes, "gradients": gradients, "optimizer_state": 2 * model_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))

    print("1. prediction time over one real first step (CPU, median of", args.repeats, "runs)")
    print(f"{'model':<28}{'real step s':>12}{'predict s':>12}{'ratio':>8}")
    for name, real, fake in speed(args.repeats):
        print(f"{name:<28}{real:>12.3f}{fake:>12.3f}{fake / real:>8.3f}")

    big = big_model()
    print("\n2. 7B-shaped GPT (32 x 4096, 32 heads, vocab 32000), batch 1 x 2048, fp32 AdamW, fresh process")
    print(f"   predicted in {big['seconds']:.1f} s, peak RSS {big['rss_bytes'] / GiB:.2f} GiB")
    print(f"   predicted peak {big['peak'] / GiB:.2f} GiB in {big['peak_phase']}; tenants (GiB):")
    for tenant, value in big["tenants"].items():
        print(f"     {tenant:<16}{value / GiB:>10.2f}")

    weights = big["tenants"]["weights"]
    mixed = predict(partial(TinyGPT, **BIG), lambda m: m.example_batch(1, 128), precision="bf16-mixed")
    print("\n3. fixed cost (GiB): ours, measured on fake tensors, beside accelerate's estimate-memory formula")
    print(f"{'':<34}{'weights':>10}{'gradients':>11}{'optimizer':>11}{'total':>10}")
    rows = [
        ("ours, 32-true", big["tenants"]),
        ("accelerate, float32", accelerate_formula(weights, mixed=False)),
        ("ours, bf16-mixed", mixed.tenants_bytes),
        ("accelerate, bfloat16 (mixed)", accelerate_formula(weights, mixed=True)),
    ]
    for name, tenants in rows:
        cells = [tenants["weights"], tenants["gradients"], tenants["optimizer_state"]]
        print(f"{name:<34}" + "".join(f"{c / GiB:>11.3f}" for c in cells) + f"{sum(cells) / GiB:>10.3f}")
    print("   ours adds AdamW's 4-byte step per parameter tensor; under Lightning's bf16-mixed the")
    print("   gradients stay fp32 (autocast casts copies, not the weights), so no fp16 gradient copy exists.")


if __name__ == "__main__":
    main()
