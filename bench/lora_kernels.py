"""The LoRA kernels alone at decode: one step's 32 layers of the Llama-3.1-8B shape (qkv, o, gate_up, down; bf16),
batch `--tokens` with `--slots` rank-`--rank` adapter slots per layer, 1 / 4 / 16 distinct adapters in the batch,
each launch shape of `kernels.lora.LoraKernelConfig` (one launch per layer or two, tile groups, column block, warps,
split-K chunk), the overlapped hook (the shrink on a side stream beside the base GEMM, the expand after it: what the
engine runs with `EngineConfig.lora_overlap`) and, with `--baseline FILE`, another version of kernels/lora.py
(e.g. main's) in the same run. Prints one JSON line per measurement (CUDA only; about a minute on an H200).

    python bench/lora_kernels.py
    git show main:kernels/lora.py > bench/lora_baseline.py  # where git is; then, on the GPU:
    python bench/lora_kernels.py --baseline bench/lora_baseline.py
    python bench/lora_kernels.py --systems default,linear,linear_bn64,linear_k256_s3 --distinct 0,1,4,16

Each case is a CUDA graph of one step: the tile plan (`lora_batch`, once) and per layer the four base GEMMs
(`torch.mm` against random weights, 8B's 14 GB, so the adapters' weights come from memory as in the model) each
followed by its `add_lora` (systems `default`, `two_launches`, ...: `overlap: false`) or, in the `overlap*` systems
(`overlap: true`), each GEMM with its `lora_shrink_partials` forked onto a side stream before it and its
`lora_expand_partials` joined after it; `side_delta` / `side_delta_deferred` put the whole LoRA of each layer on the
side stream into a float32 delta (`side_delta()` says how each is joined); `residual` is
`EngineConfig.lora_deferred` (`into_residual()`); the `linear*` systems replace each GEMM and its hook with one
`kernels.lora_linear.linear_lora` launch (the GEMM in Triton, the delta added in its epilogue; `linear_configs()`,
more with `--sweep`; their outputs differ from cuBLAS's in the GEMM's rounding: `max_abs_diff_to_first`, against
the first system's); the same graph without LoRA is the base. `step_ms`: the median
replay of the graph (`--replays` replays, best of 3 rounds); `lora_ms` = step_ms - base step_ms, `lora_us_per_hook`
= lora_ms over the 128 hooks, `overhead_of_step` = lora_ms / `--step-ms` (the engine's whole base decode step at
batch 64, 5.53 ms measured on one H200 by `bench/lora.py --profile`; the issue's target is <= 0.15). `lora_only_ms`:
a graph of the LoRA work alone (no GEMMs between the hooks). `bitwise_equal_to_default`: the case's outputs against
the default config's, or the first system's when `--systems` leaves the default out (every config but the split-K
chunk and the shrink's K step must match, the overlapped systems included; the baseline too, when its arithmetic is
unchanged; `side_delta` rounds the base output plus the float32 delta in torch, the default in the kernel; null
for `side_delta_deferred` and `residual`, whose deltas are not in the outputs). `--carveouts 0,8,16` repeats it all
(base included) with that many SMs left out of the base GEMMs (cuBLASLt), room for the side stream's deltas.
`--streams` adds to each LoRA row how 3 profiled replays used the streams (`stream_use`: per stream its launches,
busy µs and µs beside another stream's kernels; the µs two streams ran at once). `--per-linear` times each linear
of the layer alone (rows with `linear`; `hooks` = its 32; its own base; `overhead_of_step` its hooks' share of
the engine's whole step), which says per projection shape whether
the Triton GEMM of `linear*` keeps up with cuBLAS. `k64_unpipelined` is the shrink
loop before its K step grew to 256 with two pipeline stages (8 dependent steps of
64 per split).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import os
import statistics
import sys
from collections.abc import Callable
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.generate import emit  # noqa: E402
from bench.timeline import stream_concurrency  # noqa: E402

LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}  # fused linear -> (in features, output slices), Llama-3.1-8B


def configs(sweep: bool) -> tuple[dict, dict]:
    """(name -> config of `add_lora` after the GEMM, name -> config of the overlapped halves)."""
    from kernels.lora import LoraKernelConfig

    named = {"default": LoraKernelConfig(), "one_launch": LoraKernelConfig(fused=True),
             "block_ids": LoraKernelConfig(fused=True, ticketed=False),
             "groups2": LoraKernelConfig(groups_per_tile_row=2), "bn256_w8": LoraKernelConfig(block_n=256, num_warps=8),
             "k64_unpipelined": LoraKernelConfig(block_k=64, shrink_stages=1, max_split_k=16)}
    overlapped = {"overlap": LoraKernelConfig()}
    if sweep:
        named |= {"groups8": LoraKernelConfig(groups_per_tile_row=8), "bn64": LoraKernelConfig(block_n=64),
                  "w8": LoraKernelConfig(num_warps=8),
                  "one_groups2": LoraKernelConfig(fused=True, groups_per_tile_row=2),
                  "split256": LoraKernelConfig(split_k_chunk=256, max_split_k=64),
                  "k128": LoraKernelConfig(block_k=128), "k256_stages1": LoraKernelConfig(shrink_stages=1),
                  "k256_split1024": LoraKernelConfig(split_k_chunk=1024), "k64": LoraKernelConfig(block_k=64)}
        overlapped |= {"overlap_groups1": LoraKernelConfig(groups_per_tile_row=1),
                       "overlap_groups2": LoraKernelConfig(groups_per_tile_row=2),
                       "overlap_bn256_w8": LoraKernelConfig(block_n=256, num_warps=8)}
    return named, overlapped


class Hook(NamedTuple):
    """How a case runs LoRA: `plan(idx, num_slots)` once per step; per layer `start(x, A, B, plan, scaling, slices)`
    before the GEMM (None: nothing before it), then `finish(out, x, A, B, plan, scaling, slices, started)` after
    it; `end()` after the step's last layer (None: nothing). With `linear`, each layer is
    `linear(out, x, W, A, B, plan, scaling, slices)` instead: the GEMM and its LoRA in one call."""

    plan: Callable
    finish: Callable | None
    start: Callable | None = None
    end: Callable | None = None
    linear: Callable | None = None


def fused_linear(config, module=None) -> Hook:
    """`kernels.lora_linear.linear_lora` (or `module`'s, another version of that file) in place of each GEMM and its
    hook (one launch per layer); config a `LinearLoraConfig`, or a function of (in, out) giving one
    (`linear_config_for`: what the engine runs)."""
    from kernels.lora import lora_batch

    linear_lora = (module or importlib.import_module("kernels.lora_linear")).linear_lora
    pick = _picker(config)
    return Hook(lora_batch, None, linear=lambda out, x, W, A, B, plan, scaling, slices: linear_lora(
        x, W, None, A, B, plan, scaling, slices=slices, out=out, config=pick(W.shape[1], W.shape[0])))


def _picker(config) -> Callable:
    """A function of a layer's (in, out) giving its `LinearLoraConfig`: `config` itself if it is one, else a
    function giving `config` for every shape."""
    return config if callable(config) else lambda in_features, out_features: config


def linear_pickers(names: list[str], option: str) -> dict:
    """name -> function of a layer's (in, out) giving the `LinearLoraConfig` of `linear_configs`' system `name`,
    built around `kernels.lora_linear.linear_config_for` as it is now; SystemExit naming the command-line `option`
    for an unknown name."""
    configs = linear_configs(sweep=False)
    unknown = [name for name in names if name not in configs]
    if unknown:
        raise SystemExit(f"{option} must be one of {', '.join(sorted(configs))}; got {', '.join(unknown)}")
    return {name: _picker(configs[name]) for name in names}


def linear_configs(sweep: bool) -> dict:
    """name -> config of `linear_lora`, or a function of the layer's (in, out) giving one ("linear_by_shape": the
    engine's; "linear_by_shape_gathered": the same tiles with each row's B rows gathered in the expand;
    "linear_by_shape_block_ids": the same with each program's role its block id, `LoraKernelConfig.ticketed=False`;
    "linear_by_shape_expandN": the same with N software-pipeline stages over the expand's slots, 1: none;
    "linear_by_shape_chunkN": the same with one expand dot per N slots once the step uses N (8: the engine's;
    4: its default before 2026-12-07, late);
    "linear_by_shape_chunk8_narrow": chunks of 8 slots but in gate_up_proj (out >= 4x in), which keeps 4;
    "linear_by_shape_chunk8_w8": chunks of 8 with 8 warps a program in gate_up_proj (half the registers a thread
    for its 64-column block);
    "linear_by_shape_b_reshaped": the same with each chunk's B blocks loaded as a [chunk, 16, block_n] block and
    reshaped (`expand_b_rows=False`); "linear_by_shape_b_reshaped_shrink_stages2": that with chunks of 4 and 2
    stages in the shrink's loop (the defaults before 2026-12-07's evening);
    "linear_by_shape_groupsN": the same with N shrink tile groups per 64 tokens (fewer, longer shrink
    programs leave SMs to the GEMM's sooner); "linear_by_shape_splitN": the same with shrink splits of N in-features
    (fewer partials for each GEMM program's epilogue to sum, the shrink's sums in another order);
    "linear_by_shape_splitN_groupsG": both; "linear_by_shape_shrink_stagesN": the same with N software-pipeline
    stages in the shrink's loop; "linear_by_shape_shrink_kN": with K steps of N in it (its sums in another order);
    "linear_by_shape_stages4": the same with 4 pipeline stages in the GEMM's loop (down_proj's tile then takes 96
    KiB of shared memory instead of 120, two programs an SM instead of one, `bench/kernel_resources.py`);
    "linear_by_shape_narrow_sN[_w8]": N GEMM stages (and 8 warps) where the output is no wider than the input
    (o_proj, down_proj: at most one program an SM); "linear_by_shape_narrow_sN_[split1024_]shrink_stagesM": those
    with deeper or shorter shrink programs there (one program an SM leaves the GEMM's programs no room beside the
    shrink's: the shrink's take SMs first, by ticket; fewer shrink programs, each with several tiles, were far
    slower: docs/LORA_DECODE.md); "linear_by_shape_square_shrink_stagesM": o_proj's shrink in M stages at its 4
    GEMM stages (two programs an SM still); "linear_by_shape_long_s5": down_proj in 5 stages (the default before
    2026-12-07's night); "linear_by_shape_bnN": N output columns a program; "linear_by_shape_k64_s6": K
    steps of 64 in 6 stages;
    "linear_by_shape_early": the expand's first chunk loaded before the wait for the shrink
    (`LinearLoraConfig.expand_early`; "_narrow": but in gate_up_proj);
    "linear_by_shape_launch_count": each GEMM program counting itself into a launch-wide counter after its wait
    (`LinearLoraConfig.step_count=False`, the default before 2026-12-07's night)."""
    from dataclasses import replace

    from kernels.lora_linear import LinearLoraConfig, linear_config_for

    def by_shape(shrink: dict | None = None, *, where: Callable | None = None, **fields):
        """The engine's tile of each shape with `fields` of the linear's config and `shrink` of its LoRA config
        changed (only for the shapes (in, out) where `where` holds, when given)."""
        def config(in_features: int, out_features: int) -> LinearLoraConfig:
            chosen = linear_config_for(in_features, out_features)
            if where is not None and not where(in_features, out_features):
                return chosen
            return replace(chosen, lora=replace(chosen.lora, **(shrink or {})), **fields)
        return config

    def wide(i: int, o: int) -> bool:  # gate_up_proj
        return o >= 4 * i

    def narrow(i: int, o: int) -> bool:  # o_proj, down_proj: at most one program an SM at deeper pipelines
        return o <= i

    named = {"linear": LinearLoraConfig(), "linear_by_shape": linear_config_for,
             "linear_by_shape_gathered": by_shape(expand_by_slot=False),
             "linear_by_shape_block_ids": by_shape({"ticketed": False}),
             **{f"linear_by_shape_expand{n}": by_shape(expand_stages=n) for n in (1, 2, 4)},
             **{f"linear_by_shape_chunk{n}": by_shape(expand_chunk=n) for n in (1, 2, 4, 16)},
             "linear_by_shape_chunk8": by_shape(expand_chunk=8),
             "linear_by_shape_chunk8_narrow": lambda i, o: by_shape(expand_chunk=4 if wide(i, o) else 8)(i, o),
             "linear_by_shape_chunk8_w8": by_shape(expand_chunk=8, num_warps=8, where=wide),
             "linear_by_shape_launch_count": by_shape(step_count=False),
             "linear_by_shape_early": by_shape(expand_early=True),
             "linear_by_shape_early_narrow": by_shape(expand_early=True, where=lambda i, o: not wide(i, o)),
             **{f"linear_by_shape_bn{n}": by_shape(block_n=n) for n in (16, 64)},
             "linear_by_shape_k64_s6": by_shape(block_k=64, stages=6),
             "linear_by_shape_long_s5": by_shape(stages=5, where=lambda i, o: i >= 2 * o),
             **{f"linear_by_shape_narrow_s{n}{'_w8' if w == 8 else ''}": by_shape(stages=n, num_warps=w,
                                                                                  where=narrow)
                for n in (6, 7, 8) for w in (4, 8)},
             **{f"linear_by_shape_narrow_s{n}_shrink_stages{m}": by_shape({"shrink_stages": m}, stages=n,
                                                                         where=narrow)
                for n in (6, 7) for m in (4, 6, 8)},
             **{f"linear_by_shape_narrow_s{n}_split1024_shrink_stages4": by_shape(
                 {"shrink_stages": 4, "split_k_chunk": 1024}, stages=n, where=narrow) for n in (6, 7)},
             "linear_by_shape_b_reshaped": by_shape(expand_b_rows=False),
             "linear_by_shape_b_reshaped_shrink_stages2": by_shape({"shrink_stages": 2}, expand_b_rows=False,
                                                                   expand_chunk=4),
             **{f"linear_by_shape_groups{g}": by_shape({"groups_per_tile_row": g}) for g in (1, 2)},
             "linear_by_shape_stages4": by_shape(stages=4),
             **{f"linear_by_shape_shrink_stages{n}": by_shape({"shrink_stages": n}) for n in (1, 2, 4)},
             **{f"linear_by_shape_square_shrink_stages{n}": by_shape({"shrink_stages": n}, where=lambda i, o: i == o)
                for n in (4, 6)},
             **{f"linear_by_shape_shrink_k{k}": by_shape({"block_k": k}) for k in (128, 512)},
             **{f"linear_by_shape_split{n}": by_shape({"split_k_chunk": n}) for n in (512, 1024, 2048, 4096)},
             **{f"linear_by_shape_split{n}_groups{g}": by_shape({"split_k_chunk": n, "groups_per_tile_row": g})
                for n in (512, 1024, 2048, 4096) for g in (1, 2)},
             "linear_bn64": LinearLoraConfig(block_n=64),
             "linear_k256_s3": LinearLoraConfig(block_k=256, stages=3)}
    if sweep:
        # left out: K steps of 64 at 3 or 4 stages and of 128 at 3 (slower than these at every column block of
        # the whole step, 2026-12-06, H100) and of 256 at 4 or 5 (past the shared memory of 64 columns)
        named |= {f"linear_bn{n}_k{k}_s{st}_w{w}": LinearLoraConfig(block_n=n, block_k=k, stages=st, num_warps=w)
                  for n in (16, 32, 64, 128) for k, st in ((64, 5), (128, 4), (128, 5), (256, 3)) for w in (4, 8)
                  if (n, k, st, w) != (32, 128, 4, 4)}
    return named


def after_gemm(lora_batch, add_lora, **kw) -> Hook:
    """`add_lora` (with keyword arguments `kw`) after each GEMM."""
    return Hook(lora_batch, lambda out, x, A, B, plan, scaling, slices, started: add_lora(
        out, x, A, B, plan, scaling, slices=slices, **kw))


def overlapped(config) -> Hook:
    """Each layer's shrink forked onto a side stream before its GEMM, joined by the expand after it."""
    from kernels.lora import lora_batch, lora_expand_partials, lora_shrink_partials

    side = torch.cuda.Stream(priority=-1)  # as runner/lora/runtime.py makes it
    return Hook(lora_batch,
                lambda out, x, A, B, plan, scaling, slices, started: lora_expand_partials(
                    out, started, B, scaling, slices=slices),
                lambda x, A, B, plan, scaling, slices: lora_shrink_partials(x, A, plan, stream=side, config=config))


def side_delta(step: "Step", deferred: bool) -> Hook:
    """Each layer's whole LoRA (shrink and expand, one launch) on a side stream beside its GEMM, into a float32
    delta of zeros. Not deferred: the main stream joins after the GEMM and adds the delta (`out.add_`, one
    elementwise launch). Deferred: the join waits until just before the next GEMM and nothing adds the delta: the
    cost of a hook whose delta the kernel that reads the output adds on its way (residual + RMSNorm, rotary,
    SiLU-and-mul), less that kernel's extra read of the delta (at most 11 MB a layer here)."""
    from kernels.lora import add_lora, lora_batch

    side = torch.cuda.Stream(priority=-1)
    deltas = {n: torch.zeros(o.shape, dtype=torch.float32, device=o.device) for n, o in step.out.items()}
    names = {id(x): n for n, x in step.x.items()}

    def start(x, A, B, plan, scaling, slices):
        main = torch.cuda.current_stream()
        side.wait_stream(main)  # first: in a capture the side stream joins it before the main one waits on it
        if deferred:
            main.wait_stream(side)  # the previous layer's delta, as its consumer would wait for it
        delta = deltas[names[id(x)]]
        with torch.cuda.stream(side):
            delta.zero_()
            add_lora(delta, x, A, B, plan, scaling, slices=slices)
        return delta

    def finish(out, x, A, B, plan, scaling, slices, delta):
        if not deferred:
            torch.cuda.current_stream().wait_stream(side)
            out.add_(delta)

    return Hook(lora_batch, finish, start, lambda: torch.cuda.current_stream().wait_stream(side))


def into_residual(step: "Step") -> Hook:
    """What `EngineConfig.lora_deferred` runs: o's and down's whole LoRA (one launch) forked onto a side stream
    before their GEMMs, into a residual buffer of their own, joined after the GEMM; qkv's and gate_up's `add_lora`
    after theirs."""
    from kernels.lora import add_lora, lora_batch

    side = torch.cuda.Stream(priority=-1)
    residual = {n: torch.zeros_like(step.out[n]) for n in ("o", "down")}
    names = {id(x): n for n, x in step.x.items()}

    def start(x, A, B, plan, scaling, slices):
        name = names[id(x)]
        if name not in residual:
            return None
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            add_lora(residual[name], x, A, B, plan, scaling, slices=slices)
        return side

    def finish(out, x, A, B, plan, scaling, slices, forked):
        if forked is None:
            add_lora(out, x, A, B, plan, scaling, slices=slices)
        else:
            torch.cuda.current_stream().wait_stream(forked)

    return Hook(lora_batch, finish, start)


def load_baseline(path: str, name: str = "lora_baseline"):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class Step:
    """One decode step's linears and LoRA stacks, preallocated; `run(lora)` records (or runs) the step with the
    given hook (None: the base model; `gemms=False`: the hooks alone)."""

    def __init__(self, args, g: torch.Generator):
        dev, dt = "cuda", torch.bfloat16
        self.only: str | None = None  # one linear of LAYERS: the step runs that one alone (`--per-linear`)
        self.idx = torch.zeros(args.tokens, dtype=torch.int32, device=dev)
        self.layers = []
        for _ in range(args.layers):
            layer = {}
            for name, (inp, slices) in LAYERS.items():
                n = sum(slices)
                layer[name] = dict(
                    W=torch.empty(n, inp, dtype=dt, device=dev).normal_(0, inp**-0.5, generator=g),
                    A=torch.empty(args.slots, len(slices) * args.rank, inp, dtype=dt, device=dev).normal_(
                        0, inp**-0.5, generator=g),
                    B=torch.empty(args.slots, n, args.rank, dtype=dt, device=dev).normal_(0, 0.01, generator=g),
                    slices=slices)
            self.layers.append(layer)
        self.scaling = torch.full((args.slots,), 2.0, device=dev)
        self.x = {name: torch.randn(args.tokens, inp, generator=g, device=dev).to(dt) for name, (inp, _) in
                  LAYERS.items()}
        self.out = {name: torch.empty(args.tokens, sum(s), dtype=dt, device=dev) for name, (_, s) in LAYERS.items()}
        self.num_slots = args.slots

    def run(self, hook: Hook | None, gemms: bool = True) -> None:
        plan = hook.plan(self.idx, self.num_slots) if hook is not None else None
        for layer in self.layers:
            for name, t in layer.items():
                if self.only is not None and name != self.only:
                    continue
                out, x = self.out[name], self.x[name]
                if hook is not None and hook.linear is not None:
                    hook.linear(out, x, t["W"], t["A"], t["B"], plan, self.scaling, t["slices"])
                    continue
                started = (hook.start(x, t["A"], t["B"], plan, self.scaling, t["slices"])
                           if hook is not None and hook.start is not None else None)
                if gemms:
                    torch.mm(x, t["W"].t(), out=out)
                if hook is not None:
                    hook.finish(out, x, t["A"], t["B"], plan, self.scaling, t["slices"], started)
        if hook is not None and hook.end is not None:
            hook.end()


def timed_graph(step: Step, hook, args, gemms: bool = True) -> tuple[float, dict | None]:
    """Median ms of one replay of the step's graph, best of 3 rounds of `args.replays`; with `args.streams`, how
    3 more replays used the streams (bench/timeline.py's `stream_concurrency`), else None."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step.run(hook, gemms)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(hook, gemms)
    for _ in range(3):
        graph.replay()
    rounds = []
    for _ in range(3):
        times = []
        for _ in range(args.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        rounds.append(statistics.median(times))
    streams = None
    if args.streams:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        streams = stream_concurrency(prof, 3)
    del graph
    return min(rounds), streams


def assign(step: Step, distinct: int, args) -> None:
    """Token t takes slot (t mod distinct) * (slots // distinct): `distinct` adapters spread over the slots (0: no
    token has one, which times what each system costs besides the adapters' work; for `linear*`, its GEMM against
    cuBLAS's)."""
    t = torch.arange(args.tokens, dtype=torch.int32)
    step.idx.copy_(t % distinct * (args.slots // distinct) if distinct else torch.full_like(t, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--distinct", default="1,4,16")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--step-ms", type=float, default=5.53, help="the engine's base decode step (bench/lora.py "
                    "--profile, graph_replay_ms of the base system)")
    ap.add_argument("--baseline", default=None, help="another kernels/lora.py to time alongside (its add_lora and "
                    "lora_batch)")
    ap.add_argument("--baseline-linear", action="append", default=[], metavar="[NAME=]FILE", help="another "
                    "kernels/lora_linear.py to time alongside, its linear_lora with its linear_config_for: system "
                    "baseline_NAME (baseline_linear_by_shape without a name); may be repeated")
    ap.add_argument("--sweep", action="store_true", help="more launch shapes")
    ap.add_argument("--systems", default=None, help="comma-separated systems (or shell patterns of them, "
                    "e.g. 'linear*') to run (default: all)")
    ap.add_argument("--carveouts", default="0", help="comma-separated SM counts the base GEMMs leave to the side "
                    "stream (torch._C._set_sm_carveout_experimental through cuBLASLt; 0: torch's default BLAS, "
                    "no carve-out); each has its own base")
    ap.add_argument("--per-linear", action="store_true", help="each linear of the layer alone (qkv, o, gate_up, "
                    "down: its 32 GEMMs, each with its hook, as the step) instead of the whole step")
    ap.add_argument("--streams", action="store_true", help="per case, how 3 profiled replays used the streams "
                    "(`stream_use`: launches and busy µs per stream, µs of two streams at once)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/lora_kernels.py needs CUDA")
    from kernels.lora import add_lora, lora_batch

    step = Step(args, torch.Generator(device="cuda").manual_seed(0))
    common = dict(shape="llama-3.1-8b", dtype="bfloat16", tokens=args.tokens, slots=args.slots, rank=args.rank,
                  layers=args.layers, hooks=4 * args.layers, device=torch.cuda.get_device_name())
    named, overlaps = configs(args.sweep)
    hooks = {name: after_gemm(lora_batch, add_lora, config=config) for name, config in named.items()}
    hooks |= {name: overlapped(config) for name, config in overlaps.items()}
    hooks |= {"side_delta": side_delta(step, deferred=False), "side_delta_deferred": side_delta(step, deferred=True),
              "residual": into_residual(step)}
    hooks |= {name: fused_linear(config) for name, config in linear_configs(args.sweep).items()}
    if args.baseline:
        old = load_baseline(args.baseline)
        hooks["baseline"] = after_gemm(old.lora_batch, old.add_lora)
    for entry in args.baseline_linear:
        name, _, path = entry.rpartition("=")
        old = load_baseline(path, f"lora_linear_baseline_{name or 'linear_by_shape'}")
        hooks[f"baseline_{name or 'linear_by_shape'}"] = fused_linear(old.linear_config_for, old)
    if args.systems:
        wanted = args.systems.split(",")
        unknown = sorted(w for w in wanted if not fnmatch.filter(hooks, w))
        if unknown:
            raise SystemExit(f"--systems: unknown {unknown}; known: {sorted(hooks)}")
        hooks = {name: hooks[name] for name in dict.fromkeys(n for w in wanted for n in fnmatch.filter(hooks, w))}
    for carveout in [int(c) for c in args.carveouts.split(",")]:
        if carveout:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(carveout or None)
        for only in LAYERS if args.per_linear else [None]:
            step.only = only
            case = dict(common, carveout=carveout) | ({"linear": only, "hooks": args.layers} if only else {})
            base_ms, _ = timed_graph(step, None, args)
            emit(kind="lora_kernels", system="base", step_ms=round(base_ms, 4), **case)
            for distinct in [int(d) for d in args.distinct.split(",")]:
                run_systems(step, hooks, distinct, base_ms, case, args)


def run_systems(step: Step, hooks: dict, distinct: int, base_ms: float, common: dict, args) -> None:
    """Every system of `hooks` with `distinct` adapters in the batch, against the base step `base_ms`."""
    assign(step, distinct, args)
    reference = None
    from triton.runtime.errors import OutOfResources

    for name, hook in hooks.items():
        try:
            step_ms, streams = timed_graph(step, hook, args)
        except OutOfResources as e:  # a tile of the sweep that does not fit the SM's shared memory or registers
            emit(kind="lora_kernels", system=name, distinct=distinct, error=str(e)[:200], **common)
            continue
        fused = hook.linear is not None  # the GEMMs are the hook's own: no graph of the LoRA work alone
        lora_only = None if fused else round(timed_graph(step, hook, args, gemms=False)[0], 4)
        step.run(hook)
        outs = torch.cat([o.flatten() for name, o in step.out.items() if step.only in (None, name)])
        reference = outs if reference is None else reference
        lora_ms = step_ms - base_ms
        deferred = name in ("side_delta_deferred", "residual")  # deltas outside the outputs: nothing to compare
        emit(kind="lora_kernels", system=name, overlap=hook.start is not None, distinct=distinct,
             step_ms=round(step_ms, 4),
             lora_ms=round(lora_ms, 4), lora_us_per_hook=round(1e3 * lora_ms / common["hooks"], 2),
             overhead_of_step=round(lora_ms / args.step_ms, 4), lora_only_ms=lora_only,
             bitwise_equal_to_default=None if deferred or fused else bool(torch.equal(outs, reference)),
             **({"max_abs_diff_to_first": float((outs.float() - reference.float()).abs().max())} if fused else {}),
             **({"stream_use": streams} if streams is not None else {}), **common)


if __name__ == "__main__":
    main()
