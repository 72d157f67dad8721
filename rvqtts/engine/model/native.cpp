// rvqtts's native CPU kernels, built and loaded by rvqtts/engine/native.py once per machine at one of two
// instruction-set levels: AVX2 + FMA (every x86-64 CPU of the last ten years) and AVX512-BF16 (with AMX tiles
// where the CPU has them). A few bfloat16 rows x [M, K] through a linear map W [N, K] held as bfloat16 or as
// int8 with a float scale per output channel (W8A16), chosen per map shape by measurement
// (rvqtts/engine/kernels.py); and a decoder layer's row-wise steps (RMSNorm, q/k norms with RoPE, attention
// over the cache, SiLU times up), alone or with the maps as one whole layer.
//
// Map weights are packed once as [N/16][K/2][16][2]: one 64-byte vector (32 bytes for int8) per block of
// 16 output channels and pair of inputs, the operand layout of VDPBF16PS. A tile keeps CB blocks x RB
// rows of float accumulators in registers and streams its blocks' weights once per pass over its rows.
// `int8dot` holds its int8 weights in groups of two pairs that widen to bfloat16 by table lookups (`widen_group`);
// `int4dot` holds 4-bit weights in groups of inputs with a scale and zero each (its own layout, `int4_matmul`).
// The AVX2 kernels read the same packed weights, widening them to float32 vectors in registers (bfloat16 by a
// shift and a mask, int8 by sign extension), and multiply them with FMA: half of float32's bytes read for
// bfloat16 weights, a quarter for int8.
//
// Every output is one fixed sequence: acc = 0; for each input pair, acc = dpbf16(acc, x pair, w pair) (AVX2
// bfloat16: acc = fma(w even, x even, acc), then fma(w odd, x odd, acc); AVX2 int8: an even and an odd sum, each
// by FMA over the pairs, added at the end); then (int8) acc * scale; then rounding to bfloat16. Threads split the output channels, never the
// inputs, so a row's bits do not depend on how many rows share the call, which tile it fell in, or
// the thread count: a tree round's rows equal plain steps bit for bit. The row-wise steps compute each
// row (and each query) alone, so they keep that.
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int kBlock = 16;   // output channels per vector
constexpr int kAheadBytes = 1024;  // how far ahead of the loads each block's weights are prefetched
constexpr int kGroup = 4;    // blocks per tile where they divide the channels (else single blocks)
constexpr int kRows = 6;     // rows per tile at most: kGroup x kRows accumulators fit the 32 registers
constexpr int kGroupRows = 5;  // int8: rows per tile at most, beside the byte tables and a group's two vectors

// Asks for the cache line kAheadBytes past block-pair `index`'s weights, ahead of their loads.
template <bool Int8>
inline void prefetch(const void* packed, int64_t index) {
    _mm_prefetch(reinterpret_cast<const char*>(packed) + index * (Int8 ? 32 : 64) + kAheadBytes, _MM_HINT_T0);
}

#if defined(__AVX512BF16__)
template <bool Int8>
inline __m512bh load_pair(const void* packed, int64_t index) {
    if constexpr (Int8) {
        // (the AMX kernel's widening, over the pairs in order; `int8dot` widens its own groups, `widen_group`)
        // each half sign-extended straight from memory: no 32-byte load and lane extract
        const __m128i* halves = reinterpret_cast<const __m128i*>(packed) + 2 * index;
        __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(halves)));
        __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(halves + 1)));
        return _mm512_cvtne2ps_pbh(high, low);  // int8 values are exact in bfloat16
    } else {
        return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const __m512i*>(packed) + index);
    }
}

// int8 weights as `int8dot` holds them (native.py, `pack`): a block's input pairs p and p + 1 (p even) as one 64-byte
// group of sign-magnitude bytes (0x80 | |w| for negative w; quantized weights lie in [-127, 127]), pair p's bytes at
// 0-7, 16-23, 32-39, 48-55 and pair p + 1's at the rest. Two table lookups give every byte's bfloat16 low and high
// byte (the sign put back into the high one), and unpacking them gives pair p's vector and pair p + 1's: the values
// `load_pair` widens, in 5 instructions for 64 weights where it takes 10, so that a call of one row is bound by
// reading its bytes again, not by widening them.
struct Bf16Bytes {  // the low and high bytes of bfloat16(m), m = 0 .. 127, as two 128-byte tables (a pair of vectors each)
    __m512i low_first, low_second, high_first, high_second;
};

constexpr uint16_t bf16_bits(int m) {  // bfloat16 of a small non-negative integer (exact: at most 7 significant bits)
    int e = 0;
    while (m >> (e + 1)) ++e;
    return m ? static_cast<uint16_t>(((127 + e) << 7) | ((m << (7 - e)) & 0x7F)) : 0;
}

inline Bf16Bytes bf16_bytes() {
    alignas(64) static const auto bytes = [] {
        struct { uint8_t low[128], high[128]; } tables{};
        for (int m = 0; m < 128; ++m) tables.low[m] = bf16_bits(m) & 0xFF, tables.high[m] = bf16_bits(m) >> 8;
        return tables;
    }();
    const __m512i* vectors = reinterpret_cast<const __m512i*>(&bytes);
    return {_mm512_load_si512(vectors), _mm512_load_si512(vectors + 1), _mm512_load_si512(vectors + 2),
            _mm512_load_si512(vectors + 3)};
}

// The group holding block-pair `index` (even) and the next, widened: pair `index`'s vector and the next one's.
inline __attribute__((always_inline)) void widen_group(const void* packed, int64_t index, const Bf16Bytes& tables,
                                                       __m512bh& first, __m512bh& second) {
    const __m512i bytes = _mm512_loadu_si512(static_cast<const char*>(packed) + index * 32);
    const __m512i low = _mm512_permutex2var_epi8(tables.low_first, bytes, tables.low_second);
    const __m512i magnitude = _mm512_permutex2var_epi8(tables.high_first, bytes, tables.high_second);
    const __m512i high = _mm512_ternarylogic_epi32(magnitude, bytes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
    first = (__m512bh)_mm512_unpacklo_epi8(low, high);  // bfloat16 lanes: the low byte first
    second = (__m512bh)_mm512_unpackhi_epi8(low, high);
}

// How a tile pass reads its blocks' weights. A call's first pass streams them from memory, asking for each line
// kAheadBytes ahead (`kStream`); with int8 weights and later passes to come, it also keeps them widened in the thread's
// scratch (`kStreamKeep`). A later pass finds them in cache (`kCached`), or reads the kept ones (`kKept`: int8 widened
// once, not once per pass), and asks instead for the next unit's lines (CB blocks on, into L2), so that memory streams
// while it computes: calls of 9 and 17 rows 3-14 % faster with bfloat16 weights (Zen 4). With int8 weights (groups,
// two pairs a step) a tile takes kGroupRows rows at most: at 6 its accumulators, the byte tables and the broadcast
// inputs spill out of the registers (17 rows 1.3x slower).
enum class Read { kStream, kStreamKeep, kCached, kKept };

// CB blocks x RB rows: each output one sequence of VDPBF16PS over the input pairs, whatever the pass reads.
template <int CB, int RB, bool Int8, Read How>
inline __attribute__((always_inline)) void tile(const uint16_t* x, int64_t K, const void* packed,
                                                const float* scales, int64_t block, int64_t N, uint16_t* y,
                                                uint16_t* kept) {
    const int64_t pairs = K / 2;
    __m512 acc[RB][CB];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
    if constexpr (Int8 && How != Read::kKept) {  // int8 from the packed groups: two pairs a step
        const Bf16Bytes tables = bf16_bytes();
        for (int64_t p = 0; p < pairs; p += 2) {
            for (int c = 0; c < CB; ++c) {
                const int64_t index = (block + c) * pairs + p;
                __m512bh first, second;
                widen_group(packed, index, tables, first, second);
                prefetch<true>(packed, index);
                if constexpr (How == Read::kStreamKeep) {
                    _mm512_storeu_si512(kept + (c * pairs + p) * 2 * kBlock, (__m512i)first);
                    _mm512_storeu_si512(kept + (c * pairs + p + 1) * 2 * kBlock, (__m512i)second);
                }
                for (int r = 0; r < RB; ++r) {
                    const int32_t* pair = reinterpret_cast<const int32_t*>(x + r * K + 2 * p);
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_set1_epi32(pair[0]), first);
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_set1_epi32(pair[1]), second);
                }
            }
        }
    } else {  // bfloat16 vectors: the packed ones, or int8 kept widened; a pair a step
        for (int64_t p = 0; p < pairs; ++p) {
            __m512bh w[CB];
            for (int c = 0; c < CB; ++c) {
                const int64_t index = (block + c) * pairs + p;
                if constexpr (How == Read::kKept)
                    w[c] = (__m512bh)_mm512_loadu_si512(kept + (c * pairs + p) * 2 * kBlock);
                else
                    w[c] = load_pair<false>(packed, index);
                if constexpr (How == Read::kStream)
                    prefetch<false>(packed, index);
                else  // the next unit's (packed int8 for kept weights)
                    _mm_prefetch(static_cast<const char*>(packed) + (index + CB * pairs) * (Int8 ? 32 : 64),
                                 _MM_HINT_T1);
            }
            for (int r = 0; r < RB; ++r) {
                const __m512bh xr = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + 2 * p));
                for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xr, w[c]);
            }
        }
    }
    for (int c = 0; c < CB; ++c) {
        const __m512 scale = Int8 ? _mm512_loadu_ps(scales + (block + c) * kBlock) : _mm512_set1_ps(1.0f);
        for (int r = 0; r < RB; ++r) {
            const __m512 out = Int8 ? _mm512_mul_ps(acc[r][c], scale) : acc[r][c];
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + (block + c) * kBlock),
                                (__m256i)_mm512_cvtneps_pbh(out));
        }
    }
}

template <int CB, bool Int8, Read How>
void pass(int64_t rows, const uint16_t* x, int64_t K, const void* packed, const float* scales, int64_t block,
          int64_t N, uint16_t* y, uint16_t* kept) {
    switch (rows) {
        case 1: tile<CB, 1, Int8, How>(x, K, packed, scales, block, N, y, kept); break;
        case 2: tile<CB, 2, Int8, How>(x, K, packed, scales, block, N, y, kept); break;
        case 3: tile<CB, 3, Int8, How>(x, K, packed, scales, block, N, y, kept); break;
        case 4: tile<CB, 4, Int8, How>(x, K, packed, scales, block, N, y, kept); break;
        case 5: tile<CB, 5, Int8, How>(x, K, packed, scales, block, N, y, kept); break;
        default: tile<CB, kRows, Int8, How>(x, K, packed, scales, block, N, y, kept); break;
    }
}

// All M rows through CB blocks from `block` on, in passes of at most kRows (int8: kGroupRows) rows of equal size.
template <int CB, bool Int8>
void blocks(const uint16_t* x, int64_t M, int64_t K, const void* packed, const float* scales, int64_t block,
            int64_t N, uint16_t* y) {
    const int64_t most = Int8 ? kGroupRows : kRows, passes = (M + most - 1) / most, per_pass = (M + passes - 1) / passes;
    thread_local std::vector<uint16_t> kept;  // int8: the unit's weights widened, for its later passes
    const bool keep = Int8 && passes > 1;
    if (keep) kept.resize(CB * K * kBlock);
    for (int64_t r = 0; r < M; r += per_pass) {
        const int64_t rows = M - r < per_pass ? M - r : per_pass;
        const uint16_t* xr = x + r * K;
        uint16_t* yr = y + r * N;
        if (r == 0 && keep)
            pass<CB, Int8, Read::kStreamKeep>(rows, xr, K, packed, scales, block, N, yr, kept.data());
        else if (keep)
            pass<CB, Int8, Read::kKept>(rows, xr, K, packed, scales, block, N, yr, kept.data());
        else if (r == 0)
            pass<CB, Int8, Read::kStream>(rows, xr, K, packed, scales, block, N, yr, nullptr);
        else
            pass<CB, Int8, Read::kCached>(rows, xr, K, packed, scales, block, N, yr, nullptr);
    }
}

template <bool Int8>
void matmul(const uint16_t* x, int64_t M, int64_t K, const void* packed, const float* scales, int64_t N,
            uint16_t* y) {
    const int64_t total = N / kBlock, groups = total / kGroup, units = groups + total % kGroup;
    #pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        if (u < groups)
            blocks<kGroup, Int8>(x, M, K, packed, scales, u * kGroup, N, y);
        else
            blocks<1, Int8>(x, M, K, packed, scales, groups * kGroup + (u - groups), N, y);
    }
}
#endif  // __AVX512BF16__

inline float to_float(uint16_t bits) {
    uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float value;
    __builtin_memcpy(&value, &wide, 4);
    return value;
}

// Round to nearest even, as torch rounds a float to bfloat16 (NaN kept quiet).
inline uint16_t to_bf16(float value) {
    uint32_t bits;
    __builtin_memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Eight floats' bfloat16 roundings as `to_bf16` gives them: each lane's 16 high bits, the rest zero (AVX2: both builds).
inline __m256i rounded_bits8(__m256 a) {
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd);
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    const __m256i chosen = _mm256_blendv_epi8(up, quiet, _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
    return _mm256_and_si256(chosen, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
}

// Eight floats rounded to bfloat16 as `to_bf16` rounds them, packed.
inline __m128i to_bf16_lanes(__m256 value) {
    const __m256i bits = _mm256_srli_epi32(rounded_bits8(value), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

// Sixteen float lanes, the unit of the row-wise steps: one AVX-512 register, or two AVX2 ones. Every operation is
// the same IEEE operation lane by lane at either width (and the scalar tails are compiled without contraction), so
// both builds compute the same bits, and each row's bits do not depend on the others in a call.
constexpr int kLanes = 16;
#if defined(__AVX512BF16__)
struct Lanes {
    __m512 v;
};
inline Lanes splat(float x) { return {_mm512_set1_ps(x)}; }
inline Lanes load_floats(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store_floats(float* p, Lanes a) { _mm512_storeu_ps(p, a.v); }
inline Lanes load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline Lanes operator+(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Lanes operator-(Lanes a, Lanes b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Lanes operator*(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Lanes operator/(Lanes a, Lanes b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Lanes negate(Lanes a) {
    return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))};
}
inline Lanes clamp(Lanes a, float low, float high) {
    return {_mm512_max_ps(_mm512_min_ps(a.v, _mm512_set1_ps(high)), _mm512_set1_ps(low))};
}
inline Lanes nearest_integer(Lanes a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT)}; }
// 2^n for integral n in [-126, 127], exactly.
inline Lanes power_of_two(Lanes n) {
    const __m512i exponent = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(exponent, 23))};
}
// Each lane's bfloat16 rounding as `to_bf16` gives it: its 16 high bits, the rest zero.
inline __m512i rounded_bits(Lanes a) {
    const __m512i bits = _mm512_castps_si512(a.v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
    const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
    const __m512i chosen = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), up, quiet);
    return _mm512_and_si512(chosen, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}
inline Lanes round_bf16(Lanes a) { return {_mm512_castsi512_ps(rounded_bits(a))}; }
inline void store_bf16(uint16_t* p, Lanes a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded_bits(a), 16)));
}
#else
struct Lanes {
    __m256 low, high;
};
inline Lanes splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Lanes load_floats(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_floats(float* p, Lanes a) { _mm256_storeu_ps(p, a.low), _mm256_storeu_ps(p + 8, a.high); }
inline __m256 widen8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Lanes load_bf16(const uint16_t* p) { return {widen8(p), widen8(p + 8)}; }
inline Lanes operator+(Lanes a, Lanes b) { return {_mm256_add_ps(a.low, b.low), _mm256_add_ps(a.high, b.high)}; }
inline Lanes operator-(Lanes a, Lanes b) { return {_mm256_sub_ps(a.low, b.low), _mm256_sub_ps(a.high, b.high)}; }
inline Lanes operator*(Lanes a, Lanes b) { return {_mm256_mul_ps(a.low, b.low), _mm256_mul_ps(a.high, b.high)}; }
inline Lanes operator/(Lanes a, Lanes b) { return {_mm256_div_ps(a.low, b.low), _mm256_div_ps(a.high, b.high)}; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) {
    return {_mm256_fmadd_ps(a.low, b.low, c.low), _mm256_fmadd_ps(a.high, b.high, c.high)};
}
inline Lanes negate(Lanes a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return {_mm256_xor_ps(a.low, sign), _mm256_xor_ps(a.high, sign)};
}
inline Lanes clamp(Lanes a, float low, float high) {
    const __m256 lo = _mm256_set1_ps(low), hi = _mm256_set1_ps(high);
    return {_mm256_max_ps(_mm256_min_ps(a.low, hi), lo), _mm256_max_ps(_mm256_min_ps(a.high, hi), lo)};
}
inline Lanes nearest_integer(Lanes a) {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.low, kNearest), _mm256_round_ps(a.high, kNearest)};
}
inline __m256 power_of_two8(__m256 n) {
    const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23));
}
inline Lanes power_of_two(Lanes n) { return {power_of_two8(n.low), power_of_two8(n.high)}; }
inline Lanes round_bf16(Lanes a) {
    return {_mm256_castsi256_ps(rounded_bits8(a.low)), _mm256_castsi256_ps(rounded_bits8(a.high))};
}
inline void store_bf16(uint16_t* p, Lanes a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_lanes(a.low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), to_bf16_lanes(a.high));
}
#endif

// The sum of the lanes, in lane order.
inline float sum_lanes(Lanes a) {
    float lanes[kLanes];
    store_floats(lanes, a);
    float sum = 0;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    return sum;
}

// e^x: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error about 2e-7), scaled
// by 2^n; x clamped to [-87, 88], where 2^n is a normal float.
inline Lanes exp_lanes(Lanes x) {
    x = clamp(x, -87.0f, 88.0f);
    const Lanes n = nearest_integer(x * splat(1.44269504f));
    const Lanes r = fma(negate(n), splat(1.42860677e-6f), fma(negate(n), splat(0.693145752f), x));
    Lanes p = splat(1.0f / 720);
    for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fma(p, r, splat(c));
    return p * power_of_two(n);
}

// A dot product of bfloat16 vectors in float32: 16 lanes of fused multiply-adds, their sum, then the tail.
inline float dot(const uint16_t* a, const uint16_t* b, int64_t n) {
    Lanes acc = splat(0.0f);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) acc = fma(load_bf16(a + i), load_bf16(b + i), acc);
    float sum = sum_lanes(acc);
    for (; i < n; ++i) sum += to_float(a[i]) * to_float(b[i]);
    return sum;
}

// The reciprocal root of a row's mean square (float32).
inline float inverse_rms(const uint16_t* x, int64_t n, float eps) {
    return 1.0f / __builtin_sqrtf(dot(x, x, n) / static_cast<float>(n) + eps);
}

// qwen-tts's RMSNorm of one row, rounded where its bfloat16 operations round: weight * bf16(x * r).
inline void norm_row(const uint16_t* x, int64_t n, const uint16_t* weight, float eps, uint16_t* out) {
    const float r = inverse_rms(x, n, eps);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
        store_bf16(out + i, load_bf16(weight + i) * round_bf16(load_bf16(x + i) * splat(r)));
    for (; i < n; ++i) out[i] = to_bf16(to_float(weight[i]) * to_float(to_bf16(to_float(x[i]) * r)));
}

// One query head's attention over its KV head's slots: scores and softmax in float32, the values'
// weighted sum in float32, rounded to bfloat16 once. Slots not visible are skipped (a masked slot's
// exact zero weight); `slot(j)` gives the cache slot of the j-th of `width` candidates.
template <typename Slot>
void attend_one(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t d, int64_t width,
                const uint8_t* visible, Slot slot, float scale, float* scores, float* sum, uint16_t* out) {
    float top = -__builtin_inff();
    for (int64_t j = 0; j < width; ++j) {
        if (visible && !visible[j]) continue;
        scores[j] = dot(q, keys + slot(j) * d, d) * scale;
        top = scores[j] > top ? scores[j] : top;
    }
    float total = 0;
    for (int64_t e = 0; e < d; ++e) sum[e] = 0;
    for (int64_t j = 0; j < width; ++j) {
        if (visible && !visible[j]) continue;
        const float weight = __builtin_expf(scores[j] - top);
        total += weight;
        const uint16_t* value = values + slot(j) * d;
        int64_t e = 0;
        for (; e + kLanes <= d; e += kLanes) store_floats(sum + e, fma(splat(weight), load_bf16(value + e), load_floats(sum + e)));
        for (; e < d; ++e) sum[e] += weight * to_float(value[e]);
    }
    int64_t e = 0;
    for (; e + kLanes <= d; e += kLanes) store_bf16(out + e, load_floats(sum + e) / splat(total));
    for (; e < d; ++e) out[e] = to_bf16(sum[e] / total);
}

// bf16(bf16(silu(gate)) * up) over a row's gate and up halves [2 n] into out [n], as torch's bfloat16
// SiLU then product round.
inline void silu_times_up(const uint16_t* gate_up, int64_t n, uint16_t* out) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        const Lanes g = load_bf16(gate_up + i);
        const Lanes silu = g / (splat(1.0f) + exp_lanes(splat(0.0f) - g));
        store_bf16(out + i, round_bf16(silu) * load_bf16(gate_up + n + i));
    }
    for (; i < n; ++i) {
        const float g = to_float(gate_up[i]);
        out[i] = to_bf16(to_float(to_bf16(g / (1.0f + __builtin_expf(-g)))) * to_float(gate_up[n + i]));
    }
}

// x += delta, rounded to bfloat16 (a residual).
inline void add_into(uint16_t* x, const uint16_t* delta, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store_bf16(x + i, load_bf16(x + i) + load_bf16(delta + i));
    for (; i < n; ++i) x[i] = to_bf16(to_float(x[i]) + to_float(delta[i]));
}

// The maps with AVX2 + FMA: the packed weights widened to float32 in registers, the rows widened once per call.
// Each row's sum over each group of `group` inputs (the last may be shorter), in order, as floats: the term a 4-bit
// group's zero point multiplies (`int4_matmul`, `int4_fma_matmul`).
std::vector<float> group_sums(const uint16_t* x, int64_t M, int64_t K, int64_t group) {
    const int64_t groups = (K + group - 1) / group;
    std::vector<float> sums(M * groups);
    for (int64_t r = 0; r < M; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            float sum = 0.0f;
            for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) sum += to_float(x[r * K + k]);
            sums[r * groups + g] = sum;
        }
    return sums;
}

constexpr int kFmaRows = 4;   // bfloat16: rows per tile at most: 8 accumulators, 4 weight vectors and 2 inputs of 16
constexpr int kInt8Rows = 3;  // int8: rows per tile at most: 12 accumulators, a weight vector and 3 input pairs

// bfloat16: block-pair `index`'s channels 8 half .. 8 half + 7 as two float32 vectors (a shift and a mask): their
// weights for the pair's even and odd input.
inline __attribute__((always_inline)) void widen_pair(const void* packed, int64_t index, int half, __m256& even,
                                                      __m256& odd) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(packed) + index * 32) + half);
    even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// int8: block-pair `index`'s quarter q (channels 4q .. 4q + 3, both inputs) sign-extended straight into float lanes
// [channel even, channel odd, ...]: one widening per 8 weights, a third fewer instructions than splitting even from odd.
inline __attribute__((always_inline)) __m256 widen_quarter(const void* packed, int64_t index, int q) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(packed) + index * 32 + 8 * q));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
}

// The pass's prefetch for block-pair `index`: the next unit's weights where this pass's are in cache (`next`), else
// (if `Ahead`) this block's own kAheadBytes ahead. A bfloat16 tile of one row goes without the latter: its loop is
// bound by instructions, so the prefetch cost it 5 % (Zen 4), where it saved 15-20 % at 3 rows and 10-20 % for int8.
template <bool Int8, bool Ahead>
inline __attribute__((always_inline)) void prefetch_pass(const void* packed, int64_t index, int64_t pairs,
                                                         int64_t next) {
    if (next)
        _mm_prefetch(static_cast<const char*>(packed) + (index + next * pairs) * (Int8 ? 32 : 64), _MM_HINT_T1);
    else if constexpr (Ahead)
        prefetch<Int8>(packed, index);
}

// bfloat16, CB blocks x RB rows: each output acc = fma(w even, x even, acc), then fma(w odd, x odd, acc), per pair.
template <int CB, int RB>
inline __attribute__((always_inline)) void bf16_tile(const float* x, int64_t K, const void* packed, int64_t block,
                                                     int64_t N, uint16_t* y, int64_t next) {
    const int64_t pairs = K / 2;
    __m256 acc[RB][2 * CB];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < 2 * CB; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        for (int c = 0; c < CB; ++c) {
            const int64_t index = (block + c) * pairs + p;
            prefetch_pass<false, (RB > 1)>(packed, index, pairs, next);
            __m256 even[2], odd[2];
            widen_pair(packed, index, 0, even[0], odd[0]);
            widen_pair(packed, index, 1, even[1], odd[1]);
            for (int r = 0; r < RB; ++r) {
                const __m256 xe = _mm256_broadcast_ss(x + r * K + 2 * p), xo = _mm256_broadcast_ss(x + r * K + 2 * p + 1);
                for (int h = 0; h < 2; ++h) {
                    acc[r][2 * c + h] = _mm256_fmadd_ps(even[h], xe, acc[r][2 * c + h]);
                    acc[r][2 * c + h] = _mm256_fmadd_ps(odd[h], xo, acc[r][2 * c + h]);
                }
            }
        }
    }
    for (int c = 0; c < 2 * CB; ++c)
        for (int r = 0; r < RB; ++r)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * N + block * kBlock + c * 8), to_bf16_lanes(acc[r][c]));
}

// int8, CB blocks x RB rows: each output keeps an even and an odd sum (lanes of the quarters times the row's input
// pair broadcast as [x even, x odd, ...]), added at the end, then times its scale.
template <int CB, int RB>
inline __attribute__((always_inline)) void int8_tile(const float* x, int64_t K, const void* packed, const float* scales,
                                                     int64_t block, int64_t N, uint16_t* y, int64_t next) {
    const int64_t pairs = K / 2;
    __m256 acc[RB][4 * CB];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < 4 * CB; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        for (int c = 0; c < CB; ++c) {
            const int64_t index = (block + c) * pairs + p;
            prefetch_pass<true, true>(packed, index, pairs, next);
            for (int q = 0; q < 4; ++q) {
                const __m256 w = widen_quarter(packed, index, q);
                for (int r = 0; r < RB; ++r) {
                    const __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x + r * K + 2 * p)));
                    acc[r][4 * c + q] = _mm256_fmadd_ps(w, pair, acc[r][4 * c + q]);
                }
            }
        }
    }
    for (int c = 0; c < 2 * CB; ++c) {  // 8 channels each: [0 1 4 5 | 2 3 6 7] of two quarters' sums, put in order
        const int64_t channel = block * kBlock + c * 8;
        const __m256 scale = _mm256_loadu_ps(scales + channel);
        for (int r = 0; r < RB; ++r) {
            const __m256 sums = _mm256_hadd_ps(acc[r][2 * c], acc[r][2 * c + 1]);
            const __m256 ordered = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sums), 0xd8));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * N + channel), to_bf16_lanes(_mm256_mul_ps(ordered, scale)));
        }
    }
}

// One tile of either kind (the int8 one with its scales).
template <int CB, int RB, bool Int8>
inline __attribute__((always_inline)) void fma_tile(const float* x, int64_t K, const void* packed, const float* scales,
                                                    int64_t block, int64_t N, uint16_t* y, int64_t next) {
    if constexpr (Int8)
        int8_tile<CB, RB>(x, K, packed, scales, block, N, y, next);
    else
        bf16_tile<CB, RB>(x, K, packed, block, N, y, next);
}

// `count` blocks from `block` on for `rows` rows: bfloat16 one row four blocks a tile, two rows two, more one; int8
// one row two blocks a tile, more one. `next`: in a pass after a call's first, whose blocks are in cache, how many
// blocks on the next unit starts, whose weights are prefetched then (else memory would idle through those passes: 5
// rows cost 1.9x one row, now 1.3-1.6x).
template <bool Int8>
void fma_blocks(const float* x, int rows, int64_t K, const void* packed, const float* scales, int64_t block,
                int count, int64_t N, uint16_t* y, int64_t next) {
    for (int64_t b = block; b < block + count;) {
        if (rows == 1 && b + (Int8 ? 2 : 4) <= block + count) {
            fma_tile<Int8 ? 2 : 4, 1, Int8>(x, K, packed, scales, b, N, y, next), b += Int8 ? 2 : 4;
        } else if (!Int8 && rows == 2 && b + 2 <= block + count) {
            fma_tile<2, 2, Int8>(x, K, packed, scales, b, N, y, next), b += 2;
        } else {
            switch (rows) {
                case 1: fma_tile<1, 1, Int8>(x, K, packed, scales, b, N, y, next); break;
                case 2: fma_tile<1, 2, Int8>(x, K, packed, scales, b, N, y, next); break;
                case 3: fma_tile<1, 3, Int8>(x, K, packed, scales, b, N, y, next); break;
                default: fma_tile<1, Int8 ? kInt8Rows : kFmaRows, Int8>(x, K, packed, scales, b, N, y, next); break;
            }
            b += 1;
        }
    }
}

// y [M, N] = x [M, K] through packed weights with AVX2 + FMA, in passes of at most kFmaRows (int8: kInt8Rows) rows of
// equal size; threads split the output channels in groups of kGroup blocks (units), as `matmul` does.
template <bool Int8>
void fma_matmul(const uint16_t* x, int64_t M, int64_t K, const void* packed, const float* scales, int64_t N,
                uint16_t* y) {
    thread_local std::vector<float> wide;
    wide.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) wide[i] = to_float(x[i]);
    const float* rows_in = wide.data();
    const int64_t total = N / kBlock, groups = total / kGroup, units = groups + total % kGroup;
    const int64_t most = Int8 ? kInt8Rows : kFmaRows, passes = (M + most - 1) / most, per_pass = (M + passes - 1) / passes;
    #pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t block = u < groups ? u * kGroup : groups * kGroup + (u - groups);
        const int count = u < groups ? kGroup : 1;
        for (int64_t r = 0; r < M; r += per_pass) {
            const int rows = static_cast<int>(M - r < per_pass ? M - r : per_pass);
            fma_blocks<Int8>(rows_in + r * K, rows, K, packed, scales, block, count, N, y + r * N, r ? count : 0);
        }
    }
}


// 4-bit weights with AVX2 + FMA (`int4avx2`): int4dot's layout, a block's 16 bytes widened to float32 in two halves of
// 8 channels, the low nibbles (the pair's first input) and the high ones (its second) taken as 0 .. 15. Per group and
// half, part = fma(w first, x first, part), then fma(w second, x second, part) over its pairs; then acc = fma(part,
// scale, acc) and acc = fma(the row's group sum, zero - 8 x scale, acc); then rounding to bfloat16.
constexpr int kInt4FmaRows = 2;  // rows per tile: 2 x 2 accumulators and parts, 4 weight vectors, 2 inputs

template <int RB>
inline __attribute__((always_inline)) void int4_fma_tile(const float* x, int64_t K, const uint8_t* packed,
                                                         const float* scales_zeros, const float* sums, int64_t group,
                                                         int64_t block, int64_t N, uint16_t* y) {
    const int64_t pairs = K / 2, groups = (K + group - 1) / group;
    const __m256i low_nibble = _mm256_set1_epi32(0xF);
    __m256 acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256 part[RB][2];
        for (int r = 0; r < RB; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps();
        const int64_t first = g * group / 2, last = std::min(pairs, first + group / 2);
        for (int64_t p = first; p < last; ++p) {
            const uint8_t* bytes = packed + (block * pairs + p) * kBlock;
            _mm_prefetch(reinterpret_cast<const char*>(bytes) + kAheadBytes, _MM_HINT_T0);
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
            for (int h = 0; h < 2; ++h) {
                const __m256i wide = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(raw, 8) : raw);
                const __m256 w_first = _mm256_cvtepi32_ps(_mm256_and_si256(wide, low_nibble));
                const __m256 w_second = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
                for (int r = 0; r < RB; ++r) {
                    part[r][h] = _mm256_fmadd_ps(w_first, _mm256_broadcast_ss(x + r * K + 2 * p), part[r][h]);
                    part[r][h] = _mm256_fmadd_ps(w_second, _mm256_broadcast_ss(x + r * K + 2 * p + 1), part[r][h]);
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            const float* pair = scales_zeros + (block * groups + g) * 2 * kBlock + h * 8;
            const __m256 scale = _mm256_loadu_ps(pair);
            const __m256 zero = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, _mm256_loadu_ps(pair + kBlock));
            for (int r = 0; r < RB; ++r) {
                acc[r][h] = _mm256_fmadd_ps(part[r][h], scale, acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(sums[r * groups + g]), zero, acc[r][h]);
            }
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < RB; ++r)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * N + block * kBlock + h * 8), to_bf16_lanes(acc[r][h]));
}

void int4_fma_matmul(const uint16_t* x, int64_t M, int64_t K, const uint8_t* packed, const float* scales_zeros,
                     int64_t group, int64_t N, uint16_t* y) {
    thread_local std::vector<float> wide;
    wide.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) wide[i] = to_float(x[i]);
    const float* rows_in = wide.data();  // read by the team's threads: not their own (empty) thread_local copies
    const std::vector<float> sums = group_sums(x, M, K, group);
    const int64_t groups = (K + group - 1) / group;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < N / kBlock; ++b)
        for (int64_t r = 0; r < M; r += kInt4FmaRows) {
            const float* xr = rows_in + r * K;
            const float* sr = sums.data() + r * groups;
            if (M - r >= kInt4FmaRows)
                int4_fma_tile<kInt4FmaRows>(xr, K, packed, scales_zeros, sr, group, b, N, y + r * N);
            else
                int4_fma_tile<1>(xr, K, packed, scales_zeros, sr, group, b, N, y + r * N);
        }
}

#if defined(__AVX512BF16__)
// The same maps on AMX tiles (Intel Xeons from Sapphire Rapids on), for calls of many rows: a tile
// multiply takes 16 rows at the cost of one, so a call of 16 rows reads its weights once and costs
// about what one row does (AVX512-BF16 spends a VDPBF16PS per row and block). Each output is again one
// fixed sequence, the K inputs in chunks of 32 (TDPBF16PS over a row of A and the block's 16 pairs of
// B), then (int8) times the scale and rounding to bfloat16; a row's bits do not depend on the other
// rows in its tile, so these kernels keep rows invariant too (in their own order, not bf16dot's).
// Tiles: 0-3 accumulators (rows x 16 floats), 4 the rows' inputs (rows x 32), 5 and 6 weights (the
// packed layout's 16 pairs x 16 channels, 64 bytes apart; int8 weights widened into a scratch first).
constexpr int kTileRows = 16;

// GCC's tile intrinsics are asm statements that do not tell the compiler which memory they read or
// write: this orders the widened weights' stores before a tile load, and a tile store before its reads.
inline void memory_barrier() { __asm__ __volatile__("" ::: "memory"); }

struct TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) inline void configure_tiles(int rows) {
    TileConfig config;
    for (int t = 0; t < 5; ++t) config.rows[t] = rows, config.colsb[t] = 64;
    for (int t = 5; t < 7; ++t) config.rows[t] = kTileRows, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

// The address of block `block`'s 16 pairs from pair `pair` on, as bfloat16 (int8 widened into `scratch`).
template <bool Int8>
inline const void* weight_tile(const void* packed, int64_t pairs, int64_t block, int64_t pair, uint16_t* scratch) {
    const int64_t index = block * pairs + pair;
    if constexpr (!Int8) {
        return reinterpret_cast<const uint16_t*>(packed) + index * 2 * kBlock;
    } else {
        for (int p = 0; p < kTileRows; ++p)
            _mm512_storeu_si512(scratch + p * 2 * kBlock, (__m512i)load_pair<true>(packed, index + p));
        memory_barrier();
        return scratch;
    }
}

// The cache lines of block `block`'s weights kTileAhead bytes past pair `pair`'s, asked for ahead of the
// tile loads (which the hardware prefetcher alone left waiting on memory).
constexpr int kTileAhead = 4096;
template <bool Int8>
inline void prefetch_tile(const void* packed, int64_t pairs, int64_t block, int64_t pair) {
    const char* ahead = reinterpret_cast<const char*>(packed) + (block * pairs + pair) * (Int8 ? 32 : 64) + kTileAhead;
    for (int line = 0; line < (Int8 ? 8 : 16); ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
}

template <int CB, bool Int8>
__attribute__((target("amx-tile,amx-bf16"))) void amx_tile(const uint16_t* x, int rows, int64_t K,
                                                            const void* packed, const float* scales, int64_t block,
                                                            int64_t N, uint16_t* y) {
    const int64_t pairs = K / 2;
    alignas(64) uint16_t scratch[2][kTileRows * 2 * kBlock];
    _tile_zero(0);
    if constexpr (CB == 4) {
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 2 * kTileRows) {
        const int64_t pair = k / 2;
        for (int c = 0; c < CB; ++c) prefetch_tile<Int8>(packed, pairs, block + c, pair);
        _tile_loadd(4, x + k, K * sizeof(uint16_t));
        _tile_loadd(5, weight_tile<Int8>(packed, pairs, block, pair, scratch[0]), 64);
        _tile_dpbf16ps(0, 4, 5);
        if constexpr (CB == 4) {
            _tile_loadd(6, weight_tile<Int8>(packed, pairs, block + 1, pair, scratch[1]), 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, weight_tile<Int8>(packed, pairs, block + 2, pair, scratch[0]), 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, weight_tile<Int8>(packed, pairs, block + 3, pair, scratch[1]), 64);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    alignas(64) float sums[CB][kTileRows * kBlock];
    _tile_stored(0, sums[0], 64);
    if constexpr (CB == 4) {
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
    }
    memory_barrier();
    for (int c = 0; c < CB; ++c) {
        const __m512 scale = Int8 ? _mm512_loadu_ps(scales + (block + c) * kBlock) : _mm512_set1_ps(1.0f);
        for (int r = 0; r < rows; ++r) {
            const __m512 sum = _mm512_load_ps(sums[c] + r * kBlock);
            const __m512 out = Int8 ? _mm512_mul_ps(sum, scale) : sum;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + (block + c) * kBlock),
                                (__m256i)_mm512_cvtneps_pbh(out));
        }
    }
}

// y [M, N] = x [M, K] through packed weights on AMX tiles, in passes of at most 16 rows of equal size;
// threads split the output channels as `matmul` does. K % 32 == 0.
template <bool Int8>
__attribute__((target("amx-tile"))) void amx_matmul(const uint16_t* x, int64_t M, int64_t K, const void* packed,
                                                    const float* scales, int64_t N, uint16_t* y) {
    const int64_t total = N / kBlock, groups = total / kGroup, units = groups + total % kGroup;
    const int64_t passes = (M + kTileRows - 1) / kTileRows, per_pass = (M + passes - 1) / passes;
    #pragma omp parallel
    {
        int configured = 0;
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
            for (int64_t r = 0; r < M; r += per_pass) {
                const int rows = static_cast<int>(M - r < per_pass ? M - r : per_pass);
                if (rows != configured) configure_tiles(configured = rows);
                if (u < groups)
                    amx_tile<kGroup, Int8>(x + r * K, rows, K, packed, scales, u * kGroup, N, y + r * N);
                else
                    amx_tile<1, Int8>(x + r * K, rows, K, packed, scales, groups * kGroup + (u - groups), N, y + r * N);
            }
        }
        if (configured) _tile_release();
    }
}

// 4-bit weights (`int4dot`, W4A16; native.py, `pack_int4`): a block's input pair p as 16 bytes, byte c holding
// output channel c's two values q (0 .. 15) for inputs 2p (low nibble) and 2p + 1 (high nibble); groups of `group`
// inputs (the last may be shorter) with a float scale and zero per channel, [N/16][groups][2][16], standing for
// (q - 8) x scale + zero. A pair's vector widens in four instructions: the bytes zero-extended to 32-bit lanes, each
// lane's two nibbles moved to its two 16-bit halves, and vpermw reading bfloat16(q - 8) from a 16-entry table (exact).
// Each output is one fixed sequence: per group, part = 0; part = dpbf16(part, x pair, w pair) over its pairs; then
// acc = fma(part, scale, acc) and acc = fma(the row's sum of x over the group, zero, acc); then rounding to bfloat16.
constexpr int kInt4Rows = 4;   // rows per tile: 2 blocks x 4 rows of accumulators and of group parts fit the registers
constexpr int kInt4Blocks = 2;

constexpr uint16_t bf16_signed(int v) { return v < 0 ? static_cast<uint16_t>(0x8000 | bf16_bits(-v)) : bf16_bits(v); }

inline __m512i nibble_table() {  // vpermw's table: entry n is bfloat16(n - 8)
    alignas(64) static const auto table = [] {
        struct { uint16_t value[32]; } t{};
        for (int n = 0; n < 16; ++n) t.value[n] = bf16_signed(n - 8);
        return t;
    }();
    return _mm512_load_si512(&table);
}

inline __attribute__((always_inline)) __m512bh widen_nibbles(const uint8_t* bytes, __m512i table) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    // (wide | wide << 12) & 0x000F000F: the low nibble in the lane's low half, the high one in its high half
    const __m512i index = _mm512_ternarylogic_epi32(wide, _mm512_slli_epi32(wide, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    return (__m512bh)_mm512_permutexvar_epi16(index, table);
}

template <int CB, int RB>
inline __attribute__((always_inline)) void int4_tile(const uint16_t* x, int64_t K, const uint8_t* packed,
                                                     const float* scales_zeros, const float* sums, int64_t group,
                                                     int64_t block, int64_t N, uint16_t* y) {
    const int64_t pairs = K / 2, groups = (K + group - 1) / group;
    const __m512i table = nibble_table();
    __m512 acc[RB][CB];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 part[RB][CB];
        for (int r = 0; r < RB; ++r)
            for (int c = 0; c < CB; ++c) part[r][c] = _mm512_setzero_ps();
        const int64_t first = g * group / 2, last = std::min(pairs, first + group / 2);
        for (int64_t p = first; p < last; ++p) {
            __m512bh w[CB];
            for (int c = 0; c < CB; ++c) {
                const uint8_t* bytes = packed + ((block + c) * pairs + p) * kBlock;
                w[c] = widen_nibbles(bytes, table);
                _mm_prefetch(reinterpret_cast<const char*>(bytes) + kAheadBytes, _MM_HINT_T0);
            }
            for (int r = 0; r < RB; ++r) {
                const __m512bh xr = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + 2 * p));
                for (int c = 0; c < CB; ++c) part[r][c] = _mm512_dpbf16_ps(part[r][c], xr, w[c]);
            }
        }
        for (int c = 0; c < CB; ++c) {
            const float* pair = scales_zeros + ((block + c) * groups + g) * 2 * kBlock;
            const __m512 scale = _mm512_loadu_ps(pair), zero = _mm512_loadu_ps(pair + kBlock);
            for (int r = 0; r < RB; ++r) {
                acc[r][c] = _mm512_fmadd_ps(part[r][c], scale, acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * groups + g]), zero, acc[r][c]);
            }
        }
    }
    for (int c = 0; c < CB; ++c)
        for (int r = 0; r < RB; ++r)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + (block + c) * kBlock),
                                (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

template <int CB>
void int4_blocks(const uint16_t* x, int64_t M, int64_t K, const uint8_t* packed, const float* scales_zeros,
                 const float* sums, int64_t group, int64_t block, int64_t N, uint16_t* y) {
    const int64_t groups = (K + group - 1) / group;
    for (int64_t r = 0; r < M; r += kInt4Rows) {
        const uint16_t* xr = x + r * K;
        const float* sr = sums + r * groups;
        uint16_t* yr = y + r * N;
        switch (std::min<int64_t>(M - r, kInt4Rows)) {
            case 1: int4_tile<CB, 1>(xr, K, packed, scales_zeros, sr, group, block, N, yr); break;
            case 2: int4_tile<CB, 2>(xr, K, packed, scales_zeros, sr, group, block, N, yr); break;
            case 3: int4_tile<CB, 3>(xr, K, packed, scales_zeros, sr, group, block, N, yr); break;
            default: int4_tile<CB, kInt4Rows>(xr, K, packed, scales_zeros, sr, group, block, N, yr); break;
        }
    }
}

// y [M, N] = x [M, K] through 4-bit weights: each row's sums over the groups first (in order, as floats), then
// units of kInt4Blocks blocks split among the threads.
void int4_matmul(const uint16_t* x, int64_t M, int64_t K, const uint8_t* packed, const float* scales_zeros,
                 int64_t group, int64_t N, uint16_t* y) {
    const std::vector<float> sums = group_sums(x, M, K, group);
    const int64_t total = N / kBlock, pairs = total / kInt4Blocks, units = pairs + total % kInt4Blocks;
    #pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        if (u < pairs)
            int4_blocks<kInt4Blocks>(x, M, K, packed, scales_zeros, sums.data(), group, u * kInt4Blocks, N, y);
        else
            int4_blocks<1>(x, M, K, packed, scales_zeros, sums.data(), group, pairs * kInt4Blocks + (u - pairs), N, y);
    }
}

#endif  // __AVX512BF16__

// A map by kernel: 0 bf16dot, 1 int8dot, 2 AMX over bfloat16 weights, 3 AMX over int8 weights (those four in the
// AVX512-BF16 build only), 4 AVX2 over bfloat16 weights, 5 AVX2 over int8 weights.
inline void apply_map(int kind, const uint16_t* x, int64_t M, int64_t K, const void* packed, const float* scales,
                      int64_t N, uint16_t* y) {
    switch (kind) {
#if defined(__AVX512BF16__)
        case 0: matmul<false>(x, M, K, packed, nullptr, N, y); break;
        case 1: matmul<true>(x, M, K, packed, scales, N, y); break;
        case 2: amx_matmul<false>(x, M, K, packed, nullptr, N, y); break;
        case 3: amx_matmul<true>(x, M, K, packed, scales, N, y); break;
#endif
        case 4: fma_matmul<false>(x, M, K, packed, nullptr, N, y); break;
        case 5: fma_matmul<true>(x, M, K, packed, scales, N, y); break;
        default: break;  // a kernel not built at this level (native.py never asks for one)
    }
}

// Whether any of `count` cache slots lies outside a cache of `length` slots: every call that writes or reads
// slots by index checks them first, and writes nothing where one is outside (the caller raises).
bool any_outside(const int64_t* slots, int64_t count, int64_t length) {
    for (int64_t i = 0; i < count; ++i)
        if (slots[i] < 0 || slots[i] >= length) return true;
    return false;
}

}  // namespace

extern "C" {

// Attention of queries q [heads, n, d] over a layer's cache k, v [kv_heads, length, d] (bfloat16): query
// r sees `width` candidate slots, slots[r, j] where given (else slot j), those where visible[r, j] is set
// (all where null). Query heads share KV heads in groups (GQA). out [n, heads, d], the layout the output
// map reads. Each query's result is computed alone, so it does not depend on the others in the call.
// Returns 1, having computed nothing, where a slot lies outside the cache; else 0.
int rvqtts_attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t n, int64_t heads, int64_t kv_heads,
                  int64_t d, int64_t length, const int64_t* slots, int64_t width, const uint8_t* visible, float scale,
                  uint16_t* out) {
    if (slots ? any_outside(slots, n * width, length) : width > length) return 1;
    const int64_t group = heads / kv_heads;
    #pragma omp parallel for schedule(static) if (n * heads * width * d >= (1 << 18))
    for (int64_t task = 0; task < heads * n; ++task) {
        const int64_t h = task / n, r = task % n;
        thread_local std::vector<float> scores, sum;
        scores.resize(width);
        sum.resize(d);
        const uint16_t* keys = k + (h / group) * length * d;
        const uint16_t* values = v + (h / group) * length * d;
        const uint8_t* seen = visible ? visible + r * width : nullptr;
        const uint16_t* query = q + (h * n + r) * d;
        uint16_t* result = out + (r * heads + h) * d;
        if (slots) {
            const int64_t* own = slots + r * width;
            attend_one(query, keys, values, d, width, seen, [own](int64_t j) { return own[j]; }, scale, scores.data(),
                       sum.data(), result);
        } else {
            attend_one(query, keys, values, d, width, seen, [](int64_t j) { return j; }, scale, scores.data(), sum.data(),
                       result);
        }
    }
    return 0;
}

// RMSNorm of `rows` rows of n bfloat16 values (qwen-tts's, with float32 statistics).
void rvqtts_rms_norm(const uint16_t* x, int64_t rows, int64_t n, const uint16_t* weight, float eps, uint16_t* out) {
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * n, n, weight, eps, out + r * n);
}

// A layer's attention inputs from its fused q|k|v map output [rows, (heads + 2 kv_heads) d]: each query
// and key head RMS-normed (q_weight, k_weight) and rotated (RoPE with the rows' cos, sin [rows, d], in
// bfloat16 steps as qwen-tts's: x cos + rotate_half(x) sin). Queries go to q [heads, rows, d]; keys and
// values straight into the layer's caches [kv_heads, length, d], row r at slot slots[r] (start + r
// where slots is null). Returns 1, having written nothing, where a slot lies outside the caches; else 0.
int rvqtts_attention_inputs(const uint16_t* qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d,
                            const uint16_t* q_weight, const uint16_t* k_weight, const uint16_t* cos, const uint16_t* sin,
                            float eps, uint16_t* q, uint16_t* k_cache, uint16_t* v_cache, int64_t length,
                            const int64_t* slots, int64_t start) {
    if (slots ? any_outside(slots, rows, length) : start < 0 || start + rows > length) return 1;
    const int64_t width = (heads + 2 * kv_heads) * d, half = d / 2;
    uint16_t normed[1024];
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = qkv + r * width;
        const uint16_t* c = cos + r * d;
        const uint16_t* s = sin + r * d;
        const int64_t slot = slots ? slots[r] : start + r;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            const bool query = h < heads;
            norm_row(row + h * d, d, query ? q_weight : k_weight, eps, normed);
            uint16_t* out = query ? q + (h * rows + r) * d : k_cache + ((h - heads) * length + slot) * d;
            int64_t e = 0;
            if (half % kLanes == 0) {
                for (; e < d; e += kLanes) {
                    const Lanes rotated = e < half ? negate(load_bf16(normed + e + half)) : load_bf16(normed + e - half);
                    store_bf16(out + e, round_bf16(load_bf16(normed + e) * load_bf16(c + e))
                                            + round_bf16(rotated * load_bf16(s + e)));
                }
            }
            for (; e < d; ++e) {
                const float rotated = e < half ? -to_float(normed[e + half]) : to_float(normed[e - half]);
                out[e] = to_bf16(to_float(to_bf16(to_float(normed[e]) * to_float(c[e])))
                                 + to_float(to_bf16(rotated * to_float(s[e]))));
            }
        }
        for (int64_t h = 0; h < kv_heads; ++h)
            __builtin_memcpy(v_cache + (h * length + slot) * d, row + (heads + kv_heads + h) * d, d * sizeof(uint16_t));
    }
    return 0;
}

// The MLP's activation: rows of [gate | up] (2 n each) to bf16(bf16(silu(gate)) * up) [rows, n].
void rvqtts_silu_times_up(const uint16_t* gate_up, int64_t rows, int64_t n, uint16_t* out) {
    for (int64_t r = 0; r < rows; ++r) silu_times_up(gate_up + r * 2 * n, n, out + r * n);
}

// y [M, N] bfloat16 = x [M, K] bfloat16 through packed weights (transposed) by kernel `kind` (apply_map's
// numbers; scales for int8 weights). K even (a multiple of 32 on AMX), N % 16 == 0.
void rvqtts_map(int kind, const uint16_t* x, int64_t M, int64_t K, const void* packed, const float* scales,
                int64_t N, uint16_t* y) {
    apply_map(kind, x, M, K, packed, scales, N, y);
}

// y [M, N] bfloat16 = x [M, K] bfloat16 through 4-bit weights in groups of `group` inputs (int4_matmul's layout) by
// kernel `kind`: 0 int4dot (AVX512-BF16 build only), 1 int4avx2. K even, N % 16 == 0. Returns 1, having computed
// nothing, where this build lacks the kernel; else 0.
int rvqtts_map_int4(int kind, const uint16_t* x, int64_t M, int64_t K, const uint8_t* packed,
                    const float* scales_zeros, int64_t group, int64_t N, uint16_t* y) {
    if (kind == 1) {
        int4_fma_matmul(x, M, K, packed, scales_zeros, group, N, y);
        return 0;
    }
#if defined(__AVX512BF16__)
    if (kind == 0) {
        int4_matmul(x, M, K, packed, scales_zeros, group, N, y);
        return 0;
    }
#endif
    return 1;
}

// Asks Linux for this process's use of AMX tile data (once, before any tile instruction): 0 where granted.
int rvqtts_amx_permit() {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return static_cast<int>(syscall(SYS_arch_prctl, kRequestPermission, kTileData));
}

// One decoder layer of `rows` states x [rows, hidden] (updated in place), every step of
// CachedDecoder.run_layers's in one call: RMSNorm, the fused q|k|v map, q/k norms and RoPE with keys and
// values into the caches, attention (as rvqtts_attend), the output map and residual, RMSNorm, the fused
// gate|up map, SiLU times up, the down map and residual. maps[4] are the packed q|k|v, output, gate|up
// and down weights (with scales[4] for int8 weights); widths[4] their output counts; kind the kernel
// (apply_map's numbers). Returns 1, having written nothing, where a slot lies outside the caches; else 0.
int rvqtts_layer(uint16_t* x, int64_t rows, int64_t hidden, const uint16_t* input_norm, const uint16_t* post_norm,
                 float eps, const void* const* maps, const float* const* scales, const int64_t* widths, int kind,
                 int64_t heads, int64_t kv_heads, int64_t d, const uint16_t* q_norm, const uint16_t* k_norm,
                 const uint16_t* cos, const uint16_t* sin, uint16_t* k_cache, uint16_t* v_cache, int64_t length,
                 const int64_t* write_slots, int64_t write_start, int64_t width, const int64_t* attend_slots,
                 const uint8_t* visible, float scale) {
    thread_local std::vector<uint16_t> normed, qkv, q, attended, mapped, gate_up, act;
    normed.resize(rows * hidden);
    qkv.resize(rows * widths[0]);
    q.resize(rows * heads * d);
    attended.resize(rows * heads * d);
    mapped.resize(rows * hidden);
    gate_up.resize(rows * widths[2]);
    act.resize(rows * widths[2] / 2);
    auto map = [&](int which, const uint16_t* in, int64_t in_features, uint16_t* out) {
        apply_map(kind, in, rows, in_features, maps[which], scales[which], widths[which], out);
    };
    rvqtts_rms_norm(x, rows, hidden, input_norm, eps, normed.data());
    map(0, normed.data(), hidden, qkv.data());
    if (rvqtts_attention_inputs(qkv.data(), rows, heads, kv_heads, d, q_norm, k_norm, cos, sin, eps, q.data(), k_cache,
                                v_cache, length, write_slots, write_start)
        || rvqtts_attend(q.data(), k_cache, v_cache, rows, heads, kv_heads, d, length, attend_slots, width, visible,
                         scale, attended.data()))
        return 1;  // a slot outside the caches: x is as it was
    map(1, attended.data(), heads * d, mapped.data());
    add_into(x, mapped.data(), rows * hidden);
    rvqtts_rms_norm(x, rows, hidden, post_norm, eps, normed.data());
    map(2, normed.data(), hidden, gate_up.data());
    const int64_t inner = widths[2] / 2;
    rvqtts_silu_times_up(gate_up.data(), rows, inner, act.data());
    map(3, act.data(), inner, mapped.data());
    add_into(x, mapped.data(), rows * hidden);
    return 0;
}

// One code per row, drawn as rvqtts.engine.model.sampling.draw_checked draws it with torch's operations, bit for
// bit: scores = logits (bfloat16 or float32) as float32, divided by the row's temperature where it is not 1; the
// scores below the k-th largest set to -inf (top-k, where 0 < k < vocab); the row's Gumbel noise added; the first
// index of the largest score taken. A temperature of 0 draws greedily: the scores alone, no warper, no noise. A row
// with a NaN score takes its first NaN (torch's argmax does). finite[r] says whether the drawn score is finite.
// Row r's noise is noise[noise_rows[r]] (noise[r] where noise_rows is null), of `sources` rows. Each row is computed
// alone. Returns 1, having written nothing, where a noise row lies outside the noise; else 0.
int rvqtts_draw(const void* logits, int bf16, int64_t rows, int64_t vocab, const float* noise, int64_t sources,
                const int64_t* noise_rows, const float* temperatures, const int64_t* top_ks, int64_t* codes,
                uint8_t* finite) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t source = noise_rows ? noise_rows[r] : r;
        if (source < 0 || source >= sources) return 1;
    }
    #pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; ++r) {
        thread_local std::vector<float> scores, heap;
        scores.resize(vocab);
        const float t = temperatures[r];
        for (int64_t i = 0; i < vocab; ++i) {
            const float x = bf16 ? to_float(static_cast<const uint16_t*>(logits)[r * vocab + i])
                                 : static_cast<const float*>(logits)[r * vocab + i];
            scores[i] = (t > 0.0f && t != 1.0f) ? x / t : x;
        }
        int64_t best = -1;
        for (int64_t i = 0; i < vocab && best < 0; ++i)
            if (std::isnan(scores[i])) best = i;
        if (best >= 0) {  // argmax takes the first NaN
            codes[r] = best;
            finite[r] = 0;
            continue;
        }
        float kth = -std::numeric_limits<float>::infinity();
        const int64_t k = top_ks[r];
        const bool sample = t > 0.0f;
        if (sample && k > 0 && k < vocab) {  // the k-th largest score: a min-heap of the k largest so far
            heap.assign(scores.begin(), scores.begin() + k);
            std::make_heap(heap.begin(), heap.end(), std::greater<float>());
            for (int64_t i = k; i < vocab; ++i) {
                if (scores[i] > heap.front()) {
                    std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
                    heap.back() = scores[i];
                    std::push_heap(heap.begin(), heap.end(), std::greater<float>());
                }
            }
            kth = heap.front();
        }
        const float* row_noise = sample ? noise + (noise_rows ? noise_rows[r] : r) * vocab : nullptr;
        const float negative = -std::numeric_limits<float>::infinity();
        float top = 0.0f;
        for (int64_t i = 0; i < vocab; ++i) {
            float v = scores[i] < kth ? negative : scores[i];
            if (sample) v = v + row_noise[i];
            if (i == 0 || v > top) {
                top = v;
                best = i;
            }
        }
        codes[r] = best;
        finite[r] = std::isfinite(top) ? 1 : 0;
    }
    return 0;
}

}
