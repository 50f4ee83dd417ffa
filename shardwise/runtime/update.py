"""The optimizer step of a job: clipping, the update, and zero1/2's gather of the updated shards.

The update runs one of three ways:

- plain: the gradients set on the optimizer's tensors, ``optimizer.step()``;
- streamed (``offload_optimizer``): master shards and state in host memory, streamed through the
  device chunk by chunk (runtime/offload.py);
- overlapped (``overlap_update``, zero3 with the state on the device): about 16 chunks of equal bytes
  in the order the step program first reads the parameters, on CUDA on a stream of its own. The step
  returns before the update ends; the next graph's readiness waits (passes/ready.py) wait per chunk,
  so the next forward starts while later chunks are updated."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from ..costmodel.optimizer import optimizer_kernel, update_time
from .ops import ReadyWork


class Updater:
    """Runs and predicts the optimizer step of one rank's state (runtime/state.py)."""

    def __init__(self, state, device: torch.device, group: dist.ProcessGroup, ranks: int,
                 clip_grad_norm: float | None = None, overlap: bool = False):
        self.state, self.device, self.group, self.ranks = state, device, group, ranks
        self.clip, self.overlap = clip_grad_norm, bool(overlap)
        self.stream = None
        """CUDA, ``overlap``: the stream the update runs on."""
        self.chunks: list[list[str]] | None = None
        """``overlap``: the parameters of each chunk, in first-read order (``plan_chunks``)."""
        self.ready_names: set[str] = set()
        """``overlap``: the parameters the step program reads (each gets a readiness work)."""
        self.timed = False
        """Time each update (syncs the device): ``last_s`` is then measured."""
        self.last_s: float | None = None
        self.last_grad_norm: torch.Tensor | None = None
        if self.overlap and device.type == "cuda":
            opt = state.optimizer
            if any(isinstance(g.get("lr"), torch.Tensor) for g in opt.param_groups):
                raise ValueError("overlap_update: the optimizer's lr is a tensor, which a scheduler would "
                                 "change while the update still reads it; give lr as a float")
            self.stream = torch.cuda.Stream(device)
            # the optimizer's state is written on that stream: saving or loading it waits for it
            opt.register_state_dict_pre_hook(lambda *_: self.drain())
            opt.register_load_state_dict_pre_hook(lambda *_: self.drain())

    @property
    def overlaps_next_step(self) -> bool:
        """Whether a step's update runs beside the next step (overlap_update, or offload's overlap on CUDA)."""
        st = self.state.streamer
        return (st is not None and st.overlap) or self.stream is not None

    def clock(self, force: bool = False) -> float:
        if (self.timed or force) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step(self, grads: dict[str, torch.Tensor], program=None) -> int:
        """Clip, update, zero the gradients, gather zero1/2's whole weights; returns the bytes sent.
        ``program`` (the step's) orders the chunks of an overlapped update."""
        sent, self.last_grad_norm = 0, None
        if self.clip is not None:
            self.last_grad_norm, sent = self.state.clip_grad_norm_(grads, self.clip, self.group, self.ranks)
        t0 = self.clock()
        opt = self.state.optimizer
        if self.state.streamer is not None:
            self.state.streamer.step(grads)
        elif self.overlap:
            self._overlapped(grads, program)
        else:
            self.state.set_grads(grads)
            opt.step()
        opt.zero_grad(set_to_none=True)
        sent += self.state.sync_full_from_master(self.group, self.ranks)
        if self.timed:
            self.drain()  # the update's streams and its host part
            self.last_s = self.clock() - t0
        return sent

    def drain(self) -> None:
        """Wait for an update still running on its own streams (offload or overlap_update on CUDA);
        the readiness works left on the parameters are taken off (their events have passed)."""
        if self.state.streamer is not None:
            self.state.streamer.drain()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            with torch.no_grad():
                for t in self.state.master.values():
                    torch.ops._c10d_functional.wait_tensor(t)

    def plan_chunks(self, program) -> list[list[str]]:
        """The trainable parameters in the order ``program`` first reads them (its readiness waits;
        those it never reads last), cut into about 16 chunks of equal bytes."""
        if self.chunks is None:
            order = [n.meta["sw_ready"] for n in program.gm.graph.nodes if "sw_ready" in n.meta]
            self.ready_names, st = set(order), self.state
            names = [n for n in order if n in st.opt_tensors]
            names += [n for n in st.grad_names if n not in self.ready_names]
            size = {n: st.master[n].numel() * st.master[n].element_size() for n in names}
            target = sum(size.values()) / 16
            chunks, cur, acc = [], [], 0
            for n in names:
                cur.append(n)
                acc += size[n]
                if acc >= target:
                    chunks.append(cur)
                    cur, acc = [], 0
            self.chunks = chunks + ([cur] if cur else [])
        return self.chunks

    def _overlapped(self, grads: dict[str, torch.Tensor], program) -> None:
        """The update chunk by chunk in first-read order (each chunk: its gradients set, the optimizer
        stepped, which skips parameters without one); on CUDA on ``stream``, after the step's graph,
        the gradients kept from reuse until the update has read them."""
        upd, chunks = self.stream, self.plan_chunks(program)
        if upd is not None:
            from torch._C._distributed_c10d import _register_work

            upd.wait_stream(torch.cuda.current_stream(self.device))
            for g in grads.values():  # before any chunk reads them: safe even if a chunk raises
                g.record_stream(upd)
        for chunk in chunks:
            with torch.cuda.stream(upd) if upd is not None else contextlib.nullcontext():
                try:
                    self.state.set_grads({n: grads[n] for n in chunk})
                    self.state.optimizer.step()
                finally:
                    for n in chunk:
                        self.state.opt_tensors[n].grad = None
                if upd is not None:
                    ev = upd.record_event()
            if upd is not None:
                for n in chunk:
                    if n in self.ready_names:  # a work nothing waits for would stay registered
                        _register_work(self.state.master[n], ReadyWork(ev))

    def predicted_s(self, bandwidth: float, host_link) -> float:
        """The update's seconds: measured if a step ran ``timed``, else memory-bound passes over the master bytes
        (costmodel/optimizer.py), and under offload at least the host link's time for the host state both ways."""
        if self.last_s is not None:
            return self.last_s
        opt = self.state.optimizer
        nbytes = sum(t.numel() * t.element_size() for t in self.state.opt_tensors.values())
        adam = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))
        update = update_time(nbytes, bandwidth, adam, optimizer_kernel(opt.defaults, self.device.type))
        st = self.state.streamer
        return update if st is None else max(update, st.update_time(host_link))
