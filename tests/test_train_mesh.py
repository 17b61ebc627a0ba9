"""Sharded == unsharded: the same training steps on 8 CPU devices (mesh data=2, fsdp=2, tensor=2) and on
one device give the same losses and adapter (<= 1e-5, fp32). Runs in a subprocess: the device count
is fixed when JAX starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json
import jax, numpy as np
from lev_jax import testing
from lev_jax.readout import Planner
from lev_jax.training import batches, config, loop, mesh as mesh_lib

assert len(jax.devices()) == 8
bb = testing.tiny_backbone("qwen3_5", seed=0, init_std=0.05)
# lr 1e-3: Adam divides by sqrt(v), so a gradient near its eps turns a 1e-9 summation-order difference
# into an lr-sized step; at 1e-2 that alone reaches 1e-4 in the adapter after three steps.
cfg = config.resolve("tiny", {"lr": 1e-3})
renderer = batches.Renderer(Planner(bb.tokenizer), seed=0)
topics = ["sports", "world", "business", "sci_tech"]
q = {"type": "choice", "instructions": "Which topic?", "criteria": {t: None for t in topics}}
noul = {"type": "noul", "instructions": "Is it good news?", "criteria": None}
steps = []
for s in range(3):
    recs = [{"state": f"Story {s}-{i}: {t} today.", "question": q, "target_dist": [float(j == i % 4) for j in range(4)],
             "readout": "choice"} for i, t in enumerate(topics)]
    recs += [{"state": f"Note {s}-{i}.", "question": noul, "target_dist": [0.0] * 8 + [1.0], "readout": "noul_rating"}
             for i in range(4)]
    exs = [renderer.example(r, renderer.rng(s, i)) for i, r in enumerate(recs)]
    steps.append(batches.pack(exs, multiple=4, min_length=cfg.min_length)[0])

def run(mesh):
    trainer = loop.Trainer(cfg, bb, mesh)
    state = trainer.init_state()
    losses = []
    for arrays in steps:
        state, m = trainer.step(state, trainer.put_batch(arrays))
        losses.append(float(m["loss"]))
    sh = jax.tree.leaves(state["trainable"])[0].sharding
    return losses, jax.device_get(state["trainable"]), str(sh.spec), mesh

one_l, one_t, _, _ = run(mesh_lib.make("", devices=jax.devices()[:1]))
many_l, many_t, spec, mesh = run(mesh_lib.make("data=2,fsdp=2,tensor=2"))
diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
           for a, b in zip(jax.tree.leaves(one_t), jax.tree.leaves(many_t)))
moved = max(float(np.abs(np.asarray(b)).max()) for b in jax.tree.leaves({k: v["b"] for k, v in many_t.items()}))
print(json.dumps({"one": one_l, "many": many_l, "adapter_diff": diff, "b_moved": moved, "spec": spec,
                  "mesh": dict(mesh.shape), "axis_types": [str(t) for t in mesh.axis_types]}))
"""


def test_sharded_equals_unsharded():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert len(r["one"]) == 3 and "fsdp" in r["spec"]  # the adapter really is sharded
    for a, b in zip(r["one"], r["many"]):
        assert abs(a - b) <= 1e-5
    assert r["adapter_diff"] <= 1e-5
    assert r["b_moved"] > 1e-3  # the adapter trained (b left zero)
