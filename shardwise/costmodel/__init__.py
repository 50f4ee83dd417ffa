"""The one cost model: one device table, one topology-aware collective model (a calibrated link profile is
a one-level topology), roofline compute and FLOPs per token, simulated memory (tensor liveness), the
optimizer step, the two-lane simulation; ``CostModel`` puts them together for a job."""

from .collectives import KINDS, PRESETS, Level, LinkProfile, Topology, bus_factor, calibrate, fit, sent_bytes
from .compute import flops_per_token, node_time
from .devices import DEVICES, Device, cuda_device
from .hostlink import HostLink
from .memory import Liveness, liveness
from .model import CostModel
from .optimizer import optimizer_kernel, optimizer_state_bytes, optimizer_transient, update_time
from .simulate import Timeline, simulate
from ..sharding.ops import flops

__all__ = ["DEVICES", "KINDS", "PRESETS", "CostModel", "Device", "HostLink", "Level", "LinkProfile", "Liveness",
           "Timeline", "Topology", "bus_factor", "calibrate", "cuda_device", "fit", "flops", "flops_per_token",
           "liveness", "node_time", "optimizer_kernel", "optimizer_state_bytes", "optimizer_transient", "sent_bytes",
           "simulate", "update_time"]
