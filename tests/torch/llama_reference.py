"""A random transformers Llama and its logits, for ferry's Llama to match.

    python3 tests/torch/llama_reference.py DIR VARIANT

VARIANT is `plain` (untied head, grouped-query attention, default rotary frequencies) or
`tied-llama3` (tied embeddings, attention biases, Llama 3's rotary scaling). Writes into DIR:
the model (`save_pretrained`, float32), `ids.npy` (int64 [2, 24]) and `logits.npy` (float32);
then the same model in bfloat16 under DIR/bf16 with `logits.npy` computed in bfloat16 (on the GPU
when there is one, on the CPU otherwise). Prints one JSON line with the versions used.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM


def config(variant):
    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rms_norm_eps=1e-5)
    if variant == "plain":
        return LlamaConfig(**sizes, rope_theta=10000.0, tie_word_embeddings=False)
    if variant == "tied-llama3":
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=16)
        return LlamaConfig(**sizes, rope_theta=500000.0, tie_word_embeddings=True,
                           attention_bias=True, rope_scaling=scaling)
    raise SystemExit(f"unknown variant {variant!r}: plain or tied-llama3")


def main():
    out, variant = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config(variant)).eval()
    with torch.no_grad():
        # Norms start at one and biases at zero: draw them, so the comparison sees them.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 97, (2, 24))
    model.save_pretrained(out, safe_serialization=True)
    np.save(out / "ids.npy", ids.numpy())
    with torch.no_grad():
        np.save(out / "logits.npy", model(ids).logits.float().numpy())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    half = model.to(torch.bfloat16)
    half.save_pretrained(out / "bf16", safe_serialization=True)
    with torch.no_grad():
        logits = half.to(device)(ids.to(device)).logits.float().cpu()
    np.save(out / "bf16" / "logits.npy", logits.numpy())
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "bf16_on": device}))


if __name__ == "__main__":
    main()
