"""SGLang's LoRA flags parse into ``ServerArgs``, and combinations that cannot work are refused
before any process starts."""

from __future__ import annotations

import pytest

from radixserve.cli import build_parser, server_args_from_namespace
from radixserve.server_args import ServerArgs


def _args(*argv: str) -> ServerArgs:
    return server_args_from_namespace(build_parser().parse_args(["serve", "--model-path", "m",
                                                                 *argv]))


def test_lora_flags_parse_with_sglangs_names():
    args = _args("--lora-paths", "a=/x/a", "/x/b", "--max-loras-per-batch", "3",
                 "--max-lora-rank", "32", "--lora-target-modules", "q_proj", "v_proj")
    assert args.enable_lora  # implied by --lora-paths, as in SGLang
    assert args.lora_path_map == {"a": "/x/a", "/x/b": "/x/b"}
    assert (args.max_loras_per_batch, args.max_lora_rank) == (3, 32)
    assert args.lora_target_modules == ["q_proj", "v_proj"]
    assert not _args().enable_lora


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_lora_rank": 8}, "max_lora_rank need --enable-lora"),
    ({"enable_lora": True, "is_embedding": True}, "generation models"),
    ({"lora_paths": ["a=/x", "a=/y"]}, "names an adapter twice"),
    ({"lora_paths": ["a=/x", "b=/y"], "max_loras_per_batch": 1}, "at most 1 are loaded at once"),
    ({"enable_lora": True, "lora_target_modules": ["lm_head"]}, "'lm_head' is not one of"),
    ({"enable_lora": True, "max_loras_per_batch": 0}, "max_loras_per_batch must be >= 1"),
    ({"lora_paths": ["=/x"]}, "is not NAME=PATH or PATH"),
])
def test_impossible_lora_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="m", **kwargs)
