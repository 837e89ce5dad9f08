"""llama.cpp's greedy continuations and per-step top-k log-probabilities for a GGUF model.

Runs llama.cpp through llama-cpp-python (the vendored llama.cpp that
deploy/anchor/build-llama-cpp.sh builds), on the CPU, and writes a reference.json in the
format of tests/fixtures/tiny-dsv3-q4km/reference.json:

    {"model": ..., "note": ..., "prompts": [
        {"input_ids": [...], "greedy_continuation": [...],
         "top_logprobs": [[[token, logprob], ... top-k ...], ... one per generated step ...]}]}

Method: each prompt's input_ids are evaluated in one batch (no tokenization: the ids are
taken from the source fixture's reference.json), then greedy decoding one token at a time;
at each step the logits of the last position are log-softmaxed (float64) and the top-k
kept. The logprobs at step i are therefore computed on llama.cpp's own greedy prefix.

    python llama_reference.py --model m.gguf --prompts src/reference.json --out reference.json
    python llama_reference.py --model m.gguf --prompts ref.json --compare ref.json   # check

`--teacher-force ref.json` feeds that reference's greedy continuation instead of
llama.cpp's own argmax and prints the figures Duplex's `gguf_llama_cpp` test prints
(every step's top-k log-probability differences, median / 90th percentile / max, and at
how many steps the argmax is the reference's token): llama.cpp measured against itself,
say with `--no-flash-attn`, on the yardstick that Duplex is measured on.
"""

import argparse
import json
import sys

import numpy as np


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def run(model, prompts, n_predict, threads, top_k, n_ctx, flash_attn=True, forced=None, rows=None):
    """`forced`: per prompt, the tokens to feed at each step instead of the argmax.
    `rows`: a list that receives every step's full log-softmax row (float64)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=model,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=0,
        # llama.cpp's own default is 'auto', which is on for the CPU; llama-cpp-python's
        # default is off. Off, the DeepSeek-V3 (MLA) fixture's logprobs move by up to 0.6.
        flash_attn=flash_attn,
        logits_all=False,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in p["input_ids"]]
        assert len(ids) + n_predict <= n_ctx, (len(ids), n_predict, n_ctx)
        llm.reset()
        llm.eval(ids)
        greedy, tops = [], []
        for _ in range(n_predict):
            # logits_all=False: the batch asks for the last position's logits only, so
            # llama_get_logits holds exactly one row (Llama.scores is not filled then).
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).astype(np.float32)
            lp = log_softmax(logits)
            order = np.argsort(-lp, kind="stable")[:top_k]
            tops.append([[int(t), float(lp[t])] for t in order])
            if rows is not None:
                rows.append(lp)
            nxt = int(np.argmax(logits))
            greedy.append(nxt)
            llm.eval([forced[i][len(greedy) - 1] if forced else nxt])
        out.append({"input_ids": ids, "greedy_continuation": greedy, "top_logprobs": tops})
    return out


def compare(mine, ref):
    """Greedy tokens equal? Max |logprob| difference over the top-k tokens both have."""
    ok = True
    worst = 0.0
    for i, (a, b) in enumerate(zip(mine, ref)):
        same = a["greedy_continuation"] == b["greedy_continuation"]
        n_same = next((k for k, (x, y) in enumerate(zip(a["greedy_continuation"], b["greedy_continuation"])) if x != y),
                      len(a["greedy_continuation"]))
        d = 0.0
        for sa, sb in zip(a["top_logprobs"][:n_same + 1], b["top_logprobs"][:n_same + 1]):
            da, db = dict((t, v) for t, v in sa), dict((t, v) for t, v in sb)
            for t in set(da) & set(db):
                d = max(d, abs(da[t] - db[t]))
        worst = max(worst, d)
        ok &= same
        print(f"prompt {i}: greedy {'equal' if same else f'differs from step {n_same}'}; "
              f"max |logprob diff| {d:.3g} (over the shared top-k, steps 0..{min(n_same, len(a['top_logprobs']) - 1)})")
    print(f"all greedy equal: {ok}; max |logprob diff| {worst:.3g}")
    return ok, worst


def agreement(rows, greedy, ref):
    """Duplex's yardstick (shared/model/tests/gguf_llama_cpp.rs): |lp - ref| over each
    step's reference top-k tokens, and how many steps' argmax is the reference's token."""
    diffs, equal, steps = [], 0, 0
    it = iter(rows)
    for mine, theirs in zip(greedy, ref):
        for step, top in enumerate(theirs["top_logprobs"]):
            lp = next(it)
            steps += 1
            equal += int(mine[step] == theirs["greedy_continuation"][step])
            diffs += [abs(lp[t] - want) for t, want in top]
    diffs.sort()
    q = lambda f: diffs[int((len(diffs) - 1) * f)]
    print(f"top-{len(ref[0]['top_logprobs'][0])} log-probabilities vs the reference: median {q(0.5):.3f}, "
          f"90th percentile {q(0.9):.3f}, max {q(1.0):.3f}; greedy tokens equal at {equal}/{steps} steps")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--prompts", required=True, help="a reference.json whose prompts' input_ids are used")
    ap.add_argument("--out", help="reference.json to write")
    ap.add_argument("--compare", help="a reference.json in this format to compare with")
    ap.add_argument("--model-name", help='the "model" field (default: the GGUF file name)')
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--teacher-force", help="a reference.json whose greedy continuations are fed, and "
                    "against which the agreement is printed")
    ap.add_argument("--no-flash-attn", action="store_true", help="flash attention off (default on, as llama.cpp's CLI tools)")
    a = ap.parse_args()

    prompts = json.load(open(a.prompts))["prompts"]
    if a.teacher_force:
        ref = json.load(open(a.teacher_force))["prompts"]
        rows = []
        res = run(a.model, prompts, len(ref[0]["greedy_continuation"]), a.threads, a.top_k, a.n_ctx,
                  not a.no_flash_attn, [r["greedy_continuation"] for r in ref], rows)
        agreement(rows, [r["greedy_continuation"] for r in res], ref)
        return
    res = run(a.model, prompts, a.n_predict, a.threads, a.top_k, a.n_ctx, not a.no_flash_attn)
    import llama_cpp
    import os
    doc = {
        "model": a.model_name or os.path.basename(a.model),
        "note": (f"llama.cpp (vendored in llama-cpp-python {llama_cpp.__version__}, CPU, AMX compiled out) greedy "
                 f"decoding with -t {a.threads}; per step the top-{a.top_k} token logprobs "
                 f"(log-softmax of the last position's logits), computed on llama.cpp's own greedy prefix; "
                 f"prompt evaluated in one batch, then one token per step; flash attention "
                 f"{'off' if a.no_flash_attn else 'on'}, n_ctx {a.n_ctx}, KV cache F16; made by "
                 f"deploy/anchor/llama_reference.py"),
        "prompts": res,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if a.compare:
        ok, _ = compare(res, json.load(open(a.compare))["prompts"])
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
