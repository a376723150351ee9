"""A filter attached late, and a flush forgotten: both said, never silent.

* **late attachment**: a raw Gymnasium loop extends a plain buffer for a
  while, then ``rb.append_transform(filt)``: the rows already stored stay
  dirty, which the filter's first write says (naming
  ``cleanbuf.clean(rb)``); a buffer holding a collector's ``[T]``-step
  chunks cannot take the filter's rows at all, which it refuses before
  TorchRL's own batch-size error.
* **forgotten flush**: the README's ``Collector(..., replay_buffer=rb)``
  pattern without ``filt.flush(rb)``: the collector keeps the buffer and
  the filter alive, so no garbage-collection warning comes; the held rows
  are said at interpreter exit (a subprocess; the warning reaches stderr).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import gymnasium as gym
import pytest
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from tests.loops import ENVS, run_loop
from tests.oracle import collect, make_env

E = 4


def _loop_rows(steps: int) -> list:
    name, kwargs, policy = ENVS["CartPole-terminates"]
    venv, rows = run_loop(name, kwargs, policy, E, steps, gym.vector.AutoresetMode.NEXT_STEP)
    venv.close()
    return rows


def _attached_late():
    """A raw loop writes 60 steps into a plain buffer, then the filter is attached."""
    rows = _loop_rows(80)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    for td in rows[:60]:
        rb.extend(td)
    assert (rb[:]["next", "reward"] == 0).any(), "precondition: reset rows stored"
    filt = cleanbuf.AutoresetFilter("next_step", layout="step")
    rb.append_transform(filt)
    with pytest.warns(cleanbuf.CleanbufWarning, match=r"already held 240 row\(s\)") as seen:
        rb.extend(rows[60])
    message = str(seen[0].message)
    assert "rows = cleanbuf.clean(rb[:240], " in message and "append_transform" in message
    # (the seam: an env's first row through the filter may be the reset row of a done row
    # stored before it, which neither the filter nor that clean() sees)
    assert "the first row the filter stores of that env is its reset row" in message
    assert seen[0].filename == __file__, "the warning names the user's line"
    with warnings.catch_warnings():
        warnings.simplefilter("error", cleanbuf.CleanbufWarning)
        for td in rows[61:]:  # said once, at the first write
            rb.extend(td)
    filt.flush(rb)
    assert filt.stats["rows_in"] == 20 * E
    return rb, rows, message


def test_a_filter_attached_to_a_buffer_holding_rows_warns():
    """Bug caught: ``rb.append_transform(filt)`` after 60 steps of a raw loop
    left the 240 rows already stored dirty (reset rows in them) without a
    word. Now the first write warns, counting them and naming the call
    that cleans them; the rows written after it are cleaned.
    """
    _attached_late()


def test_the_late_attachment_fix_runs_as_printed():
    """Bug caught: after ``rb.append_transform(filt)`` mid-collection the
    warning said ``Clean them with rows = cleanbuf.clean(rb)``, which raised
    ``InputError <a temporary directory>/dump: cannot tell which env each
    row came from ... --layout ...`` (the buffer mixes rows written before
    and after the filter), and ``layout="flat"``, ``envs=8`` or
    ``"time_first"`` gave the same. Now the fix names the rows left dirty,
    runs as printed, and gives the explicit-reset run's rows (the raw loop
    stores its terminal observations, so nothing is lost); ``clean(rb)`` of
    the mixed buffer says why in Python terms, with the same fix, never a
    temporary path nor a command-line flag; and a Python caller's
    cannot-tell error names Python options, never the dump it read.
    """
    rb, rows, message = _attached_late()
    fix = re.search(r"(rows = cleanbuf\.clean\(rb\[:240\], layout=\"flat\"\))", message)
    assert fix, message
    scope = {"cleanbuf": cleanbuf, "rb": rb}
    exec(fix[1], scope)
    cleaned = scope["rows"]
    truth = _explicit_reset_rows(60)
    for e in range(E):  # per env, the cleaned rows: the explicit-reset run's first ones
        got = cleaned[cleaned["env_id"] == e]
        want = truth[:, e][: len(got)]
        assert len(got) >= 50
        for key in (("next", "observation"), "observation", ("next", "reward"), ("next", "done")):
            assert (got[key] == want[key]).all(), (e, key)
    for options in ({}, {"layout": "flat"}, {"layout": "flat", "envs": E}):
        with pytest.raises(cleanbuf.InputError) as err:
            cleanbuf.clean(rb, **options)
        said = str(err.value)
        assert "240 row(s) written before its AutoresetFilter was attached" in said, said
        assert "--" not in said and "/tmp" not in said and "dump" not in said, said
        assert fix[1] in said, said  # the same fix, which ran above


def test_a_python_caller_s_layout_error_names_python_options():
    """Bug caught: ``cleanbuf.clean(rb)`` of rows that do not chain said
    ``<a temporary directory>/dump: ... --layout ...``: a path the user
    never made, and flags a Python caller cannot pass.
    """
    import torch

    rows = torch.cat(_loop_rows(30))
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))]
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    rb.extend(rows.exclude("env_id"))
    with pytest.raises(cleanbuf.InputError) as err:
        cleanbuf.clean(rb)
    said = str(err.value)
    assert said.startswith("ReplayBuffer(LazyTensorStorage(1000)): cannot tell"), said
    assert "--" not in said and "/tmp" not in said and "dump" not in said, said
    assert "layout=" in said or "stream_key=" in said, said


def _explicit_reset_rows(steps: int):
    """The same raw loop with explicit resets (the oracle), ``[T, E]``."""
    import torch

    name, kwargs, policy = ENVS["CartPole-terminates"]
    venv, rows = run_loop(name, kwargs, policy, E, steps, gym.vector.AutoresetMode.DISABLED)
    venv.close()
    return torch.stack(rows, 0)


def test_the_list_error_fix_runs_as_printed():
    """Bug caught: ``rb.extend([td, td])`` said ``Fix: wrap it
    (tensordict.TensorDict(data, batch_size=[E, T]))``, which fails inside
    tensordict for a list; then its ``torch.stack(data, dim=1)`` failed for
    a filter built with ``layout="step"`` (or ``"time_first"``). Now the
    fix fits what the list holds and the filter's layout, and each runs as
    printed, storing what the filter stores from the same rows written one
    step at a time.
    """
    import torch

    steps = _loop_rows(40)

    def buffer(layout=None):
        filt = cleanbuf.AutoresetFilter("next_step", layout=layout)
        return ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt), filt

    want_rb, want_filt = buffer("step")
    for td in steps:
        want_rb.extend(td)
    want_filt.flush(want_rb)
    want = want_rb[: len(want_rb)]
    pattern = (r"(rb\.extend\(torch\.\w+\(data, dim=-?\d\)\)|for td in data: "
               r"rb\.extend\(td\)|for td in data: \[rb\.extend\(step\) for step in "
               r"td\.unbind\(1\)\])")  # fmt: skip
    for layout in (None, "time_last", "time_first", "step"):
        dim = 0 if layout == "time_first" else 1
        batches = [torch.stack(steps[:20], dim), torch.stack(steps[20:], dim)]
        for data in (steps, batches):
            rb, filt = buffer(layout)
            with pytest.raises(cleanbuf.InputError) as err:
                rb.extend(data)
            fixes = re.findall(pattern, str(err.value))
            assert fixes and "Nothing was written" in str(err.value), str(err.value)
            assert len(rb) == 0
            for fix in fixes:
                rb, filt = buffer(layout)
                exec(fix, {"rb": rb, "data": data, "torch": torch})
                filt.flush(rb)
                got = rb[: len(rb)]
                assert len(got) == len(want), (layout, fix)
                for e in range(E):
                    a, b = got[got["env_id"] == e], want[want["env_id"] == e]
                    assert (a["next", "observation"] == b["next", "observation"]).all(), fix

    from tensordict import TensorDict

    batch = torch.stack(steps, 1)
    data = {"observation": batch["observation"], "next": batch["next"].to_dict()}
    rb, _ = buffer()
    with pytest.raises(cleanbuf.InputError) as err:
        rb.extend(data)
    fix = re.search(r"(rb\.extend\(tensordict\.TensorDict\(data, batch_size=\[4, 40\]\)\))",
                    str(err.value))  # fmt: skip
    assert fix, str(err.value)
    import tensordict

    exec(fix[1], {"rb": rb, "data": data, "tensordict": tensordict})
    assert len(rb) > 0 and isinstance(rb[:1], TensorDict)


def test_a_filter_attached_to_a_buffer_of_collector_chunks_is_refused():
    """Bug caught: a filter appended to a buffer that a
    ``Collector(replay_buffer=rb)`` filled with ``[T]``-step chunks: the next
    extend failed with TorchRL's own RuntimeError about batch sizes. Now a
    LayoutError names the chunks and ``cleanbuf.clean(rb)``, and nothing is
    written.
    """
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    collect(make_env("CartPole-v1", E, trackers=False), E * 16, E * 32, replay_buffer=rb)
    batch = collect(make_env("CartPole-v1", E, trackers=False), E * 16, E * 16)[0]
    stored = len(rb)
    rb.append_transform(cleanbuf.AutoresetFilter("next_step", joint_reset=True))
    with pytest.raises(cleanbuf.LayoutError, match=r"slot\(s\) of \[16\] steps") as info:
        rb.extend(batch)
    assert "cleanbuf.clean(rb)" in str(info.value) and "Nothing was written" in str(info.value)
    assert len(rb) == stored


def test_a_filter_restored_with_its_buffer_does_not_warn(tmp_path):
    """A filter's state restored (``load_state_dict``) with its buffer's rows
    (``rb.loads``) has filled that buffer itself. Bug caught (by the late
    attachment check): a warning on such a restore, where nothing is dirty.
    """
    rows = _loop_rows(40)
    filt = cleanbuf.AutoresetFilter("next_step", layout="step")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    for td in rows[:20]:
        rb.extend(td)
    rb.dumps(str(tmp_path / "rb"))
    again = cleanbuf.AutoresetFilter("next_step", layout="step")
    again.load_state_dict(filt.state_dict())
    filt.flush()  # (the first filter's held rows: not this test's)
    rb2 = ReplayBuffer(storage=LazyTensorStorage(1000), transform=again)
    rb2.loads(str(tmp_path / "rb"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", cleanbuf.CleanbufWarning)
        for td in rows[20:]:
            rb2.extend(td)
    again.flush(rb2)
    assert again.stats["rows_in"] == 40 * E


FORGOTTEN = """
import sys
sys.path.insert(0, {root!r})
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv

from cleanbuf import AutoresetFilter
from tests.rollout_helpers import mixed_policy

if __name__ == "__main__":
    env = GymEnv("CartPole-v1", num_envs=4)
    env.set_seed(0)
    filt = AutoresetFilter.for_env(env)
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    collector = Collector(env, mixed_policy, frames_per_batch=40, total_frames=40,
                          replay_buffer=rb)
    for _ in collector:
        pass
    collector.shutdown()
    {flush}
    print("held", filt.stats["rows_held"], flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("flush", [False, True], ids=["forgotten", "flushed"])
def test_a_forgotten_flush_with_a_collector_is_said_at_exit(tmp_path, flush):
    """The README's ``Collector(..., replay_buffer=rb)`` pattern, envs 2 and 3
    ending on the batch's last step (their done rows held for their reset
    rows). Bug caught: without ``filt.flush(rb)`` those rows were never
    stored and no warning came, even at exit (the collector keeps the
    filter alive). Now stderr says so at exit; with the flush, nothing.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "forgot.py"
    script.write_text(
        textwrap.dedent(FORGOTTEN).format(root=root, flush="filt.flush(rb)" if flush else "pass")
    )
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    if flush:
        assert "held 0" in done.stdout
        assert "never stored" not in done.stderr, done.stderr
    else:
        assert "held 2" in done.stdout, done.stdout  # precondition: envs 2 and 3 held
        assert "still held 2 row(s) at interpreter exit" in done.stderr, done.stderr
        assert "filt.flush(rb)" in done.stderr


def test_the_exit_check_says_each_filter_once():
    """Bug caught (by the exit check): a filter garbage-collected after the
    exit check said its held rows a second time.
    """
    from cleanbuf.online import _at_exit

    filt = cleanbuf.AutoresetFilter("next_step", layout="step")
    rows = _loop_rows(11)  # env 0 ends on step 10 ...
    rows[-1]["next", "observation"][0] = 0  # ... its terminal obs zero-filled as TorchRL does
    for td in rows:
        filt(td)
    assert filt.stats["rows_held"] > 0
    with pytest.warns(cleanbuf.CleanbufWarning, match="at interpreter exit"):
        _at_exit._say_held()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cleanbuf.CleanbufWarning)
        _at_exit._say_held()
        del filt
        import gc

        gc.collect()


def _collected_through_the_filter(env, **flush_options):
    """The README's pattern: ``Collector(env, ..., replay_buffer=rb)``, 7 batches
    of ``[4, 16]``, then ``filt.flush(rb, **flush_options)``; the warnings it gave.
    """
    filt = cleanbuf.AutoresetFilter.for_env(env)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    collect(env, 64, 448, replay_buffer=rb)
    held = filt.stats["rows_held"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filt.flush(rb, **flush_options)
    seen = [w for w in seen if issubclass(w.category, cleanbuf.CleanbufWarning)]
    return rb, filt, held, seen


def test_a_flush_that_stores_lost_terminal_observations_warns():
    """TorchRL's ``GymEnv("CartPole-v1", num_envs=4)`` (seed 0, push left):
    envs 1 and 2 end on the 448th frame's step, alone (no joint reset), so
    their done rows (next observation zero-filled by TorchRL) are held for
    reset rows that are never collected. Bug caught: ``filt.flush(rb)``
    stored them with a NaN next observation without a word, while the same
    loss from a joint reset warns. Now it warns, with the count, at the
    user's line; the fixes it prints run as printed: ``filt.flush(rb,
    on_lost_terminal_obs='drop')`` stores no such row (and says nothing),
    ``cleanbuf.lossless_gym_env(name, num_envs)`` loses none.
    """
    env = make_env("CartPole-v1", E)
    try:
        rb, filt, held, seen = _collected_through_the_filter(env)
    finally:
        env.close()
    lost = filt.stats["terminal_obs_missing"]
    assert held == 2 and lost == 2, (held, filt.stats)  # precondition: two held done rows
    assert len(seen) == 1, [str(w.message) for w in seen]
    message = str(seen[0].message)
    assert message.startswith("2 row(s) stored by filt.flush(rb) lost their terminal"), message
    assert seen[0].filename == __file__, "the warning names the user's line"
    rows = rb[: len(rb)]
    nan = rows["next", "observation"].isnan().any(-1)
    assert int(nan.sum()) == 2 and rows["next", "done"][nan].all()

    assert "filt.flush(rb, on_lost_terminal_obs='drop')" in message
    env = make_env("CartPole-v1", E)
    try:
        rb, filt, _, seen = _collected_through_the_filter(env, on_lost_terminal_obs="drop")
    finally:
        env.close()
    assert not seen and filt.stats["lost_rows_dropped"] == 2
    assert not rb[: len(rb)]["next", "observation"].isnan().any()

    assert "cleanbuf.lossless_gym_env(name, num_envs)" in message
    env = cleanbuf.lossless_gym_env("CartPole-v1", num_envs=E)
    env.set_seed(0)
    try:
        rb, filt, _, seen = _collected_through_the_filter(env)
    finally:
        env.close()
    assert not seen and filt.stats["terminal_obs_missing"] == 0
    assert not rb[: len(rb)]["next", "observation"].isnan().any()
