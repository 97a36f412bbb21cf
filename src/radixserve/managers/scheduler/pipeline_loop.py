"""The scheduler loop of pipeline parallelism (SGLang's ``event_loop_pp``).

Every stage runs a ``Scheduler`` on the same messages; the running requests are split into
``pp_size`` micro-batches, each with its own running batch, so that while stage s computes one
micro-batch, stage s - 1 already computes the next. One round of the loop visits the
micro-batches in order; on every stage, iteration ``i`` (micro-batch ``m = i % pp_size``) is:

    1. receive the step's messages and process them       (RequestReceiver: ZMQ on rank 0,
                                                            then stage to stage)
    2. schedule micro-batch m's next batch and launch it  (stage s > 0 receives the activations
                                                            of stage s - 1 for it; stage s <
                                                            last sends its own on; the last
                                                            stage samples and sends the tokens
                                                            to stage 0)
    3. process the result of micro-batch m + 1, launched  (the last stage has it; stage 0
       one round earlier                                   receives it from the last stage and
                                                            hands it on, stage by stage)

Steps 1 and 3 change scheduler state identically on every stage, in the same order, so the
stages keep taking the same decisions; a micro-batch's next batch is always planned after its
previous result was processed. With two stages, stage 0 computes micro-batch m + 1 while stage 1
computes m: each stage waits only for what it consumes. All sends are non-blocking
(``distributed.PointToPoint``); messages between two ranks arrive in the order they were sent.

A request belongs to one micro-batch from its prefill to its end; the chunked request's next
chunk waits until its previous chunk's result was processed (``Scheduler._chunk_in_flight``).

A peer of ``NormalLoop`` and ``OverlapLoop`` (``scheduler_loop.py``): ``run_step`` is one
iteration (steps 2-3) of the next micro-batch, and a round of ``run_forever`` visits each once.
"""

from __future__ import annotations

import torch

from radixserve.distributed import PointToPoint, RankInfo
from radixserve.layers.sampler import InputLogprobs, SampleOutput
from radixserve.managers import io_struct
from radixserve.managers.io_struct import StageInputLogprobs, StageResult
from radixserve.managers.scheduler.scheduler_loop import LoopScheduler, SchedulerLoop


class PipelineLoop(SchedulerLoop):
    def __init__(
        self,
        scheduler: LoopScheduler,
        watchdog_timeout: float,
        info: RankInfo,
        p2p: PointToPoint,
        device: torch.device,
    ) -> None:
        super().__init__(scheduler, watchdog_timeout)
        assert info.pp_size > 1
        self.info = info
        self.p2p = p2p
        self.device = device
        self.steps_per_round = info.pp_size
        self._next_mb = 0  # the micro-batch of the next iteration
        self._own_results: dict[int, SampleOutput] = {}  # last stage: sampled, not processed

    def run_step(self) -> bool:
        """One iteration, of the next micro-batch in turn; whether a batch was launched."""
        mb_id, self._next_mb = self._next_mb, (self._next_mb + 1) % self.info.pp_size
        return self.iteration(mb_id)

    def on_idle_round(self) -> None:
        self.scheduler.on_idle()

    def iteration(self, mb_id: int) -> bool:
        """Steps 2-3 of the module docstring; whether a batch was launched."""
        scheduler = self.scheduler
        micro_batches = scheduler.micro_batches
        micro_batches.select(mb_id)
        scheduler.begin_step()
        batch = scheduler.get_next_batch_to_run()
        if batch is not None:
            micro_batches.launch(mb_id, batch)
            result = scheduler.run_batch(batch)
            if self.info.is_last_stage:
                assert result is not None
                self._own_results[mb_id] = result
                self.p2p.send_bytes(_encode(result), self.info.stage_rank(0))
        next_id = (mb_id + 1) % self.info.pp_size
        launched = micro_batches.take_in_flight(next_id)
        if launched is not None:
            result = self._take_result(next_id)
            scheduler.process_batch_result(launched, result)
        return batch is not None

    def _take_result(self, mb_id: int) -> SampleOutput:
        """Micro-batch ``mb_id``'s tokens: the last stage's own, or received from the stage
        before (round the ring: stage 0 hears from the last) and passed on to the next stage
        unless that is the last one, which has them already."""
        info = self.info
        if info.is_last_stage:
            return self._own_results.pop(mb_id)
        data = self.p2p.recv_bytes(info.stage_rank(info.pp_rank - 1))
        if info.pp_rank + 1 < info.pp_size - 1:
            self.p2p.send_bytes(data, info.stage_rank(info.pp_rank + 1))
        return _decode(io_struct.decode_stage_result(data), self.device)


def _encode(result: SampleOutput) -> bytes:
    inputs = result.input_logprobs
    next_token_ids, logprobs = result.to_host()
    return io_struct.encode(
        StageResult(
            next_token_ids=next_token_ids,
            logprobs=logprobs,
            top_logprobs=result.top_logprobs,
            token_ids_logprobs=result.token_ids_logprobs,
            input_logprobs=(
                [StageInputLogprobs(x.values, x.top, x.token_ids) for x in inputs]
                if inputs is not None
                else None
            ),
        )
    )


def _decode(msg: StageResult, device: torch.device) -> SampleOutput:
    return SampleOutput(
        next_token_ids=torch.tensor(msg.next_token_ids, dtype=torch.int64, device=device),
        logprobs=(
            torch.tensor(msg.logprobs, dtype=torch.float32, device=device)
            if msg.logprobs is not None
            else None
        ),
        top_logprobs=msg.top_logprobs,
        token_ids_logprobs=msg.token_ids_logprobs,
        input_logprobs=(
            [InputLogprobs(x.values, x.top, x.token_ids) for x in msg.input_logprobs]
            if msg.input_logprobs is not None
            else None
        ),
    )
