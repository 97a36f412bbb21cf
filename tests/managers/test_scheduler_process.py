"""The scheduler as its own process: JSON ready message, ZMQ in and out, clean SIGTERM exit."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shutil

import pytest
import zmq

from radixserve.managers import ipc
from radixserve.managers.io_struct import (
    BatchTokenIDOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
)
from radixserve.managers.launcher import stop_process
from radixserve.managers.scheduler.scheduler_process import run_scheduler_process, scheduler_threads
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def _recv(sock: zmq.Socket, timeout_ms: int = 60_000):
    assert sock.poll(timeout_ms), "no message from the scheduler process"
    return ipc.recv_nowait(sock)


def test_scheduler_process_serves_over_zmq_and_exits_cleanly_on_sigterm(llama_path):
    server_args = ServerArgs(model_path=str(llama_path), device="cpu", max_total_tokens=256)
    port_args = ipc.PortArgs.create()
    ctx = zmq.Context()
    from_scheduler = ipc.pull_socket(ctx, port_args.detokenizer_input)
    replies = ipc.pull_socket(ctx, port_args.tokenizer_input)
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(
        target=run_scheduler_process,
        args=(json.dumps(dataclasses.asdict(server_args)),
              json.dumps(dataclasses.asdict(port_args)), writer),
    )
    proc.start()
    try:
        writer.close()
        assert reader.poll(120), "the scheduler process did not report ready"
        info = json.loads(reader.recv_bytes())
        assert info == {"status": "ready", "max_total_num_tokens": 256,
                        "max_running_requests": 256, "context_len": 1024, "page_size": 1}

        to_scheduler = ipc.push_socket(ctx, port_args.scheduler_input)
        ipc.send(to_scheduler, TokenizedGenerateReqInput(
            rid="r", input_ids=[6, 7, 8, 9],
            sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
        [out] = _recv(from_scheduler)
        assert isinstance(out, BatchTokenIDOutput)
        assert out.outputs[0].rid == "r" and len(out.outputs[0].new_token_ids) == 3

        ipc.send(to_scheduler, GetInternalStateReq())
        [state] = _recv(replies)
        assert isinstance(state, GetInternalStateReqOutput)
        assert state.state["last_leak_check"]["ok"]

        stop_process(proc)  # how a parent stops a child (it ignores SIGTERM)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ctx.destroy(linger=0)
        shutil.rmtree(port_args.directory, ignore_errors=True)


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("1", 1), ("3", 3), ("0", None), ("two", None), ("-1", None),
])
def test_scheduler_threads_follow_omp_num_threads_else_allowed_cpus(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert scheduler_threads() == (expected or len(os.sched_getaffinity(0)))
