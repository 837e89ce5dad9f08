"""llama.cpp's own activation quantizers on this CPU, as a test fixture.

A matrix product in llama.cpp quantizes its activations with the CPU backend's
`quantize_row_q8_0` / `quantize_row_q8_1` / `quantize_row_q8_K` (the type traits'
`from_float`). On x86 with AVX or AVX2 (every build of it on the CPUs Duplex serves) the
first two are not ggml's `_ref` code: they multiply by `127 / max` rather than by
`1 / (max / 127)` and round half to even rather than half away from zero, so some quants
differ by one. This script calls those functions in the `libggml-cpu.so` that
deploy/anchor/build-llama-cpp.sh built (through ctypes) on inputs chosen to reach every
such case, and writes what they return:

    {"note": ..., "rows": [{"x_bits": [u32 ...], "q8_0": hex, "q8_1": hex, "q8_k": hex}]}

    /tmp/lcp/venv/bin/python deploy/anchor/llama_quantizers.py tests/fixtures/llama-cpp-quantizers.json
"""

import ctypes
import glob
import json
import os
import sys

import numpy as np

QK = 256  # a row: whole blocks of every format (Q8_K's 256, eight of Q8_0's 32)
BYTES = {"q8_0": 34, "q8_1": 36, "q8_k": 4 + QK + 2 * 16}  # per block of 32, 32, 256


def library():
    pattern = os.path.join(os.environ.get("LCP_WORK", "/tmp/lcp"), "venv/lib/python3*/site-packages/llama_cpp/lib/libggml-cpu.so")
    found = glob.glob(pattern)
    if not found:
        sys.exit(f"no {pattern}: run deploy/anchor/build-llama-cpp.sh pyllama first")
    lib = ctypes.CDLL(found[0])
    for name in ("quantize_row_q8_0", "quantize_row_q8_1", "quantize_row_q8_K"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


def quantize(lib, fn, x, bytes_per_row):
    out = ctypes.create_string_buffer(bytes_per_row)
    getattr(lib, fn)(x.ctypes.data, out, len(x))
    return out.raw.hex()


def straddling(rng, n):
    """Blocks of 32 whose largest magnitude `a` has f32(127 / a) != f32(1 / f32(a / 127)),
    each other value placed so that its two products fall on either side of k + 1/2."""
    rows = []
    while len(rows) < n:
        a = np.float32(rng.uniform(0.01, 100.0))
        one = np.float32(127.0) / a
        two = np.float32(1.0) / (a / np.float32(127.0))
        if one == two:
            continue
        block = [a if rng.random() < 0.5 else -a]
        while len(block) < 32:
            k = rng.integers(-126, 126)
            v = np.float32((k + 0.5) / ((float(one) + float(two)) / 2))
            if (np.float32(v * one) - np.float32(k + 0.5)) * (np.float32(v * two) - np.float32(k + 0.5)) < 0:
                block.append(v)
            elif rng.random() < 0.2:
                block.append(np.float32(rng.uniform(-float(a), float(a))))
        rows.append(np.array(block, dtype=np.float32))
    return rows


def inputs():
    rng = np.random.default_rng(20261129)
    rows = [rng.standard_normal(QK).astype(np.float32) * np.float32(s) for s in (1.0, 1e-3, 300.0, 1e-20)]
    # A large outlier among small values; a row of zeros but one block; negative maxima.
    r = rng.standard_normal(QK).astype(np.float32) * np.float32(0.01)
    r[rng.integers(QK)] = 50.0
    rows.append(r)
    r = np.zeros(QK, dtype=np.float32)
    r[40:72] = rng.standard_normal(32)
    rows.append(r)
    rows.append(-np.abs(rng.standard_normal(QK)).astype(np.float32))
    # Exact ties: max 127 (multiplier 1) and max 63.5 (multiplier 2) with values k + 1/2 and k/2 + 1/4.
    ties = np.array([127.0] + [k + 0.5 for k in range(-63, 62)] + [0.5, -0.5, 1.5, -1.5, 2.5, -2.5], dtype=np.float32)
    rows.append(np.resize(ties, QK))
    ties = np.array([63.5] + [k / 2 + 0.25 for k in range(-60, 60)], dtype=np.float32)
    rows.append(np.resize(ties, QK))
    # Blocks where 127 / max and 1 / (max / 127) part, values straddling a half.
    blocks = straddling(rng, 32)
    rows += [np.concatenate(blocks[i:i + QK // 32]) for i in range(0, len(blocks), QK // 32)]
    return rows


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    lib = library()
    out = []
    for x in inputs():
        x = np.ascontiguousarray(x, dtype=np.float32)
        assert len(x) == QK
        out.append({
            "x_bits": [int(b) for b in x.view(np.uint32)],
            "q8_0": quantize(lib, "quantize_row_q8_0", x, QK // 32 * BYTES["q8_0"]),
            "q8_1": quantize(lib, "quantize_row_q8_1", x, QK // 32 * BYTES["q8_1"]),
            "q8_k": quantize(lib, "quantize_row_q8_K", x, BYTES["q8_k"]),
        })
    import llama_cpp
    doc = {
        "note": (f"llama.cpp's activation quantizers (quantize_row_q8_0 / _q8_1 / _q8_K of libggml-cpu, "
                 f"llama-cpp-python {llama_cpp.__version__}'s vendored llama.cpp built with -march=native on an "
                 f"x86 CPU with AVX-512) on rows of 256 f32 values; made by deploy/anchor/llama_quantizers.py"),
        "rows": out,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(doc, f)
        f.write("\n")
    print(f"{len(out)} rows -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
