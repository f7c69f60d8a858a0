"""Online drafter training: distil the engine's drafter from its current target between RL steps.

    ids [B, L] (recent rollouts, or sequences the caller passes)
      target (no grad):  h [B, L, H] (+ aux layers), p = softmax(target logits) [B, L, V]
      step 0:   out_0[t] = drafter(emb(x_{t+1}), h_t)          loss: CE(p[t + 1], LM head(out_0[t]))
      step j:   out_j[t] = drafter(emb(x_{t+1}), out_{j-1}[t-1]) same loss, t >= j   (drafting ahead, as served)

The loss is the soft cross-entropy to the target's full next-token distribution (temperature 1), so the
drafter learns q close to p where acceptance min(1, p/q) is decided. The target is never updated; its
embedding and LM head are read, not trained. Runs between engine steps (the drafter is shared with the
serving path; no request state changes). Not here: choosing when to train, any trainer-side model.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn.functional as F

from runner.spec_decode.drafter import Drafter, rope_for


def drafter_loss(target, drafter: Drafter, ids: torch.Tensor, mask: torch.Tensor, num_unroll: int) -> torch.Tensor:
    """Mean soft cross-entropy over valid positions and unroll steps. ids, mask: [B, L] (mask bool, right-padded)."""
    B, L = ids.shape
    with torch.no_grad():
        if drafter.aux_layers:
            hidden, aux = target.forward_dense(ids, drafter.aux_layers)  # [B, L, H], [B, L, n*H]
        else:
            hidden, aux = target.forward_dense(ids), None
        p = torch.softmax(target.compute_logits(hidden).float(), dim=-1)  # [B, L, V]
    embed_w, head_w = target.model.embed_tokens.weight.detach(), target.lm_head_weight().detach()
    next_emb = F.embedding(ids[:, 1:], embed_w)  # [B, L-1, H] emb(x_{t+1}) at position t
    rope = rope_for(target, torch.arange(L - 1, device=ids.device), next_emb.dtype, dense=True)
    features = drafter.target_features(hidden, aux)[:, : L - 1].detach()  # [B, L-1, H]
    valid = mask[:, 2:]  # [B, L-2] x_{t+2} exists
    teacher = p[:, 1 : L - 1]  # [B, L-2] target distribution of x_{t+2}
    total, count = 0.0, 0
    for j in range(num_unroll):
        out = drafter(next_emb, features, rope, None)  # [B, L-1, H]
        logq = torch.log_softmax(F.linear(out[:, : L - 2], head_w).float(), dim=-1)
        keep = valid.clone()
        keep[:, :j] = False
        ce = -(teacher * logq).sum(-1)  # [B, L-2]
        total = total + (ce * keep).sum()
        count += int(keep.sum())
        features = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)  # own output of the previous position
    return total / max(count, 1)


def train_drafter(
    engine,
    sequences: Sequence[Sequence[int]] | None = None,
    *,
    num_steps: int = 100,
    batch_size: int = 16,
    max_len: int = 128,
    lr: float = 1e-3,
    num_unroll: int | None = None,
    time_budget_s: float | None = None,
    seed: int = 0,
) -> dict:
    """Train the engine's drafter in place on token sequences (default: `engine.recent_sequences`).

    num_unroll: drafting-ahead steps trained (default: min(k, 3)). Each step takes `batch_size` random
    windows of up to `max_len` tokens. Stops after num_steps or time_budget_s. Returns
    {"num_steps", "loss_first", "loss_last", "seconds"}. Raises ValueError without a drafter or data.
    """
    spec = engine.runner.spec
    if spec is None:
        raise ValueError("train_drafter needs an engine with EngineConfig.speculative set")
    seqs = [list(s) for s in (engine.recent_sequences if sequences is None else sequences) if len(s) >= 3]
    if not seqs:
        raise ValueError("train_drafter needs token sequences of at least 3 tokens (none given or recorded)")
    target, drafter = engine.runner.model, spec.drafter
    device = engine.runner.device
    num_unroll = num_unroll or min(spec.k, 3)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    start, losses = time.perf_counter(), []
    drafter.train()
    try:
        with torch.enable_grad():
            for _ in range(num_steps):
                ids, mask = _batch(seqs, batch_size, max_len, gen)
                loss = drafter_loss(target, drafter, ids.to(device), mask.to(device), num_unroll)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
                opt.step()
                losses.append(loss.item())
                if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
                    break
    finally:
        drafter.eval()
        drafter.zero_grad(set_to_none=True)
    return {"num_steps": len(losses), "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": time.perf_counter() - start}


def _batch(seqs: list[list[int]], batch_size: int, max_len: int, gen: torch.Generator):
    """Random windows, right-padded: ids int64 [B, L], mask bool [B, L]."""
    picks = torch.randint(len(seqs), (batch_size,), generator=gen).tolist()
    windows = []
    for i in picks:
        s = seqs[i]
        off = int(torch.randint(max(1, len(s) - max_len + 1), (1,), generator=gen))
        windows.append(s[off : off + max_len])
    L = max(len(w) for w in windows)
    ids = torch.zeros(batch_size, L, dtype=torch.int64)
    mask = torch.zeros(batch_size, L, dtype=torch.bool)
    for b, w in enumerate(windows):
        ids[b, : len(w)] = torch.tensor(w)
        mask[b, : len(w)] = True
    return ids, mask
