"""Lines ``ray-moe status`` (and the demo) print for the coordinator's autopilot and elastic operations, from
the JSON of its ``status()``: ``eplb`` (``control/autopilot.py``), ``operation`` (``control/operations.py``) and the
target and members (``ray/reconciler.py``)."""

from __future__ import annotations

import time

__all__ = ["autopilot_lines", "members_lines", "operation_lines"]


def autopilot_lines(eplb: dict | None, *, now: float | None = None) -> list[str]:
    """The autopilot's mode and policy, its last rebalance and its last decisions (oldest first), from the
    coordinator's ``status()["eplb"]``: each with its step, generation, action, reason and numbers (imbalance
    now -> predicted, gain, bytes) and what came of it (the generation it published, or the error)."""
    if not eplb:
        return []
    pol, now = eplb.get("policy", {}), time.time() if now is None else now
    head = f"autopilot: mode {eplb['mode']}"
    if eplb["mode"] == "auto":
        head += (f" (gain >= {pol.get('threshold_gain', 0):.2f}, at least {pol.get('min_interval_s', 0):g}s and "
                 f"{pol.get('min_interval_steps', 0)} load steps apart"
                 + (f", <= {pol['byte_budget']} B" if pol.get("byte_budget") else "") + ")")
    elif eplb["mode"] == "periodic":
        head += f" (every {pol.get('periodic_steps')} load steps)"
    head += f", {eplb.get('load_steps', 0)} load steps seen"
    lr = eplb.get("last_rebalance")
    head += (f"; last rebalance {now - lr['t']:.0f}s ago at load step {lr['step']}" if lr else "; no rebalance yet")
    out = [head]
    decisions = eplb.get("decisions") or []
    if decisions:
        out.append("  decisions (oldest first):")
    for d in decisions:
        nums = []
        if d.get("imbalance_now") is not None:
            nums.append(f"imbalance {d['imbalance_now']:.3f}" + (
                f" -> {d['imbalance_predicted']:.3f}" if d.get("imbalance_predicted") is not None else ""))
        if d.get("gain") is not None:
            nums.append(f"gain {d['gain']:.3f}")
        if d.get("bytes") is not None:
            nums.append(f"{d['bytes']} B")
        if d.get("taken"):
            what = f"published generation {d['new_generation']}" + (
                f" in {d['publish_s']:.2f}s" if d.get("publish_s") is not None else "")
        elif d.get("error"):
            what = f"FAILED: {d['error']}"
        else:
            what = ""
        line = f"    step {d['step']:>5} gen {d['generation']}  {d['action'].upper():<9} {d['reason']:<20}"
        line += "  " + ", ".join(nums) if nums else ""
        line += f"  -> {what}" if what else ""
        line += f"  (x{d['repeats'] + 1})" if d.get("repeats") else ""
        out.append(line.rstrip())
    return out


def operation_lines(op: dict | None) -> list[str]:
    """The elastic operation in flight (its stage, the stage's time against its deadline, progress) and the
    last ones that ended, from the coordinator's ``status()["operation"]``."""
    if not op:
        return []
    cur, out = op.get("in_flight"), []
    if cur is None:
        out.append("operation in flight: none")
    else:
        prog = (f"; {cur['copies_done']} of {cur['copies_planned']} copies, {cur['bytes_copied']} B copied"
                + (f" of {cur['bytes_planned']} B" if cur.get("bytes_planned") else "")
                if cur.get("copies_planned") is not None else "")
        stage = ("starting" if cur["stage"] is None else f"stage {cur['stage']} {cur['stage_elapsed_s']:.1f}s of its "
                 f"{cur['stage_deadline_s']:g}s deadline")
        out.append(f"operation in flight: {cur['reason']} (generation {cur['generation']}): {stage}, "
                   f"{cur['elapsed_s']:.1f}s in all{prog}")
    for d in op.get("recent") or []:
        late = f", rank(s) {d['late_ranks']} did not answer" if d.get("late_ranks") else ""
        why = f": {d['error']}" if d.get("error") and d["outcome"] != "done" else ""
        out.append(f"  {d['outcome'].upper():<8} {d['reason']} (generation {d['generation']}) at stage {d['stage'] or 'start'} "
                   f"after {d['elapsed_s']:.2f}s{late}{why}")
    return out


def members_lines(ctl: dict | None) -> list[str]:
    """The deployment's target and members from the coordinator's ``status()`` (``ray/reconciler.py``): the target
    (ranks, ranks asked out, who set it last and why, converged or not), each rank's state, bundle and node, the
    healer's last outcomes and the scaler's last change."""
    if not ctl or not ctl.get("target"):
        return []
    t = ctl["target"]
    out = [f"target: {t['ranks']} ranks" + (f", ranks {t['remove']} asked out" if t.get("remove") else "")
           + f" (version {t['version']}, set by {t['set_by']}: {t['reason']}); "
           + ("converged" if ctl.get("converged") else "converging")]
    for r, m in sorted((ctl.get("members") or {}).items(), key=lambda kv: int(kv[0])):
        bundle = m.get("bundle")
        where = f"bundle {bundle[1]} of {bundle[0][:8]}" if bundle else "no bundle"
        note = f", replaced rank {m['replaces']}" if m.get("replaces") is not None else ""
        out.append(f"  rank {r}: {m['state']}{' (died)' if m.get('died') else ''}, {where}, node "
                   f"{(m.get('node') or '?')[:8]}{note}")
    healer = ctl.get("healer") or {}
    heal = "off" if not healer.get("retries") else f"{healer['retries']} attempts per lost rank"
    events = healer.get("events") or []
    out.append(f"healing: {heal}" + (f"; replacing {healer['healing']}" if healer.get("healing") else "")
               + ("; last: " + "; ".join(_heal_event(e) for e in events[-3:]) if events else ""))
    scaler = ctl.get("scaler")
    if scaler:
        changes = [e for e in scaler.get("events") or [] if e.get("action") != "hold" or e.get("error")]
        pol = scaler.get("policy") or {}
        out.append(f"scaling: {pol.get('min_ranks')}..{pol.get('max_ranks')} ranks"
                   + (f"; last change: {changes[-1].get('action')} ({changes[-1].get('reason')})"
                      + (f", rank {changes[-1]['rank']}" if changes[-1].get("rank") is not None else "")
                      if changes else "; no change yet"))
    return out


def _heal_event(e: dict) -> str:
    if "replacement" in e:
        return f"rank {e['lost']} -> {e['replacement']} in {e['seconds']}s"
    if e.get("left_out"):
        return f"rank {e['lost']} left out ({e['reason']})"
    return f"rank {e['lost']} attempt {e.get('attempt')} failed"
