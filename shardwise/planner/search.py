"""``shardwise plan --search``: the fastest layouts of a model on a cluster for a global batch, by the planner's
estimate (estimate.py), and what would make a job fit where none does.

The space: tp inside a node (powers of two), pipeline stages (divisors of the layers and powers of two) with 1-20
interleaved stages splitting the layers evenly or with the embedding and the loss as a layer each (Megatron-Core: Llama
3 405B's 126 layers over pp 8 x v 8), ZeRO 0-3, hybrid sharding over a node, ep (with --etp 1 over a stage's tp x cp x
dp ranks), micro-batches of 1-8, every recompute policy, sp with tp; the base strategy's other fields kept. Layouts that
do not fit are dropped, the rest by step."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

from .clusters import ClusterSpec, cluster
from .estimate import RECOMPUTE, Strategy, estimate
from .models import ModelSpec

MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL = tuple(range(1, 21))


def _powers(limit: int) -> list[int]:
    return [1 << i for i in range(max(limit, 0).bit_length())]  # 1, 2, 4, ... up to limit


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def layouts(m: ModelSpec, c: ClusterSpec, base: Strategy, max_pp: int = 64, space: dict | None = None):
    """Every strategy of the search space (module docstring) on ``c``, ``base``'s other fields kept; ``space`` ({axis:
    values}: tp, pp, virtual, micro_batch, zero, ep, cp, recompute) narrows an axis to the values it lists (what the
    system a layout is for can run); context parallelism is weighed only where it lists cp values."""
    space = space or {}

    def only(axis, values):
        return [v for v in values if v in space[axis]] if axis in space else list(values)

    gpus = c.gpus
    tps = only("tp", [t for t in _powers(c.per_node if c.rings else gpus) if gpus % t == 0])
    gb = base.global_batch
    if gb is None:
        raise ValueError("a layout search needs the global batch (sequences per step): give --global-batch")
    # stages that split the layers evenly, and powers of two that do not (the fullest stage sets the pace)
    pps = only("pp", sorted(set(_divisors(m.layers, max_pp)) | {p for p in _powers(max_pp) if p <= m.layers}))
    for tp in tps:
        for pp in pps:
            if gpus % (tp * pp):
                continue
            for cp in only("cp", _powers(64)) if "cp" in space else [1]:  # cp only where the space asks
                yield from _rest(m, c, base, gpus, tp, pp, cp, gb, only)


def _rest(m, c, base, gpus, tp, pp, cp, gb, only):
    """The layouts of one (tp, pp, cp): every virtual stages, micro-batch, ZeRO, shard, ep, recompute."""
    if gpus % (tp * pp * cp):
        return
    dp = gpus // (tp * pp * cp)
    if gb % dp:
        return
    per_rank = gb // dp
    ranks = dp * (tp * cp if base.etp == 1 else 1)  # --etp 1: whole experts folded over a stage's tp x cp x dp ranks
    eps = only("ep", [e for e in _divisors(ranks, m.experts) if m.experts % e == 0] if m.experts > 1 else [1])
    virtuals = [v for v in only("virtual", VIRTUAL if pp > 1 else (1,))
                if m.layers >= pp * v and (v == 1 or m.layers % (pp * v) == 0 or (m.layers + 2) % (pp * v) == 0)]
    mbs = [mb for mb in only("micro_batch", MICRO_BATCHES) if per_rank % mb == 0]
    for virtual, mb, zero in itertools.product(virtuals, mbs, only("zero", (0, 1, 2, 3))):
        shards = [None] + ([c.per_node] if zero and c.rings and dp > c.per_node and dp % c.per_node == 0 else [])
        for shard, ep, rc in itertools.product(shards, eps, only("recompute", RECOMPUTE)):
            yield dataclasses.replace(base, tp=tp, pp=pp, virtual=virtual, micro_batch=mb, zero=zero, shard=shard,
                                      ep=ep, recompute=rc, sp=tp > 1, cp=cp)


def runs_on_shardwise(st: Strategy) -> str | None:
    """The ``shardwise train`` flags that run ``st`` today, or None where it needs what shardwise does
    not build yet (pipelines, hybrid sharding, context parallelism, FP8, recomputation other than none, experts folded
    over tp)."""
    if st.pp > 1 or st.shard is not None or st.recompute != "none" or st.cp > 1 or st.fp8 or st.tp > (st.etp or st.tp):
        return None
    flags = [f"--strategy {'ddp' if st.zero == 0 else f'zero{st.zero}'}"]
    if st.tp > 1:
        flags.append(f"--tp {st.tp}" + (" --sp" if st.sp else ""))
    if st.ep > 1:
        flags.append(f"--ep {st.ep}")
    flags.append(f"--batch {st.micro_batch}")
    return " ".join(flags)


Found = collections.namedtuple("Found", "strategy estimate")

def search(m: ModelSpec, c: ClusterSpec, base: Strategy, top: int = 5,
           space: dict | None = None) -> tuple[list[Found], dict]:
    """The ``top`` fastest layouts that fit, fastest first, and what the search did: how many layouts
    it weighed, how many fit, its seconds, and the least memory any layout needs (with its strategy)."""
    t0 = time.perf_counter()
    fits: list[Found] = []
    weighed, least = 0, None
    for st in layouts(m, c, base, space=space):
        try:
            e = estimate(m, c, st)
        except ValueError:
            continue
        weighed += 1
        if least is None or e.memory["total"] < least.estimate.memory["total"]:
            least = Found(st, e)
        if e.fits:
            fits.append(Found(st, e))
    fits.sort(key=lambda f: (f.estimate.step_s, f.estimate.memory["total"]))  # ties: the smaller
    return fits[:top], {"weighed": weighed, "fit": len(fits), "seconds": time.perf_counter() - t0, "least": least}


def to_fit(m: ModelSpec, spec: str, base: Strategy, most: int = 64, space: dict | None = None,
           fabric: str | None = None) -> tuple[str, Found] | None:
    """Where no layout fits ``spec`` (``NODE:COUNT``): the smallest power-of-two multiple of its nodes
    (up to ``most`` times) on which one does, and the fastest layout that fits there. None where the
    cluster is not given by nodes or no multiple helps."""
    name, _, count = spec.partition(":")
    for k in _powers(most)[1:] if count.isdigit() else []:  # 2, 4, ... up to most
        bigger = f"{name}:{int(count) * k}"
        top, _ = search(m, cluster(bigger, fabric), base, top=1, space=space)
        if top:
            return bigger, top[0]
    return None


def describe(st: Strategy) -> str:
    return (f"tp={st.tp}{' sp' if st.sp and st.tp > 1 else ''} pp={st.pp}"
            + (f" v={st.virtual}" if st.virtual > 1 else "") + f" zero{st.zero}"
            + (f" shard={st.shard}" if st.shard else "") + (f" ep={st.ep}" if st.ep > 1 else "")
            + (f" etp={st.etp}" if st.etp and st.ep > 1 else "") + (f" cp={st.cp}" if st.cp > 1 else "")
            + f" mb={st.micro_batch} recompute={st.recompute}")
