"""torch.distributed collectives and point-to-point transfers over gloo, in two real ranks."""

from __future__ import annotations

import torch

from radixserve.distributed import RankInfo, init_parallel_state
from radixserve.managers import io_struct
from radixserve.managers.io_struct import AbortReq, CloseSessionReqInput
from tests.distributed.helpers import run_ranks


def _tp_collectives(rank: int, init_method: str) -> dict:
    parallel = init_parallel_state(
        RankInfo.of_rank(rank, tp_size=2, pp_size=1), init_method, torch.device("cpu"), 60
    )
    tp = parallel.tp
    summed = tp.all_reduce(torch.full((3,), float(rank + 1))).tolist()
    gathered = tp.all_gather(torch.tensor([[rank, 10 + rank]]), dim=-1).tolist()
    broadcast = tp.broadcast(torch.tensor([rank * 7 + 1])).tolist()
    msgs = [AbortReq(rid="r1"), CloseSessionReqInput(session_id="s")]
    data = io_struct.encode_batch(msgs) if rank == 0 else None
    received = io_struct.decode_batch(tp.broadcast_bytes(data))
    empty = tp.broadcast_bytes(b"" if rank == 0 else None)
    torch.distributed.barrier()
    return {
        "summed": summed, "gathered": gathered, "broadcast": broadcast,
        "received": [type(m).__name__ for m in received], "same": received == msgs,
        "empty": empty.decode(),
    }


def test_tensor_parallel_group_reduces_gathers_and_broadcasts_msgspec_bytes():
    results = run_ranks("tests.distributed.test_communication:_tp_collectives", 2)
    for r in results:
        assert r["summed"] == [3.0, 3.0, 3.0]
        assert r["gathered"] == [[0, 10, 1, 11]]
        assert r["broadcast"] == [1]  # rank 0's value everywhere
        assert r["received"] == ["AbortReq", "CloseSessionReqInput"] and r["same"]
        assert r["empty"] == ""


def _pipeline_p2p(rank: int, init_method: str) -> dict:
    parallel = init_parallel_state(
        RankInfo.of_rank(rank, tp_size=1, pp_size=2), init_method, torch.device("cpu"), 60
    )
    p2p, info = parallel.p2p, parallel.info
    assert p2p is not None and parallel.tp.size == 1
    other = info.stage_rank(info.pp_rank + 1)
    # Both ranks send before either receives (the pipeline's ring): sends must not block, and
    # messages of one kind arrive in order.
    big = torch.arange(200_000, dtype=torch.float32) + rank
    p2p.send_tensor(big, other)
    for i in range(3):
        p2p.send_bytes(f"{rank}:{i}".encode(), other)
    p2p.send_bytes(b"", other)
    got = p2p.recv_tensor((200_000,), torch.float32, torch.device("cpu"), other)
    texts = [p2p.recv_bytes(other).decode() for _ in range(4)]
    torch.distributed.barrier()  # neither rank exits while its sends are still in flight
    return {"first": got[0].item(), "last": got[-1].item(), "texts": texts}


def test_pipeline_stages_exchange_tensors_and_bytes_both_ways_at_once():
    results = run_ranks("tests.distributed.test_communication:_pipeline_p2p", 2)
    for rank, r in enumerate(results):
        other = 1 - rank
        assert r["first"] == other and r["last"] == 199_999 + other
        assert r["texts"] == [f"{other}:0", f"{other}:1", f"{other}:2", ""]
