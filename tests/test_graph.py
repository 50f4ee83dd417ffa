"""What each strategy does to the captured graph (structure only; no process group needed)."""

import operator

import pytest
import torch

from shardwise.capture import capture_step, forward_nodes
from shardwise.models import build
from shardwise.passes import ShardContext, shard_step
from shardwise.passes.schedule import keep_alive
from shardwise.sharding.collective import collective_of
from shardwise.sharding.ops import info

WS = 4


def captured(name="gpt", dtype=None, **over):
    torch.manual_seed(0)
    m = build(name, "tiny", **over)
    x = torch.randint(0, 64, (2, 16))
    return m, capture_step(m, (x, x), param_dtype=dtype)


def sw_nodes(gm, kind=None, phase=None):
    out = []
    for n in gm.graph.nodes:
        c = collective_of(n)
        if c and (kind is None or c.kind == kind) and (phase is None or c.phase == phase):
            out.append(n)
    return out


def test_capture_is_one_graph_of_forward_and_backward():
    m, cap = captured()
    n_in = len(cap.gm.graph.find_nodes(op="placeholder"))
    assert n_in == cap.n_params + len(cap.buffer_names) + 2
    out = cap.gm.graph.find_nodes(op="output")[0].args[0]
    assert len(out) == 1 + len(cap.grad_names)
    # tied embedding/head: one parameter, one gradient
    assert "head.weight" not in cap.param_names and "wte.weight" in cap.param_names
    assert len(forward_nodes(cap.gm)) < len(cap.gm.graph.nodes)  # backward is in the graph too
    assert not sw_nodes(cap.gm)  # no collective before a strategy pass


def test_ddp_buckets_all_reduces():
    _, cap = captured()
    one = shard_step(cap, "ddp", ShardContext(WS, "g", bucket_bytes=1 << 30))
    assert one.counts() == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2}  # one bucket + the loss
    small = shard_step(cap, "ddp", ShardContext(WS, "g", bucket_bytes=16 * 1024))
    buckets = [n for n in sw_nodes(small.gm, "all_reduce") if collective_of(n).phase == "bwd"]
    assert len(buckets) > 2
    names = [p for b in buckets for p in collective_of(b).params]
    assert sorted(names) == sorted(cap.grad_names)  # every gradient in exactly one bucket
    # a bucket is issued before the backward ends: some backward compute follows the first one
    nodes = list(small.gm.graph.nodes)
    first = nodes.index(buckets[0])
    assert any(n.op == "call_function" and "mm" in str(n.target) for n in nodes[first:])


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero12_reduce_scatters_gradients(strategy):
    _, cap = captured()
    prog = shard_step(cap, strategy, ShardContext(WS, "g"))
    assert prog.counts() == {"all_gather": 0, "reduce_scatter": len(cap.grad_names), "all_reduce": 1}
    assert prog.param_input == "full" and prog.grad_output == "shard"
    outs = prog.gm.graph.find_nodes(op="output")[0].args[0][1:]
    for name, o in zip(cap.grad_names, outs):
        assert tuple(o.meta["val"].shape) == prog.layouts[name].local_shape


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_zero3_gathers_each_parameter_for_forward_and_for_backward(name):
    _, cap = captured(name)
    prog = shard_step(cap, "zero3", ShardContext(WS, "g"))
    fwd = [collective_of(n).param for n in sw_nodes(prog.gm, "all_gather", "fwd")]
    bwd = [collective_of(n).param for n in sw_nodes(prog.gm, "all_gather", "bwd")]
    assert sorted(fwd) == sorted(cap.param_names)  # one forward gather per parameter
    assert len(set(bwd)) == len(bwd)  # at most one backward gather per parameter
    # every linear weight is read again in backward (for its input's gradient), so it is gathered
    # again; an untied embedding table is not (its backward reads only the indices)
    untied_tables = {"wpe.weight", "tok.weight"}
    mats = [n for n, s in zip(cap.param_names, cap.param_shapes) if len(s) >= 2 and n not in untied_tables]
    assert set(mats) <= set(bwd)
    assert prog.counts()["reduce_scatter"] == len(cap.grad_names)
    # every parameter input is now a shard
    for ph, n in zip(prog.gm.graph.find_nodes(op="placeholder"), cap.param_names):
        assert tuple(ph.meta["val"].shape) == prog.layouts[n].local_shape


def _chain_users(node):
    """Every node that reads ``node`` or a pure view/cast chain of it."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "call_function" and info(u.target).chain:
                stack.append(u)
            out.append(u)
    return out


@pytest.mark.parametrize("over", [{}, {"checkpoint": True}])
def test_zero3_no_gathered_weight_lives_into_backward(over):
    _, cap = captured("llama", **over)
    prog = shard_step(cap, "zero3", ShardContext(WS, "g"))
    fwd = forward_nodes(prog.gm)  # what the loss depends on
    for start in sw_nodes(prog.gm, "all_gather", "fwd"):
        wait = next(iter(start.users))
        # keep_alive sits right after the wait (it holds the collective's buffers, it reads nothing)
        late = [u for u in _chain_users(wait) if u not in fwd and u.target is not keep_alive]
        assert not late, f"{start.meta['sw']['param']} gathered in forward is read in backward by {late}"


def test_zero3_mixed_precision_casts_the_shard_before_gathering():
    _, cap = captured("llama", dtype=torch.bfloat16)
    prog = shard_step(cap, "zero3", ShardContext(WS, "g", param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for start in sw_nodes(prog.gm, "all_gather"):
        assert start.args[0].meta["val"].dtype == torch.bfloat16
    for start in sw_nodes(prog.gm, "reduce_scatter"):
        assert start.args[0].meta["val"].dtype == torch.float32
    assert all(prog.input_dtypes[n] == torch.float32 for n in cap.param_names)


def test_ws1_inserts_no_collectives():
    _, cap = captured()
    for s in ["ddp", "zero1", "zero2", "zero3"]:
        assert sum(shard_step(cap, s, ShardContext(1, "g")).counts().values()) == 0


def test_host_staging_wraps_every_collective():
    # gloo ranks sharing a GPU move payloads to the host around each collective; shown here with a
    # stand-in staging device on a CPU graph (the rewrite only looks at devices, nothing runs)
    _, cap = captured()
    prog = shard_step(cap, "zero3", ShardContext(WS, "g", stage="meta"))
    starts = sw_nodes(prog.gm)
    assert starts
    for s in starts:
        assert s.args[0].target is torch.ops.aten._to_copy.default and s.args[0].kwargs["device"].type == "meta"
        wait = next(iter(s.users))
        (back,) = [u for u in wait.users if u.target is not keep_alive]
        assert back.target is torch.ops.aten._to_copy.default and back.kwargs["device"].type == "cpu"


def test_accumulation_programs():
    _, cap = captured()
    n = len(cap.grad_names)
    ctx = ShardContext(WS, "g")
    local = shard_step(cap, "zero1", ctx, "local")
    assert sum(local.counts().values()) == 0  # no collective before the last micro-batch
    adds = [x for x in local.gm.graph.nodes if x.target is torch.ops.aten.add_.Tensor]
    assert len(adds) == n and all(a.args[0].op == "placeholder" for a in adds)  # in place into the sums
    assert len(local.gm.graph.find_nodes(op="output")[0].args[0]) == 1  # only the loss leaves
    last = shard_step(cap, "zero1", ctx, "last")
    for rs in sw_nodes(last.gm, "reduce_scatter"):  # what is reduced is sum + fresh gradient
        src = rs.args[0]
        while src.target is not torch.ops.aten.add.Tensor:
            src = src.args[0]
        assert src.args[0].op == "placeholder" and src.args[0].name.startswith("grad_sum")
    acc = shard_step(cap, "zero2", ctx, "acc")
    assert acc.counts()["reduce_scatter"] == n
    adds = [x for x in acc.gm.graph.nodes if x.target is torch.ops.aten.add_.Tensor]
    assert len(adds) == n and all(a.args[1].target is torch.ops._c10d_functional.wait_tensor.default for a in adds)
    with pytest.raises(ValueError, match="local/last are for ddp and zero1"):
        shard_step(cap, "zero3", ctx, "local")


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_bucketing_merges_collectives(strategy):
    _, cap = captured("llama")
    one = shard_step(cap, strategy, ShardContext(WS, "g"))
    merged = shard_step(cap, strategy, ShardContext(WS, "g", shard_bucket_bytes=1 << 30))
    assert merged.buckets >= 1
    c1, c2 = one.counts(), merged.counts()
    assert c2["reduce_scatter"] == 1 and c1["reduce_scatter"] == len(cap.grad_names)
    if strategy == "zero3":
        assert c2["all_gather"] == 2  # one forward bucket, one backward bucket
    # every parameter is still in exactly one bucket per phase
    names = [p for s in sw_nodes(merged.gm, "reduce_scatter") for p in collective_of(s).params]
    assert sorted(names) == sorted(cap.grad_names)
    assert sum(collective_of(s).full_bytes for s in sw_nodes(merged.gm)) == sum(
        collective_of(s).full_bytes for s in sw_nodes(one.gm))


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_bucketing_host_staged_collectives_keeps_topological_order(strategy):
    # gloo ranks sharing a GPU stage each collective on the host: a copy there before it and a copy
    # back after its wait. A reduce-scatter bucket is issued after its last member's gradient, so the
    # earlier members' copies back must move after it (they read the bucket's result). The stage
    # device here is "meta" (the graph is only built, never run): the same copies as "cpu" on a GPU.
    _, cap = captured("llama")
    one = shard_step(cap, strategy, ShardContext(WS, "g", stage="meta", schedule=False))
    merged = shard_step(cap, strategy, ShardContext(WS, "g", stage="meta", shard_bucket_bytes=1 << 30))
    assert merged.buckets >= 1 and merged.counts()["reduce_scatter"] == 1
    merged.gm.graph.lint()  # raises if a node reads a value defined after it
    copies_back = [n for n in merged.gm.graph.nodes if n.target is torch.ops.aten._to_copy.default
                   and n.args[0].target is torch.ops._c10d_functional.wait_tensor.default]
    staged = [n for n in one.gm.graph.nodes if n.target is torch.ops.aten._to_copy.default
              and n.kwargs.get("device") == torch.device("meta")]
    assert len(staged) == sum(one.counts().values())  # every collective was staged
    order = {n: i for i, n in enumerate(merged.gm.graph.nodes)}
    (rs,) = sw_nodes(merged.gm, "reduce_scatter")
    readers = [u for n in merged.gm.graph.nodes if n.target is torch.ops.aten.view.default
               and n.args[0].target is operator.getitem and n.args[0].args[0].args[0] is next(iter(rs.users))
               for u in n.users]
    assert len(readers) == len(cap.grad_names) and all(order[u] > order[rs] for u in readers)
    assert copies_back
