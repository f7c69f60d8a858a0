"""Prompt scoring: the logprob of each token of a sequence given the tokens before it (what vLLM returns as
`prompt_logprobs`, and OpenAI's `echo` with `logprobs`), on a runner that may be serving requests.

`prompt_logprobs(runner, ...)` is called between engine steps through `Engine.collective_rpc`
("runner.scoring:prompt_logprobs"), so under tensor parallelism every rank runs it. It prefills the sequence in
chunks of at most `max_num_batched_tokens` tokens (the activation size the KV-cache sizing reserved) into KV
blocks the caller took from the engine's block pool for it, so the blocks of running requests are never
touched, and computes logits for at most `max_num_seqs` positions at a time (the sampler's size). The caller
returns the blocks afterwards; they are never registered in the prefix cache.

Not here: which blocks are free (rollout/kv_cache_manager.py), the HTTP format (rollout/server.py).
"""

from __future__ import annotations

import torch

from runner.attention import AttentionMetadata


def prompt_logprobs(runner, token_ids: list[int], block_ids: list[int], num_top: int,
                    lora_slot: int = -1) -> dict | None:
    """For each position i in 1..n-1: the logprob of token_ids[i] after token_ids[:i] under the model's own
    distribution (log-softmax of the raw logits: no temperature, no truncation), with the LoRA adapter in
    `lora_slot` (-1: the base model), its rank (1 = the most likely token) and the `num_top` most likely tokens.
    `block_ids` (enough for n tokens) are overwritten.

    Returns on rank 0 {"logprobs": [n-1] floats, "ranks": [n-1] ints, "top_ids": [n-1][num_top] ints,
    "top_logprobs": [n-1][num_top] floats}; None on the other ranks."""
    n, bs, dev = len(token_ids), runner.block_size, runner.device
    assert n >= 2 and len(block_ids) * bs >= n, (n, len(block_ids), bs)
    token_chunk = max(1, runner.config.max_num_batched_tokens)
    logit_chunk = max(1, runner.config.max_num_seqs)
    table = torch.tensor(block_ids, dtype=torch.int32, device=dev)[None, :]  # [1, num_blocks]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)  # [n]
    pos = torch.arange(n, dtype=torch.int64, device=dev)  # [n]
    slots = table[0, pos // bs].to(torch.int64) * bs + pos % bs  # [n] cache slot of each token
    out = {"logprobs": [], "ranks": [], "top_ids": [], "top_logprobs": []}
    with torch.inference_mode():
        # positions 0..n-2 predict tokens 1..n-1; the last token's KV is never needed
        for start in range(0, n - 1, token_chunk):
            end = min(start + token_chunk, n - 1)
            q = end - start
            meta = AttentionMetadata.one_sequence(q, end, table, slots[start:end], runner.config.deterministic)
            with runner.lora_tokens(q, lora_slot):
                hidden = runner.model(ids[start:end], pos[start:end], meta)  # [q, H]
            for lo in range(0, q, logit_chunk):
                hi = min(lo + logit_chunk, q)
                logits = runner.model.compute_logits(hidden[lo:hi])  # [r, V] (a vocab shard under TP)
                if runner.tp is not None:
                    from runner.parallel.sampling import gather_vocab

                    logits = gather_vocab(runner.tp, logits)
                logp = torch.log_softmax(logits.float(), dim=-1)  # [r, V]
                target = ids[start + lo + 1 : start + hi + 1]  # [r]
                chosen = logp.gather(1, target[:, None])[:, 0]  # [r]
                out["logprobs"] += chosen.tolist()
                out["ranks"] += ((logp > chosen[:, None]).sum(dim=1) + 1).tolist()
                if num_top:
                    top = logp.topk(num_top, dim=-1)
                    out["top_ids"] += top.indices.tolist()
                    out["top_logprobs"] += top.values.tolist()
                else:
                    out["top_ids"] += [[] for _ in range(hi - lo)]
                    out["top_logprobs"] += [[] for _ in range(hi - lo)]
    if runner.tp is not None and runner.tp.rank != 0:
        return None
    return out
