"""Shared pieces of the parity tests: deterministic data, the single-device reference, rank runs."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models import PRESETS, build

DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
LR = 1e-2


def make_model(name: str, dtype: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    return build(name, "tiny", **over).to(DTYPES[dtype])


def make_batch(name: str, step: int, rank: int, batch: int = 2, seed: int = 0):
    cfg = PRESETS[name]["tiny"]
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    tok = torch.randint(0, cfg["vocab"], (batch, cfg["seq"] + 1), generator=g)
    return (tok[:, :-1].contiguous(), tok[:, 1:].contiguous())


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def reference(name: str, dtype: str, ws: int, steps: int, over: tuple = ()):
    """Single-process eager training: each step averages the gradients of ws micro-batches (DDP).

    Runs single-threaded like the pool's ranks: CPU kernels reduce in an order that depends on the
    thread count, and AdamW turns that rounding noise in a mathematically-zero gradient (GPT's key
    bias: softmax ignores a per-row shift) into visible parameter differences.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(name, dtype, ws, steps, over)
    finally:
        torch.set_num_threads(threads)


def _reference(name, dtype, ws, steps, over):
    model = make_model(name, dtype, **dict(over))
    opt = adamw(list(model.named_parameters()))
    losses = []
    for s in range(steps):
        acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        tot = 0.0
        for r in range(ws):
            loss = model(*make_batch(name, s, r))
            grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
            for (n, _), g in zip(model.named_parameters(), grads):
                if g is not None:
                    acc[n] += g
            tot += loss.item()
        for n, p in model.named_parameters():
            p.grad = acc[n] / ws
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(tot / ws)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_run(name: str, strategy: str, dtype: str, steps: int, over: tuple = (), compile=None):
    """Run on every rank of the pool; returns (losses, full_state_dict on rank 0, job summary)."""
    model = make_model(name, dtype, **dict(over))
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh(), compile=compile)
    rank = dist.get_rank()
    losses = [float(job.step(make_batch(name, s, rank))) for s in range(steps)]
    sd = job.full_state_dict()
    counts = job.programs()[0].counts()
    return losses, sd, counts


def mismatched_batches():
    """Rank 1 passes a longer batch than rank 0: every rank must raise, none may hang."""
    model = make_model("gpt", "fp32")
    job = sw.compile(model, optimizer=adamw, strategy="zero3", mesh=sw.mesh())
    rank = dist.get_rank()
    x, y = make_batch("gpt", 0, rank, batch=2 + rank)
    job.step((x, y))


def bad_mesh(dp):
    sw.mesh(dp=dp)


def measured_peak(strategy: str, over: tuple = ()):
    """(peak bytes on this rank during step 2, parameter bytes) for a model whose state dwarfs its activations."""
    from shardwise.runtime.memory import measure

    torch.manual_seed(0)
    model = build("llama", "small", **dict(over))
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (1, 8), generator=g)
    job.step((x, x))
    _, peak = measure(job, lambda: job.step((x, x)))
    return peak, sum(p.numel() * 4 for p in model.parameters())


def bf16_vs_fsdp2(name: str, steps: int, strategy: str = "zero3"):
    """bf16 compute, fp32 master and reduction: shardwise and FSDP2 from the same weights and data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, ws = dist.get_rank(), dist.get_world_size()
    policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = make_model(name, "fp32")
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh(),
                     mixed_precision=sw.MixedPrecision(**policy))
    ours = [float(job.step(make_batch(name, s, rank))) for s in range(steps)]
    sd = job.full_state_dict(rank0_only=False)

    ref = make_model(name, "fp32")
    mesh = init_device_mesh("cpu", (ws,))
    mp = MixedPrecisionPolicy(**policy)
    for blk in ref.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(ref, mesh=mesh, mp_policy=mp)
    opt = adamw(list(ref.named_parameters()))
    theirs = []
    for s in range(steps):
        loss = ref(*make_batch(name, s, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        red = loss.detach().float().clone()
        dist.all_reduce(red)
        theirs.append(float(red) / ws)
    ref_sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in ref.state_dict().items()}
    errs = {k: float((sd[k] - ref_sd[k]).norm() / ref_sd[k].norm().clamp_min(1e-30)) for k in ref_sd}
    return ours, theirs, errs


def make_hf(kind: str, dtype: str = "fp64"):
    """A tiny HF model with random weights (no download)."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    return model.to(DTYPES[dtype])


def hf_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 1009 + rank)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


@functools.lru_cache(maxsize=None)
def hf_reference(kind: str, ws: int, steps: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_hf(kind)
        opt = adamw(list(model.named_parameters()))
        losses = []
        for s in range(steps):
            tot = 0.0
            for r in range(ws):
                loss = model(**hf_batch(s, r)).loss / ws
                loss.backward()
                tot += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(tot)
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def hf_run(kind: str, strategy: str, steps: int):
    model = make_hf(kind)
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    rank = dist.get_rank()
    losses = [float(job.step(hf_batch(s, rank))) for s in range(steps)]
    return losses, job.full_state_dict()
