from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


def memtenants(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_memtenants", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_predict_prints_the_desk_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    init = '{"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "block_size": 64}'
    run = memtenants(
        "predict", f"{GPT}:TinyGPT", "--batch-size", "4", "--seq-len", "32", "--init", init,
        "--budget", "64MiB", "--json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "phase (MiB)" in run.stdout and "batch_end" in run.stdout
    assert "peak inside" in run.stdout
    document = json.loads(out.read_text())
    # 2 layers of 12h^2 + 13h, token and head 256 x 64, positions 64 x 64, final LayerNorm
    params = 2 * (12 * 64 * 64 + 13 * 64) + 2 * 256 * 64 + 64 * 64 + 2 * 64
    assert document["report"]["tenants_bytes"]["weights"] == 4 * params
    largest = document["largest_batch_size"]
    assert f"largest batch for a budget of 64 MiB: {largest}" in run.stdout
    assert largest > 4
    assert document["report"]["peak_bytes"] <= 64 * 2**20


def test_console_script_is_the_same_entry_point() -> None:
    script = Path(sys.executable).with_name("memtenants")
    run = subprocess.run([str(script), "predict", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    assert "--precision" in run.stdout and "--budget" in run.stdout


def test_bad_arguments_exit_2_with_one_line(tmp_path: Path) -> None:
    cases = [
        (("predict", f"{GPT}:TinyGPT", "--precision", "fp8"), "--precision"),
        (("predict", f"{GPT}:TinyGPT", "--budget", "12XB"), "--budget"),
        (("predict", f"{GPT}:TinyGPT", "--batch-size", "0"), "--batch-size"),
        (("predict", f"{GPT}:TinyGPT", "--init", "[1]"), "--init"),
        (("predict", "no_colon"), "FILE.py:NAME"),
        (("predict", str(tmp_path / "missing.py") + ":Model"), "no such file"),
        (("predict", f"{GPT}:Nope"), "has no class or function 'Nope'"),
        (("predict", f"{GPT}:TinyGPT", "--target", "cuda", "--gpu", "Voodoo3"), "--gpu must be one of"),
        (("predict", f"{GPT}:TinyGPT", "--gpu", "A6000"), "--gpu needs --target cuda"),
    ]
    for args, expected in cases:
        run = memtenants(*args)
        assert run.returncode == 2, (args, run.stderr)
        assert expected in run.stderr, (args, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert "Traceback" not in run.stderr


def test_an_import_error_shows_the_users_code_not_ours(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\n\nraise ImportError('no module named flash_attn_9')\n")
    run = memtenants("predict", f"{broken}:Model")
    assert run.returncode == 2
    assert "ImportError: no module named flash_attn_9" in run.stderr
    assert 'broken.py", line 4' in run.stderr
    assert "cli.py" not in run.stderr


def test_predict_for_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    init = '{"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 256, "block_size": 64}'
    run = memtenants(
        "predict", f"{GPT}:TinyGPT", "--batch-size", "2", "--seq-len", "16", "--init", init,
        "--target", "cuda", "--gpu", "H100", "--json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "predicted for CUDA on H100" in run.stdout
    document = json.loads(out.read_text())
    after_backward = document["report"]["phases"]["after_backward"]
    assert after_backward["parts_bytes"]["cublas_workspace"] == 2 * 32 * 2**20
    assert after_backward["reserved_bytes"] >= after_backward["allocated_bytes"]
