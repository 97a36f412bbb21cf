"""SamplingParams parsing and validation: every bad value is a ValueError naming its field."""

from __future__ import annotations

import math

import pytest

from radixserve.sampling import SamplingParams

BAD_VALUES = [
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", 0),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("presence_penalty", 3.0),
    ("presence_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-40),  # a float32 denormal: positive logits / it overflow
    ("repetition_penalty", 2.5),
    ("max_new_tokens", -1),
    ("min_new_tokens", -1),
    ("stop", [""]),
]

WRONG_TYPES = [
    ("temperature", "hot"),
    ("temperature", True),
    ("top_p", [0.5]),
    ("top_k", 1.5),
    ("max_new_tokens", "many"),
    ("ignore_eos", "yes"),
    ("stop", 5),
    ("stop_token_ids", 3),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"one": 1.0}),
    ("sampling_seed", "lucky"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES + WRONG_TYPES)
def test_from_dict_rejects_bad_value_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_validate_rejects_bad_value_naming_the_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_from_dict_rejects_unknown_key_naming_it():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_min_new_tokens_above_max_new_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams.from_dict({"min_new_tokens": 10, "max_new_tokens": 5})


@pytest.mark.parametrize("bias", [math.nan, math.inf, -math.inf, 1e39, -1e31])
def test_non_finite_logit_bias_is_rejected(bias):
    """Also finite values that float32 logits cannot hold once divided by a temperature."""
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"3": bias}})


def test_token_ids_outside_vocabulary_are_rejected_when_vocab_known():
    SamplingParams(stop_token_ids=[99], logit_bias={99: 1.0}).validate()
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[5, 100]).validate(vocab_size=100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0}).validate(vocab_size=100)


def test_from_dict_normalises_user_input():
    params = SamplingParams.from_dict(
        {"stop": "###", "logit_bias": {"7": 2}, "temperature": 0, "max_new_tokens": None}
    )
    assert params.stop == ["###"]
    assert params.logit_bias == {7: 2.0}
    assert params.max_new_tokens == SamplingParams().max_new_tokens
    assert params.is_greedy
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_top_k_one_is_greedy_whatever_the_temperature():
    assert SamplingParams(temperature=1.0, top_k=1).is_greedy
    assert not SamplingParams(temperature=1.0, top_k=2).is_greedy
