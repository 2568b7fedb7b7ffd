"""Serve a Hugging Face MoE checkpoint on a Ray cluster: OpenAI-compatible completions and chat over Ray Serve.

    ray job submit --address http://<head>:8265 --working-dir . \
        --runtime-env-json '{"env_vars": {"RAY_MOE_API_KEY": "'"$KEY"'"}}' -- \
        python jobs/serve.py --checkpoint /models/Qwen3-30B-A3B --ranks 8 --device cuda --host 0.0.0.0 --port 8000

(or ``--api-key-file /path/on/the/head/node``: a key on the command line, ``--api-key``, shows in ``ray job logs``).
One shard actor per GPU holds the model's non-expert modules (data-parallel attention) and its expert slots
(expert-parallel MoE); the Serve replica runs the continuous-batching loop. Serve keeps one HTTP address per
cluster: when a Serve instance already runs there listening elsewhere than ``--host``/``--port`` (``ray job
stop`` leaves Serve's proxy running), the job refuses to start and says so (``serve shutdown`` first). Then,
from anywhere that reaches the head node:

    curl http://<head>:8000/v1/chat/completions -H 'Content-Type: application/json' -H "Authorization: Bearer $KEY" \
         -d '{"model": "Qwen3-30B-A3B", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'
    ray-moe status                       (RAY_ADDRESS=<head>:6379, RAY_AUTH_MODE=token; --name serve)
    ray-moe rebalance --name serve

The job runs until it is stopped (``ray job stop``); the deployment and the Serve app are torn down then.
Every option of ``ray-moe serve`` applies (``--help``).
"""

from __future__ import annotations

import sys

from ray_moe.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
