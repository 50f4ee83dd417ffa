"""The fused liveness model (costmodel/memory.py) against what it models, on this CPU machine.

    python bench/memory_model_check.py inductor   # small Llama/GPT steps: inductor's own buffers vs the model
    python bench/memory_model_check.py repredict  # the 1.1B Llama peaks of the H200 sittings, re-predicted

``inductor`` compiles each step with inductor on the CPU and measures the most bytes its generated
code holds at once (runtime.memory.inductor_wrapper_peak), beside ``liveness(fused=True)`` of the
same graph. ``repredict`` traces the 1.1B Llama steps of bench/results/2026-11-30-h200x2-*.json
(batch 4x2048, bf16, zero3 at one and two ranks, with and without ``budget_gb=120`` and
checkpointing) and predicts their peak with inductor's CUDA code rules (``cpu_code=False``) and
CUDA's foreach AdamW: resident state + the larger of the graph's live peak and the optimizer step.
Both print one line per case (results: bench/results/2026-11-30-h200x2-sitting2-summary.md).
"""

from __future__ import annotations

import sys

import torch

import shardwise as sw
from shardwise.costmodel import liveness
from shardwise.costmodel.optimizer import step_temporaries
from shardwise.runtime.launch import spawn


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-4)


def inductor() -> None:
    from shardwise.runtime.memory import inductor_wrapper_peak

    cases = [("llama", {}), ("llama", {"bf16": False}), ("llama", {"checkpoint": True}), ("gpt", {}),
             ("gpt", {"bf16": False}), ("llama", {"strategy": "ddp"})]
    for name, over in cases:
        over = dict(over)
        bf16, strategy = over.pop("bf16", True), over.pop("strategy", "zero3")
        torch.manual_seed(0)
        model = sw.models.build(name, "small", d_model=256, n_layer=4, vocab=4000, seq=256,
                                **({"ffn": 1024} if name == "llama" else {}), **over)
        mp = sw.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
        job = sw.compile(model, optimizer=_adamw, strategy=strategy, mesh=sw.mesh(dp=1), compile="inductor",
                         mixed_precision=mp)
        x = torch.randint(0, 4000, (2, 256))
        job.step((x, x))
        measured = inductor_wrapper_peak(lambda: job.step((x, x)))["peak"]
        model_peak = liveness(job.compiled((x, x)).program.gm, fused=True).peak
        print(f"{name} {'bf16' if bf16 else 'fp32'} {strategy}{' checkpointed' if over else ''}: inductor "
              f"{measured / 2**20:.2f} MiB, model {model_peak / 2**20:.2f} MiB ({model_peak / measured - 1:+.1%})",
              flush=True)


def _repredict(budget_gb: float, checkpoint: bool) -> None:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = sw.models.build("llama", "1b", checkpoint=checkpoint)
    kw = {"memory_budget": int(budget_gb * 2**30)} if budget_gb else {}
    job = sw.compile(model, optimizer=_adamw, strategy="zero3", mesh=sw.mesh(), compile="inductor",
                     mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16), **kw)
    x = torch.randint(0, model.cfg.vocab, (4, 2048))
    prog, _ = job.compiled((x, x))
    graph = liveness(prog.gm, fused=True, cpu_code=False)
    resident = sum(job.resident_bytes().values())
    shards = [p.numel() * p.element_size() for g in job.optimizer.param_groups for p in g["params"]]
    step = graph.outputs + step_temporaries(shards, {"foreach": True}, "cuda")  # the gradients + one list
    if dist.get_rank() == 0:
        what = f"ws={dist.get_world_size()} zero3" + (f" budget_gb={budget_gb:g}" if budget_gb else "") \
            + (" checkpointed" if checkpoint else "")
        print(f"{what}: resident {resident / 1e9:.2f} GB + max(graph {graph.peak / 1e9:.2f}, optimizer step "
              f"{step / 1e9:.2f}) = {(resident + max(graph.peak, step)) / 1e9:.2f} GB", flush=True)


def repredict() -> None:
    for nproc, budget, ckpt in [(1, 0, False), (2, 0, False), (2, 120, False), (2, 120, True)]:
        spawn(_repredict, nproc, budget, ckpt)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what not in ("inductor", "repredict"):
        raise SystemExit("usage: python bench/memory_model_check.py inductor|repredict")
    {"inductor": inductor, "repredict": repredict}[what]()
