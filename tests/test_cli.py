from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_memtenants import StepReport, dry_run, predict
from lightning_memtenants.cli import build_parser
from lightning_memtenants.names import PARTS, TENANTS
from lightning_memtenants.render.table import step_table

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


def memtenants(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_memtenants", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.slow
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


@pytest.mark.slow
def test_console_script_is_the_same_entry_point() -> None:
    script = Path(sys.executable).with_name("memtenants")
    run = subprocess.run([str(script), "predict", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    assert "--precision" in run.stdout and "--budget" in run.stdout


def test_bad_arguments_exit_2_with_one_line(tmp_path: Path, cli: Any) -> None:
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
        (("predict", f"{GPT}:TinyGPT", "--target", "H100", "--gpu", "A6000"), "--gpu needs --target cuda"),
        (("predict", f"{GPT}:TinyGPT", "--target", "TPU"), "--target must be one of 'cpu', 'cuda' (an A100)"),
        (("predict", f"{GPT}:TinyGPT", "--target", "sm_99"), "also written 'cuda:A6000', got 'sm_99'"),
        (("predict", f"{GPT}:TinyGPT", "--target", "cuda:3"), "--target must be one of"),
    ]
    for args, expected in cases:
        run = cli(*args)
        assert run.returncode == 2, (args, run.stderr)
        assert expected in run.stderr, (args, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_an_import_error_shows_the_users_code_not_ours(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\n\nraise ImportError('no module named flash_attn_9')\n")
    run = memtenants("predict", f"{broken}:Model")
    assert run.returncode == 2
    assert "ImportError: no module named flash_attn_9" in run.stderr
    assert 'broken.py", line 4' in run.stderr
    assert "cli.py" not in run.stderr


@pytest.mark.slow
def test_predict_for_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    init = '{"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 256, "block_size": 64}'
    run = memtenants(
        "predict", f"{GPT}:TinyGPT", "--batch-size", "2", "--seq-len", "16", "--init", init,
        "--target", "H100", "--json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "predicted for CUDA on H100" in run.stdout
    document = json.loads(out.read_text())
    after_backward = document["report"]["phases"]["after_backward"]
    assert after_backward["parts_bytes"]["cublas_workspace"] == 2 * 32 * 2**20
    assert after_backward["reserved_bytes"] >= after_backward["allocated_bytes"]
    assert (document["device"], document["gpu"]) == ("cuda", "H100")


def test_target_names_the_gpu_and_gpu_is_deprecated(tmp_path: Path, user_module: str, cli: Any) -> None:
    documents = {}
    for name, args in {
        "new": ("--target", "A6000"),
        "prefixed": ("--target", "cuda:A6000"),
        "deprecated": ("--target", "cuda", "--gpu", "A6000"),
    }.items():
        out = tmp_path / f"{name}.json"
        run = cli("predict", f"{user_module}:Model", "--batch-size", "2", *args, "--json", str(out))
        assert run.returncode == 0, run.stderr
        assert "predicted for CUDA on A6000 (compute capability 8.6)" in run.stdout
        if name == "deprecated":
            assert run.stderr == (
                "memtenants: warning: --gpu is deprecated and will be removed in the next release: write --target"
                " A6000 instead of --target cuda --gpu A6000\n"
            )
        else:
            assert run.stderr == ""
        documents[name] = json.loads(out.read_text())
    assert documents["new"] == documents["prefixed"] == documents["deprecated"]
    report = documents["new"]["report"]
    # Linear(8, 1): 36 bytes of weights and as many of gradients; Adam's two moments, its step counters on the host;
    # pow keeps the 2 x 1 output, and autograd the closure's 8-byte int64 divisor
    assert report["tenants_bytes"] == {"weights": 36, "gradients": 36, "optimizer_state": 72, "activations": 2 * 4 + 8}
    assert report["expected_fixed_bytes"] == report["measured_fixed_bytes"] == 36 * 4
    workspace = 4096 * 1024 * 2 + 16 * 1024 * 8  # per thread on compute capability 8.6
    assert report["phases"]["after_backward"]["parts_bytes"]["cublas_workspace"] == 2 * workspace
    assert (documents["new"]["device"], documents["new"]["gpu"]) == ("cuda", "A6000")


def test_target_help_lists_what_it_accepts(cli: Any) -> None:
    run = cli("predict", "--help")
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    assert "--target DEVICE device to predict for (default: cpu): one of 'cpu', 'cuda' (an A100), or a GPU" in text
    assert "'A6000'" in text and "'sm_90', also written 'cuda:A6000'" in text
    assert "'cuda' alone assumes an A100 (compute capability 8.0)" in text
    assert "--gpu GPU deprecated, to be removed in the next release: write --target A6000 instead" in text


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """Every option of the parser and of its commands, with the command's name."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(f"{name} {option}", a) for option, a in _options(sub)]
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            found.append((action.option_strings[0], action))
    return found


def test_every_option_says_its_default(cli: Any) -> None:
    parser = build_parser()
    options = _options(parser)
    assert {name for name, _ in options} >= {
        "predict --batch-size", "predict --input-shape", "predict --target", "predict --json", "predict --gpu",
    }  # fmt: skip
    for name, action in options:
        assert action.help, name
        rendered = action.help % {**vars(action), "prog": "memtenants"}
        default = "none" if action.default is None else str(action.default)
        if name in ("predict --batch-size", "advise --batch-size"):
            default = "1"  # None stands for 1, or the first dimension of --input-shape
        assert f"(default: {default}" in rendered, (name, rendered)
    help_text = " ".join(cli("predict", "--help").stdout.split())
    assert "--margin MARGIN the fraction of --budget kept free, as the callback keeps it (default: 0.05)" in help_text
    assert "--precision PRECISION Lightning's precision: one of 16-mixed," in help_text
    assert "(default: 32-true)" in help_text


def test_a_bare_command_prints_its_usage(cli: Any) -> None:
    run = cli()
    assert run.returncode == 2 and run.stderr == ""
    assert run.stdout.startswith("usage: memtenants [-h] COMMAND ...")
    assert "predict   predict one training step's tenants and peak under fake tensors" in run.stdout
    run = cli("predict")
    assert run.returncode == 2 and run.stderr == ""
    assert run.stdout.startswith("usage: memtenants predict [-h]")
    assert "--input-shape SHAPE[:DTYPE]" in run.stdout


USER_MODULE = """
import torch
from torch import nn
import lightning as L


class Model(L.LightningModule):
    def __init__(self, width: int = 8):
        super().__init__()
        self.net = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())

    def example_batch(self, batch_size, seq_len=None):
        return (torch.randn(batch_size, 8),)


class ReturnsNone(Model):
    def example_batch(self, batch_size, seq_len=None):
        return None


class ReturnsText(Model):
    def example_batch(self, batch_size, seq_len=None):
        return "tokens"


class WrongShape(Model):
    def example_batch(self, batch_size, seq_len=None):
        return (torch.randn(batch_size, 3),)


class Raises(Model):
    def example_batch(self, batch_size, seq_len=None):
        raise RuntimeError("no data here")


class NoSeqLen(Model):
    def example_batch(self, batch_size):
        return (torch.randn(batch_size, 8),)


class NoExample(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())
"""


@pytest.fixture()
def user_module(tmp_path: Path) -> str:
    path = tmp_path / "user_models.py"
    path.write_text(USER_MODULE)
    return str(path)


def test_every_bad_input_is_one_line_naming_it(tmp_path: Path, user_module: str, cli: Any) -> None:
    cases = [
        ((f"{user_module}:Model", "--json", str(tmp_path / "missing" / "r.json")), "--json: the directory"),
        ((f"{user_module}:Model", "--json", ""), "--json must be a file path or '-'"),
        ((f"{user_module}:Model", "--json", str(tmp_path)), "is a directory"),
        ((f"{user_module}:Model", "--snapshot", str(tmp_path)), "--snapshot must be a file path, and"),
        ((f"{user_module}:Model", "--snapshot", str(tmp_path / "missing" / "s.pickle")), "--snapshot: the directory"),
        ((f"{user_module}:Model", "--snapshot", f"{user_module}/s.pickle"), f"--snapshot: {user_module} is not a"),
        ((f"{user_module}:Model", "--json", f"{user_module}/r.json"), f"--json: {user_module} is not a directory"),
        ((f"{GPT}:TinyGPT", "--init", '{"n_layr": 2}'), "unexpected keyword argument 'n_layr'"),
        ((f"{user_module}:ReturnsNone",), "ReturnsNone.example_batch(1) must return the batch for training_step"),
        ((f"{user_module}:ReturnsText",), "got 'tokens'"),
        ((f"{user_module}:NoSeqLen", "--seq-len", "4"), "--seq-len: NoSeqLen.example_batch takes no seq_len argument"),
        (("torch.nn:Linear",), "torch.nn:Linear cannot be built with --init {}"),
        (("json:loads",), "json:loads cannot be built with --init {}"),
        (("json:JSONDecoder",), "json:JSONDecoder is a class but not an nn.Module"),
        ((f"{user_module}:NoExample",), "NoExample has no example_batch(batch_size, seq_len=None) method to build a"),
        ((f"{user_module}:NoExample",), "give the batch's shapes instead, one --input-shape per tensor"),
        ((f"{user_module}:NoExample", "--input-shape", "2,8", "--seq-len", "4"), "--seq-len goes to example_batch"),
        ((f"{user_module}:NoExample", "--input-shape", "2,8", "--batch-size", "4"), "--batch-size 4 differs"),
        ((f"{user_module}:NoExample", "--input-shape", "2,8", "--input-shape", "3"), "first dimension is the batch"),
        ((f"{user_module}:NoExample", "--input-shape", "2,x"), "--input-shape: must be sizes separated by commas"),
        ((f"{user_module}:NoExample", "--input-shape", "2,0"), "--input-shape: sizes must be positive"),
        ((f"{user_module}:NoExample", "--input-shape", "2,8:float99"), "--input-shape: the dtype after ':'"),
    ]
    for args, expected in cases:
        run = cli("predict", *args)
        assert run.returncode == 2, (args, run.stderr)
        assert expected in run.stderr, (args, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert run.stdout == "", args  # found before anything was printed


@pytest.mark.parametrize(
    ("option", "path", "reason"),
    [
        ("--snapshot", "/sys/memtenants.pickle", "Permission denied"),
        ("--snapshot", "/proc/memtenants.pickle", "No such file or directory"),
        ("--json", "/sys/memtenants.json", "Permission denied"),
    ],
)
def test_an_output_that_cannot_be_written_is_one_line_after_the_table(
    user_module: str, cli: Any, option: str, path: str, reason: str
) -> None:
    """The parent directory exists, so only the write can tell: the table is printed first, then one line naming the
    option and the OS's reason, exit 2, no traceback (as root too: /sys and /proc refuse new files to everyone)."""
    run = cli("predict", f"{user_module}:Model", "--batch-size", "2", option, path)
    assert run.returncode == 2, run.stderr
    assert run.stderr == f"memtenants: error: {option}: cannot write {path}: {reason}\n"
    assert "high-water mark" in run.stdout and "peak" in run.stdout  # the table was not lost
    assert "Traceback" not in run.stdout + run.stderr


def test_the_user_s_own_failures_show_their_frames_not_ours(tmp_path: Path, user_module: str, cli: Any) -> None:
    (tmp_path / "interrupts.py").write_text("raise KeyboardInterrupt\n")
    cases = [
        ((f"{GPT}:TinyGPT", "--init", '{"n_layer": "2"}'), "building", "TypeError: 'str' object cannot be"),
        ((f"{user_module}:Raises",), "Raises.example_batch(1) failed", "RuntimeError: no data here"),
        ((f"{user_module}:WrongShape",), "the training step at batch size 1", "RuntimeError: a and b must have"),
        ((f"{GPT}:TinyGPT", "--seq-len", "100000"), "TinyGPT.example_batch(1, 100000) failed", "ValueError: seq_len"),
        ((f"{tmp_path / 'interrupts.py'}:Model",), "cannot import", "KeyboardInterrupt"),
    ]
    for args, first, last in cases:
        run = cli("predict", *args)
        assert run.returncode == 2, (args, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert first in lines[0] and lines[-1].startswith(last), (args, run.stderr)
        assert "lightning_memtenants" not in run.stderr and "site-packages" not in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
        assert any(line.strip().startswith("File ") for line in lines[1:-1]), run.stderr  # the user's own lines


def test_a_model_without_example_batch_is_predicted_from_shapes(tmp_path: Path, user_module: str, cli: Any) -> None:
    out = tmp_path / "shapes.json"
    run = cli("predict", f"{user_module}:NoExample", "--input-shape", "4,8", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == (
        f"memtenants predict {user_module}:NoExample: input shapes 4,8, 32-true, 1 step, for the CPU"
    )
    document = json.loads(out.read_text())
    assert (document["batch_size"], document["input_shapes"]) == (4, ["4,8"])
    # Linear(8, 1): 36 bytes of weights, as many of gradients, Adam's two moments and two 4-byte step counters;
    # pow keeps the 4 x 1 output, autograd the closure's 8-byte int64 divisor
    tenants = {"weights": 36, "gradients": 36, "optimizer_state": 80, "activations": 4 * 4 + 8}
    assert document["report"]["tenants_bytes"] == tenants
    # the budget's search sets the batch dimension of every shape
    run = cli("predict", f"{user_module}:NoExample", "--input-shape", "4,8", "--budget", "1MiB")
    assert run.returncode == 0, run.stderr
    assert "largest batch for a budget of 1 MiB: " in run.stdout


@pytest.mark.slow
def test_the_readme_seed_model_through_the_command(tmp_path: Path, cli: Any) -> None:
    out = tmp_path / "seed.json"
    run = cli("predict", "examples/seed_mlp.py:SeedMLP", "--input-shape", "2048,1024", "--json", str(out))
    assert run.returncode == 0, run.stderr
    from seed_mlp import SeedMLP

    expected = predict(SeedMLP(), (torch.Size([2048, 1024]),))  # a TensorDataset's batch: a tuple of one tensor
    got = StepReport.from_dict(json.loads(out.read_text())["report"])
    assert got.tenants_bytes == expected.tenants_bytes == {
        "weights": 100_700_160, "gradients": 100_700_160, "optimizer_state": 201_400_344, "activations": 75_497_480,
    }  # fmt: skip
    assert got.phases == expected.phases
    assert got.peak_bytes == expected.peak_bytes == 545_423_392


def test_json_dash_is_only_json_on_stdout(user_module: str) -> None:
    run = memtenants("predict", f"{user_module}:Model", "--batch-size", "2", "--target", "A6000", "--json", "-")
    assert run.returncode == 0, run.stderr
    document = json.loads(run.stdout)  # nothing else on stdout
    assert "phase (MiB)" in run.stderr and "memtenants predict" in run.stderr  # the table went to stderr
    report = document["report"]
    tenant_sum = sum(report["tenants_bytes"].values())
    assert report["tenant_sum_bytes"] == tenant_sum == 36 + 36 + 72 + 2 * 4 + 8
    assert report["peak_minus_sum_bytes"] == report["peak_bytes"] - tenant_sum
    workspace = 4096 * 1024 * 2 + 16 * 1024 * 8  # per thread on compute capability 8.6
    assert report["parts_bytes"]["cublas_workspace"] == 2 * workspace
    for name, phase in report["phases"].items():
        parts = sum(phase["parts_bytes"].values())
        assert phase["other_bytes"] == phase["allocated_bytes"] - sum(phase["tenants_bytes"].values()) - parts, name
        assert phase["fragmentation_bytes"] == phase["reserved_bytes"] - phase["allocated_bytes"] >= 0, name
    assert report["phases"]["after_backward"]["parts_bytes"]["allocator_rounding"] > 0


def _text_rows(stdout: str) -> tuple[list[str], dict[str, list[float]]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("phase (MiB)"))
    named = lines[header].removeprefix("phase (MiB)").replace(" peak", "-peak")  # "window peak", "reserved peak"
    columns = [c.replace("-peak", " peak") for c in named.split()]
    rows = {}
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        label, cells = line[:21].strip(), line[21:].split()
        rows[label] = [float("nan") if c == "-" else float(c.replace(",", "")) for c in cells]
    return columns, rows


def test_the_table_s_columns_add_up_to_allocated(tmp_path: Path, user_module: str, cli: Any) -> None:
    out = tmp_path / "r.json"
    run = cli("predict", f"{user_module}:Model", "--batch-size", "2", "--target", "cuda", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].endswith(
        "for CUDA on A100 (compute capability 8.0), which --target cuda assumes: name your GPU with --target, e.g."
        " --target H100"
    )
    document = json.loads(out.read_text())
    assert (document["gpu"], document["gpu_assumed"]) == ("A100", True)
    columns, rows = _text_rows(run.stdout)
    assert columns == [
        *TENANTS, "cublas_workspace", "allocator_rounding", "other", "allocated", "fragmentation", "reserved",
        "reserved peak", "window peak",
    ]  # fmt: skip
    summed = [*TENANTS, "cublas_workspace", "allocator_rounding", "other"]
    for label, cells in rows.items():
        if label == "high-water mark":
            continue
        value = dict(zip(columns, cells, strict=True))
        assert sum(value[c] for c in summed) == pytest.approx(value["allocated"], abs=0.005 * len(summed)), label
        assert value["allocated"] + value["fragmentation"] == pytest.approx(value["reserved"], abs=0.01), label
    # to the byte, in the table's own cells
    table = step_table(StepReport.from_dict(document["report"]))
    assert list(table.columns) == columns
    for label, cells in table.rows[:-1]:
        value = dict(zip(table.columns, cells, strict=True))
        assert sum(value[c] for c in summed) == value["allocated"], label  # type: ignore[misc]
        assert value["allocated"] + value["fragmentation"] == value["reserved"], label  # type: ignore[operator]
    assert all(name in PARTS for name in ("cublas_workspace", "allocator_rounding"))
    # on the CPU: no part, nothing reserved, the columns as before
    run = cli("predict", f"{user_module}:Model", "--batch-size", "2")
    columns, rows = _text_rows(run.stdout)
    assert columns == [*TENANTS, "other", "allocated", "window peak"]
    for label, cells in rows.items():
        if label != "high-water mark":
            assert sum(cells[:5]) == pytest.approx(cells[5], abs=0.03), label


ADVISE_MODULE = """
import torch
from torch import nn
import lightning as L


class Blocks(L.LightningModule):
    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh()) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(2))
        self.width = width

    def forward(self, x):
        for block, out in zip(self.blocks, self.out):
            x = x + out(block(x))
        return x

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())

    def example_batch(self, batch_size, seq_len=None):
        return (torch.randn(batch_size, self.width),)
"""


def test_advise_prints_the_measured_fixes_and_writes_json(tmp_path: Path, cli: Any) -> None:
    path = tmp_path / "advised.py"
    path.write_text(ADVISE_MODULE)
    out = tmp_path / "advice.json"
    run = cli("advise", f"{path}:Blocks", "--batch-size", "64", "--budget", "1MiB", "--json", str(out))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"memtenants advise {path}:Blocks: example_batch(64), 32-true, for the CPU"
    assert lines[1].endswith("and fits; a fix fits 1 MiB less a 5% margin (0.95 MiB)")
    assert lines[2].split() == ["fix", "peak", "MiB", "saves", "MiB", "fits", "how"]
    document = json.loads(out.read_text())
    assert (document["budget_bytes"], document["limit_bytes"], document["fits"]) == (2**20, int(2**20 * 0.95), True)
    fixes = {fix["name"]: fix for fix in document["fixes"]}
    import importlib.util

    spec = importlib.util.spec_from_file_location("advised_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # each row is the dry run of that fix: the highest peak of two steps
    for name, options in {
        "bf16-mixed": {"precision": "bf16-mixed"},
        "smaller micro-batch (32 x accumulate_grad_batches=2)": {"accumulate_grad_batches": 2},
    }.items():
        size = 32 if "accumulate_grad_batches" in options else 64
        expected = dry_run(module.Blocks(), (torch.Size([size, 16]),), steps=2, **options)
        assert fixes[name]["peak_bytes"] == max(r.peak_bytes for r in expected.reports), name
        row = next(line for line in lines if line.startswith(name + "  "))
        assert f"{fixes[name]['peak_bytes'] / 2**20:,.2f}" in row and "  yes  " in row
    baseline = dry_run(module.Blocks(), (torch.Size([64, 16]),), steps=2)
    assert document["baseline_peak_bytes"] == max(r.peak_bytes for r in baseline.reports)
    # the longest ModuleList is a tie of two; the first found holds the blocks
    assert "activation checkpointing (2 of 2 blocks)" in fixes
    assert fixes["SGD with momentum"]["changes_training"] and not fixes["bf16-mixed"]["changes_training"]
    assert fixes["bf16-mixed"]["trainer_kwargs"] == {"precision": "bf16-mixed"}
    assert "not tried: foreach=False: the optimizer runs its single-tensor loop already" in run.stdout


def test_advise_refuses_bad_input_in_one_line(tmp_path: Path, user_module: str, cli: Any) -> None:
    cases = [
        ((f"{user_module}:Model",), "the following arguments are required: --budget"),
        ((f"{user_module}:Model", "--budget", "12XB"), "--budget"),
        ((f"{user_module}:Model", "--budget", "1GiB", "--margin", "1"), "--margin: must be a fraction in [0, 1)"),
        ((f"{user_module}:Model", "--budget", "1GiB", "--accumulate-grad-batches", "0"), "--accumulate-grad-batches"),
        ((f"{user_module}:Model", "--budget", "1GiB", "--target", "TPU"), "--target must be one of"),
        ((f"{user_module}:Model", "--budget", "1GiB", "--init", "[1]"), "--init must be a JSON object"),
        ((f"{user_module}:NoExample", "--budget", "1GiB"), "NoExample has no example_batch(batch_size, seq_len=None)"),
        ((f"{user_module}:Nope", "--budget", "1GiB"), "has no class or function 'Nope'"),
        ((f"{user_module}:Model", "--budget", "1GiB", "--json", str(tmp_path)), "is a directory"),
        ((f"{user_module}:Model", "--budget", "1GiB", "--fsdp-ranks", "1,2"), "--fsdp-ranks: rank counts must be 2"),
        ((f"{user_module}:Model", "--budget", "1GiB", "--fsdp-ranks", "two"), "--fsdp-ranks: must be rank counts"),
        (
            (f"{user_module}:Model", "--budget", "1GiB", "--activation-memory-budgets", "0.5,1.5"),
            "--activation-memory-budgets: each value must be in [0, 1]",
        ),
        (
            (f"{user_module}:Model", "--budget", "1GiB", "--activation-memory-budgets", "half"),
            "--activation-memory-budgets: must be values in [0, 1] separated by commas, or grid",
        ),
    ]
    for args, expected in cases:
        run = cli("advise", *args)
        assert run.returncode == 2, (args, run.stderr)
        assert expected in run.stderr, (args, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert "Traceback" not in run.stderr and run.stdout == "", args
    run = cli("advise")
    assert run.returncode == 2 and run.stdout.startswith("usage: memtenants advise [-h]")
    assert "--budget BUDGET" in run.stdout and "--input-shape SHAPE[:DTYPE]" in run.stdout
