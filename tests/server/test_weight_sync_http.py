"""RL weight sync through real HTTP: a trainer process (``tests/weight_sync_trainer.py``) makes
a gloo group with a ``--tp-size 2`` server (ranks 1 and 2), broadcasts bad updates, which are
refused with the reason while the old weights keep serving, then a second checkpoint's weights;
the server's greedy output is then that checkpoint's: token for token that of ``transformers``
and of a server started from the second checkpoint, whose logprobs it also gives (the server
from the checkpoint starts while the trainer runs, so it adds little time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.checkpoints import build_checkpoint
from tests.server.conftest import assert_no_leak, free_port, start_server
from tests.server.test_operations_http import PROMPT_IDS, greedy, hf_greedy
from tests.sync import in_background

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama_b(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-llama-b"), "llama", seed=1)


@pytest.fixture(scope="module")
def tp_server(llama_path):
    srv = start_server(llama_path, "--tp-size", "2")
    yield srv
    srv.check_clean_stop()


def greedy_logprobs(client: httpx.Client, n: int = 8) -> tuple[list[int], list[float]]:
    """Greedy output ids and the logprob of each."""
    r = client.post("/generate", json={"input_ids": PROMPT_IDS, "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": n,
                                                           "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    entries = r.json()["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


def test_trainer_broadcast_replaces_the_weights_and_bad_updates_keep_them(
    tp_server, llama_path, llama_b
):
    client = httpx.Client(base_url=tp_server.base_url, timeout=120)
    # The reference: a server started from checkpoint B, as the trainer's ranks are laid out.
    b_server = in_background(start_server, llama_b, "--tp-size", "2")
    try:
        expected_a, expected_b = hf_greedy(llama_path), hf_greedy(llama_b)
        assert expected_a != expected_b
        assert greedy(client) == expected_a
        trainer = subprocess.run(
            [sys.executable, "-m", "tests.weight_sync_trainer", tp_server.base_url, str(llama_b),
             str(free_port()), "3"],
            cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ),
        )
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        replies = json.loads(trainer.stdout.strip().splitlines()[-1])
        assert replies["init"]["status"] == 200, replies["init"]
        refusals = {
            "bad_name": "model.layers.0.mlp.nope.weight",
            "bad_shape": "shape [3, 3]",
            "bad_dtype": "int32",
            "good_then_bad": "lm_head.bias",
        }
        for key, needle in refusals.items():
            reply = replies[key]
            assert reply["status"] == 400, (key, reply)
            assert needle in reply["body"]["error"]["message"], (key, reply)
        assert replies["update"]["status"] == 200, replies["update"]
        assert replies["update"]["body"]["success"] is True
        assert replies["destroy"]["status"] == 200, replies["destroy"]
        assert greedy(client) == expected_b
        synced_ids, synced_logprobs = greedy_logprobs(client)
        with httpx.Client(base_url=b_server.result(300).base_url, timeout=120) as c:
            ids_b, logprobs_b = greedy_logprobs(c)
    finally:
        b_server.result(300).check_clean_stop()
    assert synced_ids == ids_b == expected_b
    assert synced_logprobs == pytest.approx(logprobs_b, abs=1e-5)
    assert_no_leak(client)


def test_weight_sync_refusals_without_a_group(tp_server):
    with httpx.Client(base_url=tp_server.base_url, timeout=60) as c:
        r = c.post("/update_weights_from_distributed", json={
            "names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "none"})
        assert r.status_code == 400 and "no weights update group named 'none'" in r.text
        r = c.post("/destroy_weights_update_group", json={"group_name": "none"})
        assert r.status_code == 400 and "none" in r.text
        init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                "world_size": 3, "backend": "gloo"}
        for change, needle in [
            ({"backend": "nccl"}, "nccl needs CUDA"),
            ({"world_size": 2}, "do not fit in world_size 2"),
            ({"master_address": "no-such-host.invalid"}, "does not resolve"),
            ({"master_address": "0.0.0.0"}, "no host to connect to"),
            ({}, "no torch.distributed store"),  # after the wait for the trainer's store
        ]:
            r = c.post("/init_weights_update_group", json={**init, **change})
            assert r.status_code == 400 and needle in r.text, (change, r.text)
        assert greedy(c) == greedy(c)  # the scheduler was never blocked
        r = c.post("/update_weights_from_distributed", json={
            "names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": "v1"})
        assert r.status_code == 400 and "weight_version" in r.text
