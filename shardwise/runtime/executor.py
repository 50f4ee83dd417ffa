"""Runs compiled step programs: a program's executable (the FX graph op by op, or inductor's code), its inputs from this
rank's state, and the micro-batches of one step.

A program's inputs are ``[*params, *buffers, *batch]`` (passes/program.py): the parameters as this rank holds them
(whole, or its shards), the buffers, the batch's tensor leaves; then, for the programs of accumulated micro-batches, the
running sums (passes/accumulate.py)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx

from ..capture import flatten_batch

aten = torch.ops.aten


class Compiled(NamedTuple):
    """A rewritten program (passes.Program) and the callable that runs it."""

    program: object
    run: Callable


def eager_safe(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` to run op by op in eager mode, with each ``view`` made a ``reshape``.

    Tracing records a ``view`` wherever the fake strides allow one, but eager kernels may lay a result out
    otherwise (an expanded gradient times a transposed tensor, in the MoE dispatch's backward) and the view
    fails; ``reshape`` is that view or a copy. Inductor plans its own layouts and runs ``gm`` itself."""
    if not any(n.target is aten.view.default for n in gm.graph.nodes):
        return gm
    g = fx.Graph()
    g._codegen = gm.graph._codegen  # the same calling convention
    g.output(g.graph_copy(gm.graph, {}))
    for n in g.nodes:
        if n.target is aten.view.default:
            n.target = aten.reshape.default
    return fx.GraphModule(gm, g)


def executable(gm: fx.GraphModule, inductor: bool) -> Callable:
    """What runs ``gm``: its generated code called plainly (no module hooks: MemTracker counts module
    calls), or inductor's kernels (runtime/inductor.py)."""
    if not inductor:
        return eager_safe(gm).forward
    from .inductor import compile_graph

    return compile_graph(gm)


class Executor:
    """Runs one rank's programs on its state (runtime/state.py) and buffers."""

    def __init__(self, state, buffers: dict[str, torch.Tensor], device: torch.device, rank_input=None):
        self.state, self.buffers, self.device = state, buffers, device
        self.rank_input = rank_input
        """``rank_input(name, device)``: the value of a program input that differs by rank."""
        self.comm_bytes = 0
        """Bytes this rank sent in the programs run since ``comm_bytes`` was last reset."""

    def inputs(self, prog, tensors) -> list[torch.Tensor]:
        params = self.state.param_inputs(prog.param_input == "full", prog.input_dtypes)
        bufs = [self.buffers[n].detach() for n in prog.capture.buffer_names]
        return params + bufs + list(tensors) + [self.rank_input(n, self.device) for n in prog.capture.rank_inputs]

    def run(self, compiled: Compiled, batch, extra: list[torch.Tensor] = ()) -> list[torch.Tensor]:
        tensors, _, _ = flatten_batch(batch)
        with torch.no_grad():
            outs = compiled.run(*self.inputs(compiled.program, tensors), *extra)
        prog = compiled.program
        if getattr(prog, "sent_per_run", None) is None:  # a walk over every node: once, not every step
            prog.sent_per_run = prog.comm_bytes()
        self.comm_bytes += prog.sent_per_run
        return outs

    def sync_buffers(self, names: list[str], group, ranks: int) -> None:
        """The floating-point buffers a step wrote in place (BatchNorm's running statistics, each rank's
        from its own batches) made their mean over the data-parallel ranks, so every rank holds the
        same model; integer ones (``num_batches_tracked``) agree already."""
        bufs = [self.buffers[n] for n in names if self.buffers[n].is_floating_point()]
        if ranks == 1 or not bufs:
            return
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64 if b.dtype == torch.float64 else torch.float32)
                          for b in bufs])
        dist.all_reduce(flat, group=group)
        flat /= ranks
        with torch.no_grad():
            for b, v in zip(bufs, flat.split([b.numel() for b in bufs])):
                b.copy_(v.view_as(b))

    def zeros_like_inputs(self, compiled: Compiled, n: int) -> list[torch.Tensor]:
        """Zeroed running sums shaped and typed as the last ``n`` inputs of a program."""
        phs = compiled.program.gm.graph.find_nodes(op="placeholder")[-n:]
        return [torch.zeros(p.meta["val"].shape, dtype=p.meta["val"].dtype, device=self.device) for p in phs]

    def forward_backward(self, micro: list, get: Callable, whole_grads: bool) -> tuple[torch.Tensor, list]:
        """(loss, gradients in ``state.grad_names`` order) of a step over the micro-batches ``micro``;
        ``get(batch, mode)`` gives the compiled program of a mode (passes.MODES), ``whole_grads`` says
        the strategy keeps whole gradients across micro-batches (ddp, zero1)."""
        k, n_grads = len(micro), len(self.state.grad_names)
        if k > 1 and whole_grads:
            # whole gradients summed locally (in place, in the graph); one reduction, in the last micro-batch's program
            *sums, loss_sum = self.zeros_like_inputs(get(micro[0], "local"), n_grads + 1)
            for mb in micro[:-1]:
                (loss_sum,) = self.run(get(mb, "local"), mb, [*sums, loss_sum])
            outs = self.run(get(micro[-1], "last"), micro[-1], [*sums, loss_sum])
            del sums  # the whole sums are dead once reduced: free them before the optimizer step
            loss, grads = outs[0], list(outs[1:])
        elif k > 1:
            # zero2/zero3: each micro-batch reduce-scatters and adds its shards into the sums
            grads = self.zeros_like_inputs(get(micro[0], "acc"), n_grads)
            loss = torch.stack([self.run(get(mb, "acc"), mb, grads)[0] for mb in micro]).sum()
        else:
            outs = self.run(get(micro[0], "step"), micro[0])
            loss, grads = outs[0], list(outs[1:])
        if k > 1:
            loss = loss / k
            for g in grads:
                g.div_(k)
        return loss, grads
