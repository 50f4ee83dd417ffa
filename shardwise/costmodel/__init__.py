"""The one cost model: collectives (α-β per link profile), compute (roofline), a two-lane step simulation."""

from .collectives import KINDS, PRESETS, LinkProfile, bus_factor, calibrate, fit
from .compute import DEVICES, Device, flops, node_time
from .simulate import Timeline, simulate

__all__ = ["DEVICES", "KINDS", "PRESETS", "Device", "LinkProfile", "Timeline", "bus_factor", "calibrate", "fit",
           "flops", "node_time", "simulate"]
