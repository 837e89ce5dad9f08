"""Summarise llama-bench -o json output: tokens/s min / median / max over the repetitions."""

import json
import statistics
import sys

for path in sys.argv[1:]:
    for t in json.load(open(path)):
        s = t["samples_ts"]
        test = (f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']}") + (f" @ d{t['n_depth']}" if t.get("n_depth") else "")
        print(f"{t['model_filename'].split('/')[-1]:24s} {test:14s} t={t['n_threads']} fa={t.get('flash_attn')} "
              f"tokens/s min {min(s):8.2f} median {statistics.median(s):8.2f} max {max(s):8.2f} "
              f"(n={len(s)}, mean {t['avg_ts']:.2f} ± {t['stddev_ts']:.2f})")
