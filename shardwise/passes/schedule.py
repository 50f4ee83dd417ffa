"""Latency hiding: issue collectives early, wait for them late, cap the bytes in flight.

A list scheduler over the program's node order, in the spirit of XLA's latency-hiding scheduler:

- all-gathers (with the cast/copy chain that feeds them from a shard placeholder) are *prefetched*:
  issued in their original order as early as the in-flight cap allows, across the forward/backward
  boundary too; the second gather of a two-axis one (ep's after zero3's dp gather) follows its first;
- reduce-scatters and all-reduces start where their input is produced (the strategy pass put them there);
- every wait moves down to just before the first reader of its result, unless the cap forces the
  oldest outstanding collective to be waited for earlier.

Deterministic in the input graph and the cap, so every rank issues the same collectives in the same
order (DESIGN.md invariant 2), pinned in the graph's node order, which the FX executor follows."""

from __future__ import annotations

from collections import deque

import torch.fx as fx

from ..runtime.ops import keep_alive
from ..sharding.collective import collective_of
from . import emit

WAIT = emit.WAIT


def payload(start: fx.Node) -> int:
    """Bytes a collective holds while in flight: its output buffer."""
    v = emit.val(start)
    return v.numel() * v.dtype.itemsize


def feed_chain(start: fx.Node, prefetched: set | frozenset = frozenset()) -> list[fx.Node] | None:
    """The nodes between a shard placeholder and an all-gather start, if it depends on nothing else;
    or on the wait of a gather in ``prefetched`` (the second of a two-axis gather: zero3's gather over
    dp, then ep's), the wait then a link of the chain."""
    chain, stack, shared, waited = [], [start.args[0]], False, False
    while stack:
        n = stack.pop()
        if n.op == "placeholder" or n in chain:
            continue
        if n.op != "call_function" or n.target in emit.COLLECTIVE_TARGETS:
            return None
        shared |= len(n.users) != 1  # a bucket's gathered buffer, which several parameters' views read
        chain.append(n)
        if n.target is WAIT:
            if n.args[0] not in prefetched:
                return None
            waited = True
            continue
        stack.extend(n.all_input_nodes)
    return list(reversed(chain)) if waited or not shared else None


def schedule(gm: fx.GraphModule, max_in_flight: int, max_ops: int | None = None) -> dict:
    """Reorder ``gm`` in place; returns a summary (how far each all-gather moved, the caps).

    ``max_in_flight`` caps the bytes of collectives started and not yet waited for, ``max_ops``
    their number (None: no cap on the number)."""
    g = gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.op == "call_function" and n.target in emit.COLLECTIVE_TARGETS]
    wait_of = {s: next(iter(s.users)) for s in starts}
    start_of = {w: s for s, w in wait_of.items()}
    prefetch: list[tuple[list[fx.Node], fx.Node]] = []
    movable: set[fx.Node] = set()
    for s in starts:
        if collective_of(s).kind != "all_gather":
            continue
        chain = feed_chain(s, {p for _, p in prefetch})
        if chain is None:
            continue
        chain.sort(key=pos.__getitem__)  # in graph order: a topological one, where chains branch
        prefetch.append((chain, s))
        movable.update((*chain, s))
    pending, out = deque(prefetch), g.find_nodes(op="output")[0]

    order: list[fx.Node] = []
    placed: set[fx.Node] = set()
    in_flight: deque[fx.Node] = deque()  # started, not yet waited for, oldest first
    flight = 0
    fresh: set[fx.Node] = set()  # gathers started since the last node of compute was placed

    def full(nbytes: int) -> bool:
        """No room to start a collective of ``nbytes`` now."""
        return flight + nbytes > max_in_flight or (max_ops is not None and len(in_flight) >= max_ops)

    def place(n: fx.Node) -> None:
        order.append(n)
        placed.add(n)

    def wait_for(s: fx.Node) -> None:
        nonlocal flight
        while True:  # waits retire in issue order, so the oldest goes first
            old = in_flight.popleft()
            flight -= payload(old)
            place(wait_of[old])
            # The executor frees a value after its last reader, which would be the start: a gloo
            # worker thread could then still read a freed input (seen as SIGSEGV with waits far
            # from their starts). Reading the input again after the wait keeps it alive until then.
            with g.inserting_before(out):
                ka = g.call_function(keep_alive, (wait_of[old], old.args[0]))
            place(ka)
            if old is s:
                return

    def start(s: fx.Node, chain: list[fx.Node]) -> None:
        nonlocal flight
        while in_flight and full(payload(s)):
            wait_for(in_flight[0])
        for c in chain:
            if c in placed:  # shared with a chain started before
                continue
            if c.target is not WAIT:
                place(c)
            else:  # the first gather of a two-axis one
                wait_for(start_of[c])
        place(s)
        fresh.add(s)
        in_flight.append(s)
        flight += payload(s)

    def issue_prefetch(until: fx.Node | None = None) -> None:
        """Start pending all-gathers in order: all up to ``until``, then while the cap has room."""
        while pending:
            chain, s = pending[0]
            must = until is not None and pos[s] <= pos[until]
            first = [start_of[c] for c in chain if c.target is WAIT and c not in placed]
            if not must and any(f in fresh for f in first):
                return  # its first gather only just started: let it run under some compute
            if not must and first and in_flight and in_flight[0] is first[0] and full(payload(s)):
                wait_for(first[0])  # the slot its own first gather holds, long enough in flight
            if not must and full(payload(s)):
                return
            pending.popleft()
            start(s, chain)
            if until is s:
                until = None

    def ensure(a: fx.Node) -> None:
        """A chain's node that another reader needs first (a bucket's buffer, which a parameter whose
        gather is not in the chains also reads): placed now, with what it needs."""
        if a in placed:
            return
        if a.target is WAIT:
            if start_of[a] not in placed:
                issue_prefetch(until=start_of[a])
            if a not in placed:
                wait_for(start_of[a])
            return
        for b in a.all_input_nodes:
            ensure(b)
        place(a)

    for n in nodes:
        if n in movable or n.op == "output":
            continue
        if n.op == "call_function" and n.target is WAIT:
            continue  # placed on demand, below
        for a in n.all_input_nodes:
            if a in movable and a.target not in emit.COLLECTIVE_TARGETS:  # a chain's node, not its start
                ensure(a)
        for a in n.all_input_nodes:
            if a in start_of and a not in placed:
                s = start_of[a]
                if s not in placed:
                    issue_prefetch(until=s)
                wait_for(s)
        if n.op == "call_function" and n.target in emit.COLLECTIVE_TARGETS:
            start(n, [])  # not prefetched: started where its pass put it
        else:
            place(n)
            fresh.clear()
        if n.op != "placeholder":
            issue_prefetch()
    issue_prefetch(until=prefetch[-1][1] if prefetch else None)
    while in_flight:
        wait_for(in_flight[0])
    assert len(order) + 1 == len(nodes) + len(starts), "schedule lost or duplicated nodes"
    # pin the order in the graph: move every node, in order, to just before the output
    for n in order:
        out.prepend(n)
    g.lint()
    gm.recompile()
    new = {n: i for i, n in enumerate(g.nodes)}
    def label(s):
        c = collective_of(s)
        return f"{c.phase}:{c.label or s.name}"

    moved = {label(s): pos[s] - new[s] for _, s in prefetch}
    return {"max_in_flight": max_in_flight, "max_ops": max_ops, "prefetched": moved}
