"""``csrc/format.h`` states the row format and the P pipeline's constants in C++;
``vllm_snapmla/format.py`` is the authoritative copy.  They must agree."""

import re
from pathlib import Path

from vllm_snapmla import format as fmt

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def _constants(header: Path) -> dict[str, float]:
    """``constexpr int|float kName = value;`` of a header (hex floats such as 0x1p-126f too)."""
    values = {}
    for name, value in re.findall(r"constexpr (?:int|float) (k\w+) = ([^;]+);",
                                  header.read_text()):
        value = value.split("//")[0].strip().rstrip("f")
        try:
            values[name] = float.fromhex(value) if "0x" in value else float(value)
        except ValueError:
            pass   # derived from other constants (e.g. kKvLoraRank + kRopeDim)
    return values


def test_row_format_matches_format_py():
    c = _constants(CSRC / "format.h")
    assert {name: c[name] for name in ("kPageSize", "kKvLoraRank", "kRopeDim", "kContentOffset",
                                       "kScaleOffset", "kPadOffset", "kRopeOffset",
                                       "kBytesPerToken", "kFp8Max", "kRopePrescaledMax",
                                       "kScaleFloor")} == {
        "kPageSize": fmt.PAGE_SIZE, "kKvLoraRank": fmt.KV_LORA_RANK, "kRopeDim": fmt.ROPE_DIM,
        "kContentOffset": fmt.CONTENT_OFFSET, "kScaleOffset": fmt.SCALE_OFFSET,
        "kPadOffset": fmt.PAD_OFFSET, "kRopeOffset": fmt.ROPE_OFFSET,
        "kBytesPerToken": fmt.BYTES_PER_TOKEN, "kFp8Max": fmt.FP8_MAX,
        "kRopePrescaledMax": fmt.ROPE_PRESCALED_MAX, "kScaleFloor": fmt.SCALE_FLOOR}


def test_p_pipeline_constants_match_format_py():
    c = _constants(CSRC / "format.h")
    assert c["kPScaleFloor"] == fmt.P_SCALE_FLOOR
    assert c["kPScaleRange"] == fmt.P_SCALE_RANGE
