"""The TensorBoard panels, checked in a real ``tensorboard`` server and in the event files it reads."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from conftest import SEED_WEIGHTS, RecordingLogger, make_trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from seed_mlp import SeedMLP, seed_loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_memtenants.render.tensorboard as panels
from lightning_memtenants import MemoryTenantsCallback
from lightning_memtenants.names import PARTS
from lightning_memtenants.render.table import summary_markdown
from lightning_memtenants.render.tags import DESK, POSTMORTEM, SUMMARY, custom_scalars_layout, tag
from lightning_memtenants.render.tensorboard import desk_figure
from lightning_memtenants.units import MiB

TAGS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "tags.md"  # the reference of every logged tag
TENSORBOARD = Path(sys.executable).parent / "tensorboard"
RUN = "seed_mlp/version_0"
SEED_FIXED = 402_800_664
BUDGET = 1024 * MiB
# need an allocator that reserves
CUDA_ONLY = {"memtenants/reserved_MiB", "memtenants/fragmentation_MiB", "memtenants/peak_reserved_MiB"}
# logged only under mixed precision, a GradScaler or DDP (tests/test_matrix.py checks them), or by loops this run
# does not run, or on CUDA
CONDITIONAL = {f"memtenants/part/{name}_MiB" for name in PARTS} | {"memtenants/validation/peak_reserved_MiB"}
LOOPS = ("validation", "test", "predict")


class ValidatedSeedMLP(SeedMLP):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.net(batch[0])


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[MemoryTenantsCallback, Path]:
    """The seed example's model and data in a Trainer with a TensorBoardLogger: 3 steps at batch 32, then a
    validation batch of 256 (8x), after a sanity check."""
    root = tmp_path_factory.mktemp("tb")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything sets them: not past this fit
            patch.delenv(name, raising=False)
        L.seed_everything(0, verbose=False)
        cb = MemoryTenantsCallback(budget_bytes="1GiB", print_summary=False)
        trainer = make_trainer([cb], steps=3, logger=TensorBoardLogger(root, name="seed_mlp"))
        trainer.fit(ValidatedSeedMLP(), seed_loader(32, 3), seed_loader(256, 1, seed=1))
    return cb, root


@pytest.fixture(scope="module")
def server(seed_run: tuple[MemoryTenantsCallback, Path]) -> Iterator[str]:
    """A real TensorBoard on 127.0.0.1 and a free port, serving the seed run; stopped at teardown."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [str(TENSORBOARD), "--logdir", str(seed_run[1]), "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if RUN in get(base, "/data/runs"):
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensorboard did not come up: {process.stderr.read().decode()[-2000:]}")
            time.sleep(0.25)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def get(base: str, path: str, **query: str) -> Any:
    url = base + path + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
        return json.loads(body) if "json" in response.headers.get("Content-Type", "") else body


def documented_tags() -> set[str]:
    """Every tag the tags page names; a row of ``memtenants/<loop>/...`` names each loop's, its bare names too."""
    text = TAGS_PAGE.read_text()
    tags = set(re.findall(r"`(memtenants/[A-Za-z0-9_/]+)`", text))
    for row in re.findall(r"^\| (`memtenants/<loop>/.*?) \|", text, re.M):
        names = [name.removeprefix("memtenants/<loop>/") for name in re.findall(r"`([^`]+)`", row)]
        tags |= {f"memtenants/{loop}/{name}" for loop in LOOPS for name in names}
    return tags


@pytest.mark.slow
def test_scalars_endpoint_lists_every_documented_tag(server: str) -> None:
    tags = set(get(server, "/data/plugin/scalars/tags")[RUN])
    assert all(tag.startswith("memtenants/") for tag in tags)
    expected = {tag for tag in documented_tags() if tag.endswith(("_MiB", "_size"))} - CUDA_ONLY - CONDITIONAL
    expected = {tag for tag in expected if not tag.startswith(("memtenants/test/", "memtenants/predict/"))}
    assert tags == expected
    assert len(tags) == 23 + 11  # training's, and the validation loop's


@pytest.mark.slow
def test_custom_scalars_endpoint_returns_our_layout(server: str) -> None:
    served = get(server, "/data/plugin/custom_scalars/layout")
    ours = custom_scalars_layout()
    assert served["category"] == [
        {
            "title": title,
            "chart": [{"title": chart, "multiline": {"tag": tags}} for chart, (_kind, tags) in charts.items()],
            "closed": False,
        }
        for title, charts in ours.items()
    ]
    titles = [chart["title"] for chart in served["category"][0]["chart"]]
    assert titles[:6] == [
        "tenants (MiB)",
        "peak vs sum of tenants (MiB)",
        "peak: training vs validation (MiB)",
        "fixed cost: expected vs measured (MiB)",
        "headroom (MiB)",
        "max batch size (samples)",
    ]
    # every chart's regular expression matches exactly one logged tag: no chart is empty on a budgeted CPU run
    logged = get(server, "/data/plugin/scalars/tags")[RUN]
    for chart in served["category"][0]["chart"]:
        for pattern in chart["multiline"]["tag"]:
            assert [tag for tag in logged if re.match(pattern, tag)] == [pattern]


@pytest.mark.slow
def test_images_endpoint_lists_the_desk(server: str) -> None:
    tags = get(server, "/data/plugin/images/tags")
    image = {"displayName": "", "description": "", "samples": 1}
    assert tags == {RUN: {"memtenants/desk": image, "memtenants/timeline": image}}
    images = get(server, "/data/plugin/images/images", run=RUN, tag="memtenants/desk")
    # a fit of a second draws no in-fit picture (the pictures' budget); the end of fit's is the last measured step
    assert [image["step"] for image in images] == [2]
    png = get(server, "/data/plugin/images/individualImage", blob_key=images[-1]["query"].split("blob_key=")[-1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_images_endpoint_serves_the_timeline(server: str) -> None:
    images = get(server, "/data/plugin/images/images", run=RUN, tag="memtenants/timeline")
    assert [image["step"] for image in images] == [2]  # drawn with the desk, at the end of fit
    png = get(server, "/data/plugin/images/individualImage", blob_key=images[-1]["query"].split("blob_key=")[-1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20]), int.from_bytes(png[20:24])) == (1100, 560)  # the IHDR's width, height


@pytest.mark.slow
def test_text_endpoint_lists_the_summary(server: str) -> None:
    assert get(server, "/data/plugin/text/tags") == {RUN: ["memtenants/summary/text_summary"]}
    (entry,) = get(server, "/data/plugin/text/text", run=RUN, tag="memtenants/summary/text_summary")
    html = entry["text"]
    assert entry["step"] == 2  # the step whose scalars the last table shows
    assert html.count("<strong>high-water mark</strong>") == 2  # a table for the first step and one for the last
    assert "memtenants: optimizer step 0" in html and "memtenants: optimizer step 2" in html
    assert "expected 402,800,664 bytes" in html
    assert "peak inside the optimizer step" in html


def test_event_file_holds_the_seed_weights_to_the_byte(seed_run) -> None:
    cb, root = seed_run
    events = EventAccumulator(str(root / RUN), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    weights = [event.value for event in events.Scalars("memtenants/weights_MiB")]
    assert weights == [SEED_WEIGHTS / MiB] * 3  # 100,700,160 bytes: 96.03515625, exact in float32
    assert round(weights[0], 2) == 96.04
    fixed = [event.value for event in events.Scalars("memtenants/fixed_measured_MiB")]
    assert fixed[-1] == float(np.float32(SEED_FIXED / MiB))
    headroom = events.Scalars("memtenants/headroom_MiB")[-1].value
    assert headroom == float(np.float32((BUDGET - cb.latest.peak_bytes) / MiB))
    assert "custom_scalars__config__" in events.Tags()["tensors"]
    # one validation run (the sanity check is not logged), at step 2, where Lightning logs a self.log of the same
    # validation run: the weights and Adam's state (Lightning freed the gradients), the batch of 256 x 1024 floats,
    # and Linear(1024, 4096)'s output and the ReLU's alive together
    peaks = [(event.step, event.value) for event in events.Scalars("memtenants/validation/peak_MiB")]
    peak = SEED_FIXED - SEED_WEIGHTS + 256 * 1024 * 4 + 2 * 256 * 4096 * 4
    assert peaks == [(2, float(np.float32(peak / MiB)))] and cb.evaluation_peak("validate").peak_bytes == peak


def test_png_and_markdown_in_the_log_dir(seed_run) -> None:
    cb, root = seed_run
    for name in ("memtenants_desk.png", "memtenants_desk_first.png", "memtenants_timeline.png"):
        assert (root / RUN / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (root / RUN / "memtenants_summary.md").read_text()
    assert "| `batch_end` | 96.04 | 96.04 | 192.07 | 0.00 |" in text
    headline, tables = text.strip().split("\n\n### memtenants: optimizer step ", 1)  # the headline comes first
    assert headline.startswith("### memtenants: at a glance\n\n- peak: training ")
    assert f"### memtenants: optimizer step {tables}" == "\n\n".join(
        summary_markdown(r, BUDGET) for r in (cb.first, cb.latest)
    )


def test_desk_picture_draws_the_report(seed_run) -> None:
    cb, _ = seed_run
    report = cb.latest
    figure = desk_figure(report, BUDGET)
    axes = figure.axes[0]
    stacks = {container.get_label(): [bar.get_height() for bar in container] for container in axes.containers}
    assert list(stacks) == ["weights", "gradients", "optimizer_state", "activations", "other"]
    phases = list(report.phases.values())
    for name, heights in stacks.items():
        if name == "other":
            expected = [p.other_bytes / MiB for p in phases]
        else:
            expected = [p.tenants_bytes[name] / MiB for p in phases]
        assert heights == pytest.approx(expected)
    assert stacks["weights"] == [100_700_160 / MiB] * 5
    lines = {line.get_label(): line for line in axes.lines}
    assert lines["budget 1,024 MiB"].get_ydata()[0] == pytest.approx(1024)
    star = lines["step peak"]
    assert star.get_xdata()[0] == list(report.phases).index(report.peak_phase)
    assert star.get_ydata()[0] == pytest.approx(report.peak_bytes / MiB)
    assert "window peak" in {collection.get_label() for collection in axes.collections}
    # the caption says why the star sits above the bars, and defines the window peak
    caption = figure.get_supxlabel()
    assert "Why: peak inside the optimizer step: Adam (single-tensor) temporaries" in caption.replace("\n", " ")
    assert "the window peak, the highest allocated since the phase before" in caption.replace("\n", " ")


def test_desk_writes_thin_tenants_on_the_bars() -> None:
    from lightning_memtenants.core.record import PhaseReport, StepReport

    tenants = {"weights": 500 * MiB, "gradients": 0, "optimizer_state": 0, "activations": 9 * MiB}
    phase = PhaseReport("before_backward", tenants, 509 * MiB, 509 * MiB, None)
    report = StepReport(0, {"before_backward": phase}, [{"before_backward": phase}], tenants, None, 500 * MiB)
    texts = [t.get_text() for t in desk_figure(report).axes[0].texts]
    assert "activations 9.00 MiB" in texts
    assert not any(t.startswith("weights") for t in texts)  # a thick layer reads on its own


def test_every_panel_tag_is_in_the_tags_page() -> None:
    documented = documented_tags()
    assert {tag(DESK), tag(SUMMARY), tag(POSTMORTEM)} <= documented
    assert {tag for charts in custom_scalars_layout().values() for _, tags in charts.values() for tag in tags} <= (
        documented
    )


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


def tiny_loader(steps: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(4 * steps, 8)), batch_size=4)


def read_events(directory: Path) -> EventAccumulator:
    (run,) = {path.parent for path in directory.rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def test_desk_rate_follows_the_option(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(panels.TensorBoardPanels, "_may_draw", lambda self: True)  # the budget is tested below
    cb = MemoryTenantsCallback(desk_every_n_logs=2, print_summary=False)
    make_trainer([cb], steps=5, logger=TensorBoardLogger(tmp_path)).fit(Tiny(), tiny_loader(5))
    events = read_events(tmp_path)
    assert [image.step for image in events.Images(tag(DESK))] == [0, 2, 4]  # the last is not drawn twice
    assert len(events.Scalars("memtenants/weights_MiB")) == 5


def test_desk_every_0_draws_only_at_the_end(tmp_path) -> None:
    cb = MemoryTenantsCallback(desk_every_n_logs=0, print_summary=False)
    make_trainer([cb], steps=3, logger=TensorBoardLogger(tmp_path)).fit(Tiny(), tiny_loader(3))
    assert [image.step for image in read_events(tmp_path).Images(tag(DESK))] == [2]


@pytest.mark.parametrize("value", [-1, 1.5, True, "10", None])
def test_bad_desk_rate_is_rejected(value) -> None:
    with pytest.raises(ValueError, match="desk_every_n_logs"):
        MemoryTenantsCallback(desk_every_n_logs=value)


def test_other_loggers_get_scalars_and_no_notice(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    recording = RecordingLogger()
    cb = MemoryTenantsCallback(print_summary=False)
    with caplog.at_level(logging.INFO):
        make_trainer([cb], steps=3, logger=[recording, CSVLogger(tmp_path)]).fit(Tiny(), tiny_loader(3))
    assert [r.getMessage() for r in caplog.records if "memtenants" in r.getMessage()] == []
    assert len(recording.logged) == 3
    assert "memtenants/weights_MiB" in (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert (tmp_path / "lightning_logs" / "version_0" / "memtenants_summary.md").is_file()  # tests/test_loggers.py
    assert not list(tmp_path.rglob("memtenants_desk.png"))


def test_a_failing_picture_warns_once_and_disables_only_the_picture(tmp_path, monkeypatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("no renderer")

    monkeypatch.setattr(panels, "desk_figure", broken)
    cb = MemoryTenantsCallback(desk_every_n_logs=1, print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb], steps=3, logger=TensorBoardLogger(tmp_path)).fit(Tiny(), tiny_loader(3))
    messages = [str(w.message) for w in caught if "memtenants" in str(w.message)]
    assert messages == [
        "memtenants: drawing the desk picture failed (RuntimeError: no renderer); the desk picture is disabled"
        " from now on"
    ]
    events = read_events(tmp_path)
    assert events.Tags()["images"] == ["memtenants/timeline"]  # the other picture goes on
    assert len(events.Scalars("memtenants/weights_MiB")) == 3
    assert {"custom_scalars__config__", "memtenants/summary/text_summary"} <= set(events.Tags()["tensors"])
    assert cb.latest is not None and cb.latest.step == 2


def test_oom_postmortem_goes_to_the_text_panel(tmp_path) -> None:
    module = Tiny(oom_at_step=2)
    cb = MemoryTenantsCallback(memory_source="none", print_summary=False)
    with pytest.raises(torch.OutOfMemoryError, match="injected"), pytest.warns(match="postmortem written"):
        make_trainer([cb], steps=4, logger=TensorBoardLogger(tmp_path)).fit(module, tiny_loader(4))
    events = read_events(tmp_path)
    (entry,) = events.Tensors("memtenants/postmortem/text_summary")
    text = entry.tensor_proto.string_val[0].decode()
    assert text.startswith("### memtenants OOM postmortem: step 2")
    assert "Failed in the forward pass (`forward`), after `batch_start`." in text
    assert "The last completed step:" in text and "### memtenants: optimizer step 1" in text
    assert "Fixes, estimated from the tenants (not measured), most bytes saved first:" in text
    # the logger's directory, as it was at the start of fit
    assert cb.postmortem_path == tmp_path / "lightning_logs" / "version_0" / "memtenants_oom.json"


class ImageWriter:
    """A ``SummaryWriter``-like object that keeps the tag and step of each image, and takes text and flushes."""

    def __init__(self) -> None:
        self.images: list[tuple[str, int]] = []

    def add_image(self, name: str, image: np.ndarray, step: int, dataformats: str) -> None:
        self.images.append((name, step))

    def add_text(self, *args: Any) -> None:
        pass

    def flush(self) -> None:
        pass


def small_report(step: int) -> Any:
    from lightning_memtenants.core.record import PhaseReport, StepReport

    tenants = {"weights": 5 * MiB, "gradients": 0, "optimizer_state": 0, "activations": MiB}
    phase = PhaseReport("before_backward", tenants, 6 * MiB, 6 * MiB, None)
    return StepReport(step, {"before_backward": phase}, [{"before_backward": phase}], tenants, None, 5 * MiB)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A clock the test moves: ``clock[0]`` seconds; each desk picture costs ``clock[1]`` seconds of it."""
    now = [0.0, 0.3]

    def desk(report: Any, budget_bytes: int | None = None) -> Any:
        now[0] += now[1]
        return panels.Figure(figsize=(1, 1), dpi=10)

    monkeypatch.setattr(panels, "desk_figure", desk)
    return now


def test_pictures_keep_to_two_percent_of_the_fit_time_when_every_step_is_logged(clock: list[float]) -> None:
    writer = ImageWriter()
    board = panels.TensorBoardPanels([writer], desk_every_n_logs=1, clock=lambda: clock[0], first_pair_s=0.3)
    shares = []
    for step in range(7000):
        clock[0] += 0.007  # a step of 7 ms, logged
        board.on_log(small_report(step), step)
        shares.append(board.drawing_s / clock[0])
    # each picture only once 2% of the time since the start pays for it, the ones before and the end of fit's (each
    # estimated at 0.3 s): 0.3 s of drawing once the fit is 30 s old, 0.6 s at 45 s
    assert [step for _, step in writer.images] == [4285, 6385]
    assert board.pictures == 2 and board.skipped == 6998
    assert board.drawing_s == pytest.approx(0.6)
    assert max(shares) <= 0.02  # never above the share
    board.on_fit_end([small_report(6999)], 6999, None, desk=small_report(6999))  # the end of fit's, always
    assert writer.images[-1] == (tag(DESK), 6999)
    assert board.drawing_s == pytest.approx(0.9)
    assert board.drawing_s / clock[0] <= 0.02  # the end of fit's pair included: 0.9 s of a fit of 49.9 s


def test_at_most_max_pictures_go_to_the_events_the_last_at_the_end_of_fit(clock: list[float]) -> None:
    clock[1] = 0.0  # free pictures: only the cap holds them back
    writer = ImageWriter()
    board = panels.TensorBoardPanels(
        [writer], desk_every_n_logs=1, max_pictures=4, clock=lambda: clock[0], first_pair_s=0.0
    )
    for step in range(100):
        clock[0] += 1.0
        board.on_log(small_report(step), step)
    board.on_fit_end([small_report(99)], 99, None, desk=small_report(99))
    assert [step for _, step in writer.images] == [0, 1, 2, 99]
    assert board.pictures == 3 and board.skipped == 97


def test_the_pictures_are_spread_over_a_fit_of_known_length(clock: list[float]) -> None:
    clock[1] = 0.0
    writer = ImageWriter()
    board = panels.TensorBoardPanels(
        [writer], desk_every_n_logs=1, max_pictures=11, planned_logs=1000, clock=lambda: clock[0], first_pair_s=0.0
    )
    for step in range(1000):
        clock[0] += 1.0
        board.on_log(small_report(step), step)
    assert [step for _, step in writer.images] == list(range(0, 1000, 100))  # ten, one kept for the end


@pytest.mark.parametrize(
    ("name", "value", "accepts"),
    [
        ("max_drawing_share", 0, "a number in (0, 1]"),
        ("max_drawing_share", 1.5, "a number in (0, 1]"),
        ("max_drawing_share", True, "a number in (0, 1]"),
        ("max_pictures", 0, "a positive int"),
        ("max_pictures", 2.0, "a positive int"),
        ("first_pair_s", -1, "a number of seconds, 0 or more"),
        ("first_pair_s", "0.3", "a number of seconds, 0 or more"),
    ],
)
def test_a_bad_picture_budget_is_refused_naming_the_argument(name: str, value: Any, accepts: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name} must be {accepts}, got {value!r}")):
        panels.TensorBoardPanels([], **{name: value})


def test_a_short_fit_logging_every_step_draws_only_the_end_of_fits_pictures(tmp_path) -> None:
    """Steps of milliseconds: any in-fit picture would take more than 2% of the fit, so only the summary's is drawn."""
    cb = MemoryTenantsCallback(desk_every_n_logs=1, print_summary=False)
    make_trainer([cb], steps=40, logger=TensorBoardLogger(tmp_path)).fit(Tiny(), tiny_loader(40))
    events = read_events(tmp_path)
    assert [image.step for image in events.Images(tag(DESK))] == [39]
    assert [image.step for image in events.Images("memtenants/timeline")] == [39]
    assert len(events.Scalars("memtenants/weights_MiB")) == 40


@pytest.mark.parametrize("root_dir", [True, False], ids=["default_root_dir", "unset"])
def test_without_a_logger_the_postmortem_goes_to_the_trainers_default_root_dir(tmp_path: Path, root_dir: bool) -> None:
    """``logger=False``: the trainer's ``default_root_dir``, which is the working directory unless set."""
    from lightning_memtenants.core.sources import TrackerSource

    work = tmp_path / "work"
    work.mkdir()
    options = {"default_root_dir": str(tmp_path / "root")} if root_dir else {}
    source = TrackerSource(scan=False, limit_bytes=900)  # the weights and the batch fit, the first output does not
    cb = MemoryTenantsCallback(memory_source=source, print_summary=False)
    with (
        contextlib.chdir(work),
        pytest.raises(torch.OutOfMemoryError, match="simulated device"),
        pytest.warns(match="postmortem written"),
    ):
        make_trainer([cb], steps=2, logger=False, **options).fit(Tiny(), tiny_loader(2))
    expected = (tmp_path / "root" if root_dir else work) / "memtenants_oom.json"
    assert cb.postmortem_path == expected
    assert json.loads(expected.read_text())["phase"] == "forward"
    assert (expected.parent / "memtenants_oom.txt").is_file()
