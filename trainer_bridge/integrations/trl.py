"""TRL's GRPOTrainer sampling from this engine: `rollout_func` for generation, a callback for weight pushes.

    adapter = TRLAdapter(engine_or_pool, sampling=SamplingParams(max_tokens=64, temperature=1.0))
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(use_vllm=False, ...), train_dataset=ds,
                          processing_class=tok, rollout_func=adapter.rollout_func, callbacks=[adapter.callback])

What TRL 1.16 does with it (trl/trainer/grpo_trainer.py, `_generate`): with `rollout_func` set it calls
`rollout_func(prompts, trainer)` with this process's prompts, each already repeated `num_generations` times,
so the adapter returns one completion per entry. It reads `prompt_ids`, `completion_ids` and `logprobs`
(lists of per-sample lists; the logprobs become its `sampling_per_token_logps`) and forwards every other
key to the reward functions, per sample. The adapter adds `policy_versions` (per completion token, the
engine version it was sampled under) and, with `off_policy_correction`, `importance_weights` (per completion
token, TIS / MIS weights of the trainer's logprobs against the rollout's).

Prompts are tokenized as TRL tokenizes them itself: text with `processing_class(text=prompts)`, chat
messages with `processing_class.apply_chat_template(..., add_generation_prompt=True)` and the trainer's
`chat_template` / `chat_template_kwargs`. All of one call's prompts go to the engine in one `generate`; when
they come as TRL lays them out (each prompt G times in a row) each distinct prompt is one request with
`n = G`, so its G samples share the prompt's KV blocks (separate requests scheduled in the same step would
not hit each other's prefix cache); any other layout is sent one request per entry.

The callback pushes the unwrapped `trainer.model` through `TrainerBridge.push_weights` after every optimizer
step (the first push dense, later ones sparse patches where smaller; bit-exact in the engine dtype; the
engine's `policy_version` goes up by one per step) and appends `bridge/push_*` (bytes, seconds, version)
and `bridge/mismatch_*`, `bridge/is_*` (measured at rollout time with one no-grad trainer forward) to
`trainer._metrics` (train or eval, as TRL's own), which TRL averages into its next log line.

LoRA: with `GRPOTrainer(..., peft_config=LoraConfig(...))` give the adapter a bridge that trains an engine
adapter of the same rank and modules, `TRLAdapter(bridge=TrainerBridge(engine, lora="policy"), ...)` after
`engine.load_lora("policy", initial_adapter_dir)` (EngineConfig(max_loras >= 1)): rollouts sample with the
adapter and each push carries only its A / B tensors (tests/test_trl_adapter.py).

What it does not do: TRL 1.16 applies its own importance-sampling correction only on its vLLM path
(`use_vllm and vllm_importance_sampling_correction`), so the `importance_weights` field reaches reward
functions and the metrics but not TRL's loss; multimodal prompts and TRL's tool-calling loop are not
handled; one trainer process (the engine is not shared between data-parallel ranks here).
"""

from __future__ import annotations

import dataclasses

import torch

from rollout.sampling_params import SamplingParams
from trainer_bridge.bridge import OFF_POLICY_CORRECTIONS, PushResult, TrainerBridge, importance_weights, logprob_mismatch
from weight_updates import DiffConfig


class TRLAdapter:
    """`rollout_func` and `callback` for TRL's GRPOTrainer over one engine (local `Engine` or `RolloutPool`).

    `sampling`: how every completion is sampled; `n` must be 1 (TRL repeats the prompts itself) and
    `temperature` must equal the trainer's (TRL scores tokens at its own temperature). With `sampling.seed`
    set, rollout r of the run starts from seed `seed + r * len(prompts)` (see `TrainerBridge.rollout`), so
    steps do not repeat their noise.
    `off_policy_correction` / `importance_cap`: "none", "tis" or "mis" and its C (see
    `trainer_bridge.bridge.importance_weights`); `measure_mismatch=False` skips the trainer forward at rollout
    time (no mismatch metrics, no importance weights). `bridge`: an existing TrainerBridge over the engine.
    """

    def __init__(self, engine=None, *, sampling: SamplingParams, bridge: TrainerBridge | None = None,
                 off_policy_correction: str = "none", importance_cap: float = 2.0, measure_mismatch: bool = True,
                 diff_config: DiffConfig = DiffConfig()) -> None:
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if sampling.n != 1:
            raise ValueError(f"sampling.n must be 1 (TRL repeats each prompt num_generations times), got {sampling.n}")
        if off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(f"off_policy_correction must be one of {', '.join(OFF_POLICY_CORRECTIONS)}, "
                             f"got {off_policy_correction!r}")
        if not importance_cap > 1.0:
            raise ValueError(f"importance_cap must be > 1, got {importance_cap!r}")
        if off_policy_correction != "none" and not measure_mismatch:
            raise ValueError("off_policy_correction needs measure_mismatch=True (the weights need the trainer's logprobs)")
        if (engine is None) == (bridge is None):
            raise ValueError("give exactly one of engine and bridge")
        self.bridge = bridge if bridge is not None else TrainerBridge(engine, diff_config=diff_config)
        self.sampling = sampling
        self.off_policy_correction = off_policy_correction
        self.importance_cap = importance_cap
        self.measure_mismatch = measure_mismatch
        self.pushes: list[PushResult] = []
        """One PushResult per optimizer step, in order."""
        self.rollout_versions: list[list[int]] = []
        """Per rollout call: the policy version of every completion token it returned, in order."""
        self.trainer = None
        """The GRPOTrainer, recorded by the first `rollout_func` call."""
        self.callback = _make_callback(self)

    def rollout_func(self, prompts: list, trainer) -> dict[str, list]:
        """GRPOTrainer's `rollout_func`: one completion per prompt entry (text or a list of chat messages)."""
        if not prompts:
            raise ValueError("rollout_func got no prompts")
        temperature = getattr(trainer, "temperature", self.sampling.temperature)
        if temperature != self.sampling.temperature:
            raise ValueError(f"sampling.temperature ({self.sampling.temperature}) must equal the trainer's "
                             f"temperature ({temperature}): TRL scores the tokens at its own")
        self.trainer = trainer
        prompt_ids = _tokenize_like_trl(prompts, trainer)
        sampling = self.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + len(self.rollout_versions) * len(prompts))
        unique, repeats = _runs(prompt_ids)
        if repeats > 1:  # TRL's layout: each prompt G times in a row -> one request with n = G (shared prefix)
            batch = self.bridge.rollout(unique, dataclasses.replace(sampling, n=repeats))
        else:
            batch = self.bridge.rollout(prompt_ids, sampling)
        assert len(batch.samples) == len(prompts)
        out: dict[str, list] = {
            "prompt_ids": [s.token_ids[: s.num_prompt_tokens] for s in batch.samples],
            "completion_ids": [s.completion_ids for s in batch.samples],
            "logprobs": [s.logprobs[s.num_prompt_tokens :] for s in batch.samples],
            "policy_versions": [s.policy_versions[s.num_prompt_tokens :] for s in batch.samples],
        }
        self.rollout_versions.append([v for vs in out["policy_versions"] for v in vs])
        metrics = {"rollout_s": batch.seconds, "rollout_tokens_per_s": batch.tokens_per_s,
                   "rollout_policy_version": float(batch.policy_version)}
        if self.measure_mismatch:
            padded = batch.padded(pad_id=0)
            trainer_logp = _trainer_logprobs(trainer, padded.input_ids, padded.lengths, temperature)  # [B, T-1]
            rollout_logp, mask = padded.logprobs[:, 1:], padded.loss_mask[:, 1:]  # [B, T-1]
            metrics |= logprob_mismatch(rollout_logp, trainer_logp, mask)
            if self.off_policy_correction != "none":
                weights, stats = importance_weights(rollout_logp, trainer_logp, mask, mode=self.off_policy_correction,
                                                    cap=self.importance_cap)
                metrics |= stats
                out["importance_weights"] = [weights[i, s.num_prompt_tokens - 1 : len(s.token_ids) - 1].tolist()
                                             for i, s in enumerate(batch.samples)]
        _log(trainer, metrics)
        return out

    def push(self, model) -> PushResult:
        """Push `model`'s weights now (what the callback does after each optimizer step) and log the push."""
        result = self.bridge.push_weights(model)
        self.pushes.append(result)
        if self.trainer is not None:
            _log(self.trainer, {"push_bytes": float(result.nbytes), "push_dense_bytes": float(result.dense_nbytes),
                                "push_s": result.seconds, "push_num_patch": float(result.num_patch),
                                "policy_version": float(result.version)})
        return result


def _make_callback(adapter: TRLAdapter):
    """A `transformers.TrainerCallback` calling `adapter.push` after every optimizer step (transformers lazy)."""
    from transformers import TrainerCallback

    class PushWeightsCallback(TrainerCallback):
        """Pushes the trained model's weights to the engine at every `on_step_end` (after the optimizer step)."""

        def on_step_end(self, args, state, control, **kwargs):
            trainer = adapter.trainer
            if trainer is not None:
                model = trainer.accelerator.unwrap_model(trainer.model)
            else:
                model = kwargs["model"]
            adapter.push(model)
            return control

    return PushWeightsCallback()


def _runs(prompt_ids: list[list[int]]) -> tuple[list[list[int]], int]:
    """(distinct prompts, G) when `prompt_ids` is each of them repeated G times in a row, else (prompt_ids, 1)."""
    first = prompt_ids[0]
    g = next((i for i, p in enumerate(prompt_ids) if p != first), len(prompt_ids))
    if g == 1 or len(prompt_ids) % g:
        return prompt_ids, 1
    groups = [prompt_ids[i : i + g] for i in range(0, len(prompt_ids), g)]
    if any(any(p != grp[0] for p in grp) for grp in groups):
        return prompt_ids, 1
    return [grp[0] for grp in groups], g


def _tokenize_like_trl(prompts: list, trainer) -> list[list[int]]:
    """Prompt token ids exactly as TRL 1.16's `GRPOTrainer._tokenize_prompts` makes them (text or chat)."""
    tok = trainer.processing_class
    if isinstance(prompts[0], list):  # conversational: a list of {"role", "content"} messages
        rendered = tok.apply_chat_template(
            conversation=prompts, chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True,
            tokenize=True, return_dict=True, **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )
        ids = rendered["input_ids"]
        mask = rendered.get("attention_mask")
        if mask is not None:  # drop padding, should the tokenizer have padded the batch
            ids = [[t for t, m in zip(row, mrow) if m] for row, mrow in zip(ids, mask)]
        return [list(row) for row in ids]
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be strings or lists of chat messages, got {type(prompts[0]).__name__}")
    return [list(row) for row in tok(text=prompts)["input_ids"]]


def _trainer_logprobs(trainer, input_ids: torch.Tensor, lengths: torch.Tensor, temperature: float) -> torch.Tensor:
    """The trainer model's logprob of each next token, no grad: input_ids [B, T] -> [B, T-1] (float32)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    device = next(model.parameters()).device
    width = input_ids.shape[1]
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()  # [B, T], right padding
    with torch.no_grad():
        logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits[:, :-1]  # [B, T-1, V]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return logp.gather(-1, input_ids[:, 1:, None].to(device)).squeeze(-1).cpu()


def _log(trainer, metrics: dict[str, float]) -> None:
    """Append metrics under `bridge/` to TRL's metrics of the current mode (averaged into its next log line)."""
    store = getattr(trainer, "_metrics", None)
    if store is None:
        return
    mode = "train" if trainer.model.training else "eval"
    for key, value in metrics.items():
        store[mode][f"bridge/{key}"].append(float(value))
