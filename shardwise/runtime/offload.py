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
    """Runs ``optimizer.step()`` over host-resident parameters and state, a chunk at a time on ``device``.

    ``resident`` names parameters whose master and state stay on the device (the part of the
    state the memory plan found room for): they are updated in place, in chunks of the same size
    (bounding the update's temporaries), with no copies. At most ``window`` streamed chunks are on
    the device at once: before chunk ``i + window`` is copied in, the host waits for chunk ``i``'s
    copy back to finish, so the staging memory is bounded whatever the host runs ahead.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                 compute: dict[str, torch.Tensor], device: torch.device, chunk_bytes: int = 64 * 2**20,
                 resident=(), window: int = 3):
        self.opt = optimizer
        self.params = params  # name -> master (an nn.Parameter the optimizer holds); host unless resident
        self.compute = compute  # name -> device shard in the compute dtype, refreshed after updates
        self.device = device
        self.cuda = device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self.window = window
        self.resident: frozenset[str] = frozenset()
        self.chunks: list[list[str]] = []
        self.resident_chunks: list[list[str]] = []
        self.set_resident(resident)
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.bytes_moved = 0

    def _chunked(self, names) -> list[list[str]]:
        chunks, size = [], 0
        for n in names:
            p = self.params[n]
            b = p.numel() * p.element_size()
            if not chunks or size + b > self.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(n)
            size += b
        return chunks

    @torch.no_grad()
    def set_resident(self, names) -> None:
        """Keep the master and state of ``names`` on the device and the rest in host memory (moving
        what changed side; the optimizer keeps its parameter objects)."""
        names = frozenset(names)
        unknown = names - set(self.params)
        if unknown:
            raise ValueError(f"set_resident: not parameters of this optimizer: {sorted(unknown)[:5]}")
        for n, p in self.params.items():
            if (n in names) == (n in self.resident):
                continue
            to_host = n not in names
            p.data = self._to_host(p.data).copy_(p.data) if to_host else p.data.to(self.device)
            st = self.opt.state.get(p, {})
            for k, v in list(self._state_tensors(p).items()):
                st[k] = self._to_host(v).copy_(v) if to_host else v.to(self.device)
        self.resident = names
        self.chunks = self._chunked([n for n in self.params if n not in names])
        self.resident_chunks = self._chunked([n for n in self.params if n in names])

    def _stream(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def _state_tensors(self, p) -> dict[str, torch.Tensor]:
        """The per-element state of ``p`` (tensors shaped like it; scalars such as ``step`` stay put)."""
        return {k: v for k, v in self.opt.state.get(p, {}).items()
                if isinstance(v, torch.Tensor) and v.shape == p.shape}

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)

    def _state_factor(self) -> int:
        """Per-element state tensors per parameter (measured once state exists, else by kind)."""
        from ..costmodel import optimizer_state_bytes

        p = next(iter(self.params.values()))
        have = self._state_tensors(p)
        if have:
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

    def transient_bytes(self) -> int:
        """Device bytes the step allocates on top of the resident state: ``window`` staged chunks of
        master + state, plus the update's temporaries for one chunk (the gradient cast to the master
        dtype and the foreach optimizer's two per-parameter temporaries)."""
        def chunk_bytes(c):
            return sum(self.params[n].numel() * self.params[n].element_size() for n in c)

        biggest = max((chunk_bytes(c) for c in self.chunks), default=0)
        biggest_any = max([biggest] + [chunk_bytes(c) for c in self.resident_chunks])
        return min(self.window, len(self.chunks)) * biggest * (1 + self._state_factor()) + 3 * biggest_any

    def step_bytes(self) -> int:
        """Bytes each step moves to the device (and the same back)."""
        return self.host_bytes()

    def _update(self, names, grads, staged=None) -> dict:
        """Point the optimizer at ``names`` only (their staged device copies, if any) and step."""
        host = {}
        for n in self.params:
            p = self.params[n]
            if n in names:
                if staged is not None:
                    dev_p, states = staged[n]
                    host[n] = (p.data, self._state_tensors(p))
                    p.data = dev_p
                    st = self.opt.state.get(p)
                    if st is not None:
                        st.update(states)
                g = grads.get(n)
                p.grad = None if g is None else (g if g.dtype == p.dtype else g.to(p.dtype))
            else:
                p.grad = None
        self.opt.step()
        for n in names:
            c = self.compute.get(n)
            if c is not None:
                c.copy_(self.params[n].data)  # the compute-dtype shard the next step reads
            if staged is None:
                self.params[n].grad = None
        return host

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step; ``grads`` are on the device (this rank's shards)."""
        nb = self.cuda
        staged = {}
        copied_back: dict[int, torch.cuda.Event] = {}

        def copy_in(i):
            if self.cuda and i - self.window in copied_back:
                copied_back.pop(i - self.window).synchronize()  # bound the chunks staged on the device
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
        if self.chunks:
            staged[0] = copy_in(0)
        # the resident part updates on the compute stream while the first chunk is copied in
        for names in self.resident_chunks:
            self._update(names, grads)
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
            host = self._update(names, grads, chunk)
            done = torch.cuda.Event() if self.cuda else None
            if done is not None:
                done.record()
            with self._stream(self.d2h if self.cuda else None):
                if done is not None:
                    self.d2h.wait_event(done)
                for n in names:
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
                    back = torch.cuda.Event()
                    back.record()
                    copied_back[i] = back
        if self.cuda:
            # the next step's graph reads the refreshed compute shards (written on this stream);
            # host buffers are only read again by the next step's copies, ordered by h2d.wait_stream
            torch.cuda.current_stream(self.device).wait_stream(self.d2h)
