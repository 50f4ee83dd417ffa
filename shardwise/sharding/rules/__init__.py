"""Sharding rules, one file per op family, each registered in the op registry (sharding/ops.py,
``OpInfo.rule``): pointwise, views, products, reductions and normalisations, attention, embeddings,
losses, factories; marks of placements a value must take; another axis's collectives."""

from . import attention, collectives, embedding, factory, losses, marks, matmul, pointwise, reductions, views

__all__ = ["attention", "collectives", "embedding", "factory", "losses", "marks", "matmul", "pointwise", "reductions",
           "views"]
