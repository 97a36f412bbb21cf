"""A stand-in RL trainer, run as its own process (``python -m tests.weight_sync_trainer``):
it makes the weights update group with a radixserve server over real HTTP, as verl and OpenRLHF
do (each request posted from a thread while this process does its side of the collective),
broadcasts bad updates (wrong name, shape, dtype; a good tensor followed by a bad one), then the
whole checkpoint given, then leaves the group. It prints each reply as one JSON object.

argv: server URL, checkpoint directory, master port, world size (1 + the engine's ranks).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from radixserve.model_executor.weight_sync import dtype_name, init_custom_process_group

GROUP = "trainer_group"
NAME = "model.layers.0.mlp.down_proj.weight"


def main(url: str, checkpoint: str, port: int, world_size: int) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        tensors.update(load_file(file))
    client = httpx.Client(base_url=url, timeout=300)
    pool = ThreadPoolExecutor(1)

    def post(route: str, body: dict) -> dict:
        r = client.post(route, json=body)
        return {"status": r.status_code, "body": r.json()}

    replies = {}
    init = pool.submit(post, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
        "world_size": world_size, "group_name": GROUP, "backend": "gloo"})
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size, 0, GROUP)
    replies["init"] = init.result()

    def update(names: list[str], dtypes: list[str], shapes: list[list[int]],
               sent: list[torch.Tensor]) -> dict:
        reply = pool.submit(post, "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": GROUP})
        for tensor in sent:
            dist.broadcast(tensor, src=0, group=group)
        return reply.result()

    good = tensors[NAME]
    shape = list(good.shape)
    replies["bad_name"] = update(["model.layers.0.mlp.nope.weight"], ["float32"], [shape],
                                 [good])
    replies["bad_shape"] = update([NAME], ["float32"], [[3, 3]], [torch.zeros(3, 3)])
    replies["bad_dtype"] = update([NAME], ["int32"], [shape],
                                  [torch.zeros(shape, dtype=torch.int32)])
    replies["good_then_bad"] = update([NAME, "lm_head.bias"], ["float32", "float32"],
                                      [shape, [4]], [good, torch.zeros(4)])
    names = sorted(tensors)
    replies["update"] = update(names, [dtype_name(tensors[n].dtype) for n in names],
                               [list(tensors[n].shape) for n in names],
                               [tensors[n].contiguous() for n in names])
    destroy = pool.submit(post, "/destroy_weights_update_group", {"group_name": GROUP})
    dist.destroy_process_group(group)
    replies["destroy"] = destroy.result()
    print(json.dumps(replies), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
