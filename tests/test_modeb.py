"""Mode B's pieces (lev_jax/readout/modeb.py): the reserved marker of each tokenizer, the marked row,
the scorer head over the marker hidden states read after a shared state prefix, against one full
forward of the whole sequence; 151 and 255 options in one row each."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lev_jax import models, prompt
from lev_jax.errors import RequestError
from lev_jax.readout import logits as logits_lib
from lev_jax.readout import modeb
from lev_jax.testing import tiny_backbone


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def tiny(request):
    return tiny_backbone(request.param, seed=2)


def test_each_tokenizer_has_a_one_id_marker_and_text_with_it_is_refused(tiny):
    text, mid = modeb.marker_token(tiny.tokenizer)
    assert tiny.tokenizer.encode(text) == [mid] and mid in tiny.tokenizer.special_ids
    assert text == ("<empty_output>" if tiny.name == "tiny-llama" else "<|object_ref_end|>")
    with pytest.raises(RequestError, match="reserves"):
        modeb.check_text(f"refund {text}", text, "option 'refund'")
    modeb.check_text("a plain option", text, "option 'x'")


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _options(n):
    return [(f"Queue {i:03d}", f"tickets routed to queue {i}") for i in range(n)]


@pytest.mark.parametrize("n", [7, 151, 255])
def test_marker_scores_after_a_shared_prefix_equal_one_full_forward(tiny, n):
    bb = tiny
    fmt = prompt.PromptFormat(bb.tokenizer, "chat")
    _, mid = modeb.marker_token(bb.tokenizer)
    head = modeb.init_head(bb.config.hidden_size, width=32, seed=1)
    prefix = fmt.encode_prefix(fmt.build("A customer writes: my parcel is late.", "").prefix)
    rows = [modeb.marked_row(fmt, mid, "Which queue?", opts) for opts in (_options(n), _options(n)[::-1])]
    assert all(len(m) == n and all(t[p] == mid for p in m) for t, m in rows)  # one row per order, n markers
    T = max(len(t) for t, _ in rows)
    tokens = np.zeros((2, T), np.int32)
    valid = np.zeros((2, T), bool)
    markers = np.zeros((2, n), np.int32)
    for b, (t, m) in enumerate(rows):
        tokens[b, : len(t)], valid[b, : len(t)], markers[b] = t, True, m
    cache = bb.prefill(prefix)
    fast = np.asarray(
        logits_lib.read_marker_rows(
            bb.params, head, cache, None, jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(markers), bb.config
        )
    )
    for b, (t, m) in enumerate(rows):
        hidden, _ = models.forward(bb.params, jnp.asarray([prefix + t]), None, bb.config)
        want = np.asarray(modeb.head_scores(head, hidden[:, np.asarray(m) + len(prefix)]))[0]
        # the question's distribution (as predict() answers it) to 1e-5; the raw scores of a 2k-token
        # row differ by fp32 rounding through the layers (<= 3.3e-4 on these deliberately large-weight models)
        np.testing.assert_allclose(_softmax(fast[b]), _softmax(want), atol=1e-5, rtol=0)
        np.testing.assert_allclose(fast[b], want, atol=5e-4, rtol=0)
    assert np.abs(fast[0] - fast[1][::-1]).max() > 1e-4  # the two orders are different rows


def test_head_round_trips_through_named_tensors():
    head = modeb.init_head(48, width=16, seed=3)
    back = modeb.head_from_tensors(modeb.head_tensors(head))
    for k in head:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(head[k]))
    bad = modeb.head_tensors(head)
    del bad["mode_b_head.w2"]
    with pytest.raises(ValueError, match="mode_b_head.w2"):
        modeb.head_from_tensors(bad)
