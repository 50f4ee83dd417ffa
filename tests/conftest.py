import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from dist_pool import Pool  # noqa: E402

_POOLS: dict[tuple, Pool] = {}


@pytest.fixture(scope="session")
def pools():
    """get(ws, backend="gloo") -> a persistent Pool of ws ranks, shared by every test of the session."""

    def get(ws: int, backend: str = "gloo") -> Pool:
        if (ws, backend) not in _POOLS:
            _POOLS[(ws, backend)] = Pool(ws, backend)
        return _POOLS[(ws, backend)]

    yield get
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()
