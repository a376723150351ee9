"""The filter inside a TorchRL replay buffer: add, extend, flush, Compose, state."""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys

import torch
from torchrl.data import LazyTensorStorage, ListStorage, ReplayBuffer
from torchrl.envs import Compose

from cleanbuf import AutoresetFilter
from tests.batches import next_step_batch


def test_add_one_row_at_a_time_equals_extend():
    """rb.add(row) of a single stream, one transition per call. Bugs caught:
    add() storing an [1]-batched element or a reset row, or losing the held
    done row between add() calls.
    """
    batch = next_step_batch(1, 30, 4)
    whole = AutoresetFilter("next_step")
    rb_whole = ReplayBuffer(storage=LazyTensorStorage(100), transform=whole)
    rb_whole.extend(batch)
    whole.flush(rb_whole)
    one = AutoresetFilter("next_step")
    rb_one = ReplayBuffer(storage=LazyTensorStorage(100), transform=one)
    for t in range(30):
        rb_one.add(batch[0, t])
    one.flush(rb_one)
    assert one.stats["reset_rows_dropped"] > 0
    assert len(rb_one) == len(rb_whole) == one.stats["rows_out"]
    a, b = rb_one[: len(rb_one)], rb_whole[: len(rb_whole)]
    assert (a == b).all()


def test_flush_writes_held_rows_once():
    """Bugs caught: held rows never reaching the buffer, or reaching it twice
    (flush going through the filter again, or a second flush repeating).
    """
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
    for seed in range(50):
        batch = next_step_batch(2, 12, seed)
        if batch["next", "done"][:, -1].any():
            break
    rb.extend(batch)
    held = filt.stats["rows_held"]
    assert held > 0 and len(rb) == filt.stats["rows_out"]
    filt.flush(rb)
    filt.flush(rb)
    assert (
        len(rb)
        == filt.stats["rows_out"]
        == filt.stats["rows_in"] - filt.stats["reset_rows_dropped"]
    )
    tail = rb[len(rb) - held : len(rb)]
    assert tail["next", "done"].all()
    # Collector data zero-fills the terminal observation: lost, NaN, counted.
    assert torch.isnan(tail["next", "observation"]).all()
    assert filt.stats["terminal_obs_missing"] == held


def test_reused_buffers_never_overwrite_rows_someone_holds():
    """Output buffers of large leaves are reused across calls. ListStorage
    keeps references to what it is given. Bug caught: a later call writing
    its rows into the memory of rows stored earlier (the pool must see that
    they are still referenced).
    """
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=ListStorage(10_000), transform=filt)
    both = next_step_batch(2, 80, 3)
    pixels = torch.arange(2 * 80, dtype=torch.float32).reshape(2, 80, 1, 1).expand(2, 80, 128, 128)
    both.set("pixels", pixels.clone())
    both.set(("next", "pixels"), pixels + 0.5)
    rb.extend(both[:, :40])
    first = torch.stack([rb[i] for i in range(len(rb))]).clone()
    assert first["pixels"].numel() * 4 >= 1 << 20  # large enough to be pooled
    rb.extend(both[:, 40:])
    again = torch.stack([rb[i] for i in range(len(first))])
    assert (again == first).all()


def test_output_declares_the_device_its_rows_are_on():
    """Collector batches come with ``device=None``; the filter's output says
    where its rows are, in the copying path, the zero-copy path and at a
    flush. Bug caught: an output without a device, which makes the storage
    run ``to()`` over every leaf before writing (a third of a MuJoCo-sized
    extend).
    """
    for seed in range(50):
        batch = next_step_batch(2, 12, seed)
        if batch["next", "done"][:, -1].any() and batch["next", "done"][:, :-2].any():
            break
    assert batch.device is None
    filt = AutoresetFilter("next_step")
    copied = filt.inv(batch)
    assert len(copied) < batch.numel() - filt.stats["rows_held"]  # rows were dropped
    quiet = batch[:, -1:].clone()
    quiet["next", "done"] = torch.zeros_like(quiet["next", "done"])
    quiet["next", "reward"] = torch.ones_like(quiet["next", "reward"])
    fresh = AutoresetFilter("next_step")
    passed = fresh.inv(quiet)
    assert passed["observation"].data_ptr() == quiet["observation"].data_ptr()  # zero-copy
    held = filt.flush()
    assert len(held) > 0
    for out in (copied, passed, held):
        assert out.device == torch.device("cpu")
        assert out["next"].device == torch.device("cpu")


def test_state_dict_via_replay_buffer_and_pickle():
    """Bugs caught: the carry state missing from rb.state_dict() (a restored
    buffer forgets the held rows and keeps a reset row), or the filter not
    pickling.
    """
    both = next_step_batch(3, 40, 5)
    ref = AutoresetFilter("next_step")
    ref_rb = ReplayBuffer(storage=LazyTensorStorage(200), transform=ref)
    ref_rb.extend(both[:, :20])
    ref_rb.extend(both[:, 20:])

    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(200), transform=filt)
    rb.extend(both[:, :20])
    assert filt.stats["rows_held"] or filt.stats["reset_rows_dropped"]
    saved = pickle.dumps(rb.state_dict())
    restored_filter = pickle.loads(pickle.dumps(AutoresetFilter("next_step")))
    rb2 = ReplayBuffer(storage=LazyTensorStorage(200), transform=restored_filter)
    rb2.load_state_dict(pickle.loads(saved))
    assert restored_filter.stats == filt.stats
    rb2.extend(both[:, 20:])
    assert len(rb2) == len(ref_rb)
    assert (rb2[: len(rb2)] == ref_rb[: len(ref_rb)]).all()


def test_inside_compose():
    """Bug caught: the filter only working as the sole transform."""
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=Compose(filt))
    rb.extend(next_step_batch(2, 12, 1))
    assert len(rb) == filt.stats["rows_out"] > 0 and filt.stats["reset_rows_dropped"] > 0


def test_add_path_raises_no_warning():
    """rb.add(row), one row per call, in a fresh process with warnings as
    errors (torch warns once per process, so an earlier test could hide
    it). Bug caught: torch's "NumPy array is not writable" warning from the
    shared read-only empty row index turned into a tensor.
    """
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from torchrl.data import LazyTensorStorage, ReplayBuffer\n"
        "from cleanbuf import AutoresetFilter\n"
        "from tests.batches import next_step_batch\n"
        "batch = next_step_batch(1, 30, 4)\n"
        "filt = AutoresetFilter('next_step')\n"
        "rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)\n"
        "for t in range(30):\n"
        "    rb.add(batch[0, t])\n"
        "assert filt.stats['reset_rows_dropped'] > 0\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
