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


def test_a_filter_attached_to_a_buffer_holding_rows_warns():
    """Bug caught: ``rb.append_transform(filt)`` after 60 steps of a raw loop
    left the 240 rows already stored dirty (reset rows in them) without a
    word. Now the first write warns, counting them and naming
    ``cleanbuf.clean(rb)``; the rows written after it are cleaned.
    """
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
    assert "cleanbuf.clean(rb)" in message and "append_transform" in message, message
    assert seen[0].filename == __file__, "the warning names the user's line"
    with warnings.catch_warnings():
        warnings.simplefilter("error", cleanbuf.CleanbufWarning)
        for td in rows[61:]:  # said once, at the first write
            rb.extend(td)
    filt.flush(rb)
    assert filt.stats["rows_in"] == 20 * E


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
