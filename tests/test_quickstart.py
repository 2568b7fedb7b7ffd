"""The README's serving quickstart, run as pasted (bash, the server's private Ray instance, the openai client, the
status command from another shell), and its tiny model's vocabulary is its tokenizer's."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_block() -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"<!-- quickstart:[^>]*-->\s*```bash\n(.*?)```", text, re.S)
    assert m, "README.md: the quickstart block (<!-- quickstart ... --> then a bash block) is missing"
    return m.group(1)


def test_the_block_is_complete():
    block = quickstart_block()
    for needed in ("ray-moe serve tiny-moe", "completions.create", "chat.completions.create", "ray-moe status",
                   "kill %1"):
        assert needed in block, needed
    assert "--address" not in block  # a private Ray instance is the default, nothing to say


@pytest.mark.timeout(300)
def test_readme_quickstart_runs_as_pasted(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    block = quickstart_block()
    # the install line is this checkout's own install (done by CI); everything after it runs verbatim
    lines = block.splitlines()
    assert lines[0].startswith("pip install")
    script = "\n".join(["set -euo pipefail", *lines[1:]])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PORT": str(port), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_MOE_STATE_DIR": str(tmp_path / "state")}  # (the server's state file: not this user's ~/.ray-moe)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE"):  # a shell as a user has it
        env.pop(name, None)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"completion: '.*' CompletionUsage\(completion_tokens=8, prompt_tokens=13, total_tokens=21", out), out[-3000:]
    assert re.search(r"chat: ['\"]", out), out[-3000:]  # (sampled at temperature 1: the text may hold a quote)
    assert "deployment 'serve': active generation" in out, out[-3000:]  # ray-moe status found it
    assert "ray-moe serve: stopped" in out and not (tmp_path / "state" / "serve.json").exists()
    # the model's vocabulary is its tokenizer's: every id it samples has a text
    cfg = json.loads((tmp_path / "tiny-moe" / "config.json").read_text())
    from transformers import AutoTokenizer

    assert cfg["vocab_size"] == len(AutoTokenizer.from_pretrained(tmp_path / "tiny-moe", local_files_only=True))
