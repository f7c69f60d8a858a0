"""The command line: serve flags -> ServerConfig fields, the API key from the flag or ROLLOUT_API_KEY and never
printed, and start-up errors as one line on stderr with exit status 2 (no traceback), found before the model
loads. Also the demo's end without matplotlib."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.cli import API_KEY_ENV, build_parser, check_device, check_port, main, server_fields

ROOT = Path(__file__).resolve().parent.parent


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--model", "m", *flags])


def run_main(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def command_argv(command: str, *flags: str) -> list[str]:
    """`command` (serve or generate) with `flags`, and a prompt when it is generate."""
    return [command, *flags, *(["--prompt-ids", "1"] if command == "generate" else [])]


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def busy_port():
    """A port something on 127.0.0.1 listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


# ---- flags -> ServerConfig ----------------------------------------------------------------------------------------
def test_serve_flags_set_the_server_config_fields():
    args = serve_args("--host", "0.0.0.0", "--port", "8123", "--served-model-name", "policy", "--api-key", "k-1",
                      "--disable-admin-endpoints", "--max-n", "64", "--max-prompt-tokens", "1000", "--max-tokens",
                      "500", "--max-body-bytes", "1048576", "--max-pending-requests", "10", "--max-cache-salt-chars",
                      "32", "--tool-parser", "hermes", "--chat-template", "t.jinja")
    assert server_fields(args) == dict(host="0.0.0.0", port=8123, served_model_name="policy", api_key="k-1",
                                       enable_admin=False, max_n=64, max_prompt_tokens=1000, max_tokens=500,
                                       max_body_bytes=1 << 20, max_pending_requests=10, max_cache_salt_chars=32,
                                       tool_parser="hermes", chat_template="t.jinja")


def test_flags_left_out_keep_the_server_config_defaults():
    assert server_fields(serve_args()) == {}


def test_the_api_key_comes_from_the_environment_unless_the_flag_gives_one(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_fields(serve_args())["api_key"] == "from-env"
    assert server_fields(serve_args("--api-key", "from-flag"))["api_key"] == "from-flag"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert "api_key" not in server_fields(serve_args())


def test_server_config_from_args_builds_the_servers_config():
    pytest.importorskip("rollout.server_config")
    from rollout.cli import server_config_from_args

    cfg = server_config_from_args(serve_args("--port", "8124", "--api-key", "k-2", "--max-n", "8",
                                             "--disable-admin-endpoints"))
    assert (cfg.port, cfg.api_key, cfg.max_n, cfg.enable_admin) == (8124, "k-2", 8, False)
    assert "k-2" not in repr(cfg)
    default = server_config_from_args(serve_args())
    assert (default.host, default.port, default.api_key, default.enable_admin) == ("127.0.0.1", 30000, None, True)


# ---- start-up errors -----------------------------------------------------------------------------------------------
def test_check_port_refuses_a_port_in_use_or_out_of_range(busy_port):
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{busy_port}: the port is already in use"):
        check_port("127.0.0.1", busy_port)
    for bad in (-1, 65536, 99999, True):
        with pytest.raises(ValueError, match=r"--port must be an integer in \[0, 65535\]"):
            check_port("127.0.0.1", bad)
    with socket.socket() as sock:  # a port nothing listens on (released again) is free
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    check_port("127.0.0.1", free)


def test_a_port_out_of_range_is_one_line_and_exit_2(capsys):
    code, out, err = run_main(capsys, ["serve", "--model", "x", "--port", "99999"])
    assert code == 2 and out == ""
    assert one_error_line(err) == "error: --port must be an integer in [0, 65535], got 99999"


def test_a_port_in_use_is_found_before_the_model_is_looked_for(capsys, busy_port, tmp_path):
    pytest.importorskip("rollout.server_config")
    code, _, err = run_main(capsys, ["serve", "--model", str(tmp_path / "absent"), "--port", str(busy_port)])
    assert code == 2 and "already in use" in one_error_line(err)


def test_a_flag_of_the_wrong_type_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "x", "--port", "abc"])
    assert e.value.code == 2
    assert "argument --port: invalid int value: 'abc'" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("yaml_text, message", [
    ("device: cpu\nmax_num_seqs: [8\n", ":3:1: malformed YAML"),
    ("max_num_seqs: '8'\n", ": max_num_seqs must be an integer, got '8' (string)"),
    ("enforce_eager: maybe\n", ": enforce_eager must be true or false, got 'maybe' (string)"),
    ("max_num_batched_tokens: 81.92\n", ": max_num_batched_tokens must be an integer, got 81.92 (number)"),
    ("speculative: {num_speculative_tokens: x}\n", ": speculative.num_speculative_tokens must be an integer"),
])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_bad_yaml_is_one_line_naming_file_and_key(capsys, tmp_path, yaml_text, message, command):
    path = tmp_path / "engine.yaml"
    path.write_text(yaml_text)
    code, _, err = run_main(capsys, command_argv(command, "--model", "x", "--config", str(path)))
    assert code == 2 and one_error_line(err).startswith(f"error: {path}{message}"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_device_cuda_without_cuda_is_one_line(capsys, tmp_path, command):
    code, _, err = run_main(capsys, command_argv(command, "--model", str(tmp_path / "absent"), "--device", "cuda"))
    assert code == 2
    assert "device 'cuda': CUDA is not available" in one_error_line(err)  # before the missing model is looked for


def test_device_cuda_without_triton_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if triton were not installed
    with pytest.raises(ValueError, match=r"device 'cuda:0' needs triton, which is not installed: pip install -e '\.\[gpu\]'"):
        check_device("cuda:0")
    check_device("cpu")  # the CPU needs neither


def test_a_missing_model_is_one_line(capsys, tmp_path):
    code, _, err = run_main(capsys, ["generate", "--model", str(tmp_path / "absent"), "--prompt-ids", "1"])
    assert code == 2 and f"no such directory ({tmp_path / 'absent'})" in one_error_line(err)


def test_a_missing_chat_template_is_one_line(capsys, tmp_path):
    pytest.importorskip("rollout.server_config")
    code, _, err = run_main(capsys, ["serve", "--model", "x", "--chat-template", str(tmp_path / "t.jinja")])
    assert code == 2 and "--chat-template" in one_error_line(err) and "no such file" in err


def test_generate_still_generates(capsys, ckpt_factory):
    code, out, err = run_main(capsys, ["generate", "--model", str(ckpt_factory("llama")), "--prompt-ids", "3,4,5",
                                       "--n", "2", "--max-tokens", "3", "--ignore-eos", "--dtype", "float32"])
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [len(r["token_ids"]) for r in rows[:2]] == [3, 3] and rows[2]["num_generated_tokens"] == 6


# ---- the key is never printed ----------------------------------------------------------------------------------------
def test_the_api_key_never_reaches_output_or_logs(capsys, caplog, monkeypatch, tmp_path, busy_port):
    caplog.set_level(logging.DEBUG)
    secret = "sk-do-not-print-7f3a"
    runs = [
        ["serve", "--model", "x", "--api-key", secret, "--port", "99999"],
        ["serve", "--model", "x", f"--api-key={secret}", "--max-n", "many"],  # an argparse error
        ["serve", "--model", "x", "--api_key", secret],  # a misspelt flag, echoed by argparse as unrecognized
    ]
    # an error message that would hold the key: the model's name (checked after the server's config)
    runs.append(["serve", "--model", str(tmp_path / secret), "--api-key", secret, "--port", "0"])
    for argv in runs:
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        assert code == 2
        assert secret not in out.out + out.err and secret not in caplog.text, (argv, out.err)
        assert out.err.strip()  # an error was reported, without the key
    monkeypatch.setenv(API_KEY_ENV, secret)
    assert main(["generate", "--model", str(tmp_path / secret), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert secret not in err and "***" in err


# ---- the demo's end without matplotlib --------------------------------------------------------------------------------
def test_metrics_logger_finishes_without_matplotlib(tmp_path, monkeypatch, capsys):
    from trainer_bridge.config import RunConfig
    from trainer_bridge.harness import MetricsLogger

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    logger = MetricsLogger(RunConfig(output_dir=str(tmp_path)))
    logger._wandb = None
    logger.log(1, {"reward": 0.5})
    summary = {"steps": 1}
    path = logger.finish(summary)
    assert json.loads(path.read_text()) == {"steps": 1} and "plot" not in summary
    assert not (tmp_path / "plot.png").exists()
    assert "matplotlib is not installed, so no plot.png (pip install -e '.[demo]' brings it)" in capsys.readouterr().out


def test_the_demo_command_runs_to_its_end_without_matplotlib(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from rollout.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run(
        [sys.executable, "-c", code, "demo", "--set", "rl.steps=2", "--set", "toy_model.warmup_steps=10",
         "--set", f"output_dir={tmp_path}", "--set", "logging.wandb=false", "--set", "task.num_eval_prompts=8"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no plot.png" in proc.stdout and "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2


def test_the_values_of_key_token_and_secret_flags_are_the_ones_redacted():
    from rollout.cli import _secrets_in

    argv = ["serve", "--max-tokens", "500", "--max-prompt-tokens", "9", "--api-key", "k1", "--hf_token=t2",
            "--SECRET", "s3", "--port", "1"]
    assert _secrets_in(argv) == ("k1", "t2", "s3")
