"""Capture: the single-device training step as one ATen FX graph."""

from .trace import Capture, CaptureError, batch_signature, capture_step, elementwise, flatten_batch, forward_nodes

__all__ = ["Capture", "CaptureError", "batch_signature", "capture_step", "elementwise", "flatten_batch", "forward_nodes"]
