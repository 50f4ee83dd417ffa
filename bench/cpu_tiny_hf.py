"""shardwise (zero3, ddp; the FX executor) against FSDP2 eager on tiny Hugging Face causal LMs, 2 gloo ranks.

Every system trains the same model (hidden 64, 2 layers, vocabulary 256, from one seed) on the same
batches per rank with AdamW. Systems are timed interleaved, a few steps each per round, the order
reversed every other round, so that background load hits them alike; a step's time is the slowest
rank's, and the table gives each system's median (and 20th percentile) with its ratio to FSDP2 in
the same run.

    python bench/cpu_tiny_hf.py [--models llama,qwen2,mistral,gpt2] [--batch 2] [--seq 32] [--threads 1]
                                [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 256


def build(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    cls = {"llama": (tf.LlamaForCausalLM, tf.LlamaConfig), "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config),
           "mistral": (tf.MistralForCausalLM, tf.MistralConfig)}[kind]
    return cls[0](cls[1](**common))


def batch(step: int, rank: int, size: int, seq: int) -> dict:
    ids = torch.randint(0, VOCAB, (size, seq), generator=torch.Generator().manual_seed(step * 1009 + rank * 7 + 1))
    return {"input_ids": ids, "labels": ids.clone()}


def fsdp2(kind: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = build(kind)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (m.transformer.h if hasattr(m, "transformer") else m.model.layers):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step(b):
        loss = m(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def shardwise(kind: str, strategy: str):
    import shardwise as sw

    job = sw.compile(build(kind), optimizer=lambda named: torch.optim.AdamW(named, lr=1e-3), strategy=strategy,
                     mesh=sw.mesh())
    return job.step


def worker(rank: int, ws: int, store: str, args, q) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=300))
    out = {}
    for kind in args.models.split(","):
        systems = {"fsdp2": fsdp2(kind), **{f"shardwise-{s}": shardwise(kind, s) for s in ("zero3", "ddp")}}
        times = {k: [] for k in systems}
        steps = dict.fromkeys(systems, 0)

        def run(name, n, record):
            for _ in range(n):
                b = batch(steps[name], rank, args.batch, args.seq)
                steps[name] += 1
                dist.barrier()
                t0 = time.perf_counter()
                float(systems[name](b))
                if record:
                    times[name].append(time.perf_counter() - t0)

        for name in systems:
            run(name, args.warmup, False)
        for r in range(args.rounds):
            for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                run(name, args.per_round, True)
        for name, ts in times.items():
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            out[f"{kind}/{name}"] = t.tolist()
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,qwen2,mistral,gpt2")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the per-step times here")
    args = ap.parse_args()
    store = os.path.join(tempfile.mkdtemp(prefix="cpu-tiny-hf-"), "store")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, store, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"2 gloo ranks, {args.threads} thread(s) each, batch {args.batch}x{args.seq} per rank: ms/step, median "
          f"(20th percentile) of {args.rounds * args.per_round} steps, the slowest rank's; ratio to FSDP2")
    rows = {}
    for key, ts in res.items():
        kind, name = key.split("/")
        ms = sorted(t * 1e3 for t in ts)
        rows[key] = {"median_ms": statistics.median(ms), "p20_ms": ms[len(ms) // 5]}
    for key, r in rows.items():
        kind = key.split("/")[0]
        ratio = r["median_ms"] / rows[f"{kind}/fsdp2"]["median_ms"]
        r["vs_fsdp2"] = ratio
        print(f"{key:28s} {r['median_ms']:7.2f} ({r['p20_ms']:6.2f})  x{ratio:5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows, "steps_s": res}, f, indent=1)


if __name__ == "__main__":
    main()
