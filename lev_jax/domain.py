"""The domain vocabulary: question types, their limits, readout modes, rating codes, option-count
bands and token budgets. Defined here once; the engine, the wire, calibration, the data pipeline
and training import them from here.
"""

from __future__ import annotations

import numpy as np

# -- question types and their limits ---------------------------------------------------------------
CHOICE, SCORE, NOUL = "choice", "score", "noul"
QUESTION_TYPES = (CHOICE, SCORE, NOUL)
CHOICE_OPTIONS = (2, 255)  # (fewest, most) options of a choice question
SCORE_LEVELS = (2, 10)  # (fewest, most) levels of a score question
# noul criteria as the Jev wire sends them ({"true": ..., "false": ...}); "yes"/"no" are accepted aliases
NOUL_CRITERIA = ("true", "false")
NOUL_CRITERIA_ALIASES = {"yes": "true", "no": "false"}

# -- readout modes ---------------------------------------------------------------------------------
LETTER = "letter"  # one letter code per option / level (choice, score)
BINARY = "binary"  # noul read as [Yes, No]
RATING = "rating"  # noul read as a 0..8 rating; P(yes) is its expectation / 8
MARKER = "marker"  # Mode B: a trained head scores the reserved marker after each option (readout.modeb)
READOUT_MODES = (LETTER, BINARY, RATING, MARKER)
NOUL_READOUTS = (BINARY, RATING)

YES_NO = ("Yes", "No")  # the binary noul codes, in readout order [yes, no]
RATING_LEVELS = 9
RATING_CODES = tuple(str(i) for i in range(RATING_LEVELS))  # "0" (certainly no) .. "8" (certainly yes)
RATING_NO, RATING_YES = 0, RATING_LEVELS - 1  # the ratings a labelled no / yes trains towards
RATING_WEIGHTS = np.arange(RATING_LEVELS, dtype=np.float64) / (RATING_LEVELS - 1)  # rating -> P(yes) weight
RATING_WEIGHTS.setflags(write=False)
MAX_ORDERED_LEVELS = max(SCORE_LEVELS[1], RATING_LEVELS)  # the most levels an ordered readout has

# -- option-count bands (calibration buckets, mixture coverage) ------------------------------------
BANDS = ("small", "mid", "large")
BAND_RANGES: dict[str, tuple[int, int | None]] = {"small": (2, 8), "mid": (9, 26), "large": (27, None)}
BANDED_QTYPES = frozenset({CHOICE})  # question types whose temperature is looked up per band


# Mode B reads a choice of at least this many options where a head is loaded (the large band: there
# Mode A's one row lists every option with a code, or splits into groups and a second round)
MODE_B_MIN_OPTIONS = BAND_RANGES["large"][0]


def band_of(n_options: int) -> str:
    """The band of an option count: "small" (<= 8), "mid" (9-26) or "large" (> 26)."""
    n = int(n_options)
    if n < 1:
        raise ValueError(f"n_options must be >= 1, got {n_options}")
    for band in BANDS:
        hi = BAND_RANGES[band][1]
        if hi is None or n <= hi:
            return band
    raise AssertionError("the last band is open-ended")


# -- token budgets (checked before any device work) ------------------------------------------------
MAX_STATE_PLUS_QUESTION_TOKENS = 32768  # the state prefix plus the longest question row
MAX_REQUEST_TOKENS = 65536  # the state once plus every question row

# -- images (vision checkpoints; checked before any device work) -----------------------------------
MAX_IMAGES_PER_REQUEST = 8  # image placeholders a request's state may use (each occurrence counts)
MAX_IMAGE_BYTES = 16 << 20  # encoded bytes of one image asset
# width x height an image may declare in its header: a larger one is refused before it is decoded
# (a 20000 x 20000 PNG is a few KB of bytes and 1.6 GB of pixels). 24 MP takes a 6000 x 4000 camera
# photo; a PNG is decoded whole before it is reduced (images.py), ~100 MB at this size, where 40 MP
# took ~730 MB through the conversions
MAX_IMAGE_PIXELS = 24_000_000
# the default pixel budget per image: an image is resized (aspect kept) to at most this many pixels
# before the vision tower, so its cost in image tokens is bounded
IMAGE_PIXEL_BUDGET = 512 * 512

# -- wire limits (checked on the parsed body, before any tokenizing or image decoding) -------------
# Cheap caps a request is refused at (422) before the engine spends anything on it: the token
# budgets above are only known once the text is tokenized, which for a large state (or many
# questions) is itself the cost to avoid. Characters are counted in the request's strings (keys
# too); MAX_CHARS_PER_TOKEN turns token budgets into character caps with room to spare (real text
# averages ~4 characters per token), so a request within the token budgets is within these.
MAX_CHARS_PER_TOKEN = 8
MAX_STATE_CHARS = MAX_STATE_PLUS_QUESTION_TOKENS * MAX_CHARS_PER_TOKEN  # the state's strings
MAX_REQUEST_CHARS = MAX_REQUEST_TOKENS * MAX_CHARS_PER_TOKEN  # the state's and every question's strings
MAX_TEXT_CHARS = 32768  # one instruction, option name or description, level or noul criterion (a string)
MAX_ID_CHARS = 256  # a question id, an asset key or a multipart part name
# JSON values (objects, arrays, strings, numbers, literals) in a request body. Each becomes a Python
# object (~50-100 bytes) when the body is parsed: 2M one-character strings in a 10 MB body (972 bytes
# with zstd) took 6 s and hundreds of MB to parse and walk. Legitimate requests stay far below (512
# questions of 255 described options are ~133k values).
MAX_REQUEST_VALUES = 1 << 18
MAX_QUESTIONS = 512  # questions per request
MAX_ASSETS = MAX_IMAGES_PER_REQUEST  # image assets per request: each must be used in the state
# base64 of the largest image asset, with a line break every 76 characters (MIME) allowed for
MAX_ASSET_BASE64_CHARS = -(-MAX_IMAGE_BYTES // 3) * 4 * 78 // 76 + 2
