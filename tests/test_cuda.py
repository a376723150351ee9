"""The CUDA path: rows stay on the device, flags go to the CPU kernels.

Skipped without a GPU (CI has none); run on a GPU machine to check it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cleanbuf import AutoresetFilter
from tests.batches import grid_td
from tests.reference import simulate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_equals_cpu():
    """Bugs caught: CPU-only indexing on device tensors (errors), rows moved
    in another order on the device, held rows or patches left on the CPU.
    """
    for seed in range(20):
        _check_seed(seed)


def _check_seed(seed):
    rng = np.random.default_rng(seed)
    raw, _ = simulate(rng, 4, 50, group=2 if seed % 2 else None, max_len=5)
    td = grid_td(raw, (2, 2))
    options = dict(joint_reset=bool(seed % 2), reset_group_size=2 if seed % 2 else None)
    cpu, gpu = AutoresetFilter(**options), AutoresetFilter(**options)
    cuts = [0, 7, 8, 31, 50]
    for a, b in zip(cuts[:-1], cuts[1:]):
        out_c = cpu.inv(td[..., a:b])
        out_g = gpu.inv(td[..., a:b].to("cuda"))
        if out_c is None:
            assert out_g is None
            continue
        assert out_g.device.type == "cuda"
        for key, value in out_c.items(True, True):
            torch.testing.assert_close(out_g[key].cpu(), value, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(
        gpu.flush().cpu().to_dict(), cpu.flush().to_dict(), rtol=0, atol=0, equal_nan=True
    )
    assert gpu.stats == cpu.stats
