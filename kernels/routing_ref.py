"""Mixture-of-Experts routing in plain torch (the CPU path, and the autograd path of `kernels/routing.py`).

A router's logits [N, E] -> each token's top-k experts and their weights: softmax over all E experts in
float32, the k most probable (torch.topk order: descending probability) or the given experts (routing
replay), their probabilities, renormalised to sum to 1 when asked. Differentiable in the logits (the
weights; the choice of experts is not). Not here: the router's linear layer, the experts themselves.
"""

from __future__ import annotations

import torch


def topk_ids_ref(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """logits [N, E] -> the top_k most probable experts [N, k] int64, descending probability (ranked by the
    float32 softmax, as transformers ranks them: probabilities that round equal tie there too)."""
    return torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices


def routing_weights_ref(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """logits [N, E] (any float dtype), ids [N, k] -> weights [N, k] float32: softmax(logits)[ids],
    divided by their sum when `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, ids.long())
    return weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights
