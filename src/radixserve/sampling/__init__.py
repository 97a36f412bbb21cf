"""Sampling parameters, their batched tensor form, and penalties."""

from radixserve.sampling.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
