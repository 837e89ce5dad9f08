#!/usr/bin/env python3
"""Duplex against llama.cpp on the same GGUF, interleaved (issue 22's benchmark).

Each round runs llama-bench and then `duplex bench-engine` on the same file,
so that background load hits both alike; the table gives each engine's
tokens/s per round and the ratio Duplex / llama.cpp as min / median / max
over the rounds, for decode at contexts 512 and 4096 and prefill of 512 and
2048 tokens. `uptime` is recorded before every run: a loaded machine makes
the numbers meaningless, so run nothing else meanwhile.

Usage: deploy/anchor/compare.py GGUF [--rounds 3] [--threads 2]
         [--duplex target/release/duplex] [--llama-bench PATH] [--extra MODEL]
         [--weights-dir DIR]
`--extra MODEL` adds Duplex on another model (e.g. the FP8 original) to every
round, compared with the same llama.cpp run. `--weights-dir DIR` adds Duplex
on the same GGUF with its weight segment in DIR (a hugetlbfs mount: 2 MiB
pages, as `duplex serve --shm-dir` would use them). Build llama.cpp first
with deploy/anchor/build-llama-cpp.sh.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

LCP = os.environ.get("LCP_WORK", "/tmp/lcp") + "/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench"
CONTEXTS = [512, 4096]
PROMPTS = [512, 2048]
# Overridable for quick checks (--contexts 64 --prompts 32 on a tiny model).


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def llama_cpp(bench, gguf, threads):
    """tokens/s by measurement name, one repetition each."""
    out = {}
    runs = [
        ["-p", ",".join(map(str, PROMPTS)), "-n", "0"],
        ["-p", "0", "-n", "32", "-d", ",".join(map(str, CONTEXTS))],
    ]
    for extra in runs:
        cmd = [bench, "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json", *extra]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        for row in json.loads(res.stdout):
            if row["n_gen"] == 0:
                out[f"prefill {row['n_prompt']}"] = row["avg_ts"]
            else:
                out[f"decode @{row['n_depth']}"] = row["avg_ts"]
    return out


def duplex(binary, model, threads, extra_args=()):
    cmd = [binary, "bench-engine", "--model", model, "--threads", str(threads), "--contexts", ",".join(map(str, CONTEXTS)),
           "--decode-tokens", "32", "--decode-rounds", "1", "--prefill", ",".join(map(str, PROMPTS)), *extra_args]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = {}
    for line in res.stdout.splitlines():
        m = re.match(r"\| decode, batch 1, context (\d+) \| ([\d.]+) \|", line)
        if m:
            out[f"decode @{m.group(1)}"] = float(m.group(2))
        m = re.match(r"\| prefill, (\d+) tokens \| ([\d.]+) \|", line)
        if m:
            out[f"prefill {m.group(1)}"] = float(m.group(2))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--duplex", default="target/release/duplex")
    ap.add_argument("--llama-bench", default=LCP)
    ap.add_argument("--extra", help="another model for Duplex, compared with the same llama.cpp runs")
    ap.add_argument("--weights-dir", help="also run Duplex with its weight segment in this directory (e.g. a hugetlbfs mount)")
    ap.add_argument("--contexts", default="512,4096", help="decode contexts")
    ap.add_argument("--prompts", default="512,2048", help="prefill lengths")
    a = ap.parse_args()
    CONTEXTS[:] = [int(c) for c in a.contexts.split(",")]
    PROMPTS[:] = [int(p) for p in a.prompts.split(",")]
    # Duplex's other runs per round: (column title, model, extra arguments).
    variants = []
    if a.extra:
        variants.append((f"{os.path.basename(a.extra.rstrip('/'))} ÷ llama.cpp", a.extra, []))
    if a.weights_dir:
        variants.append((f"Duplex, weights in {a.weights_dir} ÷ llama.cpp", a.gguf, ["--weights-dir", a.weights_dir]))
    engines = {"llama.cpp": [], "duplex": [], **{title: [] for title, _, _ in variants}}
    for r in range(a.rounds):
        print(f"round {r + 1}: {uptime()}", file=sys.stderr)
        engines["llama.cpp"].append(llama_cpp(a.llama_bench, a.gguf, a.threads))
        print(f"  llama.cpp {engines['llama.cpp'][-1]}", file=sys.stderr)
        engines["duplex"].append(duplex(a.duplex, a.gguf, a.threads))
        print(f"  duplex    {engines['duplex'][-1]}", file=sys.stderr)
        for title, model, extra_args in variants:
            engines[title].append(duplex(a.duplex, model, a.threads, extra_args))
            print(f"  {title}: {engines[title][-1]}", file=sys.stderr)
    print(f"\n{a.gguf}, {a.threads} threads, {a.rounds} interleaved rounds; after: {uptime()}\n")
    header = "| measurement | llama.cpp tokens/s (min / median / max) | Duplex tokens/s | Duplex ÷ llama.cpp (min / median / max) |"
    for title, _, _ in variants:
        header += f" {title} |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in (min(xs), statistics.median(xs), max(xs)))
    for key in [f"decode @{c}" for c in CONTEXTS] + [f"prefill {p}" for p in PROMPTS]:
        l = [run[key] for run in engines["llama.cpp"]]
        d = [run[key] for run in engines["duplex"]]
        row = f"| {key} | {fmt(l)} | {fmt(d)} | {fmt([x / y for x, y in zip(d, l)])} |"
        for title, _, _ in variants:
            e = [run[key] for run in engines[title]]
            row += f" {fmt([x / y for x, y in zip(e, l)])} |"
        print(row)


if __name__ == "__main__":
    main()
