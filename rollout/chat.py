"""A model's chat template: OpenAI chat messages (and tools) rendered into the prompt's token ids.

`ChatTemplate.from_model_dir(dir)` finds the template where transformers does: `chat_template.jinja` (with
named extra ones in `additional_chat_templates/<name>.jinja`), else `tokenizer_config.json`'s
`chat_template` (a string, or a list of {"name", "template"}); `override` is a path to a template file used
instead. Of named templates, "tool_use" renders requests with tools where the model has it, "default" the
others (transformers' choice). The model directory's tokenizer is loaded with transformers'
`AutoTokenizer` (imported lazily), so `render` is exactly `apply_chat_template(..., tokenize=True)`: the
template writes every special token itself (BOS included) and nothing is added around it, as in vLLM.

What `render` does to the messages before the template sees them (vLLM's handling of OpenAI messages):
- each must be a dict with a string `role`; `content` a string, None, or a list of text parts
  ({"type": "text", "text": str}); every other key (`name`, `tool_calls`, `tool_call_id`, ...) passes through;
- list content becomes one string, its parts joined with "\\n", unless the template iterates over a message's
  content (then string content becomes a one-part list instead, and parts stay parts);
- an assistant message's `tool_calls[j].function.arguments` given as a JSON string (OpenAI's form) is
  decoded to the object templates expect (`{{ arguments | tojson }}`), so a multi-turn episode re-renders the
  call as the model wrote it; empty or None is {};
- keys whose value is None are dropped (transformers 5 does the same; templates test for missing keys).
A malformed message, a bad `chat_template_kwargs` key and any error the template raises are ValueErrors
naming what was wrong.

Not here: parsing tool calls out of a completion (rollout/tool_parsers.py); the HTTP endpoint
(rollout/server.py); images or other non-text parts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# apply_chat_template's own parameters: chat_template_kwargs may not set them (the two others it has, documents
# and continue_final_message, pass through as template inputs)
_RESERVED_KWARGS = frozenset({
    "conversation", "tools", "chat_template", "add_generation_prompt", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens",
})


class ChatTemplate:
    """A chat template and the tokenizer it renders with."""

    def __init__(self, tokenizer: Any, template: str | dict[str, str], source: str) -> None:
        self._tokenizer = tokenizer  # a transformers tokenizer of the model
        self.templates = template if isinstance(template, dict) else {"default": template}
        """The template text by name ("default" for a single template)."""
        self.source = source
        """Where the template came from (a file, or tokenizer_config.json), for error messages."""
        self._content_as_parts = {}  # name -> whether the template iterates over a message's content
        for name, text in self.templates.items():
            self._content_as_parts[name] = _iterates_content(text, f"{source} ({name})")

    @classmethod
    def from_model_dir(cls, path: str | Path, override: str | None = None) -> "ChatTemplate | None":
        """The template of a model directory (or the file `override` names); None if the directory has none.
        `path` may also be a tokenizer.json (EngineConfig.tokenizer's form): its directory is read."""
        path = Path(path)
        if path.is_file():
            path = path.parent
        if override is not None:
            file = Path(override)
            if not file.is_file():
                raise ValueError(f"chat template file {override} does not exist")
            template, source = file.read_text(encoding="utf-8"), str(file)
        else:
            found = find_chat_template(path)
            if found is None:
                return None
            template, source = found
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the tokenizer of {path} for its chat template: {e}") from e
        return cls(tokenizer, template, source)

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               chat_template_kwargs: dict | None = None) -> list[int]:
        """The prompt's token ids: exactly `apply_chat_template(messages, tools=..., tokenize=True)`'s."""
        return list(self._apply(messages, tools, add_generation_prompt, chat_template_kwargs, tokenize=True))

    def render_text(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> str:
        """The rendered prompt as text (what `render` tokenizes)."""
        return self._apply(messages, tools, add_generation_prompt, chat_template_kwargs, tokenize=False)

    def _apply(self, messages, tools, add_generation_prompt, chat_template_kwargs, *, tokenize: bool):
        import jinja2

        if not isinstance(add_generation_prompt, bool):
            raise ValueError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of objects")
        kwargs = _template_kwargs(chat_template_kwargs)
        name = "tool_use" if tools is not None and "tool_use" in self.templates else "default"
        if name not in self.templates:
            raise ValueError(f"{self.source} has named chat templates {sorted(self.templates)} but no 'default'")
        conversation = normalize_messages(messages, content_as_parts=self._content_as_parts[name])
        try:
            return self._tokenizer.apply_chat_template(
                conversation, tools=tools, chat_template=self.templates[name],
                add_generation_prompt=add_generation_prompt, tokenize=tokenize, return_dict=False, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"the chat template ({self.source}) failed on these messages: "
                             f"{type(e).__name__}: {e}") from e


def find_chat_template(path: str | Path) -> tuple[str | dict[str, str], str] | None:
    """(template, where it was found) of a model directory, as transformers loads it; None if it has none."""
    path = Path(path)
    templates: dict[str, str] = {}
    default = path / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    if templates:
        source = str(default if default.is_file() else extra)
        return (templates["default"] if list(templates) == ["default"] else templates), source
    config_file = path / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    source = f"{config_file} chat_template"
    if template is None:
        return None
    if isinstance(template, str):
        return template, source
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                          and isinstance(t.get("template"), str) for t in template):
        return {t["name"]: t["template"] for t in template}, source
    raise ValueError(f"{source} must be a string or a list of {{'name', 'template'}} objects")


def normalize_messages(messages: Any, *, content_as_parts: bool = False) -> list[dict]:
    """Checked copies of OpenAI chat messages in the form templates read (see the module docstring).
    `content_as_parts`: the template iterates over content parts (else list content is joined into a string)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of message objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"{where}.role must be a non-empty string, got {m.get('role')!r}")
        msg = {k: v for k, v in m.items() if v is not None}
        if "content" in msg:
            msg["content"] = _content(msg["content"], content_as_parts, f"{where}.content")
        if "tool_calls" in msg:
            msg["tool_calls"] = _tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        if "tool_call_id" in msg and not isinstance(msg["tool_call_id"], str):
            raise ValueError(f"{where}.tool_call_id must be a string, got {msg['tool_call_id']!r}")
        out.append(msg)
    return out


def _content(content: Any, as_parts: bool, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if as_parts else content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string, null or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}[{j}] must be a text part {{'type': 'text', 'text': ...}}, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string, got {part.get('text')!r}")
        texts.append(part["text"])
    return [{"type": "text", "text": t} for t in texts] if as_parts else "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ValueError(f"{w} must be an object with a 'function' object")
        fn = dict(call["function"])
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{w}.function.name must be a non-empty string, got {fn.get('name')!r}")
        args = fn.get("arguments")
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ValueError(f"{w}.function.arguments is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"{w}.function.arguments must be a JSON object, got {args!r}")
        fn["arguments"] = args
        out.append({**call, "function": fn})
    return out


def _template_kwargs(kwargs: Any) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be an object with string keys")
    reserved = sorted(_RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (not template variables)")
    return kwargs


def _iterates_content(template: str, where: str) -> bool:
    """Whether the template loops over a message's content (OpenAI content parts), found in its syntax tree:
    a `for` over `x.content` / `x['content']`, or over a variable set from one."""
    import jinja2
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        tree = _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {where}: syntax error on line {e.lineno}: {e.message}") from None

    def is_content(node) -> bool:
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"

    names = {a.target.name for a in tree.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and is_content(a.node)}
    return any(is_content(f.iter) or (isinstance(f.iter, nodes.Name) and f.iter.name in names)
               for f in tree.find_all(nodes.For))
