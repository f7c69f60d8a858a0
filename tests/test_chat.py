"""Chat templates: `ChatTemplate.render` gives exactly the ids of transformers' `apply_chat_template` on a tiny
model directory that carries a real ChatML template with tools (Qwen2.5's, plus Qwen3's `enable_thinking`
switch), with and without tools, with template kwargs, over multi-turn episodes with tool calls and tool results;
where the template comes from; OpenAI message forms (string arguments, content parts); and the errors."""

from __future__ import annotations

import json

import pytest

from rollout.chat import ChatTemplate, find_chat_template, normalize_messages

# Qwen2.5-Instruct's template (public), with Qwen3's `enable_thinking` switch on the generation prompt
QWEN_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}]


def write_chatml_dir(path, template: str | list | None = QWEN_TEMPLATE, jinja: str | None = None):
    """A model directory's tokenizer files: a byte-level BPE with ChatML's special tokens and the non-special
    tool / think tags (as Qwen's vocabulary has them), and tokenizer_config.json carrying `template`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
              "system user assistant tool function name arguments city Paris weather sunny",
              '{"name": "get_weather", "arguments": {"city": "Paris"}}'] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_chatml_dir(tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="module")
def hf(chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_dir))


@pytest.fixture(scope="module")
def template(chat_dir):
    return ChatTemplate.from_model_dir(chat_dir)


def oracle(hf, messages, **kw) -> list[int]:
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    return list(ids)


def call(name: str, arguments: dict, id_: str) -> dict:
    """An assistant tool call in OpenAI's form: arguments as a JSON string."""
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def as_dict_arguments(messages: list[dict]) -> list[dict]:
    """The same messages with each call's arguments as an object: the form transformers' docs feed templates."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


EPISODE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris and in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Paris"}, "c1"),
                                                          call("get_weather", {"city": "Rome", "unit": "C"}, "c2")]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"sky": "rain"}'},
    {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", {"city": "Paris"}, "c3")]},
    {"role": "tool", "tool_call_id": "c3", "content": "cloudy"},
]


def test_render_equals_apply_chat_template(template, hf):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ids = template.render(messages)
    assert ids == oracle(hf, messages, add_generation_prompt=True)
    assert hf.decode(ids).endswith("<|im_start|>assistant\n")
    assert template.render(messages, add_generation_prompt=False) == oracle(hf, messages, add_generation_prompt=False)
    assert template.render(messages, add_generation_prompt=False) != ids
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.render_text(messages) == text


def test_render_with_tools(template, hf):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    ids = template.render(messages, tools=TOOLS)
    assert ids == oracle(hf, messages, tools=TOOLS, add_generation_prompt=True)
    assert ids != template.render(messages)  # the tools reached the template
    assert '"get_weather"' in hf.decode(ids)


def test_chat_template_kwargs_reach_the_template(template, hf):
    messages = [{"role": "user", "content": "Hi"}]
    off = template.render(messages, chat_template_kwargs={"enable_thinking": False})
    assert off == oracle(hf, messages, add_generation_prompt=True, enable_thinking=False)
    assert hf.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(messages, chat_template_kwargs={"enable_thinking": True}) == template.render(messages)


def test_multi_turn_with_tool_calls_and_results(template, hf):
    for k in range(2, len(EPISODE) + 1):  # every prefix of the episode that a rollout would send
        ours = template.render(EPISODE[:k], tools=TOOLS)
        assert ours == oracle(hf, as_dict_arguments(EPISODE[:k]), tools=TOOLS, add_generation_prompt=True), k
        assert template.render(as_dict_arguments(EPISODE[:k]), tools=TOOLS) == ours  # either form of arguments
    text = hf.decode(template.render(EPISODE, tools=TOOLS))
    # the assistant turn is re-rendered as the model writes a call (arguments an object, not a quoted string)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>' in text
    assert "<tool_response>\ncloudy\n</tool_response>" in text


def test_content_parts_are_joined_for_a_string_template(template, hf):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    assert template.render(parts) == oracle(hf, joined, add_generation_prompt=True)


def test_content_parts_stay_parts_for_a_template_that_iterates_them(tmp_path):
    from transformers import AutoTokenizer

    parts_template = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- for p in m['content'] %}[{{ p.text }}]"
                      "{%- endfor %}<|im_end|>\n{%- endfor %}")
    d = write_chatml_dir(tmp_path, template=parts_template)
    t, hf = ChatTemplate.from_model_dir(d), AutoTokenizer.from_pretrained(str(d))
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}]
    as_parts = [messages[0], {"role": "assistant", "content": [{"type": "text", "text": "c"}]}]
    assert t.render(messages, add_generation_prompt=False) == oracle(hf, as_parts)
    assert "[a][b]" in t.render_text(messages) and "[c]" in t.render_text(messages)


def test_where_the_template_comes_from(tmp_path):
    (tmp_path / "none").mkdir()
    assert ChatTemplate.from_model_dir(write_chatml_dir(tmp_path / "none", template=None)) is None
    assert ChatTemplate.from_model_dir(tmp_path) is None  # no tokenizer files at all

    d = tmp_path / "jinja"
    d.mkdir()
    jinja = "{%- for m in messages %}<|im_start|>{{ m.role }}|{{ m.content }}<|im_end|>{%- endfor %}"
    write_chatml_dir(d, jinja=jinja)  # chat_template.jinja wins over tokenizer_config.json's, as in transformers
    assert find_chat_template(d) == (jinja, str(d / "chat_template.jinja"))
    msgs = [{"role": "user", "content": "x"}]
    assert ChatTemplate.from_model_dir(d).render_text(msgs) == "<|im_start|>user|x<|im_end|>"
    assert ChatTemplate.from_model_dir(d / "tokenizer.json").render_text(msgs) == "<|im_start|>user|x<|im_end|>"

    override = tmp_path / "override.jinja"
    override.write_text("{{ messages[0].content }}!")
    assert ChatTemplate.from_model_dir(d, override=str(override)).render_text(msgs) == "x!"
    with pytest.raises(ValueError, match="does not exist"):
        ChatTemplate.from_model_dir(d, override=str(tmp_path / "missing.jinja"))

    named = tmp_path / "named"
    named.mkdir()
    write_chatml_dir(named, template=[{"name": "default", "template": "plain:{{ messages[0].content }}"},
                                      {"name": "tool_use", "template": "tools:{{ tools[0].function.name }}"}])
    t = ChatTemplate.from_model_dir(named)
    assert t.render_text(msgs) == "plain:x"
    assert t.render_text(msgs, tools=TOOLS) == "tools:get_weather"


def test_errors_name_what_is_wrong(template, tmp_path):
    ok = [{"role": "user", "content": "hi"}]
    cases = [
        ([], None, "messages must be a non-empty list"),
        (["hi"], None, r"messages\[0\] must be an object"),
        ([{"content": "hi"}], None, r"messages\[0\].role"),
        ([{"role": "user", "content": 3}], None, r"messages\[0\].content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None, r"content\[0\] must be a text"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}], None,
         r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], None, r"function.name"),
        (ok, {"tokenize": False}, "chat_template_kwargs may not set tokenize"),
        (ok, ["enable_thinking"], "chat_template_kwargs must be an object"),
    ]
    for messages, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            template.render(messages, chat_template_kwargs=kwargs)
    with pytest.raises(ValueError, match="tools must be a list"):
        template.render(ok, tools={"type": "function"})

    raising = write_chatml_dir(tmp_path, template="{{ raise_exception('only user turns, please') }}")
    with pytest.raises(ValueError, match="only user turns, please"):
        ChatTemplate.from_model_dir(raising).render(ok)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(ValueError, match="syntax error"):
        ChatTemplate.from_model_dir(tmp_path)


def test_messages_are_not_modified(template):
    episode = json.loads(json.dumps(EPISODE))
    template.render(episode, tools=TOOLS)
    assert episode == EPISODE
    normalized = normalize_messages(episode)
    assert "content" not in normalized[2]  # None dropped
    assert normalized[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_rendered_prompt_through_the_engine(chat_dir, ckpt_factory, tmp_path, template):
    """A rendered chat prompt reaches the engine as it is: no BOS or anything else added."""
    import shutil

    from rollout import Engine, EngineConfig, SamplingParams

    for f in ckpt_factory("qwen2", vocab_size=416, seed=3).iterdir():
        shutil.copy(f, tmp_path / f.name)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_dir / f, tmp_path / f)
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=32))
    ids = template.render(EPISODE[:2], tools=TOOLS)
    out = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.prompt_token_ids == ids
