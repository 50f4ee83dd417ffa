"""Sharding propagation over the joint graph (issue 22's engine): placements per op family and the
collectives the tensor-parallel plan needs, read off the captured single-device step."""

import fnmatch

import pytest
import torch

from test_graph import captured
from shardwise.capture import forward_nodes
from shardwise.sharding import Partial, Replicate, Shard
from shardwise.sharding.propagate import ShardingError, propagate
from shardwise.sharding.rules.views import reshape_map

aten = torch.ops.aten
MEGATRON_LLAMA = {"*.wq.weight": Shard(0), "*.wk.weight": Shard(0), "*.wv.weight": Shard(0),
                  "*.w1.weight": Shard(0), "*.w3.weight": Shard(0), "*.wo.weight": Shard(1), "*.w2.weight": Shard(1)}


def seeded(cap, plan: dict):
    phs = cap.gm.graph.find_nodes(op="placeholder")[: cap.n_params]
    seeds = {ph: next((p for g, p in plan.items() if fnmatch.fnmatch(n, g)), Replicate())
             for ph, n in zip(phs, cap.param_names)}
    outputs = [Replicate()] + [seeds[ph] for ph, t in zip(phs, cap.trainable) if t]
    return seeds, outputs


def test_megatron_plan_needs_two_all_reduces_per_layer_each_way():
    # column-parallel q, k, v, w1, w3 (output dim), row-parallel wo, w2 (input dim): per layer one
    # all-reduce after each row-parallel product in the forward, one of each sub-block's input
    # gradient in the backward, and nothing else (Megatron's count)
    m, cap = captured("llama")
    seeds, outputs = seeded(cap, MEGATRON_LLAMA)
    plan = propagate(cap.gm, seeds, 2, outputs=outputs)
    colls = plan.collectives()
    assert {c.kind for c in colls} == {"all_reduce"}
    fwd = forward_nodes(cap.gm)
    layers = m.cfg.n_layer
    assert sum(c.node in fwd for c in colls) == 2 * layers and sum(c.node not in fwd for c in colls) == 2 * layers
    # heads split: the attention runs on the ranks' heads; the gradients leave as the weights' shards
    sdpa = [n for n in cap.gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa and all(plan.placements[n][0] == Shard(1) for n in sdpa)
    out = cap.gm.graph.find_nodes(op="output")[0]
    for g, want in zip(out.args[0], outputs):
        assert plan.placements[g] == want or any(c.arg is g for c in colls)


def test_a_replicated_plan_needs_no_collective():
    _, cap = captured("llama")
    seeds, outputs = seeded(cap, {})
    plan = propagate(cap.gm, seeds, 2, outputs=outputs)
    assert plan.collectives() == [] and set(plan.placements.values()) >= {Replicate()}


@pytest.mark.parametrize("src,dst,p,want", [
    ((4, 6), (2, 2, 6), Shard(0), Shard(0)), ((6, 8), (6, 2, 4), Shard(1), Shard(1)),
    ((2, 4, 8), (8, 8), Shard(0), Shard(0)), ((2, 1, 16), (2, 16), Shard(2), Shard(1)),
    ((32, 32), (2, 16, 4, 8), Shard(1), Shard(2)),
    # an inner factor's shard is a cut of the merged dim in blocks: sequences flattened into rows ...
    ((2, 4, 8), (8, 8), Shard(1), Shard(0, groups=2)), ((8, 8), (2, 4, 8), Shard(0, groups=2), Shard(1)),
    # ... or a fused q|k|v output viewed by head: the heads' shard
    ((4, 24), (4, 3, 2, 4), Shard(1, groups=3), Shard(2)),
    ((2, 4, 8), (8, 8), Shard(2), Shard(1)), ((4, 6), (24,), Shard(1), Shard(0, groups=4)),
    ((6, 4), (3, 8), Shard(0), None),  # rank 0's 12 entries are 1.5 rows of 8
])
def test_a_view_moves_a_shard_to_where_its_blocks_fall_whole(src, dst, p, want):
    assert reshape_map(src, dst, p, 2) == want


def _mm(pa, pb, shape_a=(4, 8), shape_b=(8, 6)):
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["val"], b.meta["val"] = torch.empty(shape_a), torch.empty(shape_b)
    y = g.call_function(aten.mm.default, (a, b))
    y.meta["val"] = torch.empty(shape_a[0], shape_b[1])
    g.output([y])
    plan = propagate(torch.fx.GraphModule(torch.nn.Module(), g), {a: pa, b: pb}, 2)
    return plan.placements[y], [(r.arg.name, r.kind) for r in plan.reshards]


def test_products_follow_their_einsum():
    assert _mm(Replicate(), Shard(1)) == (Shard(1), [])  # column-parallel
    assert _mm(Shard(1), Shard(0)) == (Partial(), [])  # row-parallel: partial sums
    assert _mm(Shard(0), Replicate()) == (Shard(0), [])  # the rows' shard
    assert _mm(Shard(1), Replicate()) == (Partial(), [("b", "slice")])  # the replicated operand's slice
    # two shards on different letters: the activation (left) is gathered, the weight keeps its shard
    # (sequence parallelism's gather before a column-parallel product) ...
    assert _mm(Shard(0), Shard(1)) == (Shard(1), [("a", "all_gather")])
    # ... unless that leaves partial sums: a weight gradient x^T @ dy of token shards x and
    # column shards dy gathers dy and comes out in the weight's shard
    assert _mm(Shard(0), Shard(0)) == (Shard(0), [("b", "all_gather")])


def _op(target, shapes, placements, extra=(), out_shape=None):
    """One ``target`` call on placeholders of ``shapes`` (int64 where the name says idx) placed so:
    (its output's placement, the reshards it needs as (input, kind))."""
    g = torch.fx.Graph()
    phs = []
    for i, (shape, p) in enumerate(zip(shapes, placements)):
        ph = g.placeholder(f"in{i}")
        ph.meta["val"] = torch.empty(shape) if not isinstance(shape, tuple) or shape and shape[-1] != "idx" \
            else torch.empty(shape[:-1], dtype=torch.long)
        phs.append(ph)
    args = [phs[0], *extra[:1], *phs[1:], *extra[1:]] if extra else phs
    y = g.call_function(target, tuple(args))
    y.meta["val"] = torch.empty(out_shape or shapes[0])
    g.output([y])
    plan = propagate(torch.fx.GraphModule(torch.nn.Module(), g), dict(zip(phs, placements)), 2)
    return plan.placements[y], [(r.arg.name, r.kind) for r in plan.reshards]


def test_a_capacity_dispatchs_ops_follow_their_rules():
    """The ops of an MoE capacity dispatch on token shards (sequence parallelism): a running sum over
    the sharded tokens gathers them; a row pick by sharded indices is that shard of the rows; its
    gradient gathers its sharded rows; a buffer write takes the buffer's placement."""
    cumsum = aten.cumsum.default
    assert _op(cumsum, [(8, 4)], [Shard(0)], extra=(0,)) == (Replicate(), [("in0", "all_gather")])
    assert _op(cumsum, [(8, 4)], [Shard(1)], extra=(0,)) == (Shard(1), [])
    assert _op(cumsum, [(8, 4)], [Partial()], extra=(0,)) == (Partial(), [])
    pick = aten.index_select.default
    assert _op(pick, [(10, 4), (6, "idx")], [Replicate(), Shard(0)], extra=(0,), out_shape=(6, 4)) == (Shard(0), [])
    assert _op(pick, [(10, 4), (6, "idx")], [Shard(0), Replicate()], extra=(0,), out_shape=(6, 4)) == \
        (Replicate(), [("in0", "all_gather")])
    assert _op(pick, [(10, 4), (6, "idx")], [Shard(1), Shard(0)], extra=(0,), out_shape=(6, 4)) == \
        (Shard(1), [("in1", "all_gather")])
    add = aten.index_add.default
    assert _op(add, [(10, 4), (6, "idx"), (6, 4)], [Replicate(), Shard(0), Shard(0)], extra=(0,)) == \
        (Replicate(), [("in1", "all_gather"), ("in2", "all_gather")])
    assert _op(add, [(10, 4), (6, "idx"), (6, 4)], [Replicate(), Replicate(), Partial()], extra=(0,)) == \
        (Partial(), [("in0", "one_rank")])
    assert _op(aten.copy_.default, [(), ()], [Replicate(), Partial()]) == (Replicate(), [("in1", "all_reduce")])


def test_hugging_face_experts_ops_follow_their_rules():
    """The ops around Hugging Face's experts cut over tp: torch's grouped product as its einsum (``mk,gkn->mn``
    forward, ``km,mn->gkn`` for the weights' gradient), its rows never cut (the offsets name them); ``x[idx]`` and
    ``x[idx] = v`` of dim 0 pass a shard of another dim, or a partial, with whole indices."""
    R, P = Replicate(), Partial()
    if hasattr(aten, "_grouped_mm"):
        gmm = aten._grouped_mm.default
        fwd, grad = [(8, 6), (3, 6, 4), (3, "idx")], [(6, 8), (8, 4), (3, "idx")]
        assert _op(gmm, fwd, [R, Shard(2), R], out_shape=(8, 4)) == (Shard(1), [])  # column-parallel
        assert _op(gmm, fwd, [Shard(1), Shard(1), R], out_shape=(8, 4)) == (P, [])  # row-parallel
        assert _op(gmm, fwd, [Shard(0), Shard(2), R], out_shape=(8, 4)) == (R, [("in0", "all_gather"),
                                                                                 ("in1", "all_gather")])
        assert _op(gmm, grad, [R, Shard(1), R], out_shape=(3, 6, 4)) == (Shard(2), [])  # the weight's gradient
    g = torch.fx.Graph()
    x, idx, v = (g.placeholder(n) for n in ("x", "idx", "v"))
    x.meta["val"], v.meta["val"], idx.meta["val"] = torch.empty(10, 4), torch.empty(6, 4), torch.empty(6).long()
    pick, put = g.call_function(aten.index.Tensor, (x, [idx])), g.call_function(aten.index_put.default, (x, [idx], v))
    pick.meta["val"], put.meta["val"] = torch.empty(6, 4), torch.empty(10, 4)
    g.output([pick, put])

    def placed(px, pv):
        plan = propagate(torch.fx.GraphModule(torch.nn.Module(), g), {x: px, idx: R, v: pv}, 2)
        return plan.placements[pick], plan.placements[put]

    assert placed(Shard(1), Shard(1)) == (Shard(1), Shard(1))
    assert placed(P, P) == (P, P)
    assert placed(Shard(0), R) == (R, R)  # a cut of the indexed dim: whole


def test_a_partial_passes_a_product_whose_one_reader_is_a_sum():
    """Each expert's input gradient arrives partial (its rows of a cut weight), is masked to the expert's rows (a
    product with a whole column) and added over the experts: the partial passes each masking product into the sum, so
    the sum takes one reduction for all the experts instead of one each. A product read by anything but one sum (a
    norm's backward) still takes the sum first, as before."""
    R, P = Replicate(), Partial()
    g = torch.fx.Graph()
    ga, gb, ma, mb = (g.placeholder(n) for n in ("ga", "gb", "ma", "mb"))
    for n, shape in ((ga, (6, 4)), (gb, (6, 4)), (ma, (6, 1)), (mb, (6, 1))):
        n.meta["val"] = torch.empty(shape)
    a, b = g.call_function(aten.mul.Tensor, (ga, ma)), g.call_function(aten.mul.Tensor, (gb, mb))
    total = g.call_function(aten.add.Tensor, (a, b))
    scaled = g.call_function(aten.mul.Tensor, (total, ma))  # read by the output and by the next product: not one sum
    twice = g.call_function(aten.mul.Tensor, (scaled, ma))
    for n in (a, b, total, scaled, twice):
        n.meta["val"] = torch.empty(6, 4)
    g.output([scaled, twice])
    plan = propagate(torch.fx.GraphModule(torch.nn.Module(), g), {ga: P, gb: P, ma: R, mb: R}, 2)
    assert [plan.placements[n] for n in (a, b, total, scaled)] == [P, P, P, R]
    assert [(c.kind, c.arg) for c in plan.collectives()] == [("all_reduce", total)]


def test_an_op_without_a_rule_is_an_error_naming_it():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    y = g.call_function(aten.cumprod.default, (x, 1))
    y.meta["val"] = torch.empty(4, 8)
    g.output([y])
    with pytest.raises(ShardingError, match=r"no sharding rule for aten\.cumprod\.default \(node cumprod_default, inputs placed "
                                            r"\{'x': 'S\(1\)'\}\)"):
        propagate(torch.fx.GraphModule(torch.nn.Module(), g), {x: Shard(1)}, 2)


def test_a_shard_the_ranks_do_not_divide_is_an_error_naming_the_sizes():
    _, cap = captured("llama")
    seeds, outputs = seeded(cap, MEGATRON_LLAMA)
    names = dict(zip(cap.gm.graph.find_nodes(op="placeholder"), cap.param_names))
    with pytest.raises(ShardingError, match=r"blocks\.0\.attn\.wq\.weight .* of shape \(32, 32\) would be sharded on "
                                            r"dim 0 over 3 ranks, which do not divide its 32"):
        propagate(cap.gm, seeds, 3, outputs=outputs, names=names)


def test_megatron_pairs_are_found_from_the_graph():
    # from the graph alone: q, k, v and w1, w3 column-parallel; wo and w2 row-parallel; the LM head
    # vocab-parallel (its product feeds the log-softmax; its weight is not the embedding's); the
    # embedding whole
    from shardwise.passes.tp import megatron_plan

    _, cap = captured("llama")
    plan = megatron_plan(cap)
    want = {n: p for n in cap.param_names for g, p in MEGATRON_LLAMA.items() if fnmatch.fnmatch(n, g)}
    assert plan == {**want, "head.weight": Shard(0)}
    # GPT-2's fused QKV is split into q, k and v along the product's output: its weight and bias are
    # cut in 3 blocks, so each rank holds its heads of each; the MLP's pair is split with its bias
    _, cap = captured("gpt")
    plan = megatron_plan(cap)
    assert plan["blocks.0.fc.weight"] == Shard(0) and plan["blocks.0.fc.bias"] == Shard(0)
    assert plan["blocks.0.out.weight"] == Shard(1) and plan["blocks.0.attn.proj.weight"] == Shard(1)
    assert plan["blocks.0.attn.qkv.weight"] == plan["blocks.0.attn.qkv.bias"] == Shard(0, groups=3)


def test_the_partitioned_llama_step_runs_on_local_shards():
    # the tp-local step: shards of the split weights as inputs and gradients, the heads halved, the
    # all-reduces of the plan on the tp group and nothing else
    from shardwise.passes.tp import partition
    from shardwise.sharding.collective import collective_of

    _, cap = captured("llama")
    local, prop = partition(cap, MEGATRON_LLAMA, 2, "tp-group")
    shapes = dict(zip(cap.param_names, local.param_shapes))
    assert shapes["blocks.0.attn.wq.weight"] == (16, 32) and shapes["blocks.0.attn.wo.weight"] == (32, 16)
    assert shapes["blocks.0.ffn.w2.weight"] == (32, 24) and shapes["tok.weight"] == (64, 32)
    colls = [collective_of(n) for n in local.gm.graph.nodes if collective_of(n)]
    assert len(colls) == 8 and {(c.kind, c.axis, c.ranks) for c in colls} == {("all_reduce", "tp", 2)}
    out = local.gm.graph.find_nodes(op="output")[0].args[0]
    grads = dict(zip([n for n, t in zip(cap.param_names, cap.trainable) if t], out[1:]))
    assert tuple(grads["blocks.0.attn.wq.weight"].meta["val"].shape) == (16, 32)
    sdpa = next(n for n in local.gm.graph.nodes if "scaled_dot_product" in str(n.target))
    assert tuple(sdpa.meta["val"][0].shape) == (2, 2, 16, 8)  # 4 heads, 2 on this rank
