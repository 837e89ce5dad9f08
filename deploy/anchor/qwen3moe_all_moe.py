"""Make an all-MoE variant of a Qwen3-MoE checkpoint that has dense layers.

llama.cpp's qwen3moe architecture has no dense layers (no `mlp_only_layers`, no
`decoder_sparse_step`): its converter cannot map `model.layers.0.mlp.down_proj.weight`
and its graph expects experts in every layer. tests/fixtures/tiny-qwen3moe has layer 0
dense (`mlp_only_layers` [0]), so for the GGUF fixture we derive a model in the layout of
the real Qwen3-30B-A3B (every layer MoE): each dense layer's MLP is replaced by a copy of
the MoE block (router `mlp.gate` and every `mlp.experts.E.*`) of the first MoE layer;
everything else is copied unchanged, and config.json gets `mlp_only_layers` [] and
`decoder_sparse_step` 1. Deterministic (no random numbers).

    python qwen3moe_all_moe.py SRC_DIR OUT_DIR
"""

import json
import os
import shutil
import sys

from safetensors import safe_open
from safetensors.torch import save_file


def main():
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    n_layers = cfg["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers", []))
    moe = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    dense = [i for i in range(n_layers) if i not in moe]
    assert moe, "no MoE layer to copy"
    donor = moe[0]

    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)

    for layer in dense:
        prefix = f"model.layers.{layer}.mlp."
        for k in [k for k in tensors if k.startswith(prefix)]:
            del tensors[k]
        donor_prefix = f"model.layers.{donor}.mlp."
        for k in [k for k in tensors if k.startswith(donor_prefix)]:
            tensors[prefix + k[len(donor_prefix):]] = tensors[k].clone()
        print(f"layer {layer}: dense MLP replaced by a copy of layer {donor}'s MoE block", file=sys.stderr)

    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg["mlp_only_layers"] = []
    cfg["decoder_sparse_step"] = 1
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    for name in ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "reference.json"]:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out, name))


if __name__ == "__main__":
    main()
