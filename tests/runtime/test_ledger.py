"""The tensor ledger that measures peak memory (piper_core.validate.instrument.TensorLedger): every
storage an operator creates counts from creation until freed, views and in-place results once."""

from __future__ import annotations

import torch

from piper_core.validate.instrument import tensor_ledger

T = 1000 * 1000 * 4  # bytes of a 1000 x 1000 fp32 tensor


def test_creation_free_views_and_the_peak():
    with tensor_ledger() as ledger:
        a = torch.ones(1000, 1000)
        b = a @ a
        assert (ledger.now, ledger.peak) == (2 * T, 2 * T)
        view = b[:10]  # a view: no new storage
        b.add_(1.0)  # in place: no new storage
        assert ledger.now == 2 * T
        del b
        assert ledger.now == 2 * T  # the view keeps the storage alive
        del view
        assert (ledger.now, ledger.peak) == (T, 2 * T)
        c = (a * 2).sum()  # the temporary a * 2 lives inside the expression only
        # peak: a, the temporary and the 4-byte sum, together for a moment
        assert ledger.now == T + c.untyped_storage().nbytes() and ledger.peak == 2 * T + 4
    del a
    assert ledger.now == c.untyped_storage().nbytes()  # freed after the mode still counts down


def test_autograd_saves_gradients_and_optimizer_state_are_counted():
    with tensor_ledger() as ledger:
        lin = torch.nn.Linear(1000, 1000, bias=False)  # one T of weight
        opt = torch.optim.Adam(lin.parameters())
        x = torch.ones(250, 1000)  # T / 4
        lin(x).relu().sum().backward()  # the gradient: one T; the saved activations freed by backward
        opt.step()  # exp_avg and exp_avg_sq: two T, and Adam's fp32 step counter (4 bytes)
        del x
        assert ledger.now == 4 * T + 4
        # Adam's step makes temporaries (e.g. the square root of exp_avg_sq): the peak sees them
        assert ledger.now < ledger.peak <= ledger.now + 3 * T
