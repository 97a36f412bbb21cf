"""PEFT adapters for the LoRA tests, made here with ``peft`` on the tiny random checkpoints.

PEFT initialises B to zero (an adapter that changes nothing); these adapters get random non-zero
A and B (fixed seed) so that every adapted module changes the output."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


def make_adapter(base: Path, out: Path, rank: int, targets: list[str], seed: int,
                 alpha: float = 16, use_rslora: bool = False) -> Path:
    """Write a PEFT adapter folder for the checkpoint at ``base`` and return it."""
    import peft
    import transformers

    if (out / "adapter_config.json").exists():
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             use_rslora=use_rslora, lora_dropout=0.0)
    lora_model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    lora_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompt_ids: list[int],
                max_new_tokens: int) -> list[int]:
    """Greedy fp32 continuation by ``transformers`` with ``peft``'s adapter applied (``None``:
    the base model). Memoised: the tests of the plain and the overlap schedule ask the same."""
    return list(_peft_greedy(base, adapter, tuple(prompt_ids), max_new_tokens))


@functools.lru_cache(maxsize=256)
def _peft_greedy(base: Path, adapter: Path | None, prompt_ids: tuple[int, ...],
                 max_new_tokens: int) -> tuple[int, ...]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=2)
    return tuple(out[0, len(prompt_ids):].tolist())
