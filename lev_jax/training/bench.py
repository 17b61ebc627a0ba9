"""One LoRA training step on the embedded model: this trainer vs transformers + peft (PyTorch CPU).

Both sides train the same rows (the served rows of N choice questions, both option orders, laid out
by the Planner), the same LoRA (rank, alpha, every projection), the same dtype, with AdamW and the
same loss (CE + 0.5 Brier over the label codes). transformers runs each row as a full padded
sequence (what it offers); this trainer computes each example's shared prefix once
(`batches.group_rows`). Throughput counts the rows' real tokens (prefix + row, no padding) for both.
`python -m scripts.bench_train` is the command line.
"""

from __future__ import annotations

import time

import numpy as np

TOPICS = [
    "card payment declined",
    "transfer not received",
    "exchange rate",
    "lost or stolen card",
    "top up failed",
    "change PIN",
    "refund not showing",
    "cash withdrawal charge",
]


def records(n: int, seed: int = 0) -> list[dict]:
    """n banking-style choice records (8 options each), states of varying length."""
    rng = np.random.default_rng(seed)
    q = {
        "type": "choice",
        "instructions": "What is the customer asking the bank about?",
        "criteria": {t.replace(" ", "_"): t for t in TOPICS},
    }
    out = []
    for i in range(n):
        gold = int(rng.integers(len(TOPICS)))
        words = " ".join(
            rng.choice(["please", "help", "urgent", "today", "again", "my", "account"], int(rng.integers(4, 30)))
        )
        out.append(
            {
                "state": {"message": f"Hi, question {i} about {TOPICS[gold]}: {words}."},
                "question": q,
                "target_dist": [float(j == gold) for j in range(len(TOPICS))],
                "readout": "choice",
            }
        )
    return out


def _best(fn, repeats: int) -> float:
    fn()  # compile / warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def jax_step_seconds(
    bb, examples, *, rank: int, alpha: float, dtype: str, remat: str, repeats: int, layers: int = 0
) -> float:
    import jax

    from lev_jax.training import batches, config, loop
    from lev_jax.training import mesh as mesh_lib

    cfg = config.TrainConfig(
        preset="bench",
        dtype=dtype,
        lora_rank=rank,
        lora_alpha=alpha,
        lora_layers=layers,
        remat=remat,
        lr=1e-4,
        warmup_steps=0,
        steps=1000,
    ).validate()
    trainer = loop.Trainer(cfg, bb, mesh_lib.make("", devices=jax.devices()[:1]))
    holder = {"state": trainer.init_state()}
    arrays, _ = batches.pack(examples)
    batch = trainer.put_batch(arrays)

    def step():
        holder["state"], m = trainer.step(holder["state"], batch)
        jax.block_until_ready(m["loss"])

    return _best(step, repeats)


def torch_step_seconds(
    examples, *, rank: int, alpha: float, dtype: str, repeats: int, threads: int, layers: int = 0
) -> float:
    import peft
    import torch

    from lev_jax.bench.torch_reference import transformers_gguf_model
    from lev_jax.loaders.gguf import embedded_default_path
    from lev_jax.training import lora

    torch.set_num_threads(threads)
    model = transformers_gguf_model(embedded_default_path())
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    n_layers = model.config.num_hidden_layers
    top = {"layers_to_transform": list(range(n_layers - layers, n_layers))} if layers else {}
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(lora.DEFAULT_TARGETS), **top),
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = [(ex.prefix + r.tokens, r.label_ids, t) for ex in examples for r, t in zip(ex.rows, ex.targets)]
    L = max(len(s) for s, _, _ in rows)
    ids = torch.zeros((len(rows), L), dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, (s, _, _) in enumerate(rows):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    answer = torch.tensor([len(s) - 1 for s, _, _ in rows])
    label_ids = [torch.tensor(li) for _, li, _ in rows]
    targets = [torch.tensor(np.asarray(t), dtype=torch.float32) for _, _, t in rows]

    def step():
        opt.zero_grad()
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        h = hidden[torch.arange(len(rows)), answer]  # final-normed hidden at each answer position
        head = model.get_output_embeddings().weight
        loss = 0.0
        for i in range(len(rows)):
            logits = (h[i] @ head[label_ids[i]].T).float()
            p = torch.softmax(logits, -1)
            loss = loss - (targets[i] * torch.log_softmax(logits, -1)).sum() + 0.5 * ((p - targets[i]) ** 2).sum()
        (loss / len(rows)).backward()
        opt.step()

    return _best(step, repeats)


def run(
    *,
    examples: int = 8,
    rank: int = 16,
    alpha: float = 32.0,
    dtype: str = "bfloat16",
    remat: str = "none",
    repeats: int = 3,
    threads: int = 2,
    layers: int = 0,
    out=print,
) -> dict:
    import lev_jax
    from lev_jax.readout import Planner
    from lev_jax.training import batches

    bb = lev_jax.load_backbone(None, dtype=dtype)
    renderer = batches.Renderer(Planner(bb.tokenizer), seed=0)
    exs = [renderer.example(r, renderer.rng(0, i)) for i, r in enumerate(records(examples))]
    row_tokens = sum(len(ex.prefix) + len(r.tokens) for ex in exs for r in ex.rows)
    n_rows = sum(len(ex.rows) for ex in exs)
    out(
        f"batch: {examples} examples, {n_rows} rows (both option orders), {row_tokens} real row tokens, "
        f"LoRA r{rank} alpha {alpha:g} on every projection of "
        f"{f'the last {layers} layers' if layers else 'every layer'}, {dtype}"
    )
    t_jax = jax_step_seconds(bb, exs, rank=rank, alpha=alpha, dtype=dtype, remat=remat, repeats=repeats, layers=layers)
    out(f"lev-jax       {t_jax * 1000:8.0f} ms/step  {row_tokens / t_jax:8.0f} tokens/s  (remat {remat})")
    t_torch = torch_step_seconds(
        exs, rank=rank, alpha=alpha, dtype=dtype, repeats=repeats, threads=threads, layers=layers
    )
    out(
        f"transformers  {t_torch * 1000:8.0f} ms/step  {row_tokens / t_torch:8.0f} tokens/s  (+ peft, "
        f"{threads} threads)"
    )
    ratio = t_torch / t_jax
    out(f"ratio {ratio:.2f}x (target >= 1.5x)")
    return {
        "examples": examples,
        "rows": n_rows,
        "row_tokens": row_tokens,
        "dtype": dtype,
        "lora_layers": layers,
        "jax_s": t_jax,
        "torch_s": t_torch,
        "jax_tokens_per_s": row_tokens / t_jax,
        "torch_tokens_per_s": row_tokens / t_torch,
        "ratio": ratio,
    }
