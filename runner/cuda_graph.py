"""CUDA-graph capture and replay of pure-decode steps.

A pure-decode batch (every request computes one token and samples it) of B requests is padded up to the
next captured size P and replayed: the graph reads the runner's persistent step buffers (input tokens
still in flight, staged as -1, it reads from the runner's `last_sampled`; the sampling tensors as the views
`StepBuffers.sampling(P)`), runs the model, the LM head and the sampler, keeps the tokens in
`last_sampled`, and writes tokens and logprobs into static output tensors. Padded rows have seq_len 0 and
KV slot -1, so they read nothing, write nothing and their outputs are ignored. The graph's attention grid
is sized for `max_model_len`, so one graph serves every context length.

Each size has two variants: steps where no row truncates (top-k / top-p / min-p off, the RL default;
captured at start-up) and steps where some row does (captured the first time one occurs). A runner with LoRA
slots doubles them: steps where some token has an adapter replay a graph that runs the LoRA kernels, steps
where none has one replay a graph captured with the LoRA hooks off (the base model's step, at its cost); both
no-truncation variants are captured at start-up, in the one memory pool. Without LoRA the `lora` key is always
False.

Not here: mixed prefill/decode steps and steps that want top-N logprobs — those run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, multiples of 16 up to 256, multiples of 64 beyond, and max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, min(max_num_seqs, 256) + 1, 16))
    sizes += list(range(320, max_num_seqs + 1, 64))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the side stream every capture runs on


def capture_stream() -> torch.cuda.Stream:
    """The one side stream the current device's graphs are warmed up and captured on. cuBLAS keeps a workspace
    per (handle, stream) for the process's life: a fresh stream per capture would leave one (~32 MiB) behind on
    each of the 32 pooled streams in turn, none of it counted by the KV cache sizing's one probe capture."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[device]


def capture(step, pool=None):
    """(graph, outputs) of `step()` captured as a CUDA graph in memory pool `pool` (None: a new one). A warm-up
    call on the capture stream first compiles (and autotunes) every kernel and sets up that stream's BLAS
    workspaces outside the capture."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = step()
    return graph, outputs


class DecodeGraphs:
    def __init__(self, runner, sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sorted(sizes)
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}  # (size, truncation, lora) -> graph
        # (size, truncation, lora) -> (tokens [P], logprobs [P])
        self.outputs: dict[tuple[int, bool, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.lora_variants = (True, False) if runner.lora is not None else (False,)  # the `lora` keys captured
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int:
        return next(s for s in self.sizes if s >= num_reqs)

    def capture(self) -> float:
        """Capture every size (with LoRA: both LoRA variants), largest first (smaller graphs reuse its memory
        pool). Returns seconds."""
        start = time.perf_counter()
        self.runner.fill_padding_rows(0, self.max_size)
        self.runner.buffers.upload(self.max_size)
        torch.cuda.synchronize()
        for size in reversed(self.sizes):
            for lora in self.lora_variants:
                self._capture_one(size, truncation=False, lora=lora)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        logger.info("captured %d decode graphs (sizes %s) in %.1f s", len(self.graphs), self.sizes, elapsed)
        return elapsed

    def _capture_one(self, size: int, truncation: bool, lora: bool) -> None:
        """Capture one variant. The warm-up runs compute the step the buffers hold (during a run: the real
        step, so they rewrite the same KV values), which compiles the kernels outside the capture."""
        graph, (tokens, logprobs) = capture(lambda: self.runner.decode_forward(size, truncation, lora), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(size, truncation, lora)] = graph
        self.outputs[(size, truncation, lora)] = (tokens, logprobs)

    def replay(self, size: int, truncation: bool = False, lora: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step the buffers hold; `lora`: some token of it has an adapter (a step with adapter tokens
        must never take lora=False, which adds nothing)."""
        assert lora in self.lora_variants, "lora=True needs a runner with LoRA slots"
        key = (size, truncation, lora)
        if key not in self.graphs:
            # the capture's warm-up runs overwrite `last_sampled`: the step's in-flight input tokens are
            # read from it first, so that the warm-ups and the replay all compute this step
            self.runner.resolve_placeholders(size)
            self._capture_one(*key)
        self.graphs[key].replay()
        return self.outputs[key]

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
