"""CompactStorage: samples bitwise equal to a plain filtered buffer's, every key, every edge.

Two buffers take the same writes through two equal filters, one over
TorchRL's ``LazyTensorStorage``, one over ``cleanbuf.CompactStorage``; the
stored rows and the samples for the same indices must be equal bit for bit
(NaN and -0.0 included). Real loops are also checked against the
explicit-reset run.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import (
    PrioritizedSampler,
    RandomSampler,
    SliceSampler,
)
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter

from cleanbuf import AutoresetFilter, CompactStorage, LayoutError, StateError
from cleanbuf.online._compact import STREAM_KEY, rows_equal
from tests.batches import grid_td
from tests.loops import ENVS, run_loop
from tests.oracle import collect, compare_streams, make_env, streams_from_batches, streams_from_rows
from tests.reference import simulate

try:  # TorchRL's C++ extension (its sum trees); a build against another torch lacks it
    from torchrl._torchrl import SumSegmentTreeFp32 as _tree  # noqa: F401

    SAMPLERS = ["random", "prioritized", "slice"]
except ImportError:
    SAMPLERS = ["random", "slice"]
needs_trees = pytest.mark.skipif(
    "prioritized" not in SAMPLERS,
    reason="PrioritizedSampler needs torchrl's C++ extension, which does not load here",
)


def assert_bitwise(got, want, where=""):
    """Same keys, dtypes, shapes and bytes (NaN equal to the same NaN, -0.0 not 0.0)."""
    assert got.batch_size == want.batch_size, (where, got.batch_size, want.batch_size)
    gk, wk = set(got.keys(True, True)), set(want.keys(True, True))
    assert gk == wk, f"{where}: keys {sorted(map(str, gk ^ wk))} differ"
    for key in wk:
        a, b = got.get(key), want.get(key)
        assert a.dtype == b.dtype and a.shape == b.shape, (where, key, a.dtype, b.dtype)
        if a.numel():
            same = rows_equal(a.reshape(1, -1), b.reshape(1, -1))
            assert bool(same.all()), f"{where}: key {key} differs: {a} != {b}"


def sampler_of(kind, max_size):
    if kind == "random":
        return RandomSampler()
    if kind == "prioritized":
        return PrioritizedSampler(max_size, alpha=0.7, beta=0.5)
    return SliceSampler(num_slices=2, end_key=("next", "done"), traj_key=None, strict_length=False)


def twins(max_size, kind, **options):
    """A plain and a compact buffer, each with its own filter of ``options``."""
    plain = ReplayBuffer(
        storage=LazyTensorStorage(max_size),
        sampler=sampler_of(kind, max_size),
        transform=AutoresetFilter(**options),
        batch_size=4,
    )
    compact = ReplayBuffer(
        storage=CompactStorage(max_size),
        sampler=sampler_of(kind, max_size),
        transform=AutoresetFilter(**options),
        batch_size=4,
    )
    return plain, compact


def check_same(plain, compact, kind, where, seed=0):
    """Stored rows, and a sample of each buffer from the same seed, bitwise equal."""
    assert len(plain) == len(compact), where
    if not len(plain):
        return
    assert_bitwise(compact.storage[:], plain.storage[:], f"{where}, every row")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(-len(plain), len(plain), (9,), generator=gen)  # repeats, negatives
    assert_bitwise(compact.storage[idx], plain.storage[idx], f"{where}, indices {idx.tolist()}")
    assert_bitwise(compact.storage[int(idx[0])], plain.storage[int(idx[0])], f"{where}, one row")
    if kind == "slice" and len(plain) < 2:
        return  # (TorchRL's SliceSampler cannot read the ends of a one-row storage)
    torch.manual_seed(seed)
    got, info_c = compact.sample(return_info=True)
    torch.manual_seed(seed)
    want, info_p = plain.sample(return_info=True)
    ic, ip = info_c["index"], info_p["index"]
    if isinstance(ic, tuple):
        ic, ip = torch.stack(list(ic)), torch.stack(list(ip))
    assert torch.equal(ic, ip), where
    assert_bitwise(got, want, f"{where}, {kind} sample")
    if kind == "prioritized":  # the same priorities, so later samples stay alike
        prio = torch.rand(len(torch.as_tensor(info_c["index"])))
        compact.update_priority(info_c["index"], prio)
        plain.update_priority(info_p["index"], prio)


VARIANTS = ["plain", "joint", "restarts_marks", "same_step", "raw_loop_kept"]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 4),
    steps=st.integers(1, 30),
    variant=st.sampled_from(VARIANTS),
    max_size=st.integers(3, 80),
    kind=st.sampled_from(SAMPLERS),
    data=st.data(),
)
def test_random_streams_sample_as_plain_buffer(seed, n, steps, variant, max_size, kind, data):
    """Random next-step and same-step streams, [E, T] batches cut at random
    call boundaries, joint resets with lost terminal observations (NaN),
    collector restarts and batch-end marks, the ring wrapping, a state_dict
    round trip mid-stream and a flush, under the three samplers. Bugs caught:
    a next observation taken from another stream's row, from the successor
    of a dropped or restarted row, or from a slot the ring overwrote; a
    pending row's side entry freed before its successor was verified (or
    never); a held row released by a later call linked wrong; a lost (NaN)
    terminal observation replaced by the next episode's first observation;
    the stream column stored; links or side table not restored by
    load_state_dict.
    """
    rng = np.random.default_rng(seed)
    mode = "same_step" if variant == "same_step" else "next_step"
    kwargs = {"mode": mode}
    if variant == "joint":
        kwargs.update(group=n)
    per_call = data.draw(st.integers(1, 5)) if variant == "restarts_marks" else 0
    if per_call:  # a collector's batches: marks on each batch's last step, a restart between
        steps = per_call * max(steps // per_call, 1)
        restart = data.draw(st.sampled_from(range(0, steps, per_call)))
        kwargs.update(restart_at=(restart,) if restart else (), mark_every=per_call)
    if variant == "raw_loop_kept":
        kwargs.update(zero_fill=0.5)
    if mode == "same_step":
        kwargs.update(final_missing=0.2)
    raw, _ = simulate(rng, n, steps, max_len=4, **kwargs)
    td = grid_td(raw, (n,), final=mode == "same_step", marks=variant == "restarts_marks")
    options = {
        "mode": mode,
        "joint_reset": variant == "joint",
        "on_lost_terminal_obs": "nan",
    }
    plain, compact = twins(max_size, kind, **options)
    if per_call:
        cuts = set(range(per_call, steps, per_call))
    else:
        cuts = data.draw(st.sets(st.integers(1, max(steps - 1, 1)), max_size=steps))
    bounds = [0, *sorted(cuts - {steps}), steps]
    restore_at = data.draw(st.integers(0, len(bounds)))
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b <= a:
            continue
        if i == restore_at:  # a checkpoint of the compact buffer, loaded into a fresh one
            state = compact.state_dict()
            old = compact
            _, compact = twins(max_size, kind, **options)
            compact.load_state_dict(state)
            old.transform[0].flush()  # (its held rows live on in the restored filter)
        batch = td[..., a:b]
        plain.extend(batch.clone())
        compact.extend(batch.clone())
        check_same(plain, compact, kind, f"call {i} [{a}:{b}]", seed + i)
    plain.transform[0].flush(plain)
    compact.transform[0].flush(compact)
    check_same(plain, compact, kind, "after flush", seed)
    assert STREAM_KEY not in compact.storage[:].keys()
    assert compact.storage.side_rows <= len(compact)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), steps=st.integers(2, 25))
def test_step_layout_one_step_per_call(seed, n, steps):
    """A raw loop's rows, one step of E envs per call (layout="step"): every
    row's successor comes in the next call. Bugs caught: a pending row's next
    observation taken from the wrong env's row of the next call, a pending
    row left in the side table after its successor was verified (the
    storage not compact), a done row's reset row linked as its successor.
    """
    raw, _ = simulate(np.random.default_rng(seed), n, steps, max_len=5, zero_fill=False)
    td = grid_td(raw, (n,))
    plain, compact = twins(200, "random", mode="next_step", layout="step")
    for t in range(steps):
        plain.extend(td[:, t].clone())
        compact.extend(td[:, t].clone())
        check_same(plain, compact, "random", f"step {t}", seed + t)
    ends = int(plain.storage[:]["next", "done"].sum()) if len(plain) else 0
    # Only episode ends, one pending row per env, and held done rows use the side table.
    assert compact.storage.side_rows <= ends + n


@needs_trees
@pytest.mark.parametrize("variant", VARIANTS)
def test_prioritized_sampler(variant):
    """PrioritizedSampler over a wrapping compact buffer, priorities updated
    after each sample. Bugs caught: the sampler's indices read against a
    different row order than the plain buffer's, rows rebuilt wrong at the
    slots a prioritized sample favours.
    """
    test_random_streams_sample_as_plain_buffer.hypothesis.inner_test(
        seed=7, n=3, steps=30, variant=variant, max_size=20, kind="prioritized", data=None
    )


def test_byte_exact_floats_and_observation_dicts():
    """Observation dicts (two keys) with -0.0, NaN payloads and a pixel key:
    a link is made only where every key's bytes are equal. Bugs caught: a
    value compare (-0.0 == 0.0, NaN != NaN) linking a row to a slot whose
    observation differs in its bytes, one key of a dict verified and not the
    other.
    """
    T = 6
    pos = torch.arange(T + 1, dtype=torch.float32)[:, None].repeat(1, 2)
    pix = torch.arange(T + 1, dtype=torch.uint8)[:, None, None].expand(T + 1, 3, 3).clone()
    nxt_pos = pos[1:].clone()
    nxt_pos[1, 0] = -0.0 if pos[2, 0] == 0 else nxt_pos[1, 0]
    pos[2, 0] = 0.0
    nxt_pos[1, 0] = -0.0  # row 1's next is -0.0, row 2's observation +0.0: no link
    nxt_pix = pix[1:].clone()
    nxt_pix[3, 0, 0] = 99  # row 3's next pixels differ from row 4's
    batch = TensorDict(
        {
            "pos": pos[:T][None],
            "pix": pix[:T][None],
            ("next", "pos"): nxt_pos[None],
            ("next", "pix"): nxt_pix[None],
            ("next", "reward"): torch.ones(1, T, 1),
            ("next", "done"): torch.zeros(1, T, 1, dtype=torch.bool),
        },
        batch_size=[1, T],
    )
    plain, compact = twins(50, "random", mode="next_step")
    plain.extend(batch.clone())
    compact.extend(batch.clone())
    assert compact.storage.observation_keys == [("pos",), ("pix",)]
    assert_bitwise(compact.storage[:], plain.storage[:], "dict observations")
    assert torch.signbit(compact.storage[1]["next", "pos"][0])
    # rows 1 and 3 are not linked, and the last row waits for its successor
    assert compact.storage.side_rows == 3


@pytest.mark.parametrize("env_key", list(ENVS))
def test_gymnasium_step_loop_matches_explicit_resets(env_key):
    """A real Gymnasium next-step loop (layout='step' via step_rows) into a
    compact buffer: equal bitwise to the plain filtered buffer, and per
    stream to the explicit-reset run. Bugs caught: a done row given the next
    episode's first observation (the reset row's successor linked), a
    truncation's final observation lost, a pending row never resolved.
    """
    name, kwargs, policy = ENVS[env_key]
    n_envs, steps = 4, 60
    _, oracle_rows = run_loop(
        name, kwargs, policy, n_envs, steps, gym.vector.AutoresetMode.DISABLED
    )
    oracle = torch.stack(oracle_rows, dim=1)
    venv = gym.make_vec(name, num_envs=n_envs, vectorization_mode="sync", **kwargs)
    rbs = []
    for storage in (LazyTensorStorage(10_000), CompactStorage(10_000)):
        rb = ReplayBuffer(storage=storage, transform=AutoresetFilter.for_env(venv))
        run_loop(name, kwargs, policy, n_envs, steps, gym.vector.AutoresetMode.NEXT_STEP, rb)
        rb.transform[0].flush(rb)
        rbs.append(rb)
    plain, compact = rbs
    assert_bitwise(compact.storage[:], plain.storage[:], env_key)
    lost = compare_streams(
        streams_from_rows(compact[: len(compact)]),
        {e: oracle[e] for e in range(n_envs)},
        min_rows=40,
    )
    assert lost == 0
    assert compact.storage.side_rows < len(compact) // 2


def test_gymenv_collector_matches_explicit_resets():
    """A real TorchRL GymEnv(num_envs=4) collector writing into a compact
    buffer (Collector(replay_buffer=rb)): rows equal to the plain filtered
    buffer bitwise (lost terminal observations NaN alike) and, per stream,
    to the explicit-reset run. Bugs caught: a joint reset's lost terminal
    observation replaced by the next episode's first observation (a link
    across the reset), [E, T] batches linked across envs, held rows the
    flush stores linked wrong.
    """
    E, T, batches = 4, 16, 8
    oracle_env = make_env("CartPole-v1", E, disabled=True)
    oracle = streams_from_batches(collect(oracle_env, E * T, E * T * batches))
    rbs = []
    for storage in (LazyTensorStorage(100_000), CompactStorage(100_000)):
        env = make_env("CartPole-v1", E)
        filt = AutoresetFilter.for_env(env)
        rb = ReplayBuffer(storage=storage, transform=filt)
        collect(env, E * T, E * T * batches, replay_buffer=rb)
        filt.flush(rb)
        env.close()
        rbs.append(rb)
    plain, compact = rbs
    assert_bitwise(compact.storage[:], plain.storage[:], "collector")
    n_lost = compare_streams(
        streams_from_rows(compact[: len(compact)]), oracle, min_rows=T * batches * 3 // 4
    )
    assert n_lost == rbs[1].transform[0].stats["terminal_obs_missing"]
    torch.manual_seed(1)
    idx = torch.randint(len(plain), (256,))
    assert_bitwise(compact.storage[idx], plain.storage[idx], "collector sample")


def _filled(storage, rows=40):
    rb = ReplayBuffer(storage=storage, transform=AutoresetFilter("next_step"))
    raw, _ = simulate(np.random.default_rng(3), 3, rows, max_len=5)
    td = grid_td(raw, (3,))
    for a in range(0, rows, 7):
        rb.extend(td[:, a : a + 7].clone())
    return rb


def test_state_dict_dumps_loads_and_empty(tmp_path):
    """state_dict / load_state_dict, rb.dumps / rb.loads and rb.empty() keep
    a compact buffer equal to a plain one, and a reloaded buffer links the
    next write to the rows it loaded. Bugs caught: links or the side table
    not saved (next observations wrong after a restore), pending rows lost
    at a restore (the next write's first rows unverified, or linked to a
    stale slot), empty() leaving links that a new write then follows.
    """
    plain = _filled(LazyTensorStorage(64))
    compact = _filled(CompactStorage(64))
    assert_bitwise(compact.storage[:], plain.storage[:], "filled")
    for how in ("state_dict", "dumps"):
        again = ReplayBuffer(storage=CompactStorage(64), transform=AutoresetFilter("next_step"))
        if how == "state_dict":
            again.load_state_dict(compact.state_dict())
        else:
            compact.dumps(tmp_path / how)
            again.loads(tmp_path / how)
        assert_bitwise(again.storage[:], plain.storage[:], how)
        assert again.storage.side_rows == compact.storage.side_rows
    compact.empty()
    plain.empty()
    assert len(compact) == 0 and compact.storage.side_rows == 0
    fresh_p = _filled(plain.storage)
    fresh_c = _filled(compact.storage)
    assert_bitwise(fresh_c.storage[:], fresh_p.storage[:], "after empty")


@pytest.mark.parametrize("how", ["state_dict", "dumps"])
def test_restored_buffer_continues_streams(how, tmp_path):
    """A buffer restored from state_dict takes the next batch of the same
    streams: its first rows are verified against the pending rows and
    linked. Bugs caught: pending rows not restored (each stream's last row
    stays in the side table forever), or restored on the wrong slots.
    """
    raw, _ = simulate(np.random.default_rng(5), 2, 30, max_len=50)  # no episode end
    td = grid_td(raw, (2,))
    plain, compact = twins(100, "random", mode="next_step")
    plain.extend(td[:, :10].clone())
    compact.extend(td[:, :10].clone())
    again = ReplayBuffer(storage=CompactStorage(100), transform=AutoresetFilter("next_step"))
    if how == "state_dict":
        again.load_state_dict(compact.state_dict())
    else:
        compact.dumps(tmp_path)
        again.loads(tmp_path)
    again.extend(td[:, 10:].clone())
    plain.extend(td[:, 10:].clone())
    assert_bitwise(again.storage[:], plain.storage[:], "restored")
    ends = int(plain.storage[:]["next", "done"].sum())
    assert again.storage.side_rows == ends + 2  # each stream's newest row only


def test_refusals(tmp_path):
    """Bugs caught: a writer that picks its own slots accepted (rows
    overwritten out of turn would leave links to them), a plain storage's
    state or dump loaded as compact (next observations read from nowhere),
    a batch without any observation twin accepted silently; each refusal
    writes nothing.
    """
    rb = ReplayBuffer(
        storage=CompactStorage(10),
        writer=TensorDictMaxValueWriter(rank_key=("next", "reward")),
        transform=AutoresetFilter("next_step"),
    )
    raw, _ = simulate(np.random.default_rng(0), 1, 5, max_len=9)
    with pytest.raises(LayoutError, match="RoundRobinWriter"):
        rb.extend(grid_td(raw, (1,)))
    assert len(rb) == 0
    plain = _filled(LazyTensorStorage(64))
    with pytest.raises(StateError, match="not a CompactStorage"):
        CompactStorage(64).load_state_dict(plain.storage.state_dict())
    plain.dumps(tmp_path / "plain")
    with pytest.raises(StateError, match="LazyTensorStorage"):
        ReplayBuffer(storage=CompactStorage(64)).loads(tmp_path / "plain")
    bare = ReplayBuffer(storage=CompactStorage(8))
    with pytest.raises(ValueError, match="observation_keys"):
        bare.extend(TensorDict({"a": torch.zeros(3), ("next", "b"): torch.zeros(3)}, [3]))
    assert len(bare) == 0
    with pytest.raises(LayoutError, match="ndim=1"):
        CompactStorage(8, ndim=2)


@pytest.mark.parametrize("how", ["dumps", "state_dict"])
def test_compact_dump_into_a_plain_buffer_is_named(how, tmp_path):
    """A compact buffer's dump (or state) loaded by a buffer over a
    LazyTensorStorage with the filter. Bug caught: TorchRL loads the rows
    without their next observations and the first sample fails with a bare
    KeyError (a newcomer's report); the filter's state now says its buffer
    was compact and the load is refused by name. A CompactStorage of the
    same size loads it.
    """
    compact = _filled(CompactStorage(64))
    plain = ReplayBuffer(storage=LazyTensorStorage(64), transform=AutoresetFilter("next_step"))
    again = ReplayBuffer(storage=CompactStorage(64), transform=AutoresetFilter("next_step"))
    if how == "dumps":
        compact.dumps(tmp_path / "compact")
        with pytest.raises(StateError, match=r"CompactStorage\(max_size\)"):
            plain.loads(tmp_path / "compact")
        again.loads(tmp_path / "compact")
    else:
        state = compact.state_dict()
        with pytest.raises(StateError, match="KeyError"):
            plain.load_state_dict(state)
        again.load_state_dict(state)
    assert_bitwise(again.storage[:], compact.storage[:], "loaded into a CompactStorage")


def test_offline_reads_a_compact_dump(tmp_path):
    """cleanbuf.audit reads a compact buffer's dump (and the live buffer,
    which it dumps first) as the plain buffer's, and the reader that
    ``clean`` and ``export`` share gives the same rows, next observations
    included; ``cleanbuf audit`` on the command line says the same. Bugs
    caught: the dump read without its next observations (a missing key, or
    every row's next observation taken as absent), links read from the
    wrong slots of a wrapped dump.
    """
    import subprocess
    import sys

    import cleanbuf
    from cleanbuf.offline._formats import read

    plain = _filled(LazyTensorStorage(64))
    compact = _filled(CompactStorage(64))
    plain.dumps(tmp_path / "plain")
    compact.dumps(tmp_path / "compact")
    for source in ("compact", compact):
        got = source if not isinstance(source, str) else str(tmp_path / source)
        a, b = cleanbuf.audit(got).to_dict(), cleanbuf.audit(str(tmp_path / "plain")).to_dict()
        paths = {k for k in a if str(tmp_path) in str(a[k]) or str(tmp_path) in str(b[k])}
        paths |= {"in_memory", "format"} if not isinstance(source, str) else set()
        assert {k: a[k] for k in a if k not in paths} == {k: b[k] for k in b if k not in paths}
        assert b["episodes"] > 10 and b["wrapped"]
    # what clean and export read: the rows, every key, the next observations included
    got, want = read(str(tmp_path / "compact")), read(str(tmp_path / "plain"))
    assert got.wrapped and np.array_equal(got.order, want.order)
    assert_bitwise(got.data, want.data, "the dump as read")
    cli = [sys.executable, "-m", "cleanbuf", "audit"]
    out = [
        subprocess.run([*cli, str(tmp_path / d)], capture_output=True, text=True)
        for d in ("plain", "compact")
    ]
    assert out[0].returncode == out[1].returncode
    assert out[0].stdout.replace(str(tmp_path / "plain"), "DIR") == out[1].stdout.replace(
        str(tmp_path / "compact"), "DIR"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_storage_gathers_on_its_device():
    """A compact storage on the GPU, fed CPU rows: links, side table and the
    sample live on the GPU and equal a plain GPU storage's rows. Bugs
    caught: links or the side table left on the CPU (a device mismatch at
    the gather), a sample's next observation gathered on the wrong device.
    """
    raw, _ = simulate(np.random.default_rng(2), 3, 40, max_len=5)
    td = grid_td(raw, (3,))
    rbs = []
    for storage in (LazyTensorStorage(50, device="cuda"), CompactStorage(50, device="cuda")):
        rb = ReplayBuffer(storage=storage, transform=AutoresetFilter("next_step"))
        for a in range(0, 40, 6):
            rb.extend(td[:, a : a + 6].clone())
        rbs.append(rb)
    plain, compact = rbs
    assert compact.storage._link.device.type == "cuda"
    assert compact.storage._side.device.type == "cuda"
    idx = torch.randint(len(plain), (64,), device="cuda")
    got = compact.storage[idx]
    assert got["next", "observation"].device.type == "cuda"
    assert_bitwise(got.cpu(), plain.storage[idx].cpu(), "cuda")


@pytest.mark.slow  # spawned worker processes
def test_several_producers_into_one_compact_buffer():
    """A MultiAsyncCollector's batches (one worker's [E, T] at a time, env
    indices alike across workers) extended in this process into a compact
    and a plain filtered buffer: equal bit for bit. Bug caught: a row
    linked to the row of another worker's env of the same index (the
    stream index collides across producers; only the byte comparison
    keeps it out).
    """
    from torchrl.collectors import MultiAsyncCollector

    from tests.workers import push_left, worker_env

    collector = MultiAsyncCollector(
        [worker_env] * 2, push_left, frames_per_batch=32, total_frames=32 * 16
    )
    try:
        collector.set_seed(0)
        rbs = [
            ReplayBuffer(
                storage=storage,
                transform=AutoresetFilter.for_env(collector, observation_keys=["observation"]),
            )
            for storage in (LazyTensorStorage(10_000), CompactStorage(10_000))
        ]
        for batch in collector:
            for rb in rbs:
                rb.extend(batch.clone())
    finally:
        collector.shutdown()
    for rb in rbs:
        rb.transform[0].flush(rb)
    plain, compact = rbs
    assert len(plain) > 300
    assert_bitwise(compact.storage[:], plain.storage[:], "two producers")


def test_writes_out_of_ring_order_keep_every_row():
    """Rows written at chosen slots (``storage[idx] = rows``: no cursor), then
    the ring going on: the rows that linked into the slots written keep
    their next observations. Bugs caught: a row left linking to a slot that
    now holds another observation, the side entries of overwritten rows not
    freed or freed twice.
    """
    plain = _filled(LazyTensorStorage(64))
    compact = _filled(CompactStorage(64))
    rows = plain.storage[torch.tensor([40, 41, 3])].clone()
    for rb in (plain, compact):
        rb.storage[torch.tensor([10, 11, 30])] = rows.clone()
    assert_bitwise(compact.storage[:], plain.storage[:], "after storage[idx] = rows")
    raw, _ = simulate(np.random.default_rng(9), 3, 30, max_len=5)
    td = grid_td(raw, (3,))
    more = [
        ReplayBuffer(storage=rb.storage, transform=AutoresetFilter("next_step"))
        for rb in (plain, compact)
    ]
    for rb, old in zip(more, (plain, compact)):
        rb._writer._cursor = old._writer._cursor
        rb.extend(td.clone())
    assert_bitwise(compact.storage[:], plain.storage[:], "and the ring going on")
    assert compact.storage.side_rows <= len(compact)


def test_tensordict_buffer_trajectory_slices_and_add():
    """A TensorDictReplayBuffer (its writer stores an "index" key) sampled
    by a SliceSampler over ("collector", "traj_ids"), and rows added one at
    a time with rb.add (layout="step", one env): as the plain buffer, bit
    for bit. Bugs caught: a single row (batch []) written at an int cursor
    linked wrong or not at all, the writer's "index" key lost.
    """
    raw, _ = simulate(np.random.default_rng(1), 3, 30, max_len=5)
    td = grid_td(raw, (3,), marks=True)
    got = []
    for storage in (LazyTensorStorage(40), CompactStorage(40)):
        rb = TensorDictReplayBuffer(
            storage=storage,
            transform=AutoresetFilter("next_step"),
            sampler=SliceSampler(
                num_slices=4, traj_key=("collector", "traj_ids"), strict_length=False
            ),
            batch_size=16,
        )
        for a in range(0, 30, 5):
            rb.extend(td[:, a : a + 5].clone())
        torch.manual_seed(0)
        got.append((rb.storage[:], rb.sample()))
    assert_bitwise(got[1][0], got[0][0], "TensorDictReplayBuffer rows")
    assert_bitwise(got[1][1], got[0][1], "trajectory slices")
    added = []
    for storage in (LazyTensorStorage(40), CompactStorage(40)):
        rb = ReplayBuffer(storage=storage, transform=AutoresetFilter("next_step", layout="step"))
        for t in range(30):
            rb.add(td[0, t].clone())
        rb.transform[0].flush(rb)
        added.append(rb)
    assert_bitwise(added[1].storage[:], added[0].storage[:], "rb.add")
    ends = int(added[0].storage[:]["next", "done"].sum())
    assert added[1].storage.side_rows <= ends + 1


class LinkModel:
    """The compact storage's bookkeeping, readable: per slot, where its next observation is.

    ``link[slot]`` is ``None`` (never written), an ``int`` (the slot whose
    observation is this row's next one, byte for byte) or ``("side", value)``
    (kept apart); ``pending[stream]`` is the stream's newest slot. A write:
    rows linking into the slots written out of ring order keep their next
    observation apart first; then each stream's rows link to the next row of
    that stream where the bytes match, its first row closes the stream's
    pending row of an earlier write (alive, bytes matching), and its last
    row waits apart.
    """

    def __init__(self, max_size):
        self.size = max_size
        self.link = [None] * max_size
        self.obs = [None] * max_size
        self.pending = {}
        self.next_slot = 0

    def write(self, slots, sids, obs, nxt, in_order=True):
        n = len(slots)
        ordered = in_order and slots == [(self.next_slot + i) % self.size for i in range(n)]
        written = set(slots)
        if not ordered:
            for r, t in enumerate(self.link):
                if isinstance(t, int) and t in written and r not in written:
                    self.link[r] = ("side", self.obs[t])
        for stream in dict.fromkeys(sids):
            rows = [i for i in range(n) if sids[i] == stream]
            r = self.pending.get(stream)
            if r is not None and r not in written and isinstance(self.link[r], tuple):
                if self.link[r][1] == obs[rows[0]]:
                    self.link[r] = slots[rows[0]]
            for i, j in zip(rows, rows[1:]):
                self.link[slots[i]] = slots[j] if nxt[i] == obs[j] else ("side", nxt[i])
            self.link[slots[rows[-1]]] = ("side", nxt[rows[-1]])
        self.pending = {s: r for s, r in self.pending.items() if r not in written}
        for i in range(n):
            self.obs[slots[i]] = obs[i]
            self.pending[sids[i]] = slots[i]
        self.next_slot = (slots[-1] + 1) % self.size


def _row_bytes(td, keys, i):
    return tuple(td.get(k)[i].numpy().tobytes() for k in keys)


def _check_links(storage, model, keys):
    nkeys = [("next", k) for k in keys]
    link = storage._link_host.numpy()
    assert torch.equal(storage._link.cpu(), storage._link_host), "device copy out of date"
    entries = []
    for slot, want in enumerate(model.link):
        got = int(link[slot])
        if want is None:
            assert got == -1, (slot, got)
        elif isinstance(want, int):
            assert got == want, f"slot {slot}: links to {got}, the model to {want}"
        else:
            assert got <= -2, f"slot {slot}: links to {got}, the model keeps it apart"
            entries.append(-2 - got)
            assert _row_bytes(storage._side, nkeys, -2 - got) == want[1], f"slot {slot}: side"
    assert len(set(entries)) == len(entries), "two rows share a side entry"
    assert storage.side_rows == len(entries), "a side entry leaked or freed twice"
    free = storage._free[: storage._n_free].tolist()
    assert not set(free) & set(entries), "a side entry in use is on the free stack"
    assert dict(zip(storage._pend_stream.tolist(), storage._pend_slot.tolist())) == model.pending
    written = [s for s, want in enumerate(model.link) if want is not None and s < len(storage)]
    if not written:
        return
    rows = storage.get(torch.tensor(written))  # the read path (CPU kernel or device gathers)
    for i, slot in enumerate(written):
        want = model.link[slot]
        want = model.obs[want] if isinstance(want, int) else want[1]
        assert _row_bytes(rows, nkeys, i) == want, f"slot {slot}: next observation read back"


@pytest.mark.parametrize("path", ["one key, CPU", "two keys, CPU", "device path"])
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    max_size=st.integers(2, 40),
    streams=st.integers(1, 5),
    writes=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 9)), min_size=1, max_size=25),
)
def test_link_kernels_match_the_readable_model(path, seed, max_size, streams, writes):
    """The write kernels (``plan_links``, ``commit_links``, ``write_links``,
    ``rows_match``, ``copy_rows``) against :class:`LinkModel`, on random
    interleaved streams whose observations often repeat the row before's
    next one (few values, NaN and -0.0 among them), written in random
    call sizes, the ring wrapping, and one write in ten at a random slot
    out of ring order; for the single-key CPU kernel, the general CPU path
    (two keys) and the device path (torch comparisons, run on the CPU).
    Links, side entries, the free stack, the pending rows and every next
    observation read back are checked after every write. Bugs caught: a
    link made without the byte match (a wrong next observation served with
    no error), a stream's pending row
    not closed by its next write or closed by another stream's row, a
    side entry leaked, freed twice or shared, a pending row kept after the
    ring overwrote it, a row left linking into a slot written out of ring
    order.
    """
    rng = np.random.default_rng(seed)
    values = np.array([0.0, -0.0, 1.0, np.nan, 2.5], dtype=np.float32)
    keys = ["observation", "pixels"] if path == "two keys, CPU" else ["observation"]
    storage = CompactStorage(max_size)
    storage._compare_on_host = path != "device path"
    model = LinkModel(max_size)
    last = {s: rng.choice(values, size=2) for s in range(streams)}
    cursor = 0
    for size, jump in writes:
        size = min(size, max_size)
        sids, obs, nxt = [], [], []
        for _ in range(size):
            s = int(rng.integers(streams))
            o = last[s] if rng.random() < 0.7 else rng.choice(values, size=2)
            x = rng.choice(values, size=2)
            last[s] = x
            sids.append(s)
            obs.append(o)
            nxt.append(x)
        if jump == 0:
            cursor = int(rng.integers(max_size))
        slots = [(cursor + i) % max_size for i in range(size)]
        cols = {}
        for k, factor in zip(keys, (1.0, -1.0)):
            cols[k] = torch.tensor(np.stack(obs) * factor)
            cols[("next", k)] = torch.tensor(np.stack(nxt) * factor)
        td = TensorDict(
            {**cols, STREAM_KEY: torch.tensor(sids), "reward": torch.zeros(size)},
            batch_size=[size],
        )
        storage.set(torch.tensor(slots), td, set_cursor=True)
        want_obs = [_row_bytes(td, keys, i) for i in range(size)]
        want_next = [_row_bytes(td, [("next", k) for k in keys], i) for i in range(size)]
        model.write(slots, sids, want_obs, want_next)  # (out of order: slots tell)
        _check_links(storage, model, keys)
        cursor = (slots[-1] + 1) % max_size
