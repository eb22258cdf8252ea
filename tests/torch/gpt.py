#!/usr/bin/env python3
"""The character-level GPT of `ferry train gpt`, in PyTorch, for the loss comparison.

    python3 tests/torch/gpt.py CORPUS.txt [--device cuda] [--epochs 40] [--steps-per-epoch 100]
        [--batch-size 32] [--context 64] [--width 128] [--layers 4] [--heads 4] [--lr 3e-3]

CORPUS.txt is the text `ferry train gpt` writes into its --out directory (corpus.txt). Same
model (pre-norm blocks, causal multi-head attention, 4x GELU MLP, N(0, 0.02) weights with the
residual projections at 0.02 / sqrt(2 layers), zero biases, LayerNorm eps 1e-5), same split
(first 90% train), same batches per step (random windows; the random streams differ), AdamW
(betas 0.9/0.999, eps 1e-8, no weight decay), 5% linear warmup then a cosine to a tenth of the
peak. Prints one JSON line per epoch: {"epoch", "loss" (mean training loss of the epoch),
"held_out_accuracy"}; TF32 is off.
"""
import argparse
import json
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


class Block(nn.Module):
    def __init__(self, width, heads, residual_std):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, eps=1e-5)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width, eps=1e-5)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        for lin, std in ((self.qkv, 0.02), (self.proj, residual_std), (self.fc, 0.02), (self.out, residual_std)):
            nn.init.normal_(lin.weight, 0.0, std)
            nn.init.zeros_(lin.bias)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        heads = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        nn.init.normal_(self.tok.weight, 0.0, 0.02)
        nn.init.normal_(self.pos.weight, 0.0, 0.02)
        residual = 0.02 / math.sqrt(2 * max(layers, 1))
        self.blocks = nn.ModuleList(Block(width, heads, residual) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab)
        nn.init.normal_(self.head.weight, 0.0, 0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def windows(ids, lo, hi, count, context, rng, device):
    span = max(hi - lo - context - 1, 1)
    starts = [lo + rng.randrange(span) for _ in range(count)]
    x = torch.stack([ids[s:s + context] for s in starts]).to(device)
    y = torch.stack([ids[s + 1:s + context + 1] for s in starts]).to(device)
    return x, y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("corpus")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    text = open(a.corpus, encoding="utf-8").read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = len(ids) * 9 // 10
    torch.manual_seed(a.seed)
    model = Gpt(len(chars), a.context, a.width, a.layers, a.heads).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    total = a.epochs * a.steps_per_epoch
    warmup = max(total * 0.05, 1.0)
    for epoch in range(1, a.epochs + 1):
        rng = random.Random(a.seed * 1_000_003 + epoch)
        losses = []
        for s in range(a.steps_per_epoch):
            step = (epoch - 1) * a.steps_per_epoch + s
            if step < warmup:
                scale = (step + 1) / warmup
            else:
                t = (step - warmup) / max(total - warmup, 1.0)
                scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
            for g in opt.param_groups:
                g["lr"] = a.lr * scale
            x, y = windows(ids, 0, split, a.batch_size, a.context, rng, a.device)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        vrng = random.Random(0xF00D)
        with torch.no_grad():
            vx, vy = windows(ids, split, len(ids), 64, a.context, vrng, a.device)
            right = (model(vx).argmax(-1) == vy).float().mean().item()
        print(json.dumps({"epoch": epoch, "loss": sum(losses) / len(losses), "held_out_accuracy": right}), flush=True)


if __name__ == "__main__":
    main()
