"""Sharding rules, one file per op family, each registered in the op registry (sharding/ops.py,
``OpInfo.rule``): pointwise, views, products, reductions and normalisations, attention, embeddings,
losses, factories."""

from . import attention, embedding, factory, losses, matmul, pointwise, reductions, views

__all__ = ["attention", "embedding", "factory", "losses", "matmul", "pointwise", "reductions", "views"]
