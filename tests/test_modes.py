"""Lost terminal observations, same-step final entries and observation-only rows."""

from __future__ import annotations

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter, clean
from tests.batches import assert_same_rows, next_step_batch


def _joint_batch():
    for seed in range(100):
        batch = next_step_batch(2, 30, seed, group=2)
        done = batch["next", "done"].squeeze(-1)
        if (done.all(0)[:-1]).any():  # a joint reset inside the batch
            return batch
    raise AssertionError("no joint reset")


def test_lost_terminal_observation_policies():
    """TorchRL's joint reset loses terminal observations. Bugs caught: 'drop'
    storing the rows anyway or not counting them, 'raise' writing part of the
    batch, 'keep' altering the producer's values, 'nan' marking rows other
    than the lost ones.
    """
    batch = _joint_batch()
    results = {}
    for policy in ("nan", "drop", "keep"):
        filt = AutoresetFilter("next_step", joint_reset=True, on_lost_terminal_obs=policy)
        rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
        rb.extend(batch)
        filt.flush(rb)
        results[policy] = (filt.stats, rb[: len(rb)])
    nan_stats, nan_rows = results["nan"]
    n_lost = nan_stats["terminal_obs_missing"]
    assert n_lost > 0
    assert int(torch.isnan(nan_rows["next", "observation"]).sum()) == n_lost
    drop_stats, drop_rows = results["drop"]
    assert drop_stats["lost_rows_dropped"] == n_lost
    assert len(drop_rows) == len(nan_rows) - n_lost
    assert not torch.isnan(drop_rows["next", "observation"]).any()
    keep_stats, keep_rows = results["keep"]
    assert len(keep_rows) == len(nan_rows)
    lost = torch.isnan(nan_rows["next", "observation"]).reshape(-1)
    assert (keep_rows["next", "observation"].reshape(-1)[lost] == 0).all()  # as zero-filled
    filt = AutoresetFilter("next_step", joint_reset=True, on_lost_terminal_obs="raise")
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
    with pytest.raises(Exception, match="on_lost_terminal_obs='raise'"):
        rb.extend(batch)
    assert len(rb) == 0 and filt.stats["rows_in"] == 0


def test_joint_key_on_flat_rows_cleans_as_time_aligned_batches():
    """Flat rows with an env id and a per-row joint flag (``joint_key``)
    clean as the same [E, T] batch does with ``joint_reset=True``. Bugs
    caught: the flag ignored on flat rows (the next episode's first row
    dropped as a reset row, or ResetRowError), the flag read on rows that
    are not done, rows of one env mixed with another's.
    """
    batch = _joint_batch()
    n_envs, steps = batch.batch_size
    batch.set("env", torch.arange(n_envs).unsqueeze(1).expand(n_envs, steps).clone())
    done = batch["next", "done"].squeeze(-1)
    batch.set("joint", done & done.all(0, keepdim=True))  # every env done on the step
    want, want_stats = clean(batch, joint_reset=True, return_stats=True)
    assert want_stats["terminal_obs_missing"] > 0 and want_stats["reset_rows_dropped"] > 0
    flat = batch.reshape(-1)
    got, got_stats = clean(flat, stream_key="env", joint_key="joint", return_stats=True)
    assert got_stats == want_stats
    for env in range(n_envs):
        assert_same_rows(got[got["env"] == env], want[want["env"] == env], f"env {env}")


def test_compact_keeps_observation_only_layout():
    """compact=True: the artifacts go, the layout stays observation-only.
    Bugs caught: next observations materialized anyway (memory doubled),
    rows held although nothing waits for a successor, reset rows kept.
    """
    batch = next_step_batch(2, 30, 6).exclude(("next", "observation"))
    filt = AutoresetFilter("next_step", observation_keys=["observation"], compact=True)
    out = filt.inv(batch)
    assert ("next", "observation") not in out.keys(True, True)
    assert filt.stats["rows_held"] == 0
    assert filt.stats["reset_rows_dropped"] > 0
    assert len(out) == filt.stats["rows_in"] - filt.stats["reset_rows_dropped"]
    assert (out["next", "reward"] != 0).all()


def test_final_observation_entry_stored_only_when_asked():
    """Bugs caught: the final-observation entry (a second copy of every
    observation) stored by default, or dropped when keep_final_obs=True.
    """
    from tests.batches import same_step_batch

    batch = same_step_batch(2, 12, 0)
    plain = AutoresetFilter("same_step").inv(batch)
    kept = AutoresetFilter("same_step", keep_final_obs=True).inv(batch)
    assert ("next", "final_obs") not in plain.keys(True, True)
    assert ("next", "_final_obs") not in plain.keys(True, True)
    assert ("next", "final_obs") in kept.keys(True, True)
    done = plain["next", "done"].reshape(-1)
    assert torch.equal(plain["next", "observation"][done], kept["next", "final_obs"][done])


def test_clean_same_step_and_observation_only():
    """clean() takes the same-step and observation-only options. Bugs caught:
    clean() ignoring mode='same_step' (done rows keep the reset observation)
    or not flushing the rows that wait for a successor.
    """
    from tests.batches import same_step_batch

    batch = same_step_batch(2, 12, 0)
    out = clean(batch, mode="same_step")
    done = out["next", "done"].reshape(-1)
    assert torch.equal(
        out["next", "observation"][done],
        batch["next", "final_obs"].reshape(-1, 1)[batch["next", "done"].reshape(-1)],
    )
    obs_only = clean(
        batch.exclude(("next", "observation")),
        mode="same_step",
        observation_keys=["observation"],
        on_lost_terminal_obs="nan",
    )
    assert len(obs_only) == batch.numel()
    # The last row of each stream has no successor, unless it is a done row
    # (its final observation is its next observation).
    waiting = int((~batch["next", "done"][:, -1]).sum())
    assert waiting > 0
    assert int(torch.isnan(obs_only["next", "observation"]).sum()) == waiting


def test_flush_same_step_observation_only_marks_unfinished_rows():
    """Same-step observation-only data: the last row of each stream waits for
    its successor; at a flush it never comes. Bug caught: the flush raising
    the same-step "no final observation" error for rows that are not done
    (or storing them with a next observation from nowhere).
    """
    from tests.batches import same_step_batch

    batch = same_step_batch(2, 12, 0).exclude(("next", "observation"))
    filt = AutoresetFilter("same_step", observation_keys=["observation"])
    filt.inv(batch)
    waiting = filt.stats["rows_held"]
    assert waiting > 0
    rows = filt.flush()
    assert len(rows) == waiting and not rows["next", "done"].any()
    assert torch.isnan(rows["next", "observation"]).all()
    assert filt.stats["next_obs_missing"] == waiting and filt.stats["terminal_obs_missing"] == 0
