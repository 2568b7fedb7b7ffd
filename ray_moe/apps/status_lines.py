"""Lines ``ray-moe status`` (and the demo) print for the coordinator's autopilot and elastic operations, from
the JSON of its ``status()``: ``eplb`` (``control/autopilot.py``) and ``operation`` (``control/operations.py``)."""

from __future__ import annotations

import time

__all__ = ["autopilot_lines", "operation_lines"]


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
