"""What a ``Job`` holds and has learned, as read-only views (and two settings) over its parts: the
optimizer, the control group, the memory plan's budget and re-plans, the update's timings."""

from __future__ import annotations


def _view(part: str, attr: str, doc: str | None = None, settable: bool = False) -> property:
    """A property that reads ``job.<part>.<attr>`` (and, ``settable``, writes it)."""
    def get(self):
        return getattr(getattr(self, part), attr)

    def put(self, value) -> None:
        setattr(getattr(self, part), attr, value)

    return property(get, put if settable else None, doc=doc)


class Held:
    """The properties of ``Job`` that read its parts (job.py builds the parts)."""

    optimizer = _view("state", "optimizer", "The torch optimizer over this rank's trainable state (shards under "
                      "zero1-3).")
    ctrl = _view("agree", "ctrl", "The gloo group of the job's ranks that control messages travel on.")
    memory_budget = _view("plan", "budget")
    replans = _view("plan", "replans", "Each time a measured step contradicted the memory plan: its step, predicted "
                    "and measured peaks.")
    replan_at = _view("plan", "replan_at", "The step whose measured peak checks a budgeted plan (default 2).",
                      settable=True)
    recompiles_avoided = _view("compiler", "recompiles_avoided")
    residency_peak = _view("plan", "residency_peak", "Offload on CUDA: the measured peak of the first steps that "
                           "decided what state stays on the device.")
    time_optimizer = _view("updater", "timed", "Time the optimizer phase of each step (syncs the GPU); "
                           "``last_optimizer_s`` then holds it.", settable=True)
    last_optimizer_s = _view("updater", "last_s", settable=True)
    last_grad_norm = _view("updater", "last_grad_norm", "With ``clip_grad_norm``: the global gradient norm of the "
                           "last step, before clipping.")
