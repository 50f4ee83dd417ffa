"""The one cost model: collectives (α-β per link profile), compute (roofline), a two-lane step simulation,
simulated memory (tensor liveness)."""

from .collectives import KINDS, PRESETS, LinkProfile, bus_factor, calibrate, fit
from .compute import DEVICES, Device, flops, node_time
from .memory import Liveness, liveness, optimizer_state_bytes, optimizer_transient
from .simulate import Timeline, simulate

__all__ = ["DEVICES", "KINDS", "PRESETS", "Device", "LinkProfile", "Liveness", "Timeline", "bus_factor", "calibrate",
           "fit", "flops", "liveness", "node_time", "optimizer_state_bytes", "optimizer_transient", "simulate"]
