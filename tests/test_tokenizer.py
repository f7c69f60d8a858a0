"""The tokenizer encodes like the model's own (transformers' AutoTokenizer is the oracle): the BOS a Llama-style
post-processor adds to text prompts, `add_special_tokens=False` per request, tokenizer_config.json's added tokens;
and decodes with `skip_special_tokens` and `spaces_between_special_tokens` both ways, incrementally as in full,
through the engine's outputs too."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from rollout import Engine, EngineConfig, SamplingParams
from rollout.detokenizer import IncrementalDetokenizer
from rollout.tokenizer import Tokenizer

TEXTS = ["hello world", "the quick brown fox", " leading space", "x", "world hello world", ""]


def write_llama_tokenizer(path, config: dict | None = None):
    """A Llama-style tokenizer: SentencePiece-like BPE (Metaspace) whose post-processor puts <s> first."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["hello world the quick brown fox jumps over"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return path


def write_chatml_tokenizer(path):
    """A byte-level BPE with ChatML's special tokens and a non-special added tag (as Qwen's vocabulary has)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user assistant hello world, the quick brown fox 你好"] * 20, trainer)
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    return path


def hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_llama_tokenizer(tmp_path_factory.mktemp("llama_tok"))


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    return write_chatml_tokenizer(tmp_path_factory.mktemp("chatml_tok"))


def test_text_gets_the_bos_the_post_processor_adds(llama_dir):
    ours, hf = Tokenizer(llama_dir), hf_tokenizer(llama_dir)
    bos = hf.convert_tokens_to_ids("<s>")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ids[0] == bos
        plain = ours.encode(text, add_special_tokens=False)
        assert plain == hf(text, add_special_tokens=False)["input_ids"] and ids == [bos] + plain
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (bos, 2)
    assert Tokenizer(llama_dir / "tokenizer.json").encode("hello") == ours.encode("hello")  # a file path reads its dir


def test_no_post_processor_adds_nothing(chatml_dir):
    ours, hf = Tokenizer(chatml_dir), hf_tokenizer(chatml_dir)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == hf(text)["input_ids"] == ours.encode(text, add_special_tokens=False), text
    assert ours.bos_token_id is None and ours.eos_token_id is None  # no tokenizer_config.json


def test_tokenizer_config_added_tokens(tmp_path):
    """Tokens that only tokenizer_config.json declares are added as transformers adds them."""
    base = Tokenizer(write_llama_tokenizer(tmp_path)).vocab_size
    extra = {"added_tokens_decoder": {str(base): {"content": "<extra>", "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False, "special": True},
                                      str(base + 1): {"content": "[tag]", "lstrip": False, "normalized": False,
                                                      "rstrip": False, "single_word": False, "special": False}},
             "pad_token": {"content": "<pad>", "__type": "AddedToken"}}
    write_llama_tokenizer(tmp_path, extra)
    ours, hf = Tokenizer(tmp_path), hf_tokenizer(tmp_path)
    assert ours.vocab_size == len(hf) == base + 3
    text = "hello <extra> world [tag] fox<pad>"
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert {base, base + 1, base + 2} <= set(ids)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)  # <extra> and <pad> dropped, [tag] kept
    assert "[tag]" in ours.decode(ids) and "<extra>" not in ours.decode(ids)


def test_spaces_between_special_tokens(llama_dir, chatml_dir):
    llama = Tokenizer(llama_dir)
    ids = llama.encode("hello world") + [llama.eos_token_id]  # <s> hello world </s>
    assert llama.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True) == "<s> hello world </s>"
    assert llama.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "<s> hello world</s>"
    assert llama.decode(ids, skip_special_tokens=False) == "<s> hello world </s>"  # True is the default
    for spaces in (True, False):
        assert llama.decode(ids, spaces_between_special_tokens=spaces) == "hello world"

    chatml = Tokenizer(chatml_dir)
    ids = chatml.encode("<|im_start|>user\nhi<tool_call>x<|im_end|><|im_end|>")
    assert chatml.decode(ids, False, True) == "<|im_start|> user\nhi<tool_call>x <|im_end|> <|im_end|>"
    assert chatml.decode(ids, False, False) == "<|im_start|>user\nhi<tool_call>x<|im_end|><|im_end|>"
    assert chatml.decode(ids, False, False) == hf_tokenizer(chatml_dir).decode(ids, skip_special_tokens=False)
    assert chatml.decode(ids, True, True) == chatml.decode(ids, True, False) == "user\nhi<tool_call>x"


@pytest.mark.parametrize("skip,spaces", [(False, True), (False, False), (True, True)])
def test_incremental_text_equals_full_decode(llama_dir, chatml_dir, skip, spaces):
    rng = random.Random(0)
    for d in (llama_dir, chatml_dir):
        tok = Tokenizer(d)
        special = list(tok._special)
        for _ in range(50):
            ids = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(tok.vocab_size)
                   for _ in range(rng.randint(1, 12))]
            detok = IncrementalDetokenizer(tok.decoder(skip, spaces))
            for end in range(1, len(ids) + 1):
                detok.update(ids, 0, end)
            detok.flush(ids, 0, len(ids))
            assert detok.text() == tok.decode(ids, skip, spaces), ids


def test_sampling_params_fields_are_checked():
    for name in ("add_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(ValueError, match=f"SamplingParams.{name} must be a bool"):
            SamplingParams(**{name: "yes"})


def model_dir_with(tokenizer_dir, ckpt_factory, tmp_path, vocab_size: int):
    for f in ckpt_factory("llama", vocab_size=vocab_size, seed=4).iterdir():
        shutil.copy(f, tmp_path / f.name)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_engine_text_prompts_get_bos_unless_asked_not_to(llama_dir, ckpt_factory, tmp_path):
    engine = Engine(EngineConfig(model=str(model_dir_with(llama_dir, ckpt_factory, tmp_path, 96)), dtype="float32",
                                 num_kv_blocks=32))
    hf = hf_tokenizer(llama_dir)
    text = "hello world the fox"
    greedy = dict(max_tokens=2, temperature=0)
    with_bos, without = engine.generate([text, text], [SamplingParams(**greedy),
                                                       SamplingParams(add_special_tokens=False, **greedy)])
    assert with_bos.prompt_token_ids == hf(text)["input_ids"] and with_bos.prompt_token_ids[0] == hf.bos_token_id
    assert without.prompt_token_ids == hf(text, add_special_tokens=False)["input_ids"]
    rid = engine.add_request(text, SamplingParams(add_special_tokens=False, **greedy))
    outs = []
    while not any(o.request_id == rid and o.finished for o in outs):
        outs += engine.step()
    assert outs[-1].prompt_token_ids == without.prompt_token_ids
    ids = [5, 6, 7]  # token-id prompts are used as given, whatever the flag says
    assert engine.generate([ids], SamplingParams(**greedy))[0].prompt_token_ids == ids


def test_engine_outputs_honour_spaces_between_special_tokens(chatml_dir, ckpt_factory, tmp_path):
    """The flags reach the incremental detokenizer: the runner's sampled tokens are replaced by a script with
    special tokens in it, and each output's text is the full decode under its request's flags."""
    engine = Engine(EngineConfig(model=str(model_dir_with(chatml_dir, ckpt_factory, tmp_path, 320)), dtype="float32",
                                 num_kv_blocks=32))
    tok = engine.tokenizer
    script = tok.encode("<|im_start|>assistant\nhello<|im_end|><|im_start|>fox")
    real = engine.runner.collect
    step = {"k": 0}

    def collect(handle):
        out = real(handle)
        out.sampled_token_ids = [[script[min(step["k"], len(script) - 1)]] for _ in out.req_ids]
        step["k"] += 1
        return out

    engine.runner.collect = collect
    for spaces in (True, False):
        step["k"] = 0
        params = SamplingParams(max_tokens=len(script), temperature=0, ignore_eos=True, skip_special_tokens=False,
                                spaces_between_special_tokens=spaces)
        (out,) = engine.generate([[3, 4, 5]], params)
        assert out.outputs[0].token_ids == script
        assert out.outputs[0].text == tok.decode(script, False, spaces)
    assert tok.decode(script, False, True) != tok.decode(script, False, False)
