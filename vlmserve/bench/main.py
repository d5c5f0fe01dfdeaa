"""`vlmserve bench`: vlmserve against transformers' generate on the same checkpoint, requests and
machine, in one run.

1. The workload (default: 32 requests, one 448x448 image each, ~64 text tokens, outputs spread
   over 32..256 tokens, eos ignored) through vlmserve with every request in flight, and through
   transformers at its best static batch size (chosen by a probe, then run for real).
2. One request alone: time to first token (encode the image + prefill the prompt) and time per
   output token (a decode step), both engines.
3. Sweeps (vlmserve; transformers too with --sweep-hf): concurrency, and image size.
Prints the numbers and ratios and how many workload requests got the same greedy tokens from
both engines (every request's tokens are in bench.json), writes bench.json and bench.png to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from vlmserve.bench.metrics import RunResult, greedy_agreement, print_table
from vlmserve.bench.options import add_arguments
from vlmserve.bench.run_hf import load_hf_model, probe_batch_sizes, run_hf
from vlmserve.bench.run_vlmserve import run_vlmserve
from vlmserve.bench.sampling import sampling_fields
from vlmserve.bench.single import run_single
from vlmserve.bench.workload import BenchRequest, make_workload, max_model_len_for
from vlmserve.entrypoints.llm import LLM
from vlmserve.entrypoints.llm_engine import LLMEngine
from vlmserve.kernels.dispatch import linear_op_json
from vlmserve.models.layers import bound_linear_op
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Phases:
    """Says which phase the benchmark is in, out of how many, and how long it has run."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.single:
            self.total = 2 + (0 if args.no_hf else 1)
        else:
            self.total = 3 + (0 if args.no_hf else 3) + bool(args.concurrency) + bool(args.image_sizes)
            self.total += len(args.sampling) > 1
        self.done = 0
        self.start = time.perf_counter()

    def begin(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        logger.info("phase %d of %d: %s (%.0f s so far)", self.done, self.total, what, elapsed)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.model is None:
        from vlmserve.tools.tiny_checkpoint import bench_checkpoint_dir

        args.model = str(bench_checkpoint_dir())
    max_out = max(args.output_len[1], args.single_output_len, args.sweep_output_len[1])
    biggest = max([args.image_size, *args.image_sizes])
    max_model_len = max_model_len_for(biggest, args.input_len, max_out)
    max_seqs = 4 if args.single else max([args.num_requests, *args.concurrency, 1])
    phases = Phases(args)
    phases.begin("vlmserve: loading the model")
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_model_len=max_model_len,
        max_num_seqs=max_seqs,
        quantization=args.quantization,
    )
    engine = llm.llm_engine
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": args.threads,
            "torch": torch.__version__,
        },
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "vlmserve_startup_s": round(time.perf_counter() - t0, 2),
        "memory_plan": engine.memory_plan.describe(),
        # Which matrix product each layer shape and row count got (CPU bf16: kernels/dispatch.py).
        "linear_layers": linear_op_json(bound_linear_op(engine.model)),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    # SamplingParams fields of each --sampling spec; the first is what every run but the extra
    # workload runs samples with (transformers' through generate).
    samplings = {spec: sampling_fields(spec, engine.frontend.sampling_defaults) for spec in args.sampling}
    args.sampling_fields = samplings[args.sampling[0]]
    report["sampling"] = samplings
    size = (args.image_size, args.image_size)
    single = make_workload(llm, 1, size, args.input_len, (args.single_output_len,) * 2, args.seed + 1)
    warmup = make_workload(llm, 2, (56, 56), 8, (4, 4), args.seed + 2)
    for fields in samplings.values():
        run_vlmserve(engine, warmup, 2, tag="-warmup", sampling=fields)
    if args.single:
        return _run_single(args, llm, single, report, phases)
    workload = make_workload(llm, args.num_requests, size, args.input_len, tuple(args.output_len), args.seed)

    # NOTE: every measured vlmserve run starts from empty prefix and encoder caches: transformers
    # has none, and a repeated request would otherwise be served from them.
    engine.reset_prefix_cache()
    phases.begin(f"vlmserve: the workload ({args.num_requests} requests, all in flight)")
    sampling = args.sampling_fields
    ours = run_vlmserve(engine, workload, args.num_requests, desc="vlmserve workload", sampling=sampling)
    results: dict[str, Any] = {"vlmserve": {"workload": ours.to_json()}}
    if len(samplings) > 1:
        results["vlmserve"]["workload_by_sampling"] = _by_sampling(args, engine, workload, ours, samplings, phases)

    hf_model = None
    if args.no_hf:
        engine.reset_prefix_cache()
        phases.begin("vlmserve: one request alone")
        alone = run_vlmserve(engine, single, 1, tag="-single", desc="one request", sampling=sampling)
        results["vlmserve"]["single"] = [alone.to_json()]
        print_table("workload", [ours.summary()], list(ours.summary()))
        print_table("one request alone", [alone.summary()], list(alone.summary()))
    else:
        hf_model = _load_transformers(args, llm, phases)
        phases.begin("transformers: probing batch sizes")
        best, probes = probe_batch_sizes(hf_model, workload, args.hf_batch_sizes)
        phases.begin(f"transformers: the workload at batch size {best}")
        theirs = run_hf(hf_model, workload, best, desc="transformers workload", sampling=sampling)
        # Where both engines took the argmax (greedy, or a top_k of 1 as Qwen2-VL's defaults),
        # their tokens say whether the numbers compare like with like (a fast engine producing
        # other tokens is no result); sampled tokens differ by chance.
        if SamplingParams(**sampling).takes_argmax:
            report["greedy_agreement"] = greedy_agreement(ours, theirs)
        # One request alone, alternating engines so that both see the same machine conditions
        # (this machine's memory bandwidth drifts by tens of percent over minutes).
        ours_single: list[RunResult] = []
        theirs_single: list[RunResult] = []
        phases.begin(f"one request alone, {args.single_rounds} rounds alternating the engines")
        for r in range(args.single_rounds):
            engine.reset_prefix_cache()
            round_name = f"round {r + 1} of {args.single_rounds}"
            ours_single.append(
                run_vlmserve(engine, single, 1, tag=f"-single{r}", desc=f"vlmserve, {round_name}", sampling=sampling)
            )
            theirs_single.append(run_hf(hf_model, single, 1, desc=f"transformers, {round_name}", sampling=sampling))
        results["transformers"] = {"batch_size_probe": probes, "workload": theirs.to_json()}
        results["vlmserve"]["single"] = [x.to_json() for x in ours_single]
        results["transformers"]["single"] = [x.to_json() for x in theirs_single]
        decode = [_ratio(t.tpot_mean, o.tpot_mean) for o, t in zip(ours_single, theirs_single, strict=True)]
        prefill = [_ratio(t.ttft_mean, o.ttft_mean) for o, t in zip(ours_single, theirs_single, strict=True)]
        report["ratios"] = {
            "useful_tokens_per_s": round(_ratio(ours.useful_tokens_per_s, theirs.useful_tokens_per_s), 2),
            "workload_ttft_mean (lower is better)": round(_ratio(theirs.ttft_mean, ours.ttft_mean), 2),
            "workload_tpot_mean (lower is better)": round(_ratio(theirs.tpot_mean, ours.tpot_mean), 2),
            "single_decode_step (median of rounds)": round(statistics.median(decode), 2),
            "single_encode_and_prefill (median of rounds)": round(statistics.median(prefill), 2),
        }
        report["single_rounds"] = {
            "decode_step_ratios": [round(x, 3) for x in decode],
            "encode_and_prefill_ratios": [round(x, 3) for x in prefill],
        }
        print_table("workload", [ours.summary(), theirs.summary()], [*ours.summary(), "batch_size"])
        rows = [
            x.summary() | {"round": i}
            for i, pair in enumerate(zip(ours_single, theirs_single, strict=True))
            for x in pair
        ]
        print_table("one request alone", rows, ["round", *ours.summary()])
        agreement = report.get("greedy_agreement")
        if agreement is not None:
            print(
                f"\ngreedy tokens: {agreement['identical']} of {agreement['requests']} requests identical in both "
                "engines"
            )
        print("\nvlmserve / transformers (higher is better for vlmserve):")
        for name, value in report["ratios"].items():
            print(f"  {name}: {value}x")

    results["sweeps"] = _sweeps(args, llm, hf_model if args.sweep_hf else None, phases)
    report["results"] = results
    _print_linear_layers(report["linear_layers"])
    _write(report, args.out)
    return report


def _by_sampling(
    args: argparse.Namespace,
    engine: LLMEngine,
    workload: list[BenchRequest],
    first: RunResult,
    samplings: dict[str, dict[str, Any]],
    phases: Phases,
) -> dict[str, Any]:
    """The workload again through vlmserve with each further --sampling spec, right after the first
    (the same machine minutes): useful tokens/s of each and its ratio to the first's."""
    phases.begin(f"vlmserve: the workload with each further sampling ({len(samplings) - 1})")
    runs = {args.sampling[0]: first}
    for spec, fields in list(samplings.items())[1:]:
        engine.reset_prefix_cache()
        runs[spec] = run_vlmserve(engine, workload, args.num_requests, desc=f"vlmserve, {spec}", sampling=fields)
    rows = [
        {
            "sampling": spec,
            "useful_tokens_per_s": round(run.useful_tokens_per_s, 2),
            "x_first": round(_ratio(run.useful_tokens_per_s, first.useful_tokens_per_s), 3),
            "tpot_mean_s": round(run.tpot_mean, 4),
        }
        for spec, run in runs.items()
    ]
    print_table(f"workload by sampling (x_first: useful tokens/s over {args.sampling[0]}'s)", rows, list(rows[0]))
    return {"rows": rows, "runs": {spec: run.to_json() for spec, run in runs.items() if run is not first}}


def _run_single(
    args: argparse.Namespace, llm: LLM, single: list[BenchRequest], report: dict[str, Any], phases: Phases
) -> dict[str, Any]:
    hf_model = None if args.no_hf else _load_transformers(args, llm, phases)
    phases.begin(f"one request alone, {args.single_rounds} rounds")
    report["single"] = run_single(args, llm, hf_model, single)
    _print_linear_layers(report["linear_layers"])
    _write(report, args.out, plot=False)
    return report


def _load_transformers(args: argparse.Namespace, llm: LLM, phases: Phases) -> Any:
    """transformers' model of the same checkpoint, warmed up on a small request."""
    phases.begin("transformers: loading the model")
    hf_model = load_hf_model(args.hf_model or Path(llm.llm_engine.model_dir), getattr(torch, args.dtype))
    run_hf(hf_model, make_workload(llm, 1, (56, 56), 8, (4, 4), args.seed + 2), 1, sampling=args.sampling_fields)
    return hf_model


def _write(report: dict[str, Any], out: Path, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json"]
    written[0].write_text(json.dumps(report, indent=2) + "\n")
    if plot:
        written.append(out / "bench.png")
        _plot(report, written[1])
    print("\nwrote " + " and ".join(map(str, written)))


def _print_linear_layers(linear: dict[str, Any]) -> None:
    print(f"\nvlmserve's linear layers: {linear['how']}")
    choices = linear.get("choices")
    if choices:
        rows = [{"shape": shape} | paths for shape, paths in choices.items()]
        print_table("path per layer shape (out x in) and rows", rows, ["shape", *linear["buckets"]])


def _sweeps(args: argparse.Namespace, llm: LLM, hf_model: Any, phases: Phases) -> dict[str, list[dict[str, Any]]]:
    engine = llm.llm_engine
    sampling = args.sampling_fields
    out: dict[str, list[dict[str, Any]]] = {"concurrency": [], "image_size": []}
    side = args.image_size
    if args.concurrency:
        phases.begin(f"concurrency sweep: {args.concurrency} requests in flight")
        for c in args.concurrency:
            # Fresh requests at every level, and empty caches: nothing is served from a cache.
            reqs = make_workload(
                llm,
                args.sweep_requests,
                (side, side),
                args.input_len,
                tuple(args.sweep_output_len),
                args.seed + 100 + c,
            )
            engine.reset_prefix_cache()
            run = run_vlmserve(engine, reqs, c, tag=f"-c{c}", desc=f"vlmserve, {c} in flight", sampling=sampling)
            rows = [run.summary()]
            if hf_model is not None:
                rows.append(run_hf(hf_model, reqs, c, desc=f"transformers, batch {c}", sampling=sampling).summary())
            out["concurrency"].extend(rows)
        print_table("concurrency sweep", out["concurrency"], [*out["concurrency"][0], "batch_size"])
    if args.image_sizes:
        phases.begin(f"image size sweep: {args.image_sizes} pixels square")
        n = min(args.sweep_requests, 16)
        for s in args.image_sizes:
            reqs = make_workload(llm, n, (s, s), args.input_len, tuple(args.sweep_output_len), args.seed + 200 + s)
            engine.reset_prefix_cache()
            run = run_vlmserve(engine, reqs, n, tag=f"-s{s}", desc=f"vlmserve, {s}x{s}", sampling=sampling)
            rows = [run.summary()]
            if hf_model is not None:
                rows.append(run_hf(hf_model, reqs, n, desc=f"transformers, {s}x{s}", sampling=sampling).summary())
            for row, r in zip(rows, [reqs] * len(rows), strict=True):
                row["image_size"] = s
                row["image_tokens"] = r[0].prompt.mm_items[0].length
            out["image_size"].extend(rows)
        print_table(
            "image size sweep", out["image_size"], ["image_size", "image_tokens", *list(out["image_size"][0])[:-2]]
        )
    return out


def _plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install -e '.[bench]')")
        return
    results = report["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = ["vlmserve", *(["transformers"] if "transformers" in results else [])]
    tps = [results[n]["workload"]["summary"]["useful_tokens_per_s"] for n in names]
    axes[0].bar(names, tps, color=["tab:blue", "tab:orange"][: len(names)])
    axes[0].set_title("workload: useful output tokens/s")
    for engine, color in (("vlmserve", "tab:blue"), ("transformers", "tab:orange")):
        conc = [r for r in results["sweeps"]["concurrency"] if r["engine"] == engine]
        if conc:
            key = "concurrency" if engine == "vlmserve" else "batch_size"
            axes[1].plot(
                [r[key] for r in conc], [r["useful_tokens_per_s"] for r in conc], "o-", color=color, label=engine
            )
        sizes = [r for r in results["sweeps"]["image_size"] if r["engine"] == engine]
        if sizes:
            axes[2].plot(
                [r["image_tokens"] for r in sizes], [r["ttft_mean_s"] for r in sizes], "o-", color=color, label=engine
            )
    axes[1].set(xscale="log", xlabel="requests in flight", ylabel="useful tokens/s", title="concurrency sweep")
    axes[2].set(xlabel="image tokens per request", ylabel="mean time to first token (s)", title="image size sweep")
    for ax in axes[1:]:
        if ax.get_legend_handles_labels()[0]:  # no sweep run: nothing to name
            ax.legend()
    fig.suptitle(f"{Path(report['model']).name}, {report['dtype']}, {report['machine']['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vlmserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    run(parser.parse_intermixed_args(argv))
    return 0
