"""``ray-moe serve``'s elasticity as a user runs it (issue 42): the deployment started by the CLI process, the
generation loop in the Serve replica, HTTP traffic.

* ``--max-ranks``: the scaler's signals come from where the generation loop runs (the replica reports them to the
  coordinator); requests that wait make it add a rank. (It used to run in the CLI process and sample
  ``waiting=0, running=0`` forever.)
* ``--heal-retries 2`` (the default): a shard killed under a request is replaced on a machine with no spare CPU,
  in the dead rank's own placement-group bundle; the request completes token-equal. (The replica's healer used to
  ask for a fresh bundle, which never came.)

One server for both tests (a start costs seconds): the scale-out runs first, the kill second.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import ray  # noqa: E402

from ray_moe_dev.testing.hf_models import tiny_model  # noqa: E402

NAME = "serve-elastic"
# the CLI's --max-ranks scaling with short timings (the defaults wait 30 s after a start before any change)
FAST = dict(target_wait_s=0.5, cooldown_s=1.0, tick_s=0.2, idle_s=600.0, hysteresis=0.0)


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory, serve_port, serve_running):
    from ray_moe.apps import cli
    from ray_moe.apps.serve_flags import normalize_serve_args

    model, folder = tiny_model("qwen3_moe", tmp_path_factory.mktemp("elastic") / "tiny-elastic")
    model.eval()
    args = cli.build_parser().parse_args(
        ["serve", str(folder), "--data-parallel-size", "2", "--max-ranks", "3", "--max-num-seqs", "2",
         "--kv-tokens", "512", "--block-size", "8", "--max-num-batched-tokens", "64", "--name", NAME,
         "--port", str(serve_port)])
    normalize_serve_args(args, cli.BadInput)
    fields = cli.serve_config_fields(args)
    assert fields["heal_retries"] == 2 and fields["scaling"].max_ranks == 3  # what `ray-moe serve` would run
    fields["scaling"] = fields["scaling"].model_copy(update=FAST)
    with serve_running(args, config_fields=fields) as base:
        yield base


def _status(rt) -> dict:
    return ray.get(rt.coordinator.status.remote(), timeout=60)


def _complete(base: str, prompt: list[int], n: int) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=180,
                   json={"model": "tiny-elastic", "prompt": prompt, "max_tokens": n, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_scale_out_under_serve_load(server):
    """Twelve requests at once with two running at a time: the waiting ones make the coordinator's scaler add a
    third rank while they are served; every request completes."""
    import ray_moe

    rt = ray_moe.Runtime.connect(NAME)
    assert _status(rt)["group"] == [0, 1]
    done: list[dict] = []
    threads = [threading.Thread(target=lambda i=i: done.append(_complete(server, [3 + i, 9, 27, 4], 24)))
               for i in range(12)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_status(rt)["group"]) < 3:
        time.sleep(0.2)
    for th in threads:
        th.join(timeout=180)
    st = _status(rt)
    assert len(st["group"]) == 3, st
    assert len(done) == 12 and all(len(c["token_ids"]) == 24 for c in done)
    while time.monotonic() < deadline and not any(e.get("action") == "add" and "done" in e
                                                  for e in rt.scale_events()):  # (written once the add is done)
        time.sleep(0.1)
    events = rt.scale_events()
    added = [e for e in events if e.get("action") == "add" and e.get("done")]
    assert added, [e for e in events if e.get("action") != "hold"]
    assert added[0]["waiting"] > 0 and added[0]["oldest_wait_s"] > FAST["target_wait_s"], added
    assert added[0]["ranks"] == 2 and added[0]["rank"] == 2 and added[0]["reason"] == "queue_wait"
    rt.close()


def test_killed_shard_is_replaced_in_its_own_bundle_with_no_spare_cpu(server):
    """Every CPU the deployment does not hold is taken; a shard is killed while a request streams: the request
    completes token-equal to the same request before the kill, and a replacement starts in the dead rank's
    placement-group bundle (no fresh bundle could fit)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    import ray_moe

    rt = ray_moe.Runtime.connect(NAME)
    prompt = [5, 17, 40, 2, 9]
    want = _complete(server, prompt, 100)["token_ids"]
    free = ray.available_resources().get("CPU", 0.0)
    hog = placement_group([{"CPU": free}]) if free >= 0.01 else None
    if hog is not None:
        ray.get(hog.ready(), timeout=60)
    try:
        assert ray.available_resources().get("CPU", 0.0) < 0.01  # no room for a fresh bundle anywhere
        st = _status(rt)
        ranks = list(st["group"])
        members = {int(r): m for r, m in st.get("members", {}).items()}
        victim = ranks[-1]
        seen: list = []
        got: dict = {}

        def stream() -> None:
            with httpx.stream("POST", f"{server}/v1/completions", timeout=180,
                              json={"model": "tiny-elastic", "prompt": prompt, "max_tokens": 100, "temperature": 0,
                                    "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])["choices"]
                        if ch:
                            seen.extend(ch[0].get("token_ids") or [])
                            got["finish"] = ch[0].get("finish_reason") or got.get("finish")

        th = threading.Thread(target=stream)
        th.start()
        deadline = time.monotonic() + 60
        while len(seen) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 10 <= len(seen) < 100, "the request finished before the kill: make it longer"
        ray.kill(rt.shards[victim])
        th.join(timeout=180)
        assert seen == want and got["finish"] == "length"  # nothing lost through the kill
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            st = _status(rt)
            if len(st["group"]) == len(ranks) and victim not in st["group"]:
                break
            time.sleep(0.2)
        assert victim not in st["group"] and len(st["group"]) == len(ranks), st
        new = [r for r in st["group"] if r not in ranks]
        assert len(new) == 1, st
        now = {int(r): m for r, m in st["members"].items()}
        assert now[new[0]]["bundle"] == members[victim]["bundle"] and now[new[0]]["node"] == members[victim]["node"]
        healed = [e for e in st["healer"]["events"] if e.get("replacement") == new[0]]
        assert healed and healed[0]["lost"] == victim, st["healer"]
        assert _complete(server, prompt, 100)["token_ids"] == want  # the healed group serves the same tokens
    finally:
        rt.close()
        if hog is not None:
            remove_placement_group(hog)
