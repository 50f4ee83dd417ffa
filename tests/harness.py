"""Shared pieces of the parity tests: deterministic data, the single-device reference, rank runs."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models import PRESETS, build

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
LR = 1e-2


def make_model(name: str, dtype: str, seed: int = 0, freeze: tuple = (), **over):
    torch.manual_seed(seed)
    model = build(name, "tiny", **over).to(DTYPES[dtype])
    for n, p in model.named_parameters():
        if n in freeze:
            p.requires_grad_(False)
    return model


def make_batch(name: str, step: int, rank: int, batch: int = 2, seed: int = 0):
    cfg = PRESETS[name]["tiny"]
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    tok = torch.randint(0, cfg["vocab"], (batch, cfg["seq"] + 1), generator=g)
    return (tok[:, :-1].contiguous(), tok[:, 1:].contiguous())


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def reference(name: str, dtype: str, ws: int, steps: int, over: tuple = (), micro: int = 1, device: str = "cpu"):
    """Single-process eager training: each step averages the gradients of ws micro-batches (DDP).

    Runs single-threaded like the pool's ranks: CPU kernels reduce in an order that depends on the
    thread count, and AdamW turns that rounding noise in a mathematically-zero gradient (GPT's key
    bias: softmax ignores a per-row shift) into visible parameter differences.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(name, dtype, ws, steps, over, micro, device)
    finally:
        torch.set_num_threads(threads)


def _reference(name, dtype, ws, steps, over, micro, device):
    model = make_model(name, dtype, **dict(over)).to(device)
    train = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = adamw(train)
    losses = []
    for s in range(steps):
        acc = {n: torch.zeros_like(p) for n, p in train}
        tot = 0.0
        for r in range(ws):
            for m in range(micro):
                loss = model(*(t.to(device) for t in make_batch(name, s * micro + m, r)))
                grads = torch.autograd.grad(loss, [p for _, p in train], allow_unused=True)
                for (n, _), g in zip(train, grads):
                    if g is not None:
                        acc[n] += g
                tot += loss.item()
        for n, p in train:
            p.grad = acc[n] / (ws * micro)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(tot / (ws * micro))
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def train_run(name: str, strategy: str, dtype: str, steps: int, over: tuple = (), compile=None, micro: int = 1,
              seed: int | None = None, device: str = "cpu", shard_bucket_mb: float | str | None = "auto", schedule: bool = True,
              mesh_kw: tuple = (), **compile_kw):
    """Run on every rank of the pool; returns (losses, full_state_dict on rank 0, job summary).

    ``seed=None`` builds the same weights on every rank; ``seed="rank"`` gives each rank other
    weights (the job must start every rank from rank 0's). ``mesh_kw``: the mesh's axes (the batch
    still goes by the global rank: every rank but a tp group's takes its own)."""
    rank = dist.get_rank()
    model = make_model(name, dtype, seed=rank if seed == "rank" else 0, **dict(over)).to(device)
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh(device=device, **dict(mesh_kw)), compile=compile,
                     shard_bucket_mb=shard_bucket_mb, schedule=schedule, **compile_kw)
    losses = []
    for s in range(steps):
        mbs = [tuple(t.to(device) for t in make_batch(name, s * micro + m, rank)) for m in range(micro)]
        losses.append(float(job.step(mbs if micro > 1 else mbs[0])))
    sd = job.full_state_dict()
    counts = job.programs()[0].counts()
    counts["carved"] = job.programs()[0].carved
    counts["carve_choice"] = job.programs()[0].carve_choice
    return losses, sd, counts


def set_carve_min_s(v: float) -> float:
    """Set the shortest product the carveout carves on this rank (``passes.carveout.CARVE_MIN_S``);
    returns what it was. The test models' products take a few µs on a GPU, under the default."""
    from shardwise.passes import carveout

    old, carveout.CARVE_MIN_S = carveout.CARVE_MIN_S, v
    return old


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
    """(peak bytes on this rank during step 2, parameter bytes) for a model whose state dwarfs its
    activations, one collective per parameter (the ZeRO paper's accounting: each gradient lives until
    its own reduce-scatter)."""
    from shardwise.runtime.memory import measure

    torch.manual_seed(0)
    model = build("llama", "small", **dict(over))
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh(), shard_bucket_mb=0)
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
    elif kind.startswith("mixtral"):  # mixtral-<experts implementation>[-aux]: grouped_mm, batched_mm, eager
        impl, _, aux = kind.split("-", 1)[1].partition("-")
        cfg = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                               num_local_experts=4, num_experts_per_tok=2,
                               output_router_logits=bool(aux), router_aux_loss_coef=0.02)
        model = tf.MixtralForCausalLM(cfg)
        model.set_experts_implementation(impl)
    elif kind == "qwen2_moe":  # routed experts and a gated shared expert
        cfg = tf.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=32, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1)
        model = tf.Qwen2MoeForCausalLM(cfg)
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
def hf_reference(kind: str, ws: int, steps: int, dtype: str = "fp64", capacity: float | None = None):
    """Eager single-device training, each step averaging ws micro-batches. ``capacity``: every experts
    module under GShard's capacity rule on one device (passes/ep.py ``capacity_dispatch`` without
    ranks), each micro-batch dispatched alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_hf(kind, dtype)
        if capacity is not None:
            from shardwise.passes.ep import capacity_dispatch, hf_experts

            for _, m in hf_experts(model):
                m.forward = lambda h, i, w, _m=m: capacity_dispatch(_m, h, i, w, capacity, 1, None)
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


def hf_run(kind: str, strategy: str, steps: int, dtype: str = "fp64"):
    model = make_hf(kind, dtype)
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    rank = dist.get_rank()
    losses = [float(job.step(hf_batch(s, rank))) for s in range(steps)]
    return losses, job.full_state_dict()


def hf_tp_run(kind: str, strategy: str, steps: int, tp: int, dtype: str = "fp64", **compile_kw):
    """``hf_run`` on a mesh of dp x ``tp`` ranks: (losses, full_state_dict, tp collectives by kind and phase, layer 0's
    local parameter shapes)."""
    from collections import Counter

    from shardwise.sharding.collective import collective_of

    mesh = sw.mesh(tp=tp)
    job = sw.compile(make_hf(kind, dtype), optimizer=adamw, strategy=strategy, mesh=mesh, **split_head(compile_kw, tp))
    losses = [float(job.step(hf_batch(s, mesh.rank("dp")))) for s in range(steps)]
    prog = job.programs()[0]
    cs = [collective_of(n) for n in prog.collective_nodes()]
    shapes = {n: tuple(s) for n, s in zip(prog.capture.param_names, prog.capture.param_shapes) if ".layers.0." in n}
    return losses, job.full_state_dict(), Counter((c.kind, c.phase) for c in cs if c.axis == "tp"), shapes


def rel_param_err(sd, ref):
    return max(((sd[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item() for k in ref)


def check(pools, name, strategy, dtype, ws, steps, over=(), compile=None, loss_tol=None, param_tol=None,
          micro=1, seed=None, device="cpu", backend="gloo", ref_device="cpu", shard_bucket_mb="auto", schedule=True,
          **compile_kw):
    """Train on ``ws`` pool ranks and hold losses and final weights to the single-device reference."""
    ref_losses, ref_sd = reference(name, dtype, ws, steps, over, micro, ref_device)
    pool = pools(ws, backend)
    losses, sd, counts = pool.run(train_run, name, strategy, dtype, steps, over, compile, micro, seed, device,
                                  shard_bucket_mb, schedule, **compile_kw)[0]
    assert set(sd) == set(ref_sd)
    dl = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    dp = rel_param_err(sd, ref_sd)
    assert dl <= loss_tol, f"losses differ by {dl:.3e} (relative) > {loss_tol}"
    assert dp <= param_tol, f"parameters differ by {dp:.3e} (relative norm) > {param_tol}"
    # the run actually trained: parameters moved away from their initial values
    init = make_model(name, dtype, **dict(over)).state_dict()
    assert rel_param_err(sd, init) > 1e-3
    check.counts = counts  # rank 0's program: its collectives (and carved products) for the caller
    return sd, ref_sd


def dropout_and_eval(strategy: str):
    """Dropout on: training runs and differs from a dropout-free run; eval is deterministic."""
    rank = dist.get_rank()
    model = make_model("gpt", "fp64", dropout=0.2)
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    batch = make_batch("gpt", 0, rank)
    e0, e1 = float(job.eval_step(batch)), float(job.eval_step(batch))
    train = [float(job.step(batch)) for _ in range(3)]
    return e0, e1, train


def eval_and_export(strategy: str, steps: int):
    rank = dist.get_rank()
    model = make_model("llama", "fp64")
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    for s in range(steps):
        job.step(make_batch("llama", s, rank))
    evals = float(job.eval_step(make_batch("llama", 100 + rank, rank)))  # each rank its own batch
    return evals, job.full_state_dict()


class RankDependent(torch.nn.Module):
    """A model whose graph differs on rank 1 (or fails to trace there): ranks must all stop."""

    def __init__(self, fail: bool):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.fail = fail

    def forward(self, x):
        y = self.lin(x)
        if dist.get_rank() == 1:
            y = y[y > 0] if self.fail else y * 2
        return y.pow(2).mean()


def rank_dependent_graph(fail: bool):
    job = sw.compile(RankDependent(fail), optimizer=adamw, strategy="zero3", mesh=sw.mesh())
    job.step(torch.ones(2, 4))


# -- the training loop of issue 3: accumulation, clipping, schedule, groups, eval, export ----------

LOOP = dict(micro=4, clip=0.3, warmup=2)


def loop_opt(named):
    from shardwise.recipes import adamw_groups

    return adamw_groups(named, lr=LR, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def loop_reference(name: str, dtype: str, ws: int, steps: int, over: tuple = ()):
    """Single device: ws*micro micro-batches averaged, clip_grad_norm_, cosine warm-up, two groups."""
    from shardwise.recipes import cosine_with_warmup

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(name, dtype, **dict(over))
        opt = loop_opt(model.named_parameters())
        sched = cosine_with_warmup(opt, LOOP["warmup"], steps)
        losses, norms = [], []
        k = LOOP["micro"]
        for s in range(steps):
            tot = 0.0
            for r in range(ws):
                for m in range(k):
                    loss = model(*make_batch(name, s * k + m, r)) / (ws * k)
                    loss.backward()
                    tot += loss.item()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), LOOP["clip"])))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(tot)
        model.eval()
        with torch.no_grad():
            ev = sum(float(model(*make_batch(name, 10_000 + r, r))) for r in range(ws)) / ws
        return losses, norms, ev, {k_: v.detach().clone() for k_, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def loop_run(name: str, strategy: str, dtype: str, steps: int, tp: int | None = None, over: tuple = (),
             ep: int | None = None, **compile_kw):
    """The loop of ``loop_reference`` on a mesh of dp x ``ep`` x ``tp`` ranks (a tp group takes the
    batches of its dp and ep coordinates)."""
    from shardwise.recipes import cosine_with_warmup

    model = make_model(name, dtype, **dict(over))
    mesh = sw.mesh(tp=tp, ep=ep)
    rank = mesh.batch_rank()
    job = sw.compile(model, optimizer=loop_opt, strategy=strategy, mesh=mesh, clip_grad_norm=LOOP["clip"],
                     **split_head(compile_kw, tp))
    sched = cosine_with_warmup(job.optimizer, LOOP["warmup"], steps)
    k = LOOP["micro"]
    losses, norms = [], []
    for s in range(steps):
        losses.append(float(job.step([make_batch(name, s * k + m, rank) for m in range(k)])))
        norms.append(float(job.last_grad_norm))
        sched.step()
    ev = float(job.eval_step(make_batch(name, 10_000 + rank, rank)))
    return losses, norms, ev, job.full_state_dict()


def tp_peak(tp: int | None, sp: bool, strategy: str = "ddp", batch: int = 4):
    """(measured peak bytes of a step on this rank, the predicted peak, parameter bytes on this rank) of
    the small Llama on a mesh of ``tp`` tensor-parallel ranks (with sequence parallelism: ``sp``)."""
    from shardwise.runtime.memory import measure

    torch.manual_seed(0)
    model = build("llama", "small")
    mesh = sw.mesh(tp=tp)
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=mesh,
                     **({"sequence_parallel": True} if sp else {}), **split_head({}, tp))
    g = torch.Generator().manual_seed(mesh.rank("dp"))
    x = torch.randint(0, 256, (batch, 65), generator=g)
    b = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
    predicted = job.predict_memory(b)["peak"]
    job.step(b)
    _, peak = measure(job, lambda: job.step(b))
    return peak, predicted, sum(t.numel() * t.element_size() for t in job.state.opt_tensors.values())


def accumulation_peak(strategy: str, micro: int = 4):
    """(peak bytes on this rank during a step of ``micro`` micro-batches, fp32 parameter bytes)."""
    from shardwise.runtime.memory import measure

    torch.manual_seed(0)
    model = build("llama", "small")
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    rank = dist.get_rank()
    mbs = [torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(rank * 10 + m)) for m in range(micro)]
    job.step([(x, x) for x in mbs])
    _, peak = measure(job, lambda: job.step([(x, x) for x in mbs]))
    return peak, sum(p.numel() * 4 for p in model.parameters())


def explain_text(strategy: str):
    """``explain`` of a tiny Llama with one collective per parameter (a row each in the table)."""
    model = make_model("llama", "fp32")
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh(), link_profile="h200-nv18-x2",
                     shard_bucket_mb=0)
    job.step(make_batch("llama", 0, dist.get_rank()))
    return job.explain()


def predicted_and_measured_peak(strategy: str, name: str, batch: int, seq: int):
    """(predicted peak before the first step, predicted after it, measured peak of step 2) on this rank."""
    from shardwise.runtime.memory import measure

    torch.manual_seed(0)
    model = build(name, "small")
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, 256, (batch, seq), generator=g)
    before = job.predict_memory((x, x))["peak"]
    job.step((x, x))
    after = job.predict_memory((x, x))["peak"]
    _, peak = measure(job, lambda: job.step((x, x)))
    return before, after, peak


def measured_prediction():
    """(measured node times, predicted step with them, profiler measurement of one real step)."""
    model = make_model("gpt", "fp32")
    job = sw.compile(model, optimizer=adamw, strategy="zero3", mesh=sw.mesh())
    b = make_batch("gpt", 0, dist.get_rank())
    job.time_optimizer = True
    job.step(b)
    assert job.predict_step(b)["compute_source"] == "roofline"
    times = job.profile_compute(b)
    pred = job.predict_step(b)
    pred.pop("timeline")
    _, meas = job.profile_step(b)
    return times, pred, meas


def overlapped_update_prediction():
    """(forward's idle compute time, [(update s, predicted step, graph s)]) of zero3 with overlap_update,
    predicted as on CUDA (the update stream stood in for)."""
    from shardwise.capture import forward_nodes

    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(),
                     overlap_update=True)
    b = make_batch("llama", 0, dist.get_rank())
    job.step(b)
    job.updater.stream = "a CUDA stream"  # only the prediction reads it here
    prog, _ = job.compiled(b)
    tl = job.predict_step(b)["timeline"]
    # idle: the part of the time to the forward's end that the compute lane is not busy
    seen = {n.name for n in forward_nodes(prog.gm)}
    fwd_end = max(e for k, name, _, e in tl.events if k == "compute" and name in seen)
    idle = fwd_end - sum(e - s for k, _, s, e in tl.events if k == "compute" and e <= fwd_end)
    out = []
    for opt in (idle / 2, 10.0):
        job.last_optimizer_s = opt
        pred = job.predict_step(b)
        out.append((opt, pred["step_s"], pred["graph_s"]))
    job.updater.stream = None
    return idle, out


def rank_dependent_plan():
    """Same model and batch on every rank, but rank 1 buckets differently: the same captured graph,
    a different plan."""
    model = make_model("gpt", "fp32")
    job = sw.compile(model, optimizer=adamw, strategy="zero3", mesh=sw.mesh(),
                     shard_bucket_mb=0 if dist.get_rank() == 0 else None)
    job.step(make_batch("gpt", 0, dist.get_rank()))


def budget_run(budget, recompute=False, with_recomputed=False):
    """(planned unsharded params, collective counts, predicted peak, measured peak) under a budget."""
    from shardwise.runtime.memory import measure

    job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(), memory_budget=budget,
                     recompute=recompute)
    b = make_batch("llama", 0, dist.get_rank())
    job.step(b)
    prog = job.programs()[0]
    pred = job.predict_memory(b)["peak"]
    _, peak = measure(job, lambda: job.step(b))
    if with_recomputed:
        return prog.unsharded, prog.recomputed, pred, peak
    return prog.unsharded, prog.counts(), pred, peak


def budget_error(strategy: str, budget: int):
    """A step of the tiny fp64 Llama under ``strategy`` and ``memory_budget`` (the test expects a BudgetError)."""
    job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy=strategy, mesh=sw.mesh(), memory_budget=budget)
    job.step(make_batch("llama", 0, dist.get_rank()))


def act_offload_plan(budget=None, **kw):
    """(offloaded, recomputed, predicted graph peak, the step program) of a zero3 llama step."""
    job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(),
                     memory_budget=budget, **kw)
    b = make_batch("llama", 0, dist.get_rank())
    job.step(b)
    prog = job.programs()[0]
    return prog.offloaded or [], prog.recomputed or [], job.predict_memory(b)["graph_peak"], \
        job.predict_memory(b)["peak"]


def offload_facts():
    job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(),
                     offload_optimizer=True, offload_chunk_mb=1 / 64)
    moved = []
    for s in range(2):
        job.step(make_batch("llama", s, dist.get_rank()))
        moved.append(job.state.streamer.bytes_moved)
    return moved, job.state.streamer.host_bytes(), job.resident_bytes(), len(job.state.streamer.chunks)


def residency_facts(budget):
    """Offload under a budget: (names kept on the device, all names, bytes moved by step 2, host bytes,
    device bytes of the kept state)."""
    job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(),
                     offload_optimizer=True, offload_chunk_mb=1 / 64, memory_budget=budget)
    job.replan_at = 0  # compare against the first plan alone
    st = job.state.streamer
    job.step(make_batch("llama", 0, dist.get_rank()))
    before = st.bytes_moved
    job.step(make_batch("llama", 1, dist.get_rank()))
    return (job.programs()[0].resident_state, list(st.params), st.bytes_moved - before, st.host_bytes(),
            st.device_bytes())


def grad_dtypes(**kw):
    """dtypes of the step program's gradient outputs at one rank under bf16 compute."""
    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(dp=1),
                     mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16), **kw)
    job.step(make_batch("llama", 0, 0))
    out = job.programs()[0].gm.graph.find_nodes(op="output")[0].args[0]
    return {a.meta["val"].dtype for a in out[1:]}


def replan_run(budget, under, **kw):
    """A memory model that under-predicts every graph's peak by ``under`` bytes (standing in for an
    allocation it does not know about): the first plan keeps too much gathered, step 2's measured
    peak contradicts it, and the plan is made again. Returns (replans, unsharded before, after,
    measured peak of a step after the re-plan)."""
    import dataclasses

    from shardwise.costmodel import CostModel
    from shardwise.runtime.memory import measure

    true = CostModel.liveness
    CostModel.liveness = lambda self, gm: dataclasses.replace(true(self, gm), peak=true(self, gm).peak - under)
    try:
        job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(),
                         memory_budget=budget, **kw)
        b = make_batch("llama", 0, dist.get_rank())
        job.step(b)
        before = job.programs()[0].unsharded
        job.step(b)  # step 2: measured against its prediction
        job.step(b)
        after = job.programs()[0].unsharded
        _, peak = measure(job, lambda: job.step(b))
    finally:
        CostModel.liveness = true
    assert job.recompiles_avoided == 0  # the plan changed: compiled again
    return job.replans, before, after, peak


def predicted_peak(**kw):
    """(predicted peak, bytes AdamW's offloaded master + moments will hold on the host)."""
    job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(), **kw)
    b = make_batch("llama", 0, dist.get_rank())
    host = 3 * sum(t.numel() * t.element_size() for t in job.state.master.values())
    return job.predict_memory(b)["peak"], host


# -- tensor parallelism (issue 22) ---------------------------------------------------------------

def split_head(kw: dict, tp: int | None) -> dict:
    """tp jobs of the tests cut an untied LM head by classes (``vocab_parallel=True``) unless told
    otherwise: on the tiny models the cost model would keep it whole (its product costs less than the
    vocab-parallel log-softmax's small all-reduces), and the tests are of the partition. The cost
    model's own choice is tested by itself (test_tp.py)."""
    if not tp or tp == 1 or kw.get("tp_plan", "megatron") != "megatron" or "vocab_parallel" in kw:
        return kw
    return {**kw, "vocab_parallel": True}


def tp_run(name: str, strategy: str, dtype: str, steps: int, tp: int, micro: int = 1, over: tuple = (),
           device: str = "cpu", gather: str | None = None, **compile_kw):
    """Train on a mesh of dp x ``tp`` ranks; the ranks of one tp group take their dp rank's batches.
    Returns (losses, full_state_dict on rank 0, what rank 0's step program holds: its collectives by
    axis and phase, its parameters' local shapes, ``explain``)."""
    from collections import Counter

    from shardwise.sharding.collective import collective_of

    model = make_model(name, dtype, **dict(over)).to(device)
    mesh = sw.mesh(tp=tp, device=device)
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=mesh, **split_head(compile_kw, tp))
    if gather is not None:  # the products of two shards resolved so, not as the cost model weighs it
        job.tp.gather = gather
    d = mesh.rank("dp")
    losses = []
    for s in range(steps):
        mbs = [tuple(t.to(device) for t in make_batch(name, s * micro + m, d)) for m in range(micro)]
        losses.append(float(job.step(mbs if micro > 1 else mbs[0])))
    sd = {k: v.cpu() for k, v in job.full_state_dict().items()}
    prog = job.programs()[0]
    cs = [collective_of(n) for n in prog.collective_nodes()]
    info = {"tp": prog.counts("tp"), "dp": prog.counts("dp"),
            "phases": Counter((c.axis, c.kind, c.phase) for c in cs),
            "tp_all_reduced": sorted(p for c in cs if c.axis == "tp" and c.kind == "all_reduce" for p in c.params),
            "tp_bytes": Counter((c.kind, c.phase, c.full_bytes) for c in cs if c.axis == "tp"),
            "gather": (job.tp.gather, job.tp.gather_choice), "fuse": job.tp.fuse_choice,
            "shapes": dict(zip(prog.capture.param_names, prog.capture.param_shapes)),
            "explain": job.explain()}
    return losses, sd, info


def tp_fused_kernel_run(fuse: str, steps: int = 4, dtype: torch.dtype = torch.float32, executor: str | None = None):
    """A small Llama (rows a multiple of the kernels' tile: batch 4 x 64 tokens) on tp=2 with sequence
    parallelism on CUDA, its tp products fused as ``fuse`` says: (losses, the fused sites' impls)."""
    import os

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"  # the ranks share one GPU
    torch.manual_seed(0)
    model = build("llama", "small").to(dtype).cuda()
    job = sw.compile(model, optimizer=adamw, strategy="ddp", mesh=sw.mesh(tp=2, device="cuda"), sequence_parallel=True,
                     tp_fuse=fuse, compile=executor)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tok = torch.randint(0, 256, (4, 65), generator=g).cuda()
        losses.append(float(job.step((tok[:, :-1], tok[:, 1:]))))
    return losses, [r["impl"] for r in job.tp.fuse_choice]


def tp_budget_run(budget, steps: int = 2, **kw):
    """A zero3 step of the tiny fp64 Llama on dp x tp=2 under ``memory_budget``: (parameters the plan
    keeps gathered, activations it offloads, predicted peak, measured peak of a step, losses, the
    full state dict)."""
    from shardwise.runtime.memory import measure

    job = sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(tp=2),
                     memory_budget=budget, **split_head(kw, 2))
    d = job.mesh.rank("dp")
    losses = [float(job.step(make_batch("llama", 0, d)))]
    b = make_batch("llama", 1, d)
    pred = job.predict_memory(b)["peak"]
    loss, peak = measure(job, lambda: job.step(b))
    losses.append(float(loss))
    losses += [float(job.step(make_batch("llama", s, d))) for s in range(2, steps)]
    prog = job.programs()[0]
    sd = {k: v.cpu() for k, v in job.full_state_dict().items()}
    return list(prog.unsharded or []), list(prog.offloaded or []), pred, peak, losses, sd


def tp_bf16_losses(sp: bool, steps: int = 8):
    """Losses of the tiny Llama in bf16 compute (fp32 master weights) on dp x tp=2."""
    return tp_run("llama", "zero3", "fp32", steps, 2, mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16),
                  sequence_parallel=sp)[0]


def tp_refused(plan: dict):
    """A tp job whose plan is refused at its first step: (the error, the model left whole?)."""
    model = make_model("llama", "fp64")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    job = sw.compile(model, optimizer=adamw, strategy="zero3", mesh=sw.mesh(tp=2), tp_plan=plan)
    try:
        job.step(make_batch("llama", 0, 0))
    except ValueError as e:
        err = str(e)
    else:
        err = None
    whole = all(p.device.type != "meta" and torch.equal(p, before[n]) for n, p in model.named_parameters())
    return err, whole


class UnruledNet(torch.nn.Module):
    """Two products around an op no sharding rule knows (a cumulative product)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.down(self.up(x).cumprod(-1)), y)


class MarkedNet(torch.nn.Module):
    """Two products whose hidden activation the model marks in shards of its features (``sw.shard``)."""

    def __init__(self, mark: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.mark = mark
        self.up, self.down = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False)

    def forward(self, x, y):
        h = torch.relu(self.up(x))
        if self.mark:
            h = sw.shard(h, sw.Shard(-1))
        return ((self.down(h) - y) ** 2).mean()


def marked_run(tp: int | None, mark: bool = True):
    """Two steps of MarkedNet on a mesh with ``tp`` ranks and no tp plan: (tp collectives, dp
    collectives, hints left in the program, full_state_dict)."""
    model = MarkedNet(mark).double()
    job = sw.compile(model, optimizer=adamw, strategy="ddp", mesh=sw.mesh(tp=tp),
                     **({"tp_plan": {}} if tp else {}))
    for _ in range(2):
        job.step(unruled_batch())
    prog = job.programs()[0]
    hints = len(prog.gm.graph.find_nodes(op="call_function", target=torch.ops.shardwise.shard_hint.default))
    return dict(prog.counts("tp")), dict(prog.counts("dp")), hints, job.full_state_dict()


def small_net_reference(model, steps: int = 2) -> dict:
    """The state of a small test net (UnruledNet, MarkedNet) after ``steps`` eager AdamW steps on one process."""
    opt = adamw(list(model.parameters()))
    for _ in range(steps):
        model(*unruled_batch()).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


class PaddedNet(torch.nn.Module):
    """An embedding with a padding row, an MLP pair and an untied head: a token model in miniature."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(16, 8, padding_idx=0)
        self.up, self.down = torch.nn.Linear(8, 12, bias=False), torch.nn.Linear(12, 8, bias=False)
        self.head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, idx, targets):
        h = self.tok(idx)
        h = h + self.down(torch.relu(self.up(h)))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def padded_run(tp: int | None, **kw):
    """Three steps of PaddedNet (fp64) on a mesh with ``tp`` ranks: (losses, full_state_dict, tp
    placements of the parameters, tp collectives by kind and phase)."""
    from collections import Counter

    from shardwise.sharding.collective import collective_of

    job = sw.compile(PaddedNet().double(), optimizer=adamw, strategy="ddp", mesh=sw.mesh(tp=tp), **kw)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        idx = torch.randint(0, 16, (2, 6), generator=g)
        idx[:, -1] = 0  # padding tokens: the padding row takes no gradient
        losses.append(float(job.step((idx, torch.randint(0, 16, (2, 6), generator=g)))))
    prog = job.programs()[0]
    counts = Counter((c.kind, c.phase) for c in map(collective_of, prog.collective_nodes()) if c.axis == "tp")
    return losses, job.full_state_dict(), (job.tp.placements if tp else None), counts


def unruled_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 8, generator=g, dtype=torch.float64)


def tp_unruled(plan, **kw):
    """Two steps of UnruledNet at tp=2 under ``plan``: ("ok", tp collectives, full_state_dict, warnings) or
    ("error", message, model whole?)."""
    import warnings

    model = UnruledNet().double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    job = sw.compile(model, optimizer=adamw, strategy="ddp", mesh=sw.mesh(tp=2), tp_plan=plan, **kw)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                job.step(unruled_batch())
    except ValueError as e:
        return "error", str(e), all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return "ok", sum(job.programs()[0].counts("tp").values()), job.full_state_dict(), [str(w.message) for w in seen]


def tp_mesh_error(tp: int):
    try:
        sw.mesh(tp=tp)
    except ValueError as e:
        return type(e).__name__, str(e)
    return None


def tp_compile_error(kw: dict):
    """Compile a tp=2 job with options ``kw`` (the test expects a refusal)."""
    sw.compile(make_model("llama", "fp64"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(tp=2), **kw)


def ckpt_run(strategy: str, path: str, steps: int, save_at: int | None = None, resume: bool = False,
             micro_of: int = 1, over: tuple = (), loop: bool = False, die: str | None = None, half: bool = False,
             tp: int | None = None, name: str = "llama", save_to: str | None = None, warm: bool = False,
             **compile_kw):
    """The tiny fp32 Llama trained to ``steps`` on this pool's dp ranks: saved to ``path`` after
    ``save_at`` steps, or (``resume``) started from the checkpoint at ``path`` with other weights
    first (so only the load can make it match). ``micro_of``: each rank takes the batches of that
    many ranks of the saving run as micro-batches (a dp=1 resume of a dp=2 run). ``loop``: two
    micro-batches per step, gradient clipping and a cosine schedule kept in the checkpoint. ``half``:
    rank r takes half of the batch rank r // 2 of the saving run took (a dp=4 resume of a dp=2 run).
    ``die``: every rank SIGKILLs itself "after" the save at ``save_at``, or "in" it, between DCP's
    write and the publication. ``tp``: a mesh of dp x tp ranks, the batches by dp rank; ``save_to``:
    where the save at ``save_at`` goes (``path`` by default); ``warm``: a step on another batch before
    the load (which must then replace the program's state as a whole); ``compile_kw``: more options
    of the job. Returns (loss per step index,
    full_state_dict on rank 0, what ``load`` returned)."""
    import os
    import signal

    from shardwise.recipes import cosine_with_warmup
    from shardwise.runtime import checkpoint

    job = sw.compile(make_model(name, "fp32", seed=1 if resume else 0, **dict(over)), optimizer=adamw,
                     strategy=strategy, mesh=sw.mesh(tp=tp) if tp else sw.mesh(),
                     **{"clip_grad_norm": 0.05 if loop else None, **split_head(compile_kw, tp)})
    sched = cosine_with_warmup(job.optimizer, 1, steps) if loop else None
    extra = {"scheduler": sched} if loop else None
    r, meta = job.mesh.rank("dp"), None
    start = 0
    if resume:
        if warm:
            job.step([make_batch(name, 99, r)] * 2 if loop else make_batch(name, 99, r))  # the loop's program
        meta = job.load(path, extra=extra)
        start = meta["steps"]
    if die == "in":
        real = checkpoint.dcp.save
        checkpoint.dcp.save = lambda *a, **k: (real(*a, **k), os.kill(os.getpid(), signal.SIGKILL))
    losses = {}
    per = micro_of * (2 if loop else 1)
    for s in range(start, steps):
        mbs = [make_batch(name, s, r * per + m) for m in range(per)]
        if half:
            mbs = [tuple(t[r % 2:r % 2 + 1] for t in make_batch(name, s, r // 2))]
        losses[s] = float(job.step(mbs if per > 1 else mbs[0]))
        if sched is not None:
            sched.step()
        if save_at is not None and s + 1 == save_at:
            job.save(save_to or path, extra=extra)
            if die == "after":
                os.kill(os.getpid(), signal.SIGKILL)
    return losses, job.full_state_dict(), meta


def hang_run(case: str, timeout: float = 3.0, steps: int = 3):
    """The tiny Llama on this pool's ranks with a test-short ``timeout``, rank 1 misbehaving at the
    last step: "stop" (SIGSTOP inside it), "fewer" (rank 1 takes one step fewer), "raise" (its
    forward raises), "eval" (rank 1 calls eval_step where rank 0 steps). Returns the losses of the
    rank that got through."""
    import os
    import signal

    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(), timeout=timeout)
    r = dist.get_rank()
    losses = []
    for s in range(steps):
        batch = make_batch("llama", s, r)
        last = s == steps - 1 and r == 1
        if last and case == "fewer":
            break
        if last and case == "stop":  # inside the step, before its first collective
            run = job.executor.forward_backward

            def stopped(*a, **k):
                os.kill(os.getpid(), signal.SIGSTOP)
                return run(*a, **k)
            job.executor.forward_backward = stopped
        if last and case == "raise":  # before the step's first collective
            def broken(*a, **k):
                raise OSError("no space left on device (a test's)")
            job.executor.forward_backward = broken
        if last and case == "eval":
            losses.append(float(job.eval_step(batch)))
            continue
        losses.append(float(job.step(batch)))
    return losses


def plain_loop_run(strategy: str):
    """A loop of one's own over a job's model and optimizer (the way DDP is trained by hand): what
    each of its calls raised, and the largest difference of the ranks' weights after it."""
    job = sw.compile(make_model("llama", "fp32"), optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    x, y = make_batch("llama", 0, dist.get_rank())
    job.step((x, y))
    said = []
    for call in (lambda: job.model(x, y).backward(), lambda: job.optimizer.step()):
        try:
            call()
            said.append(None)
        except Exception as e:  # noqa: BLE001 - returned to the test
            said.append((type(e).__name__, str(e)))
    sd = job.full_state_dict(rank0_only=False)
    mine = torch.cat([v.flatten().double() for v in sd.values()])
    other = mine.clone()
    dist.broadcast(other, src=0)
    return said, float((mine - other).abs().max())


class BatchNormCNN(torch.nn.Module):
    """Two conv + BatchNorm blocks and a linear head: buffers written in place in every step."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=0.3)
        self.fc = nn.Linear(8, 10)

    def forward(self, x, y):
        h = torch.relu(self.bn1(self.c1(x)))
        h = torch.relu(self.bn2(self.c2(h)))
        return torch.nn.functional.cross_entropy(self.fc(h.mean((2, 3))), y)


def bn_model():
    torch.manual_seed(0)
    return BatchNormCNN().double()


def bn_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (4,), generator=g)


def bn_run(strategy: str, steps: int = 3, compile: str | None = None):
    job = sw.compile(bn_model(), optimizer=adamw, strategy=strategy, mesh=sw.mesh(), compile=compile)
    r = dist.get_rank()
    losses = [float(job.step(bn_batch(s, r))) for s in range(steps)]
    ev = float(job.eval_step(bn_batch(99, r)))  # eval mode: normalised by the running statistics
    writes = {n.meta["sw_writes_buffer"] for n in job.programs()[0].gm.graph.nodes if "sw_writes_buffer" in n.meta}
    return losses, ev, job.full_state_dict(rank0_only=False), writes, job.programs()[0].capture.written_buffers


def bn_reference(ws: int, steps: int = 3):
    """Single-device training of ``bn_model``: each step averages the gradients of ws micro-batches,
    each normalised by its own statistics, and the running statistics become the mean of the ws
    micro-batches' updates from the same start (the data-parallel job's rule, runtime/executor.py)."""
    model = bn_model()
    opt = adamw(model.parameters())
    bufs = {n: b for n, b in model.named_buffers()}
    losses = []
    for s in range(steps):
        start = {n: b.clone() for n, b in bufs.items()}
        after, total = [], 0.0
        opt.zero_grad()
        for r in range(ws):
            with torch.no_grad():
                for n, b in bufs.items():
                    b.copy_(start[n])
            loss = model(*bn_batch(s, r)) / ws
            loss.backward()
            total += float(loss.detach())
            after.append({n: b.clone() for n, b in bufs.items()})
        with torch.no_grad():
            for n, b in bufs.items():
                b.copy_(sum(a[n] for a in after) / ws if b.is_floating_point() else after[0][n])
        opt.step()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        ev = sum(float(model(*bn_batch(99, r))) for r in range(ws)) / ws
    return losses, ev, model.state_dict()


class RandomNet(torch.nn.Module):
    """A small model drawn by hypothesis (``spec``): an embedding, ``widths`` linear layers with an
    activation, optionally a dense two-expert mixture (gated, no data-dependent routing), a head tied
    to the embedding or not, and one frozen layer or none."""

    def __init__(self, spec):
        super().__init__()
        widths, act, tied, frozen, moe = spec
        nn = torch.nn
        self.act = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "tanh": torch.tanh,
                    "silu": torch.nn.functional.silu}[act]
        dims = [widths[0], *widths] + ([widths[0]] if tied and widths[-1] != widths[0] else [])
        self.emb = nn.Embedding(16, dims[0])
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.moe = None
        if moe:
            self.gate = nn.Linear(dims[-1], 2)
            self.moe = nn.ModuleList(nn.Linear(dims[-1], dims[-1]) for _ in range(2))
        self.head = nn.Linear(dims[-1], 16, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        if frozen >= 0:
            self.layers[frozen % len(self.layers)].requires_grad_(False)

    def forward(self, x, y):
        h = self.emb(x)
        for lin in self.layers:
            h = self.act(lin(h))
        if self.moe is not None:
            w = torch.softmax(self.gate(h), -1)
            h = h + sum(w[..., i:i + 1] * e(h) for i, e in enumerate(self.moe))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def random_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 31 + rank)
    return torch.randint(0, 16, (2, 5), generator=g), torch.randint(0, 16, (2, 5), generator=g)


def random_run(spec, strategy: str, steps: int = 2):
    torch.manual_seed(0)
    job = sw.compile(RandomNet(spec).double(), optimizer=adamw, strategy=strategy, mesh=sw.mesh())
    losses = [float(job.step(random_batch(s, dist.get_rank()))) for s in range(steps)]
    return losses, job.full_state_dict()


def random_reference(spec, ws: int, steps: int = 2):
    torch.manual_seed(0)
    model = RandomNet(spec).double()
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    losses = []
    for s in range(steps):
        opt.zero_grad()
        total = 0.0
        for r in range(ws):
            loss = model(*random_batch(s, r)) / ws
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


def ep_refused(case: str):
    """A job the ep axis refuses: "dense" (the MoE's dense path: no batched expert products), "uneven"
    (3 experts over ep=2), "plan-none" / "plan-typo" (an ep_plan glob that
    names parameters no expert product reads, or none at all), "capacity" (ep_capacity_factor for the
    built-in MoE, which has its own), "split" (a batch of 2 rows in 3 parts)."""
    over = {"dense": {"capacity_factor": None}, "uneven": {"capacity_factor": 2.0, "n_expert": 3}}.get(
        case, {"capacity_factor": 2.0})
    plan = {"plan-none": ["blocks.*.attn.*"], "plan-typo": ["blocks.*.moe.*"]}.get(case)
    job = sw.compile(make_model("moe", "fp64", **over), optimizer=adamw, strategy="zero3", mesh=sw.mesh(ep=2),
                     ep_plan=plan, ep_capacity_factor=1.25 if case == "capacity" else None,
                     ep_split=3 if case == "split" else 1)
    job.step(make_batch("moe", 0, dist.get_rank()))


def ep_tp_run(strategy: str, steps: int, save: str | None = None, device: str = "cpu", save_after: int | None = None,
              **compile_kw):
    """The tiny fp64 MoE (capacity 2) on a mesh of ep=2 x tp=2, each tp pair taking the batch of its
    ep rank: (losses, full_state_dict, rank 0's step collectives by (axis, kind, phase), explain).
    ``save``: a checkpoint written there after ``save_after`` steps (default: at the end)."""
    from collections import Counter

    from shardwise.sharding.collective import collective_of

    job = sw.compile(make_model("moe", "fp64", capacity_factor=2.0).to(device), optimizer=adamw, strategy=strategy,
                     mesh=sw.mesh(ep=2, tp=2, device=device), **compile_kw)
    r = job.mesh.batch_rank()
    losses = []
    for s in range(steps):
        losses.append(float(job.step(tuple(t.to(device) for t in make_batch("moe", s, r)))))
        if save is not None and s + 1 == (save_after or steps):
            job.save(save)
    prog = job.programs()[0]
    counts = Counter((c.axis, c.kind, c.phase) for c in map(collective_of, prog.collective_nodes()))
    return losses, job.full_state_dict(), counts, job.explain()


def ep_run(strategy: str, steps: int, ep: int, cf: float | None = 2.0, save: str | None = None, device: str = "cpu",
           **compile_kw):
    """The tiny fp64 MoE (capacity dispatch ``cf``) on a mesh of dp x ``ep`` ranks, each rank taking the
    batch of its global rank. Returns (losses, full_state_dict, what rank 0's step program holds: its
    collectives by (axis, kind, phase), its ep collectives of parameters by (kind, phase, parameter),
    the MoE layers' expert parameters, the parameters' local shapes, the bytes of this rank's expert
    parameters and their optimizer state, and of the others'). ``save``: a checkpoint written there
    at the end."""
    from collections import Counter

    from shardwise.sharding.collective import collective_of

    model = make_model("moe", "fp64", capacity_factor=cf).to(device)
    job = sw.compile(model, optimizer=adamw, strategy=strategy, mesh=sw.mesh(ep=ep, device=device), **compile_kw)
    r = dist.get_rank()
    losses = [float(job.step(tuple(t.to(device) for t in make_batch("moe", s, r)))) for s in range(steps)]
    if save is not None:
        job.save(save)
    prog = job.programs()[0]
    experts = [n for n in job.state.names if ".ffn.w" in n]
    st = job.state
    held = st.full if strategy == "ddp" else st.master

    def held_bytes(names):
        return sum(held[n].numel() * held[n].element_size() + sum(
            v.numel() * v.element_size() for v in job.optimizer.state[st.opt_tensors[n]].values() if v.dim() > 0)
            for n in names)

    cs = list(map(collective_of, prog.collective_nodes()))
    nodes = list(prog.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    products = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
    def under_of(s):  # the matrix products run while ``s`` is in flight
        return sum(n.target in products for n in nodes[pos[s] + 1 : pos[next(iter(s.users))]])

    under = [under_of(s) for s in prog.collective_nodes()
             if collective_of(s).kind == "all_to_all" and collective_of(s).phase == "fwd"]
    gathers_under = [under_of(s) for s in prog.collective_nodes() if collective_of(s).axis == "ep"
                     and collective_of(s).kind == "all_gather" and collective_of(s).params]
    info = {"phases": Counter((c.axis, c.kind, c.phase) for c in cs), "products_under_all_to_all": under,
            "products_under_ep_gathers": gathers_under,
            "ep_params": Counter((c.kind, c.phase, p) for c in cs if c.axis == "ep" for p in c.params),
            "moe_params": sorted(p for layer in prog.capture.moe_layers for p in layer["params"]),
            "shapes": dict(zip(prog.capture.param_names, prog.capture.param_shapes)),
            "expert_bytes": held_bytes(experts), "shared_bytes": held_bytes([n for n in st.names if n not in experts]),
            "n_layer": len(model.blocks) if hasattr(model, "blocks") else None,
            "dropped": {k: int(v) for k, v in job.buffers.items() if k.endswith("dropped")}, "explain": job.explain()}
    return losses, {k: v.cpu() for k, v in job.full_state_dict().items()}, info


def ep_resumed(path: str, ep: int, step: int, strategy: str = "zero2", tp: int = 1):
    """A job of other weights on dp x ``ep`` x ``tp`` loads the checkpoint at ``path`` (before its
    first step) and takes step ``step``: (its loss, full_state_dict)."""
    mesh = sw.mesh(ep=ep if ep > 1 else None, tp=tp if tp > 1 else None)
    job = sw.compile(make_model("moe", "fp64", seed=1, capacity_factor=2.0), optimizer=adamw, strategy=strategy,
                     mesh=mesh)
    job.load(path)
    return float(job.step(make_batch("moe", step, job.mesh.batch_rank()))), job.full_state_dict()


def hf_ep_run(kind: str, strategy: str, steps: int, ep: int = 2, device: str = "cpu", **compile_kw):
    """``hf_run`` (fp32) on a mesh of dp x ``ep`` ranks, each taking its global rank's batches:
    (losses, full_state_dict, the ep collectives of no parameter by (kind, phase), the experts' local
    shapes, explain)."""
    from collections import Counter

    from shardwise.sharding.collective import collective_of

    job = sw.compile(make_hf(kind, "fp32").to(device), optimizer=adamw, strategy=strategy,
                     mesh=sw.mesh(ep=ep, device=device), **compile_kw)
    losses = [float(job.step({k: v.to(device) for k, v in hf_batch(s, dist.get_rank()).items()}))
              for s in range(steps)]
    prog = job.programs()[0]
    cs = Counter((c.kind, c.phase) for c in map(collective_of, prog.collective_nodes()) if c.axis == "ep"
                 and not c.params)  # the experts' dispatch, not the other weights' ZeRO over ep
    shapes = {n: tuple(s) for n, s in zip(prog.capture.param_names, prog.capture.param_shapes) if "experts" in n}
    return losses, {k: v.cpu() for k, v in job.full_state_dict().items()}, cs, shapes, job.explain()


def hf_ep_tp_run(kind: str, strategy: str, steps: int, **compile_kw):
    """``hf_run`` (fp32) on a mesh of ep=2 x tp=2, each tp pair taking the batches of its ep rank: (losses,
    full_state_dict, rank 0's step collectives by (axis, kind, phase, of parameters or not), layer 0's local
    parameter shapes)."""
    from collections import Counter

    from shardwise.sharding.collective import collective_of

    job = sw.compile(make_hf(kind, "fp32"), optimizer=adamw, strategy=strategy, mesh=sw.mesh(ep=2, tp=2),
                     **compile_kw)
    r = job.mesh.batch_rank()
    losses = [float(job.step(hf_batch(s, r))) for s in range(steps)]
    prog = job.programs()[0]
    cs = Counter((c.axis, c.kind, c.phase, bool(c.params)) for c in map(collective_of, prog.collective_nodes()))
    shapes = {n: tuple(s) for n, s in zip(prog.capture.param_names, prog.capture.param_shapes) if ".layers.0." in n}
    return losses, {k: v.cpu() for k, v in job.full_state_dict().items()}, cs, shapes


def hf_ep_dispatch(kind: str, steps: int, budget: int):
    """``hf_ep_run``'s model on ep=2 (zero3) with its dispatch left to the cost model under
    ``memory_budget=budget``: (losses, full_state_dict, the dispatch choice, explain)."""
    job = sw.compile(make_hf(kind, "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(ep=2),
                     memory_budget=budget)
    losses = [float(job.step(hf_batch(s, dist.get_rank()))) for s in range(steps)]
    return losses, job.full_state_dict(), job.ep.dispatch_choice, job.explain()


def hf_ep_overlap():
    """Qwen2-MoE on ep=2: (position of the first ep collective's start, of the shared expert's first
    product, of the collective's first reader) in the ep-local step's graph."""
    from shardwise.sharding.collective import collective_of

    job = sw.compile(make_hf("qwen2_moe", "fp32"), optimizer=adamw, strategy="zero3", mesh=sw.mesh(ep=2))
    job.step(hf_batch(0, dist.get_rank()))
    cap = job.programs()[0].capture
    nodes = list(cap.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    phs = dict(zip(cap.param_names, cap.gm.graph.find_nodes(op="placeholder")))
    reads, stack = set(), [phs["model.layers.0.mlp.shared_expert.gate_proj.weight"]]
    while stack:  # the weight's readers, through its gather over ep (zero3 over dp x ep) and views
        for u in stack.pop().users:
            if u not in reads and len(reads) < 50:
                reads.add(u)
                stack.append(u)
    product = min((u for u in reads if u.target is torch.ops.aten.mm.default), key=pos.get)
    start = next(n for n in nodes if n.op == "call_function" and collective_of(n) is not None
                 and collective_of(n).axis == "ep" and not collective_of(n).params)
    first_read = min(next(iter(start.users)).users, key=pos.get)
    return pos[start], pos[product], pos[first_read]
