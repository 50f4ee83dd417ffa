"""Capture: the single-device training step as one ATen FX graph."""

from .trace import Capture, batch_signature, capture_step, flatten_batch, forward_nodes, hf_experts

__all__ = ["Capture", "batch_signature", "capture_step", "flatten_batch", "forward_nodes", "hf_experts"]
