"""Detokenizer process: token ids from the scheduler → UTF-8-safe text deltas for the tokenizer.

Data flow per request (``rid``)::

    ReqTokenOutput(new_token_ids, finished_reason)      from the scheduler
        │  IncrementalDetokenizer.begin() ... finish()
        ▼
    ReqStrOutput(new_text = the part of the text no client has seen yet)   to the TokenizerManager

A scheduler step's outputs are decoded together: every request's pending id lists go to the
tokenizer in one batch call (per decoding option), not two Python-level ``decode`` calls per
request and step, whose overhead would be paid on every streamed token.

Two things are held back from ``new_text`` until they are safe to show:

* a tail that decodes to U+FFFD: a multi-byte character split across tokens (byte-level BPE)
  is emitted once its last byte arrives, never as a replacement character mid-stream;
* a tail that could be the start of a stop string: the scheduler finishes the request when the
  stop string completes, and the text is then cut where it begins, so it never leaks.

At finish everything still held is flushed (cut at the stop string when it matched), and the
request's state is dropped. A ``stop_regex`` match cuts the text where the match begins; text
streamed before the match completed cannot be held back (a regex has no fixed prefixes), so a
stream may already have shown its start.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from radixserve.finish_reason import FinishReason, FinishStop
from radixserve.managers import io_struct, ipc
from radixserve.managers.child_process import install_exit_handlers, report_failure, report_ready
from radixserve.managers.io_struct import BatchStrOutput, BatchTokenIDOutput, ReqStrOutput
from radixserve.sampling.stop_regex import match_start
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's growing token ids into text deltas.

    Decoding uses two offsets into ``ids`` (the scheme of vLLM/SGLang): ``prefix_offset`` marks a
    few already-emitted tokens decoded again as context (so tokenizers that look at neighbours,
    e.g. SentencePiece leading spaces, decode consistently) and ``read_offset`` marks the end of
    what has been turned into text. The text of ``ids[prefix_offset:]`` minus the text of
    ``ids[prefix_offset:read_offset]`` is the new text.

    ``text[:sent]`` has been emitted; ``text[sent:]`` is held back (a possible stop-string start).

    ``step`` decodes with ``decode``; a batch of detokenizers instead runs ``begin`` (the id lists
    to decode), decodes all of them at once, and hands each its texts with ``finish``.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str] | None = None,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        stop_regex: Sequence[str] = (),
    ) -> None:
        self._decode = decode
        self._finished_reason: FinishReason | None = None
        self._stop = [s for s in stop if s]
        self._stop_regex = list(stop_regex)
        self._no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.sent = 0

    def step(self, new_ids: Sequence[int], finished_reason: FinishReason | None) -> str:
        """Add ``new_ids``; return the text that became safe to emit (all of it at finish)."""
        assert self._decode is not None, "step needs a decode function"
        return self.finish([self._decode(ids) for ids in self.begin(new_ids, finished_reason)])

    def begin(
        self, new_ids: Sequence[int], finished_reason: FinishReason | None
    ) -> list[list[int]]:
        """Add ``new_ids``; return the id lists whose texts ``finish`` needs (none or two)."""
        self._finished_reason = finished_reason
        matched = self._stop_matched()
        if isinstance(matched, int) and new_ids and new_ids[-1] == matched:
            new_ids = new_ids[:-1]  # the stop token itself is not part of the text
        self.ids.extend(new_ids)
        if self.read_offset == len(self.ids):
            return []
        return [self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]]

    def finish(self, texts: list[str]) -> str:
        """Take the texts of ``begin``'s id lists; return the text that became safe to emit."""
        finished_reason, matched = self._finished_reason, self._stop_matched()
        if texts:
            self._take_new_text(*texts, force=finished_reason is not None)
        if finished_reason is None:
            end = len(self.text) if self._no_stop_trim else self._safe_end()
        else:
            end = len(self.text)
            if isinstance(matched, str):
                pos = self._match_start(matched)
                if pos != -1:
                    end = max(pos, self.sent)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def _stop_matched(self) -> int | str | None:
        """What the request stopped on, when that is cut from the text (else None)."""
        reason = self._finished_reason
        if isinstance(reason, FinishStop) and not self._no_stop_trim:
            return reason.matched
        return None

    def _take_new_text(self, surrounding: str, full: str, force: bool) -> None:
        if len(full) > len(surrounding) and (force or not full.endswith(_REPLACEMENT_CHAR)):
            self.text += full[len(surrounding) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def _match_start(self, matched: str) -> int:
        """Where the stop string (or, failing that, the stop regex) ``matched`` begins."""
        pos = self.text.find(matched)
        if pos == -1 and matched in self._stop_regex:
            pos = match_start(matched, self.text)  # RE2: linear in the text
        return pos

    def _safe_end(self) -> int:
        """End of the text that cannot be (the start of) a stop string."""
        end = len(self.text)
        for stop in self._stop:
            pos = self.text.find(stop, self.sent)
            if pos != -1:
                end = min(end, pos)
            # Longest suffix of the unsent text that is a proper prefix of ``stop``.
            for k in range(min(len(stop) - 1, len(self.text) - self.sent), 0, -1):
                if self.text.endswith(stop[:k]):
                    end = min(end, len(self.text) - k)
                    break
        return end


class DetokenizerManager:
    """Receives ``BatchTokenIDOutput``, keeps one ``IncrementalDetokenizer`` per running rid."""

    def __init__(self, server_args: ServerArgs, port_args: ipc.PortArgs) -> None:
        from transformers import PreTrainedTokenizerFast

        from radixserve.tokenizer_loader import load_tokenizer

        self.tokenizer = load_tokenizer(server_args.tokenizer)
        self._ctx = zmq.Context()
        self._recv = ipc.pull_socket(self._ctx, port_args.detokenizer_input)
        self._send = ipc.push_socket(self._ctx, port_args.tokenizer_input)
        self._states: dict[str, IncrementalDetokenizer] = {}
        # A fast tokenizer whose decode is the stock one only calls its Rust tokenizer (which has
        # no use for spaces_between_special_tokens): a batch of id lists then takes one call.
        stock = type(self.tokenizer)._decode is PreTrainedTokenizerFast._decode
        fast = isinstance(self.tokenizer, PreTrainedTokenizerFast) and stock
        self._rust_decoder = self.tokenizer.backend_tokenizer if fast else None

    def handle_batch(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        """Decode one scheduler output into text deltas; drop the state of finished requests."""
        states, pending = [], []
        # every request's id lists, grouped by decoding options, decoded in one call per group
        groups: dict[tuple[bool, bool], list[list[int]]] = {}
        for out in batch.outputs:
            state = self._states.get(out.rid)
            if state is None:
                state = IncrementalDetokenizer(
                    stop=out.stop, no_stop_trim=out.no_stop_trim, stop_regex=out.stop_regex
                )
                self._states[out.rid] = state
            ids = state.begin(out.new_token_ids, out.finished_reason)
            options = (out.skip_special_tokens, out.spaces_between_special_tokens)
            group = groups.setdefault(options, [])
            pending.append((options, len(group), len(ids)))
            group.extend(ids)
            states.append(state)
        texts = {options: self._decode_batch(ids, *options) if ids else []
                 for options, ids in groups.items()}
        outputs = []
        for out, state, (options, first, count) in zip(batch.outputs, states, pending,
                                                       strict=True):
            new_text = state.finish(texts[options][first : first + count])
            if out.finished_reason is not None:
                del self._states[out.rid]
            outputs.append(ReqStrOutput.from_token_output(out, new_text))
        return BatchStrOutput(outputs=outputs)

    def _decode_batch(
        self, batch: list[list[int]], skip_special: bool, spaces_between_special: bool
    ) -> list[str]:
        """The texts of ``batch``, as ``tokenizer.decode`` gives them one by one."""
        if self._rust_decoder is not None:  # what a fast tokenizer's decode runs, in one call
            return self._rust_decoder.decode_batch(batch, skip_special_tokens=skip_special)
        return [
            self.tokenizer.decode(
                ids,
                skip_special_tokens=skip_special,
                spaces_between_special_tokens=spaces_between_special,
                clean_up_tokenization_spaces=False,
            )
            for ids in batch
        ]

    def close(self) -> None:
        self._recv.close(linger=0)
        self._send.close(linger=0)
        self._ctx.term()

    def event_loop(self) -> None:
        """Block on the socket forever; the parent terminates this process at shutdown."""
        while True:
            msg = io_struct.decode(self._recv.recv())
            if isinstance(msg, BatchTokenIDOutput):
                ipc.send(self._send, self.handle_batch(msg))
            else:
                logger.warning("detokenizer ignores unexpected message %s", type(msg).__name__)


def run_detokenizer_process(server_args_json: str, port_args_json: str, ready_conn: Any) -> None:
    """Entry point of the spawned detokenizer process (arguments arrive as JSON, never pickled)."""
    install_exit_handlers()
    try:
        server_args = ServerArgs(**json.loads(server_args_json))
        logging.basicConfig(level=server_args.log_level.upper())
        manager = DetokenizerManager(server_args, ipc.PortArgs(**json.loads(port_args_json)))
    except Exception as e:  # report any start-up failure to the parent, then exit
        report_failure(ready_conn, e)
        raise
    report_ready(ready_conn)
    manager.event_loop()
