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
"""

from __future__ import annotations

import torch

from radixserve.layers.sampler import InputLogprobs, SampleOutput
from radixserve.managers import io_struct
from radixserve.managers.io_struct import StageInputLogprobs, StageResult
from radixserve.managers.scheduler.request_receiver import RequestReceiver
from radixserve.managers.scheduler.scheduler import IDLE_POLL_MS, Scheduler
from radixserve.managers.scheduler.watchdog import Watchdog


class PipelineLoop:
    def __init__(self, scheduler: Scheduler, receiver: RequestReceiver) -> None:
        self.scheduler = scheduler
        self.receiver = receiver
        self.info = scheduler.parallel.info
        assert scheduler.parallel.p2p is not None and self.info.pp_size > 1
        self.p2p = scheduler.parallel.p2p
        self.device = scheduler.tp_worker.model_runner.device
        self._own_results: dict[int, SampleOutput] = {}  # last stage: sampled, not processed

    def run(self) -> None:
        """Run forever; an idle round blocks on the input (rank 0) instead of spinning. The
        watchdog ends the process if steps 2-3 of one iteration hang for
        ``--watchdog-timeout`` seconds."""
        watchdog = Watchdog(self.scheduler.settings.watchdog_timeout)
        watchdog.start()
        while True:
            busy = False
            for mb_id in range(self.info.pp_size):
                self.scheduler.process_input_requests(self.receiver.recv())
                watchdog.step_started()
                busy |= self.iteration(mb_id)
                watchdog.step_finished()
            self.scheduler.report_load()
            if not busy:
                self.scheduler.on_idle()
                self.receiver.wait(IDLE_POLL_MS)

    def iteration(self, mb_id: int) -> bool:
        """Steps 2-3 of the module docstring; whether a batch was launched."""
        sched = self.scheduler
        mb = sched.select_micro_batch(mb_id)
        sched.begin_step()
        batch = sched.get_next_batch_to_run()
        if batch is not None:
            if any(other.in_flight is not None for other in sched.micro_batches):
                sched.num_pipelined_steps += 1
            mb.in_flight = batch
            result = sched.run_batch(batch)
            if self.info.is_last_stage:
                assert result is not None
                self._own_results[mb_id] = result
                self.p2p.send_bytes(_encode(result), self.info.stage_rank(0))
        next_id = (mb_id + 1) % self.info.pp_size
        launched = sched.micro_batches[next_id].in_flight
        if launched is not None:
            result = self._take_result(next_id)
            sched.select_micro_batch(next_id).in_flight = None
            sched.process_batch_result(launched, result)
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
    return io_struct.encode(
        StageResult(
            next_token_ids=result.next_token_ids.tolist(),
            logprobs=result.logprobs.tolist() if result.logprobs is not None else None,
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
