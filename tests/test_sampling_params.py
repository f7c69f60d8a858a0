"""SamplingParams checks its own fields: each wrong type or value is a ValueError naming the field and the rule,
never a TypeError from a comparison and never a silently accepted NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollout.sampling_params import MAX_CACHE_SALT_CHARS, RequestOutputKind, SamplingParams

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field, value, rule", [
    ("temperature", NAN, "must be a finite number >= 0, got nan"),
    ("temperature", INF, "must be a finite number >= 0, got inf"),
    ("temperature", -INF, "must be a finite number >= 0"),
    ("temperature", "hot", "must be a finite number >= 0, got 'hot'"),
    ("temperature", None, "must be a finite number >= 0, got None"),
    ("temperature", True, "must be a finite number >= 0, got True"),
    ("temperature", -0.5, "must be a finite number >= 0, got -0.5"),
    ("top_p", NAN, r"must be a finite number in \(0, 1\], got nan"),
    ("top_p", "0.9", r"must be a finite number in \(0, 1\]"),
    ("top_p", 0.0, r"must be a finite number in \(0, 1\], got 0.0"),
    ("min_p", INF, r"must be a finite number in \[0, 1\], got inf"),
    ("min_p", [0.1], r"must be a finite number in \[0, 1\]"),
    ("n", True, "must be an integer >= 1, got True"),
    ("n", 2.0, "must be an integer >= 1, got 2.0"),
    ("n", "4", "must be an integer >= 1, got '4'"),
    ("n", 0, "must be an integer >= 1, got 0"),
    ("max_tokens", False, "must be an integer >= 1, got False"),
    ("max_tokens", 1.5, "must be an integer >= 1"),
    ("max_tokens", NAN, "must be an integer >= 1"),
    ("top_k", True, "must be an integer"),
    ("top_k", 5.0, "must be an integer"),
    ("top_k", -2, "must be an integer >= 1, or 0 / -1"),
    ("seed", True, "must be an integer or None, got True"),
    ("seed", 1.0, "must be an integer or None"),
    ("seed", "7", "must be an integer or None"),
    ("min_tokens", True, "must be an integer"),
    ("top_logprobs", 2.5, "must be an integer >= 0"),
    ("top_logprobs", -1, "must be an integer >= 0"),
    ("stop_token_ids", ["3"], "must be a list of integers >= 0, got '3' in it"),
    ("stop_token_ids", [True], "must be a list of integers >= 0, got True in it"),
    ("stop_token_ids", [2.0], "must be a list of integers >= 0"),
    ("stop_token_ids", [-1], "must be a list of integers >= 0, got -1 in it"),
    ("stop_token_ids", 3, "must be a list of integers >= 0"),
    ("stop_token_ids", "12", "must be a list of integers >= 0"),
    ("stop", [""], "must be a string or a list of non-empty strings"),
    ("stop", [1], "must be a string or a list of non-empty strings"),
    ("ignore_eos", 1, r"must be a bool \(true or false\), got 1"),
    ("add_special_tokens", "no", "must be a bool"),
    ("logprobs", "yes", "must be a bool"),
    ("skip_special_tokens", None, "must be a bool"),
    ("cache_salt", "", "must be a non-empty string or None"),
    ("cache_salt", 5, "must be a non-empty string or None"),
    ("output_kind", 7, "must be a RequestOutputKind"),
    ("output_kind", "delta", "must be a RequestOutputKind"),
])
def test_a_bad_field_is_a_value_error_naming_field_and_rule(field, value, rule):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} {rule}"):
        SamplingParams(**{field: value})


def test_min_tokens_is_bounded_by_max_tokens():
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens must be an integer in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_cache_salt_length_is_bounded_and_the_salt_is_not_echoed():
    assert MAX_CACHE_SALT_CHARS == 256
    assert SamplingParams(cache_salt="s" * MAX_CACHE_SALT_CHARS).cache_salt == "s" * 256
    salt = "tenant-" + "x" * MAX_CACHE_SALT_CHARS
    with pytest.raises(ValueError, match=r"cache_salt must be at most MAX_CACHE_SALT_CHARS=256 characters, got 263") as e:
        SamplingParams(cache_salt=salt)
    assert salt not in str(e.value)


def test_numbers_of_other_numeric_types_are_normalised():
    p = SamplingParams(n=np.int64(3), temperature=np.float32(0.5), top_p=1, min_p=0, max_tokens=np.int32(7),
                       seed=np.uint32(9), top_k=-1, stop_token_ids=(np.int64(4), 5), stop="</a>",
                       output_kind=1)
    assert (p.n, p.max_tokens, p.seed, p.top_k) == (3, 7, 9, 0)
    assert all(type(x) is int for x in (p.n, p.max_tokens, p.seed, p.top_k))
    assert (p.temperature, p.top_p, p.min_p) == (0.5, 1.0, 0.0)
    assert all(type(x) is float for x in (p.temperature, p.top_p, p.min_p))
    assert p.stop_token_ids == [4, 5] and all(type(t) is int for t in p.stop_token_ids)
    assert p.stop == ["</a>"] and p.output_kind is RequestOutputKind.DELTA


def test_defaults_and_edges_are_accepted():
    p = SamplingParams()
    assert p.temperature == 1.0 and not math.isnan(p.top_p)
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_p=1.0, min_p=1.0, top_k=1, seed=-3, max_tokens=1).seed == -3
