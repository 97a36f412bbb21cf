"""Adapters over int8 base weights: a compressed-tensors W8A16 checkpoint (int8 weights read by
radixserve's int8 kernels) with a PEFT adapter computes what ``peft`` computes over the
transformers model that decompresses the same checkpoint, for a batch mixing the adapter and the
base model. The LoRA hooks add their delta to whatever the quantised linear returns."""

from __future__ import annotations

import torch

from tests.lora.adapters import make_adapter
from tests.model_executor.harness import ManualSlots, make_runner
from tests.quantized_checkpoints import build_w8a16_checkpoint

PROMPTS = [[5, 9, 30, 41, 7, 100, 3], [8, 2, 77], [44, 45, 46, 47, 48]]


def _peft_last_logits(base, adapter, prompts, with_adapter):
    import peft
    import transformers

    # decompressed to float weights (peft adapts nn.Linear layers, not compressed ones)
    decompress = transformers.CompressedTensorsConfig(run_compressed=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, quantization_config=decompress
    ).eval()
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for prompt, adapted in zip(prompts, with_adapter, strict=True):
            ids = torch.tensor([prompt])
            if adapted:
                out.append(model(ids).logits[0, -1].float())
            else:
                with model.disable_adapter():
                    out.append(model(ids).logits[0, -1].float())
    return torch.stack(out)


def test_an_adapter_over_int8_weights_matches_peft_over_the_decompressed_model(
    llama_path, tmp_path
):
    w8a16 = build_w8a16_checkpoint(llama_path, tmp_path / "w8a16")
    adapter = make_adapter(llama_path, tmp_path / "adapter", 8,
                           ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], seed=21)
    runner = make_runner(w8a16, dtype="float32", enable_lora=True, lora_paths=[f"a={adapter}"],
                         max_lora_rank=8, max_loras_per_batch=2)
    assert runner.model.model.layers[0].self_attn.qkv_proj.weight_packed.dtype == torch.int32
    slot = runner.lora.slot_of["a"]
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in PROMPTS]
    batch = slots.extend(seqs, PROMPTS)
    batch.lora_slots = [slot, -1, slot]
    got = runner.forward(batch).float()
    expected = _peft_last_logits(w8a16, adapter, PROMPTS, [True, False, True])
    # the int8 kernel's int16 activations round at 1/65534 of a row's largest value
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    base = _peft_last_logits(w8a16, adapter, PROMPTS[:1], [False])
    assert (got[0] - base[0]).abs().max() > 0.05  # the adapter changes the output
