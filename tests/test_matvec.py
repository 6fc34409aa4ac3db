"""The speed probe's synthetic weights (model/matvec.py: random_blocks) are weights a model could
hold: gguf's reference dequantizer reads every one of them as a finite number, for every type the
probe has a rule for. Random bytes in a block's fp16 scale fields (NaN, infinities, subnormals)
made some kernels run at half speed, so the planner took a machine for slower than it is."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from potluck.model.matvec import _F16_FIELDS, random_blocks

TYPES = [*_F16_FIELDS, T.F32, T.F16, T.BF16]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_are_finite_weights(qtype: T) -> None:
    n, k = 64, 512  # 64 rows of two 256-wide super-blocks: 128 blocks of every K-quant
    raw = random_blocks(qtype, n, k, seed=3)
    try:
        w = quants.dequantize(raw.reshape(n, -1), qtype)
    except NotImplementedError:
        pytest.skip(f"gguf has no reference dequantizer for {qtype.name}")
    assert w.shape == (n, k)
    assert np.isfinite(w).all(), f"{(~np.isfinite(w)).sum()} of {w.size} not finite"
    assert 0 < np.abs(w).max() < 1e3
