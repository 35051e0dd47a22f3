from __future__ import annotations

import gc

import torch
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_memtenants.core.tracker import LiveTensorTracker

F32 = 4


def fresh() -> LiveTensorTracker:
    return LiveTensorTracker(scan=False)  # count only what the test creates


def test_allocations_and_frees_exact() -> None:
    with fresh() as tracker:
        a = torch.ones(1000)
        b = torch.ones(500)
        assert tracker.read() == (1500 * F32, 1500 * F32)
        del a
        c = torch.ones(200)
        assert tracker.read() == (700 * F32, 1500 * F32)
        del b, c
        assert tracker.read() == (0, 700 * F32)
    assert _get_current_dispatch_mode() is None


def test_views_and_in_place_ops_allocate_nothing() -> None:
    with fresh() as tracker:
        a = torch.zeros(64, 64)
        tracker.read()
        v = a.t()[3:10]
        a.add_(1.0)
        v.mul_(2.0)
        w = a.view(-1)
        assert tracker.read() == (64 * 64 * F32, 64 * 64 * F32)
        assert w.shape == (4096,)


def test_storage_freed_inside_a_window_still_sets_its_peak() -> None:
    with fresh() as tracker:
        keep = torch.zeros(100)
        tracker.read()
        temporary = torch.zeros(10_000)
        del temporary
        assert tracker.read() == (100 * F32, 10_100 * F32)
        assert tracker.peak_bytes == 10_100 * F32
        del keep


def test_tensors_created_under_no_grad_and_by_backward() -> None:
    weight = torch.ones(8, 8, requires_grad=True)
    with fresh() as tracker:
        with torch.no_grad():
            buffer = torch.zeros(8, 8)
        assert tracker.current_bytes == 64 * F32
        loss = (torch.ones(4, 8) @ weight).sum()  # mm saves its input; sum frees the product
        assert tracker.current_bytes == (64 + 32) * F32 + F32
        assert tracker.peak_bytes == (64 + 32 + 32) * F32 + F32
        # backward makes the seed gradient of loss (1 float) and weight's gradient (64 floats) while mm's saved
        # input is still alive, then frees the seed and the saved input
        loss.backward()
        assert tracker.current_bytes == (64 + 64) * F32 + F32  # buffer, weight.grad and loss
        assert tracker.peak_bytes == (64 + 32 + 1) * F32 + (1 + 64) * F32
        del buffer
    assert weight.grad.shape == (8, 8)


def scanned_bytes() -> int:
    """What a scanning tracker finds alive at its start: every CPU tensor in the process."""
    tracker = LiveTensorTracker()
    tracker.start()
    found = tracker.current_bytes
    tracker.stop()
    return found


def test_existing_tensors_are_found_by_the_scan_and_roots() -> None:
    gc.collect()  # what earlier tests left in reference cycles must not be freed between the two scans
    before = scanned_bytes()
    existing = torch.zeros(12_345)
    assert scanned_bytes() == before + 12_345 * F32
    roots_only = LiveTensorTracker(scan=False)
    roots_only.start(roots=[existing, existing[5:]])
    assert roots_only.current_bytes == 12_345 * F32
    roots_only.stop()
    assert roots_only.current_bytes == 0 and not roots_only.active


def test_pause_keeps_following_frees() -> None:
    tracker = fresh()
    tracker.start()
    a = torch.zeros(300)
    tracker.pause()
    assert _get_current_dispatch_mode() is None
    b = torch.zeros(1000)  # unseen while paused
    del a
    assert tracker.current_bytes == 0
    del b


def test_fake_tensors_are_tracked_by_storage_identity_in_a_prediction() -> None:
    with FakeTensorMode():
        tracker = LiveTensorTracker(scan=False, count_fake=True)
        with tracker:
            a = torch.empty(256, 256)
            b = a[:128]
            c = torch.empty(1000, dtype=torch.float64)
            assert tracker.current_bytes == 256 * 256 * F32 + 8000
            del a, b
            assert tracker.current_bytes == 8000
            del c
            assert tracker.read() == (0, 256 * 256 * F32 + 8000)


def test_fake_and_meta_tensors_are_never_memory_in_a_real_run() -> None:
    from lightning_memtenants.core.tracker import _live_tensors

    # inductor leaves FakeTensors alive after a cold compile; their .device says cpu
    with FakeTensorMode():
        kept = torch.empty(1024, 1024)
    meta = torch.empty(2048, device="meta")
    assert kept.device.type == "cpu"
    assert not any(t is kept for t in _live_tensors())  # the first tracked step's gc scan skips it
    tracker = LiveTensorTracker(scan=False)
    tracker.start(roots=[kept, meta])
    real = torch.ones(10)
    with FakeTensorMode():
        fake = torch.empty(4096)  # made under the tracker's mode too
    assert tracker.read() == (40, 40)
    tracker.stop()
    del kept, meta, fake, real


def test_other_devices_are_ignored() -> None:
    tracker = LiveTensorTracker("cuda", scan=False)
    with tracker:
        a = torch.zeros(100)
    assert tracker.current_bytes == 0
    del a


def test_storage_resizes_are_followed_and_the_hook_is_removed() -> None:
    # FSDP2 frees a gathered parameter with storage.resize_(0) and re-grows it, outside the dispatcher
    tracker = fresh()
    tracker.start()
    gathered = torch.ones(256)
    tracker.read()
    gathered.untyped_storage().resize_(0)
    assert tracker.read() == (0, 256 * F32)
    gathered.untyped_storage().resize_(512 * F32)
    assert tracker.read() == (512 * F32, 512 * F32)
    tracker.pause()
    gathered.untyped_storage().resize_(0)  # unseen while paused; the next start re-reads every size
    tracker.start()
    assert tracker.read() == (0, 0)
    tracker.stop()
    assert "resize_" not in torch.UntypedStorage.__dict__


def test_a_user_mode_entered_above_ours_stays_and_the_stack_is_left_as_without_us() -> None:
    import torch.utils._python_dispatch as dispatch
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

    class Counting(TorchDispatchMode):  # a user's mode, entered while ours runs and left after we stopped
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    def flags() -> tuple[bool, bool, bool]:
        return (
            dispatch._is_in_torch_dispatch_mode,
            dispatch._is_in_non_infra_torch_dispatch_mode,
            dispatch._is_in_any_mode_without_ignore_compile_internals,
        )

    before = flags()
    tracker = fresh()
    tracker.start()
    user = Counting()
    user.__enter__()
    tracker.pause()  # ours leaves from under the user's mode
    assert _get_current_dispatch_mode() is user
    assert flags() == (True, True, True)  # only the user's mode is active now
    torch.ones(3) * 2
    assert Counting.calls == 2
    user.__exit__(None, None, None)
    assert _get_current_dispatch_mode() is None and flags() == before
    tracker.stop()


def test_a_live_tensor_whose_storage_cannot_be_read_is_left_out_not_fatal() -> None:
    class Odd(torch.Tensor):
        def untyped_storage(self):  # type: ignore[override]
            raise RuntimeError("no storage here")

    odd = torch.randn(3).as_subclass(Odd)
    tracker = LiveTensorTracker()
    try:
        tracker.start()
        assert tracker.unreadable == 1 and tracker.error is None
        start = tracker.current_bytes
        plain = torch.empty(250)
        assert tracker.current_bytes == start + 1000
        before = tracker.current_bytes
        del plain
        assert tracker.current_bytes == before - 1000  # the tracker goes on following the process's tensors
    finally:
        tracker.stop()
    del odd


def test_a_rewrite_hook_changes_what_an_operator_returns_before_it_is_counted() -> None:
    """The dry run's corrections of fake kernels: the tracker counts, and the caller gets, the rewritten outputs."""
    seen = []

    def widen(func, args, kwargs, out):  # type: ignore[no-untyped-def]
        seen.append(func._overloadpacket.__name__)
        if func._overloadpacket.__name__ == "mul" and isinstance(out, torch.Tensor):
            return torch.empty(out.shape, dtype=torch.float64)  # 8 bytes an element where mul made 4
        return out

    tracker = LiveTensorTracker("cpu", scan=False)  # only what the operators below make
    tracker.rewrite = widen
    x = torch.ones(16)
    with tracker:
        y = x * 2
        z = x + 1
        # y as rewritten (16 float64), z as made (16 float32); mul's own float32 output was never counted
        assert tracker.current_bytes == tracker.peak_bytes == 16 * 8 + 16 * 4
    assert y.dtype == torch.float64 and z.dtype == torch.float32
    assert "mul" in seen and "add" in seen
    del y, z


def test_the_short_path_counts_what_the_general_path_counts() -> None:
    """A real CPU run's operators go through ``seen``; a dry run's through ``add``: both give the same figures."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 16)

    def step(short: bool) -> tuple[int, int, int]:
        tracker = LiveTensorTracker(scan=False)
        tracker.start([*model.parameters(), x])
        assert tracker.plain  # a CPU tracker with nothing to rewrite, record or limit
        tracker.plain = short
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker.pause()
        return tracker.peak_bytes, tracker.current_bytes, len(tracker._live)

    step(True)  # Adam's state exists from here on: both steps below are alike
    short, general = step(True), step(False)
    assert short == general
    weights = (16 * 32 + 32 + 32 * 4 + 4) * F32
    # the weights and the batch (the roots), and Adam's state (two moments and a 0-d step per parameter): not a
    # root, but its in-place updates return it, and an operator's output is counted; zero_grad freed the gradients
    assert short[1] == weights + 8 * 16 * F32 + 2 * weights + 4 * F32
    assert short[0] > short[1]
