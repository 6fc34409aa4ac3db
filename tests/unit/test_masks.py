"""Attention masks (model/graph.causal_mask): the one-row form a decode step takes is the same as
the general one, for every position, cache width and sliding window."""

from __future__ import annotations

import numpy as np
import pytest

from potluck.model.graph import causal_mask


def _reference(start: int, n: int, n_kv: int, window: int) -> np.ndarray:
    pos = np.arange(start, start + n)[:, None]
    j = np.arange(n_kv)[None, :]
    ok = (j <= pos) & ((pos - j < window) if window else True)
    return np.where(ok, np.float16(0), np.float16(-np.inf))


@pytest.mark.parametrize("window", [0, 1, 4, 256, 4096])
@pytest.mark.parametrize("n", [1, 3])
def test_mask_equals_the_definition(window: int, n: int) -> None:
    for n_kv in (256, 512):
        for start in range(0, n_kv - n + 1, 11):
            got = causal_mask(start, n, n_kv, window)
            assert got.dtype == np.float16 and got.shape == (n, n_kv)
            assert np.array_equal(got, _reference(start, n, n_kv, window)), (start, n_kv)
