"""The toy task: multi-digit addition with a verifiable reward, a character tokenizer and a tiny model.

    prompt      "47+385="            (operands drawn uniformly with 1..max_digits digits)
    completion  "432<eos>"           (the sum, written normally, then EOS)
    reward      1.0 if the completion's text starts with the sum as a whole number, else 0.0

What it provides: the tokenizer (built with `tokenizers`, one token per character, saved as
tokenizer.json), seeded train / held-out prompt sets, the reward function, a tiny random Llama in
Hugging Face layout (via `runner.testing.write_random_checkpoint`), and a supervised warm-up that trains
that model with `TrainingModel` + AdamW and saves it back as safetensors in checkpoint names.
What it does not do: RL (see `trainer_bridge.grpo`), or any talking to the engine.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

PAD, EOS = "<pad>", "<eos>"
CHARS = "0123456789+="
VOCAB = [PAD, EOS, *CHARS]  # id 0 = pad (also bos in config.json), id 1 = eos
PAD_ID, EOS_ID = 0, 1


@dataclass(kw_only=True, slots=True)
class Problem:
    prompt: str  # "47+385="
    answer: str  # "432"


def build_tokenizer(path: str | Path) -> Path:
    """Write a character-level tokenizer.json (WordLevel over single characters) to `path` (a directory)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, EOS])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def encode(text: str) -> list[int]:
    """Character ids without the tokenizer file (the same mapping tokenizer.json holds)."""
    return [VOCAB.index(c) for c in text]


def make_problems(num: int, *, max_digits: int, seed: int, template: str = "{a}+{b}=") -> list[Problem]:
    """`num` seeded addition problems; each operand has 1..max_digits digits (uniform).

    `template` writes the prompt from operands a and b ("{a}+{b}=" for the toy model; a real model's
    preset asks in words).
    """
    if num < 1 or max_digits < 1:
        raise ValueError(f"num and max_digits must be >= 1, got {num}, {max_digits}")
    rng = random.Random(seed)

    def operand() -> int:
        digits = rng.randint(1, max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    out = []
    for _ in range(num):
        a, b = operand(), operand()
        out.append(Problem(prompt=template.format(a=a, b=b), answer=str(a + b)))
    return out


_LEADING_INT = re.compile(r"\s*(\d+)(?!\d)")


def reward(problem: Problem, completion_text: str) -> float:
    """1.0 if the completion begins (after spaces) with the sum as a whole number, else 0.0."""
    m = _LEADING_INT.match(completion_text)
    return 1.0 if m is not None and m.group(1) == problem.answer else 0.0


def write_model(path: str | Path, *, hidden_size: int, num_layers: int, seed: int) -> Path:
    """A tiny random Llama (HF layout) plus the tokenizer, in `path`."""
    from runner.testing import write_random_checkpoint

    path = Path(path)
    write_random_checkpoint(
        path, family="llama", seed=seed, std=0.02, vocab_size=len(VOCAB), hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=PAD_ID, eos_token_id=EOS_ID,
    )
    build_tokenizer(path)
    return path


def supervised_batch(problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced batch: input_ids [B, T] (right-padded with PAD), target mask [B, T - 1] (answer + EOS)."""
    seqs = [encode(p.prompt) + encode(p.answer) + [EOS_ID] for p in problems]
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.int64)  # [B, T]
    mask = torch.zeros(len(seqs), width - 1)  # [B, T - 1]; entry t scores token t + 1
    for i, (p, s) in enumerate(zip(problems, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        mask[i, len(p.prompt) - 1 : len(s) - 1] = 1.0
    return input_ids, mask


def warm_up(model_dir: str | Path, *, steps: int, batch_size: int, lr: float, problems, progress: bool = True) -> list[float]:
    """Supervised warm-up of the checkpoint in `model_dir`, saved back in place. Returns the loss per step.

    `problems.batch(step, size)` gives each step's problems (see harness.ProblemStream).
    """
    from safetensors.torch import save_file

    from trainer_bridge.training_model import TrainingModel

    model = TrainingModel.from_pretrained(model_dir, dtype="float32")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    steps_iter = range(steps)
    if progress:
        from tqdm.auto import tqdm

        steps_iter = tqdm(steps_iter, desc="warm-up", unit="step")
    for step in steps_iter:
        input_ids, mask = supervised_batch(problems.batch(step, batch_size))
        logprobs = model.token_logprobs(input_ids)  # [B, T - 1]
        loss = -(logprobs * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress:
            steps_iter.set_postfix(loss=f"{losses[-1]:.3f}")
    state = {k: v.contiguous().clone() for k, v in model.checkpoint_state().items()}
    save_file(state, str(Path(model_dir) / "model.safetensors"), metadata={"format": "pt"})
    return losses
