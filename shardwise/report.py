"""``explain``: a job's plan as text (placements, each collective with its bytes and predicted time, the
memory plan, predicted step and peak); costmodel/plot.py draws the predicted timeline."""

from __future__ import annotations

from .errors import size_text
from .passes.actoffload import candidates
from .runtime.state import optimizer_kind
from .sharding.collective import collective_of


def choices(rows) -> str:
    """A cost-model choice's rows (size, predicted s, predicted peak, chosen) as ``explain`` prints them."""
    return "; ".join(f"{'*' if c else ''}{b / 2**20:.2f} MiB -> {t * 1e3:.2f} ms, peak {pk / 2**20:.1f} MiB"
                     for b, t, pk, c in rows)


def explain(job) -> str:
    """The plan of ``job`` (a ``shardwise.Job``): strategy, mesh, placements, and per compiled program its collectives
    with bytes, predicted time and exposure, and the predicted step (two-lane simulation of the schedule)."""
    lp, dev = job.cost.link, job.cost.device
    lines = [f"strategy={job.strategy} {job.mesh} precision={job.config.mixed_precision}", f"link profile: {lp}",
             f"compute: roofline on {dev.name} ({dev.flops / 1e12:.1f} TFLOP/s, {dev.bandwidth / 1e9:.0f} GB/s)",
             f"optimizer: {optimizer_kind(job.optimizer)}"]
    for (sig, mode), (prog, _) in job.compiler.programs.items():
        measured = job.node_times.get((sig, mode))
        tl, src = job.cost.simulate(prog.gm, measured), "roofline" if measured is None else "measured"
        lines.append(
            f"program [{mode}] {prog.strategy}: {len(prog.gm.graph.nodes)} nodes; "
            + " ".join(f"{k}={v}" for k, v in prog.counts().items()) + f"; {prog.comm_bytes() / 2**20:.2f} MiB "
            f"sent per rank; predicted graph {tl.step_s * 1e3:.2f} ms = compute ({src}) {tl.compute_s * 1e3:.2f} ms + "
            f"exposed comm {tl.exposed_comm_s * 1e3:.2f} ms ({tl.exposed_pct:.0f}%), comm busy {tl.comm_s * 1e3:.2f} ms"
        )
        if mode != "eval":
            saved = candidates(prog.gm)
            big = ", ".join(f"{n.name} {tuple(n.meta['val'].shape)} {b / 2**20:.2f}" for n, b in saved[:6])
            lines.append(f"  activations saved for the backward: {len(saved)}, "
                         f"{sum(b for _, b in saved) / 2**20:.2f} MiB (views counted with their source); "
                         f"largest (MiB): {big}")
        if prog.recomputed:
            lines.append(f"  recomputed in backward ({len(prog.recomputed)}): {', '.join(prog.recomputed)[:300]}")
        if prog.carve_choice:
            plain, carved, keep = prog.carve_choice
            lines.append(f"  SM carveout (auto, cost model with SM contention): step {plain * 1e3:.2f} ms uncarved, "
                         f"{carved * 1e3:.2f} ms carved: " + ("carved" if keep else "not carved"))
        if prog.carved:
            c = job.ctx.sm_carveout
            lines.append(f"  matrix products beside a collective, leaving {c.sms} SMs free to it: {prog.carved} "
                         + (f"(a share of {c.share:.0%} of the SMs)" if c.total else "(inert off CUDA)"))
        if prog.offloaded:
            lines.append(f"  activations kept in host memory, fetched back early in the backward "
                         f"({len(prog.offloaded)}): {', '.join(prog.offloaded)[:300]}")
        if prog.unsharded is not None:
            lines.append(f"  memory budget {job.memory_budget / 2**20:.1f} MiB: kept gathered forward to backward "
                         f"({len(prog.unsharded)}): {', '.join(prog.unsharded)[:300]}")
        if prog.hashes:
            lines.append(f"  hashes (agreed by every rank): capture {prog.hashes['capture']} plan {prog.hashes['plan']}")
        if prog.bucket_choice:
            lines.append("  buckets (auto, cost model): " + choices(prog.bucket_choice))
        if prog.schedule:
            ops = prog.schedule.get("max_ops")
            lines.append(f"  schedule: cap {prog.schedule['max_in_flight'] / 2**20:.2f} MiB in flight"
                         + (f", {ops} collective(s) at a time" if ops else ""))
            if prog.schedule.get("cap_choice"):
                lines.append("  in-flight caps (cost model): " + choices(prog.schedule["cap_choice"]))
        if mode == "step":
            opt = job.predicted_update_s()
            step = job.cost.step_time(prog.gm, tl, opt, job.update_overlap())
            if job.update_overlap() is None:
                lines.append(f"  predicted step {step * 1e3:.2f} ms = graph + optimizer {opt * 1e3:.2f} ms")
            else:
                lines.append(f"  predicted step {step * 1e3:.2f} ms = graph {tl.step_s * 1e3:.2f} ms, its forward "
                             f"beside the previous step's update ({opt * 1e3:.2f} ms)")

            live = job.plan.liveness(prog)
            res = job.resident_bytes()
            lines.append(f"  memory: resident {sum(res.values()) / 2**20:.2f} MiB ("
                         + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in res.items())
                         + f"), graph peak +{live.peak / 2**20:.2f} MiB at {live.peak_at}")
            if live.at_peak:
                top = live.at_peak[:6]
                rest = live.peak - sum(b for _, b in top)
                lines.append("    live then (MiB): " + ", ".join(f"{n} {b / 2**20:.2f}" for n, b in top)
                             + (f", {len(live.at_peak) - len(top)} more {rest / 2**20:.2f}"
                                if len(live.at_peak) > len(top) else ""))
            if (st := job.state.streamer) is not None:
                hl = job.cost.host
                up, down = st.transfer_bytes()
                lines.append(f"  optimizer offload: {st.host_bytes() / 2**20:.2f} MiB on the host; per step "
                             f"{up / 2**20:.2f} MiB to the device, {down / 2**20:.2f} MiB back (>= "
                             f"{hl.stream_time(up, down) * 1e3:.2f} ms over {hl}); "
                             f"{st.device_bytes() / 2**20:.2f} MiB kept on the device; {len(st.chunks)} "
                             f"chunks, {st.window}-slot staging ring {st.staging_bytes() / 2**20:.2f} MiB")
                if st.host:
                    rate = f"{st.host_rate / 1e9:.2f} G elements/s measured" if st.host_rate else "rate not measured"
                    lines.append(f"  host update: {len(st.host)} parameters, {st.host_elements() / 1e6:.1f} M "
                                 f"elements on the host's cores ({rate}); predicted update "
                                 f"{st.update_time(hl) * 1e3:.2f} ms")
        lines.append(f"  {'collective':15s} {'axis':2s} {'phase':5s} {'sent/rank':>10s} {'pred µs':>9s}  param(s)")
        for n in prog.collective_nodes():
            c = collective_of(n)
            lines.append(f"  {c.kind:15s} {c.axis:2s} {c.phase:5s} {c.sent_bytes / 1024:8.1f}KiB "
                         f"{job.cost.comm_time(n) * 1e6:9.1f}  {c.label[:60]}")
        lines.extend(_moe_lines(job, prog))
    tp = job.state.tp
    axes = [a.label for a in tp.axes] if tp is not None else []
    lines.append("placements (dp axis" + (f", {' and '.join(axes)} axis: local shape and placement" if tp else "")
                 + ") and memory decisions:")
    kept = set(job.ctx.keep_gathered).union(*(prog.unsharded or () for prog in job.programs()))
    for n, lay in job.layouts.items():
        place = "R" if job.strategy == "ddp" else str(lay)
        what = []
        if job.strategy == "zero3":
            what.append("kept gathered fwd->bwd" if n in kept else "resharded after forward")
        if (st := job.state.streamer) is not None:
            what.append("master+optimizer state on the device" if n in st.resident
                        else "master+optimizer state on host, updated on the host" if n in st.host
                        else "master+optimizer state on host, streamed")
        for a in tp.axes if tp is not None else ():
            place += f"  {a.label} {a.placements.get(n, 'R')}"
        lines.append(f"  {n:40s} {str(tuple(lay.shape)):20s} {place:8s} {'; '.join(what)}".rstrip())
    g = job.tp.gather_choice if job.tp is not None else None
    if g:
        lines.append(f"  products of two shards gather {'the smaller operand' if g['gather'] == 'fewer_bytes' else 'the activation'}"
                     f", by the cost model: step {g['activation_s'] * 1e3:.3f} ms gathering activations (peak "
                     f"{size_text(g['activation_peak'])}) vs {g['fewer_bytes_s'] * 1e3:.3f} ms gathering the "
                     f"smaller operand (peak {size_text(g['fewer_bytes_peak'])})")
    for h in job.tp.head_choice if job.tp is not None else ():
        lines.append(f"  {h['head']}: {'vocab-parallel' if h['vocab_parallel'] else 'whole'}, by the cost "
                     f"model: step {h['split_s'] * 1e3:.3f} ms vocab-parallel (peak {size_text(h['split_peak'])}) vs "
                     f"{h['whole_s'] * 1e3:.3f} ms whole (peak {size_text(h['whole_peak'])}); "
                     "vocab_parallel=True|False decides instead")
    rows = job.tp.fuse_choice if job.tp is not None else []
    if rows:
        fused = sum(r["impl"] != "plain" for r in rows)
        lines.append(f"  products beside tp collectives (tp_fuse={job.tp.fuse!r}): {fused} of {len(rows)} fused; "
                     "predicted µs per way (plain, ring, kernel), the one taken in []:")
        for r in rows:
            ways = " ".join(f"[{i} {t * 1e6:.1f}]" if i == r["impl"] else f"{i} {t * 1e6:.1f}"
                            for i, t in r["predicted"].items())
            lines.append(f"    {r['kind']:14s} {size_text(r['bytes']):>9s}  {ways or r['impl']}  {r['site']}")
    return "\n".join(lines)


def _moe_lines(job, prog) -> list[str]:
    """Per MoE layer the ep axis splits: how its pairs reach the experts (a capacity dispatch's all-to-all, or every
    pair gathered: dropless), experts per rank, capacity, what the layer's forward collectives send per rank and their
    predicted time, and the pairs dropped in the last step on this rank (a ``dropped`` buffer beside the experts, as the
    built-in MoE keeps; ``-`` where none)."""
    layers = prog.capture.moe_layers
    if not layers:
        return []
    fwd = [n for n in prog.collective_nodes() if collective_of(n).axis == "ep" and collective_of(n).phase == "fwd"
           and collective_of(n).kind != "all_reduce" and not collective_of(n).params]  # not a weight's gather
    head = f"MoE layer (ep={layers[0]['ranks']})"
    out = [(f"    {head:34s} {'dispatch':>9s} {'experts':>7s} {'/rank':>5s} {'capacity':>8s} "
            f"{'fwd sent/rank':>13s} {'pred µs':>8s} {'dropped':>7s}")]
    at = 0
    for layer in layers:
        prefix = layer["params"][0].rpartition(".")[0]
        dropped = job.buffers.get(f"{prefix}.dropped" if prefix else "dropped")
        e, ep, cap, k = layer["experts"], layer["ranks"], layer["capacity"], layer["fwd_collectives"]
        mine, at = fwd[at:at + k], at + k
        sent = sum(collective_of(n).sent_bytes for n in mine)
        t = sum(job.cost.comm_time(n) for n in mine) * 1e6
        out.append(f"    {prefix or '(top)':34s} {'capacity' if cap else 'dropless':>9s} {e:7d} {e // ep:5d} "
                   f"{cap if cap else '-':>8} {sent / 1024:10.1f}KiB {t:8.1f} "
                   f"{'-' if dropped is None or not cap else int(dropped):>7}")
    if any(not layer["capacity"] for layer in layers):
        out.append("    dropless: the experts' group sizes follow the routing, so every rank's pairs go to every "
                   "rank (buffers for the worst case)")
    if job.ep is not None and job.ep.split_choice:
        out.append(f"    ep_split=auto: {job.ep.split} part(s) a micro-batch, by the cost model: predicted step "
                   + ", ".join(f"{t * 1e3:.3f} ms as {k}" for k, t in job.ep.split_choice.items()))
    c = job.ep.dispatch_choice if job.ep is not None else None
    if c:
        room = "no memory limit known" if c["room"] is None else f"the graph's room {size_text(c['room'])}"
        why = (f"dropless, by the cost model: its graph peak {size_text(c['dropless_peak'])} fits {room}"
               if c["dispatch"] == "dropless" else
               f"capacity x{c['factor']:g}, by the cost model: dropless needs a graph peak of "
               f"{size_text(c['dropless_peak'])}, over {room}; capacity's is {size_text(c['capacity_peak'])} "
               f"(step {c['dropless_s'] * 1e3:.3f} ms dropless vs {c['capacity_s'] * 1e3:.3f} ms)")
        out.append(f"    {why}; ep_capacity_factor=C or 'dropless' decides instead")
    return out
