"""GenerateReqInput.normalize: shapes, defaults and the errors users see."""

from __future__ import annotations

import pytest

from radixserve.managers.tokenizer.generate_request import GenerateReqInput


def test_single_text_gets_rid_and_empty_sampling_params():
    obj = GenerateReqInput(text="hi")
    obj.normalize()
    assert obj.is_single and obj.batch_size == 1
    assert isinstance(obj.rid, str) and len(obj.rid) == 32
    assert obj.sampling_params == {}


def test_batch_broadcasts_sampling_params_and_generates_unique_rids():
    obj = GenerateReqInput(input_ids=[[1, 2], [3]], sampling_params={"temperature": 0})
    obj.normalize()
    assert not obj.is_single and obj.batch_size == 2
    assert obj.sampling_params == [{"temperature": 0}, {"temperature": 0}]
    assert obj.sampling_params[0] is not obj.sampling_params[1]
    assert len(set(obj.rid)) == 2
    assert obj[1].input_ids == [3] and obj[1].rid == obj.rid[1]


def test_single_input_ids_list_is_one_prompt():
    obj = GenerateReqInput(input_ids=[5, 6, 7], rid="r")
    obj.normalize()
    assert obj.is_single and obj.rid == "r"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of text"),
        ({"text": "a", "input_ids": [1]}, "exactly one of text"),
        ({"text": ["a", 1]}, "text must be a string"),
        ({"input_ids": [1, "2"]}, "integer token ids"),
        ({"input_ids": [[1], [True]]}, "integer token ids"),
        ({"text": []}, "at least one prompt"),
        ({"text": ["a", "b"], "rid": ["x"]}, "list of 2 strings"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "unique"),
        ({"text": "a", "rid": ["x"]}, "1 to 256 printable characters"),
        ({"text": "a", "rid": ""}, "1 to 256 printable characters"),
        ({"text": "a", "rid": "x" * 257}, r"\(257 characters\)"),
        ({"text": "a", "rid": "line\nbreak"}, "printable"),
        ({"text": ["a", "b"], "rid": ["x", 5]}, r"rid\[1\] must be"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "list of 2 for 2 prompt"),
        ({"text": "a", "sampling_params": [{}]}, "must be a dict"),
        ({"text": "a", "sampling_params": [{"n": 2}, {"n": 3}]}, "the same"),
        ({"text": "a", "sampling_params": {"n": 0}}, "positive integer"),
        # Unhashable values were a 500 (TypeError), found by the schemathesis fuzz.
        ({"text": "a", "sampling_params": {"n": [2]}}, "positive integer"),
        ({"text": ["a", "b"], "sampling_params": [{"n": {}}, {"n": 1}]}, "positive integer"),
        ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "a", "token_ids_logprob": ["x"]}, "token_ids_logprob"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_bad_shapes_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerateReqInput(**kwargs).normalize()
