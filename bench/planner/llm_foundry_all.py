"""Every row of llm-foundry's BF16 benchmark tables (scripts/train/benchmarking/README.md of mosaicml/llm-foundry,
commit 495218376: H100 80GB, A100 80GB and A100 40GB, 125M to 70B, 8 to 128 GPUs, sequences 512 to 65,536;
llm_foundry_tables.csv) against ``shardwise plan``, with MPT's Triton attention at its own rate (``--attention
triton-2022``) and as the device's flash attention. The validation table (planner/data/runs.toml) holds 30 of these
rows; two of them fit the kernel's rates. Run anywhere (no GPU):
    python bench/planner/llm_foundry_all.py [--rows]
"""

import collections
import csv
import os
import sys

from shardwise.planner.clusters import cluster
from shardwise.planner.estimate import Strategy, estimate
from shardwise.planner.models import ModelSpec

# d_model, n_heads, n_layers of scripts/train/yamls/pretrain/mpt-<size>.yaml (expansion ratio 4, vocabulary 50,368)
SIZES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
         "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
NODES = {"h100": "dgx-h100", "a100": "dgx-a100", "a100-40gb": "dgx-a100-40gb"}


def rows():
    with open(os.path.join(os.path.dirname(__file__), "llm_foundry_tables.csv"), newline="") as f:
        yield from csv.DictReader(f)


def predict(r, attention):
    h, heads, layers = SIZES[r["model"]]
    seq, gpus = int(r["seq"]), int(r["gpus"])
    m = ModelSpec(f"mpt-{r['model']}", layers, h, heads, heads, 4 * h, 50368, seq=seq, gated=False, tied=True,
                  bias=True, learned_positions=seq)
    assert abs(m.params() / int(r["params"]) - 1) < 1e-3, (r, m.params())  # the table's NumParams
    st = Strategy(zero=3 if r["sharding"] == "FULL_SHARD" else 2, micro_batch=int(r["micro_batch"]),
                  global_batch=int(r["global_batch"]), seq=seq, recompute="block" if r["checkpointing"] == "True"
                  else "none", reduce_fp32=r["mp_mode"] == "DEFAULT", attention=attention)
    measured = int(r["global_batch"]) * seq / gpus / float(r["tokens_per_s_per_gpu"])
    return estimate(m, cluster(f"{NODES[r['gpu']]}:{gpus // 8}"), st).step_s / measured - 1


def main():
    table = list(rows())
    kernels = (None, "triton-2022")
    errors = [[predict(r, a) for a in kernels] for r in table]  # each row's error under each attention, once
    for i, attention in enumerate(kernels):
        groups = collections.defaultdict(list)
        for r, e in zip(table, errors):
            for key in (r["gpu"] + (" x8" if r["gpus"] == "8" else " >8"), "all"):
                groups[key].append(abs(e[i]))
        print(f"attention {attention or 'flash (the device default)'}:")
        for key, errs in sorted(groups.items()):
            errs.sort()
            print(f"  {key:14} {len(errs):4} rows, {sum(e <= 0.10 for e in errs):4} within 10%, "
                  f"median |error| {100 * errs[len(errs) // 2]:.1f}%")
    if "--rows" in sys.argv:
        for r, (flash, triton) in zip(table, errors):
            print(f"{r['gpu']:10} {r['model']:5} {r['gpus']:>4} GPUs seq {r['seq']:>6} {r['micro_batch']:>3}x"
                  f"{r['accum']:<3} ckpt {r['checkpointing']:5} {flash:+7.1%} {triton:+7.1%}")


if __name__ == "__main__":
    main()
