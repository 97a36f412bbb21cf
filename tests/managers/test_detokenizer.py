"""Incremental detokenization: UTF-8 safety, equality with a full decode, stop-string trimming."""

from __future__ import annotations

import random
import shutil

import pytest
from transformers import AutoTokenizer

from radixserve.finish_reason import FinishLength, FinishReason, FinishStop
from radixserve.managers.detokenizer_manager import DetokenizerManager, IncrementalDetokenizer
from radixserve.managers.io_struct import BatchTokenIDOutput, ReqTokenOutput
from radixserve.managers.ipc import PortArgs
from radixserve.server_args import ServerArgs
from tests.checkpoints import build_tokenizer

EOS = 1


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def make(tokenizer, skip_special=True, **kwargs) -> IncrementalDetokenizer:
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special,
                                clean_up_tokenization_spaces=False)

    return IncrementalDetokenizer(decode, **kwargs)


def stream(detok: IncrementalDetokenizer, ids: list[int], finished_reason: FinishReason,
           chunk: int = 1) -> list[str]:
    """Feed ``ids`` in chunks (the last one finishing); return every delta."""
    deltas = []
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        deltas.append(detok.step(ids[start:start + chunk], finished_reason if last else None))
    return deltas


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_decode_equals_full_decode_for_random_ids(tokenizer, skip_special):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        detok = make(tokenizer, skip_special)
        deltas = stream(detok, ids, FinishLength(length=len(ids)),
                        chunk=rng.randint(1, 4))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special)


def test_split_multibyte_characters_never_stream_replacement_char(tokenizer):
    text = "emoji 😀 and 世界, then 🎉 ok"
    ids = tokenizer.encode(text)
    # The byte-level tokens really do split characters: some single tokens decode to U+FFFD.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = make(tokenizer)
    deltas = stream(detok, ids, FinishLength(length=len(ids)))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def _ids_until_stop(tokenizer, text: str, stop: str) -> list[int]:
    """The ids the scheduler would have produced: up to the token that completes ``stop``."""
    ids = tokenizer.encode(text)
    for n in range(1, len(ids) + 1):
        if stop in tokenizer.decode(ids[:n]):
            return ids[:n]
    raise AssertionError("stop string not in text")


@pytest.mark.parametrize("stop", ["answer is", "\n\nEND", "is 4"])
def test_stop_string_spanning_tokens_is_trimmed_and_never_streamed(tokenizer, stop):
    text = "The answer is 42.\n\nEND of the story"
    ids = _ids_until_stop(tokenizer, text, stop)
    assert text.find(stop) < len(tokenizer.decode(ids[:-1])), "the stop must span tokens"
    detok = make(tokenizer, stop=[stop, "never matches"])
    finished = FinishStop(matched=stop)
    deltas = stream(detok, ids, finished)
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert text[: text.find(stop)].startswith(emitted)
    assert emitted == text[: text.find(stop)]


def test_held_back_stop_prefix_is_released_when_text_diverges(tokenizer):
    text = "we stop here and go on"
    ids = tokenizer.encode(text)
    detok = make(tokenizer, stop=["stop now"])
    deltas = stream(detok, ids, FinishLength(length=len(ids)))
    assert "".join(deltas) == text
    # While "stop" could still become "stop now", it was not emitted.
    emitted = ""
    detok = make(tokenizer, stop=["stop now"])
    for i in range(len(ids)):
        emitted += detok.step(ids[i:i + 1], None)
        if tokenizer.decode(ids[: i + 1]).endswith(" stop"):
            assert not emitted.endswith("stop")


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    text = "The answer is 42.\n\nEND of the story"
    ids = _ids_until_stop(tokenizer, text, "END")
    detok = make(tokenizer, stop=["END"], no_stop_trim=True)
    deltas = stream(detok, ids, FinishStop(matched="END"))
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "".join(deltas).endswith("END")


def test_stop_regex_match_is_trimmed_where_it_begins(tokenizer):
    text = "Order 66 was given at 9 pm"
    ids = tokenizer.encode(text)
    pattern = r"[0-9]+ pm"
    n = next(n for n in range(1, len(ids) + 1) if "pm" in tokenizer.decode(ids[:n]))
    finished = FinishStop(matched=pattern)
    # Reported at once (a non-stream request): cut where the match begins.
    assert make(tokenizer, stop_regex=[pattern]).step(ids[:n], finished) == "Order 66 was given at "
    kept = make(tokenizer, stop_regex=[pattern], no_stop_trim=True)
    assert kept.step(ids[:n], finished).endswith("9 pm")
    # Streamed token by token, what was sent before the match completed stays sent (a regex
    # has no prefix to hold back); the rest is cut.
    streamed = "".join(stream(make(tokenizer, stop_regex=[pattern]), ids[:n], finished))
    assert streamed.startswith("Order 66 was given at ") and not streamed.endswith("pm")


def test_matched_stop_token_is_left_out_of_the_text(tokenizer):
    ids = tokenizer.encode("hello world") + [EOS]
    detok = make(tokenizer, skip_special=False)
    deltas = stream(detok, ids, FinishStop(matched=EOS))
    assert "".join(deltas) == "hello world"


def test_manager_honours_flags_and_drops_state_at_finish(tokenizer_dir, tokenizer):
    port_args = PortArgs.create()
    manager = DetokenizerManager(ServerArgs(model_path=str(tokenizer_dir)), port_args)
    try:
        ids = tokenizer.encode("a b") + [EOS]

        def out(rid: str, new_ids: list[int], finished: dict | None, skip: bool):
            return ReqTokenOutput(rid=rid, new_token_ids=new_ids, finished_reason=finished,
                                  prompt_tokens=3, completion_tokens=len(ids), cached_tokens=0,
                                  skip_special_tokens=skip)

        length = FinishLength(length=len(ids))
        first = manager.handle_batch(BatchTokenIDOutput(outputs=[
            out("keep", ids[:-1], None, False), out("skip", ids[:-1], None, True)]))
        assert [o.new_text for o in first.outputs] == ["a b", "a b"]
        last = manager.handle_batch(BatchTokenIDOutput(outputs=[
            out("keep", ids[-1:], length, False), out("skip", ids[-1:], length, True)]))
        assert [o.new_text for o in last.outputs] == ["<|eos|>", ""]
        assert last.outputs[0].new_token_ids == [EOS]
        assert manager._states == {}
    finally:
        manager.close()
        shutil.rmtree(port_args.directory)


@pytest.mark.parametrize("batched", [True, False])
def test_manager_decodes_a_batch_as_each_request_alone(tokenizer_dir, tokenizer, batched):
    """Every request of a step is decoded in one tokenizer call (``batched``: the Rust
    tokenizer's decode_batch; else one decode per id list): each gets the deltas its own
    IncrementalDetokenizer gives, whatever the requests beside it."""
    rng = random.Random(1)
    vocab = len(tokenizer)
    text = "The answer is 42.\n\nEND of the story, emoji 😀 and 世界 🎉"
    requests = []
    for i in range(12):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))] + tokenizer.encode(text)
        stop = ["END"] if i % 3 == 0 else []
        finished = FinishLength(length=len(ids))
        if stop:
            ids = ids[: next(n for n in range(1, len(ids) + 1)
                             if "END" in tokenizer.decode(ids[:n], skip_special_tokens=True))]
            finished = FinishStop(matched="END")
        requests.append((f"r{i}", ids, stop, i % 2 == 0, finished))
    port_args = PortArgs.create()
    manager = DetokenizerManager(ServerArgs(model_path=str(tokenizer_dir)), port_args)
    assert manager._rust_decoder is not None  # the test tokenizer is a stock fast one
    if not batched:
        manager._rust_decoder = None
    try:
        got: dict[str, list[str]] = {rid: [] for rid, *_ in requests}
        expected: dict[str, list[str]] = {}
        sent = dict.fromkeys(got, 0)
        alone = {rid: make(tokenizer, skip, stop=stop) for rid, _, stop, skip, _ in requests}
        while any(sent[rid] < len(ids) for rid, ids, *_ in requests):
            step = []
            for rid, ids, stop, skip, finished in requests:
                if sent[rid] == len(ids) or rng.random() < 0.3:
                    continue  # finished, or not in this step's batch
                new = ids[sent[rid] : sent[rid] + rng.randint(1, 3)]
                sent[rid] += len(new)
                done = finished if sent[rid] == len(ids) else None
                step.append(ReqTokenOutput(
                    rid=rid, new_token_ids=new, finished_reason=done, prompt_tokens=1,
                    completion_tokens=sent[rid], cached_tokens=0, stop=stop,
                    skip_special_tokens=skip))
                expected.setdefault(rid, []).append(alone[rid].step(new, done))
            for out in manager.handle_batch(BatchTokenIDOutput(outputs=step)).outputs:
                got[out.rid].append(out.new_text)
        assert got == expected and manager._states == {}
        for rid, ids, stop, skip, _ in requests:
            full = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(got[rid]) == (full[: full.find("END")] if stop else full)
    finally:
        manager.close()
        shutil.rmtree(port_args.directory)
