"""Decoder checkpoints served as embedders (``is_embedding=True``): the normalised final hidden
state of each input's last token, as ``transformers`` computes it (fp32, cos >= 0.99999), through
the same scheduler as generation: batched prefills, prefix reuse and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from tests.engine.conftest import ENGINE_KWARGS, wait_idle
from tests.managers.conftest import make_prompts


def hf_last_token_embeddings(path, prompts: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), output_hidden_states=True)
            rows.append(torch.nn.functional.normalize(out.hidden_states[-1][0, -1], dim=-1))
    return torch.stack(rows)


def assert_close(outs, ref: torch.Tensor) -> None:
    ours = torch.tensor([o["embedding"] for o in outs])
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min().item() >= 0.99999, cos.tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_last_token_pooling_matches_transformers(arch, checkpoint_factory, strict_env):
    path = checkpoint_factory(arch)
    prompts = make_prompts(500, lens=(3, 9, 17, 40, 90))
    with Engine(path, dtype="float32", is_embedding=True, **ENGINE_KWARGS) as engine:
        outs = engine.encode(input_ids=prompts)
        assert_close(outs, hf_last_token_embeddings(path, prompts))
        assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in prompts]
        # The same inputs again reuse their cached prefixes and give the same vectors.
        again = engine.encode(input_ids=prompts)
        assert all(o["meta_info"]["cached_tokens"] == len(p) - 1
                   for o, p in zip(again, prompts, strict=True))
        assert_close(again, hf_last_token_embeddings(path, prompts))
        wait_idle(engine)


def test_chunked_prefill_gives_the_same_embedding(llama_path, strict_env):
    prompts = make_prompts(500, lens=(70, 45), seed=3)
    kwargs = {**ENGINE_KWARGS, "chunked_prefill_size": 16, "disable_radix_cache": True}
    with Engine(llama_path, dtype="float32", is_embedding=True, **kwargs) as engine:
        ref = hf_last_token_embeddings(llama_path, prompts)
        assert_close(engine.encode(input_ids=prompts), ref)
        with pytest.raises(ValueError, match="embedding model"):
            engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})
        wait_idle(engine)

