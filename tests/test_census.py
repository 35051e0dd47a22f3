from __future__ import annotations

import torch
from conftest import SEED_SAVED_PER_SAMPLE, SEED_WEIGHTS
from seed_mlp import seed_model
from torch import nn
from torch._subclasses import FakeTensorMode

from lightning_memtenants.core.census import ActivationTracker, take_census
from lightning_memtenants.core.storage import storage_key, unique_storage_bytes


def test_views_and_shared_storages_count_once() -> None:
    base = torch.zeros(10, 10)
    seen: set[int] = set()
    assert unique_storage_bytes([base, base[2:5], base.t(), base.view(100)], seen) == 400
    assert unique_storage_bytes([base[0], torch.zeros(3, dtype=torch.float64)], seen) == 24


def test_storage_key_works_on_fake_tensors_where_data_ptr_is_zero() -> None:
    with FakeTensorMode():
        a, b = torch.empty(4), torch.empty(8)
        assert storage_key(a) != storage_key(b)
        assert storage_key(a) == storage_key(a[1:])
        assert unique_storage_bytes([a, a[1:], b], set()) == 48


def test_seed_model_weights_and_gradients_exact() -> None:
    model = seed_model()
    assert take_census(model) == {"weights": SEED_WEIGHTS, "gradients": 0, "optimizer_state": 0, "activations": 0}
    model(torch.randn(2, 1024)).sum().backward()
    assert take_census(model)["gradients"] == SEED_WEIGHTS


def test_tied_weights_counted_once() -> None:
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100, bias=False))
    model[1].weight = model[0].weight
    assert take_census(model)["weights"] == 100 * 16 * 4


def test_buffers_are_weights() -> None:
    model = nn.BatchNorm1d(8)
    # weight, bias, running_mean, running_var (fp32) and num_batches_tracked (int64)
    assert take_census(model)["weights"] == 4 * 8 * 4 + 8


def test_activations_are_the_unique_saved_storages_minus_weights_and_batch() -> None:
    torch.manual_seed(0)
    model = seed_model()
    batch = 48
    x = torch.randn(batch, 1024)
    tracker = ActivationTracker()
    tracker.ignore([x])
    loss = model(x).pow(2).mean()
    tracker.observe(loss)
    assert take_census(model, activations=tracker)["activations"] == batch * SEED_SAVED_PER_SAMPLE
    loss.backward()
    del loss
    assert take_census(model, activations=tracker)["activations"] == 0


def test_activations_include_the_batch_when_not_ignored() -> None:
    model = nn.Linear(16, 8)
    x = torch.randn(5, 16)
    tracker = ActivationTracker()
    out = model(x)  # addmm saves x and a view of the weight
    tracker.observe(out)
    assert take_census(model, activations=tracker)["activations"] == 5 * 16 * 4
    del out


def test_activation_tracker_does_not_change_numerics_or_keep_tensors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    tracker = ActivationTracker()
    tracker.ignore([x])
    out = model(x)
    tracker.observe(out)
    hidden = torch.utils.weak.WeakTensorKeyDictionary()
    hidden[out] = 1
    out.sum().backward()
    del out
    assert len(hidden) == 0
    assert take_census(model, activations=tracker)["activations"] == 0
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))


def test_a_graph_that_cannot_be_read_is_recorded_not_raised() -> None:
    tracker = ActivationTracker()

    class Odd(torch.Tensor):
        def untyped_storage(self):  # type: ignore[override]
            raise RuntimeError("no storage here")

    x = torch.randn(3, requires_grad=True)
    y = (x * 2).as_subclass(Odd)
    z = (y * y).sum()
    tracker.observe(z)  # MulBackward0 saved y, whose storage cannot be read
    z.backward()
    assert isinstance(tracker.error, RuntimeError) and str(tracker.error) == "no storage here"
    tracker.error = None  # its traceback's frames hold y (and the tracker): a cycle that would outlive the test


def test_a_saved_wrapper_subclass_counts_as_the_tensors_it_wraps() -> None:
    """An ``AsyncCollectiveTensor`` (tensor parallelism's lazy wait) holds no memory of its own, only what it wraps."""
    from torch.testing._internal.two_tensor import TwoTensor

    model = nn.Linear(8, 8, bias=False)
    x = TwoTensor(torch.randn(3, 8), torch.randn(3, 8))
    tracker = ActivationTracker()
    out = model(x)  # mm saves the input: the wrapper, which holds two 3 x 8 fp32 tensors
    tracker.observe(out)
    assert take_census(model, activations=tracker)["activations"] == 2 * 3 * 8 * 4
    del out
