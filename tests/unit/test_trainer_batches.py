"""The trainer's batches and metrics: device moves keep each container's type; metric sums stay on the device."""

from __future__ import annotations

import math
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from lockstep.errors import ConfigError
from lockstep.trainer.reporting.metrics import MetricBuffer
from lockstep.trainer.run.batches import batch_len, split_batch, to_device
from tests.helpers import HostCopyCounter

Pair = namedtuple("Pair", ["image", "label"])
META = torch.device("meta")  # a real device move that runs without a GPU: every moved tensor reports it


def test_a_namedtuple_batch_stays_that_namedtuple_and_every_tensor_moves() -> None:
    batch = Pair(image=torch.zeros(4, 3), label=torch.arange(4))
    moved = to_device(batch, META)
    assert type(moved) is Pair  # the old move rebuilt namedtuples as plain tuples
    assert moved.image.device == META and moved.label.device == META
    assert moved.image.shape == (4, 3) and moved.label.dtype == torch.int64
    assert batch.image.device.type == "cpu"  # the batch itself is left as it was


def test_a_dict_batch_moves_with_its_nests_and_non_tensor_leaves() -> None:
    batch: dict[str, Any] = {
        "input_ids": torch.ones(2, 5, dtype=torch.long),
        "extra": OrderedDict(
            mask=torch.ones(2, 5, dtype=torch.bool), weights=[torch.ones(2), torch.zeros(2)]
        ),
        "names": ["a", "b"],
        "scale": 0.5,
    }
    moved = to_device((batch, torch.zeros(2)), META)
    assert type(moved) is tuple and type(moved[0]) is dict and type(moved[0]["extra"]) is OrderedDict
    assert list(moved[0]["extra"]) == ["mask", "weights"] and type(moved[0]["extra"]["weights"]) is list
    tensors = [moved[0]["input_ids"], moved[0]["extra"]["mask"], *moved[0]["extra"]["weights"], moved[1]]
    assert all(t.device == META for t in tensors)  # the old move left every dict's tensors on the CPU
    assert moved[0]["names"] == ["a", "b"] and moved[0]["scale"] == 0.5


@pytest.mark.gpu
def test_pinned_batches_are_copied_without_blocking() -> None:
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    batch = {"x": torch.ones(8).pin_memory(), "y": torch.ones(8)}
    moved = to_device(batch, torch.device("cuda"))
    torch.cuda.synchronize()
    assert all(t.is_cuda for t in moved.values()) and float(moved["x"].sum()) == 8.0


def test_batches_split_into_inputs_and_targets_and_count_their_samples() -> None:
    inputs, targets = split_batch(
        Pair(torch.zeros(6, 2), {"label": torch.arange(6), "weight": torch.ones(6)})
    )
    assert batch_len(targets) == 6  # the first dimension, not the number of keys
    assert batch_len(torch.zeros(3, 2)) == 3 and batch_len([1, 2, 3, 4]) == 4
    with pytest.raises(ConfigError, match=r"a pair \(inputs, targets\), got a dict of 3"):
        split_batch({"x": torch.zeros(2), "y": torch.zeros(2), "z": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"got a Tensor"):
        split_batch(torch.zeros(2, 2))


def test_metric_sums_stay_on_the_device_until_reduce_copies_them_once() -> None:
    HostCopyCounter.calls.clear()
    buffer = MetricBuffer()
    losses = [0.5, 0.25, 2.0]
    for index, loss in enumerate(losses):
        buffer.add({"loss": torch.tensor(loss).as_subclass(HostCopyCounter)}, 4 + index)
        buffer.add_sums({"correct": torch.tensor(index + 1).as_subclass(HostCopyCounter)}, 0)
    assert (
        HostCopyCounter.calls == []
    )  # no copy to the host per batch (the old buffer called .cpu() each time)
    assert buffer.count == 15
    means, count = buffer.reduce(["loss", "correct", "never_added"])
    assert HostCopyCounter.calls == ["tolist"]  # one packed copy for all the sums
    assert count == 15
    assert means["loss"] == pytest.approx((0.5 * 4 + 0.25 * 5 + 2.0 * 6) / 15, abs=0)
    assert means["correct"] == pytest.approx(6 / 15, abs=0) and means["never_added"] == 0.0
    empty_means, empty_count = buffer.reduce(["loss"])  # reduce resets the sums
    assert empty_count == 0 and math.isnan(empty_means["loss"])


def test_metric_sums_are_float64_tensors_on_the_values_device() -> None:
    buffer = MetricBuffer()
    buffer.add({"loss": torch.tensor(1.5, dtype=torch.bfloat16, device=META)}, 2)
    total = buffer._sums["loss"]
    assert isinstance(total, torch.Tensor) and total.device == META and total.dtype == torch.float64
