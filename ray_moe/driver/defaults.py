"""ONE set of serving defaults for every front: ``Runtime.generate`` / ``Runtime.serving``, ``ray-moe serve`` and the
serving benchmark all resolve an unset size here, by the device the shards run on (pure: no torch, no Ray).

* decode sub-steps per actor call on CUDA (multi-step decode: a request arriving mid-call waits for the call's end
  to join; streamed tokens arrive in bursts of that many). 2, measured on one H100, 24-layer Qwen3-30B-A3B shape,
  one lease (c3cc57c, ``bench/results/serving-h100x1-c3cc57c``): offline output tok/s at 4 / 2 sub-steps mixed
  10,349 / 10,381, decode-heavy 18,471 / 18,408, chat 8,719 / 9,000, long 1,212 / 1,216 (level), while the online
  chat at 8 req/s had TTFT p50 / p99 48 / 81 ms at 4 (cebd5aa) and 34 / 51 ms at 2 (vLLM 0.25: 30 / 73). One
  sub-step a call costs ~12% on decode-heavy (15,908 tok/s: the host's work between calls is no longer hidden).
* prefill tokens per rank per step on CUDA: 16,384 (vLLM 0.25's offline ``LLM`` default on >= 70 GB GPUs; its
  ``vllm serve`` takes 8,192). Every captured token size is at most this plus a decode row of each running sequence
  (``shard/lattice.py``). Measured on one H100, 24-layer Qwen3-30B-A3B shape, one lease (d9eaf52,
  ``bench/results/serving-h100x1-d9eaf52``), first passes, output tok/s at 8,192 / 16,384: mixed 9,933 / 10,473,
  long prompts 1,182 / 1,279, chat 8,908 / 9,022 (decode-heavy's 8,192 prompt tokens fit one step either way).
  Half as many prefill steps each read the expert weights once, and a 6-8k prompt is split across steps half as
  often (its continuation chunk attends through FlashAttention-2 at about half cuDNN's rate,
  ``model/dense_prefill.py``). The price is latency under a prefill backlog: a decoding sequence sharing a step
  with a full chunk waits for it (mixed: inter-token p99 140 ms against 82); TTFT and TPOT p50 / p99 were lower
  on every offline workload. ``--step-tokens 8192`` is the latency-first setting.
* sequences running at once over every rank (vLLM 0.25's ``max_num_seqs`` on >= 70 GB GPUs, offline and served):
  a decode step reads the weights of nearly every expert whatever its rows, so more sequences a step share that
  read. At 256 (the default until session 27) the chat workload of 1,000 requests ran 256 at a time against vLLM's
  ~1,000 (its JSON's ``effective``; ``bench/results/serving-h200x1-f048dfe``: 0.84x). The scheduler still admits
  only what each rank's KV cache holds (a request reserves its prompt + max_tokens), and the lattice captures every
  decode size up to it (29 sizes to 1,024, 12 more graphs than at 256). On CPU 256 (the lattice's graphs are eager
  stand-ins there: fewer sizes, shorter tests).
"""

from __future__ import annotations

DEFAULT_DECODE_STEPS_CUDA = 2
DEFAULT_STEP_TOKENS = {"cuda": 16384, "cpu": 2048}
DEFAULT_MAX_RUNNING = {"cuda": 1024, "cpu": 256}


def serving_sizes(device: str, *, step_tokens: int | None, max_running: int | None,
                  decode_steps: int | None) -> tuple[int, int, int]:
    """(step_tokens, max_running, decode_steps) with each None replaced by ``device``'s default ("cuda": the
    GPU defaults above; anything else: the CPU ones)."""
    gpu = device == "cuda"
    return (int(DEFAULT_STEP_TOKENS["cuda" if gpu else "cpu"] if step_tokens is None else step_tokens),
            int(DEFAULT_MAX_RUNNING["cuda" if gpu else "cpu"] if max_running is None else max_running),
            int((DEFAULT_DECODE_STEPS_CUDA if gpu else 1) if decode_steps is None else decode_steps))


__all__ = ["DEFAULT_DECODE_STEPS_CUDA", "DEFAULT_MAX_RUNNING", "DEFAULT_STEP_TOKENS", "serving_sizes"]
