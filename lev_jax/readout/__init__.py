"""The readout path shared by predict() and training: (state, question) -> rows and label ids
(`plan`), label logits of rows (`logits`), bucketed execution with a prefix cache (`execute`, serving
only), and logits -> calibrated probabilities -> Jev answers (`compose`)."""

from lev_jax.readout.compose import answer, question_probs, readout_probs, run
from lev_jax.readout.execute import Executor, Usage
from lev_jax.readout.logits import (
    RowBatch,
    pack_prefixes,
    pack_rows,
    prefixed_label_logits,
    rows_exit_logits,
    rows_label_logits,
    rows_scores,
)
from lev_jax.readout.plan import (
    MODE_A,
    MODE_A_GROUPED,
    MODE_B,
    ImagePrefix,
    Planner,
    QuestionPlan,
    Readout,
    RequestPlan,
    Row,
    check_limits,
    normalize_question,
    prefix_key,
    route,
)

__all__ = [
    "MODE_A",
    "MODE_A_GROUPED",
    "MODE_B",
    "route",
    "rows_scores",
    "Executor",
    "ImagePrefix",
    "Planner",
    "QuestionPlan",
    "Readout",
    "RequestPlan",
    "Row",
    "RowBatch",
    "Usage",
    "answer",
    "check_limits",
    "normalize_question",
    "pack_prefixes",
    "pack_rows",
    "prefix_key",
    "prefixed_label_logits",
    "question_probs",
    "readout_probs",
    "rows_exit_logits",
    "rows_label_logits",
    "run",
]
