"""W&B, MLflow and CSV get the end of fit's pictures and summary, read back from the files each logger writes.

The real packages, offline: wandb in offline mode under the test's directory, MLflow on a local file store. One
fit with the three loggers at once serves most tests.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from conftest import RecordingLogger, make_trainer
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from matplotlib.image import imread
from seed_mlp import SeedMLP, seed_loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_memtenants.render.tensorboard as panels
from lightning_memtenants import MemoryTenantsCallback
from lightning_memtenants.lightning.sinks import CSVSink, MLFlowSink, WandbSink, sink_for


def offline(patch: pytest.MonkeyPatch, root: Path) -> None:
    """wandb offline, quiet, writing under ``root``; MLflow's local file store allowed."""
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_SILENT", "true")
    patch.setenv("WANDB_DIR", str(root))
    patch.setenv("WANDB_CACHE_DIR", str(root / "cache"))
    patch.setenv("WANDB_CONFIG_DIR", str(root / "config"))
    patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.x refuses its file store unless told


@pytest.fixture(scope="module")
def three_loggers(tmp_path_factory: pytest.TempPathFactory) -> tuple[MemoryTenantsCallback, Path, str]:
    """The seed model, 2 steps at batch 8, logged to W&B (offline), MLflow (file store) and CSV at once."""
    root = tmp_path_factory.mktemp("loggers")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
            patch.delenv(name, raising=False)
        offline(patch, root)
        L.seed_everything(0, verbose=False)
        wandb_logger = WandbLogger(save_dir=str(root), offline=True, project="memtenants")
        mlflow_logger = MLFlowLogger(experiment_name="memtenants", tracking_uri=f"file:{root}/mlruns")
        loggers = [wandb_logger, mlflow_logger, CSVLogger(root / "csv")]
        cb = MemoryTenantsCallback(budget_bytes="1GiB", print_summary=False)
        try:
            make_trainer([cb], steps=2, logger=loggers).fit(SeedMLP(), seed_loader(8, 2))
        finally:
            wandb_logger.experiment.finish()
    return cb, root, mlflow_logger.run_id


def peak_words(cb: MemoryTenantsCallback) -> str:
    """The last measured step's peak as the summary writes it (MiB, two decimals, thousands separated)."""
    assert cb.latest_measured is not None and cb.latest_measured.peak_bytes is not None
    return f"peak {cb.latest_measured.peak_bytes / 2**20:,.2f} MiB"


@pytest.mark.slow  # the shared fit: some 5 s, wandb's offline start included
def test_the_shared_fit_measured_its_last_step(three_loggers) -> None:
    cb, _, _ = three_loggers
    # SeedMLP's 25,175,040 float32 weights are 96.04 MiB; with the gradients and Adam's two moments the peak is higher
    assert cb.latest_measured.step == 1
    assert cb.latest_measured.peak_bytes > 3 * 25_175_040 * 4


@pytest.mark.slow
def test_csv_gets_the_summary_beside_metrics_csv(three_loggers) -> None:
    cb, root, _ = three_loggers
    (metrics,) = (root / "csv").rglob("metrics.csv")
    summary = (metrics.parent / "memtenants_summary.md").read_text()
    assert "### memtenants: optimizer step 0\n" in summary and "| `batch_end` |" in summary
    assert peak_words(cb) in summary
    assert not list((root / "csv").rglob("*.png"))  # CSV shows no picture


@pytest.mark.slow
def test_mlflow_gets_the_pictures_and_the_summary_as_artifacts(three_loggers) -> None:
    cb, root, run_id = three_loggers
    (artifacts,) = (root / "mlruns").rglob(f"{run_id}/artifacts")
    assert sorted(p.name for p in artifacts.iterdir()) == [
        "memtenants_desk.png",
        "memtenants_summary.md",
        "memtenants_timeline.png",
    ]
    assert peak_words(cb) in (artifacts / "memtenants_summary.md").read_text()
    for name in ("memtenants_desk.png", "memtenants_timeline.png"):
        assert imread(artifacts / name).shape[:2] == (560, 1100)  # the figures' 11 x 5.6 inches at 100 dpi


@pytest.mark.slow
def test_wandb_gets_the_pictures_and_the_summary_as_media(three_loggers) -> None:
    cb, root, _ = three_loggers
    (run,) = (root / "wandb").glob("offline-run-*")
    media = run / "files" / "media"
    desks = list((media / "images" / "memtenants").glob("desk_*.png"))
    timelines = list((media / "images" / "memtenants").glob("timeline_*.png"))
    assert len(desks) == len(timelines) == 1
    assert imread(desks[0]).shape[:2] == imread(timelines[0]).shape[:2] == (560, 1100)
    (page,) = (media / "html" / "memtenants").glob("summary_*.html")
    text = page.read_text()
    assert text.count("<pre>") == 1 and "memtenants: optimizer step 0 (memory source: " in text
    assert peak_words(cb) in text


@pytest.mark.slow
def test_mlflow_and_wandb_get_the_same_desk_pixels(three_loggers) -> None:
    _, root, run_id = three_loggers
    (artifacts,) = (root / "mlruns").rglob(f"{run_id}/artifacts")
    (desk,) = (root / "wandb").glob("offline-run-*/files/media/images/memtenants/desk_*.png")
    ours = imread(artifacts / "memtenants_desk.png")[..., :3]
    theirs = imread(desk)[..., :3]
    assert ours.shape == theirs.shape and np.array_equal(ours, theirs)


class Tiny(L.LightningModule):
    def __init__(self, oom_at_step: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.oom_at_step = oom_at_step

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.oom_at_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def test_a_failing_log_image_warns_once_and_the_fit_finishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no media")

    offline(monkeypatch, tmp_path)
    monkeypatch.setattr(WandbLogger, "log_image", broken)
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="memtenants")
    cb = MemoryTenantsCallback(print_summary=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
            trainer = make_trainer([cb], steps=2, logger=logger)
            trainer.fit(Tiny(), loader)
    finally:
        logger.experiment.finish()
    messages = [str(w.message) for w in caught if "memtenants" in str(w.message)]
    assert messages == [
        "memtenants: logging the pictures to WandbLogger failed (RuntimeError: no media); the pictures to"
        " WandbLogger is disabled from now on"
    ]
    assert trainer.state.finished and trainer.global_step == 2
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert len(list(run.glob("files/media/html/memtenants/summary_*.html"))) == 1  # the summary still went


def test_each_logger_kind_gets_its_writer(tmp_path: Path, monkeypatch) -> None:
    offline(monkeypatch, tmp_path)
    assert type(sink_for(CSVLogger(tmp_path))) is CSVSink
    assert type(sink_for(MLFlowLogger(tracking_uri=f"file:{tmp_path}/mlruns"))) is MLFlowSink
    assert type(sink_for(WandbLogger(save_dir=str(tmp_path), offline=True))) is WandbSink
    assert sink_for(TensorBoardLogger(tmp_path)) is None  # its panels
    assert sink_for(RecordingLogger()) is None  # any other logger: the scalars only


def test_with_tensorboard_the_pictures_are_drawn_once_for_every_logger(tmp_path: Path, monkeypatch) -> None:
    offline(monkeypatch, tmp_path)
    drawn = []

    def desk(*args: Any) -> Any:
        drawn.append(args[0].step)
        return desk_figure(*args)

    desk_figure = panels.desk_figure
    monkeypatch.setattr(panels, "desk_figure", desk)
    mlflow_logger = MLFlowLogger(tracking_uri=f"file:{tmp_path}/mlruns")
    board = TensorBoardLogger(tmp_path / "tb")
    cb = MemoryTenantsCallback(desk_every_n_logs=0, print_summary=False)
    loader = DataLoader(TensorDataset(torch.randn(12, 8)), batch_size=4)
    make_trainer([cb], steps=3, logger=[board, mlflow_logger]).fit(Tiny(), loader)
    assert drawn == [2, 0]  # the end of fit's desk, then the first step's PNG: none again for MLflow
    (artifacts,) = (tmp_path / "mlruns").rglob(f"{mlflow_logger.run_id}/artifacts")
    for name in ("memtenants_desk.png", "memtenants_timeline.png"):
        assert np.array_equal(imread(artifacts / name)[..., :3], imread(Path(board.log_dir) / name)[..., :3])


def test_mlflow_gets_the_oom_postmortem_as_an_artifact(tmp_path: Path, monkeypatch) -> None:
    offline(monkeypatch, tmp_path)
    mlflow_logger = MLFlowLogger(tracking_uri=f"file:{tmp_path}/mlruns")
    cb = MemoryTenantsCallback(memory_source="none", print_summary=False)
    loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)
    with pytest.raises(torch.OutOfMemoryError, match="injected"), pytest.warns(match="postmortem written"):
        make_trainer([cb], steps=4, logger=mlflow_logger).fit(Tiny(oom_at_step=2), loader)
    (artifacts,) = (tmp_path / "mlruns").rglob(f"{mlflow_logger.run_id}/artifacts")
    text = (artifacts / "memtenants_postmortem.md").read_text()
    assert text.startswith("### memtenants OOM postmortem: step 2")
    assert "The last completed step:" in text and "### memtenants: optimizer step 1" in text
    assert not (artifacts / "memtenants_summary.md").exists()  # no end of fit after the error
