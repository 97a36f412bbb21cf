"""The command line and the default model, in process (no server)."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.cli import build_parser, server_args_from_namespace
from radixserve.model_config import ModelConfig
from radixserve.registry_choices import check_registry_choices
from radixserve.server.default_model import default_model_path
from radixserve.server.http_server import load_chat_template
from radixserve.server_args import ServerArgs


def test_every_server_arg_is_a_kebab_case_flag_with_its_default():
    ns = build_parser().parse_args(["serve", "--model-path", "m"])
    for f in dataclasses.fields(ServerArgs):
        expected = "m" if f.name == "model_path" else f.default
        assert getattr(ns, f.name) == expected, f.name
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in help_text


def test_flags_parse_into_server_args():
    ns = build_parser().parse_args([
        "serve", "--model-path", "m", "--port", "8000", "--disable-radix-cache",
        "--max-queued-requests", "4", "--schedule-policy", "lpm", "--mem-fraction-static", "0.5",
    ])
    args = server_args_from_namespace(ns)
    assert (args.port, args.disable_radix_cache, args.max_queued_requests) == (8000, True, 4)
    assert args.schedule_policy == "lpm" and args.mem_fraction_static == 0.5


@pytest.mark.parametrize("argv", [
    ["serve", "--dtype", "float8"], ["serve", "--device", "tpu"],
    ["serve", "--schedule-policy", "random"], ["serve", "--port", "abc"], [],
    ["serve", "--attention-backend", "flash"],
])
def test_invalid_flags_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("flag, value", [("--stream-interval", "0"), ("--page-size", "0")])
def test_out_of_range_flag_values_raise_value_error_naming_the_flag(flag, value):
    ns = build_parser().parse_args(["serve", "--model-path", "m", flag, value])
    with pytest.raises(ValueError, match=flag.removeprefix("--").replace("-", "_")):
        server_args_from_namespace(ns)


def test_attention_backend_flag_and_engine_argument_take_the_registrys_names():
    ns = build_parser().parse_args(["serve", "--model-path", "m", "--attention-backend", "cpu"])
    assert server_args_from_namespace(ns).attention_backend == "cpu"
    with pytest.raises(ValueError, match="attention_backend must be one of .*'flash'"):
        check_registry_choices(ServerArgs(model_path="m", attention_backend="flash"))
    ns = build_parser().parse_args(["serve", "--model-path", "m"])
    ns.attention_backend = "flash"  # as an Engine argument would: past argparse's choices
    with pytest.raises(ValueError, match="attention_backend must be one of .*'flash'"):
        server_args_from_namespace(ns)


def test_default_model_prefers_the_demo_checkpoint_in_the_working_directory(tmp_path,
                                                                            monkeypatch):
    demo = tmp_path / "models" / "radixserve-demo"
    demo.mkdir(parents=True)
    (demo / "config.json").write_text("{}")
    (demo / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert default_model_path() == demo
    args = server_args_from_namespace(build_parser().parse_args(["serve"]))
    assert args.model_path == str(demo) and args.model_name == "radixserve-demo"


def test_missing_demo_model_without_model_path_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("radixserve.server.default_model.__file__",
                        str(tmp_path / "a" / "b" / "c" / "default_model.py"))
    with pytest.raises(ValueError, match="no --model-path given and the demo model"):
        default_model_path()


def test_shipped_demo_model_is_the_default(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # found through the source checkout
    args = server_args_from_namespace(build_parser().parse_args(["serve"]))
    assert args.model_path.endswith("models/radixserve-demo")
    assert ModelConfig.from_path(args.model_path).architecture == "LlamaForCausalLM"


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    file = tmp_path / "t.jinja"
    file.write_text(template)
    assert load_chat_template(str(file)) == template
    assert load_chat_template(template) == template
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("no-such-file.jinja")
