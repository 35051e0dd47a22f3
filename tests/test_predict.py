from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import CLOSURE_DIVISOR, SEED_P, SEED_SAVED_PER_SAMPLE, SEED_WEIGHTS, assert_equals_the_real_run
from gpt import TinyGPT
from seed_mlp import SeedMLP, seed_model
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_memtenants import TENANTS, dry_run, largest_batch_size, predict, sweep
from lightning_memtenants.analysis.budget import Budget
from lightning_memtenants.predict import cuda_model, dryrun, fake, transformer

HERE = Path(__file__).resolve().parent


def article_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


@pytest.fixture(scope="module")
def real_runs() -> dict[tuple[str, int], dict]:
    """Real one-step Trainer runs on the CPU, in a fresh process so the tracker sees only them."""
    specs = ["seed:8", "seed:64", "gpt:4", "gpt:8", "seed@bf16-mixed:8", "gpt@bf16-mixed:4"]
    out = subprocess.run(
        [sys.executable, str(HERE / "predict_check.py"), *specs], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {(run["kind"], run["batch_size"]): run for run in runs}


def small_gpt() -> TinyGPT:
    return TinyGPT(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)


@pytest.mark.parametrize(
    ("kind", "batch_size"),
    [("seed", 8), ("seed", 64), ("gpt", 4), ("gpt", 8), ("seed@bf16-mixed", 8), ("gpt@bf16-mixed", 4)],
)
@pytest.mark.slow
def test_prediction_equals_a_real_cpu_run_to_the_byte(real_runs: dict, kind: str, batch_size: int) -> None:
    real = real_runs[(kind, batch_size)]
    model, _, precision = kind.partition("@")
    precision = precision or "32-true"
    if model == "seed":
        predicted = predict(SeedMLP(), (torch.Size([batch_size, 1024]),), precision=precision)
    else:
        predicted = predict(small_gpt(), lambda m: m.example_batch(batch_size, 32), precision=precision)
    assert_equals_the_real_run(predicted, real)


def test_seed_prediction_values() -> None:
    report = predict(SeedMLP(), (torch.Size([256, 1024]),))
    assert report.tenants_bytes == {
        "weights": SEED_WEIGHTS,
        "gradients": SEED_WEIGHTS,
        "optimizer_state": 2 * SEED_WEIGHTS + 6 * 4,
        "activations": 256 * SEED_SAVED_PER_SAMPLE + CLOSURE_DIVISOR,
    }
    assert report.measured_fixed_bytes == report.expected_fixed_bytes == 16 * SEED_P + 24
    assert report.peak_phase == "batch_end"
    assert "Adam (single-tensor)" in report.peak_explanation
    assert report.memory_source.startswith("live-tensor tracker")


def test_article_plain_loop_peak() -> None:
    """The article's loop at batch 2048: a real CPU run of it peaks at 545,423,388 bytes with x resident."""
    report = predict(seed_model(), torch.Size([2048, 1024]), loss_fn=article_loss, optimizer=torch.optim.Adam)
    # the real run held x, the model and the loop's scalars (its peak is also the profiler's); the prediction holds them
    assert report.peak_bytes == 545_423_388
    assert report.phases["batch_end"].tenants_bytes["optimizer_state"] == 2 * SEED_WEIGHTS + 24


def test_every_batch_form_gives_the_same_report() -> None:
    model = seed_model()
    kwargs = {"loss_fn": article_loss, "optimizer": torch.optim.SGD}
    forms = [
        torch.randn(16, 1024),
        torch.empty(16, 1024, device="meta"),
        torch.Size([16, 1024]),
        lambda: torch.randn(16, 1024),
        lambda module: torch.zeros(16, module[0].in_features),
    ]
    reports = [predict(model, form, **kwargs) for form in forms]
    peaks = {r.peak_bytes for r in reports}
    assert len(peaks) == 1
    assert {r.tenants_bytes["activations"] for r in reports} == {16 * SEED_SAVED_PER_SAMPLE}


def test_the_callers_model_is_untouched() -> None:
    model = SeedMLP()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = {name: id(p) for name, p in model.named_parameters()}
    predict(model, (torch.Size([4, 1024]),), steps=2)
    assert model.losses == []
    for name, p in model.named_parameters():
        assert id(p) == ids[name]
        assert p.grad is None
        assert torch.equal(p, before[name])
        assert type(p) is nn.Parameter
    assert not model.net[0]._forward_hooks and not model.net[0]._forward_pre_hooks


def test_steps_two_is_a_steady_state_step() -> None:
    prediction = dry_run(SeedMLP(), (torch.Size([8, 1024]),), steps=2)
    first, second = prediction.reports
    assert (first.step, second.step) == (0, 1)
    assert first.phases["batch_start"].tenants_bytes["optimizer_state"] == 0
    assert second.phases["batch_start"].tenants_bytes["optimizer_state"] == 2 * SEED_WEIGHTS + 24
    # Lightning zeroes gradients after the forward, so the previous step's are resident at batch start
    assert second.phases["batch_start"].tenants_bytes["gradients"] == SEED_WEIGHTS
    assert second.phases["after_backward"].tenants_bytes["gradients"] == SEED_WEIGHTS


def test_true_precisions_cast_parameters_and_inputs() -> None:
    report = predict(SeedMLP(), (torch.Size([8, 1024]),), precision="bf16-true")
    assert report.tenants_bytes["weights"] == 50_350_080
    assert report.tenants_bytes["gradients"] == 50_350_080
    assert report.tenants_bytes["optimizer_state"] == 100_700_160 + 24
    assert report.tenants_bytes["activations"] == 8 * SEED_SAVED_PER_SAMPLE // 2 + CLOSURE_DIVISOR
    double = predict(SeedMLP(), (torch.Size([8, 1024]),), precision="64-true")
    assert double.tenants_bytes["weights"] == 2 * SEED_WEIGHTS


def test_16_mixed_on_cpu_is_bf16_mixed_and_says_so() -> None:
    prediction = dry_run(SeedMLP(), (torch.Size([8, 1024]),), precision="16-mixed")
    assert prediction.notes == ["16-mixed on the CPU runs as bf16-mixed, as Lightning does there"]
    assert prediction.report.tenants_bytes["weights"] == SEED_WEIGHTS


def test_manual_optimization_with_two_optimizers() -> None:
    class Gan(SeedMLP):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.critic = nn.Linear(1024, 1)

        def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
            (x,) = batch
            gen, critic = self.optimizers()
            loss = self.critic(self.net(x)).mean()
            gen.zero_grad()
            self.manual_backward(loss)
            gen.step()
            critic_loss = self.critic(x).pow(2).mean()
            critic.zero_grad()
            self.manual_backward(critic_loss)
            critic.step()

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.Adam(self.net.parameters()), torch.optim.SGD(self.critic.parameters(), momentum=0.9)]

    report = predict(Gan(), (torch.Size([4, 1024]),))
    critic_bytes = (1024 + 1) * 4
    assert report.tenants_bytes["weights"] == SEED_WEIGHTS + critic_bytes
    assert report.tenants_bytes["optimizer_state"] == 2 * SEED_WEIGHTS + 24 + critic_bytes
    assert report.measured_fixed_bytes == report.expected_fixed_bytes


def seed_batch(size: int) -> tuple[torch.Size]:
    return (torch.Size([size, 1024]),)


def test_sweep_feeds_the_forecast() -> None:
    forecast, predictions = sweep(SeedMLP(), seed_batch, (64, 128))
    assert [p.batch_size for p in predictions] == [64, 128]
    assert [p.batch_elements for p in predictions] == [64 * 1024, 128 * 1024]
    for prediction in predictions:
        assert forecast.predict_peak_bytes(prediction.batch_size) == prediction.report.peak_bytes


def test_largest_batch_size_is_exact() -> None:
    """The steady-state step must fit the budget less the margin; the forecast line misses backward's steeper slope."""
    budget = 600 * 2**20
    limit = Budget(budget).limit_bytes  # 5% kept free, as the callback keeps it
    largest = largest_batch_size(SeedMLP(), seed_batch, budget, start=64)
    assert predict(SeedMLP(), seed_batch(largest), steps=2).peak_bytes <= limit  # type: ignore[operator]
    over = predict(SeedMLP(), seed_batch(largest + 1), steps=2)
    assert over.peak_bytes > limit  # type: ignore[operator]
    assert over.peak_phase == "before_backward"  # the previous step's gradients are still resident in the forward
    # the first step alone, with no margin: it fits more, as it holds no optimizer state before its step
    first = largest_batch_size(SeedMLP(), seed_batch, budget, start=64, steps=1, margin=0.0)
    assert (
        predict(SeedMLP(), seed_batch(first)).peak_bytes
        <= budget
        < predict(SeedMLP(), seed_batch(first + 1)).peak_bytes
    )  # type: ignore[operator]
    assert first > largest
    assert largest_batch_size(SeedMLP(), seed_batch, "100MiB") == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        largest_batch_size(SeedMLP(), seed_batch, -1)


@pytest.mark.slow
def test_a_model_too_big_to_build_is_built_fake() -> None:
    """7B-shaped: weights exact for the configuration (timing and RAM are in benchmarks/predict.py)."""
    h, layers, vocab, block = 4096, 32, 32000, 2048
    build = partial(TinyGPT, vocab_size=vocab, n_layer=layers, n_head=32, n_embd=h, block_size=block)
    report = predict(build, lambda m: m.example_batch(1, 128))
    params = layers * (12 * h * h + 13 * h) + 2 * vocab * h + block * h + 2 * h
    assert report.tenants_bytes["weights"] == 4 * params == 26_858_782_720
    tensors = layers * 12 + 5  # 12 per block; token, position, final LayerNorm (2), head
    assert report.tenants_bytes["optimizer_state"] == 8 * params + 4 * tensors  # AdamW's 4-byte step per tensor


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"precision": "fp8"}, "precision"),
        ({"steps": 0}, "steps"),
        ({"target": "tpu"}, "target"),
        ({"target": "sm_99"}, "target"),
        ({"gpu": "A6000"}, "gpu"),
        ({"loss_fn": 3}, "loss_fn"),
        ({"optimizer": "adam"}, "optimizer"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        predict(SeedMLP(), (torch.Size([2, 1024]),), **kwargs)


def test_predict_is_dry_run_s_last_report_with_the_same_options() -> None:
    options = {"loss_fn": article_loss, "optimizer": torch.optim.SGD, "steps": 2, "target": "A6000"}
    prediction = dry_run(seed_model(), torch.Size([8, 1024]), **options)
    report = predict(seed_model(), torch.Size([8, 1024]), **options)
    assert len(prediction.reports) == 2 and prediction.report.to_dict() == report.to_dict()
    assert report.tenants_bytes["optimizer_state"] == 0  # plain SGD keeps no state
    assert report.tenants_bytes["weights"] == report.tenants_bytes["gradients"] == SEED_WEIGHTS


def test_plain_module_needs_a_loss_function() -> None:
    with pytest.raises(ValueError, match="loss_fn"):
        predict(seed_model(), torch.Size([2, 1024]))
    with pytest.raises(ValueError, match="batch"):
        predict(seed_model(), None, loss_fn=article_loss)


def test_user_errors_pass_through() -> None:
    class Broken(SeedMLP):
        def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
            raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        predict(Broken(), (torch.Size([2, 1024]),))
    assert _get_current_dispatch_mode() is None  # nothing of ours is left on the dispatch stack


def test_tenants_are_the_four() -> None:
    report = predict(seed_model(), torch.Size([2, 1024]), loss_fn=article_loss)
    assert tuple(report.tenants_bytes) == TENANTS


def test_tied_weights_stay_tied_and_counted_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 16)
            self.head = nn.Linear(16, 100, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(idx))

    def loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        return model(idx).logsumexp(-1).mean()

    for precision, size in (("32-true", 4), ("bf16-true", 2)):
        report = predict(Tied(), torch.zeros(2, 8, dtype=torch.long), loss_fn=loss, precision=precision)
        assert report.tenants_bytes["weights"] == 100 * 16 * size
        assert report.tenants_bytes["gradients"] == 100 * 16 * size
        assert report.measured_fixed_bytes == report.expected_fixed_bytes


def test_a_step_that_logs_and_reads_trainer_state_runs_without_a_trainer(recwarn: pytest.WarningsRecorder) -> None:
    class Logging(SeedMLP):
        def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, prog_bar=True)
            self.log_dict({"epoch": float(self.current_epoch), "step": float(self.global_step)})
            return loss

    report = predict(Logging(), (torch.Size([4, 1024]),))
    assert report.tenants_bytes["activations"] == 4 * SEED_SAVED_PER_SAMPLE + CLOSURE_DIVISOR
    assert not [w for w in recwarn if "self.log" in str(w.message)]


def test_a_compiled_model_is_predicted_as_it_runs_eagerly_and_still_compiles_afterwards() -> None:
    graphs: list[object] = []

    def counting(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting)
    prediction = dry_run(compiled, torch.Size([4, 8]), loss_fn=article_loss)
    eager = predict(model, torch.Size([4, 8]), loss_fn=article_loss)
    assert prediction.report.tenants_bytes == eager.tenants_bytes and prediction.report.peak_bytes == eager.peak_bytes
    assert "torch.compile'd parts are predicted as they run eagerly" in prediction.notes[-1]
    assert graphs == []  # nothing was compiled for fake tensors
    compiled(torch.randn(4, 8)).sum().backward()
    assert len(graphs) == 1  # and the user's own compile goes on as without us
    torch._dynamo.reset()


def test_the_public_entry_points_have_google_style_docstrings() -> None:
    import inspect

    from lightning_memtenants import cli

    documented = [
        (dryrun, ("predict", "dry_run", "sweep", "largest_batch_size", "Prediction", "PredictOptions")),
        (transformer, ("activation_check", "ActivationCheck", "korthikanti_bytes", "Term")),
        (cuda_model, ("resolve_gpu", "resolve_target", "CachingAllocatorModel", "CudaTarget", "round_block")),
        (cuda_model, ("cublas_workspace_bytes", "host_state_names", "host_state_bytes", "cuda_optimizer_defaults")),
        (fake, ("check_precision", "fake_module", "fake_batch", "forward_context")),
        (cli, ("main", "build_parser", "load_target")),
    ]
    missing = []
    for module, names in documented:
        for name in names:
            doc = inspect.getdoc(getattr(module, name)) or ""
            summary, _, body = doc.partition("\n\n")
            takes = inspect.isclass(getattr(module, name)) or bool(inspect.signature(getattr(module, name)).parameters)
            sections = ("Args:", "Keys:", "Attributes:") if takes else ("Returns:",)
            if not summary or not any(section in body for section in sections):
                missing.append(f"{module.__name__}.{name}")
            if inspect.isfunction(getattr(module, name)) and "Returns:" not in body:
                missing.append(f"{module.__name__}.{name} (Returns)")
    assert missing == []


def test_a_prediction_inside_the_users_saved_tensor_hooks_never_calls_them_and_leaves_them_in_place() -> None:
    calls: list[str] = []

    def hooks(name: str):
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            calls.append(name)
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    with hooks("outer"), hooks("inner"):
        report = predict(nn.Linear(8, 8), torch.Size([4, 8]), loss_fn=lambda m, b: m(b).pow(2).sum())
        assert calls == []
        x = torch.ones(2, requires_grad=True)
        (x * x).sum()  # the innermost hook is still the one on top, as the user left it
    assert report.tenants_bytes["activations"] > 0
    assert calls == ["inner", "inner"]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _float_sum(model: nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    return model(batch[0]).float().sum()


@pytest.mark.parametrize(
    ("make", "direct", "batch", "tensors_bytes", "parameters", "param_tensors"),
    [
        # Linear(4, 4) in bf16: weight 16 x 2 B + bias 4 x 2 B
        (
            lambda: nn.Linear(4, 4).to(torch.bfloat16),
            lambda: nn.Linear(4, 4, dtype=torch.bfloat16),
            (torch.zeros(2, 4, dtype=torch.bfloat16),),
            16 * 2 + 4 * 2,
            20,
            2,
        ),
        # Embedding(10, 4) + Linear(4, 2) by .half(): 40 x 2 B + (8 + 2) x 2 B
        (
            lambda: nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)).half(),
            lambda: nn.Sequential(nn.Embedding(10, 4, dtype=torch.half), nn.Linear(4, 2, dtype=torch.half)),
            (torch.zeros(2, 3, dtype=torch.long),),
            40 * 2 + 10 * 2,
            50,
            3,
        ),
        # with buffers: Linear(4, 4) + BatchNorm1d(4) in fp16; running mean and var 2 x 4 x 2 B, the int64 counter 8 B
        (
            lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(torch.float16),
            lambda: nn.Sequential(nn.Linear(4, 4, dtype=torch.half), nn.BatchNorm1d(4, dtype=torch.half)),
            (torch.zeros(2, 4, dtype=torch.half),),
            (20 + 8) * 2 + 2 * 4 * 2 + 8,
            28,
            4,
        ),
        # device and dtype in one call, the device the one it is on
        (
            lambda: nn.Linear(4, 4).to("cpu", torch.bfloat16),
            lambda: nn.Linear(4, 4, dtype=torch.bfloat16),
            (torch.zeros(2, 4, dtype=torch.bfloat16),),
            40,
            20,
            2,
        ),
    ],
    ids=["linear-to-bf16", "embedding-half", "batchnorm-buffers-to-fp16", "to-cpu-and-bf16"],
)
def test_a_model_converted_in_its_constructor_is_predicted_as_built_in_that_dtype(
    make, direct, batch, tensors_bytes: int, parameters: int, param_tensors: int
) -> None:
    report = predict(make, batch, loss_fn=_float_sum)
    assert report.tenants_bytes["weights"] == tensors_bytes
    assert report.tenants_bytes["gradients"] == 2 * parameters
    assert report.tenants_bytes["optimizer_state"] == 2 * 2 * parameters + 4 * param_tensors  # Adam, 4-byte steps
    same = predict(direct, batch, loss_fn=_float_sum)
    assert (report.tenants_bytes, report.peak_bytes) == (same.tenants_bytes, same.peak_bytes)


def test_a_tied_model_converted_in_its_constructor_stays_tied() -> None:
    def make() -> nn.Module:
        model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100, bias=False))
        model[1].weight = model[0].weight
        return model.to(torch.bfloat16)

    apply = nn.Module._apply
    report = predict(make, (torch.zeros(2, 8, dtype=torch.long),), loss_fn=_float_sum)
    assert report.tenants_bytes["weights"] == report.tenants_bytes["gradients"] == 100 * 16 * 2
    assert nn.Module._apply is apply  # torch's, put back after the build
