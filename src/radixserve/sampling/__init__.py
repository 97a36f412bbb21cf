"""Sampling parameters, their batched tensor form, and penalties.

Only ``SamplingParams`` is exported here: it is imported by every process (IPC messages), and
exporting ``SamplingBatchInfo`` would load torch into the tokenizer/HTTP processes too. Import
``radixserve.sampling.sampling_batch_info`` directly where tensors are needed.
"""

from radixserve.sampling.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
