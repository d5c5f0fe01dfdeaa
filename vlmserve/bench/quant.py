"""Decode speed of weight-only int8 (and of a 4-bit AWQ copy of the model, --awq) against the float
model, one request, same process, rounds alternating (the machine's load changes from minute to
minute; compare ratios within a run):

    python -m vlmserve.bench.quant [MODEL] [--rounds 3] [--tokens 32] [--awq DIR]
    python -m vlmserve.bench.quant --ops     # the linear-layer candidates, one shape at a time

--awq DIR: the AWQ checkpoint `python -m vlmserve.tools.quantize_awq MODEL DIR` writes.

MODEL defaults to the benchmark-size random Qwen2-VL (Qwen2-VL-2B's language-model width, 4
layers). A decode step's time is (time for 1 + T tokens - time for 1 token) / T, greedy, eos
ignored, a text-only prompt."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _decode_ms(llm, prompt: str, tokens: int) -> float:  # type: ignore[no-untyped-def]
    from vlmserve import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt, params)
        return time.perf_counter() - start

    first = run(1)
    full = run(1 + tokens)
    return 1000 * (full - first) / tokens


def bench_models(model: str | None, rounds: int, tokens: int, dtype: str, awq: str | None = None) -> None:
    from vlmserve import LLM
    from vlmserve.engine.banner import describe_cpu
    from vlmserve.tools.tiny_checkpoint import bench_checkpoint_dir

    model = model or str(bench_checkpoint_dir())
    print(describe_cpu())
    checkpoints = [(dtype, model, None), ("int8", model, "int8")] + ([("int4 (awq)", awq, None)] if awq else [])
    engines = {
        name: LLM(path, dtype=dtype, device="cpu", quantization=q, max_model_len=1024, kv_cache_memory_gib=0.25)
        for name, path, q in checkpoints
    }
    prompt = "Describe the weather in a city you like, in a few sentences. " * 4
    times: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():  # warm-up: kernels built, caches touched
        _decode_ms(llm, prompt, 4)
    for _ in range(rounds):
        for name, llm in engines.items():
            times[name].append(_decode_ms(llm, prompt, tokens))
    base = statistics.median(times[dtype])
    print(f"{model}: one request, {tokens} decode steps, {rounds} alternating rounds (median, all rounds)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:<10} decode {med:7.1f} ms/step  ({', '.join(f'{t:.1f}' for t in ts)})  {base / med:.2f}x {dtype}"
        )


def _time_ms(f: Callable[[], object], repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def bench_ops(n: int, k: int, repeat: int) -> None:
    """The candidates for an int8 linear layer on this CPU, bf16 activations, against bf16 F.linear.
    Each timing runs over enough copies of the matrix (256 MB of int8) that they come from memory,
    not the caches, as a decode step's weights do; the time shown is per matrix."""
    from vlmserve.engine.banner import describe_cpu
    from vlmserve.kernels.int8 import int8_linear, load_int8_kernel
    from vlmserve.models.quant.int8 import quantize_per_channel

    print(describe_cpu())
    g = torch.Generator().manual_seed(0)
    copies = max(2, (256 << 20) // (n * k))
    # the 4-bit copies of the same matrices are a quarter of the int8 bytes: still past the caches
    ws = [0.02 * torch.randn(n, k, generator=g) for _ in range(copies)]
    qs = [quantize_per_channel(w) for w in ws]
    wbs = [w.bfloat16() for w in ws]
    sbs = [s.bfloat16() for _, s in qs]
    int4 = _int4_layers(ws, group=128) if k % 128 == 0 else []
    del ws
    kernel = load_int8_kernel()
    avx512 = kernel.avx512 if kernel is not None else None

    def each(f: Callable[[int, torch.Tensor], object], x: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for i in range(copies):
                f(i, x)

        return run

    print(f"[M, {k}] x [{n}, {k}]^T over {copies} copies, bf16 activations, median of {repeat}, ms per matrix")
    for m in (1, 2, 4, 8, 16, 32, 64, 256):
        x = torch.randn(m, k, generator=g).bfloat16()
        xf = x.float()
        row = {
            "bf16 F.linear": each(lambda i, x: F.linear(x, wbs[i]), x),
            "torch._weight_int8pack_mm": each(lambda i, x: torch._weight_int8pack_mm(x, qs[i][0], sbs[i]), x),
        }
        if kernel is not None:
            row["cpu_int8.c"] = each(lambda i, x: kernel.linear(x, qs[i][0], qs[i][1], None), xf)
        if avx512 is not None:
            row["cpu_int8_avx512.c"] = each(lambda i, x: avx512.linear(x, qs[i][0], qs[i][1], None), x)
        row["chosen (int8_linear)"] = each(lambda i, x: int8_linear(x, qs[i][0], qs[i][1], None, kernel), x)
        if int4:
            row["int4 (int4_linear)"] = each(lambda i, x: int4[i](x), x)
        times = {name: _time_ms(f, repeat) / copies for name, f in row.items()}
        print(f"  M={m:<4} " + "  ".join(f"{name} {t:.2f}" for name, t in times.items()))


def _int4_layers(weights: list[torch.Tensor], group: int) -> list[torch.nn.Module]:
    """Each weight rounded to 4 bits (tools/quantize_awq) as the Int4Linear an AWQ checkpoint
    loads; none where the int4 kernels do not build."""
    from vlmserve.kernels.int4 import load_int4_kernel
    from vlmserve.models.quant.int4 import Int4Linear
    from vlmserve.models.quant.packed import PackedConfig, int4_rows
    from vlmserve.tools.quantize_awq import pack_awq, quantize_rtn

    kernel = load_int4_kernel()
    if kernel is None:
        return []
    layers: list[torch.nn.Module] = []
    for w in weights:
        q, zeros, scales = quantize_rtn(w, group)
        parts = {"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales}
        rows = int4_rows(PackedConfig("awq", group), parts, "bench")
        layers.append(Int4Linear.from_rows(rows, group, kernel))
    return layers


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m vlmserve.bench.quant", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per round")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--ops", action="store_true", help="time the linear-layer candidates instead")
    p.add_argument("--shape", type=int, nargs=2, default=[8960, 1536], metavar=("N", "K"))
    p.add_argument("--awq", default=None, metavar="DIR", help="an AWQ checkpoint of MODEL, decoded alongside")
    args = p.parse_args(argv)
    if args.ops:
        bench_ops(args.shape[0], args.shape[1], repeat=5)
    else:
        bench_models(args.model, args.rounds, args.tokens, args.dtype, args.awq)


if __name__ == "__main__":
    main()
