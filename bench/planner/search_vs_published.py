"""The planner's layout search against the published layouts of the validation table (bench/results/2026-12-02-plan-search.md): searched over what the framework ran (ZeRO 0, its recomputation; vTrain: no interleaving), its top layout's predicted step over the published one's. Run: python bench/planner/search_vs_published.py"""

from shardwise.planner.search import search, describe
from shardwise.planner.clusters import cluster
from shardwise.planner.estimate import Strategy, estimate
from shardwise.planner import validation as V
print("| run | published layout | predicted s | search's top (same framework) | predicted s | top / published |")
print("| --- | --- | --- | --- | --- | --- |")
for r in V.RUNS:
    if r.strategy.zero == 0 and (r.strategy.pp > 1 or r.strategy.tp > 1) and (r.source == "vtrain" or "selective" in r.label):
        c = cluster(r.cluster); st = r.strategy
        pub = estimate(r.model, c, st)
        space = {"zero": [0], "recompute": [st.recompute]} | ({"virtual": [1]} if r.source == "vtrain" else {})
        top, _ = search(r.model, c, Strategy(global_batch=st.global_batch, seq=st.seq, fused_attention=st.fused_attention), space=space)
        b = top[0]
        print(f"| {r.label[:48]} | {describe(st)} | {pub.step_s:.2f} | {describe(b.strategy)} | {b.estimate.step_s:.2f} | {b.estimate.step_s / pub.step_s:.3f} |")
