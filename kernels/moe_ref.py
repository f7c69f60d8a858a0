"""Plain-torch Mixture-of-Experts reference: x [T, H] through each token's top-k experts, combined in order."""
import torch
import torch.nn.functional as F


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, *, deterministic=False):
    T, H = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros(T, k, H, dtype=x.dtype, device=x.device)
    I = w13.shape[1] // 2
    for e in topk_ids.unique().tolist():
        tok, j = torch.where(topk_ids == e)
        g, u = F.linear(x[tok], w13[e]).split(I, dim=-1)
        y = F.linear(F.silu(g) * u, w2[e])
        out = out.index_put((tok, j), y * topk_weights[tok, j, None].to(y.dtype))
    return out.sum(1)
