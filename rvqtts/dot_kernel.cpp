// rvqtts's own CPU kernel for the hot loops' linear maps: y = x W^T for a few bfloat16 rows x [M, K] and
// weights W [N, K] held as bfloat16 or as int8 with a float scale per output channel (W8A16), on CPUs
// with AVX512-BF16. Built and loaded by rvqtts/dot_kernel.py; chosen per map shape by measurement
// (rvqtts/kernels.py).
//
// Weights are packed once as [N/16][K/2][16][2]: one 64-byte vector (32 bytes for int8) per block of 16
// output channels and pair of inputs, the operand layout of VDPBF16PS. A tile keeps CB blocks x RB rows
// of float accumulators in registers and streams its blocks' weights once per pass over its rows.
//
// Every output is one fixed sequence: acc = 0; for each input pair, acc = dpbf16(acc, x pair, w pair);
// then (int8) acc * scale; then rounding to bfloat16. Threads split the output channels, never the
// inputs, so a row's bits do not depend on how many rows share the call, which tile it fell in, or
// the thread count: a tree round's rows equal plain steps bit for bit.
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int kBlock = 16;   // output channels per vector
constexpr int kAhead = 16;   // input pairs prefetched ahead of the loads
constexpr int kGroup = 4;    // blocks per tile where they divide the channels (else single blocks)
constexpr int kRows = 6;     // rows per tile at most: kGroup x kRows accumulators fit the 32 registers

template <bool Int8>
inline __m512bh load_pair(const void* packed, int64_t index) {
    if constexpr (Int8) {
        __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed) + index);
        __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
        __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
        return _mm512_cvtne2ps_pbh(high, low);  // int8 values are exact in bfloat16
    } else {
        return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const __m512i*>(packed) + index);
    }
}

template <bool Int8>
inline void prefetch(const void* packed, int64_t index) {
    _mm_prefetch(reinterpret_cast<const char*>(packed) + index * (Int8 ? 32 : 64), _MM_HINT_T0);
}

template <int CB, int RB, bool Int8>
inline __attribute__((always_inline)) void tile(const uint16_t* x, int64_t K, const void* packed,
                                                const float* scales, int64_t block, int64_t N, uint16_t* y) {
    const int64_t pairs = K / 2;
    __m512 acc[RB][CB];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh w[CB];
        for (int c = 0; c < CB; ++c) {
            const int64_t index = (block + c) * pairs + p;
            w[c] = load_pair<Int8>(packed, index);
            prefetch<Int8>(packed, index + kAhead);
        }
        for (int r = 0; r < RB; ++r) {
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + 2 * p));
            for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xr, w[c]);
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

// All M rows through CB blocks from `block` on, in passes of at most kRows rows of equal size.
template <int CB, bool Int8>
void blocks(const uint16_t* x, int64_t M, int64_t K, const void* packed, const float* scales, int64_t block,
            int64_t N, uint16_t* y) {
    const int64_t passes = (M + kRows - 1) / kRows, per_pass = (M + passes - 1) / passes;
    for (int64_t r = 0; r < M; r += per_pass) {
        const int64_t rows = M - r < per_pass ? M - r : per_pass;
        const uint16_t* xr = x + r * K;
        uint16_t* yr = y + r * N;
        switch (rows) {
            case 1: tile<CB, 1, Int8>(xr, K, packed, scales, block, N, yr); break;
            case 2: tile<CB, 2, Int8>(xr, K, packed, scales, block, N, yr); break;
            case 3: tile<CB, 3, Int8>(xr, K, packed, scales, block, N, yr); break;
            case 4: tile<CB, 4, Int8>(xr, K, packed, scales, block, N, yr); break;
            case 5: tile<CB, 5, Int8>(xr, K, packed, scales, block, N, yr); break;
            default: tile<CB, kRows, Int8>(xr, K, packed, scales, block, N, yr); break;
        }
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

}  // namespace

extern "C" {

// y [M, N] bfloat16 = x [M, K] bfloat16 times packed bfloat16 weights, transposed. K even, N % 16 == 0.
void rvqtts_dot_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N, uint16_t* y) {
    matmul<false>(x, M, K, packed, nullptr, N, y);
}

// The same with packed int8 weights and a float scale per output channel.
void rvqtts_dot_int8(const uint16_t* x, int64_t M, int64_t K, const int8_t* packed, const float* scales,
                     int64_t N, uint16_t* y) {
    matmul<true>(x, M, K, packed, scales, N, y);
}

}
