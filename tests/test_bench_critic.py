"""``bench/critic.py`` on a small scale: the three versions of one rollout, fitted.

The bench's conclusions rest on two facts this checks on CartPole, one
seed, 3 fitting rounds (about 10 s of CPU): the repaired rollout's valid
rows are the explicit-reset run's rows (``collect`` raises otherwise), and
a critic fitted on them is the oracle's critic, while one fitted on the
rollout as TorchRL stores it is not.
"""

from __future__ import annotations

import torch


def test_repaired_rollout_fits_the_oracles_critic():
    """Bug caught: a repair that mis-stitches, mis-masks or leaves a reset row live.

    A wrong terminal observation changes the GAE targets of its episode;
    a reset row left valid teaches the critic that a fallen pole is worth a
    fresh start, as TorchRL's rows do; a wrong mask fits a reset row or
    skips a real one. Each moves the repaired critic toward TorchRL's and
    away from the oracle's (measured: 0.31 from the oracle's values on
    held-out states, against 1.20 for TorchRL's rows). A row that is not
    the oracle's makes ``collect`` raise before anything is fitted.
    """
    from bench.critic import TASKS, collect, fit_critic, truth

    torch.set_num_threads(1)
    task = TASKS["cartpole"]
    data, facts = collect(task, seed=0)
    assert facts["repair_stats"]["reset_rows_masked"] > 0  # the rollout has reset rows
    assert facts["episodes_terminated"] > 0 and facts["episodes_truncated"] > 0
    fitted = {variant: int(rows.sum()) for variant, (_, rows) in data.items()}
    assert fitted["cleanbuf"] == fitted["oracle"] < fitted["torchrl"]

    states = truth(task, 50_000, episodes=6)["states"]
    values = {}
    for variant, (td, rows) in data.items():
        critic = fit_critic(td, rows, task, seed=0, rounds=3)
        with torch.no_grad():
            values[variant] = critic.module(states).squeeze(-1)
    repaired = (values["cleanbuf"] - values["oracle"]).abs().mean()
    stored = (values["torchrl"] - values["oracle"]).abs().mean()
    assert repaired < 0.5 * stored, (float(repaired), float(stored))
