"""``ray-moe serve``'s elasticity flags: --heal-retries (default 2) and --min-ranks / --max-ranks (scaling on when
either is given) become RuntimeConfig fields; bad values are refused naming the flag."""

from __future__ import annotations

import pytest

from ray_moe.apps.cli import BadInput, build_parser, serve_config_fields
from ray_moe.model.config import EplbMode

BASE = ["serve", "--checkpoint", "/tmp/x", "--ranks", "2"]


def test_defaults_heal_twice_autopilot_on_scaling_off():
    fields = serve_config_fields(build_parser().parse_args(BASE))
    assert fields["heal_retries"] == 2 and fields["eplb"].mode is EplbMode.AUTO and "scaling" not in fields


def test_min_max_ranks_turn_scaling_on_within_bounds():
    f = serve_config_fields(build_parser().parse_args([*BASE, "--max-ranks", "4", "--heal-retries", "0"]))
    assert f["heal_retries"] == 0
    assert (f["scaling"].enabled, f["scaling"].min_ranks, f["scaling"].max_ranks) == (True, 1, 4)
    f = serve_config_fields(build_parser().parse_args([*BASE, "--min-ranks", "2"]))
    assert (f["scaling"].min_ranks, f["scaling"].max_ranks) == (2, 2)
    with pytest.raises(BadInput, match=r"--min-ranks=3 exceeds --max-ranks=2"):
        serve_config_fields(build_parser().parse_args([*BASE, "--min-ranks", "3", "--max-ranks", "2"]))
    with pytest.raises(BadInput, match=r"--ranks=2 is outside \[--min-ranks=3, --max-ranks=4\]"):
        serve_config_fields(build_parser().parse_args([*BASE, "--min-ranks", "3", "--max-ranks", "4"]))


@pytest.mark.parametrize("flag,value", [("--heal-retries", "-1"), ("--min-ranks", "0"), ("--max-ranks", "x"),
                                        ("--start-timeout", "0"), ("--start-timeout", "inf"),
                                        ("--start-timeout", "soon")])
def test_bad_values_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE, flag, value])
    assert flag in capsys.readouterr().err


def test_the_flags_reach_the_deployments_config(monkeypatch):
    """``ray-moe serve`` hands the elasticity flags to run_server, which builds the RuntimeConfig with them."""
    from ray_moe.apps import cli, server
    from ray_moe.ray import connection

    seen: dict = {}
    monkeypatch.setattr(connection, "join_cluster", lambda *a, **k: None)
    monkeypatch.setattr(server, "run_server", lambda args, config_fields=None, **kw: seen.update(config_fields) or 0)
    assert cli.main([*BASE, "--heal-retries", "3", "--max-ranks", "4", "--eplb", "periodic:5"]) == 0
    assert seen["heal_retries"] == 3 and seen["scaling"].max_ranks == 4 and seen["scaling"].enabled
    assert seen["eplb"] is not None


def test_the_payload_format_flag_sets_the_config_field(capsys):
    """--payload-format: how routed rows cross ranks (unset: the config's default, native rows)."""
    assert "payload_format" not in serve_config_fields(build_parser().parse_args(BASE))
    f = serve_config_fields(build_parser().parse_args([*BASE, "--payload-format", "fp8_block128"]))
    assert f["payload_format"] == "fp8_block128"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE, "--payload-format", "fp4"])
    assert "--payload-format" in capsys.readouterr().err
