"""``shardwise bench``: shardwise and its peers on the same model, batch and precision, in one run.

Every system trains the same built-in model from the same seed on the same synthetic batches per rank, with the same
precision policy (bf16 compute with fp32 weights, optimizer and gradient reduction; or fp32) and the same
activation-checkpointing setting, then:

- ``step_s``: the timed steps' mean wall time (back to back, one device sync at the end; the slowest rank's);
- ``tokens_per_s_per_gpu``: batch x sequence per rank / step_s; ``mfu``: model FLOPs per token (6N + 12·L·d·T, PaLM's
  formula) x tokens/s against the device's dense bf16 peak;
- ``peak_mem_gb``: ``max_memory_allocated`` over the timed steps (CUDA), MemTracker's live-tensor peak of a step (CPU);
- ``exposed_comm_pct``: NCCL kernel time with no other kernel running, from a torch.profiler trace of one step
  (runtime/profile.py; the profiler slows the step it traces);
- ``over_ceiling_pct`` (where the record has a ``compile`` row): the step's share above that no-communication ceiling,
  measured without the profiler;
- shardwise only: ``pred_step_s`` and ``pred_peak_mem_gb`` from its cost model, made before the timed steps.

Systems: ``shardwise`` (passes on: scheduler), ``shardwise-noopt`` (scheduler off) — either may carry options, e.g.
``shardwise:ops=1+inflight_mb=256+bucket_mb=128+executor=fx`` or ``shardwise:offload=1+recompute=1+budget_gb=30``
(offload=all: no state kept on the device) — ``compile`` (plain torch.compile on each rank's batch, no communication:
the single-device ceiling), ``ddp``, ``fsdp2`` (``fully_shard`` per block and root), ``fsdp2-compile`` (then
torch.compile), ``fsdp2-offload`` (``CPUOffloadPolicy``: shards, gradients and the optimizer step on the host); these
torch peers take ``:fused=1`` for torch's fused AdamW, which shardwise picks itself on CUDA (``shardwise:fused=0`` turns
that off; each row's ``optimizer`` names the kernel), ``deepspeed`` (ZeRO-3; ``:offload=1`` to CPU Adam, ``+ratio=0.7``
only that share) and ``deepcompile`` (``:offload=1``: its ``offload_opt_states``) where deepspeed is installed on a CUDA
machine. A system that fails (out of memory, missing package) is recorded with its error; the others still run.

With ``--tp N [--sp]`` shardwise runs on ``sw.mesh(tp=N)`` and ``fsdp2`` / ``fsdp2-compile`` become FSDP2 over dp with
torch's TP over tp (peers.tensor_parallel, the built-in Llama); a tp group trains on one batch, so tokens per GPU are
its tokens over N. Each row's ``loss`` (the last timed step's) shows that the systems trained the same model alike.
"""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import MISSING, asdict, fields

import torch
import torch.distributed as dist

from .config import BenchConfig, options
from .peers import bench_device, build_model, peer, sync
from .plot import plot


def flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token of a built-in model at sequence ``seq``: the planner's count of its shape
    (costmodel.flops_per_token: 6 per weight a token multiplies, top_k of an MoE's experts, plus
    12·L·d·T), so a measured MFU and a planned one are the same quantity."""
    from ..planner.models import from_builtin

    return from_builtin(model).flops_per_token(seq)


def _cpu_peak(fn, model, opt) -> int | None:
    from ..runtime.memory import tracked_peak

    try:
        return tracked_peak(fn, model, opt)[1]
    except Exception:  # noqa: BLE001 - MemTracker does not follow every wrapper; then no number
        fn()
        return None


def run_system(system: str, cfg: BenchConfig, ctrl=None) -> dict:
    """Build, warm up, time and profile one system on this rank; returns its result row. ``ctrl`` is a
    gloo group for the small host-side agreements (the default group may be NCCL)."""
    import shardwise as sw

    from ..data import SyntheticStream
    from ..runtime.memory import measure
    from ..runtime.profile import profiled
    from ..runtime.state import optimizer_kind

    device = bench_device()
    rank, ws = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    # each system compiles from a clean slate: dynamo's per-code cache is shared by the process's systems,
    # and an earlier one's entries count towards its recompile limit (past it, dynamo silently runs eager)
    torch._dynamo.reset()
    model = build_model(cfg, device)
    seq = cfg.seq or model.cfg.seq
    fpt = flops_per_token(model, seq)
    data = SyntheticStream(model.cfg.vocab, seq, cfg.batch, cfg.seed)
    if ws % cfg.tp:
        raise ValueError(f"bench: --tp {cfg.tp} does not divide the {ws} ranks")
    # tp innermost: the ranks of one tp group are adjacent and train on their dp rank's batches
    batches = [tuple(t.to(device) for t in data.get(i, rank // cfg.tp)) for i in range(cfg.warmup + cfg.steps + 2)]
    row = {"system": system, "step_s": None, "tokens_per_s_per_gpu": None, "mfu": None, "peak_mem_gb": None,
           "exposed_comm_pct": None, "pred_step_s": None, "pred_peak_mem_gb": None}
    # the communication settings this row ran under (a record's rows may come from several commands)
    if env := {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_"))}:
        row["env"] = env
    if system.startswith("shardwise"):
        mp = sw.MixedPrecision(param_dtype=torch.bfloat16) if cfg.precision == "bf16" else None
        executor = cfg.executor if cfg.executor != "auto" else ("inductor" if device.type == "cuda" else "fx")
        opts = {"schedule": not system.startswith("shardwise-noopt"), **options(system)}
        ep = opts.pop("ep", 1)
        job = sw.compile(model, optimizer=lambda p: torch.optim.AdamW(p, lr=cfg.lr), strategy=cfg.strategy,
                         mesh=sw.mesh(tp=cfg.tp if cfg.tp > 1 else None, ep=ep if ep > 1 else None), mixed_precision=mp,
                         compile=opts.pop("compile", executor), link_profile=cfg.link_profile,
                         **({"sequence_parallel": True} if cfg.sp else {}),
                         **({"vocab_parallel": cfg.vocab_parallel} if cfg.vocab_parallel is not None else {}), **opts)
        row["pred_peak_mem_gb"] = job.predict_memory(batches[0])["peak"] / 1e9
        step, opt = job.step, job.optimizer
        job.time_optimizer = True
        # under a budget the plan is checked on the second warm-up step: the first compiles, and on CUDA
        # compilation allocates (autotuning) beyond what the step itself needs
        job.replan_at = 2
    else:
        step, opt = peer(system, cfg, model, device)
    inner = getattr(opt, "optimizer", None)  # DeepSpeed's ZeRO wrapper holds the optimizer that steps
    row["optimizer"] = optimizer_kind(inner if isinstance(inner, torch.optim.Optimizer) else opt)
    if system.startswith("shardwise") and job.state.streamer is not None:
        row["optimizer"] = f"{type(opt).__name__} (offloaded: streamed per chunk, part on the host)"
    # model built, wrapped (shardwise: its plan made, for the predicted peak), before the first step
    row["setup_s"] = round(time.perf_counter() - started, 2)
    if rank == 0:
        print(f"{system}: set-up {row['setup_s']:.1f} s", flush=True)
    warmup = cfg.warmup
    if system.startswith("deepcompile"):
        # DeepCompile profiles the first steps, then at its WARMUP-th step resets dynamo and recompiles
        # with its optimisation passes (prefetch, selective gather): steps up to two past that are warm-up
        from deepspeed.compile import init_z3

        warmup = max(warmup, getattr(init_z3, "WARMUP", 5) + 2)
    # each warm-up step timed and printed as it ends, with the reasons dynamo gave for any
    # recompilation: a system that keeps compiling shows it in the log even if its command is killed
    times, reasons = [], {}
    for i in range(warmup):
        t = time.perf_counter()
        step(batches[i % len(batches)])
        sync(device)
        times.append(round(time.perf_counter() - t, 4))
        new = recompile_reasons(reasons)
        if rank == 0:
            print(f"{system}: warm-up step {i + 1}/{warmup} {times[-1]:.3f} s"
                  + (f"; recompiled: {new[-1][:160]}" if new else ""), flush=True)
        if cfg.system_timeout is not None:
            late = torch.tensor([time.perf_counter() - started > cfg.system_timeout], dtype=torch.float64)
            dist.all_reduce(late, op=dist.ReduceOp.MAX, group=ctrl)  # every rank stops at the same step
            if late.item():
                raise TimeoutError(f"warm-up step {i + 1}/{warmup} ended {time.perf_counter() - started:.0f} s "
                                   f"into the system, past --system-timeout {cfg.system_timeout:g} s; steps took "
                                   f"{times} s" + (f"; last recompilation: {list(reasons)[-1][:120]}" if reasons else ""))
    row["warmup_step_s"] = times
    if reasons:
        row["recompile_reasons"] = list(reasons)[-5:]
    row["warmup_steps"] = warmup
    if system.startswith("shardwise"):
        # the warm-up also holds the steps that decide the plan (offload residency, a budget's check)
        # and a step that times the update of the plan made
        while (job.plan.residency_pending or (job.memory_budget is not None and job.steps < job.replan_at)
               or not job.programs()  # a plan made again runs (and compiles) inside the warm-up
               or job.last_optimizer_s is None):
            step(batches[0])
            row["warmup_steps"] += 1
        try:
            job.profile_compute(batches[0])
        except torch.OutOfMemoryError:  # node-by-node timing runs unfused: more memory than the step
            row["pred_source"] = "roofline (profiling ran out of memory)"
            gc.collect()
            torch.cuda.empty_cache()
        row["pred_step_s"] = job.predict_step(batches[0])["step_s"]
        # what the cost model chose for the step's program: in-flight cap (and the caps it weighed), buckets
        prog = job.compiled(batches[0]).program
        if prog.schedule:
            row["schedule"] = {"max_in_flight_mb": prog.schedule["max_in_flight"] / 2**20,
                               "carved_products": prog.carved, "carve_choice": prog.carve_choice,
                               "max_ops": prog.schedule.get("max_ops"), "cap_choice": prog.schedule.get("cap_choice"),
                               "bucket_choice": prog.bucket_choice}
            if rank == 0:
                print(f"{system}: in-flight cap {row['schedule']['max_in_flight_mb']:.1f} MiB"
                      + (f"; caps weighed: {prog.schedule['cap_choice']}" if prog.schedule.get("cap_choice") else ""),
                      flush=True)
        elif prog.carved:  # the unscheduled baseline, carving the SMs it was told to
            row["carved_products"] = prog.carved
        # the plan the timed steps run (offload: with the state the warm-up found room for)
        mem = job.predict_memory(batches[0])
        row["pred_peak_mem_gb"] = mem["peak"] / 1e9
        if cfg.memory_sites:  # the prediction's parts and its live set at the graph's peak, beside the sites
            live = job.plan.liveness(job.compiled(batches[0]).program)
            row["pred_memory"] = {k: (v / 1e9 if isinstance(v, int) else v) for k, v in mem.items()}
            row["pred_memory"]["at_peak"] = [[name, round(b / 1e9, 5)] for name, b in live.at_peak[:400]]
        job.time_optimizer = False
    sync(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # the timed steps run back to back, as a training loop runs them (work a system leaves running
    # past the end of a step may overlap the next), with one device sync at the end
    t0 = time.perf_counter()
    for i in range(cfg.steps):
        loss = step(batches[cfg.warmup + i])
    row["loss"] = float(loss)  # the last timed step's: every system trains the same model on the same batches
    sync(device)
    # every rank's mean; the job runs at the pace of the slowest rank
    mean = torch.tensor([(time.perf_counter() - t0) / cfg.steps], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=ctrl)
    row["step_s"] = float(mean)
    # the ranks of a tp group share their batch; compile's ceiling runs each rank's batch alone
    row["tokens_per_s_per_gpu"] = cfg.batch * seq / row["step_s"] / (1 if system == "compile" else cfg.tp)
    if peak := peak_flops(device):
        row["mfu"] = fpt * row["tokens_per_s_per_gpu"] / peak
    row["ranks"] = ws
    if system.startswith("shardwise") and job.state.streamer is not None:
        st = job.state.streamer
        to_device, to_host = st.transfer_bytes()
        row["offload"] = {"host_gb": st.host_bytes() / 1e9, "device_state_gb": st.device_bytes() / 1e9,
                          "to_device_gb": to_device / 1e9, "to_host_gb": to_host / 1e9, "chunks": len(st.chunks),
                          "host_updated_gb": sum(st.param_bytes(n) for n in st.host) / 1e9,
                          "host_rate_gelem_s": st.host_rate / 1e9 if st.host_rate else None}
    if device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    try:  # the timed numbers stand even if these extra measurements fail
        if device.type != "cuda":
            b = batches[cfg.warmup + cfg.steps]
            peak = measure(job, lambda: step(b))[1] if system.startswith("shardwise") \
                else _cpu_peak(lambda: step(b), model, opt)
            row["peak_mem_gb"] = None if peak is None else peak / 1e9
        trace = None
        if cfg.trace_dir and rank == 0:  # the directory was made before the first system (bench())
            trace = os.path.join(cfg.trace_dir, system.replace(":", "_").replace("=", "").replace("+", "_") + ".json.gz")
        _, meas = profiled(lambda: step(batches[-1]), device, trace=trace)
        if device.type == "cuda" or system.startswith("shardwise"):
            row["exposed_comm_pct"] = meas["exposed_pct"]
        if "exposed_by_kind_s" in meas:  # GPUs: which collectives are exposed, and where in the step
            row["exposed_by_kind_ms"] = {k: round(v * 1e3, 3) for k, v in meas["exposed_by_kind_s"].items()}
            row["exposed_top"] = meas["exposed_top"]
            # all-gathers a running product held back (no SM for NCCL until it ended), and the link's idle time
            row["gathers_held_back"] = meas["gathers_held_back"]
            row["gathers_held_back_ms"] = round(meas["gathers_held_back_s"] * 1e3, 3)
    except Exception as e:  # noqa: BLE001
        row["profile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if cfg.memory_sites and device.type == "cuda":
        try:
            row["memory_at_peak"] = _memory_sites(lambda: step(batches[-1]), device)
        except Exception as e:  # noqa: BLE001
            row["memory_sites_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if system.startswith("shardwise"):
        job.synchronize()  # an overlapped update's last readiness works, else left registered at exit
    return row


def recompile_reasons(seen: dict) -> list[str]:
    """Reasons dynamo has recorded for guard failures (recompilations) that ``seen`` lacks; adds them."""
    try:
        from torch._dynamo.utils import guard_failures
    except ImportError:
        return []
    keys = (f"{getattr(code, 'co_name', code)}: {r}" for code, rs in list(guard_failures.items()) for r in rs)
    new = [k for k in dict.fromkeys(keys) if k not in seen]
    seen.update(dict.fromkeys(new))
    return new


def _memory_sites(fn, device) -> dict:
    """One step under the allocator's recorder: its peak and the blocks live then, by site (GB)."""
    from ..runtime.memory import live_at_peak

    torch.cuda.synchronize(device)
    base = torch.cuda.memory_stats(device).get("requested_bytes.all.current", 0)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live = live_at_peak(snap["device_traces"][device.index], base, top=400)
    stats = torch.cuda.memory_stats(device)  # requested and allocated peaks: live_at_peak says how they differ
    return {"peak_gb": live["peak"] / 1e9, "requested_peak_gb": stats.get("requested_bytes.all.peak", 0) / 1e9,
            "max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "before_step_gb": live["before"] / 1e9,
            "sites": [[site, round(b / 1e9, 4), n] for site, b, n in live["sites"]]}


def peak_flops(device) -> float | None:
    """The device's datasheet dense bf16 FLOP/s (costmodel/devices.py), which MFU is quoted against."""
    if device.type != "cuda":
        return None
    from ..costmodel.devices import DEVICES

    name = torch.cuda.get_device_name(device).lower()
    return next((d.peak_flops for d in DEVICES.values() if any(m in name for m in d.match)), None)


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("triton", "deepspeed", "transformers"):  # read from the installed metadata: importing them is slow
        try:
            v[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    if os.environ.get("SHARDWISE_COMMIT"):  # a copy of the tree without its git history (remote machines)
        v["shardwise"] = os.environ["SHARDWISE_COMMIT"]
        return v
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        v["shardwise"] = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        v["shardwise"] = "unknown"
    return v


def _machine(device) -> str:
    cpu = platform.processor() or platform.machine()
    if device.type == "cuda":
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(device)}, {os.cpu_count()} CPU cores"
    return f"{os.cpu_count()} CPU cores ({cpu}), gloo"


def bench(cfg: BenchConfig, out_dir: str = "bench/results", name: str | None = None, command: str | None = None,
          append: bool = False) -> dict | None:
    """Run every system of ``cfg`` on this job's ranks; rank 0 writes ``<out_dir>/<name>.json`` and
    ``.png`` and returns the record (other ranks return None). ``append``: add the rows to an
    existing record of that name (one sitting split over several commands; the configs must match)."""
    device = bench_device()
    rank, ws = dist.get_rank(), dist.get_world_size()
    ctrl = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    if cfg.memory_fraction is not None:
        if device.type != "cuda":
            raise ValueError("bench: --memory-fraction caps CUDA memory; this run has no GPU")
        torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, device)
    now = datetime.datetime.now(datetime.timezone.utc)
    name = name or f"{now:%Y-%m-%d}-bench-{cfg.model}-{cfg.size}-ws{ws}-{device.type}"
    path = os.path.join(out_dir, name + ".json")
    rec = {"name": name, "date": now.isoformat(timespec="seconds"), "machine": _machine(device),
           "gpus": ws if device.type == "cuda" else 0, "versions": _versions(),
           "command": command or " ".join(sys.argv), "config": {**asdict(cfg), "ranks": ws}, "results": []}
    bad = [""]
    if rank == 0:
        # whatever goes wrong here is told to every rank before any of them starts a system
        try:
            for what, d in (("--out", out_dir), ("--trace-dir", cfg.trace_dir)):
                if d:
                    try:
                        os.makedirs(d, exist_ok=True)
                    except OSError as e:
                        raise OSError(f"cannot make the {what} directory {d!r} ({type(e).__name__}: {e}); "
                                      f"give a directory path that can be created") from None
            if append and os.path.exists(path):
                bad[0] = _append_to(path, rec)
        except Exception as e:  # noqa: BLE001
            bad[0] = f"bench: {e}"
    dist.broadcast_object_list(bad, src=0, group=ctrl)  # every rank stops, not rank 0 alone
    if bad[0]:
        raise ValueError(bad[0])
    for system in cfg.systems:
        t0 = time.perf_counter()
        try:
            row = run_system(system, cfg, ctrl)
        except Exception as e:  # noqa: BLE001 - recorded, the next system still runs
            row = {"system": system, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc()
        err = row.get("error", "")
        # agree: a system counts only if it ran on every rank
        errs: list = [None] * ws
        dist.all_gather_object(errs, err, group=ctrl)
        if any(errs):
            row = {"system": system, "error": next(e for e in errs if e)}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        if rank == 0:
            print(_fmt_row(row), flush=True)
            rec["results"].append(row)
            # written after every system: a sitting cut short keeps the rows it finished
            _write_atomic(path, rec)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
    if rank != 0:
        return None
    if over_ceiling(rec["results"]):
        _write_atomic(path, rec)
    try:
        plot(rec, os.path.join(out_dir, name + ".png"))
        print(f"wrote {path} and {name}.png", flush=True)
    except ImportError as e:
        print(f"wrote {path}; no plot: {e} (pip install matplotlib)", flush=True)
    return rec


def _append_to(path: str, rec: dict) -> str:
    """Fold the record at ``path`` into ``rec`` (its rows first); returns why it cannot be, or ""."""
    with open(path) as f:
        old = json.load(f)
    try:
        cfg, rows, command, date = old["config"], old["results"], old["command"], old["date"]
        systems = cfg["systems"]
    except (KeyError, TypeError):
        return f"bench --append: {path} is not a bench record (no config, results, command or date)"
    # settings that are not part of what is measured may differ; a setting an older record lacks counts as its default
    ignore = {"systems", "trace_dir", "memory_sites", "system_timeout"}
    defaults = {f.name: f.default for f in fields(BenchConfig) if f.default is not MISSING}
    keys = (set(cfg) | set(rec["config"])) - ignore
    if any(cfg.get(k, defaults.get(k)) != rec["config"].get(k, defaults.get(k)) for k in keys):
        return f"bench --append: {path} was made with another configuration: {cfg}"
    rec["config"]["systems"] = systems + rec["config"]["systems"]
    rec.update(results=rows, command=command + " ; " + rec["command"], date=date)
    return ""


def over_ceiling(rows: list[dict]) -> bool:
    """Where the record holds the ``compile`` row (the same model compiled on each rank alone, no
    communication), give every other row ``over_ceiling_pct``: the share of its step above that
    ceiling — exposed communication plus whatever else the system adds — measured without the
    profiler, which slows the step it traces. Returns whether any row got one."""
    ceiling = next((r["step_s"] for r in rows if r["system"] == "compile" and r.get("step_s")), None)
    if ceiling is None:
        return False
    for r in rows:
        if r["system"] != "compile" and r.get("step_s"):
            r["over_ceiling_pct"] = 100.0 * (r["step_s"] - ceiling) / r["step_s"]
    return True


def _write_atomic(path: str, rec: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(tmp, path)


def _fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['system']:16s} failed: {r['error']}"

    def f(k, fmt):
        return format(r[k], fmt) if r.get(k) is not None else "-"

    return (f"{r['system']:16s} step {f('step_s', '.4f')} s  tok/s/gpu {f('tokens_per_s_per_gpu', ',.0f')}  "
            f"mfu {f('mfu', '.3f')}  peak {f('peak_mem_gb', '.3f')} GB  exposed comm {f('exposed_comm_pct', '.1f')}%  "
            f"pred step {f('pred_step_s', '.4f')} s  pred peak {f('pred_peak_mem_gb', '.3f')} GB  ({r['wall_s']} s)")
