"""One expert backward in two passes: input gradients now, weight gradients later.

In a MoE layer's backward the gradient of the dispatch can leave as soon as the experts' *input*
gradients exist; the *weight* gradients are needed only by the optimizer. :func:`split_backward`
runs the input-gradient pass first (autograd computes only what reaches the inputs: for ``mm`` /
``addmm`` nodes that skips the weight GEMM) and keeps, at each node where a weight's branch leaves
the input path, the gradient flowing into it; the returned callable later runs autograd from those
nodes to the weights only, so no input-gradient GEMM runs twice. The idea is the split behind
zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; PyTorch's
``torch.distributed.pipelining`` splits stage backward the same way); written here for one
expert call, with gradients returned rather than accumulated into ``.grad``.

Both passes run the very nodes one ``torch.autograd.grad`` over inputs and weights would run, on
the same tensors, so every gradient is bit-identical to the unsplit backward.

A node that computes both gradients at once cannot be split: a custom ``autograd.Function`` (e.g.
Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication``) computes its weight gradient in
the input pass whatever autograd asks for, and again in the weight pass. :func:`split_backward`
refuses such experts with an error naming the node rather than doing the weight GEMMs twice.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from piper_core.errors import SpecError

WeightPass = Callable[[], list[torch.Tensor | None]]


def _node(t: torch.Tensor) -> Node:
    """The autograd node gradients of ``t`` flow into (a leaf's accumulator, made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():  # inside a backward grad mode is off, and the view would have no node
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _parents(root: Node) -> dict[Node, list[Node]]:
    """For every node below ``root``: the nodes whose backward feeds it (the graph, reversed)."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, todo = {root}, deque([root])
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return parents


def _upward(starts: list[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` towards the root, not passing ``stop``; and the ``stop`` nodes met."""
    reached, met, todo = set(starts), set(), deque(starts)
    while todo:
        for parent in parents.get(todo.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                todo.append(parent)
    return reached, met


def _groups(root: Node, inputs: list[Node], weights: list[Node],
            parents: dict[Node, list[Node]]) -> list[tuple[list[Node], list[int]]]:
    """(branch nodes on the input path, weight indices) per group of weights sharing a branch node.
    The root counts as on the input path (a weight may join the output after the last input does)."""
    on_input_path = _upward(inputs, parents, set())[0] | {root}
    groups: list[tuple[set[Node], set[int]]] = []
    for i, w in enumerate(weights):
        _, branch = _upward([w], parents, on_input_path)
        merged = (set(branch), {i})
        for g in [g for g in groups if g[0] & merged[0]]:
            groups.remove(g)
            merged = (merged[0] | g[0], merged[1] | g[1])
        groups.append(merged)
    return [(list(nodes), sorted(idx)) for nodes, idx in groups if nodes]


def split_backward(out: torch.Tensor, grad_out: torch.Tensor, inputs: Sequence[torch.Tensor],
                   weights: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightPass]:
    """Gradients of ``out`` (seeded with ``grad_out``) for ``inputs`` now, and a callable that
    returns those for ``weights`` (``None`` where a weight is unused). Call it exactly once."""
    root, weight_nodes = out.grad_fn, [_node(w) for w in weights]
    parents = _parents(root)
    groups = _groups(root, [_node(t) for t in inputs], weight_nodes, parents)
    for nodes, _ in groups:
        fused = [n for n in nodes if isinstance(n, BackwardCFunction)]
        if fused:
            raise SpecError("defer_wgrad", True, f"the experts' weights get their gradient from a custom autograd "
                            f"Function ({fused[0].name()}), which computes it together with the input gradient: "
                            "deferring it would run those weight GEMMs twice",
                            "build the experts from torch ops (nn.Linear, torch.mm), or set defer_wgrad=false")
    seeds: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [n.register_prehook(lambda g, n=n: seeds.__setitem__(n, tuple(g)))
               for nodes, _ in groups for n in nodes]
    try:
        got = torch.autograd.grad(out, list(inputs), grad_out, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if root not in seeds:  # no input reached through the root: the input pass did not run it
        seeds[root] = (None,) * out.output_nr + (grad_out,)
    done = False

    def weight_pass() -> list[torch.Tensor | None]:
        nonlocal done
        if done:
            raise RuntimeError("split_backward: the weight pass ran twice (the graph is freed after the first)")
        done = True
        grads: list[torch.Tensor | None] = [None] * len(weights)
        for g, (nodes, idx) in enumerate(groups):
            edges, seeded = [], []
            for n in nodes:
                for slot, s in enumerate(seeds.get(n, ())):
                    if s is not None:
                        edges.append(GradientEdge(n, slot))
                        seeded.append(s)
            if not edges:
                continue
            # a branch node below another one of the group would get its seed twice: pin it to the seed
            pins = [n.register_prehook(lambda _, s=seeds[n]: s) for n in nodes
                    if n in seeds and n is not root] if len(nodes) > 1 else []
            try:
                dw = torch.autograd.grad(edges, [GradientEdge(weight_nodes[i], 0) for i in idx], seeded,
                                         retain_graph=g + 1 < len(groups), allow_unused=True)
            finally:
                for h in pins:
                    h.remove()
            for i, d in zip(idx, dw):
                grads[i] = d
        seeds.clear()
        return grads

    return list(got), weight_pass
