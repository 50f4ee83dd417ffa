"""Optimizer state in host memory, streamed through the device for the update.

The master shards and per-parameter optimizer state live in host memory (pinned on CUDA). The step runs on the device
chunk by chunk: chunk i+1 is copied in on one stream while chunk i is updated and chunk i-1 is copied back on a third,
so both directions of the PCIe link and the update overlap. With overlap (CUDA) the step returns before the update ends;
the next step's graph waits for each parameter where it first reads it (passes/ready.py). Each chunk's update is the
user's own torch optimizer, its ``.data`` and state pointed at the device copies for the call; the compute-dtype shard
is refreshed on the device.

A parameter bigger than a chunk is streamed in slices (Adam and AdamW: elementwise, state made up front as zeros, step
count advanced once per step), so staging memory is ``window`` chunks whatever the largest parameter (a 128k-vocabulary
embedding is 1.5 GB in fp32).

Part of the offloaded state may be updated on the host instead (``set_host``, Adam and AdamW) by a fused AdamW on a
worker thread: only the gradient goes down and the new compute-dtype weights come up (4 bytes per element in bf16, not
24 of fp32 master and moments). ``plan_host`` picks the split (the larger of link time and measured host update time,
minimised). Each parameter's weights are published as they arrive, in forward order, so the next forward waits only for
what it reads next.

On CPU the "host" is a separate buffer pool and the copies are plain copies: the same code path runs (and is tested for
parity) without streams."""

from __future__ import annotations

import contextlib
import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed

from .ops import HostReadyWork, ReadyWork


class StreamedOptimizer:
    """Runs ``optimizer.step()`` over host-resident parameters and state, a chunk at a time on ``device``.

    ``resident`` names parameters whose master and state stay on the device (what the memory plan found room for):
    updated in place, in chunks of the same size (bounding the update's temporaries). At most ``window`` streamed chunks
    are on the device at once: chunk ``i + window`` is copied in after chunk ``i``'s copy back. A chunk is a list of
    units ``(name, start, stop)``: flat element ranges of parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                 compute: dict[str, torch.Tensor], device: torch.device, chunk_bytes: int = 64 * 2**20,
                 resident=(), window: int = 3, overlap: bool = True):
        self.opt = optimizer
        self.params = params  # name -> master (an nn.Parameter the optimizer holds); host unless resident
        self.compute = compute  # name -> device shard in the compute dtype, refreshed after updates
        self.device, self.cuda = device, device.type == "cuda"
        if window < 2:
            raise ValueError(f"StreamedOptimizer: window must be at least 2 (a slot is copied into while the "
                             f"previous one is updated), got {window}")
        self.chunk_bytes, self.window = chunk_bytes, window
        # Adam and AdamW without capturable/fused: the state they make lazily is zeros plus a CPU ``step``
        # scalar, so it can be made up front and parameters sliced
        self.sliced = isinstance(optimizer, torch.optim.Adam) and not any(
            g.get("capturable") or g.get("fused") or g.get("differentiable") for g in optimizer.param_groups)
        if self.sliced:
            self._init_state()
        self.resident: frozenset[str] = frozenset()
        self.host: frozenset[str] = frozenset()  # updated on the host (``set_host``)
        self.chunks: list[list[tuple]] = []
        self.resident_chunks: list[list[tuple]] = []
        self.host_rate: float | None = None  # elements/s of the host update, measured (``plan_host``)
        self._host_opt: torch.optim.Optimizer | None = None
        self._host_params: dict[str, torch.nn.Parameter] = {}
        self._host_bufs: dict[str, dict[str, torch.Tensor]] = {}
        self._host_sent: dict[str, object] = {}  # name -> event of its last weights' copy to the device
        self._host_job: Future | None = None
        self._host_moved = 0  # bytes the worker sent up since the last join
        self._host_groups: list[dict] = []  # the user's param group of each host group
        self._worker: ThreadPoolExecutor | None = None
        self.grad_dtype: torch.dtype | None = None  # seen at the first step
        # CUDA: the update runs on its own stream and the step returns without waiting for it; the
        # next step's graph waits per parameter (passes/ready.py) via works registered on the
        # compute shards, so its first layers start while the last are still being updated
        self.overlap = overlap and self.cuda
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.upd = torch.cuda.Stream(device) if self.overlap else None
            self.hs = torch.cuda.Stream(device)  # the host update's gradients down and weights up
        self.bytes_moved = 0
        self.set_resident(resident)

    @torch.no_grad()
    def _init_state(self) -> None:
        """Adam's state as its first step would make it, made now in host memory."""
        try:
            from torch.optim.optimizer import _get_scalar_dtype

            scalar = _get_scalar_dtype()
        except ImportError:  # pragma: no cover - older layouts
            scalar = torch.get_default_dtype()
        for g in self.opt.param_groups:
            for p in g["params"]:
                st = self.opt.state[p]
                if st:
                    continue
                st["step"] = torch.tensor(0.0, dtype=scalar)
                for k in ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if g.get("amsgrad") else []):
                    st[k] = self._to_host(p).zero_()

    def _chunked(self, names) -> list[list[tuple]]:
        """Chunks of at most ``chunk_bytes`` of master weights; parameters sliced where allowed."""
        chunks: list[list[tuple]] = [[]]
        size = 0
        for n in names:
            p = self.params[n]
            es, numel = p.element_size(), p.numel()
            if not self.sliced:
                if chunks[-1] and size + numel * es > self.chunk_bytes:
                    chunks.append([])
                    size = 0
                chunks[-1].append((n, 0, numel))
                size += numel * es
                continue
            a = 0
            while a < numel or (numel == 0 and a == 0):
                room = (self.chunk_bytes - size) // es
                if room <= 0:
                    chunks.append([])
                    size, room = 0, max(1, self.chunk_bytes // es)
                b = min(numel, a + room)
                chunks[-1].append((n, a, b))
                size += (b - a) * es
                if numel == 0:
                    break
                a = b
        return [c for c in chunks if c]

    @torch.no_grad()
    def set_resident(self, names) -> None:
        """Keep the master and state of ``names`` on the device and the rest in host memory (moving
        what changed side; the optimizer keeps its parameter objects)."""
        names = frozenset(names)
        if unknown := names - set(self.params):
            raise ValueError(f"set_resident: not parameters of this optimizer: {sorted(unknown)[:5]}")
        self.drain()
        if self.host & names:
            self.set_host(self.host - names)
        for n, p in self.params.items():
            if (n in names) == (n in self.resident):
                continue
            to_host, st = n not in names, self.opt.state.get(p, {})
            for k, v in list(self._state_tensors(p).items()):
                st[k] = self._to_host(v).copy_(v) if to_host else v.to(self.device)
            p.data = self._to_host(p.data).copy_(p.data) if to_host else p.data.to(self.device)
        self.resident = names
        self.chunks = self._chunked(self.streamed())
        self.resident_chunks = self._chunked([n for n in self.params if n in names])

    def streamed(self) -> list[str]:
        """Parameters whose master and state stream through the device for the update."""
        return [n for n in self.params if n not in self.resident and n not in self.host]

    # -- the host update ------------------------------------------------------------------------

    def set_host(self, names) -> None:
        """Update the master and state of ``names`` (offloaded, not resident) on the host, one parameter at
        a time on a worker thread, with the user's groups' current hyperparameters; hooks registered on
        the user's optimizer do not run for this part. Call again after ``optimizer.load_state_dict``."""
        names = frozenset(names)
        bad = names - set(self.params)
        if bad or names & self.resident:
            raise ValueError(f"set_host: not offloaded parameters of this optimizer: {sorted(bad | (names & self.resident))[:5]}")
        if names and not self.sliced:
            raise ValueError(f"the host update is built for Adam and AdamW (state made up front), not "
                             f"{type(self.opt).__name__}: use offload_host_update=False")
        self.drain()
        self.host = names
        self.chunks = self._chunked(self.streamed())
        self._host_bufs = {n: b for n, b in self._host_bufs.items() if n in names}
        self._host_sent = {}
        self._host_opt = self._host_optimizer(names) if names else None
        for n in sorted(names - set(self._host_bufs), key=list(self.params).index):
            # pinned buffers are slow to make (page locking): made with the plan, not in a step
            dtype = self.grad_dtype or (self.compute[n] if n in self.compute else self.params[n]).dtype
            self._bufs(n, torch.empty(self.params[n].shape, device="meta", dtype=dtype))
        if names and self._worker is None:
            dev = self.device
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="shardwise-host-update",
                                              initializer=(lambda: torch.cuda.set_device(dev)) if self.cuda else None)

    def _host_optimizer(self, names) -> torch.optim.Optimizer:
        """An optimizer of the user's class and hyperparameters over the host masters of ``names`` (shared
        storage) and the very same state dicts. Fused where the masters are fp32/fp64 (CPU: one pass)."""
        by_id = {id(p): n for n, p in self.params.items()}
        groups, self._host_params, self._host_groups = [], {}, []
        fused = all(self.params[n].dtype in (torch.float32, torch.float64) for n in names)
        for g in self.opt.param_groups:
            ps = []
            for p in g["params"]:
                if (n := by_id.get(id(p))) in names:
                    ps.append(torch.nn.Parameter(p.data, requires_grad=p.requires_grad))
                    self._host_params[n] = ps[-1]
            if ps:
                groups.append(self._host_group(g, ps, fused))
                self._host_groups.append(g)
        opt = type(self.opt)(groups)
        for n, hp in self._host_params.items():
            opt.state[hp] = self.opt.state[self.params[n]]  # the same dict: one optimizer state
        return opt

    @staticmethod
    def _host_group(group: dict, params: list, fused: bool) -> dict:
        """The user's ``group`` hyperparameters over ``params``, fused where asked."""
        return {**group, **(dict(fused=True, foreach=False) if fused else {}), "params": params}

    def _bufs(self, n: str, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """Host buffers of one host-updated parameter, made once: the gradient as it arrives, in the
        master dtype, and the new weights in the compute dtype."""
        b, master = self._host_bufs.get(n), self.params[n]
        if b is None or b["grad"].dtype != grad.dtype:
            b = {"grad": torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.cuda)}
            if grad.dtype != master.dtype:
                b["grad32"] = torch.zeros(master.shape, dtype=master.dtype)  # pages touched now
            c = self.compute.get(n)
            if c is not None and self.cuda:
                b["out"] = torch.empty(c.shape, dtype=c.dtype, pin_memory=True)
            self._host_bufs[n] = b
        return b

    @torch.no_grad()
    def run_host_update(self, arrived: dict, published: dict[str, Future]) -> None:
        """Worker thread: step each host parameter once its gradient is home, then send its compute
        weights to the device (``published[name]`` gets the copy's event)."""
        for n, ev in arrived.items():
            hp, b = self._host_params[n], self._host_bufs[n]
            if self.cuda:
                ev.synchronize()
            g = b["grad"].view(hp.shape)
            if "grad32" in b:
                g = b["grad32"].copy_(g)
            hp.grad = g
            self._host_opt.step()
            hp.grad = None
            c, sent = self.compute.get(n), None
            self._host_moved += c.numel() * c.element_size() if c is not None else 0
            if c is not None and self.cuda:
                out = b["out"]
                if n in self._host_sent:
                    self._host_sent[n].synchronize()  # the last step's copy has left the buffer
                out.copy_(hp.data.view(out.shape))
                with torch.cuda.stream(self.hs):
                    c.copy_(out, non_blocking=True)
                    sent = self._event()
                self._host_sent[n] = sent
            elif c is not None:
                c.copy_(hp.data)
            if n in published:
                published[n].set_result(sent)

    def start_host(self, grads: dict[str, torch.Tensor], main) -> dict[str, Future]:
        """Send the host parameters' gradients down (in forward order, on their own stream, after the
        step's graph) and start the worker; returns each parameter's future copy-up event. The host
        groups take the user's groups' current hyperparameters first (a scheduler changes ``lr``)."""
        for hg, g in zip(self._host_opt.param_groups, self._host_groups):
            hg.update({k: v for k, v in g.items() if k not in ("params", "fused", "foreach")})
        arrived, published = {}, {}
        if self.cuda:
            self.hs.wait_stream(main)
        for n in self.params:
            g = grads.get(n)
            if n not in self.host or g is None:
                continue
            b = self._bufs(n, g)
            self.bytes_moved += g.numel() * g.element_size()
            with self._stream(self.hs if self.cuda else None):
                b["grad"].copy_(g, non_blocking=self.cuda)
                if self.cuda:
                    g.record_stream(self.hs)
                arrived[n] = self._event()
            published[n] = Future()
        self._host_job = self._worker.submit(self.run_host_update, arrived, published)

        def failed(job):  # a worker that failed (or never ran) must not leave the next step's graph waiting
            if job.exception() is not None:
                for f in published.values():
                    if not f.done():
                        f.set_exception(job.exception())

        self._host_job.add_done_callback(failed)
        return published

    def _join_host(self) -> None:
        """Wait (host) for the host update; its errors surface here."""
        job, self._host_job = self._host_job, None
        if job is not None:
            job.result()
            self.bytes_moved += self._host_moved  # counted by the worker alone, added here
            self._host_moved = 0

    @torch.no_grad()
    def measure_host_rate(self, numel: int = 1 << 24, iters: int = 3) -> float:
        """Elements/s of the host update on this machine: the gradient's cast to the master dtype, a
        step of the host optimizer's kind and the cast of the new weights, on scratch tensors."""
        name, master = next(iter(self.params.items()))
        cd = self.compute[name].dtype if name in self.compute else master.dtype
        gd = self.grad_dtype or cd
        p = torch.nn.Parameter(torch.zeros(numel, dtype=master.dtype))
        g = torch.ones(numel, dtype=gd, pin_memory=self.cuda)
        out = torch.empty(numel, dtype=cd, pin_memory=self.cuda)
        fused = master.dtype in (torch.float32, torch.float64)
        opt = type(self.opt)([self._host_group(self.opt.param_groups[0], [p], fused)])
        p.grad = torch.empty(numel, dtype=master.dtype)
        ts = []
        for _ in range(iters + 1):
            t0 = time.perf_counter()
            p.grad.copy_(g)
            opt.step()
            out.copy_(p)
            ts.append(time.perf_counter() - t0)
        return numel / sorted(ts[1:])[len(ts[1:]) // 2]

    def transfer_bytes(self) -> tuple[int, int]:
        """Bytes each step moves (to the device, back): the streamed master and state both ways;
        for host-updated parameters the new compute weights up and the gradients down."""
        streamed = sum(self.param_bytes(n) for n in self.streamed())
        up = sum(self.compute[n].numel() * self.compute[n].element_size() for n in self.host if n in self.compute)
        gsize = self.grad_dtype.itemsize if self.grad_dtype is not None else None
        down = sum(self.params[n].numel() * (gsize or (self.compute[n].element_size() if n in self.compute
                                                        else self.params[n].element_size())) for n in self.host)
        return streamed + up, streamed + down

    def host_elements(self) -> int:
        return sum(self.params[n].numel() for n in self.host)

    def update_time(self, link) -> float:
        """Predicted update seconds: the link moving ``transfer_bytes`` (both ways at once) beside the host's part."""
        host = self.host_elements() / self.host_rate if self.host and self.host_rate else 0.0
        return max(link.stream_time(*self.transfer_bytes()), host)

    def plan_host(self, link, rate: float | None = None, fraction: float | None = None) -> list[str]:
        """Choose the host-updated parameters among the offloaded, last in forward order first (the next forward
        reads them last): ``fraction`` of the offloaded state's bytes, else each one that lowers ``update_time``."""
        take: list[str] = []
        cands = [n for n in self.params if n not in self.resident][::-1] if self.sliced else []
        if fraction is not None:  # each candidate while the ones before it hold less than the fraction
            total = sum(self.param_bytes(n) for n in cands)
            before = itertools.accumulate((self.param_bytes(n) for n in cands), initial=0)
            take = [n for n, acc in zip(cands, before) if acc < fraction * total]
        elif cands:
            self.host_rate = rate if rate is not None else (self.host_rate or self.measure_host_rate())
            self.drain()
            # candidate splits are priced by setting ``host`` alone; set_host below makes the chosen one
            # (its pinned buffers are kept for the parameters that stay on the host)
            self.host = frozenset()
            best = self.update_time(link)
            for n in cands:
                self.host = frozenset(take + [n])
                t = self.update_time(link)
                if t < best:
                    best = t
                    take.append(n)
        self.set_host(take)
        return take

    def _stream(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def _event(self):
        """An event recorded on the current stream (CUDA), else None."""
        return torch.cuda.current_stream().record_event() if self.cuda else None

    def _state_tensors(self, p) -> dict[str, torch.Tensor]:
        """The per-element state of ``p`` (tensors shaped like it; scalars such as ``step`` stay put)."""
        return {k: v for k, v in self.opt.state.get(p, {}).items()
                if isinstance(v, torch.Tensor) and v.shape == p.shape}

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)

    def _state_factor(self) -> int:
        """Per-element state tensors per parameter (measured once state exists, else by kind)."""
        from ..costmodel import optimizer_state_bytes

        if have := self._state_tensors(next(iter(self.params.values()))):
            return len(have)
        return round((optimizer_state_bytes(self.opt) - 4 * len(self.params))
                     / max(1, sum(q.numel() * q.element_size() for q in self.params.values())))

    def host_bytes(self) -> int:
        """Bytes held in host memory: master shards and per-element optimizer state."""
        return sum(self.param_bytes(n) for n in self.params if n not in self.resident)

    def param_bytes(self, name: str) -> int:
        """Master + per-element state bytes of one parameter (predicted before the first step)."""
        p = self.params[name]
        return p.numel() * p.element_size() * (1 + self._state_factor())

    def device_bytes(self) -> int:
        """Bytes of master and state kept on the device (the resident part)."""
        return sum(self.param_bytes(n) for n in self.resident)

    def _chunk_bytes(self, chunk) -> int:
        return sum((b - a) * self.params[n].element_size() for n, a, b in chunk)

    def staging_bytes(self) -> int:
        """Device bytes of the staging ring: ``window`` slots, each holding one chunk's master and
        per-element state. Allocated at the first step and kept (no allocator churn between steps)."""
        biggest = max((self._chunk_bytes(c) + 16 * len(c) for c in self.chunks), default=0)
        return min(self.window, len(self.chunks)) * biggest * (1 + self._state_factor())

    def transient_bytes(self) -> int:
        """Device bytes the update allocates for one chunk: the gradients cast to the master dtype
        and the foreach optimizer's two per-parameter temporaries."""
        return 3 * max([self._chunk_bytes(c) for c in self.chunks + self.resident_chunks] or [0])

    def _update(self, chunk, grads, views, counts) -> None:
        """Step the optimizer on ``chunk``'s units only. ``views[name]`` = (parameter data, {state key:
        tensor}) to use for the unit: device slices, copied in or (resident) views of the whole."""
        for p in self.params.values():
            p.grad = None
        for n, a, b in chunk:
            p = self.params[n]
            data, states = views[n]
            st = self.opt.state.get(p)
            if st is not None and "step" in st and isinstance(st["step"], torch.Tensor):
                # a parameter sliced over several units advances its step count once per step
                if n in counts:
                    st["step"] = counts[n].clone()
                else:
                    counts[n] = st["step"].clone()
            p.data = data
            if st is not None:
                st.update(states)
            g = grads.get(n)
            if g is not None:
                g = g.reshape(-1)[a:b] if self.sliced else g
                p.grad = g if g.dtype == data.dtype else g.to(data.dtype)
        self.opt.step()
        for n, a, b in chunk:
            c = self.compute.get(n)
            if c is not None:  # the compute-dtype shard the next step reads
                self._piece(c, a, b).copy_(self.params[n].data)
            self.params[n].grad = None

    def _piece(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return t.view(-1)[a:b] if self.sliced else t

    def _slots(self, roles: list[str]) -> list[dict[str, torch.Tensor]]:
        """The staging ring: ``window`` slots of one flat byte buffer per role (``param`` and each
        per-element state key), made on the compute stream once and reused every step."""
        size = max(self._chunk_bytes(c) + 16 * len(c) for c in self.chunks)
        self._ring_fresh = False
        if getattr(self, "_ring", None) is None or self._ring_key != (size, tuple(roles)):
            if getattr(self, "_ring", None) is not None and self.cuda:
                # the old slots may still be read by copies on the side streams: let them finish before
                # the allocator hands their memory to the compute stream
                torch.cuda.synchronize(self.device)
            self._ring = [{r: torch.empty(size, dtype=torch.uint8, device=self.device) for r in roles}
                          for _ in range(min(self.window, len(self.chunks)))]
            self._ring_key = (size, tuple(roles))
            self._ring_fresh = True
        return self._ring

    @staticmethod
    def _carve(buf: torch.Tensor, off: int, like: torch.Tensor, a: int, b: int, shape) -> tuple[torch.Tensor, int]:
        """A ``like.dtype`` view of ``b - a`` elements of ``buf`` at byte ``off`` (16-byte aligned)."""
        nbytes = (b - a) * like.element_size()
        return buf[off:off + nbytes].view(like.dtype).view(shape), off + (nbytes + 15) // 16 * 16

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step; ``grads`` are on the device (this rank's shards).

        Chunk ``i`` is copied into ring slot ``i % window`` on the host-to-device stream once the slot's
        last chunk is home (a device-side wait), updated on the update stream (the compute stream without
        overlap), and copied back on the device-to-host stream. The host never waits for the device, and
        nothing is allocated per chunk but the update's own temporaries."""
        nb = self.cuda
        self._join_host()  # the last step's host update (the graph that just ran read its weights)
        if self.grad_dtype is None and grads:
            self.grad_dtype = next(iter(grads.values())).dtype
        counts: dict[str, torch.Tensor] = {}
        whole = {n: (p.data, self._state_tensors(p)) for n, p in self.params.items() if n not in self.host}
        roles = ["param"] + sorted({k for _, st in whole.values() for k in st})
        ring = self._slots(roles) if self.chunks else []
        copied_back: dict[int, object] = {}
        ready: dict[str, object] = {}  # name -> event after its last update (overlap)
        main = torch.cuda.current_stream(self.device) if self.cuda else None
        cur = self.upd if self.overlap else main  # the stream the update runs on
        # the host part first: its gradients go down ahead of the streamed chunks' traffic
        published = self.start_host(grads, main) if self.host else {}
        if self.overlap:
            cur.wait_stream(main)  # the gradients exist and the step's graph is done with the shards
            for n, g in grads.items():
                if n not in self.host:
                    g.record_stream(cur)  # the compute stream must not reuse them before the update read them

        def copy_in(i):
            slot = ring[i % len(ring)]
            with self._stream(self.h2d if self.cuda else None):
                if self.cuda and i - len(ring) in copied_back:
                    self.h2d.wait_event(copied_back.pop(i - len(ring)))  # the slot's last chunk is home
                out, offs = {}, dict.fromkeys(roles, 0)
                for n, a, b in self.chunks[i]:
                    data, states = whole[n]
                    shape = (b - a,) if self.sliced else data.shape
                    dev, offs["param"] = self._carve(slot["param"], offs["param"], data, a, b, shape)
                    dev.copy_(self._piece(data, a, b).view(shape), non_blocking=nb)
                    dst = {}
                    for k, v in states.items():
                        dst[k], offs[k] = self._carve(slot[k], offs[k], v, a, b, shape)
                        dst[k].copy_(self._piece(v, a, b).view(shape), non_blocking=nb)
                    self.bytes_moved += dev.numel() * dev.element_size() * (1 + len(dst))
                    out[n] = (dev, dst)
                ev = self._event()
            return out, ev

        try:
            if self.cuda:
                # the previous step's copies back are done before this step's copies in (ring reuse);
                # slots just made on the compute stream are ready once it gets here. Otherwise the
                # copies in need nothing from the compute stream and start during its backward.
                if getattr(self, "_ring_fresh", True):
                    self.h2d.wait_stream(main)
                self.h2d.wait_stream(self.d2h)
            staged = {0: copy_in(0)} if self.chunks else {}
            # the resident part updates in place while the first chunk is copied in
            for chunk in self.resident_chunks:
                views = {}
                for n, a, b in chunk:
                    data, states = whole[n]
                    views[n] = (self._piece(data, a, b), {k: self._piece(v, a, b) for k, v in states.items()})
                with self._stream(cur if self.overlap else None):
                    self._update(chunk, grads, views, counts)
                    if self.overlap:
                        ev = self._event()
                        ready.update((n, ev) for n, _, _ in chunk)
            for i, chunk in enumerate(self.chunks):
                if i + 1 < len(self.chunks):
                    staged[i + 1] = copy_in(i + 1)
                views, ev = staged.pop(i)
                if ev is not None:
                    cur.wait_event(ev)
                with self._stream(cur if self.overlap else None):
                    self._update(chunk, grads, views, counts)
                    done = self._event()
                if self.overlap:
                    ready.update((n, done) for n, _, _ in chunk)
                with self._stream(self.d2h if self.cuda else None):
                    if done is not None:
                        self.d2h.wait_event(done)
                    for n, a, b in chunk:
                        p = self.params[n]
                        data, states = whole[n]
                        dev = p.data
                        self._piece(data, a, b).copy_(dev.reshape(-1) if self.sliced else dev, non_blocking=nb)
                        self.bytes_moved += dev.numel() * dev.element_size()
                        st = self.opt.state.get(p, {})
                        for k, v in list(st.items()):
                            if not isinstance(v, torch.Tensor) or k == "step" or v.shape != dev.shape:
                                continue
                            h = states.get(k)
                            if h is None:  # state made by this (first) step of an unsliced optimizer
                                h = states[k] = self._to_host(v)
                                if self.cuda:
                                    v.record_stream(self.d2h)
                            self._piece(h, a, b).copy_(v.reshape(-1) if self.sliced else v, non_blocking=nb)
                            self.bytes_moved += v.numel() * v.element_size()
                    copied_back[i] = self._event()  # read on CUDA alone
        finally:
            # the optimizer's parameters and state point at the whole tensors again
            for n, (data, states) in whole.items():
                p = self.params[n]
                p.data = data
                p.grad = None
                st = self.opt.state.get(p)
                if st is not None:
                    st.update(states)
        if self.overlap:
            # the next graph waits for each parameter where it first reads it (passes/ready.py)
            from torch._C._distributed_c10d import _register_work

            works = [(n, ReadyWork(e)) for n, e in ready.items()]
            for n, work in works + [(n, HostReadyWork(f)) for n, f in published.items()]:
                if n in self.compute:
                    _register_work(self.compute[n], work)
            return
        self._join_host()
        if self.host and self.cuda:
            main.wait_stream(self.hs)  # the host part's weights are on the device
        if self.cuda:
            # the next step's graph reads the refreshed compute shards (written on the compute
            # stream); it must not start before the slots are free again either (next step's ring)
            main.wait_stream(self.d2h)

    def drain(self) -> None:
        """Wait (host) for the update and its copies back: before reading state outside a step. The
        readiness works left on the compute shards are taken off (their events have passed)."""
        self._join_host()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.hs)
            if self.upd is not None:
                self.upd.synchronize()
            self.d2h.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self.upd or self.d2h)
            if self.overlap:
                for c in self.compute.values():
                    torch.ops._c10d_functional.wait_tensor(c)
