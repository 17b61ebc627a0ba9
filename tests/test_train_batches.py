"""Training rows are the served rows: records -> Planner rows -> shared-prefix groups, targets per code,
large choices in two rounds, and gradients through a shared prefix equal those of independent rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lev_jax import domain, testing
from lev_jax.readout import Planner
from lev_jax.training import batches, config, loop, lora
from lev_jax.training import mesh as mesh_lib

CHOICE = {
    "type": "choice",
    "instructions": "Which topic?",
    "criteria": {"world": "World news", "sports": None, "business": "Markets", "sci_tech": None},
}
SCORE = {"type": "score", "instructions": "How positive?", "criteria": ["bad", "so-so", "good"]}
NOUL = {"type": "noul", "instructions": "Is it positive?", "criteria": {"yes": "it is", "no": "it is not"}}


def _rec(state, q, dist, readout):
    return {"state": state, "question": q, "target_dist": dist, "readout": readout, "source": "t"}


RECORDS = [
    _rec("The striker scored twice in the final.", CHOICE, [0, 1, 0, 0], "choice"),
    _rec({"review": "A tender, witty film."}, SCORE, [0, 0, 1], "score"),
    _rec("Dull and far too long.", NOUL, [1, 0, 0, 0, 0, 0, 0, 0, 0], "noul_rating"),  # rating 0: a no
    _rec("Markets fell as the bank cut rates.", CHOICE, [0, 0, 1, 0], "choice"),
]


@pytest.fixture(scope="module")
def bb():
    # weights at a trained model's scale (not the default 0.5 that makes tiny label distributions
    # peaked): fp32 rounding of the two computation orders stays far below the 1e-5 tolerance
    return testing.tiny_backbone("qwen3_5", seed=0, init_std=0.05)


def _examples(bb, records, **planner_kw):
    r = batches.Renderer(Planner(bb.tokenizer, **planner_kw), seed=0)
    return [r.example(rec, r.rng(0, i)) for i, rec in enumerate(records)]


def test_rows_are_the_planners_rows_with_targets_per_code(bb):
    planner = Planner(bb.tokenizer)
    ex = _examples(bb, RECORDS)
    text = planner.state_text(RECORDS[0]["state"])
    qp = planner.question(text, "q", CHOICE)
    assert ex[0].prefix == planner.prefix_ids(text)
    assert [r.tokens for r in ex[0].rows] == [r.tokens for r in qp.readouts[0].rows]  # both option orders
    assert [r.label_ids for r in ex[0].rows] == [r.label_ids for r in qp.readouts[0].rows]
    assert ex[0].targets[0].tolist() == [0, 1, 0, 0] and ex[0].targets[1].tolist() == [0, 0, 1, 0]  # reversed
    assert ex[1].ordinal == [True] and ex[1].targets[0].tolist() == [0, 0, 1]
    # the served noul readout is binary [yes, no]: a rating-0 target is "no"
    assert ex[2].modes == [domain.READOUT_MODES.index(domain.BINARY)] * 2
    assert ex[2].targets[0].tolist() == [0, 1] and ex[2].ordinal == [False, False]
    rating = _examples(bb, RECORDS[2:3], noul_readout=domain.RATING)[0]
    assert rating.ordinal == [True] and rating.targets[0].tolist() == [1] + [0] * 8


def test_large_choices_train_both_rounds(bb):
    planner = Planner(bb.tokenizer)
    planner.group_size = 4  # as a tokenizer with few single-token codes would have it
    options = {f"intent_{i}": None for i in range(10)}
    rec = _rec(
        "I lost my card.",
        {"type": "choice", "instructions": "Which intent?", "criteria": options},
        [0.0] * 7 + [1.0, 0.0, 0.0],
        "choice",
    )
    r = batches.Renderer(planner, seed=0)
    ex = r.example(rec, r.rng(0, 0))
    qp = planner.question(planner.state_text(rec["state"]), "q", rec["question"])
    gi = next(i for i, g in enumerate(qp.groups) if 7 in g)
    assert [x.tokens for x in ex.rows[:2]] == [x.tokens for x in qp.readouts[gi].rows]  # the gold's group
    assert ex.targets[0][qp.groups[gi].index(7)] == 1.0
    round2 = ex.rows[2:]
    assert len(round2) == 2 and len(round2[0].label_ids) == len(qp.groups)  # one winner per group
    assert sum(t.sum() for t in ex.targets[2:]) == 2.0  # the gold wins its group in both orders
    again = r.example(rec, r.rng(0, 0))  # seeded: a resumed run draws the same distractors
    assert [x.tokens for x in again.rows] == [x.tokens for x in ex.rows]


def test_groups_share_the_longest_prefix(bb):
    ex = _examples(bb, RECORDS)
    groups = batches.group_rows(ex)
    assert len(groups) == len(RECORDS)  # state first: one group per example (its option orders)
    for g in groups:
        e = g.rows[0][0]
        assert len(g.prefix) > len(ex[e].prefix)  # state + the question header both orders share
        for e, i, suffix in g.rows:
            assert g.prefix + suffix == ex[e].prefix + ex[e].rows[i].tokens
    # schema first, one question: every row shares the whole question
    same_q = [_rec(f"Story {i}: the match went to penalties.", CHOICE, [0, 1, 0, 0], "choice") for i in range(5)]
    ex_q = _examples(bb, same_q, layout="schema_first", option_averaging=False)
    (g,) = batches.group_rows(ex_q)
    assert len(g.rows) == 5 and all(len(s) < 40 for _, _, s in g.rows)
    arrays, tokens = batches.pack(ex_q)
    assert arrays["prefix_EP"].shape[0] == 1 and tokens == len(g.prefix) + sum(len(s) for _, _, s in g.rows)


@pytest.mark.parametrize("layout", ["state_first", "schema_first"])
def test_shared_prefix_gradients_equal_independent_rows(bb, layout):
    cfg = config.resolve("tiny", {"layout": layout})
    records = (
        RECORDS
        if layout == "state_first"
        else [_rec(f"Story {i}: the match went to penalties.", CHOICE, [0, 1, 0, 0], "choice") for i in range(3)]
    )
    ex = _examples(bb, records, layout=layout)
    trainer = loop.Trainer(cfg, bb, mesh_lib.make(""))
    state = trainer.init_state()
    trainable = jax.tree.map(lambda x: x + 0.05, state["trainable"])  # b != 0: the adapter matters
    grad = jax.jit(jax.value_and_grad(lambda t, f, b: trainer.loss(t, f, b)[0]))
    shared, _ = batches.pack(ex)
    alone, _ = batches.pack(ex, shared=False)
    assert shared["prefix_EP"].shape[0] < alone["prefix_EP"].shape[0]
    (l1, g1), (l2, g2) = grad(trainable, trainer.frozen, shared), grad(trainable, trainer.frozen, alone)
    assert float(l1) == pytest.approx(float(l2), abs=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g1)) > 1e-3  # gradients are not trivially 0
    assert lora.n_params(g1) == lora.n_params(trainable)


def test_rows_read_a_few_at_a_time_give_the_same_loss_and_gradients(bb):
    """`rows_per_call` (lax.map over chunks of a group's rows, the last chunk padded) schedules the
    work differently and computes the same thing."""
    records = [_rec(f"Story {i}: the match went to penalties.", CHOICE, [0, 1, 0, 0], "choice") for i in range(5)]
    ex = _examples(bb, records, layout="schema_first")
    arrays, _ = batches.pack(ex)
    assert arrays["tokens_ERT"].shape[1] > 5 and arrays["tokens_ERT"].shape[1] % 5  # a ragged last chunk
    out = []
    for k in (0, 5):
        cfg = config.resolve("tiny", {"layout": "schema_first", "rows_per_call": k})
        trainer = loop.Trainer(cfg, bb, mesh_lib.make(""))
        trainable = jax.tree.map(lambda x: x + 0.05, trainer.init_state()["trainable"])
        grad = jax.jit(jax.value_and_grad(lambda t, f, b: trainer.loss(t, f, b)[0]))
        out.append(grad(trainable, trainer.frozen, arrays))
    (l0, g0), (l5, g5) = out
    assert float(l0) == pytest.approx(float(l5), abs=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g5)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g0)) > 1e-3


def test_mode_b_examples_train_the_marked_row_shuffled_and_the_mode_a_rows(bb):
    """With a head (`--mode-b`) a routed choice trains its marked row, options in a seeded random
    order with the target following them, and (joint) the Mode A rows; the training step scores the
    rows exactly as the serving executor reads them, and the loss reaches the head."""
    from lev_jax.readout import Executor, Usage, modeb

    kw = {"mode_b": True, "mode_b_min_options": 4}
    planner = Planner(bb.tokenizer, **kw)
    r = batches.Renderer(planner, seed=0)
    ex = r.example(RECORDS[3], r.rng(0, 3))
    marked = [row for row in ex.rows if row.markers is not None]
    assert len(marked) == 1 and len(ex.rows) == 3  # the marked row + both Mode A orders
    i = ex.rows.index(marked[0])
    assert ex.modes[i] == domain.READOUT_MODES.index(domain.MARKER)
    order = ex.levels[i]  # candidate index per marker position
    assert sorted(order) == [0, 1, 2, 3] and ex.targets[i][order.index(2)] == 1.0  # "business" is the gold
    orders = {tuple(r.example(RECORDS[3], r.rng(e, 3)).levels[0]) for e in range(6)}
    assert len(orders) > 1  # shuffled per epoch (seeded: the same on resume)
    a_only = batches.Renderer(planner, seed=0, mode_b_joint=False).example(RECORDS[3], r.rng(0, 3))
    assert len(a_only.rows) == 1

    cfg = config.resolve("tiny", {"mode_b": True, "mode_b_min_options": 4})
    trainer = loop.Trainer(cfg, bb, mesh_lib.make(""))
    state = trainer.init_state()
    trainable = jax.tree.map(lambda x: x + 0.05, state["trainable"])
    assert set(trainable[modeb.HEAD_KEY]) == {"wq", "wk", "wp"}
    examples = [r.example(rec, r.rng(0, k)) for k, rec in enumerate(RECORDS)]
    arrays, _ = batches.pack(examples)
    assert sum(p["marked_ER"].sum() for p in batches.parts(arrays)) == 2  # both 4-option choices
    for g in batches.group_rows(examples):  # a group never mixes marked and Mode A rows
        assert len({examples[e].rows[i].markers is None for e, i, _ in g.rows}) == 1
    scores = np.asarray(trainer.logits(trainable, trainer.frozen, arrays))
    # the serving path (the same merged weights and head): every row of the examples with a marked
    # row (both choices: their marked and Mode A rows) scores alike; the other examples' Mode A rows
    # are test_shared_prefix_gradients_equal_independent_rows'
    served_bb = type(bb)(bb.config, trainer.params(trainable, trainer.frozen), bb.tokenizer, name="t")
    served_bb.mode_b_head = trainable[modeb.HEAD_KEY]
    ex_ = Executor(served_bb)
    for e in (e for e in examples if any(row.markers is not None for row in e.rows)):
        [want] = ex_.read_reference([(e.prefix, e.rows)], [Usage()])
        got = [scores[b] for b in _row_index(arrays, examples, e)]
        for w, g, row in zip(want, got, e.rows):
            np.testing.assert_allclose(g[: row.width], w, atol=2e-4, rtol=0)
    grads = jax.grad(lambda t: trainer.loss(t, trainer.frozen, arrays)[0])(trainable)
    assert all(float(jnp.abs(g).max()) > 0 for g in grads[modeb.HEAD_KEY].values())  # query, key and prior


def _row_index(arrays, examples, example):
    """Flat batch indices of `example`'s rows (pack's layout, recomputed)."""
    e = next(i for i, x in enumerate(examples) if x is example)
    where = batches.row_positions(examples, arrays)
    return [where[(e, i)] for i in range(len(example.rows))]


def _same_question(n, **planner_kw):
    big = {f"intent_{k}": None for k in range(12)}
    q = {"type": "choice", "instructions": "Which intent?", "criteria": big}
    return [_rec(f"Ticket {i}: my card was charged twice.", q, np.eye(12)[i % 12].tolist(), "choice") for i in range(n)]


def test_mode_b_rows_are_a_part_of_their_own_and_scores_equal_the_rows_alone(bb):
    """Schema first, one question per batch, joint: the question's Mode A rows join over the whole
    question (short rows) and the marked rows form the batch's second part, padded apart; the step's
    scores and gradients equal every row read in its own group (no sharing, no parts)."""
    kw = {"mode_b": True, "mode_b_min_options": 4, "layout": "schema_first", "option_averaging": False}
    r = batches.Renderer(Planner(bb.tokenizer, **kw), seed=0, mode_b_options=5)
    examples = [r.example(rec, r.rng(0, k)) for k, rec in enumerate(_same_question(4))]
    plain, marked = batches.layout(examples)
    assert len(plain) == 1 and all(len(t) < 30 for _, _, t in plain[0].rows)  # states after the question
    assert all(examples[e].rows[i].markers is not None for g in marked for e, i, _ in g.rows)
    arrays, _ = batches.pack(examples)
    main, part_b = batches.parts(arrays)
    assert main["tokens_ERT"].shape[2] < part_b["tokens_ERT"].shape[2]  # each part padded to its own rows
    assert part_b["marked_ER"].sum() == 4 and main["marked_ER"].sum() == 0
    cfg = config.resolve("tiny", {k: v for k, v in kw.items() if k != "option_averaging"})
    trainer = loop.Trainer(cfg, bb, mesh_lib.make(""))
    trainable = jax.tree.map(lambda x: x + 0.05, trainer.init_state()["trainable"])
    grad = jax.jit(jax.value_and_grad(lambda t, f, b: trainer.loss(t, f, b)[0]))
    alone, _ = batches.pack(examples, shared=False)
    assert len(batches.parts(alone)) == 1
    (l1, g1), (l2, g2) = grad(trainable, trainer.frozen, arrays), grad(trainable, trainer.frozen, alone)
    assert float(l1) == pytest.approx(float(l2), abs=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert float(jnp.abs(g1[modeb_key()]["wq"]).max()) > 0
    # sampled subsets differ per state: each group's prefix stops before the markers, read in the rows
    assert all(g.markers is None and len(g.prefix) <= len(examples[g.rows[0][0]].prefix) + 13 for g in marked)
    assert not part_b["prefix_keyed_E"].any()
    # a lone marked row computes all but its last token as its prefix, markers included
    lone = batches.Renderer(Planner(bb.tokenizer, **kw), seed=0, mode_b_joint=False).example(
        _same_question(1)[0], r.rng(0, 0)
    )
    (g,) = batches.group_rows([lone])
    assert g.markers == [len(lone.prefix) + m for m in lone.rows[0].markers] and len(g.rows[0][2]) == 1
    assert batches.pack([lone])[0]["marked_ER"].sum() == 1


def test_a_batch_of_one_question_reads_its_options_once_in_the_prefix(bb):
    """Every option (no sampling): a batch's marked rows share one seeded option order, so with the
    schema first the options block, markers and all, is their group's prefix (its markers read
    there once) and each state is a short row after it; the step's scores and gradients equal
    every row read alone (markers in the row), and the order changes from batch to batch."""
    kw = {"mode_b": True, "mode_b_min_options": 4, "layout": "schema_first", "option_averaging": False}
    r = batches.Renderer(Planner(bb.tokenizer, **kw), seed=0, mode_b_joint=False)
    records = _same_question(4)
    examples, _ = r.batch({"rows": records, "index": np.arange(4), "epoch": 0})
    assert len({tuple(ex.levels[0]) for ex in examples}) == 1  # one order for the batch
    other, _ = r.batch({"rows": records, "index": np.arange(4, 8), "epoch": 0})
    assert other[0].levels[0] != examples[0].levels[0]
    (g,) = batches.group_rows(examples)
    row = examples[0].rows[0]
    assert g.markers == [len(examples[0].prefix) + m for m in row.markers]  # every marker in the prefix
    assert all(len(t) < len(row.tokens) - row.markers[-1] for _, _, t in g.rows)  # states after the options
    arrays, _ = batches.pack(examples)
    assert arrays["prefix_keyed_E"].sum() == 1 and arrays["marked_ER"].sum() == 4
    np.testing.assert_array_equal(arrays["prefix_markers_EC"][0, :12], g.markers)
    cfg = config.resolve("tiny", {k: v for k, v in kw.items() if k != "option_averaging"})
    trainer = loop.Trainer(cfg, bb, mesh_lib.make(""))
    trainable = jax.tree.map(lambda x: x + 0.05, trainer.init_state()["trainable"])
    grad = jax.jit(jax.value_and_grad(lambda t, f, b: trainer.loss(t, f, b)[0]))
    alone, _ = batches.pack(examples, shared=False)
    assert not alone["prefix_keyed_E"].any()
    (l1, g1), (l2, g2) = grad(trainable, trainer.frozen, arrays), grad(trainable, trainer.frozen, alone)
    assert float(l1) == pytest.approx(float(l2), abs=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert float(jnp.abs(g1[modeb_key()]["wk"]).max()) > 0
    # the same rows read one at a time (rows_per_call) score alike
    chunked_cfg = config.resolve(
        "tiny", {**{k: v for k, v in kw.items() if k != "option_averaging"}, "rows_per_call": 3}
    )
    chunked = loop.Trainer(chunked_cfg, bb, mesh_lib.make(""))
    np.testing.assert_allclose(
        np.asarray(chunked.logits(trainable, trainer.frozen, arrays)),
        np.asarray(trainer.logits(trainable, trainer.frozen, arrays)),
        rtol=1e-6,
    )


def modeb_key():
    from lev_jax.readout import modeb

    return modeb.HEAD_KEY


def test_mode_b_options_samples_the_gold_and_others_per_epoch(bb):
    """`mode_b_options`: a marked training row lists that many options, always the gold, the
    others drawn per (seed, epoch, record), the target on the gold; 0 lists every option."""
    kw = {"mode_b": True, "mode_b_min_options": 4, "layout": "schema_first", "option_averaging": False}
    planner = Planner(bb.tokenizer, **kw)
    rec = _same_question(4)[3]  # gold: intent_3
    r = batches.Renderer(planner, seed=0, mode_b_options=5, mode_b_joint=False)
    seen = set()
    for epoch in range(6):
        ex = r.example(rec, r.rng(epoch, 3))
        (row,), (levels,), (target,) = ex.rows, ex.levels, ex.targets
        assert len(row.markers) == 5 and len(levels) == 5 and 3 in levels
        assert target[levels.index(3)] == 1.0 and target.sum() == pytest.approx(1.0)
        seen.add(frozenset(levels))
        assert ex.rows == r.example(rec, r.rng(epoch, 3)).rows  # seeded: the same on resume
    assert len(seen) > 1
    full = batches.Renderer(planner, seed=0, mode_b_joint=False).example(rec, r.rng(0, 3))
    assert sorted(full.levels[0]) == list(range(12)) and len(full.rows[0].tokens) > len(row.tokens)
    with pytest.raises(config.ConfigError, match="mode_b_options"):
        config.resolve("tiny", {"mode_b": True, "mode_b_options": 1})
