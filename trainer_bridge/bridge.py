"""TrainerBridge: the one object a training script uses to talk to the rollout engine.

    batch = bridge.rollout(prompts, sampling)   engine.generate -> one TokenSample per completion
    stats = bridge.push_weights(model)          WeightDiffer.encode -> engine.apply_weight_update -> commit
                                                (rank_local: per engine rank, -> engine.update_weights_rank_local)
    m     = bridge.logprob_mismatch(batch, trainer_logprobs)
    w, s  = bridge.importance_weights(batch, trainer_logprobs, mode="tis", cap=2.0)   TIS / MIS weights

LoRA: `TrainerBridge(engine, lora=name)` rolls out with the engine's adapter `name` (unless a rollout's sampling names
another) and pushes only the adapter: `push_weights(peft_model)` (or its adapter state dict, PEFT's names with or
without the adapter segment) sends its lora_A / lora_B tensors, dense the first time and then as patches, into the
adapter's slot (`Engine.apply_lora_update`; a `RolloutPool`'s does the same on every worker, all or none), which
validates them all before writing.

MoE routing replay (R3): with `routed_experts` on (the default when the engine's model routes), every sample
carries the experts the rollout chose at each of its input positions, and `PaddedBatch.routed_experts` lines
them up with `input_ids` for `TrainingModel.token_logprobs(..., routed_experts=...)`.

The engine behind it is a local `rollout.Engine` (same process) or a `rollout.pool.RolloutPool`; both
offer `generate`, `weight_specs`, `apply_weight_update` and `policy_version` (with LoRA, `lora_specs` and
`apply_lora_update`), which is all this module uses. The bridge keeps the trainer-side snapshot (the
`WeightDiffer`), so each push after the first is a sparse patch wherever that is smaller. It does not compute
losses or rewards, and does not own the optimizer: see `trainer_bridge.grpo` / `trainer_bridge.ppo`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollout.sampling_params import SamplingParams
from weight_updates import DiffConfig, ParamSpec, WeightDiffer
from weight_updates.differ import checked_named_tensors


@dataclass(kw_only=True, slots=True)
class TokenSample:
    """One token stream: a prompt and one sampled completion. Every per-token list has length L.

    Position t describes token `token_ids[t]`: `logprobs[t]` is the rollout logprob of that token given
    the tokens before it, `policy_versions[t]` the policy version it was sampled under. Prompt tokens were
    not sampled: their loss mask is 0, logprob 0.0 and version -1, so they are never trained on.

    Worked example, prompt "7+5=" (4 tokens) and completion "12<eos>" (3 tokens) sampled under version 3::

        token_ids        [ 9,  12,   7,  13,    3,    4,    1]    "7" "+" "5" "=" | "1" "2" <eos>
        loss_mask        [ 0,   0,   0,   0,    1,    1,    1]
        logprobs         [ 0.,  0.,  0.,  0., -0.4, -0.1, -0.01]
        policy_versions  [-1,  -1,  -1,  -1,    3,    3,    3]
        num_prompt_tokens = 4

    A trainer's `token_logprobs(input_ids)` is `[B, L - 1]` with entry t scoring token t + 1, so it lines
    up with `logprobs[1:]` and `loss_mask[1:]`. `routed_experts` (MoE, when asked for) has one row per input
    position 0 .. L - 2, the trainer's forward's `routed_experts[:, t]`.
    """

    prompt_index: int
    """Position of the prompt in the `rollout` call."""
    sample_index: int
    """Which of the prompt's n samples this is."""
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    num_prompt_tokens: int
    finish_reason: str
    """"stop" or "length" (see rollout.outputs.CompletionOutput)."""
    completion_text: str | None = None
    """Detokenized completion when the engine has a tokenizer."""
    routed_experts: np.ndarray | None = None
    """MoE routing replay: int32 [L - 1, num_moe_layers, top_k], the experts the rollout routed the token at
    each position 0 .. L - 2 to (`CompletionOutput.routed_experts`); None when not asked for."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert len(self.loss_mask) == len(self.logprobs) == len(self.policy_versions) == n, "ragged TokenSample"
        assert 0 < self.num_prompt_tokens <= n
        assert self.routed_experts is None or self.routed_experts.shape[0] == n - 1, "routed_experts misaligned"

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(kw_only=True, slots=True)
class PaddedBatch:
    """TokenSamples right-padded into tensors; every tensor is [B, T] with T the longest stream."""

    input_ids: torch.Tensor  # [B, T] int64, padded with pad_id
    loss_mask: torch.Tensor  # [B, T] float32, 0 on prompt and padding
    logprobs: torch.Tensor  # [B, T] float32 rollout logprobs, 0 on prompt and padding
    policy_versions: torch.Tensor  # [B, T] int64, -1 on prompt and padding
    lengths: torch.Tensor  # [B] int64 stream lengths
    # [B, T - 1, num_moe_layers, top_k] int32 rollout experts of input positions 0 .. T - 2 (MoE routing replay;
    # None unless every sample has them: a sample aborted before it ran has none); padding positions route to
    # experts 0 .. top_k - 1 (their outputs are masked out)
    routed_experts: torch.Tensor | None = None


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    """The result of one `TrainerBridge.rollout`: samples in prompt order, then sample order."""

    samples: list[TokenSample]
    num_prompts: int
    samples_per_prompt: int
    seconds: float
    policy_version: int
    """The engine's policy version when the rollout finished."""

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.token_ids) - s.num_prompt_tokens for s in self.samples)

    @property
    def tokens_per_s(self) -> float:
        return self.num_completion_tokens / max(self.seconds, 1e-9)

    def version_lag(self) -> tuple[float, int]:
        """(mean, max) over completion tokens of `policy_version - token's version` (0 when fully on-policy)."""
        lags = [self.policy_version - v for s in self.samples for v, m in zip(s.policy_versions, s.loss_mask) if m]
        return (sum(lags) / len(lags), max(lags)) if lags else (0.0, 0)

    def padded(self, pad_id: int = 0, device: torch.device | str = "cpu") -> PaddedBatch:
        width = max(len(s.token_ids) for s in self.samples)
        b = len(self.samples)
        input_ids = torch.full((b, width), pad_id, dtype=torch.int64)  # [B, T]
        loss_mask = torch.zeros(b, width)  # [B, T]
        logprobs = torch.zeros(b, width)  # [B, T]
        versions = torch.full((b, width), -1, dtype=torch.int64)  # [B, T]
        for i, s in enumerate(self.samples):
            n = len(s.token_ids)
            input_ids[i, :n] = torch.tensor(s.token_ids)
            loss_mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            logprobs[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
            versions[i, :n] = torch.tensor(s.policy_versions)
        lengths = torch.tensor([len(s.token_ids) for s in self.samples])  # [B]
        routed = None
        if all(s.routed_experts is not None for s in self.samples):
            _, num_layers, top_k = self.samples[0].routed_experts.shape
            routed = torch.arange(top_k, dtype=torch.int32).expand(b, width - 1, num_layers, top_k).clone()
            for i, s in enumerate(self.samples):
                routed[i, : len(s.token_ids) - 1] = torch.from_numpy(s.routed_experts)
            routed = routed.to(device)
        return PaddedBatch(
            input_ids=input_ids.to(device), loss_mask=loss_mask.to(device), logprobs=logprobs.to(device),
            policy_versions=versions.to(device), lengths=lengths.to(device), routed_experts=routed,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PushResult:
    """What one `push_weights` did."""

    version: int
    """The engine's policy version after the push."""
    num_dense: int
    num_patch: int
    nbytes: int
    """Payload bytes sent (dense tensors + patch indices and values)."""
    dense_nbytes: int
    """Bytes had every parameter been sent dense."""
    changed_fraction: float
    """Fraction of elements whose bits changed (over parameters the differ had a snapshot of)."""
    encode_s: float
    apply_s: float
    """Transport + validate + write + verify on the engine side, as seen by the trainer."""
    lora_version: int | None = None
    """With `TrainerBridge(lora=...)`: the adapter's version after the push (the engine's `policy_version` moved
    by one too)."""

    @property
    def seconds(self) -> float:
        return self.encode_s + self.apply_s

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["seconds"] = self.seconds
        return d


def logprob_mismatch(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Rollout-vs-trainer logprob mismatch over the tokens where `mask` is nonzero (same shapes, any).

    delta = trainer - rollout per token. Returns mean |delta|, max |delta|, mean |exp(delta) - 1| (the
    importance ratio's distance from 1) and the k3 estimate of KL(rollout || trainer), E[r - 1 - log r]
    with r = exp(delta), which is >= 0 per token.
    """
    if rollout_logprobs.shape != trainer_logprobs.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError(
            f"shapes differ: rollout {tuple(rollout_logprobs.shape)}, trainer {tuple(trainer_logprobs.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    sel = mask.bool()
    delta = (trainer_logprobs.detach().double() - rollout_logprobs.double())[sel]  # [num_tokens]
    if delta.numel() == 0:
        return {"mismatch_abs_mean": 0.0, "mismatch_abs_max": 0.0, "ratio_dev_mean": 0.0, "mismatch_kl": 0.0}
    ratio = delta.exp()
    return {
        "mismatch_abs_mean": delta.abs().mean().item(),
        "mismatch_abs_max": delta.abs().max().item(),
        "ratio_dev_mean": (ratio - 1).abs().mean().item(),
        "mismatch_kl": (ratio - 1 - delta).mean().item(),
    }


OFF_POLICY_CORRECTIONS = ("none", "tis", "mis")


def importance_weights(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str, cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token off-policy correction weights for tokens sampled by the rollout engine (same shapes, any).

    r = exp(trainer - rollout) per token (trainer detached: the weights carry no gradient).
      "tis" (truncated importance sampling): w = min(r, cap)
      "mis" (masked importance sampling):    w = r where 1/cap <= r <= cap, else 0 (the token is dropped)
      "none":                                w = 1
    `w` is 0 wherever `mask` is 0. Returns (w, stats) with stats over the masked-in tokens: `is_weight_mean`,
    `is_truncated_frac` (r > cap, tis), `is_masked_frac` (r outside [1/cap, cap], mis), `is_ratio_max`.
    """
    if mode not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"mode must be one of {', '.join(OFF_POLICY_CORRECTIONS)}, got {mode!r}")
    if not cap > 1.0:
        raise ValueError(f"cap must be > 1 (the ratio's bound C, [1/C, C] for mis), got {cap!r}")
    if rollout_logprobs.shape != trainer_logprobs.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError(
            f"shapes differ: rollout {tuple(rollout_logprobs.shape)}, trainer {tuple(trainer_logprobs.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    sel = mask.bool()
    ratio = (trainer_logprobs.detach().double() - rollout_logprobs.double()).exp()
    truncated = sel & (ratio > cap)
    outside = sel & ((ratio > cap) | (ratio < 1.0 / cap))
    if mode == "tis":
        weights = ratio.clamp(max=cap)
    elif mode == "mis":
        weights = ratio.masked_fill(outside, 0.0)
    else:
        weights = torch.ones_like(ratio)
    weights = (weights * sel).to(torch.float32)
    num = max(1, int(sel.sum()))
    stats = {
        "is_weight_mean": weights[sel].double().sum().item() / num,
        "is_truncated_frac": int(truncated.sum()) / num if mode == "tis" else 0.0,
        "is_masked_frac": int(outside.sum()) / num if mode == "mis" else 0.0,
        "is_ratio_max": ratio[sel].max().item() if sel.any() else 0.0,
    }
    return weights, stats


class TrainerBridge:
    """Rollouts from, and weight pushes to, one engine (local `Engine` or `RolloutPool`).

    The first push of a parameter is sent dense (the bridge has no snapshot of the engine's weights yet);
    later pushes send a patch of the changed coordinates when that is smaller (see `DiffConfig`).

    With `rank_local=True` (a local `Engine`, any tensor-parallel size) each push is cut into the engine
    ranks' parts (`Engine.rank_local_layouts`), diffed per rank against that rank's snapshot, staged where
    rank r maps it (/dev/shm on the CPU, rank r's GPU through CUDA IPC) and applied with
    `Engine.update_weights_rank_local`: no rank receives another rank's part. The counts and bytes of its
    `PushResult` are summed over ranks (a replicated tensor counts once per rank).

    `routed_experts` (MoE routing replay): every rollout asks for the experts each sample was routed to
    (`SamplingParams.return_routed_experts`), and its samples and padded batches carry them. None: on when the
    engine (or pool) says its model routes (`routed_experts_shape`).

    `lora` (an `Engine` or a `RolloutPool` with the adapter loaded): the bridge trains that LoRA adapter. Rollouts sample with it
    (a `sampling.lora` of its own wins) and pushes carry only its A / B tensors (see `push_weights`).
    """

    def __init__(self, engine, *, diff_config: DiffConfig = DiffConfig(), snapshot_device: str = "cpu",
                 rank_local: bool = False, routed_experts: bool | None = None, lora: str | None = None) -> None:
        for attr in ("generate", "weight_specs", "apply_weight_update", "policy_version"):
            if not hasattr(engine, attr):
                raise ValueError(f"engine must offer {attr} (an Engine or a RolloutPool), got {type(engine).__name__}")
        self.engine = engine
        if routed_experts is None:
            routed_experts = getattr(engine, "routed_experts_shape", None) is not None
        self.routed_experts = routed_experts
        """Whether rollouts ask for the samples' routed experts (MoE routing replay)."""
        self.lora = lora
        """The engine's LoRA adapter this bridge rolls out with and pushes to; None: the base weights."""
        if lora is not None:
            if not hasattr(engine, "apply_lora_update"):
                raise ValueError(f"lora needs an Engine or a RolloutPool (pushes go into the adapter's slot), got "
                                 f"{type(engine).__name__}")
            if rank_local:
                raise ValueError("lora and rank_local cannot be combined: an adapter push goes to the engine's slot")
        self.specs: dict[str, ParamSpec] = dict(engine.weight_specs() if lora is None else engine.lora_specs(lora))
        self.differ = WeightDiffer(self.specs, device=snapshot_device, config=diff_config)
        self._rank_layouts: list[dict] | None = None
        self._rank_differs: list[WeightDiffer] = []
        if rank_local:
            if not hasattr(engine, "update_weights_rank_local"):
                raise ValueError(f"rank_local needs a local Engine (its ranks map the trainer's memory), got {type(engine).__name__}")
            self._rank_layouts = engine.rank_local_layouts()
            self._rank_differs = [
                WeightDiffer({n: ParamSpec(slot.shard_shape, self.specs[n].dtype) for n, slot in layout.items()},
                             device=snapshot_device, config=diff_config)
                for layout in self._rank_layouts
            ]

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def rollout(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams, *, use_tqdm: bool = False,
                min_finished_prompts: int | None = None) -> RolloutBatch:
        """`sampling.n` completions of every prompt, as TokenSamples in prompt order.

        With `sampling.seed` set, prompt i is sampled with seed `sampling.seed + i` (so prompts do not share
        noise) and the batch is reproducible on any engine, local or pool. `sampling.logprobs` is forced on (and
        `sampling.return_routed_experts` with the bridge's `routed_experts`).
        `min_finished_prompts` (a local engine): stop once that many prompts are done; the other samples come
        back cut short, `finish_reason == "abort"` (over-sampling: keep the finished groups, drop or resume
        the rest). `use_tqdm` (a local engine): a progress bar.
        """
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("rollout needs at least one prompt")
        lora = sampling.lora if sampling.lora is not None else self.lora
        params = [
            dataclasses.replace(sampling, logprobs=True, seed=None if sampling.seed is None else sampling.seed + i,
                                return_routed_experts=sampling.return_routed_experts or self.routed_experts, lora=lora)
            for i in range(len(prompts))
        ]
        start = time.perf_counter()
        extra = {} if min_finished_prompts is None else {"min_finished_prompts": min_finished_prompts}
        if use_tqdm:
            extra["use_tqdm"] = True
        outputs = self.engine.generate(prompts, params, **extra)
        seconds = time.perf_counter() - start
        samples = []
        for i, out in enumerate(outputs):
            p = len(out.prompt_token_ids)
            for c in out.outputs:
                assert c.finished and c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
                n = len(c.token_ids)
                routed = c.routed_experts  # a sample aborted before it ran has fewer rows: it gets none
                routed = routed if routed is not None and routed.shape[0] == p + n - 1 else None
                samples.append(
                    TokenSample(
                        prompt_index=i, sample_index=c.index, token_ids=list(out.prompt_token_ids) + list(c.token_ids),
                        loss_mask=[0] * p + [1] * n, logprobs=[0.0] * p + list(c.logprobs),
                        policy_versions=[-1] * p + list(c.policy_versions), num_prompt_tokens=p,
                        finish_reason=c.finish_reason, completion_text=c.text, routed_experts=routed,
                    )
                )
        return RolloutBatch(
            samples=samples, num_prompts=len(prompts), samples_per_prompt=sampling.n, seconds=seconds,
            policy_version=self.policy_version,
        )

    def push_weights(self, weights) -> PushResult:
        """Send new weights; on success the engine holds them under `policy_version + 1`.

        `weights`: a `TrainingModel` (or any object with `checkpoint_state()`), an `nn.Module` whose
        parameter names are checkpoint (Hugging Face) names, a `Mapping[str, Tensor]`, or an iterable of
        (name, tensor) pairs; any subset of the engine's parameters. Tensors are cast to the engine dtype
        (fp32 master weights -> bf16, say). An unknown name, a wrong shape or a non-float dtype raises
        ValueError, as does a rejected update; either way the engine's weights, its version and the
        bridge's snapshot are unchanged.

        With `TrainerBridge(lora=name)`: `weights` is a PEFT model (peft's `PeftModel`: the lora_A / lora_B
        weights of its active adapter are sent, nothing else), or its adapter state dict (a mapping or pairs)
        in PEFT's names, `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, with or without the
        adapter segment peft inserts (`.lora_A.default.weight`); any subset of the adapter's tensors. A rank,
        module or shape the loaded adapter does not have is refused (ValueError) and nothing changes; on
        success the adapter's version moves by one (`PushResult.lora_version`) and so does `policy_version`.
        """
        weights = _named_weights(weights) if self.lora is None else _adapter_weights(weights)
        if self._rank_layouts is not None:
            return self._push_rank_local(weights)
        t0 = time.perf_counter()
        with torch.no_grad():
            push = self.differ.encode(weights)
        t1 = time.perf_counter()
        lora_version = None
        if self.lora is None:
            self.engine.apply_weight_update(self.policy_version + 1, push.updates)
        else:
            lora_version = self.engine.apply_lora_update(self.lora, push.updates).version
        t2 = time.perf_counter()
        self.differ.commit(push)
        s = push.stats
        return PushResult(
            version=self.policy_version, num_dense=s.num_dense, num_patch=s.num_patch, nbytes=s.nbytes,
            dense_nbytes=s.dense_nbytes, changed_fraction=s.changed_fraction, encode_s=t1 - t0, apply_s=t2 - t1,
            lora_version=lora_version,
        )

    def _push_rank_local(self, weights) -> PushResult:
        """`push_weights` with `rank_local=True`: one bucket per engine rank, holding only its part."""
        from runner.parallel.worker import rank_device
        from weight_updates.transports.rank_local import stage_bucket

        full = checked_named_tensors(weights, self.specs)  # against the full specs: a cut could hide a wrong shape
        t0 = time.perf_counter()
        pushes = self._encode_rank_local(full)
        t1 = time.perf_counter()
        buckets = []
        try:
            for rank, push in enumerate(pushes):
                buckets.append(stage_bucket(push.updates, rank_device(self.engine.config.device, rank)))
            self.engine.update_weights_rank_local(self.policy_version + 1, [b.handle for b in buckets])
        finally:
            for b in buckets:
                b.close()
        t2 = time.perf_counter()
        for differ, push in zip(self._rank_differs, pushes):
            differ.commit(push)
        stats = [p.stats for p in pushes]
        compared = [p for s in stats for p in s.params if p.num_changed >= 0]
        return PushResult(
            version=self.policy_version, num_dense=sum(s.num_dense for s in stats), num_patch=sum(s.num_patch for s in stats),
            nbytes=sum(s.nbytes for s in stats), dense_nbytes=sum(s.dense_nbytes for s in stats),
            changed_fraction=sum(p.num_changed for p in compared) / max(1, sum(p.numel for p in compared)),
            encode_s=t1 - t0, apply_s=t2 - t1,
        )

    def _encode_rank_local(self, full: dict[str, torch.Tensor]) -> list:
        """One PendingPush per engine rank, of its part of `full`."""
        from weight_updates.transports.rank_local import shard_weights

        with torch.no_grad():
            return [d.encode(shard_weights(full, layout)) for d, layout in zip(self._rank_differs, self._rank_layouts)]

    def adopt_engine_weights(self, weights) -> int:
        """Record `weights` as what the engine already holds, sending nothing (trainer and engine started
        from one checkpoint), so the next push is a patch instead of a full dense copy.

        Checked first, tensor by tensor: the engine's checksum must equal that of `weights` cast to the
        engine dtype (with `rank_local=True`, every rank's part against that rank's). A mismatch raises
        ValueError naming the tensors and records nothing. Needs a local engine (a pool's workers are not
        read). Returns the number of tensors adopted.
        """
        if self.lora is not None:
            raise ValueError("adopt_engine_weights is for the base weights; an adapter's first push is small, send it")
        if self._rank_layouts is not None:
            return self._adopt_rank_local(_named_weights(weights))
        if not hasattr(self.engine, "rank_local_checksums"):
            raise ValueError("adopt_engine_weights needs a local Engine; push the weights to a pool instead")
        if len(self.engine.rank_local_layouts()) > 1:
            raise ValueError("adopt_engine_weights of a tensor-parallel engine needs TrainerBridge(rank_local=True)")
        weights = _named_weights(weights)
        with torch.no_grad():
            push = self.differ.encode(weights)
        (held,) = self.engine.rank_local_checksums()  # one rank: its part is the whole tensor
        differ_names = [u.name for u in push.updates if held[u.name] != u.checksum]
        if differ_names:
            raise ValueError(f"the engine does not hold these weights: {len(differ_names)} tensors differ, e.g. "
                             f"{differ_names[:3]}; push them instead")
        self.differ.commit(push)
        return len(push.updates)

    def _adopt_rank_local(self, weights) -> int:
        """`adopt_engine_weights` with `rank_local=True`: every rank's part checked against its checksum."""
        pushes = self._encode_rank_local(checked_named_tensors(weights, self.specs))
        held = self.engine.rank_local_checksums()
        differ_names = [f"{u.name} (rank {rank})" for rank, push in enumerate(pushes) for u in push.updates
                        if held[rank][u.name] != u.checksum]
        if differ_names:
            raise ValueError(f"the engine does not hold these weights: {len(differ_names)} tensor parts differ, e.g. "
                             f"{differ_names[:3]}; push them instead")
        for differ, push in zip(self._rank_differs, pushes):
            differ.commit(push)
        return len(pushes[0].updates)

    def logprob_mismatch(self, batch: RolloutBatch | PaddedBatch, trainer_logprobs: torch.Tensor) -> dict[str, float]:
        """Mismatch of the trainer's `token_logprobs(batch.input_ids)` ([B, T - 1]) against the rollout's."""
        padded = batch.padded(device=trainer_logprobs.device) if isinstance(batch, RolloutBatch) else batch
        return logprob_mismatch(padded.logprobs[:, 1:], trainer_logprobs, padded.loss_mask[:, 1:])

    def importance_weights(self, batch: RolloutBatch | PaddedBatch, trainer_logprobs: torch.Tensor, *, mode: str,
                           cap: float) -> tuple[torch.Tensor, dict[str, float]]:
        """TIS / MIS weights ([B, T - 1], see `importance_weights`) of the trainer's `token_logprobs(batch.input_ids)`
        against the rollout's, and their statistics merged with `logprob_mismatch`'s."""
        padded = batch.padded(device=trainer_logprobs.device) if isinstance(batch, RolloutBatch) else batch
        rollout, mask = padded.logprobs[:, 1:], padded.loss_mask[:, 1:]
        weights, stats = importance_weights(rollout, trainer_logprobs, mask, mode=mode, cap=cap)
        return weights, logprob_mismatch(rollout, trainer_logprobs, mask) | stats


_PEFT_TENSOR = re.compile(r"(?P<stem>.+\.lora_[AB])\.(?:(?P<adapter>[^.]+)\.)?weight")


def _adapter_weights(weights) -> dict[str, torch.Tensor]:
    """A PEFT adapter's lora_A / lora_B tensors under PEFT's saved names (no adapter segment): from a PEFT model
    (the tensors of its active adapter; every other parameter is left out) or from a mapping / (name, tensor) pairs
    (every name must be such a tensor's, of one adapter)."""
    if isinstance(weights, torch.nn.Module):
        active = getattr(weights, "active_adapter", None)
        if not isinstance(active, str):
            raise ValueError(f"a PEFT model with one active adapter is needed, got {type(weights).__name__} "
                             f"(active adapter {active!r})")
        items = [(n, t) for n, t in weights.named_parameters() if (m := _PEFT_TENSOR.fullmatch(n)) is not None
                 and m["adapter"] == active]
    elif isinstance(weights, Mapping):
        items = list(weights.items())
    elif isinstance(weights, Iterable):
        items = list(weights)
    else:
        raise ValueError(f"cannot push an adapter of type {type(weights).__name__}")
    out, adapters = {}, set()
    for name, tensor in items:
        match = _PEFT_TENSOR.fullmatch(name)
        if match is None:
            raise ValueError(f"{name!r} is not a PEFT lora_A / lora_B weight (base_model.model....lora_A.weight)")
        adapters.add(match["adapter"])
        out[match["stem"] + ".weight"] = tensor
    if len(adapters - {None}) > 1:
        raise ValueError(f"the tensors belong to several adapters {sorted(adapters - {None})}: push one")
    if not out:
        raise ValueError("push_weights got no lora_A / lora_B tensors")
    return out


def _named_weights(weights) -> Mapping[str, torch.Tensor] | list:
    """Checkpoint-named tensors from a TrainingModel, an nn.Module, a mapping or (name, tensor) pairs."""
    if hasattr(weights, "checkpoint_state"):
        weights = weights.checkpoint_state()
    elif isinstance(weights, torch.nn.Module):
        weights = dict(weights.named_parameters())
    elif not isinstance(weights, Mapping):
        if not isinstance(weights, Iterable):
            raise ValueError(f"cannot push weights of type {type(weights).__name__}")
        weights = list(weights)
    if not weights:
        raise ValueError("push_weights got no parameters")
    return weights
