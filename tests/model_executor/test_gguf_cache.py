"""The GGUF metadata cache (``gguf_cache.py``): the config and tokenizer a process reads from it
are those a parse of the file gives; a file rewritten in place, a damaged entry, an unwritable
cache and a file we refuse never give a stale or broken answer."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch

from radixserve import gguf_file
from radixserve.cache_files import exclusive
from radixserve.gguf_cache import cached, entry_path
from radixserve.gguf_file import gguf_hf_config
from radixserve.model_executor.model_loader_gguf import gguf_weight_bytes, gguf_weights
from radixserve.tokenizer_loader import load_tokenizer
from tests.gguf_checkpoints import convert_checkpoint

pytest.importorskip("gguf")

TEXTS = ["Hello world", " two  spaces\n\tand a tab", "ünïcödé 日本語 🙂", "<|im_end|> after"]
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and?"}]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _entries(home, kind):
    """The entries of ``kind`` (not the lock files their builders took)."""
    root = home / "radixserve" / "gguf" / kind
    return sorted(p.name for p in root.iterdir() if p.suffix != ".lock") if root.is_dir() else []


def _fresh_config(path):
    """What a parse of the file gives, as JSON carries it (the cache's form)."""
    return json.loads(json.dumps(gguf_file._read_hf_config(path)))


def _same_tokenizer(a, b):
    assert a.get_vocab() == b.get_vocab()
    assert a.all_special_tokens == b.all_special_tokens
    assert (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text)), text
    assert a.chat_template == b.chat_template
    if a.chat_template:
        assert a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
            b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_later_processes_read_the_config_and_tokenizer_a_parse_gives(
        checkpoint_factory, tmp_path, cache_home, monkeypatch):
    from transformers import AutoTokenizer

    path = convert_checkpoint(checkpoint_factory("llama"), tmp_path / "m.gguf")
    built = gguf_hf_config(path)
    assert list(built) == _fresh_config(path)
    tokenizer = load_tokenizer(path)
    _same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf"))
    sizes = gguf_weight_bytes(path, tied=False, dtype=torch.float32)
    weights = {name: get().load() for name, get in gguf_weights(path)}
    assert len(_entries(cache_home, "config")) == 1
    assert len(_entries(cache_home, "tokenizer")) == 1
    assert len(_entries(cache_home, "tensor-table")) == 1

    # a later process: nothing parses the file (a parse would fail now)
    def no_parse(*args, **kwargs):
        raise AssertionError("the file was parsed again")

    monkeypatch.setattr(gguf_file, "_read_hf_config", no_parse)
    monkeypatch.setattr(gguf_file, "open_gguf", no_parse)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        _refusing_gguf(AutoTokenizer.from_pretrained))
    assert list(gguf_hf_config(path)) == list(built)
    _same_tokenizer(load_tokenizer(path), tokenizer)
    assert gguf_weight_bytes(path, tied=False, dtype=torch.float32) == sizes
    later = {name: get().load() for name, get in gguf_weights(path)}
    assert later.keys() == weights.keys()
    assert all(torch.equal(later[name], weights[name]) for name in weights)


def _refusing_gguf(load):
    def wrapped(*args, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError("the tokenizer was built from the GGUF file again")
        return load(*args, **kwargs)

    return wrapped


def test_a_file_rewritten_in_place_gets_a_new_entry(checkpoint_factory, tmp_path, cache_home):
    path = tmp_path / "m.gguf"
    convert_checkpoint(checkpoint_factory("llama"), path)
    llama = gguf_hf_config(path)
    stat = path.stat()
    other = convert_checkpoint(checkpoint_factory("qwen3"), tmp_path / "other.gguf")
    shutil.copyfile(other, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even at the old time
    assert gguf_hf_config(path)[0]["architectures"] == ["Qwen3ForCausalLM"]
    assert llama[0]["architectures"] == ["LlamaForCausalLM"]
    assert len(_entries(cache_home, "config")) == 2


def test_a_damaged_entry_is_rebuilt(checkpoint_factory, tmp_path, cache_home):
    path = convert_checkpoint(checkpoint_factory("llama"), tmp_path / "m.gguf")
    expected = list(gguf_hf_config(path))
    tokenizer = load_tokenizer(path)
    config_entry = cache_home / "radixserve" / "gguf" / "config" / _entries(cache_home,
                                                                             "config")[0]
    (config_entry / "value.json").write_text('{"truncated": ')
    tokenizer_entry = cache_home / "radixserve" / "gguf" / "tokenizer" / _entries(
        cache_home, "tokenizer")[0]
    (tokenizer_entry / "tokenizer.json").write_text("not json")
    assert list(gguf_hf_config(path)) == expected
    _same_tokenizer(load_tokenizer(path), tokenizer)
    # rebuilt in place: the next process reads a good entry again
    assert json.loads((config_entry / "value.json").read_text()) == expected
    json.loads((tokenizer_entry / "tokenizer.json").read_text())


def test_an_unwritable_cache_still_loads_and_a_refused_file_leaves_no_entry(
        checkpoint_factory, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    path = convert_checkpoint(checkpoint_factory("llama"), tmp_path / "m.gguf")
    assert list(gguf_hf_config(path)) == _fresh_config(path)
    assert load_tokenizer(path).get_vocab()

    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    for _ in range(2):
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            gguf_hf_config(bad)
    kind_dir = entry_path(bad, "config", "any").parent  # holds at most the builders' lock
    assert [p.name for p in kind_dir.glob("*") if p.suffix != ".lock"] == []


def test_a_process_starting_while_another_builds_waits_and_loads_its_entry(tmp_path, cache_home):
    """The engine's processes start together on a cold cache: one builds, the others wait for
    its entry instead of building it too (here the builder is this test, holding the lock)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF and whatever follows")
    entry = entry_path(gguf, "probe", "v1")
    entry.parent.mkdir(parents=True)
    built = []

    def build():
        built.append("waiter")
        return "built by the waiter"

    def save(value, directory):
        (directory / "value.txt").write_text(value)

    result = []
    with exclusive(entry.parent / f"{entry.name}.lock"):
        waiter = threading.Thread(target=lambda: result.append(
            cached(gguf, "probe", "v1", build, save, lambda d: (d / "value.txt").read_text())))
        waiter.start()
        scratch = entry.parent / "scratch"  # the builder holding the lock saves its entry
        scratch.mkdir()  # as cached() does: written aside, renamed into place whole
        save("built by the lock holder", scratch)
        os.rename(scratch, entry)
    waiter.join(timeout=60)
    assert result == ["built by the lock holder"] and built == []
