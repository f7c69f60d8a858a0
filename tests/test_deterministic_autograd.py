"""kernel_forward: the forward value comes from the kernel, the gradient from the reference."""

from __future__ import annotations

import torch

from runner.deterministic import kernel_forward


def test_forward_from_kernel_backward_from_reference():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    marker = torch.full((4, 5), 7.0)

    def kernel(a, b):  # a stand-in "kernel" whose value differs from the reference's
        return marker.clone()

    def reference(a, b):
        return a @ b.T

    out = kernel_forward(kernel, reference, x, w)
    assert torch.equal(out, marker)
    out.sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (x2 @ w2.T).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_tuple_outputs_and_inputs_without_grad():
    x = torch.randn(3, 4, requires_grad=True)
    r = torch.randn(3, 4)  # no grad wanted

    def kernel(a, b):
        return a * 0 + 1.0, a + b

    def reference(a, b):
        return a * 2.0, a + b

    first, second = kernel_forward(kernel, reference, x, r)
    (first.sum() + second.sum()).backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))  # d(2a)/da + d(a+b)/da
    assert r.grad is None


def test_no_autograd_means_plain_kernel_call():
    with torch.no_grad():
        out = kernel_forward(lambda a: a + 1, lambda a: a + 2, torch.zeros(2, requires_grad=True))
    assert torch.equal(out, torch.ones(2)) and not out.requires_grad
