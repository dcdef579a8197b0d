"""Single-process checks of the deferral bookkeeping."""

from __future__ import annotations

import torch

from eagertp.deferred import PendingMatmul, PendingSum, orphaned_storages, storage_key

aten = torch.ops.aten


def _pending(out: torch.Tensor) -> PendingMatmul:
    return PendingMatmul(aten.mm.default, torch.ones(2, 2), torch.ones(2, 2), out, tid=0)


def test_product_held_only_by_its_item_is_unobserved():
    item = _pending(torch.empty(2, 2))  # NB: not inside the assert, which pytest rewrites to hold temporaries
    assert item.unobserved()


def test_product_reachable_from_python_is_observed():
    out = torch.empty(2, 2)
    item = _pending(out)
    assert not item.unobserved()
    del out
    assert item.unobserved()


def test_product_reachable_through_a_view_is_observed():
    item = _pending(torch.empty(2, 2))
    view = item.out.view(4)
    assert not item.unobserved()
    del view
    assert item.unobserved()


def test_product_saved_by_autograd_is_observed():
    item = _pending(torch.empty(2, 2))
    w = torch.ones(2, 2, requires_grad=True)
    y = item.out * w  # saves item.out for the gradient of w
    assert not item.unobserved()
    del y
    assert item.unobserved()


def test_sum_terms_and_total():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    c, d = torch.randn(3, 6), torch.randn(6, 5)
    t1 = PendingMatmul(aten.mm.default, a, b, torch.empty(3, 5), tid=0)
    t2 = PendingMatmul(aten.mm.default, c, d, torch.empty(3, 5), tid=1)
    total = PendingSum([t1, t2], torch.empty(3, 5), tid=2)
    total.issue_standalone()
    torch.testing.assert_close(total.out, a @ b + c @ d, rtol=0, atol=0)
    rows = torch.empty(1, 5)
    total.compute_rows(lambda t: t[1:2], rows)
    torch.testing.assert_close(rows, (a @ b + c @ d)[1:2])
    assert total.render() == "$2: f32[3, 5] = $0 + $1"


def _weight_gradient(g: torch.Tensor, x: torch.Tensor) -> PendingMatmul:
    """``g.t() @ x`` pending, as autograd issues a linear's weight gradient."""
    return PendingMatmul(aten.mm.default, g.t(), x, torch.empty(2, 2), tid=0)


def test_weight_gradient_inputs_only_it_holds_are_orphaned():
    """Note [Products past their collective]: ``g`` reached only through the
    transposed view the item holds (its base's Python object then carries a
    reference from its TensorImpl, which the count expects), ``x`` only by the
    item; either one held from Python is not orphaned."""
    item = _weight_gradient(torch.ones(3, 2), torch.ones(3, 2))
    g_key, x_key = storage_key(item.a), storage_key(item.b)
    assert orphaned_storages([item], {g_key, x_key}) == {g_key, x_key}
    g = item.a._base
    assert orphaned_storages([item], {g_key, x_key}) == {x_key}
    del g
    x = item.b
    assert orphaned_storages([item], {g_key, x_key}) == {g_key}
    del x
    assert orphaned_storages([item], {g_key, x_key}) == {g_key, x_key}
