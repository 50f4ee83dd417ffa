import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from dist_pool import Pool  # noqa: E402

_POOLS: dict[int, Pool] = {}


@pytest.fixture(scope="session")
def pools():
    """get(ws) -> a persistent Pool of ws gloo ranks, shared by every test of the session."""

    def get(ws: int) -> Pool:
        if ws not in _POOLS:
            _POOLS[ws] = Pool(ws)
        return _POOLS[ws]

    def reset(ws: int) -> None:
        p = _POOLS.pop(ws, None)
        if p is not None:
            p.close()

    get.reset = reset
    yield get
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()
