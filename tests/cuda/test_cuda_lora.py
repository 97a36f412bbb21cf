"""CUDA graphs with LoRA on the GPU: decode batches mixing adapters and the base model replay
the captured graphs (the rows' adapter slots are graph inputs, ``lora/graph_inputs.py``) and
give the eager forward's logits and greedy tokens, at padded batch sizes and after the mix of
adapters changes between steps. The adapters are written here (PEFT's file layout, random
non-zero A and B), so the GPU machine needs no ``peft``."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.cuda.helpers import HEAD_DIM_64, ON_CUDA, DeviceSlots, make_runner, requires_device

pytestmark = requires_device

_SHAPES = {  # module: (in, out) of the head_dim-64 test Llama
    "q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
    "gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256),
}
_LAYERS = 2


def _write_adapter(folder: Path, rank: int, targets: list[str], seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(_LAYERS):
        for module in targets:
            fan_in, fan_out = _SHAPES[module]
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.1
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.1
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "bias": "none", "lora_dropout": 0.0,
    }))
    return folder


def test_graphed_decode_with_mixed_adapters_equals_eager(llama64_path, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llama64_path)
    assert config.num_hidden_layers == _LAYERS and config.hidden_size == HEAD_DIM_64[
        "hidden_size"]
    paths = [
        f"attn={_write_adapter(tmp_path / 'attn', 4, ['q_proj', 'k_proj', 'v_proj', 'o_proj'], 1)}",
        f"mlp={_write_adapter(tmp_path / 'mlp', 8, ['gate_proj', 'up_proj', 'down_proj'], 2)}",
        f"mixed={_write_adapter(tmp_path / 'mixed', 2, ['q_proj', 'down_proj'], 3)}",
    ]
    runner = make_runner(llama64_path, max_running_requests=8, enable_lora=True,
                         lora_paths=paths, max_loras_per_batch=3, max_lora_rank=8)
    graphs = runner.graph_runner
    if ON_CUDA:
        assert graphs is not None and graphs.lora_inputs is not None
        assert runner.cuda_graph_batch_sizes == [1, 2, 4, 8]
    slot = runner.lora.slot_of
    per_req = [slot["attn"], -1, slot["mlp"], slot["mixed"], slot["attn"], -1, slot["mlp"]]
    rng = random.Random(4)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (9, 30, 4, 17, 2, 12, 25)]
    slots = DeviceSlots(runner)
    seqs = [slots.new_seq() for _ in prompts]
    logits = runner.forward(dataclasses.replace(slots.extend(seqs, prompts), lora_slots=per_req))
    for step in range(6):
        # 7 requests (padded to 8), 6, 5 (padded to 8), 3 (to 4); the last steps reverse the mix
        live = [7, 6, 5, 3, 3, 2][step]
        mix = per_req[:live] if step < 4 else list(reversed(per_req[:live]))
        fb = dataclasses.replace(
            slots.decode(seqs[:live], logits[:live].argmax(-1).tolist()), lora_slots=mix)
        graphed = runner.forward(fb).clone()
        runner.graph_runner = None
        try:
            eager = runner.forward(fb)  # rewrites the same KV slots with the same values
            base = runner.forward(dataclasses.replace(fb, lora_slots=None))
        finally:
            runner.graph_runner = graphs
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=0)
        assert graphed.argmax(-1).tolist() == eager.argmax(-1).tolist()
        differs = ((graphed - base).abs().amax(-1) > 1e-4).tolist()
        assert differs == [s >= 0 for s in mix], (step, mix)
        logits = graphed
