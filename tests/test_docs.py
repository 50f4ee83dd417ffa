"""The runnable examples in the public docstrings run and say what they claim."""

import doctest
import importlib

import pytest

MODULES = ["shardwise", "shardwise.job", "shardwise.config", "shardwise.runtime.mesh", "shardwise.capture.trace",
           "shardwise.sharding.ops", "shardwise.costmodel.model", "shardwise.recipes", "shardwise.sharding.annotate",
           "shardwise.sharding.placements", "shardwise.sharding.propagate"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0
    assert res.attempted > 0 or name == "shardwise"  # the package example has no output to compare
