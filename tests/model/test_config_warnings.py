"""``RuntimeConfig.start_warnings``: what a configuration leaves slower or less protected than a user may assume,
said once at start (``Runtime.start`` logs each): healing off, and an FP8 payload format on one rank (no rows move)."""

from __future__ import annotations

from ray_moe.model.config import RuntimeConfig

BASE = dict(num_experts=8, num_ranks=2, slots_per_rank=5, top_k=2, hidden_size=16, ffn_size=8, heal_retries=2)


def test_the_product_defaults_warn_of_nothing_but_healing_off():
    assert RuntimeConfig(**BASE).start_warnings() == []
    off = RuntimeConfig(**{**BASE, "heal_retries": 0}).start_warnings()
    assert len(off) == 1 and off[0].startswith("healing is off (heal_retries=0)")


def test_an_fp8_payload_on_one_rank_says_it_applies_to_nothing():
    assert RuntimeConfig(**BASE, payload_format="fp8_block128").start_warnings() == []  # every path carries it
    one = RuntimeConfig(**{**BASE, "num_ranks": 1, "slots_per_rank": 8}, payload_format="fp8_row").start_warnings()
    assert len(one) == 1 and "one rank exchanges no rows" in one[0]
