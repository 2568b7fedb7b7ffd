"""``ray-moe serve`` spelled as ``vllm serve`` (``apps/serve_flags.py``): MODEL positional (``--checkpoint`` and
``--model`` name it too), vLLM's flags mapped to ray-moe's knobs (the README's table, parsed row by row), no
prefix matching on any parser, ``--tensor-parallel-size`` above 1 refused saying why, ``--max-model-len`` within
the model's positions, and the checks that run before Ray: an address something listens on (named, with its
owner) and ``--device cuda`` without a GPU (in seconds, as a user runs it)."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_moe.apps.cli import BadInput, build_parser, main
from ray_moe.apps.serve_flags import VLLM_FLAGS, human_int, normalize_serve_args

README = Path(__file__).resolve().parents[2] / "README.md"


_PARSER: list[argparse.ArgumentParser] = []


def parser() -> argparse.ArgumentParser:
    """One parser for the module (building one lists the benchmarks: half a second)."""
    if not _PARSER:
        _PARSER.append(build_parser())
    return _PARSER[0]


def parse(*argv: str) -> argparse.Namespace:
    return normalize_serve_args(parser().parse_args(["serve", *argv]), BadInput)


def _parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_matches_a_prefix():
    parsers = list(_parsers(parser()))
    assert len(parsers) >= 8  # ray-moe, demo, status, scale, rebalance, serve, drill, drill rollback, bench
    assert all(p.allow_abbrev is False for p in parsers), [p.prog for p in parsers if p.allow_abbrev]
    for argv in (["serve", "m", "--max-num", "4"], ["serve", "m", "--served", "x"], ["status", "--nam", "x"],
                 ["scale", "--exp", "1", "--replicas", "2"]):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)


def test_model_is_positional_and_its_flags_are_aliases():
    assert parse("tiny-moe").checkpoint == "tiny-moe"
    assert parse("--checkpoint", "tiny-moe").checkpoint == "tiny-moe"
    a = parse("--model", "tiny-moe")  # the model folder (vLLM's --model), never taken for --model-name
    assert a.checkpoint == "tiny-moe" and a.model_name is None
    assert parse("tiny-moe", "--checkpoint", "tiny-moe").checkpoint == "tiny-moe"
    with pytest.raises(BadInput, match="name the model folder once"):
        parse("a", "--checkpoint", "b")
    with pytest.raises(BadInput, match=r"MODEL: the model folder is missing \(ray-moe serve MODEL"):
        parse("--port", "8000")


def test_vllm_flags_set_ray_moes_knobs():
    a = parse("m", "--served-model-name", "tiny", "--max-model-len", "32k", "--gpu-memory-utilization", "0.8",
              "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--data-parallel-size", "4",
              "--enable-expert-parallel", "--tensor-parallel-size", "1", "--api-key", "k", "--host", "0.0.0.0",
              "--port", "9000", "--dtype", "auto")
    assert (a.model_name, a.max_model_len, a.memory_fraction, a.max_running, a.step_tokens, a.ranks) == \
        ("tiny", 32000, 0.8, 64, 4096, 4)
    assert (a.api_key, a.host, a.port, a.dtype, a.enable_expert_parallel) == ("k", "0.0.0.0", 9000, "auto", True)
    # ray-moe's own spellings are the same options
    b = parse("m", "--model-name", "tiny", "--max-running", "64", "--step-tokens", "4096", "--ranks", "4")
    assert (b.model_name, b.max_running, b.step_tokens, b.ranks) == ("tiny", 64, 4096, 4)
    # unset: the product's serving defaults (driver/loop.py resolves None), 2 ranks
    d = parse("m")
    assert (d.step_tokens, d.decode_steps, d.ranks, d.max_model_len, d.tensor_parallel_size) == (None, None, 2, None,
                                                                                                  None)
    assert human_int("32K") == 32768 and human_int("4096") == 4096 and human_int("1.5k") == 1500
    with pytest.raises(argparse.ArgumentTypeError):
        human_int("lots")


def test_tensor_parallelism_is_refused_saying_what_to_use(capsys):
    assert main(["serve", "m", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size=2" in err and "data-parallel attention with expert parallelism" in err
    assert "--data-parallel-size 2" in err


def test_the_readme_maps_every_vllm_flag_and_each_parses():
    text = README.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(--[a-z-]+|MODEL)[^`]*`[^|]*\| `([^`]*)`", text, re.M)
    table = dict(rows)
    assert set(VLLM_FLAGS) <= set(table), sorted(set(VLLM_FLAGS) - set(table))
    values = {"--max-model-len": "4096", "--gpu-memory-utilization": "0.9", "--max-num-seqs": "8",
              "--max-num-batched-tokens": "2048", "--data-parallel-size": "2", "--tensor-parallel-size": "1",
              "--api-key": "k", "--host": "127.0.0.1", "--port": "8000", "--dtype": "bfloat16",
              "--served-model-name": "x"}
    for flag in VLLM_FLAGS:
        if flag == "MODEL":
            continue
        argv = ["m", flag] + ([values[flag]] if flag in values else [])
        parse(*argv)  # vLLM's spelling is accepted as is
        ours = table[flag].split()[0]
        if ours.startswith("--"):  # and the ray-moe spelling the table names is an option too
            parse(*(["m", ours] + ([values[flag]] if flag in values else [])))


def test_max_model_len_within_the_models_positions(tmp_path):
    from ray_moe.apps.serve_checks import check_max_model_len, model_context

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert model_context(str(tmp_path)) == 512
    check_max_model_len(512, str(tmp_path))
    with pytest.raises(ValueError, match=r"--max-model-len=1024 exceeds the model's 512 positions"):
        check_max_model_len(1024, str(tmp_path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_something_listens_on_is_refused_naming_its_owner(tmp_path):
    """A plain bind, before Ray: a listener with SO_REUSEPORT (as Serve's proxy sets it) still holds the address;
    the refusal names the address and the process (here: this test's own)."""
    from ray_moe.apps.serve_checks import address_taken, port_owner
    from ray_moe.apps.serve_run import address_refusal

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert address_taken("127.0.0.1", port) is not None and address_taken("0.0.0.0", port) is not None
        msg = address_refusal("127.0.0.1", port, str(tmp_path))
        assert msg.startswith(f"--host 127.0.0.1 --port {port}: the address is already in use"), msg
        assert "pass another --port" in msg
        if Path("/proc/net/tcp").exists():
            assert port_owner(port).pid == os.getpid() and f"by pid {os.getpid()} (" in msg
    assert address_taken("127.0.0.1", port) is None  # closed again: free
    with pytest.raises(ValueError, match="not an address of this machine"):
        address_taken("203.0.113.7", port)


def test_cuda_without_a_gpu_fails_at_once_naming_what_is_missing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""),
           "RAY_MOE_STATE_DIR": str(tmp_path / "state")}
    script = Path(sys.executable).parent / "ray-moe"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "ray_moe.apps.cli"]
    t0 = time.monotonic()
    p = subprocess.run([*cmd, "serve", str(tmp_path), "--device", "cuda", "--port", str(_free_port())],
                       capture_output=True, text=True, timeout=120, env=env)
    took = time.monotonic() - t0
    assert p.returncode != 0 and took < 5, (took, p.stderr)
    assert "--device cuda: no" in p.stderr and "GPU" in p.stderr and "--device cpu" in p.stderr, p.stderr
    assert "Ray" not in p.stderr.split("error:")[0]  # no Ray instance started: the one line is the error
