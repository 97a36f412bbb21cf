"""The GPU path's flags (SGLang's names): CUDA graphs, the triton attention backend, and the
overlap schedule that is the default on CUDA only."""

from __future__ import annotations

import pytest

from radixserve.cli import build_parser, server_args_from_namespace
from radixserve.server_args import ServerArgs


def _args(*flags: str) -> ServerArgs:
    return server_args_from_namespace(build_parser().parse_args(["serve", "--model-path", "m",
                                                                 *flags]))


def test_cuda_graph_and_backend_flags_parse():
    args = _args("--disable-cuda-graph", "--cuda-graph-max-bs", "48",
                 "--attention-backend", "triton")
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 48
    assert args.attention_backend == "triton"
    defaults = _args()
    assert not defaults.disable_cuda_graph and defaults.cuda_graph_max_bs is None


def test_overlap_schedule_is_the_default_on_cuda_only():
    assert _args().overlap_schedule_on("cuda")
    assert not _args().overlap_schedule_on("cpu")
    assert _args("--enable-overlap-schedule").overlap_schedule_on("cpu")
    assert not _args("--disable-overlap-schedule").overlap_schedule_on("cuda")
    assert not _args("--pp-size", "2").overlap_schedule_on("cuda")  # pipelines overlap stages
    with pytest.raises(ValueError, match="not both"):
        _args("--enable-overlap-schedule", "--disable-overlap-schedule")
