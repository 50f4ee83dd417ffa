"""Optimizer state in host memory, streamed through the device for the update.

The master shards and every per-parameter optimizer state (Adam's moments) live in host memory
(pinned on CUDA). The optimizer step runs on the device, chunk by chunk: chunk i+1 is copied in on
one stream while chunk i is updated on the compute stream and chunk i-1 is copied back on a third,
so the PCIe link in both directions and the update overlap. Each chunk's update is the user's own
torch optimizer: its parameters' ``.data`` and state tensors are pointed at the device copies for
the call, then back at the host buffers. After an update the compute-dtype shard the step graph
reads is refreshed on the device, so the next step needs no host copy.

On CPU the "host" is a separate buffer pool and the copies are plain copies: the same code path
runs (and is tested for parity) without streams.
"""

from __future__ import annotations

import contextlib

import torch


class StreamedOptimizer:
    """Runs ``optimizer.step()`` over host-resident parameters and state, a chunk at a time on ``device``."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                 compute: dict[str, torch.Tensor], device: torch.device, chunk_bytes: int = 64 * 2**20):
        self.opt = optimizer
        self.params = params  # name -> host master (an nn.Parameter the optimizer holds)
        self.compute = compute  # name -> device shard in the compute dtype, refreshed after updates
        self.device = device
        self.cuda = device.type == "cuda"
        self.chunks: list[list[str]] = []
        size = 0
        for n, p in params.items():
            b = p.numel() * p.element_size()
            if not self.chunks or size + b > chunk_bytes:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(n)
            size += b
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.bytes_moved = 0

    def _stream(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def _state_tensors(self, p) -> dict[str, torch.Tensor]:
        """The per-element state of ``p`` (tensors shaped like it; scalars such as ``step`` stay put)."""
        return {k: v for k, v in self.opt.state.get(p, {}).items()
                if isinstance(v, torch.Tensor) and v.shape == p.shape}

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)

    def host_bytes(self) -> int:
        """Bytes held in host memory: master shards and per-element optimizer state."""
        return sum(p.numel() * p.element_size() + sum(v.numel() * v.element_size()
                                                      for v in self._state_tensors(p).values())
                   for p in self.params.values())

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step; ``grads`` are on the device (this rank's shards)."""
        nb = self.cuda
        staged = {}

        def copy_in(i):
            with self._stream(self.h2d if self.cuda else None):
                out = {}
                for n in self.chunks[i]:
                    p = self.params[n]
                    dev_p = p.detach().to(self.device, non_blocking=nb, copy=True)
                    states = {k: v.to(self.device, non_blocking=nb, copy=True) for k, v in self._state_tensors(p).items()}
                    self.bytes_moved += p.numel() * p.element_size() + sum(v.numel() * v.element_size()
                                                                           for v in states.values())
                    out[n] = (dev_p, states)
                ev = torch.cuda.Event() if self.cuda else None
                if ev is not None:
                    ev.record()
            return out, ev

        if self.cuda:
            # the previous step's write-backs land before this step reads the host buffers, and the
            # gradients (made on the compute stream) exist before the update reads them
            self.h2d.wait_stream(self.d2h)
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        staged[0] = copy_in(0)
        for i, names in enumerate(self.chunks):
            if i + 1 < len(self.chunks):
                staged[i + 1] = copy_in(i + 1)
            chunk, ev = staged.pop(i)
            if ev is not None:
                cur = torch.cuda.current_stream(self.device)
                cur.wait_event(ev)
                for dev_p, states in chunk.values():  # made on the copy stream, used on this one
                    dev_p.record_stream(cur)
                    for v in states.values():
                        v.record_stream(cur)
            # point the optimizer at the device copies of this chunk only
            host = {}
            for n in self.params:
                p = self.params[n]
                if n in chunk:
                    dev_p, states = chunk[n]
                    host[n] = (p.data, self._state_tensors(p))
                    p.data = dev_p
                    st = self.opt.state.get(p)
                    if st is not None:
                        st.update(states)
                    g = grads.get(n)
                    p.grad = None if g is None else (g if g.dtype == dev_p.dtype else g.to(dev_p.dtype))
                else:
                    p.grad = None
            self.opt.step()
            for n in chunk:
                c = self.compute.get(n)
                if c is not None:
                    c.copy_(self.params[n].data)  # the compute-dtype shard the next step reads
            done = torch.cuda.Event() if self.cuda else None
            if done is not None:
                done.record()
            with self._stream(self.d2h if self.cuda else None):
                if done is not None:
                    self.d2h.wait_event(done)
                for n in chunk:
                    p = self.params[n]
                    host_p, host_states = host[n]
                    dev_p = p.data
                    host_p.copy_(dev_p, non_blocking=nb)
                    self.bytes_moved += dev_p.numel() * dev_p.element_size()
                    st = self.opt.state.get(p, {})
                    for k, v in list(self._state_tensors(p).items()):
                        h = host_states.get(k)
                        if h is None:  # state created by this (first) step: give it a host buffer
                            h = self._to_host(v)
                        h.copy_(v, non_blocking=nb)
                        self.bytes_moved += v.numel() * v.element_size()
                        if self.cuda:
                            v.record_stream(self.d2h)
                        st[k] = h
                    if self.cuda:
                        dev_p.record_stream(self.d2h)
                    p.data = host_p
                    p.grad = None
        if self.cuda:
            # the next step's graph reads the refreshed compute shards (written on this stream);
            # host buffers are only read again by the next step's copies, ordered by h2d.wait_stream
            torch.cuda.current_stream(self.device).wait_stream(self.d2h)
