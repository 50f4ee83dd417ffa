"""The host link: bandwidth between device memory and (pinned) host memory, and the time of a streamed optimizer step
over it.

An offloaded optimizer step moves every host-resident byte of master weights and optimizer state to the device and back:
``h2d = d2h = S``. Copies in the two directions run on separate streams and overlap, so the step's transfer time is
bounded below by

max(S / bw_h2d, S / bw_d2h, 2·S / bw_both)

where ``bw_both`` is the two directions measured at once (PCIe is full duplex, a host's memory system may not be).
``measure`` times the three; on CPU the "host" is a second buffer pool (memcpy speeds)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostLink:
    h2d: float
    """Bytes/s host -> device, alone."""
    d2h: float
    """Bytes/s device -> host, alone."""
    both: float
    """Bytes/s of the two directions together (sum of both), copies issued at once on two streams."""
    source: str = ""

    def stream_time(self, h2d_bytes: int, d2h_bytes: int) -> float:
        """Lower bound on seconds to move ``h2d_bytes`` in and ``d2h_bytes`` out, overlapped."""
        return max(h2d_bytes / self.h2d, d2h_bytes / self.d2h, (h2d_bytes + d2h_bytes) / self.both)

    def __str__(self) -> str:
        return (f"host link: h2d {self.h2d / 1e9:.1f} GB/s, d2h {self.d2h / 1e9:.1f} GB/s, "
                f"both at once {self.both / 1e9:.1f} GB/s")


def measure(device: torch.device, nbytes: int = 256 * 2**20, iters: int = 5) -> HostLink:
    """Time pinned host<->device copies of ``nbytes`` on ``device`` (median of ``iters``)."""
    cuda = device.type == "cuda"
    n = nbytes // 4
    host_in = torch.ones(n, dtype=torch.float32, pin_memory=cuda)
    host_out = torch.empty(n, dtype=torch.float32, pin_memory=cuda)
    dev_in = torch.empty(n, dtype=torch.float32, device=device)
    dev_out = torch.ones(n, dtype=torch.float32, device=device)
    s1, s2 = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)

    def timed(fn):
        ts = []
        for _ in range(iters + 1):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            ts.append(time.perf_counter() - t0)
        return sorted(ts[1:])[iters // 2]  # the median of the timed calls (the first warms up)

    def h2d():
        with torch.cuda.stream(s1) if cuda else contextlib.nullcontext():
            dev_in.copy_(host_in, non_blocking=cuda)

    def d2h():
        with torch.cuda.stream(s2) if cuda else contextlib.nullcontext():
            host_out.copy_(dev_out, non_blocking=cuda)

    t_in, t_out, t_both = timed(h2d), timed(d2h), timed(lambda: (h2d(), d2h()))
    src = f"measured on {torch.cuda.get_device_name(device) if cuda else 'CPU (memcpy)'}, {nbytes >> 20} MiB copies, " \
          f"{time.strftime('%Y-%m-%d')}"
    return HostLink(nbytes / t_in, nbytes / t_out, 2 * nbytes / t_both, src)
