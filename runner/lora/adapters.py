"""LoRA adapters in PEFT's format, read and validated against a base model's config.

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are
named `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r]. Supported: the decoder's linear layers q_proj / k_proj / v_proj / o_proj / gate_proj / up_proj /
down_proj (the MLP ones only in dense models), any rank r (one for every module), `lora_alpha`, and
`use_rslora` (scaling lora_alpha / sqrt(r), else lora_alpha / r). Every option that changes what the adapter
computes and is not plain LoRA is refused with a ValueError naming the field (biases, DoRA and the other
variants, modules_to_save, fan_in_fan_out, per-module rank or alpha patterns, ...), as is any tensor that is
not the A or B of a supported module, a missing partner, a rank that differs between A, B and `r`, and a
shape that does not fit the base model. Options that only shape training or initialisation are ignored.

`LoraAdapter` is the validated result in checkpoint coordinates: per (layer, module) the (A [r, in],
B [out, r]) pair as stored (dtype and device unchanged). Not here: the device slots the engine serves
adapters from (runner/lora/slots.py), tensor-parallel shards, embedding or LM-head adapters.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.model_config import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # module -> the decoder-layer block holding it
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# adapter_config.json fields that must keep their plain-LoRA value (None, False, empty also accepted)
_MUST_BE = {"bias": "none", "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None, "rank_pattern": {},
            "alpha_pattern": {}, "lora_bias": False, "use_qalora": False, "layer_replication": None,
            "target_parameters": None, "trainable_token_indices": None, "alora_invocation_tokens": None,
            "megatron_config": None, "velora_config": None, "monteclora_config": None, "kasa_config": None,
            "use_bdlora": None, "arrow_config": None}
# fields that only shape training, initialisation or bookkeeping (the tensors say which layers are adapted)
_IGNORED = {"task_type", "peft_version", "auto_mapping", "base_model_name_or_path", "revision", "inference_mode",
            "init_lora_weights", "lora_dropout", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
            "qalora_group_size", "megatron_core", "layers_to_transform", "layers_pattern", "exclude_modules",
            "ensure_weight_tying", "runtime_config"}
_USED = {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules"}


@dataclass(kw_only=True, slots=True)
class LoraAdapter:
    """A validated LoRA adapter in checkpoint coordinates."""

    name: str  # what requests and the engine call it
    rank: int  # r, the same for every module
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A [r, in], B [out, r])

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted modules, in LORA_MODULES order."""
        present = {module for _, module in self.weights}
        return tuple(m for m in LORA_MODULES if m in present)


def lora_scaling(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's scaling of B @ A: lora_alpha / sqrt(r) with rsLoRA, else lora_alpha / r."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def peft_tensor_name(layer: int, module: str, which: str) -> str:
    """PEFT's name of the A (`which` = "A") or B tensor of `module` in decoder layer `layer`."""
    assert module in PARENT_MODULE and which in ("A", "B"), (module, which)
    return f"base_model.model.model.layers.{layer}.{PARENT_MODULE[module]}.{module}.lora_{which}.weight"


def lora_module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each module an adapter of this model may target: the attention projections, and the MLP
    ones in dense models (a MoE model's MLPs are expert stacks, not adapter targets here)."""
    hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}
    if not (cfg.hf_config.get("num_experts") or cfg.hf_config.get("num_local_experts")):
        inter = cfg.intermediate_size
        shapes |= {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return shapes


def _unset(value) -> bool:
    return value is None or value is False or (isinstance(value, (list, dict, str, tuple)) and not value)


def _check_config(config: dict, shapes: dict[str, tuple[int, int]], source: str) -> tuple[int, float]:
    """(r, scaling) of a valid adapter_config; ValueError naming the first field that is not."""
    if not isinstance(config, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{source}: peft_type must be 'LORA', got {config.get('peft_type')!r}")
    for key, plain in _MUST_BE.items():
        value = config.get(key, plain)
        if value != plain and not _unset(value):
            raise ValueError(f"{source}: {key}={value!r} is not supported (plain LoRA needs {plain!r})")
    for key, value in config.items():
        if key not in _MUST_BE and key not in _IGNORED and key not in _USED and not _unset(value):
            raise ValueError(f"{source}: unknown option {key}={value!r} (not read, so refused while set)")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{source}: r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{source}: lora_alpha must be a finite number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"{source}: use_rslora must be true or false, got {rslora!r}")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        for target in targets:
            module = str(target).rsplit(".", 1)[-1]
            if module not in shapes:
                raise ValueError(f"{source}: target_modules has {target!r}; supported modules of this model: "
                                 f"{sorted(shapes)}")
    elif not isinstance(targets, str) or not targets:  # a regex or "all-linear": the tensors say what is adapted
        raise ValueError(f"{source}: target_modules must be a list of module names or a pattern, got {targets!r}")
    return r, lora_scaling(float(alpha), r, rslora)


def adapter_from_peft(name: str, config: dict, tensors: dict[str, torch.Tensor], model_config: ModelConfig, *,
                      source: str = "adapter") -> LoraAdapter:
    """Validate a PEFT LoRA adapter given as its config (adapter_config.json's object) and its tensors (PEFT's
    names, as in adapter_model.safetensors or `peft.get_peft_model_state_dict`) against `model_config`.
    `source` prefixes the error messages."""
    shapes = lora_module_shapes(model_config)
    r, scaling = _check_config(config, shapes, f"{source}: {CONFIG_FILE}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    where = f"{source}: tensor"
    for tensor_name, tensor in tensors.items():
        match = _TENSOR.fullmatch(tensor_name)
        if match is None or match[3] not in PARENT_MODULE or match[2] != PARENT_MODULE[match[3]]:
            raise ValueError(f"{where} {tensor_name!r} is not the lora_A / lora_B weight of one of {LORA_MODULES}")
        layer, module = int(match[1]), match[3]
        if module not in shapes:
            raise ValueError(f"{where} {tensor_name!r}: {module} is not an adapter target of this model "
                             f"(supported: {sorted(shapes)})")
        if layer >= model_config.num_layers:
            raise ValueError(f"{where} {tensor_name!r}: layer {layer} is past the model's {model_config.num_layers}")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(f"{where} {tensor_name!r} must be a 2-D floating-point tensor, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{where} {tensor_name!r} has non-finite values")
        pairs.setdefault((layer, module), {})[match[4]] = tensor
    if not pairs:
        raise ValueError(f"{source}: the adapter has no lora_A / lora_B tensors")
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        for which in ("A", "B"):
            if which not in pair:
                raise ValueError(f"{source}: {peft_tensor_name(layer, module, which)} is missing (its partner is "
                                 f"there)")
        a, b = pair["A"], pair["B"]
        out, inp = shapes[module]
        label = f"{where}s of layer {layer} {module}"
        if a.shape[0] != b.shape[1]:
            raise ValueError(f"{label}: rank mismatch between lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}")
        if a.shape[0] != r:
            raise ValueError(f"{label}: rank {a.shape[0]} differs from the config's r={r}")
        if a.shape[1] != inp or b.shape[0] != out:
            raise ValueError(f"{label}: shapes lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not match the base "
                             f"model's {module} [{out}, {inp}] (lora_A [r, {inp}], lora_B [{out}, r])")
        weights[(layer, module)] = (a, b)
    return LoraAdapter(name=name, rank=r, scaling=scaling, weights=weights)


def read_adapter(path: str | Path, model_config: ModelConfig, *, name: str | None = None) -> LoraAdapter:
    """Read and validate the PEFT adapter directory `path` (adapter_config.json + adapter_model.safetensors) for
    the base model of `model_config`; `name` defaults to the directory's name. Tensors are read to the CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file():
        raise ValueError(f"adapter directory {path} has no {CONFIG_FILE}")
    if not weights_file.is_file():
        raise ValueError(f"adapter directory {path} has no {WEIGHTS_FILE} (adapter_model.bin is pickle and never "
                         f"read; save the adapter with safe_serialization=True)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    return adapter_from_peft(name or path.name, config, load_file(weights_file), model_config, source=str(path))
