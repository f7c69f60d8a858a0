"""Typed configs from YAML: every value is checked against its field's annotation (naming the key and the
type expected), unknown keys are refused by name, and malformed YAML names its file, line and column."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rollout import SamplingParams
from rollout.config import EngineConfig, SpeculativeConfig, from_mapping, load_yaml
from rollout.pool import PoolConfig
from rollout.sampling_params import RequestOutputKind


@pytest.mark.parametrize("data, message", [
    ({"max_num_seqs": "8"}, "max_num_seqs must be an integer, got '8' (string)"),
    ({"max_num_seqs": True}, "max_num_seqs must be an integer, got True (boolean)"),
    ({"max_num_seqs": 8.0}, "max_num_seqs must be an integer, got 8.0 (number)"),
    ({"max_model_len": 1.5}, "max_model_len must be an integer or null, got 1.5 (number)"),
    ({"max_model_len": "long"}, "max_model_len must be an integer or null, got 'long' (string)"),
    ({"num_kv_blocks": [4]}, "num_kv_blocks must be an integer or null, got [4] (list)"),
    ({"enforce_eager": "yes"}, "enforce_eager must be true or false, got 'yes' (string)"),
    ({"enforce_eager": 1}, "enforce_eager must be true or false, got 1 (integer)"),
    ({"gpu_memory_utilization": "most"}, "gpu_memory_utilization must be a finite number, got 'most' (string)"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be a finite number, got nan"),
    ({"gpu_memory_utilization": False}, "gpu_memory_utilization must be a finite number, got False"),
    ({"dtype": 16}, "dtype must be a string, got 16 (integer)"),
    ({"async_scheduling": "auto"}, "async_scheduling must be true or false or null, got 'auto' (string)"),
    ({"speculative": 3}, "speculative must be a mapping of SpeculativeConfig fields or null, got 3 (integer)"),
    ({"speculative": {"num_speculative_tokens": "4"}}, "speculative.num_speculative_tokens must be an integer, got '4'"),
    ({"speculative": {"auto_off": None}}, "speculative.auto_off must be true or false, got None (null)"),
])
def test_a_value_of_the_wrong_type_names_the_key_and_the_type(data, message):
    with pytest.raises(ValueError) as e:
        from_mapping(EngineConfig, {"model": "m", **data}, "engine.yaml")
    assert str(e.value).startswith(f"engine.yaml: {message}"), str(e.value)


def test_values_of_the_right_type_pass_and_floats_take_integers_and_numeric_strings():
    cfg = from_mapping(EngineConfig, {"model": "m", "gpu_memory_utilization": 1, "max_model_len": None,
                                      "speculative": {"num_speculative_tokens": 2}}, "e.yaml")
    assert cfg.gpu_memory_utilization == 1.0 and type(cfg.gpu_memory_utilization) is float
    assert cfg.max_model_len is None and cfg.speculative == SpeculativeConfig(num_speculative_tokens=2)
    assert from_mapping(EngineConfig, {"model": "m", "gpu_memory_utilization": "5e-1"}).gpu_memory_utilization == 0.5
    spec = SpeculativeConfig(method="mtp")
    assert from_mapping(EngineConfig, {"model": "m", "speculative": spec}).speculative is spec


def test_lists_dicts_and_enums_are_checked_item_by_item():
    with pytest.raises(ValueError, match=r"^s: stop_token_ids\[1\] must be an integer, got '2' \(string\)"):
        from_mapping(SamplingParams, {"stop_token_ids": [1, "2"]}, "s")
    with pytest.raises(ValueError, match=r"^s: stop must be a list \(each item a string\), got 'x'"):
        from_mapping(SamplingParams, {"stop": "x"}, "s")
    with pytest.raises(ValueError, match=r"^s: output_kind must be one of 0, 1, 2, got 7"):
        from_mapping(SamplingParams, {"output_kind": 7}, "s")
    assert from_mapping(SamplingParams, {"output_kind": 2, "stop": ["</a>"]}).output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match=r"^p\.yaml: resources\.num_cpus must be a finite number, got 'a'"):
        from_mapping(PoolConfig, {"model": "m", "resources": {"num_cpus": "a"}}, "p.yaml")
    with pytest.raises(ValueError, match=r"^p\.yaml: engine must be a mapping, got \['cpu'\]"):
        from_mapping(PoolConfig, {"model": "m", "engine": ["cpu"]}, "p.yaml")

    @dataclass(kw_only=True)
    class Nested:
        weights: dict[str, float] = field(default_factory=dict)
        sizes: list[int | None] = field(default_factory=list)

    assert from_mapping(Nested, {"weights": {"a": 1}, "sizes": [1, None]}) == Nested(weights={"a": 1.0}, sizes=[1, None])
    with pytest.raises(ValueError, match=r"^<dict>: weights\.b must be a finite number, got 'x'"):
        from_mapping(Nested, {"weights": {"a": 1, "b": "x"}})
    with pytest.raises(ValueError, match=r"^<dict>: sizes\[0\] must be an integer or null, got True"):
        from_mapping(Nested, {"sizes": [True]})


def test_unknown_keys_are_named_with_where_they_are():
    with pytest.raises(ValueError, match=r"^e\.yaml: unknown key\(s\) \['max_num_seq'\] for EngineConfig"):
        from_mapping(EngineConfig, {"model": "m", "max_num_seq": 4}, "e.yaml")
    with pytest.raises(ValueError, match=r"^e\.yaml: speculative: unknown key\(s\) \['methd'\] for SpeculativeConfig"):
        from_mapping(EngineConfig, {"model": "m", "speculative": {"methd": "eagle"}}, "e.yaml")
    with pytest.raises(ValueError, match=r"^e\.yaml: .*model"):  # a required field left out
        from_mapping(EngineConfig, {}, "e.yaml")


@pytest.mark.parametrize("text, where, what", [
    ("device: cpu\nmax_num_seqs: [1, 2\nseed: 3\n", ":3:5:", "expected ',' or ']'"),
    ("device: cpu\n  dtype: float32\n", ":2:8:", "mapping values are not allowed here"),
    ("a: 1\n\tb: 2\n", ":2:1:", "cannot start any token"),
    ("key: 'unclosed\n", ":2:1:", "found unexpected end of stream"),
])
def test_malformed_yaml_names_file_line_and_column(tmp_path, text, where, what):
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="malformed YAML") as e:
        load_yaml(path)
    assert str(e.value).startswith(f"{path}{where} malformed YAML") and what in str(e.value), str(e.value)


def test_yaml_that_is_not_a_mapping_or_not_text_is_refused(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"top level must be a mapping of keys, got \[1, 2\]"):
        load_yaml(path)
    path.write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(ValueError, match=r"e\.yaml: malformed YAML: 'utf-8' codec"):
        load_yaml(path)
    with pytest.raises(ValueError, match="config file not found"):
        load_yaml(tmp_path / "absent.yaml")
    path.write_text("")
    assert load_yaml(path) == {}


@pytest.mark.parametrize("rows", [-1, 9, True, 1.0])
def test_fused_gemv_rows_is_an_integer_from_0_to_8(rows):
    with pytest.raises(ValueError, match=r"EngineConfig.fused_gemv_rows must be an integer in \[0, 8\]"):
        EngineConfig(model="m", fused_gemv_rows=rows)
    for ok in (0, 1, 8):
        assert EngineConfig(model="m", fused_gemv_rows=ok).runner_config().fused_gemv_rows == ok
