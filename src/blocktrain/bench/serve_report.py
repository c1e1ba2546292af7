"""The result of ``blocktrain bench serve``: its summary keys and the markdown table."""

from __future__ import annotations

from typing import Any

from blocktrain.bench.serve_options import ServeBenchOptions
from blocktrain.bench.serve_spec import long_summary, spec_markdown

LONG_ROWS = {"baseline": "AR baseline (E2E, KV cache; re-prefills the last window per byte)",  # result key -> label
             "spec": "stack spec (windowed frames past the context)",
             "stack_ar": "stack ar (same model as spec; re-prefills the last window per byte)"}


def summarise(opts: ServeBenchOptions, main: dict[str, Any], network: dict[str, Any]) -> dict[str, Any]:
    """The result's summary keys; ``network``: where the stages ran (``Placement.describe()``)."""
    t, q = main["tasks"], main["quality"]
    n, hops = opts.output_bytes, 3
    k = min(opts.sweeps)  # the headline sweep: the fewest sweeps measured (k = 1 by default; --sweeps 2,4 has none)
    sweep, ar, base = t[f"sweep_k{k}"], t["ar"], t["baseline"]
    floor = hops * opts.hop_delay_ms / 1000 + main["traversal_compute_s"]
    return {
        "hop_delay_ms": opts.hop_delay_ms, "hops_per_traversal": hops, "output_bytes": n,
        "prompt_bytes": opts.prompt_bytes, "temperature": opts.temperature, "top_k": opts.top_k,
        "network": network, "sweep_k": k,
        "sweep_seconds": sweep["seconds"], "ar_seconds": ar["seconds"], "ar_baseline_seconds": base["seconds"],
        "sweep_bytes_per_s": n / sweep["seconds"], "ar_bytes_per_s": n / ar["seconds"],
        "ar_baseline_bytes_per_s": n / base["seconds"],
        "sweep_wire_bytes": sweep["stage_bytes_out"], "ar_wire_bytes": ar["stage_bytes_out"],
        "ar_baseline_wire_bytes": base["stage_bytes_out"],
        "speedup_sweep_vs_baseline": base["seconds"] / sweep["seconds"],
        "speedup_sweep_vs_ar": ar["seconds"] / sweep["seconds"],
        "floor_seconds": floor, "floor_compute_seconds": main["traversal_compute_s"],
        "sweep_over_floor": sweep["seconds"] / floor,
        "sweep_generative_ce": q[f"sweep_k{k}"]["generative_ce"], "ar_generative_ce": q["ar"]["generative_ce"],
        "baseline_generative_ce": q["baseline"]["generative_ce"],
        "reference_continuation_ce": main["reference_continuation_ce"],
        "sweeps": {name: {"seconds": t[name]["seconds"], "wire_bytes": t[name]["stage_bytes_out"],
                          "generative_ce": q[name]["generative_ce"],
                          "repeat_4gram_fraction": q[name]["repeat_4gram_fraction"]}
                   for name in t if name.startswith("sweep_")},
        **_diffusion_spec(t, q, n, base["seconds"]),
        **({"long_output_bytes": opts.long_output_bytes} if opts.long_output_bytes else {}),
        **(long_summary("baseline", t["baseline_long"], q["baseline_long"]) if "baseline_long" in t
           else {}),
        "quality": q, "teacher_forced_ce": main["teacher_forced"], "model": main["model"],
        "timings": {k: {"seconds_all": v["seconds_all"], "client_bytes_out": v["client_bytes_out"]}
                    for k, v in t.items()},
    }


def _diffusion_spec(t: dict[str, Any], q: dict[str, Any], n: int, baseline_s: float) -> dict[str, Any]:
    """The diffusion run's spec row (block 0 alone drafts), where the main comparison ran it."""
    if "diffusion_spec" not in t:
        return {}
    s = t["diffusion_spec"]
    return {"diffusion_spec_seconds": s["seconds"], "diffusion_spec_bytes_per_traversal": n / float(s["traversals"]),
            "diffusion_spec_wire_bytes": s["stage_bytes_out"], "diffusion_spec_generative_ce": q["diffusion_spec"]["generative_ce"],
            "speedup_diffusion_spec_vs_baseline": baseline_s / s["seconds"]}


def long_markdown(r: dict[str, Any]) -> list[str]:
    """The long rows' table (outputs of several context windows), when the result has any."""
    rows = [(label, name) for name, label in LONG_ROWS.items() if f"{name}_long_seconds" in r]
    if not rows:
        return []
    n, ctx = r["long_output_bytes"], r["model"]["context"]
    lines = ["", f"Long outputs: {n} bytes after the same prompts ({(r['prompt_bytes'] + n) / ctx:.1f} context windows "
             "of text), every mode sliding its window as local generate does.", "",
             "| mode | time to full output (s) | bytes/s | bytes written by stages | generative CE (nats/byte) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for label, name in rows:
        s = r[f"{name}_long_seconds"]
        per = r.get(f"{name}_long_bytes_per_traversal")
        label = label if per is None else f"{label}, {per:.2f} bytes/traversal"
        sem = r.get(f"{name}_long_generative_ce_sem")
        lines.append(f"| {label} | {s:.3f} | {n / s:.1f} | {r[f'{name}_long_wire_bytes']:,} "
                     f"| {r[f'{name}_long_generative_ce']:.3f}{'' if sem is None else f' ± {sem:.3f}'} |")
    if r.get("spec_long_generative_ce_sem") is not None and r.get("stack_ar_long_generative_ce_sem") is not None:
        gap = r["spec_long_generative_ce"] - r["stack_ar_long_generative_ce"]
        se = (r["spec_long_generative_ce_sem"] ** 2 + r["stack_ar_long_generative_ce_sem"] ** 2) ** 0.5
        lines += ["", f"Spec minus ar, long outputs: {gap:+.3f} ± {se:.3f} nats/byte (± one standard error over "
                  f"{len(r['spec_long_generative_ce_per_prompt'])} prompts; the two sample independently)."]
    return lines


def render_markdown(r: dict[str, Any]) -> str:
    """A short human-readable summary of a serve.json result."""
    n = r["output_bytes"]
    sweeps = sorted(r["sweeps"].items(), key=lambda kv: int(kv[0].split("_k")[1]))
    rows = [(f"BlockTrain sweep (k={name.split('_k')[1]})", v["seconds"], v["wire_bytes"], v["generative_ce"])
            for name, v in sweeps]
    rows += [("BlockTrain ar", r["ar_seconds"], r["ar_wire_bytes"], r["ar_generative_ce"])]
    if "diffusion_spec_seconds" in r:
        rows.append((f"BlockTrain spec (block 0 drafts, {r['diffusion_spec_bytes_per_traversal']:.2f} bytes/traversal)",
                     r["diffusion_spec_seconds"], r["diffusion_spec_wire_bytes"], r["diffusion_spec_generative_ce"]))
    rows += [
        ("AR baseline (E2E, KV cache)", r["ar_baseline_seconds"], r["ar_baseline_wire_bytes"],
         r["baseline_generative_ce"]),
    ]
    net = r["network"]
    lines = [
        "# Pipelined serving benchmark",
        "",
        f"Three stages, {r['hop_delay_ms']:.0f} ms one way per hop ({net['delay']}; namespaces: {net['namespaces']}),"
        f" {r['hops_per_traversal']} hops per traversal, client beside stage 0. Output: {n} bytes after a "
        f"{r['prompt_bytes']}-byte prompt, temperature {r['temperature']}, top-k {r['top_k']}.",
        "",
        "| mode | time to full output (s) | bytes/s | bytes written by stages | generative CE (nats/byte) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {a} | {s:.3f} | {n / s:.1f} | {w:,} | {ce:.3f} |" for a, s, w, ce in rows]
    lines += spec_markdown(r)
    lines += long_markdown(r)
    tf = r["teacher_forced_ce"]
    lines += [
        "",
        f"- Speedup of sweep (k = {r.get('sweep_k', 1)}) over the AR baseline: **{r['speedup_sweep_vs_baseline']:.1f}x**; "
        "over BlockTrain ar: "
        f"{r['speedup_sweep_vs_ar']:.1f}x.",
        f"- Floor: {r['hops_per_traversal']} x {r['hop_delay_ms']:.0f} ms + one pass of block compute "
        f"({r['floor_compute_seconds']:.3f} s) = {r['floor_seconds']:.3f} s; sweep takes "
        f"{r['sweep_over_floor']:.2f}x the floor.",
        f"- Reference: the true test continuations score {r['reference_continuation_ce']:.3f} nats/byte under the E2E "
        "model. Generative CE is measured under the E2E model, which favours the baseline's own samples.",
        f"- Teacher-forced CE on {tf['bytes']:,} test bytes: BlockTrain through the pipeline (score) "
        f"{tf['blocktrain_pipeline_score']:.4f}, BlockTrain local {tf['blocktrain_local']:.4f}, "
        f"E2E {tf['e2e_local']:.4f} nats/byte.",
    ]
    lines += [
        "",
        "Caveats:",
        "- Where the kernel lacks netem (as here), the delay is injected per frame by each stage on its forward link:",
        "  propagation delay is modelled, TCP window growth over a long-RTT path is not.",
        "- Bytes are application bytes written by the stages (frames, custody ACKs, results), not TCP/IP headers.",
        f"- Sweep text is {'worse' if r['sweep_generative_ce'] > r['ar_generative_ce'] else 'not worse'} than ar "
        f"({r['sweep_generative_ce']:.2f} vs {r['ar_generative_ce']:.2f} nats/byte generative CE; baseline "
        f"{r['baseline_generative_ce']:.2f}); best sweep k: {min(r['sweeps'], key=lambda k: r['sweeps'][k]['generative_ce'])}.",
        "",
        "Command: `" + r["commands"]["bench"] + "`",
        "",
    ]
    return "\n".join(lines)


