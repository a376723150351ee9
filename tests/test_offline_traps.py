"""The offline side's traps met on a first try: each test fails on the code before its fix.

Data from a real ``Collector(replay_buffer=rb)`` over TorchRL's
``GymEnv("CartPole-v1", num_envs=4)`` (next-step auto-reset: reset rows,
zero-filled terminal observations); what the filter stores from the same
batches at write time is the reference.
"""

from __future__ import annotations

import os
import shutil
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from torchrl.data import LazyMemmapStorage, ReplayBuffer

import cleanbuf
from cleanbuf import InputError
from cleanbuf.check.cli import main
from cleanbuf.offline import audit, clean_dataset
from tests.faults import GC_WARNING
from tests.test_offline import T, _assert_streams, _collect, _digest, _filtered


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """A buffer on ``LazyMemmapStorage(10_000)`` filled by the collector ([16]-step
    chunks), its dump, and the filter's rows and stats from the same batches.
    """
    rb, batches = _collect(LazyMemmapStorage(10_000))
    want, stats = _filtered(batches)
    src = str(tmp_path_factory.mktemp("collected") / "src")
    rb.dumps(src)
    return rb, src, want, stats, batches


def _clean(src, dst, capsys, *flags):
    assert main(["clean", src, dst, "--no-progress", *flags]) == 0
    return capsys.readouterr()


def test_cleaned_dump_audits_clean_without_hedging(collected, tmp_path, capsys):
    """Bug caught: ``cleanbuf audit`` of what ``cleanbuf clean`` just wrote could
    not recover its envs (the reset rows are gone, so the rows no longer fall
    into runs of T steps) and said "streams not recovered" and "low
    confidence", or read the rows of four envs as one stream, and refused to
    clean them again ("cannot tell which env each row came from"). Also caught: an
    env index stored wrong (the audit would then find artifacts), and a stale
    index trusted after another ``rb.dumps`` into the directory.
    """
    _, src, _, stats, _ = collected
    for dst in (str(tmp_path / "dst"), str(tmp_path / "dst.npz")):
        _clean(src, dst, capsys)
        assert main(["audit", dst]) == 0
        out = capsys.readouterr().out
        assert "not recovered" not in out and "low confidence" not in out, out
        report = audit(dst)
        assert report.clean and report.confidence == "high" and report.env_stored
        assert (report.envs, report.episodes) == (4, stats["episodes_completed"])
        assert report.is_init_wrong == report.step_count_wrong == 0
        again = clean_dataset(dst, None).stats  # cleaning it again changes nothing
        assert again["rows_out"] == again["rows_in"] == stats["rows_out"]
        assert again["reset_rows_dropped"] == again["next_obs_restitched"] == 0
    # The same directory rewritten by TorchRL with other rows: the stored
    # index no longer describes them and is ignored.
    rb = ReplayBuffer(storage=LazyMemmapStorage(10_000))
    rb.loads(str(tmp_path / "dst"))
    rb.extend(rb[:100].clone())
    rb.dumps(str(tmp_path / "dst"))
    assert not audit(str(tmp_path / "dst")).env_stored


def test_audit_of_a_buffer_in_memory_names_it_and_says_how_to_clean_it(collected):
    """Bugs caught: the report of ``cleanbuf.audit(rb)`` named a temporary
    directory deleted when the call returned and suggested a command line
    on it; TorchRL's "last_cursor is None" warning (a buffer filled by
    ``rb.loads``) leaked to the user. The suggested call is run: a call that
    does not clean the buffer fails the comparison with the filter.
    """
    _, src, want, _, _ = collected
    rb = ReplayBuffer(storage=LazyMemmapStorage(10_000))
    rb.loads(src)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = cleanbuf.audit(rb)
        rows = cleanbuf.clean(rb)
    assert [str(w.message) for w in seen if GC_WARNING not in str(w.message)] == []
    assert report.source == "ReplayBuffer(LazyMemmapStorage(10000))" and report.in_memory
    text = str(report)
    assert "cleanbuf-" not in text and "/tmp" not in text and "cleanbuf clean" not in text, text
    assert report.command() in text
    scope = {"cleanbuf": cleanbuf, "rb": rb}
    exec(report.command(), scope)
    _assert_streams(scope["rows"], want)
    _assert_streams(rows, want)


def test_dst_inside_src_or_src_inside_dst_is_refused(collected, tmp_path, capsys):
    """Bugs caught: ``cleanbuf clean SRC SRC/storage/x`` accepted, writing into
    SRC; ``cleanbuf clean SRC PARENT --force`` (SRC inside DST) deleting SRC
    with the old DST; the same through a symlink (paths not resolved).
    """
    _, src, _, _, _ = collected
    outer = tmp_path / "outer"
    inner = str(outer / "src")
    shutil.copytree(src, inner)
    link = tmp_path / "link"
    os.symlink(inner, link)
    before, listing = _digest(inner), sorted(os.listdir(outer))
    cases = (
        ([inner, os.path.join(inner, "storage", "x")], "inside SRC"),
        ([str(link), os.path.join(inner, "x")], "inside SRC"),
        ([inner, str(outer), "--force"], "inside DST"),
        ([str(link), str(outer), "--force"], "inside DST"),
    )
    for args, message in cases:
        assert main(["clean", *args, "--no-progress"]) == 2, args
        assert message in capsys.readouterr().err
        assert _digest(inner) == before and sorted(os.listdir(outer)) == listing


def test_clean_reads_a_dict_named_as_in_npz_files(collected):
    """Bug caught: ``cleanbuf.clean(d)`` of a dict keyed ``"next/done"``,
    ``"next/observation"`` (as ``np.load`` of a ``.npz`` gives it) failed with
    "cannot infer the batch dimensions of a dict without a done key" although
    the key is there. Also caught: a really missing done key reported
    without the keys that were found, or with a way out (``batch_dims=``)
    that only leads to another error; ``done_key=`` ignored when reading
    the batch dimensions.
    """
    *_, batches = collected
    data = torch.cat(batches, 1)  # [E, steps]: time last
    named = {
        "/".join(k) if isinstance(k, tuple) else k: v.numpy() for k, v in data.items(True, True)
    }
    got, stats = cleanbuf.clean(named, layout="time_last", return_stats=True)
    want = cleanbuf.clean(data, layout="time_last")
    assert stats["reset_rows_dropped"] > 10
    assert sorted(got) == sorted(named)  # the names as given
    for key, value in want.items(True, True):
        name = "/".join(key) if isinstance(key, tuple) else key
        np.testing.assert_array_equal(got[name], value.numpy(), err_msg=name)
    missing = {k: v for k, v in named.items() if k not in ("next/done", "next/terminated")}
    missing.pop("next/truncated")
    with pytest.raises(InputError, match=r"found keys .*'next/reward'") as info:
        cleanbuf.clean(missing, layout="time_last")
    assert "done_key=" in str(info.value) and "batch_dims=" not in str(info.value)
    # the key the message names as the way out works alone (it also gives the batch dims)
    missing["dones"] = named["next/done"]
    got = cleanbuf.clean(missing, layout="time_last", done_key="dones")
    np.testing.assert_array_equal(got["next/observation"], want["next", "observation"].numpy())


def test_a_cleaned_dump_loads_into_a_buffer_built_as_the_source(collected, tmp_path, capsys):
    """Bug caught: SRC's storage has 10_000 slots of [16]-step chunks; DST was
    laid out for 10_000 x 16 rows, so ``rb.loads(DST)`` into
    ``LazyMemmapStorage(10_000)`` raised "The size of tensor a (10000) must
    match the size of tensor b (160000)", though the rows fit.
    """
    _, src, want, stats, _ = collected
    dst = str(tmp_path / "dst")
    _clean(src, dst, capsys)
    rb = ReplayBuffer(storage=LazyMemmapStorage(10_000))
    rb.loads(dst)
    assert len(rb) == stats["rows_out"]
    _assert_streams(rb[: len(rb)], want)


def test_a_buffer_too_small_for_the_cleaned_rows_is_named(collected, tmp_path, capsys):
    """A wrapped ``LazyMemmapStorage(20)`` of [16]-step chunks: 320 rows, about
    300 once cleaned, more than a 20-row buffer holds. Bugs caught: a dump
    that no buffer built as SRC's can load, written without a word; a
    storage named that cannot load it. And the exact fit (SRC's storage
    sized to the cleaned rows, fewer slots than its rows): no note, and the
    cleaned dump loads into a buffer built as SRC's.
    """
    _, _, want, stats, _ = collected
    rb, _ = _collect(LazyMemmapStorage(20))
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    rb.dumps(src)
    n = 20 * T
    err = _clean(src, dst, capsys).err
    assert f"ReplayBuffer(storage=LazyMemmapStorage({n}))" in err, err
    loaded = ReplayBuffer(storage=LazyMemmapStorage(n))
    loaded.loads(dst)
    assert 0 < len(loaded) < n
    fit = stats["rows_out"]  # 720 rows once cleaned, from 768 in 48 slots
    rb, _ = _collect(LazyMemmapStorage(fit))
    src, dst = str(tmp_path / "src_fit"), str(tmp_path / "dst_fit")
    rb.dumps(src)
    assert "note" not in _clean(src, dst, capsys).err
    loaded = ReplayBuffer(storage=LazyMemmapStorage(fit))
    loaded.loads(dst)
    assert len(loaded) == fit
    _assert_streams(loaded[:fit], want)


def test_plot_data_integer_env_ticks_and_a_visible_change(collected, tmp_path, capsys):
    """Bugs caught: fractional env ticks (0.5, 1.5); a before/after view in
    which cleaning shows no difference (episode lengths that differ by one
    row); a view that shows a change where there is none (a cleaned dump).
    """
    from cleanbuf.offline._plot import KINDS, counts, figure

    _, src, _, stats, _ = collected
    report = audit(src)
    fig = figure(report)
    assert list(fig.axes[0].get_yticks()) == [0, 1, 2, 3]
    before, after = counts(report)["as stored"], counts(report)["cleaned"]
    by_kind = dict(zip(KINDS, zip(before, after)))
    assert by_kind["reset rows"] == (stats["reset_rows_dropped"], 0)
    assert by_kind["terminal obs zeros"] == (stats["next_obs_restitched"], 0)
    assert by_kind["terminal obs restored"] == (0, stats["next_obs_restitched"])
    bars = [round(p.get_height()) for p in fig.axes[1].patches]
    assert bars == [*before, *after]  # what is drawn is these counts
    _clean(src, str(tmp_path / "dst"), capsys)
    clean = counts(audit(str(tmp_path / "dst")))
    assert clean["as stored"] == clean["cleaned"] == (0, 0, 0, 0, 0)
    plt.close(fig)
