// The fp8_snapmla cache row format: mirrors vllm_snapmla/format.py (the authoritative copy).
#pragma once

namespace snapmla {

constexpr int kPageSize = 64;       // tokens per KV block
constexpr int kKvLoraRank = 512;    // latent content values per token
constexpr int kRopeDim = 64;        // RoPE key values per token
constexpr int kHeadSize = kKvLoraRank + kRopeDim;

constexpr int kContentOffset = 0;   // e4m3[512]   content / s
constexpr int kScaleOffset = 512;   // float32     s
constexpr int kPadOffset = 516;     // zero[12]
constexpr int kRopeOffset = 528;    // bf16[64]    k_pe / s
constexpr int kBytesPerToken = 656;

constexpr float kFp8Max = 448.0f;
constexpr float kRopePrescaledMax = 0x1p24f;  // bound on |k_pe / s|
constexpr float kScaleFloor = 0x1p-126f;      // smallest normal float32

// The decode's P pipeline (docs/format.md "Decode").
constexpr float kPScaleFloor = 0x1p-126f;   // floor on a page's amax(P') before dividing by 448
constexpr float kPScaleRange = 0x1p-32f;    // sigma_P never drops below this fraction of the peak

static_assert(kContentOffset + kKvLoraRank == kScaleOffset, "content must end at the scale");
static_assert(kScaleOffset + 4 == kPadOffset, "scale is one float32");
static_assert(kRopeOffset + 2 * kRopeDim == kBytesPerToken, "rope must end the row");
static_assert(kRopeOffset % 16 == 0 && kBytesPerToken % 16 == 0, "16-byte vector access");

}  // namespace snapmla
