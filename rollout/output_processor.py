"""What the engine returns, built incrementally from the requests that got tokens in a step.

    Engine.step():  changed = schedule -> execute -> update;  return OutputProcessor.process(changed)

`add` registers a prompt before the scheduler sees it: per sample an `IncrementalDetokenizer` (when the
engine has a tokenizer) and the sample's `StopStrings` (set on the Request, for the scheduler's stop check;
both read the one incrementally decoded text). `process` turns the prompts whose samples got tokens into
`RequestOutput`s of the prompt's `RequestOutputKind`:

    CUMULATIVE   everything so far: copies of the per-token lists and the text so far, every step the
                 prompt changed (what `Engine.step` returns by default)
    DELTA        only what is new since the prompt's previous output: the samples that changed, each with
                 its new token ids, logprobs, top logprobs, policy versions and text; a sample's last delta
                 carries its finish_reason, and the prompt's last output is `finished` (`AsyncEngine.stream`)
    FINAL_ONLY   nothing until every sample has finished, then one cumulative output (`Engine.generate`)

A prompt is reported finished once and then forgotten; `abort` forgets one early.

Cost: a step costs O(its changed samples) here, whatever n: `process` visits each changed request once,
and a DELTA output is built from the samples that changed since the prompt's previous one (its `changed`
list), not from a scan of all n. (A CUMULATIVE output carries every sample, so it costs O(n) each time.)

Text: mid-stream, the committed text (never a partial character) less what could still begin a stop string
(`StopStrings.held_back`; not with include_stop_str_in_output, whose match ends inside the newest token's
text); a finished sample's text is cut at its matched stop string (after it with include_stop_str_in_output),
or else all its tokens decoded (`flush`). So a sample's deltas concatenate to its final text, and no output
holds text that the final text lacks. Token lists count the tokens that exist: the placeholders of steps in
flight (async scheduling) are left out. Scalars (num_preemptions, spec_decode_stats, stop_reason, lora) are the
sample's current values in every kind; a LoRA sample's `lora_versions` follow from its policy versions
(`LoadedLora.versions_at`). Routed experts (MoE, when asked for) are a copy of the sample's rows of
positions 0 .. P + L - 2 in cumulative outputs (so O(P + L) per output) and only in a DELTA sample's last delta.

Adding an output field: a field of `CompletionOutput` (rollout/outputs.py), filled in `_completion` (a
per-token list is sliced `[lo:num]` like the others, so DELTA and CUMULATIVE both work), and folded in
`CompletionOutput.add`. Not here: when a request stops (rollout/scheduler.py), HTTP formats (rollout/server.py).
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from rollout.detokenizer import IncrementalDetokenizer, StopStrings
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.request import Request, RequestGroup
from rollout.sampling_params import RequestOutputKind
from rollout.spec_stats import spec_stats_summary
from rollout.tokenizer import Tokenizer

_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


class _Sample:
    """Output state of one sample."""

    __slots__ = ("req", "detokenizer", "stop", "num_sent_tokens", "num_sent_chars", "done", "changed")

    def __init__(self, req: Request, detokenizer: IncrementalDetokenizer | None, stop: StopStrings | None) -> None:
        self.req = req
        self.detokenizer = detokenizer  # None without a tokenizer: text stays None
        self.stop = stop
        self.num_sent_tokens = 0  # DELTA: output tokens already handed out
        self.num_sent_chars = 0  # DELTA: characters of text already handed out
        self.done = False  # DELTA: its last delta (with finish_reason) was handed out
        self.changed = False  # DELTA: in its prompt's `changed` list


class _Prompt:
    __slots__ = ("group", "kind", "samples", "changed")

    def __init__(self, group: RequestGroup, kind: RequestOutputKind, samples: list[_Sample]) -> None:
        self.group, self.kind, self.samples = group, kind, samples  # samples[j]: sample index j
        self.changed: list[_Sample] = []  # DELTA: samples that got tokens since the prompt's previous output


class OutputProcessor:
    """Per-prompt output state; turns each step's changed requests into RequestOutputs (see the module doc)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._prompts: dict[str, _Prompt] = {}
        self._unreported: dict[str, _Prompt] = {}  # changed since their last output, not yet built

    def __len__(self) -> int:
        """Prompts not yet reported finished."""
        return len(self._prompts)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._prompts

    def get(self, request_id: str) -> RequestGroup | None:
        prompt = self._prompts.get(request_id)
        return None if prompt is None else prompt.group

    def has_unreported(self) -> bool:
        """Whether some prompt changed since its last output and `process` has not built it yet."""
        return bool(self._unreported)

    def add(self, group: RequestGroup, kind: RequestOutputKind) -> None:
        """Register a prompt whose members the scheduler is about to get; sets each member's `stop_strings`."""
        assert group.request_id not in self._prompts
        params = group.params
        samples = []
        for req in group.members:
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer.decoder(params.skip_special_tokens,
                                                                      params.spaces_between_special_tokens))
            stop = None
            if params.stop:
                assert detok is not None, "the engine refuses stop strings without a tokenizer"
                stop = StopStrings(params.stop, detok)
            req.stop_strings = stop
            samples.append(_Sample(req, detok, stop))
        self._prompts[group.request_id] = _Prompt(group, kind, samples)

    def process(self, changed: Iterable[Request], only: Container[str] | None = None) -> list[RequestOutput]:
        """The outputs of the prompts whose samples got tokens (in `changed`, or in an earlier call that did not
        build them), in the order they first changed. `only`: build those of these request ids and keep the
        others for a later call. A prompt reported finished is forgotten."""
        prompts, unreported = self._prompts, self._unreported
        for req in changed:
            rid = req.group.request_id
            prompt = unreported.get(rid)
            if prompt is None:
                prompt = prompts.get(rid)
                if prompt is None or prompt.group is not req.group:
                    continue
                unreported[rid] = prompt
            if prompt.kind is _DELTA:
                sample = prompt.samples[req.sample_index]
                assert sample.req is req
                if not sample.changed:
                    sample.changed = True
                    prompt.changed.append(sample)
        outs = []
        for rid in [r for r in unreported if only is None or r in only]:
            prompt = unreported.pop(rid)
            out = self._output(prompt)
            if out is not None:
                outs.append(out)
            if prompt.group.finished:
                del prompts[rid]
        return outs

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a prompt whose samples the scheduler has just finished (aborted); returns its last output in
        its kind (DELTA: what its unreported samples have new), or None for an unknown id."""
        prompt = self._prompts.pop(request_id, None)
        if prompt is None:
            return None
        self._unreported.pop(request_id, None)
        assert prompt.group.finished
        return self._output(prompt, everything=True)

    # ---- building -----------------------------------------------------------------------------------------
    def _output(self, prompt: _Prompt, everything: bool = False) -> RequestOutput | None:
        """The prompt's output in its kind, or None when it has nothing to report. A DELTA output is built from
        the samples that changed, unless `everything` (an abort: every unfinished sample ends now)."""
        group, kind = prompt.group, prompt.kind
        if kind is _FINAL_ONLY and not group.finished:
            return None
        delta = kind is _DELTA
        samples = prompt.samples
        if delta:
            for s in prompt.changed:
                s.changed = False
            if not everything:
                samples = sorted(prompt.changed, key=lambda s: s.req.sample_index)  # outputs in index order
            prompt.changed = []
        outputs = [c for c in (self._completion(s, delta) for s in samples) if c is not None]
        if not outputs:
            return None
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=None if group.prompt_embeds is not None else group.prompt_token_ids,
            outputs=outputs,
            num_cached_prompt_tokens=group.num_cached_prompt_tokens,
            finished=group.finished,
        )

    def _completion(self, s: _Sample, delta: bool) -> CompletionOutput | None:
        """One sample's output: everything so far, or (delta) what is new since its last one (None if nothing)."""
        r = s.req
        finished = r.status.finished
        num = len(r.token_ids) - r.num_prompt_tokens - r.num_placeholders  # output tokens that exist
        lo = 0
        if delta:
            if s.done or (num == s.num_sent_tokens and not finished):
                return None
            lo, s.num_sent_tokens, s.done = s.num_sent_tokens, num, finished
        p, start = r.params, r.num_prompt_tokens
        n_top = p.top_logprobs
        return CompletionOutput(
            index=r.sample_index,
            token_ids=r.token_ids[start + lo : start + num],
            logprobs=r.logprobs[lo:num] if p.logprobs else None,
            finish_reason=r.status.value if finished else None,
            policy_versions=r.policy_versions[lo:num],
            text=self._text(s, num, finished, delta),
            top_logprobs=[t[:n_top] for t in r.top_logprobs[lo:num]] if n_top else None,
            num_preemptions=r.num_preemptions,
            spec_decode_stats=None if r.spec_stats is None else spec_stats_summary(r.spec_stats),
            stop_reason=r.stop_reason if finished else None,
            routed_experts=r.routed_experts.first(start + num - 1)
            if r.routed_experts is not None and (finished or not delta) else None,
            lora=None if r.lora is None else r.lora.name,
            lora_versions=None if r.lora is None else r.lora.versions_at(r.policy_versions[lo:num]),
        )

    def _text(self, s: _Sample, num: int, finished: bool, delta: bool) -> str | None:
        detok = s.detokenizer
        if detok is None:
            return None
        r = s.req
        start, include = r.num_prompt_tokens, r.params.include_stop_str_in_output
        if finished and s.stop is not None and s.stop.match is not None:
            begin, stop_end = s.stop.match
            end = stop_end if include else begin
        elif finished:
            detok.flush(r.token_ids, start, start + num)
            end = detok.length
        else:
            detok.update(r.token_ids, start, start + num)
            end = detok.length - (s.stop.held_back() if s.stop is not None and not include else 0)
        if not delta:
            return detok.text(0, end)
        assert end >= s.num_sent_chars, "text once handed out stays in the final text"
        begin, s.num_sent_chars = s.num_sent_chars, end
        return detok.text(begin, end)
