"""split_backward: the input pass and the deferred weight pass give exactly the gradients of one
``torch.autograd.grad`` over both, run each GEMM once between them, and refuse what cannot be split."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from piper_core.errors import SpecError
from piper_core.runtime.wgrad import split_backward

H = 16


class _CountGemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.__name__.split(".")[0] in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


def _expert():
    """An expert MLP as DeepSpeed users write it (nn.Linear, gelu, nn.Linear) scaled by its prob,
    plus a parameter the call does not use."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(H, 4 * H), torch.nn.GELU(), torch.nn.Linear(4 * H, H))
    unused = torch.nn.Parameter(torch.randn(3))
    x, p = torch.randn(40, H, requires_grad=True), torch.rand(40, requires_grad=True)
    return (lambda: mlp(x) * p.unsqueeze(-1)), [x, p], [*mlp.parameters(), unused]


def test_split_gradients_equal_one_backward_and_each_gemm_runs_once() -> None:
    fn, inputs, weights = _expert()
    grad, out = torch.randn(40, H), fn()
    with _CountGemms() as whole:
        want = torch.autograd.grad(out, [*inputs, *weights], grad, allow_unused=True)
    out = fn()
    with _CountGemms() as first:
        got, weight_pass = split_backward(out, grad, inputs, weights)
    with _CountGemms() as second:
        got += weight_pass()
    assert got[-1] is None and want[-1] is None  # the unused parameter
    assert all(torch.equal(a, b) for a, b in zip(want[:-1], got[:-1], strict=True))
    # 2 linears: the unsplit backward runs 4 GEMMs (2 dgrad, 2 wgrad); the input pass only the dgrads
    assert (whole.n, first.n, second.n) == (4, 2, 2)
    with pytest.raises(RuntimeError, match="weight pass ran twice"):
        weight_pass()


def test_a_weight_that_joins_after_the_inputs_still_gets_its_gradient() -> None:
    x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    out = (x * 0).sum().expand(3) + w.sum()
    _, weight_pass = split_backward(out, torch.ones(3), [x], [w])
    assert torch.equal(weight_pass()[0], torch.full((5,), 3.0))


def test_a_custom_function_computing_both_gradients_is_refused_by_name() -> None:
    class FusedLinear(torch.autograd.Function):  # the shape of Megatron-Core's linear Functions
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    x, w = torch.randn(4, H, requires_grad=True), torch.randn(H, H, requires_grad=True)
    out = FusedLinear.apply(x, w)
    with pytest.raises(SpecError, match=r"defer_wgrad=True: .*custom autograd Function \(FusedLinearBackward\).*twice; "
                                        r"build the experts from torch ops"):
        split_backward(out, torch.ones_like(out), [x], [w])
