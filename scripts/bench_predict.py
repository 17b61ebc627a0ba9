"""predict() against transformers (PyTorch CPU) on the same prompts, in the same run.

    python -m scripts.bench_predict [--ns 1,2,4,8,16,32] [--repeats 3]

A ~330-token state and N 3-option choice questions on the embedded SmolLM2-135M-Instruct. Every
method reads the same token rows predict() plans (option-order averaging included: 2 rows per
question) and the same label logits:
  predict  lev-jax: state prefix once, each question's header (the text before its options) once as
           a cache segment both option orders continue, the rows in bucketed batched calls, label
           rows of the head
           cold: the prefix is computed in every request (the comparison that counts);
           warm: the same state was asked about before, its prefix comes from the cross-request cache
  naive    transformers: one full forward per row (prefix + row)
  fork     transformers: prefix once, its KV cache copied per row, each row continued from the copy
  batch    transformers: all rows (prefix + row) left-padded into one batch
All transformers calls use logits_to_keep=1 (the head only at the last position), their fastest form.
Prints ms per request, speedups against the fastest transformers method, the marginal cost of a
question relative to the state, and predict()'s achieved GFLOP/s next to the measured matmul ceiling.
`--unrolled` also times predict() (cold) with every decoder layer unrolled in its programs
(`scan_unroll` = the layer count, what a Python layer loop compiles) beside the default scan.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import jax
import numpy as np
import torch

import lev_jax
from lev_jax import buckets
from lev_jax.bench.torch_reference import transformers_gguf_model
from lev_jax.loaders.gguf import embedded_default_path
from scripts.bench_forward import matmul_ceiling

STATE = (
    "Customer support ticket #48213, opened 2026-11-28 via the mobile app. The customer, a premium "
    "subscriber since 2019, writes: I ordered a standing desk and two monitor arms on November 12th "
    "and paid with my company credit card. The confirmation email promised delivery within five "
    "working days, but the tracking page has shown 'label created' for two weeks now. I called your "
    "hotline twice; the first agent told me the parcel was lost and a replacement was on its way, the "
    "second agent said there was no record of a replacement at all. Meanwhile my card statement shows "
    "the order was charged twice, once on the 12th and again on the 19th, for 649.00 euros each time. "
    "I need the desk for a new office that opens on December 5th, so if it cannot arrive before then I "
    "want the whole order cancelled and both charges refunded. I have attached screenshots of the "
    "tracking page and of my card statement. Please also tell me why nobody answered the three emails "
    "I sent to your support address. If this is not resolved by Friday I will dispute the charges with "
    "my bank and leave a review describing this experience. Account notes: two previous orders, both "
    "delivered on time; one earlier complaint about a damaged lamp in 2024, resolved with a voucher. "
    "Preferred contact: email. Language: English. Region: Germany. Warehouse: Leipzig hub."
)
TOPICS = [
    ("refund", "cancel", "delivery"),
    ("billing", "shipping", "account"),
    ("angry", "calm", "neutral"),
    ("urgent", "normal", "low"),
    ("desk", "chair", "lamp"),
    ("email", "phone", "chat"),
    ("germany", "france", "spain"),
    ("premium", "basic", "trial"),
]


def questions(n: int) -> dict:
    return {
        f"q{i}": {
            "type": "choice",
            "instructions": f"Question {i}: which label fits the ticket best?",
            "criteria": {o: None for o in TOPICS[i % len(TOPICS)]},
        }
        for i in range(n)
    }


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


class Torch:
    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def naive(self, prefix, rows):
        return [
            self.model(input_ids=torch.tensor([prefix + r.tokens]), logits_to_keep=1).logits[0, -1, r.label_ids]
            for r in rows
        ]

    @torch.no_grad()
    def fork(self, prefix, rows):
        cache = self.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
        out = []
        for r in rows:
            c = copy.deepcopy(cache)
            logits = self.model(
                input_ids=torch.tensor([r.tokens]), past_key_values=c, use_cache=True, logits_to_keep=1
            ).logits
            out.append(logits[0, -1, r.label_ids])
        return out

    @torch.no_grad()
    def batch(self, prefix, rows):
        seqs = [prefix + r.tokens for r in rows]
        T = max(map(len, seqs))
        ids = torch.zeros((len(seqs), T), dtype=torch.long)
        mask = torch.zeros((len(seqs), T), dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding: every row's answer position is the last one
            ids[i, T - len(s) :], mask[i, T - len(s) :] = torch.tensor(s), 1
        logits = self.model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
        return [logits[i, r.label_ids] for i, r in enumerate(rows)]


def device_flops(engine, plan) -> float:
    """FLOPs of the padded device work predict() does for a plan: the prefix's prefill chunks, then
    every slab call (its lanes' padded tokens against the prefix's capacity) and every row read alone
    (its chunks and tail)."""
    cfg = engine.backbone.config
    n = len(plan.prefix_ids)
    offset, slots = buckets.prefilled(n)
    total = sum(size * cfg.flops_per_token(start + size / 2) for start, size, _ in buckets.chunks(n)) if n else 0.0
    read = engine.executor.read_plan([plan.rows], [slots])
    for call in read.calls:
        L, T = call.shape
        total += L * T * cfg.flops_per_token(slots + T / 2)
    for _, i in read.single:
        for key in engine.executor.long_row_calls(offset, slots, plan.rows[i]):
            size = key[2]
            total += size * cfg.flops_per_token(key[1] + size / 2)
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="weight dtypes, for predict() and transformers alike")
    ap.add_argument("--unrolled", action="store_true", help="also time predict() with the layers unrolled")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.ns.split(",")]
    dtypes = args.dtypes.split(",")

    engines = {d: lev_jax.load(base_only=True, calibration=None, dtype=d) for d in dtypes}
    colds = {d: lev_jax.Engine(e.backbone, prefix_cache_bytes=0) for d, e in engines.items()}
    unrolled = {}
    if args.unrolled:
        for d, e in engines.items():
            bb = e.backbone
            cfg = dataclasses.replace(bb.config, scan_unroll=bb.config.num_hidden_layers)
            flat = lev_jax.Backbone(cfg, bb.params, bb.tokenizer, name=bb.name, hf_config=bb.hf_config)
            unrolled[d] = lev_jax.Engine(flat, prefix_cache_bytes=0)
    base = transformers_gguf_model(embedded_default_path())
    refs = {d: Torch(base if d == "float32" else copy.deepcopy(base).to(getattr(torch, d))) for d in dtypes}
    print(
        f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); dtypes {dtypes} (lev-jax bf16: bf16 weights and matmul inputs, "
        f"fp32 accumulation and residual stream; transformers bf16: the model cast to bf16)"
    )
    engine0 = next(iter(engines.values()))
    plan0 = engine0.plan(STATE, questions(1))
    print(f"state prefix: {len(plan0.prefix_ids)} tokens (chat header + state)")
    cold_ms = {d: {} for d in dtypes}
    for n in ns:
        qs = questions(n)
        plan = engine0.plan(STATE, qs)
        rows = plan.rows
        theirs = refs[dtypes[0]].fork(plan.prefix_ids, rows)  # same prompts, same numbers: check agreement once
        t_ref = {}
        for d, ref in refs.items():
            for m in ("naive", "fork", "batch"):
                t_ref[(m, d)] = best_ms(
                    lambda m=m, ref=ref: getattr(ref, m)(plan.prefix_ids, rows), max(1, args.repeats - (n >= 16))
                )
        fastest = min(t_ref, key=t_ref.get)
        print(
            f"N={n:2d} rows={len(rows):2d} transformers ms: "
            + " ".join(f"{m}/{d[:4]} {t:8.1f}" for (m, d), t in t_ref.items())
            + f" | fastest {'/'.join(fastest)}"
        )
        for d in dtypes:
            ours = colds[d].executor.read([(plan.prefix_ids, rows)], [lev_jax.readout.Usage()])[0]
            diff = max(float(np.abs(a - b.float().numpy()).max()) for a, b in zip(ours, theirs))
            t_pred = best_ms(lambda d=d: colds[d].predict(STATE, qs), args.repeats)
            t_warm = best_ms(lambda d=d: engines[d].predict(STATE, qs), args.repeats)
            same = min(((m, d) for m in ("naive", "fork", "batch")), key=t_ref.get)
            gflops = device_flops(engines[d], plan) / (t_pred / 1e3) / 1e9
            cold_ms[d][n] = t_pred
            print(
                f"      predict {d:8s} cold {t_pred:8.1f} warm {t_warm:8.1f} ms | vs fastest overall "
                f"({'/'.join(fastest)}): cold {t_ref[fastest] / t_pred:5.2f}x warm {t_ref[fastest] / t_warm:5.2f}x"
                f" | vs fastest {d} ({same[0]}): {t_ref[same] / t_pred:5.2f}x | {gflops:6.1f} GFLOP/s (padded) |"
                f" max |dlogit| vs transformers {dtypes[0]} {diff:.1e}",
                flush=True,
            )
            if d in unrolled:
                t_flat = best_ms(lambda d=d: unrolled[d].predict(STATE, qs), args.repeats)
                print(
                    f"      predict {d:8s} cold {t_flat:8.1f} ms with the layers unrolled | vs fastest overall: "
                    f"{t_ref[fastest] / t_flat:5.2f}x | scan / unrolled time {t_pred / t_flat:5.3f}",
                    flush=True,
                )
    ceiling = {d: max(matmul_ceiling([(512, 576, 1536), (2048, 2048, 2048)], 5, dtype=d).values()) for d in dtypes}
    print("matmul ceiling measured in this run: " + ", ".join(f"{d} {c:.1f} GFLOP/s" for d, c in ceiling.items()))
    for d, by_n in cold_ms.items():
        if 1 in by_n and max(by_n) > 1:
            n_max = max(by_n)
            per_q = (by_n[n_max] - by_n[1]) / (n_max - 1)
            state_ms = by_n[1] - per_q
            print(
                f"{d}: marginal question cost {per_q:.1f} ms; state (N=1 minus one question) {state_ms:.1f} ms; "
                f"ratio {per_q / state_ms:.3f} (target <= 0.2)"
            )


if __name__ == "__main__":
    main()
