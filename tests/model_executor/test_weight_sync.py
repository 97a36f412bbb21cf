"""``model_executor/weight_sync.py`` without a server: the shared-memory hand-over keeps every
byte, dtype and shape; the checks name the tensor at fault; a broadcast through a group made by
``init_custom_process_group`` (trainer rank 0 and an engine rank, two processes) arrives whole."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from radixserve.model_executor.weight_sync import (
    WeightsUpdateGroups,
    check_named_tensors,
    init_custom_process_group,
    parse_dtype,
    tensors_from_shared_memory,
    tensors_to_shared_memory,
)


def test_shared_memory_round_trip_keeps_bytes_dtypes_and_shapes():
    torch.manual_seed(0)
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)),
             ("c", torch.randn(2, 2, 2).half()), ("d", torch.arange(6).view(2, 3))]
    block, layout = tensors_to_shared_memory(named)
    try:
        back = tensors_from_shared_memory(block.name, layout, torch.device("cpu"))
    finally:
        block.close()
        block.unlink()
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(named, back, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_checks_name_the_tensor_at_fault():
    shapes = {"w": [2, 3]}
    check_named_tensors([("w", torch.zeros(2, 3))], shapes)
    for named, needle in [([("v", torch.zeros(2, 3))], "'v' is not a weight"),
                          ([("w", torch.zeros(3, 2))], "shape [3, 2]"),
                          ([("w", torch.zeros(2, 3, dtype=torch.int64))], "int64")]:
        with pytest.raises(ValueError) as info:
            check_named_tensors(named, shapes)
        assert needle in str(info.value)
    assert parse_dtype("torch.bfloat16") is torch.bfloat16 and parse_dtype("int32") is torch.int32
    with pytest.raises(ValueError, match="not a torch dtype"):
        parse_dtype("float33")


def _engine_rank(port: int, queue: mp.Queue) -> None:
    groups = WeightsUpdateGroups(0, 1, torch.device("cpu"))
    groups.init_group("127.0.0.1", port, 1, 2, "g", "gloo")
    queue.put(groups.receive(["x", "y"], ["float32", "bfloat16"], [[2, 2], [3]], "g"))
    groups.destroy_group("g")


def test_broadcast_through_a_custom_group_arrives_whole():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    engine = ctx.Process(target=_engine_rank, args=(port, queue))
    engine.start()
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "g")
    sent = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0.5, 1.5, 2.5]).bfloat16()]
    for tensor in sent:
        torch.distributed.broadcast(tensor, src=0, group=group)
    received = queue.get(timeout=120)
    engine.join(timeout=60)
    torch.distributed.destroy_process_group(group)
    assert engine.exitcode == 0
    assert [n for n, _ in received] == ["x", "y"]
    for want, (_, got) in zip(sent, received, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
