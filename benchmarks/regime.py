"""`spectrain bench regime`: where speculative decoding can pay on this machine, by target size and concurrency.

Speculation trades one target forward per token for one per `k + 1` tokens, plus `k` draft passes. Whether that
pays depends on how expensive a target step is next to a draft pass (the target's depth and width) and on how
much a target step costs per sequence (the concurrency). This benchmark maps both at the *best case*: the target
and its one-layer EAGLE-3 draft always agree, so every proposal is accepted (acceptance length `k + 1`). Their
final norms are zero, so both pick token 0 every time while every layer still runs at full cost (greedy,
`ignore_eos`). A real draft accepts less (3.5 of 4 in the demo): the measured ceiling, scaled by how much less,
says where a real draft can win.

For every size (`layers x hidden`, bf16 by default) it starts one plain engine and one EAGLE-3 engine with `k`
tokens, then decodes `new_tokens` tokens for each concurrency (1 warm-up call, then `repeats` paired calls, the
order alternating) and reports tokens/s of both and their ratio (median of the paired ratios, min..max).

Writes `regime.json`, `regime.md` and `regime.png` under `out`.

Usage: `spectrain bench regime [sizes=4x128,8x512,16x1024] [concurrency=1,4,16,64] [k=3] [new_tokens=64]
[repeats=2] [dtype=bfloat16] [out=runs/bench_regime] [work=runs/bench_regime]`.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from benchmarks.common import int_list, paired_ratios, parse_options
from spectrain.errors import ConfigError
from spectrain.machine import machine_label
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft, export_draft
from spectrain.models.hf_io import save_pretrained
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM
from spectrain.plots import plot_panels

DEFAULTS = {"sizes": "4x128,8x512,16x1024", "concurrency": "1,4,16,64", "k": 3, "new_tokens": 64, "repeats": 2,
            "dtype": "bfloat16", "out": "runs/bench_regime", "work": "runs/bench_regime"}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
VOCAB = 128
PROMPT_TOKENS = 16


def log(msg: str) -> None:
    print(f"[bench regime {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        layers, _, hidden = item.partition("x")
        if not (layers.isdigit() and hidden.isdigit() and int(layers) >= 4 and int(hidden) % 64 == 0):
            raise ConfigError(f"bench regime: sizes: {item!r} is not LAYERSxHIDDEN with LAYERS >= 4 (the EAGLE-3 "
                              f"draft taps three distinct layers) and HIDDEN a multiple of 64, e.g. "
                              f"sizes=4x128,16x1024")
        sizes.append((int(layers), int(hidden)))
    return sizes


def agreeing_models(layers: int, hidden: int, work: Path, dtype: torch.dtype) -> tuple[Path, Path, float]:
    """A target and draft that always pick token 0 (zero final norms: all logits 0); their dirs and the target's
    parameter count in millions."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=256)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg)
    draft = Eagle3Draft(Eagle3Config.from_policy(cfg))
    with torch.no_grad():
        target.model.norm.weight.zero_()
        draft.norm.weight.zero_()
    target_dir = save_pretrained(target, work / "target", dtype=dtype)
    from spectrain.tasks.tokenizer import save_tokenizer

    save_tokenizer(target_dir)
    draft_dir = export_draft(draft, work / "draft", cfg, dtype=dtype)
    return target_dir, draft_dir, sum(p.numel() for p in target.parameters()) / 1e6


def tokens_per_s(engine, prompts: list[list[int]], new_tokens: int) -> float:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == len(prompts) * new_tokens, (generated, len(prompts), new_tokens)
    return generated / seconds


def measure_size(layers: int, hidden: int, opts: dict, work: Path) -> dict:
    from spectrain.rollout.vllm.engine import VLLMRolloutEngine

    dtype = opts["dtype"]
    target_dir, draft_dir, millions = agreeing_models(layers, hidden, work / f"{layers}x{hidden}", DTYPES[dtype])
    common = dict(max_model_len=PROMPT_TOKENS + opts["new_tokens"] + opts["k"] + 8, kv_cache_gib=1, dtype=dtype)
    plain = VLLMRolloutEngine(target_dir, **common)
    spec = VLLMRolloutEngine(target_dir, draft_dir, num_speculative_tokens=opts["k"], **common)
    rng = random.Random(0)
    points = []
    try:
        for c in opts["concurrency"]:
            prompts = [[rng.randrange(4, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(c)]
            for engine in (plain, spec):  # warm-up at this batch size
                tokens_per_s(engine, prompts, min(8, opts["new_tokens"]))
            rates = {"plain": [], "spec": []}
            for r in range(opts["repeats"]):
                for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                    rates[name].append(tokens_per_s(plain if name == "plain" else spec, prompts, opts["new_tokens"]))
            acceptance = spec.spec_decode_counters().mean_acceptance_length
            ratio = paired_ratios(rates["spec"], rates["plain"])
            points.append({"concurrency": c, "plain_tokens_per_s": rates["plain"], "spec_tokens_per_s": rates["spec"],
                           "speedup": ratio, "acceptance_length": acceptance})
            log(f"{layers}x{hidden} ({millions:.0f}M) at {c}: plain {max(rates['plain']):.0f} tok/s, "
                f"k={opts['k']} {max(rates['spec']):.0f} tok/s, {ratio['median']:.2f}x")
    finally:
        plain.shutdown()
        spec.shutdown()
    return {"layers": layers, "hidden": hidden, "params_millions": round(millions, 1), "points": points}


def markdown(payload: dict) -> str:
    o = payload["options"]
    lines = [
        "# Where speculative decoding can pay on this machine",
        "",
        f"`{payload['command']}` on {payload['machine']}, {payload['seconds']:.0f} s.",
        "",
        f"Best case: target and EAGLE-3 draft always agree (acceptance length {o['k'] + 1} at k={o['k']}; "
        f"measured {payload['min_acceptance']:.2f} or more). Greedy, {o['new_tokens']} new tokens per sequence "
        f"after {PROMPT_TOKENS}-token prompts, {o['dtype']}, vocabulary {VOCAB}; the draft is one layer as wide "
        "as the target. Speedup: speculative over plain tokens/s, median of "
        f"{o['repeats']} paired calls (min..max).",
        "",
        "| target | params | " + " | ".join(f"{c} seqs" for c in o["concurrency"]) + " |",
        "|---|---|" + "---|" * len(o["concurrency"]),
    ]
    for size in payload["sizes"]:
        cells = []
        for p in size["points"]:
            s = p["speedup"]
            cells.append(f"**{s['median']:.2f}x** ({s['min']:.2f}..{s['max']:.2f}; "
                         f"{max(p['plain_tokens_per_s']):.0f} -> {max(p['spec_tokens_per_s']):.0f} tok/s)")
        lines.append(f"| {size['layers']} x {size['hidden']} | {size['params_millions']:.0f}M | "
                     + " | ".join(cells) + " |")
    lines += [
        "",
        "Above 1x speculation is faster, below 1x slower. A real draft accepts fewer tokens than this ceiling: "
        "with acceptance length a instead of k+1 the speculative rate scales by about a/(k+1), so a cell pays "
        "with a real draft only where its speedup exceeds (k+1)/a (1.14x at the demo's 3.5 of 4).",
        "",
        "![speedup by concurrency and target size](regime.png)",
        "",
    ]
    return "\n".join(lines)


def parse(args: list[str]) -> tuple[dict, list[tuple[int, int]]]:
    """The options and the target sizes, checked before anything runs."""
    opts = parse_options("regime", args, DEFAULTS)
    opts["concurrency"] = int_list("regime", "concurrency", str(opts["concurrency"]))
    sizes = parse_sizes(str(opts["sizes"]))
    for key in ("k", "new_tokens", "repeats"):
        opts[key] = int(opts[key])
        if opts[key] < 1:
            raise ConfigError(f"bench regime: {key}={opts[key]}: it must be >= 1")
    if opts["dtype"] not in DTYPES:
        raise ConfigError(f"bench regime: dtype={opts['dtype']}: use one of {sorted(DTYPES)}")
    return opts, sizes


def main(args: list[str]) -> int:
    opts, sizes = parse(args)
    started = time.perf_counter()
    work, out = Path(opts["work"]), Path(opts["out"])
    results = [measure_size(layers, hidden, opts, work) for layers, hidden in sizes]
    payload = {"command": "spectrain bench regime " + " ".join(args), "machine": machine_label(),
               "seconds": time.perf_counter() - started, "options": {**opts, "sizes": str(opts["sizes"])},
               "min_acceptance": min(p["acceptance_length"] for s in results for p in s["points"]), "sizes": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "regime.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "regime.md").write_text(markdown(payload))
    series = {f"{s['layers']}x{s['hidden']} ({s['params_millions']:.0f}M)":
              ([p["concurrency"] for p in s["points"]], [p["speedup"]["median"] for p in s["points"]])
              for s in results}
    plot_panels(out / "regime.png", f"speculation at full agreement, k={opts['k']}: speculative / plain tokens/s",
                [("speedup (x)", series)], xlabel="concurrent sequences", logx=True)
    log(f"wrote {out / 'regime.md'}")
    return 0
