"""The one set of serving defaults (``driver/defaults.py``) every front resolves an unset size to."""

from __future__ import annotations

import inspect

from ray_moe.driver.defaults import DEFAULT_MAX_RUNNING, DEFAULT_STEP_TOKENS, serving_sizes


def test_unset_sizes_take_the_device_defaults_and_set_ones_stay():
    """CUDA: 16,384 prefill tokens, 1,024 running sequences (vLLM 0.25's offline defaults on >= 70 GB GPUs), 2 decode
    sub-steps;
    CPU: 2,048 / 256 / 1; a size the caller sets is kept as given."""
    assert serving_sizes("cuda", step_tokens=None, max_running=None, decode_steps=None) == (16384, 1024, 2)
    assert serving_sizes("cpu", step_tokens=None, max_running=None, decode_steps=None) == (2048, 256, 1)
    assert serving_sizes("cuda", step_tokens=4096, max_running=256, decode_steps=1) == (4096, 256, 1)
    assert (DEFAULT_STEP_TOKENS["cuda"], DEFAULT_MAX_RUNNING["cuda"]) == (16384, 1024)


def test_every_front_leaves_the_running_limit_to_the_defaults():
    """``Runtime.serving``, the generation loop and ``ray-moe serve`` pass None (the defaults' choice), never a
    number of their own."""
    from ray_moe.apps.cli import build_parser
    from ray_moe.driver.loop import GenerationLoop
    from ray_moe.runtime import Runtime

    assert inspect.signature(Runtime.serving).parameters["max_running"].default is None
    assert inspect.signature(GenerationLoop.__init__).parameters["max_running"].default is None
    args = build_parser().parse_args(["serve", "--checkpoint", "/nonexistent"])
    assert args.max_running is None
