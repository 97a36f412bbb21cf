"""The grammar mask in the sampler: it holds in every decoding mode, after bias and penalties,
and logprobs stay those of the raw logits."""

from __future__ import annotations

import pytest
import torch

from radixserve.constrained.xgrammar_backend import XGrammarBackend
from radixserve.layers.sampler import Sampler
from radixserve.sampling import SamplingParams
from radixserve.sampling.sampling_batch_info import GrammarMask
from tests.sampling.helpers import make_info

VOCAB = 96
ALLOWED = [5, 40, 77]  # the tokens the mask of row 0 allows


def mask_for(batch: int, rows: list[int]) -> GrammarMask:
    bitmask = torch.full((batch, VOCAB // 32), -1, dtype=torch.int32)
    for row in rows:
        bitmask[row] = 0
        for token in ALLOWED:
            bitmask[row, token // 32] |= 1 << (token % 32)
    return GrammarMask(bitmask, rows, XGrammarBackend.apply_bitmask)


def sample(logits, params, output_ids=None, rows=(0,), **kwargs):
    info = make_info(params, VOCAB, output_ids)
    info.grammar_mask = mask_for(len(params), list(rows))
    return Sampler()(logits, info, **kwargs)


MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "sampled": SamplingParams(temperature=1.0, top_p=0.9, sampling_seed=1),
    "top_k_min_p": SamplingParams(temperature=0.7, top_k=50, min_p=0.01, sampling_seed=2),
    "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.9, frequency_penalty=2.0,
                                presence_penalty=2.0),
    "bias_against": SamplingParams(temperature=0.0, logit_bias={5: -100.0, 40: -100.0}),
    "bias_for_forbidden": SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
    "min_tokens_bans_eos": SamplingParams(temperature=0.0, min_new_tokens=10),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_masked_rows_only_sample_allowed_tokens_in_every_mode(mode, dtype):
    logits = (torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    logits[0, 3] = 50.0  # the favourite token is forbidden
    params = [MODES[mode]] * 3
    for seed in range(8):
        out = sample(logits.clone(), params, output_ids=[[5, 40, 40]] * 3, rows=[0])
        assert out.next_token_ids[0].item() in ALLOWED, (mode, seed)
    if MODES[mode].is_greedy and mode != "bias_for_forbidden":
        # The unmasked rows of the batch are what they would be without a grammar.
        info = make_info(params, VOCAB, [[5, 40, 40]] * 3)
        plain = Sampler()(logits.clone(), info).next_token_ids
        assert out.next_token_ids[1:].tolist() == plain[1:].tolist()


def test_grammar_wins_where_the_min_tokens_ban_leaves_it_nothing():
    """Only EOS (id 1) is allowed, and min_new_tokens bans EOS: the grammar decides."""
    logits = torch.randn(1, VOCAB)
    info = make_info([SamplingParams(temperature=0.0, min_new_tokens=5)], VOCAB, [[]])
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    bitmask[0, 0] = 1 << 1
    info.grammar_mask = GrammarMask(bitmask, [0], XGrammarBackend.apply_bitmask)
    assert Sampler()(logits, info).next_token_ids.tolist() == [1]


def test_logprobs_of_constrained_rows_are_the_raw_log_softmax():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    raw = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, sampling_seed=3)]
    out = sample(logits, params, rows=[0, 1], return_logprob=True, top_logprobs_nums=[2, 2])
    assert torch.equal(logits, raw)
    reference = torch.log_softmax(raw, dim=-1)
    for row, token in enumerate(out.next_token_ids.tolist()):
        assert token in ALLOWED
        assert out.logprobs[row].item() == pytest.approx(reference[row, token].item(), abs=1e-6)
        # The top alternatives are the model's, masked or not.
        assert [t for t, _ in out.top_logprobs[row]] == reference[row].topk(2).indices.tolist()
