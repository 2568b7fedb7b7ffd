"""Serve a Hugging Face MoE checkpoint on a Ray cluster: OpenAI-compatible completions over Ray Serve.

    ray job submit --address http://<head>:8265 --working-dir . -- \
        python jobs/serve.py --checkpoint /models/Qwen3-30B-A3B --ranks 8 --device cuda --host 0.0.0.0 --port 8000

One shard actor per GPU holds the model's non-expert modules (data-parallel attention) and its expert slots
(expert-parallel MoE); the Serve replica runs the continuous-batching loop. Then, from anywhere that reaches
the head node:

    curl http://<head>:8000/v1/completions -H 'Content-Type: application/json' -H "Authorization: Bearer $KEY" \
         -d '{"model": "Qwen3-30B-A3B", "prompt": "Hello", "max_tokens": 32}'
    ray-moe status --name serve          (RAY_ADDRESS=<head>:6379, RAY_AUTH_MODE=token)
    ray-moe rebalance --name serve

The job runs until it is stopped (``ray job stop``); the deployment and the Serve app are torn down then.
Every option of ``ray-moe serve`` applies (``--help``).
"""

from __future__ import annotations

import sys

from ray_moe.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
