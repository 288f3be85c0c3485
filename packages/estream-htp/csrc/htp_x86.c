/* x86-64 inner-loop tables (AVX2, AVX-512, AVX-512 VNNI). Each function carries its own target
 * attribute, so this file compiles with plain `gcc -O2` (no -march) and a backend picks a table
 * by cpuid. Only inner loops live here: the tile/token drivers are generic (htp_core.c). */
#include "htp_internal.h"

#ifdef HTP_X86
#include "htp_attn_body.h"
#include "htp_gemm_body.h"
#include "htp_matmul_body.h"
#include "htp_norm_body.h"

#include <immintrin.h>

/* ---- AVX-512 kernels' row masks and stores: a strip's 32 rows as two 16-lane halves, of which
 * the first `rows` (<= 32) exist. */
HTP_T_AVX512 static inline __attribute__((always_inline)) void rows32_masks(uint32_t rows,
                                                                           __mmask16 *k0,
                                                                           __mmask16 *k1) {
    *k0 = rows >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1u);
    *k1 = rows >= 32 ? (__mmask16)0xffff : rows > 16 ? (__mmask16)((1u << (rows - 16)) - 1u) : (__mmask16)0;
}
/* Store nt tokens' row sums (acc[u][0]: rows 0..15, acc[u][1]: rows 16..31) at out + u * ldo. */
HTP_T_AVX512 static inline __attribute__((always_inline)) void store_rows32(float *out, uint32_t ldo,
                                                                           __m512 (*acc)[2], int nt,
                                                                           uint32_t rows) {
    __mmask16 k0, k1;
    rows32_masks(rows, &k0, &k1);
    for (int u = 0; u < nt; u++) {
        _mm512_mask_storeu_ps(out + (size_t)u * ldo, k0, acc[u][0]);
        _mm512_mask_storeu_ps(out + (size_t)u * ldo + 16, k1, acc[u][1]);
    }
}

/* ---- generic bodies, vectorised by the compiler under each target ---- */
#define HTP_INSTANTIATE(SUFFIX, TARGET)                                                          \
    TARGET static void f32_strip_##SUFFIX(const float *panel, uint32_t k, const float *x,        \
                                          uint32_t ldx, uint32_t nt, float *out, uint32_t ldo,   \
                                          uint32_t rows) {                                       \
        htp_f32_strip_body(panel, k, x, ldx, nt, out, ldo, rows);                                \
    }                                                                                            \
    TARGET static void q8q8_strip_##SUFFIX(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, \
                                           uint32_t nt, float *out, uint32_t ldo, uint32_t rows) { \
        htp_q8_strip_body(strip, HTP_FMT_Q8_0_T32R4, kb, a, nt, out, ldo, rows);                 \
    }                                                                                            \
    TARGET static void dequant_##SUFFIX(const uint8_t *p, uint32_t fmt, float *panel) {          \
        htp_dequant_tile_body(p, fmt, panel);                                                    \
    }                                                                                            \
    TARGET static void quantize_q8_##SUFFIX(const float *x, uint32_t k, int8_t *q, float *d,     \
                                            int32_t *s) {                                        \
        htp_quantize_row_q8_body(x, k, q, d, s);                                                 \
    }                                                                                            \
    TARGET HTP_NO_CONTRACT static void matmul_f32_##SUFFIX(const float *x, const float *w,       \
                                                           uint32_t k, uint32_t n, uint32_t i0,  \
                                                           uint32_t i1, float *y) {              \
        htp_matmul_f32_body(x, w, k, n, i0, i1, y);                                              \
    }                                                                                            \
    TARGET static void rms_rows_##SUFFIX(const float *x, const float *w, uint32_t d, float eps,   \
                                         size_t rows, float *out) {                              \
        htp_rms_rows_body(x, w, d, eps, rows, out);                                              \
    }

HTP_INSTANTIATE(avx2, HTP_T_AVX2)
HTP_INSTANTIATE(avx512, HTP_T_AVX512)

/* K-quant tiles x Q8 activations: the reference-order bodies vectorised by the compiler under
 * each target (the integer sums are exact, so every table gives the same partial sums) */
#define HTP_INSTANTIATE_KQ(SUFFIX, TARGET)                                                       \
    TARGET static void q4kq8_strip_##SUFFIX(const uint8_t *strip, uint32_t kb,                   \
                                            const htp_act_q8 *a, uint32_t nt, float *out,        \
                                            uint32_t ldo, uint32_t rows) {                       \
        htp_q4k_strip_body(strip, kb, a, nt, out, ldo, rows);                                    \
    }                                                                                            \
    TARGET static void q6kq8_strip_##SUFFIX(const uint8_t *strip, uint32_t kb,                   \
                                            const htp_act_q8 *a, uint32_t nt, float *out,        \
                                            uint32_t ldo, uint32_t rows) {                       \
        htp_q6k_strip_body(strip, kb, a, nt, out, ldo, rows);                                    \
    }                                                                                            \
    TARGET static void q5kq8_strip_##SUFFIX(const uint8_t *strip, uint32_t kb,                   \
                                            const htp_act_q8 *a, uint32_t nt, float *out,        \
                                            uint32_t ldo, uint32_t rows) {                       \
        htp_q5k_strip_body(strip, kb, a, nt, out, ldo, rows);                                    \
    }                                                                                            \
    TARGET static void dequant_kq_##SUFFIX(const uint8_t *p, uint32_t fmt, float *panel) {       \
        htp_dequant_kq_tile_body(p, fmt, panel);                                                 \
    }

HTP_INSTANTIATE_KQ(avx2, HTP_T_AVX2)
HTP_INSTANTIATE_KQ(avx512, HTP_T_AVX512)
HTP_INSTANTIATE_KQ(vnni, HTP_T_VNNI)

/* ---- Q4_0 x Q8 tile kernel, AVX-512 ----
 * A 128-byte group of a tile is two zmm registers whose 32-bit lanes are rows 0..15 and
 * 16..31; each lane holds 4 bytes = 8 nibbles: low nibbles are columns 4g..4g+3, high nibbles
 * columns 16+4g..16+4g+3. Broadcasting the matching 4 activation bytes makes one vpdpbusd
 * (u8 weights x s8 activations) add a 4-term dot product to 16 rows at once. Weights are
 * stored +8, so each block's integer accumulators start at -8*sum(activation block). */
#define Q4_KERNEL(SUFFIX, TARGET, DOT)                                                           \
    TARGET static inline __attribute__((always_inline)) void q4q8_block_##SUFFIX(                \
        const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s,    \
        uint32_t k, float *out, uint32_t ldo, uint32_t rows, const int NT) {                     \
        const __m512i m4 = _mm512_set1_epi8(0x0f);                                               \
        __m512 acc[6][2];                                                                        \
        for (int u = 0; u < NT; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();                \
        for (uint32_t j = 0; j < kb; j++) {                                                      \
            const uint8_t *tile = strip + (size_t)j * HTP_Q4_TILE_BYTES;                        \
            /* start at -8 * sum(block), the +8 offset of the nibbles: a scalar multiply and a   \
             * broadcast a token (a table of the products made per call and broadcast from      \
             * memory ran ~2 % slower: its stores and reloads cost more than they saved) */     \
            __m512i ia[6][2];                                                                    \
            for (int u = 0; u < NT; u++)                                                         \
                ia[u][0] = ia[u][1] = _mm512_set1_epi32(-8 * s[(size_t)u * kb + j]);             \
            for (int g = 0; g < 4; g++) {                                                        \
                const __m512i v0 = _mm512_loadu_si512((const void *)(tile + 64 + 128 * g));     \
                const __m512i v1 = _mm512_loadu_si512((const void *)(tile + 128 + 128 * g));    \
                const __m512i l0 = _mm512_and_si512(v0, m4);                                     \
                const __m512i l1 = _mm512_and_si512(v1, m4);                                     \
                const __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);               \
                const __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);               \
                for (int u = 0; u < NT; u++) {                                                   \
                    const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;                       \
                    int32_t alo, ahi;                                                            \
                    memcpy(&alo, qa, 4);                                                         \
                    memcpy(&ahi, qa + 16, 4);                                                    \
                    const __m512i bl = _mm512_set1_epi32(alo), bh = _mm512_set1_epi32(ahi);      \
                    ia[u][0] = DOT(ia[u][0], l0, bl);                                            \
                    ia[u][0] = DOT(ia[u][0], h0, bh);                                            \
                    ia[u][1] = DOT(ia[u][1], l1, bl);                                            \
                    ia[u][1] = DOT(ia[u][1], h1, bh);                                            \
                }                                                                                \
            }                                                                                    \
            const __m512 dw0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));       \
            const __m512 dw1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32)));\
            for (int u = 0; u < NT; u++) {                                                       \
                const __m512 da = _mm512_set1_ps(d[(size_t)u * kb + j]);                         \
                const __m512 f0 = _mm512_cvtepi32_ps(ia[u][0]);                                  \
                const __m512 f1 = _mm512_cvtepi32_ps(ia[u][1]);                                  \
                acc[u][0] = _mm512_fmadd_ps(f0, _mm512_mul_ps(dw0, da), acc[u][0]);              \
                acc[u][1] = _mm512_fmadd_ps(f1, _mm512_mul_ps(dw1, da), acc[u][1]);              \
            }                                                                                    \
        }                                                                                        \
        store_rows32(out, ldo, acc, NT, rows);                                                   \
    }                                                                                            \
    TARGET static void q4q8_strip_##SUFFIX(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, \
                                           uint32_t nt, float *out, uint32_t ldo, uint32_t rows) { \
        const uint32_t k = kb * 32;                                                              \
        switch (nt) {                                                                            \
        case 6: q4q8_block_##SUFFIX(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, 6); break;   \
        case 5: q4q8_block_##SUFFIX(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, 5); break;   \
        case 4: q4q8_block_##SUFFIX(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, 4); break;   \
        case 3: q4q8_block_##SUFFIX(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, 3); break;   \
        case 2: q4q8_block_##SUFFIX(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, 2); break;   \
        case 1: q4q8_block_##SUFFIX(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, 1); break;   \
        default: break;                                                                          \
        }                                                                                        \
    }

/* The AVX-512 strip drivers' loop: blocks of up to 6 tokens of the activations a (nt tokens, kb
 * blocks, k = 32 kb values a token), each one call FN(strip, kb, q, d, s, k, o, ldo, rows, NT
 * [, extra]) with NT a constant 1..6 and q, d, s, o the block's; the arguments after FN (an
 * empty one, then any extra) end the call. */
#define AVX512_STRIP6(FN, ...)                                                                  \
    do {                                                                                        \
        const uint32_t k = kb * 32;                                                             \
        for (uint32_t t0 = 0; t0 < nt; t0 += 6) {                                               \
            const uint32_t n = nt - t0 < 6 ? nt - t0 : 6;                                       \
            const int8_t *q = a->q + (size_t)t0 * k;                                            \
            const float *d = a->d + (size_t)t0 * kb;                                            \
            const int32_t *s = a->s + (size_t)t0 * kb;                                          \
            float *o = out + (size_t)t0 * ldo;                                                  \
            switch (n) {                                                                        \
            case 6: FN(strip, kb, q, d, s, k, o, ldo, rows, 6 __VA_ARGS__); break;              \
            case 5: FN(strip, kb, q, d, s, k, o, ldo, rows, 5 __VA_ARGS__); break;              \
            case 4: FN(strip, kb, q, d, s, k, o, ldo, rows, 4 __VA_ARGS__); break;              \
            case 3: FN(strip, kb, q, d, s, k, o, ldo, rows, 3 __VA_ARGS__); break;              \
            case 2: FN(strip, kb, q, d, s, k, o, ldo, rows, 2 __VA_ARGS__); break;              \
            default: FN(strip, kb, q, d, s, k, o, ldo, rows, 1 __VA_ARGS__); break;             \
            }                                                                                   \
        }                                                                                       \
    } while (0)

#define DOT_VNNI(acc, w, a) _mm512_dpbusd_epi32((acc), (w), (a))
#define DOT_BW(acc, w, a) \
    _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((w), (a)), _mm512_set1_epi16(1)))

Q4_KERNEL(vnni, HTP_T_VNNI, DOT_VNNI)
Q4_KERNEL(bw, HTP_T_AVX512, DOT_BW)

/* ---- Q4_K x Q8 tile kernel, AVX-512: the Q4_0 kernel's nibble scheme (a q4_k tile's groups are
 * Q4_0-ordered nibbles, values 0..15, at byte 192), integer sums from 0 (the portable body's
 * exact int32 dot per row and block). The scales go into fp32 once per tile, not per token:
 * d·sc and dmin·m are exact in fp32 (an fp16 significand of 11 bits times a 6-bit integer), so
 * per token and block the epilogue is the shared htp_q45k_epilogue lane-wise,
 * acc = fma(dot, (d·sc)·da, acc), acc = fma(−dmin·m, sa·da, acc): two fused multiply-adds and
 * no integer multiply, the same bits as every other table; sa·da is read from the rows'
 * products (htp_act_q8.sd) where the op that quantized the rows made them. The same kernel runs
 * q5_k tiles (Q5 = 1: the fifth bits added to the nibbles before the dot products, q5k_fifth). */
/* 16 fp16 / 16 uint8 values of a tile as fp32 lanes (the K-quant scale vectors). */
HTP_T_AVX512 static inline __attribute__((always_inline)) __m512 q4k_f16x16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
HTP_T_AVX512 static inline __attribute__((always_inline)) __m512 q4k_u8x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Q5_K: a q5_k-t32r4 tile is a q4_k one with each row's 32 fifth bits as a little-endian uint32
 * at 704 + 4r (bit c = column c). For one 64-byte half of a group (16 rows, a 32-bit lane each),
 * byte `byte` of the row's fifth bits holds, from bit 4*`odd`, the bits of the lane's four
 * columns: vpshufb copies that byte to the lane's 4 bytes, vptestmb picks bit b for byte b, and
 * 16 is added to the nibbles whose bit is set (q = nibble + 16 x fifth bit, 0..31; no
 * vpmaddubsw pair saturates: 2 x 31 x 127). */
HTP_T_AVX512 static inline __attribute__((always_inline)) __m512i q5k_fifth(__m512i nib,
                                                                            const uint8_t *hb,
                                                                            int byte, int odd) {
    const __m512i bits = _mm512_loadu_si512((const void *)hb);
    const __m512i idx = _mm512_add_epi8(
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12)),
        _mm512_set1_epi8((char)byte));
    const __mmask64 set = _mm512_test_epi8_mask(
        _mm512_shuffle_epi8(bits, idx), _mm512_set1_epi32(odd ? (int)0x80402010 : 0x08040201));
    return _mm512_mask_add_epi8(nib, set, nib, _mm512_set1_epi8(16));
}

/* A q4_k / q5_k tile's dot-product operands: for each group g, the 16-row halves of its low
 * nibbles (columns 4g..4g+3) and high nibbles (16+4g..16+4g+3), plus 16 x the fifth bit for
 * q5_k: w[4g + 0..3] = low rows 0..15, low rows 16..31, high rows 0..15, high rows 16..31. */
HTP_T_AVX512 static inline __attribute__((always_inline)) void k45_operands(const uint8_t *tile,
                                                                            const int Q5,
                                                                            __m512i w[16]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < 4; g++) {
        const __m512i v0 = _mm512_loadu_si512((const void *)(tile + 192 + 128 * g));
        const __m512i v1 = _mm512_loadu_si512((const void *)(tile + 256 + 128 * g));
        __m512i l0 = _mm512_and_si512(v0, m4);
        __m512i l1 = _mm512_and_si512(v1, m4);
        __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
        __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
        if (Q5) {
            l0 = q5k_fifth(l0, tile + 704, g / 2, g % 2);
            l1 = q5k_fifth(l1, tile + 768, g / 2, g % 2);
            h0 = q5k_fifth(h0, tile + 704, 2 + g / 2, g % 2);
            h1 = q5k_fifth(h1, tile + 768, 2 + g / 2, g % 2);
        }
        w[4 * g] = l0, w[4 * g + 1] = l1, w[4 * g + 2] = h0, w[4 * g + 3] = h1;
    }
}
/* A q4_k / q5_k tile's ds = d·sc and dm = dmin·m as fp32 lanes (exact): sv[0..3] = ds rows
 * 0..15, ds rows 16..31, dm rows 0..15, dm rows 16..31. */
HTP_T_AVX512 static inline __attribute__((always_inline)) void k45_scales(const uint8_t *tile,
                                                                          __m512 sv[4]) {
    sv[0] = _mm512_mul_ps(q4k_f16x16(tile), q4k_u8x16(tile + 128));
    sv[1] = _mm512_mul_ps(q4k_f16x16(tile + 32), q4k_u8x16(tile + 144));
    sv[2] = _mm512_mul_ps(q4k_f16x16(tile + 64), q4k_u8x16(tile + 160));
    sv[3] = _mm512_mul_ps(q4k_f16x16(tile + 96), q4k_u8x16(tile + 176));
}

/* Tiles per chunk of a q5_k strip whose operands (nibbles + 16 x fifth bit) and scales the strip
 * kernel prepares once for all its token blocks (1280 B of stack a tile, 40 KiB), instead of
 * per 6-token block (the fifth bits cost ~20 instructions a tile). Q4_K's strips make theirs per
 * block: its masks and shifts are cheap, and prepared scales or operands measured no faster in
 * the GEMM and slower in the expert op (the buffer's share of L1). */
#define HTP_K45_CHUNK 32

/* One block of NT tokens over tiles j0..j1-1 of a strip: the accumulators start at 0 (j0 = 0)
 * or at the block's outputs, where the previous chunk left them (a float store and load, so
 * the fp32 sequence per row and token is the one of a single pass). The tiles' operands and
 * scales come prepared (PREP: pw, sv, chunk-relative) or are made here. */
#define K45_BLOCK(SUFFIX, NT, PREP)                                                              \
    q4kq8_block_##SUFFIX(strip, j0, j1, kb, q, d, s, sd, pwb, svb, k, o, ldo, rows, NT, Q5, PREP)
#define K45_BLOCKS(SUFFIX, PREP)                                                                 \
    switch (n) {                                                                                 \
    case 6: K45_BLOCK(SUFFIX, 6, PREP); break;                                                   \
    case 5: K45_BLOCK(SUFFIX, 5, PREP); break;                                                   \
    case 4: K45_BLOCK(SUFFIX, 4, PREP); break;                                                   \
    case 3: K45_BLOCK(SUFFIX, 3, PREP); break;                                                   \
    case 2: K45_BLOCK(SUFFIX, 2, PREP); break;                                                   \
    default: K45_BLOCK(SUFFIX, 1, PREP); break;                                                  \
    }
#define Q4K_KERNEL(SUFFIX, TARGET, DOT)                                                          \
    TARGET static inline __attribute__((always_inline)) void q4kq8_block_##SUFFIX(               \
        const uint8_t *strip, uint32_t j0, uint32_t j1, uint32_t kb, const int8_t *q,            \
        const float *d, const int32_t *s, const float *sd, const __m512i *pw, const __m512 *sv,  \
        uint32_t k, float *out, uint32_t ldo, uint32_t rows, const int NT, const int Q5,         \
        const int PREP) {                                                                        \
        __mmask16 k0, k1;                                                                        \
        rows32_masks(rows, &k0, &k1);                                                            \
        __m512 acc[6][2];                                                                        \
        for (int u = 0; u < NT; u++) {                                                           \
            if (j0 == 0) {                                                                       \
                acc[u][0] = acc[u][1] = _mm512_setzero_ps();                                     \
            } else {                                                                             \
                acc[u][0] = _mm512_maskz_loadu_ps(k0, out + (size_t)u * ldo);                    \
                acc[u][1] = _mm512_maskz_loadu_ps(k1, out + (size_t)u * ldo + 16);               \
            }                                                                                    \
        }                                                                                        \
        for (uint32_t j = j0; j < j1; j++) {                                                     \
            const uint8_t *tile =                                                                \
                strip + (size_t)j * (Q5 ? HTP_Q5K_TILE_BYTES : HTP_Q4K_TILE_BYTES);              \
            __m512i w[16];                                                                       \
            if (PREP && Q5)                                                                      \
                for (int i = 0; i < 16; i++) w[i] = pw[16 * (size_t)(j - j0) + i];               \
            else                                                                                 \
                k45_operands(tile, Q5, w);                                                       \
            __m512i ia[6][2];                                                                    \
            for (int u = 0; u < NT; u++) ia[u][0] = ia[u][1] = _mm512_setzero_si512();           \
            for (int g = 0; g < 4; g++) {                                                        \
                const __m512i l0 = w[4 * g], l1 = w[4 * g + 1];                                  \
                const __m512i h0 = w[4 * g + 2], h1 = w[4 * g + 3];                              \
                for (int u = 0; u < NT; u++) {                                                   \
                    const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;                       \
                    int32_t alo, ahi;                                                            \
                    memcpy(&alo, qa, 4);                                                         \
                    memcpy(&ahi, qa + 16, 4);                                                    \
                    const __m512i bl = _mm512_set1_epi32(alo), bh = _mm512_set1_epi32(ahi);      \
                    ia[u][0] = DOT(ia[u][0], l0, bl);                                            \
                    ia[u][0] = DOT(ia[u][0], h0, bh);                                            \
                    ia[u][1] = DOT(ia[u][1], l1, bl);                                            \
                    ia[u][1] = DOT(ia[u][1], h1, bh);                                            \
                }                                                                                \
            }                                                                                    \
            __m512 sc[4];                                                                        \
            if (PREP)                                                                            \
                for (int i = 0; i < 4; i++) sc[i] = sv[4 * (size_t)(j - j0) + i];                \
            else                                                                                 \
                k45_scales(tile, sc);                                                            \
            const __m512 ds0 = sc[0], ds1 = sc[1], dm0 = sc[2], dm1 = sc[3];                     \
            for (int u = 0; u < NT; u++) {                                                       \
                const float dau = d[(size_t)u * kb + j];                                         \
                const __m512 da = _mm512_set1_ps(dau);                                           \
                const __m512 sada = _mm512_set1_ps(sd ? sd[(size_t)u * kb + j]                   \
                                                      : (float)s[(size_t)u * kb + j] * dau);     \
                acc[u][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[u][0]), _mm512_mul_ps(ds0, da), \
                                            acc[u][0]);                                          \
                acc[u][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[u][1]), _mm512_mul_ps(ds1, da), \
                                            acc[u][1]);                                          \
                acc[u][0] = _mm512_fnmadd_ps(dm0, sada, acc[u][0]);                              \
                acc[u][1] = _mm512_fnmadd_ps(dm1, sada, acc[u][1]);                              \
            }                                                                                    \
        }                                                                                        \
        for (int u = 0; u < NT; u++) {                                                           \
            _mm512_mask_storeu_ps(out + (size_t)u * ldo, k0, acc[u][0]);                         \
            _mm512_mask_storeu_ps(out + (size_t)u * ldo + 16, k1, acc[u][1]);                    \
        }                                                                                        \
    }                                                                                            \
    /* Q5_K with more than one token block: the strip in chunks of HTP_K45_CHUNK tiles, each    \
     * chunk's operands and scales prepared once for all the blocks; otherwise one pass. */      \
    TARGET static inline __attribute__((always_inline)) void k45q8_strip_##SUFFIX(               \
        const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out,         \
        uint32_t ldo, uint32_t rows, const int Q5, const int SD) {                               \
        const uint32_t k = kb * 32;                                                              \
        __m512i pwb[Q5 ? HTP_K45_CHUNK * 16 : 1];                                                \
        __m512 svb[Q5 ? HTP_K45_CHUNK * 4 : 1];                                                  \
        const int prep = Q5 && nt > 6;                                                           \
        for (uint32_t j0 = 0; j0 < kb; j0 += prep ? HTP_K45_CHUNK : kb) {                        \
            const uint32_t j1 = prep && kb - j0 > HTP_K45_CHUNK ? j0 + HTP_K45_CHUNK : kb;       \
            if (prep)                                                                            \
                for (uint32_t j = j0; j < j1; j++) {                                             \
                    const uint8_t *tile =                                                        \
                        strip + (size_t)j * (Q5 ? HTP_Q5K_TILE_BYTES : HTP_Q4K_TILE_BYTES);      \
                    k45_operands(tile, Q5, pwb + 16 * (size_t)(j - j0));                         \
                    k45_scales(tile, svb + 4 * (size_t)(j - j0));                                \
                }                                                                                \
            for (uint32_t t0 = 0; t0 < nt; t0 += 6) {                                            \
                const uint32_t n = nt - t0 < 6 ? nt - t0 : 6;                                    \
                const int8_t *q = a->q + (size_t)t0 * k;                                         \
                const float *d = a->d + (size_t)t0 * kb;                                         \
                const int32_t *s = a->s + (size_t)t0 * kb;                                       \
                const float *sd = SD ? a->sd + (size_t)t0 * kb : NULL;                           \
                float *o = out + (size_t)t0 * ldo;                                               \
                if (prep) {                                                                      \
                    K45_BLOCKS(SUFFIX, 1);                                                       \
                } else {                                                                         \
                    K45_BLOCKS(SUFFIX, 0);                                                       \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    TARGET static void q4kq8_strip_fast_##SUFFIX(const uint8_t *strip, uint32_t kb,              \
                                                 const htp_act_q8 *a, uint32_t nt, float *out,   \
                                                 uint32_t ldo, uint32_t rows) {                  \
        if (a->sd)                                                                               \
            k45q8_strip_##SUFFIX(strip, kb, a, nt, out, ldo, rows, 0, 1);                        \
        else                                                                                     \
            k45q8_strip_##SUFFIX(strip, kb, a, nt, out, ldo, rows, 0, 0);                        \
    }                                                                                            \
    TARGET static void q5kq8_strip_fast_##SUFFIX(const uint8_t *strip, uint32_t kb,              \
                                                 const htp_act_q8 *a, uint32_t nt, float *out,   \
                                                 uint32_t ldo, uint32_t rows) {                  \
        if (a->sd)                                                                               \
            k45q8_strip_##SUFFIX(strip, kb, a, nt, out, ldo, rows, 1, 1);                        \
        else                                                                                     \
            k45q8_strip_##SUFFIX(strip, kb, a, nt, out, ldo, rows, 1, 0);                        \
    }

Q4K_KERNEL(vnni, HTP_T_VNNI, DOT_VNNI)
Q4K_KERNEL(bw, HTP_T_AVX512, DOT_BW)

/* ---- Q6_K x Q8 tile kernel, AVX-512: the int8 values (-32..31) are made unsigned by +32 for
 * the u8 x s8 dot product, so each half's sum carries 32 x (its activations' sum): the integer
 * sums start at -32 x that sum (as the Q4_0 kernel's start at -8 x the block's), read from the
 * rows' start values (htp_act_q8.z) where the op that quantized the rows made them, else the
 * half sums taken with one vpsadbw per token and block (in every strip: ~13 % of the kernel's
 * time); then the int32 sc0*dot0 + sc1*dot1 (the scale pairs at byte 64 + 2r sign-extended from
 * 16-bit lanes) times d·da. Groups 0..3 are columns 0..15, groups 4..7 columns 16..31. */
HTP_T_AVX512 static inline __attribute__((always_inline)) int32_t q6k_sum16(const int8_t *a) {
    /* sum of 16 int8: vpsadbw on the values + 128, less 16 x 128 */
    const __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)a), _mm_set1_epi8((char)0x80));
    const __m128i t = _mm_sad_epu8(v, _mm_setzero_si128());
    return _mm_cvtsi128_si32(_mm_add_epi64(t, _mm_unpackhi_epi64(t, t))) - 16 * 128;
}
#define Q6K_KERNEL(SUFFIX, TARGET, DOT)                                                          \
    TARGET static inline __attribute__((always_inline)) void q6kq8_block_##SUFFIX(               \
        const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s,    \
        const int32_t *z, uint32_t k, float *out, uint32_t ldo, uint32_t rows, const int NT) {   \
        const __m512i off = _mm512_set1_epi8(32);                                                \
        __m512 acc[4][2];                                                                        \
        for (int u = 0; u < NT; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();                \
        for (uint32_t j = 0; j < kb; j++) {                                                      \
            const uint8_t *tile = strip + (size_t)j * HTP_Q6K_TILE_BYTES;                       \
            __m512i lo[4][2], hi[4][2];                                                          \
            for (int u = 0; u < NT; u++) {                                                       \
                if (z) { /* made with the rows: two broadcasts from memory */                    \
                    lo[u][0] = lo[u][1] = _mm512_set1_epi32(z[2 * ((size_t)u * kb + j)]);        \
                    hi[u][0] = hi[u][1] = _mm512_set1_epi32(z[2 * ((size_t)u * kb + j) + 1]);    \
                } else {                                                                         \
                    const int32_t slo = q6k_sum16(q + (size_t)u * k + 32 * j);                   \
                    lo[u][0] = lo[u][1] = _mm512_set1_epi32(-32 * slo);                          \
                    hi[u][0] = hi[u][1] = _mm512_set1_epi32(-32 * (s[(size_t)u * kb + j] - slo)); \
                }                                                                                \
            }                                                                                    \
            for (int g = 0; g < 4; g++) {                                                        \
                const uint8_t *gl = tile + 128 + 128 * g, *gh = gl + 512;                        \
                const __m512i l0 = _mm512_add_epi8(_mm512_loadu_si512((const void *)gl), off);   \
                const __m512i l1 = _mm512_add_epi8(_mm512_loadu_si512((const void *)(gl + 64)), off); \
                const __m512i h0 = _mm512_add_epi8(_mm512_loadu_si512((const void *)gh), off);   \
                const __m512i h1 = _mm512_add_epi8(_mm512_loadu_si512((const void *)(gh + 64)), off); \
                for (int u = 0; u < NT; u++) {                                                   \
                    const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;                       \
                    int32_t alo, ahi;                                                            \
                    memcpy(&alo, qa, 4);                                                         \
                    memcpy(&ahi, qa + 16, 4);                                                    \
                    const __m512i bl = _mm512_set1_epi32(alo), bh = _mm512_set1_epi32(ahi);      \
                    lo[u][0] = DOT(lo[u][0], l0, bl);                                            \
                    lo[u][1] = DOT(lo[u][1], l1, bl);                                            \
                    hi[u][0] = DOT(hi[u][0], h0, bh);                                            \
                    hi[u][1] = DOT(hi[u][1], h1, bh);                                            \
                }                                                                                \
            }                                                                                    \
            const __m512 dw0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));       \
            const __m512 dw1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32)));\
            const __m512i x0 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(tile + 64))); \
            const __m512i x1 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(tile + 96))); \
            const __m512i sl0 = _mm512_srai_epi32(_mm512_slli_epi32(x0, 24), 24);                \
            const __m512i sl1 = _mm512_srai_epi32(_mm512_slli_epi32(x1, 24), 24);                \
            const __m512i sh0 = _mm512_srai_epi32(x0, 8), sh1 = _mm512_srai_epi32(x1, 8);        \
            for (int u = 0; u < NT; u++) {                                                       \
                const __m512 da = _mm512_set1_ps(d[(size_t)u * kb + j]);                         \
                const __m512i i0 = _mm512_add_epi32(_mm512_mullo_epi32(lo[u][0], sl0),           \
                                                    _mm512_mullo_epi32(hi[u][0], sh0));          \
                const __m512i i1 = _mm512_add_epi32(_mm512_mullo_epi32(lo[u][1], sl1),           \
                                                    _mm512_mullo_epi32(hi[u][1], sh1));          \
                acc[u][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(dw0, da), acc[u][0]); \
                acc[u][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(dw1, da), acc[u][1]); \
            }                                                                                    \
        }                                                                                        \
        store_rows32(out, ldo, acc, NT, rows);                                                   \
    }                                                                                            \
    TARGET static inline __attribute__((always_inline)) void q6kq8_strip_z_##SUFFIX(             \
        const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out,         \
        uint32_t ldo, uint32_t rows, const int Z) {                                              \
        const uint32_t k = kb * 32;                                                              \
        for (uint32_t t0 = 0; t0 < nt; t0 += 4) {                                                \
            const uint32_t n = nt - t0 < 4 ? nt - t0 : 4;                                        \
            const int8_t *q = a->q + (size_t)t0 * k;                                             \
            const float *d = a->d + (size_t)t0 * kb;                                             \
            const int32_t *s = a->s + (size_t)t0 * kb;                                           \
            const int32_t *z = Z ? a->z + (size_t)t0 * kb * 2 : NULL;                            \
            float *o = out + (size_t)t0 * ldo;                                                   \
            switch (n) {                                                                         \
            case 4: q6kq8_block_##SUFFIX(strip, kb, q, d, s, z, k, o, ldo, rows, 4); break;      \
            case 3: q6kq8_block_##SUFFIX(strip, kb, q, d, s, z, k, o, ldo, rows, 3); break;      \
            case 2: q6kq8_block_##SUFFIX(strip, kb, q, d, s, z, k, o, ldo, rows, 2); break;      \
            default: q6kq8_block_##SUFFIX(strip, kb, q, d, s, z, k, o, ldo, rows, 1); break;     \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    TARGET static void q6kq8_strip_fast_##SUFFIX(const uint8_t *strip, uint32_t kb,              \
                                                 const htp_act_q8 *a, uint32_t nt, float *out,   \
                                                 uint32_t ldo, uint32_t rows) {                  \
        if (a->z)                                                                                \
            q6kq8_strip_z_##SUFFIX(strip, kb, a, nt, out, ldo, rows, 1);                         \
        else                                                                                     \
            q6kq8_strip_z_##SUFFIX(strip, kb, a, nt, out, ldo, rows, 0);                         \
    }

Q6K_KERNEL(vnni, HTP_T_VNNI, DOT_VNNI)
Q6K_KERNEL(bw, HTP_T_AVX512, DOT_BW)

/* ---- MXFP4 x Q8 tile kernel, AVX-512: the Q4_0 kernel's nibble scheme on mxfp4 tiles (codes
 * in Q4_0 order at byte 32), each code turned by one vpshufb into its doubled E2M1 value + 12
 * (0..24, unsigned for the u8 x s8 dot product; no pair of vpmaddubsw saturates: 2 x 24 x 127),
 * integer sums from -12 x sum(activations), so per block the exact int32 dot; the fp32
 * epilogue is the portable body's, product then sum ((float)dot x (e8m0_half(e) x da), no fused
 * multiply-add), so the results are the portable table's bits. */
#define MXFP4_HALF512(TARGET)                                                                    \
    TARGET static inline __attribute__((always_inline)) __m512 mx_half512(__m512i e) {         \
        const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));                \
        const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);    \
        const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);                 \
        return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, big, sub));                    \
    }
MXFP4_HALF512(HTP_T_AVX512)

#define MXFP4_KERNEL(SUFFIX, TARGET, DOT)                                                        \
    TARGET HTP_NO_CONTRACT static inline __attribute__((always_inline)) void mxq8_block_##SUFFIX(                \
        const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s,    \
        uint32_t k, float *out, uint32_t ldo, uint32_t rows, const int NT) {                     \
        const __m512i m4 = _mm512_set1_epi8(0x0f);                                               \
        const __m512i lut = _mm512_broadcast_i32x4(                                              \
            _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));           \
        __m512 acc[6][2];                                                                        \
        for (int u = 0; u < NT; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();                \
        for (uint32_t j = 0; j < kb; j++) {                                                      \
            const uint8_t *tile = strip + (size_t)j * HTP_MXFP4_TILE_BYTES;                     \
            __m512i ia[6][2]; /* start at -12 * sum(block): the +12 offset of the values */      \
            for (int u = 0; u < NT; u++)                                                         \
                ia[u][0] = ia[u][1] = _mm512_set1_epi32(-12 * s[(size_t)u * kb + j]);            \
            for (int g = 0; g < 4; g++) {                                                        \
                const __m512i v0 = _mm512_loadu_si512((const void *)(tile + 32 + 128 * g));     \
                const __m512i v1 = _mm512_loadu_si512((const void *)(tile + 96 + 128 * g));     \
                const __m512i l0 = _mm512_shuffle_epi8(lut, _mm512_and_si512(v0, m4));           \
                const __m512i l1 = _mm512_shuffle_epi8(lut, _mm512_and_si512(v1, m4));           \
                const __m512i h0 =                                                               \
                    _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4));    \
                const __m512i h1 =                                                               \
                    _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4));    \
                for (int u = 0; u < NT; u++) {                                                   \
                    const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;                       \
                    int32_t alo, ahi;                                                            \
                    memcpy(&alo, qa, 4);                                                         \
                    memcpy(&ahi, qa + 16, 4);                                                    \
                    const __m512i bl = _mm512_set1_epi32(alo), bh = _mm512_set1_epi32(ahi);      \
                    ia[u][0] = DOT(ia[u][0], l0, bl);                                            \
                    ia[u][0] = DOT(ia[u][0], h0, bh);                                            \
                    ia[u][1] = DOT(ia[u][1], l1, bl);                                            \
                    ia[u][1] = DOT(ia[u][1], h1, bh);                                            \
                }                                                                                \
            }                                                                                    \
            const __m512 e0 = mx_half512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)tile))); \
            const __m512 e1 =                                                                    \
                mx_half512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + 16)))); \
            for (int u = 0; u < NT; u++) {                                                       \
                const __m512 da = _mm512_set1_ps(d[(size_t)u * kb + j]);                         \
                const __m512 p0 = _mm512_cvtepi32_ps(ia[u][0]);                                  \
                const __m512 p1 = _mm512_cvtepi32_ps(ia[u][1]);                                  \
                acc[u][0] = _mm512_add_ps(acc[u][0], _mm512_mul_ps(p0, _mm512_mul_ps(e0, da)));  \
                acc[u][1] = _mm512_add_ps(acc[u][1], _mm512_mul_ps(p1, _mm512_mul_ps(e1, da)));  \
            }                                                                                    \
        }                                                                                        \
        store_rows32(out, ldo, acc, NT, rows);                                                   \
    }                                                                                            \
    TARGET HTP_NO_CONTRACT static void mxq8_strip_fast_##SUFFIX(const uint8_t *strip, uint32_t kb,               \
                                                const htp_act_q8 *a, uint32_t nt, float *out,    \
                                                uint32_t ldo, uint32_t rows) {                   \
        AVX512_STRIP6(mxq8_block_##SUFFIX, );                                                    \
    }

MXFP4_KERNEL(vnni, HTP_T_VNNI, DOT_VNNI)
MXFP4_KERNEL(bw, HTP_T_AVX512, DOT_BW)

/* ---- IQ4_NL, IQ4_XS, Q4_1, Q5_0, Q5_1 x Q8 tile kernel, AVX-512: the Q4_0 kernel's nibble
 * scheme (the codes of all five are Q4_0-ordered nibbles; LQ_* (htp_internal.h) says which tile,
 * a compile-time constant). Q4_1: the nibbles (0..15) as they are; Q5_0 / Q5_1: plus 16 x the fifth bit
 * (q5k_fifth: the fifth-bit words have the Q5_K layout, at 64 + 4r / 128 + 4r), 0..31; IQ4_NL /
 * IQ4_XS, AVX-512BW (OFFS 0): one vpshufb gives |kv[code]| (0..127) and the codes below 8
 * (kv < 0) negate the activations of their lanes, so a vpmaddubsw pair stays within
 * 2 x 127 x 127; VNNI (OFFS 1): one vpshufb gives kv[code] + 128 (1..241) as vpdpbusd's
 * unsigned operand against the signed activations, the sums starting at -128 x the block's
 * activation sum (exact: |sum| <= 32 x 241 x 128 + 128 x 32 x 128, and vpdpbusd does not
 * saturate). The integer sums are the portable body's exact int32 dots (Q5_0's
 * start at -16 x the block's activation sum: its dot - 16 sa), and the fp32 epilogue is the
 * portable body's, operation for operation, no fused multiply-add (HTP_NO_CONTRACT):
 *   IQ4_NL / IQ4_XS: acc += (float)(sc x dot) x (d x da)          (IQ4_NL: sc = 1)
 *   Q5_0:            acc += (float)(dot - 16 sa) x (d x da)
 *   Q4_1 / Q5_1:     acc += (float)dot x (d x da) + (float)sa x (m x da). */

/* the d (and m) of 16 rows: fp16 at 2r, or (d, m) pairs at 4r (the 64 bytes at p) */
HTP_T_AVX512 static inline __attribute__((always_inline)) void lq_dm512(const uint8_t *p, int hasm,
                                                                       __m512 *dv, __m512 *mv) {
    if (!hasm) {
        *dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        return;
    }
    const __m512i w = _mm512_loadu_si512((const void *)p);
    *dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
    *mv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
}

#define LQ_KERNEL(SUFFIX, TARGET, DOT, OFFS)                                                     \
    TARGET HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lqq8_block_##SUFFIX( \
        const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s,    \
        uint32_t k, float *out, uint32_t ldo, uint32_t rows, const int NT, const int K) {        \
        const __m512i m4 = _mm512_set1_epi8(0x0f);                                               \
        const __m512i eight = _mm512_set1_epi8(8);                                               \
        const __m512i lut = _mm512_broadcast_i32x4(                                              \
            OFFS ? _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141,          \
                                 (char)153, (char)166, (char)181, (char)197, (char)217,          \
                                 (char)241)                                                      \
                 : _mm_setr_epi8(127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89,    \
                                 113));                                                          \
        __m512 acc[6][2];                                                                        \
        for (int u = 0; u < NT; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();                \
        for (uint32_t j = 0; j < kb; j++) {                                                      \
            const uint8_t *tile = strip + (size_t)j * LQ_BYTES(K);                               \
            __m512i ia[6][2];                                                                    \
            for (int u = 0; u < NT; u++)                                                         \
                ia[u][0] = ia[u][1] =                                                            \
                    _mm512_set1_epi32(K == LQ_Q50             ? -16 * s[(size_t)u * kb + j]      \
                                      : OFFS && LQ_IQ4(K) ? -128 * s[(size_t)u * kb + j]         \
                                                          : 0);                                  \
            for (int g = 0; g < 4; g++) {                                                        \
                const __m512i v0 = _mm512_loadu_si512((const void *)(tile + LQ_NIB(K) + 128 * g)); \
                const __m512i v1 =                                                               \
                    _mm512_loadu_si512((const void *)(tile + LQ_NIB(K) + 64 + 128 * g));         \
                __m512i l0 = _mm512_and_si512(v0, m4);                                           \
                __m512i l1 = _mm512_and_si512(v1, m4);                                           \
                __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);                     \
                __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);                     \
                __mmask64 nl0 = 0, nl1 = 0, nh0 = 0, nh1 = 0;                                    \
                if (LQ_IQ4(K) && !OFFS) {                                                        \
                    nl0 = _mm512_cmplt_epu8_mask(l0, eight);                                     \
                    nl1 = _mm512_cmplt_epu8_mask(l1, eight);                                     \
                    nh0 = _mm512_cmplt_epu8_mask(h0, eight);                                     \
                    nh1 = _mm512_cmplt_epu8_mask(h1, eight);                                     \
                }                                                                                \
                if (LQ_IQ4(K)) {                                                                 \
                    l0 = _mm512_shuffle_epi8(lut, l0);                                           \
                    l1 = _mm512_shuffle_epi8(lut, l1);                                           \
                    h0 = _mm512_shuffle_epi8(lut, h0);                                           \
                    h1 = _mm512_shuffle_epi8(lut, h1);                                           \
                }                                                                                \
                if (LQ_Q5(K)) {                                                                  \
                    l0 = q5k_fifth(l0, tile + LQ_QH(K), g / 2, g % 2);                           \
                    l1 = q5k_fifth(l1, tile + LQ_QH(K) + 64, g / 2, g % 2);                      \
                    h0 = q5k_fifth(h0, tile + LQ_QH(K), 2 + g / 2, g % 2);                       \
                    h1 = q5k_fifth(h1, tile + LQ_QH(K) + 64, 2 + g / 2, g % 2);                  \
                }                                                                                \
                for (int u = 0; u < NT; u++) {                                                   \
                    const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;                       \
                    int32_t alo, ahi;                                                            \
                    memcpy(&alo, qa, 4);                                                         \
                    memcpy(&ahi, qa + 16, 4);                                                    \
                    const __m512i bl = _mm512_set1_epi32(alo), bh = _mm512_set1_epi32(ahi);      \
                    if (LQ_IQ4(K) && !OFFS) {                                                    \
                        const __m512i z = _mm512_setzero_si512();                                \
                        ia[u][0] = DOT(ia[u][0], l0, _mm512_mask_sub_epi8(bl, nl0, z, bl));      \
                        ia[u][0] = DOT(ia[u][0], h0, _mm512_mask_sub_epi8(bh, nh0, z, bh));      \
                        ia[u][1] = DOT(ia[u][1], l1, _mm512_mask_sub_epi8(bl, nl1, z, bl));      \
                        ia[u][1] = DOT(ia[u][1], h1, _mm512_mask_sub_epi8(bh, nh1, z, bh));      \
                    } else {                                                                     \
                        ia[u][0] = DOT(ia[u][0], l0, bl);                                        \
                        ia[u][0] = DOT(ia[u][0], h0, bh);                                        \
                        ia[u][1] = DOT(ia[u][1], l1, bl);                                        \
                        ia[u][1] = DOT(ia[u][1], h1, bh);                                        \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            __m512 dw0, dw1, mw0 = _mm512_setzero_ps(), mw1 = _mm512_setzero_ps();               \
            lq_dm512(tile, LQ_HASM(K), &dw0, &mw0);                                              \
            lq_dm512(tile + (LQ_HASM(K) ? 64 : 32), LQ_HASM(K), &dw1, &mw1);                     \
            __m512i sc0 = _mm512_setzero_si512(), sc1 = _mm512_setzero_si512();                  \
            if (K == LQ_IQ4XS) {                                                                 \
                sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(tile + 64)));       \
                sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(tile + 80)));       \
            }                                                                                    \
            for (int u = 0; u < NT; u++) {                                                       \
                const float dau = d[(size_t)u * kb + j];                                         \
                const __m512 da = _mm512_set1_ps(dau);                                           \
                __m512i i0 = ia[u][0], i1 = ia[u][1];                                            \
                if (K == LQ_IQ4XS) {                                                             \
                    i0 = _mm512_mullo_epi32(sc0, i0);                                            \
                    i1 = _mm512_mullo_epi32(sc1, i1);                                            \
                }                                                                                \
                __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(dw0, da));       \
                __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(dw1, da));       \
                if (LQ_HASM(K)) {                                                                \
                    const __m512 sa = _mm512_set1_ps((float)s[(size_t)u * kb + j]);              \
                    v0 = _mm512_add_ps(v0, _mm512_mul_ps(sa, _mm512_mul_ps(mw0, da)));           \
                    v1 = _mm512_add_ps(v1, _mm512_mul_ps(sa, _mm512_mul_ps(mw1, da)));           \
                }                                                                                \
                acc[u][0] = _mm512_add_ps(acc[u][0], v0);                                        \
                acc[u][1] = _mm512_add_ps(acc[u][1], v1);                                        \
            }                                                                                    \
        }                                                                                        \
        store_rows32(out, ldo, acc, NT, rows);                                                   \
    }                                                                                            \
    TARGET HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lqq8_strip_##SUFFIX( \
        const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out,         \
        uint32_t ldo, uint32_t rows, const int K) {                                              \
        AVX512_STRIP6(lqq8_block_##SUFFIX, , K);                                                 \
    }                                                                                            \
    LQ_ENTRIES(fast_##SUFFIX, TARGET HTP_NO_CONTRACT, lqq8_strip_##SUFFIX)

LQ_KERNEL(vnni, HTP_T_VNNI, DOT_VNNI, 1)
LQ_KERNEL(bw, HTP_T_AVX512, DOT_BW, 0)

/* ---- Q8_0 x Q8 tile kernel, AVX-512 VNNI: the int8 weights flipped to u8 (v ^ 0x80 = v + 128)
 * for vpdpbusd, the integer sums starting at -128 x sum(activation block) (exact: vpdpbusd
 * does not saturate), then the Q4_0 kernel's fp32 epilogue. (vpmaddubsw would saturate its
 * 16-bit pairs on u8 up to 255, so the AVX-512BW table keeps the compiled generic body.) */
HTP_T_VNNI static inline __attribute__((always_inline)) void q8q8_block_vnni(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s,
    uint32_t k, float *out, uint32_t ldo, uint32_t rows, const int NT) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[6][2];
    for (int u = 0; u < NT; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_Q8_TILE_BYTES;
        __m512i ia[6][2];
        for (int u = 0; u < NT; u++)
            ia[u][0] = ia[u][1] = _mm512_set1_epi32(-128 * s[(size_t)u * kb + j]);
        for (int g = 0; g < 8; g++) {
            const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(tile + 64 + 128 * g)), flip);
            const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(tile + 128 + 128 * g)), flip);
            for (int u = 0; u < NT; u++) {
                int32_t av;
                memcpy(&av, q + (size_t)u * k + 32 * j + 4 * g, 4);
                const __m512i b = _mm512_set1_epi32(av);
                ia[u][0] = _mm512_dpbusd_epi32(ia[u][0], w0, b);
                ia[u][1] = _mm512_dpbusd_epi32(ia[u][1], w1, b);
            }
        }
        const __m512 dw0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));
        const __m512 dw1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32)));
        for (int u = 0; u < NT; u++) {
            const __m512 da = _mm512_set1_ps(d[(size_t)u * kb + j]);
            acc[u][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[u][0]), _mm512_mul_ps(dw0, da), acc[u][0]);
            acc[u][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[u][1]), _mm512_mul_ps(dw1, da), acc[u][1]);
        }
    }
    store_rows32(out, ldo, acc, NT, rows);
}

HTP_T_VNNI static void q8q8_strip_fast_vnni(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                            uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    AVX512_STRIP6(q8q8_block_vnni, );
}

/* The VNNI strip for the AMX kernel's short token tails (nt <= HTP_Q4_VNNI_NT). */
void htp_q4q8_strip_vnni(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                         float *out, uint32_t ldo, uint32_t rows) {
    q4q8_strip_vnni(strip, kb, a, nt, out, ldo, rows);
}

/* ---- Q4_0 x Q8 tile kernel, AVX2: the same scheme with 8-row registers. One pass covers 16
 * rows (two ymm of 32-bit lanes) for up to 4 tokens, so each weight load and nibble split serves
 * 4 tokens; the fp32 sums wait in L1, leaving the registers to the 16-bit sums. vpmaddubsw (u8 nibbles x s8 activations) sums adjacent pairs into 16 bits; a block's
 * 4 groups x (low + high) stay in 16 bits (|sum| <= 8 x 2 x 15 x 127 = 30480 < 2^15, the
 * activations being within +-127) and one vpmaddwd per block widens them. The integer sums are
 * exact, and the fp32 epilogue is the AVX-512 one (convert, dw·da, FMA, blocks in order). */
HTP_T_AVX2 static inline __attribute__((always_inline)) void q4q8_rows16_avx2(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s, uint32_t k,
    float *out, uint32_t ldo, uint32_t rows, uint32_t pass, const int NT) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    float acc[4][16]; /* fp32 sums in L1: the registers hold the 16-bit block sums */
    for (int u = 0; u < NT; u++)
        for (int r = 0; r < 16; r++) acc[u][r] = 0.0f;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_Q4_TILE_BYTES;
        __m256i p16[4][2];
        for (int u = 0; u < NT; u++) p16[u][0] = p16[u][1] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const uint8_t *gp = tile + 64 + 128 * g + 64 * pass;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)gp);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(gp + 32));
            const __m256i l0 = _mm256_and_si256(v0, m4), l1 = _mm256_and_si256(v1, m4);
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
            for (int u = 0; u < NT; u++) {
                const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;
                int32_t alo, ahi;
                memcpy(&alo, qa, 4);
                memcpy(&ahi, qa + 16, 4);
                const __m256i bl = _mm256_set1_epi32(alo), bh = _mm256_set1_epi32(ahi);
                p16[u][0] = _mm256_add_epi16(p16[u][0], _mm256_maddubs_epi16(l0, bl));
                p16[u][1] = _mm256_add_epi16(p16[u][1], _mm256_maddubs_epi16(l1, bl));
                p16[u][0] = _mm256_add_epi16(p16[u][0], _mm256_maddubs_epi16(h0, bh));
                p16[u][1] = _mm256_add_epi16(p16[u][1], _mm256_maddubs_epi16(h1, bh));
                /* keep each sum in one register, added in order: without this gcc
                 * re-associates the 16-bit adds into a tree of products spilled to the stack */
                __asm__("" : "+x"(p16[u][0]), "+x"(p16[u][1]));
            }
        }
        const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32 * pass)));
        const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32 * pass + 16)));
        for (int u = 0; u < NT; u++) {
            const __m256 da = _mm256_set1_ps(d[(size_t)u * kb + j]);
            const __m256i s8 = _mm256_set1_epi32(8 * s[(size_t)u * kb + j]);
            const __m256 f0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(p16[u][0], ones), s8));
            const __m256 f1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(p16[u][1], ones), s8));
            _mm256_storeu_ps(acc[u], _mm256_fmadd_ps(f0, _mm256_mul_ps(dw0, da), _mm256_loadu_ps(acc[u])));
            _mm256_storeu_ps(acc[u] + 8, _mm256_fmadd_ps(f1, _mm256_mul_ps(dw1, da), _mm256_loadu_ps(acc[u] + 8)));
        }
    }
    const uint32_t r0 = 16u * pass, live = rows - r0 < 16 ? rows - r0 : 16;
    for (int u = 0; u < NT; u++)
        for (uint32_t r = 0; r < live; r++) out[(size_t)u * ldo + r0 + r] = acc[u][r];
}

HTP_T_AVX2 static void q4q8_strip_avx2(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                       uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    for (uint32_t pass = 0; 16 * pass < rows; pass++) {
        switch (nt) {
        case 4: q4q8_rows16_avx2(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, pass, 4); break;
        case 3: q4q8_rows16_avx2(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, pass, 3); break;
        case 2: q4q8_rows16_avx2(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, pass, 2); break;
        case 1: q4q8_rows16_avx2(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, pass, 1); break;
        default: break;
        }
    }
}

/* 8 uint8 values as fp32 lanes (the AVX2 K-quant scale vectors) */
HTP_T_AVX2 static inline __attribute__((always_inline)) __m256 htp_u8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Q5_K, AVX2: for 32 bytes of a group (8 rows, a 32-bit lane each) and the rows' fifth-bit
 * words at hb (row i's at hb + 4i), byte `byte` of each word holds from bit 4*`odd` the bits of
 * the lane's four columns: vpshufb copies it to the lane's 4 bytes, the byte's own bit is
 * tested (and + cmpeq) and 16 added to the nibbles whose bit is set. */
HTP_T_AVX2 static inline __attribute__((always_inline)) __m256i q5k_fifth_avx2(__m256i nib,
                                                                             const uint8_t *hb,
                                                                             int byte, int odd) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)hb);
    const __m256i idx = _mm256_add_epi8(
        _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                         8, 8, 8, 8, 12, 12, 12, 12),
        _mm256_set1_epi8((char)byte));
    const __m256i bit = _mm256_set1_epi32(odd ? (int)0x80402010 : 0x08040201);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(bits, idx), bit), bit);
    return _mm256_add_epi8(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

/* ---- Q4_K x Q8 tile kernel, AVX2: the Q4_0 AVX2 scheme (16 rows a pass, 16-bit block sums of
 * nibbles x activations, |sum| <= 30480) on q4_k tiles (groups at byte 192, values 0..15), then
 * per block the exact int32 dot (vpmaddwd by ones) and the shared fp32 epilogue
 * (htp_q45k_epilogue): d·sc and dmin·m taken into fp32 once per tile (exact), then
 * acc = fma(dot, (d·sc)·da, acc), acc = fma(−dmin·m, sa·da, acc). With Q5 = 1 it runs q5_k
 * tiles: each row's fifth bits (the word at 704 + 4r) add 16 to the nibbles whose bit is set
 * (q5k_fifth_avx2), and since q reaches 31 the 16-bit sums are widened every two groups
 * (8 products x 31 x 127 = 31496 fit in int16). */
HTP_T_AVX2 static inline __attribute__((always_inline)) void q4kq8_rows16_avx2(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s, uint32_t k,
    float *out, uint32_t ldo, uint32_t rows, uint32_t pass, const int NT, const int Q5) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    float acc[4][16];
    for (int u = 0; u < NT; u++)
        for (int r = 0; r < 16; r++) acc[u][r] = 0.0f;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * (Q5 ? HTP_Q5K_TILE_BYTES : HTP_Q4K_TILE_BYTES);
        __m256i p16[4][2], i32[4][2];
        for (int u = 0; u < NT; u++) {
            p16[u][0] = p16[u][1] = _mm256_setzero_si256();
            i32[u][0] = i32[u][1] = _mm256_setzero_si256();
        }
        for (int g = 0; g < 4; g++) {
            const uint8_t *gp = tile + 192 + 128 * g + 64 * pass;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)gp);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(gp + 32));
            __m256i l0 = _mm256_and_si256(v0, m4), l1 = _mm256_and_si256(v1, m4);
            __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
            __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
            if (Q5) {
                const uint8_t *hb = tile + 704 + 64 * pass;
                l0 = q5k_fifth_avx2(l0, hb, g / 2, g % 2);
                l1 = q5k_fifth_avx2(l1, hb + 32, g / 2, g % 2);
                h0 = q5k_fifth_avx2(h0, hb, 2 + g / 2, g % 2);
                h1 = q5k_fifth_avx2(h1, hb + 32, 2 + g / 2, g % 2);
            }
            for (int u = 0; u < NT; u++) {
                const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;
                int32_t alo, ahi;
                memcpy(&alo, qa, 4);
                memcpy(&ahi, qa + 16, 4);
                const __m256i bl = _mm256_set1_epi32(alo), bh = _mm256_set1_epi32(ahi);
                p16[u][0] = _mm256_add_epi16(p16[u][0], _mm256_maddubs_epi16(l0, bl));
                p16[u][1] = _mm256_add_epi16(p16[u][1], _mm256_maddubs_epi16(l1, bl));
                p16[u][0] = _mm256_add_epi16(p16[u][0], _mm256_maddubs_epi16(h0, bh));
                p16[u][1] = _mm256_add_epi16(p16[u][1], _mm256_maddubs_epi16(h1, bh));
                __asm__("" : "+x"(p16[u][0]), "+x"(p16[u][1]));
            }
            if (Q5 && g % 2 == 1) /* widen before the int16 sums could overflow */
                for (int u = 0; u < NT; u++)
                    for (int h = 0; h < 2; h++) {
                        i32[u][h] = _mm256_add_epi32(i32[u][h], _mm256_madd_epi16(p16[u][h], ones));
                        p16[u][h] = _mm256_setzero_si256();
                    }
        }
        const uint8_t *hd = tile + 32 * pass;
        const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd));
        const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + 16)));
        const __m256 dm0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + 64)));
        const __m256 dm1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + 80)));
        const uint8_t *hs = tile + 128 + 16 * pass, *hm = tile + 160 + 16 * pass;
        /* d·sc and dmin·m, exact in fp32, once per tile (htp_q45k_scales) */
        const __m256 ds0 = _mm256_mul_ps(dw0, htp_u8x8_ps(hs)), ds1 = _mm256_mul_ps(dw1, htp_u8x8_ps(hs + 8));
        const __m256 dmm0 = _mm256_mul_ps(dm0, htp_u8x8_ps(hm)), dmm1 = _mm256_mul_ps(dm1, htp_u8x8_ps(hm + 8));
        for (int u = 0; u < NT; u++) { /* htp_q45k_epilogue, lane-wise */
            const float dau = d[(size_t)u * kb + j];
            const __m256 da = _mm256_set1_ps(dau);
            const __m256 sada = _mm256_set1_ps((float)s[(size_t)u * kb + j] * dau);
            const __m256 f0 = _mm256_cvtepi32_ps(
                Q5 ? i32[u][0] : _mm256_madd_epi16(p16[u][0], ones));
            const __m256 f1 = _mm256_cvtepi32_ps(
                Q5 ? i32[u][1] : _mm256_madd_epi16(p16[u][1], ones));
            __m256 a0 = _mm256_fmadd_ps(f0, _mm256_mul_ps(ds0, da), _mm256_loadu_ps(acc[u]));
            __m256 a1 = _mm256_fmadd_ps(f1, _mm256_mul_ps(ds1, da), _mm256_loadu_ps(acc[u] + 8));
            _mm256_storeu_ps(acc[u], _mm256_fnmadd_ps(dmm0, sada, a0));
            _mm256_storeu_ps(acc[u] + 8, _mm256_fnmadd_ps(dmm1, sada, a1));
        }
    }
    const uint32_t r0 = 16u * pass, live = rows - r0 < 16 ? rows - r0 : 16;
    for (int u = 0; u < NT; u++)
        for (uint32_t r = 0; r < live; r++) out[(size_t)u * ldo + r0 + r] = acc[u][r];
}

/* The AVX2 strip drivers' loop: blocks of up to 4 tokens of the activations a (nt tokens,
 * kb blocks, k = 32 kb values a token), each over 16-row passes; ROWS16(NT) is the kernel call
 * for one pass of NT tokens (NT a constant 1..4), given q, d, s, o of the block and pass. */
#define AVX2_STRIP4(ROWS16)                                                                      \
    do {                                                                                         \
        const uint32_t k = kb * 32;                                                              \
        for (uint32_t t0 = 0; t0 < nt; t0 += 4) {                                                \
            const uint32_t n = nt - t0 < 4 ? nt - t0 : 4;                                        \
            const int8_t *q = a->q + (size_t)t0 * k;                                             \
            const float *d = a->d + (size_t)t0 * kb;                                             \
            const int32_t *s = a->s + (size_t)t0 * kb;                                           \
            float *o = out + (size_t)t0 * ldo;                                                   \
            (void)s;                                                                             \
            for (uint32_t pass = 0; 16 * pass < rows; pass++) {                                  \
                switch (n) {                                                                     \
                case 4: ROWS16(4); break;                                                        \
                case 3: ROWS16(3); break;                                                        \
                case 2: ROWS16(2); break;                                                        \
                default: ROWS16(1); break;                                                       \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    } while (0)

HTP_T_AVX2 static inline __attribute__((always_inline)) void k45q8_strip_avx2(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int Q5) {
#define K45_ROWS16(NT) q4kq8_rows16_avx2(strip, kb, q, d, s, k, o, ldo, rows, pass, NT, Q5)
    AVX2_STRIP4(K45_ROWS16);
#undef K45_ROWS16
}

HTP_T_AVX2 static void q4kq8_strip_fast_avx2(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                             uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    k45q8_strip_avx2(strip, kb, a, nt, out, ldo, rows, 0);
}
HTP_T_AVX2 static void q5kq8_strip_fast_avx2(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                             uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    k45q8_strip_avx2(strip, kb, a, nt, out, ldo, rows, 1);
}

/* ---- Q8_0 x Q8 tile kernel, AVX2: 16 rows a pass (two ymm of 32-bit lanes per group), up to 4
 * tokens. vpmaddubsw takes |w| (u8, <= 128) and the activations with w's sign (vpsignb), so a
 * pair sums to at most 2 x 128 x 127 = 32512 (no saturation); vpmaddwd widens each group's pairs
 * into the block's int32 sums (exact), then the fp32 epilogue of the Q4_0 kernel. */
HTP_T_AVX2 static inline __attribute__((always_inline)) void q8q8_rows16_avx2(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, uint32_t k, float *out,
    uint32_t ldo, uint32_t rows, uint32_t pass, const int NT) {
    const __m256i ones = _mm256_set1_epi16(1);
    float acc[4][16];
    for (int u = 0; u < NT; u++)
        for (int r = 0; r < 16; r++) acc[u][r] = 0.0f;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_Q8_TILE_BYTES;
        __m256i i32[4][2];
        for (int u = 0; u < NT; u++) i32[u][0] = i32[u][1] = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
            const uint8_t *gp = tile + 64 + 128 * g + 64 * pass;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)gp);
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(gp + 32));
            const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
            for (int u = 0; u < NT; u++) {
                int32_t av;
                memcpy(&av, q + (size_t)u * k + 32 * j + 4 * g, 4);
                const __m256i b = _mm256_set1_epi32(av);
                const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(b, w0));
                const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(b, w1));
                i32[u][0] = _mm256_add_epi32(i32[u][0], _mm256_madd_epi16(p0, ones));
                i32[u][1] = _mm256_add_epi32(i32[u][1], _mm256_madd_epi16(p1, ones));
            }
        }
        const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32 * pass)));
        const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32 * pass + 16)));
        for (int u = 0; u < NT; u++) {
            const __m256 da = _mm256_set1_ps(d[(size_t)u * kb + j]);
            const __m256 f0 = _mm256_cvtepi32_ps(i32[u][0]), f1 = _mm256_cvtepi32_ps(i32[u][1]);
            _mm256_storeu_ps(acc[u], _mm256_fmadd_ps(f0, _mm256_mul_ps(dw0, da), _mm256_loadu_ps(acc[u])));
            _mm256_storeu_ps(acc[u] + 8, _mm256_fmadd_ps(f1, _mm256_mul_ps(dw1, da), _mm256_loadu_ps(acc[u] + 8)));
        }
    }
    const uint32_t r0 = 16u * pass, live = rows - r0 < 16 ? rows - r0 : 16;
    for (int u = 0; u < NT; u++)
        for (uint32_t r = 0; r < live; r++) out[(size_t)u * ldo + r0 + r] = acc[u][r];
}

HTP_T_AVX2 static void q8q8_strip_fast_avx2(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                            uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
#define Q8Q8_ROWS16(NT) q8q8_rows16_avx2(strip, kb, q, d, k, o, ldo, rows, pass, NT)
    AVX2_STRIP4(Q8Q8_ROWS16);
#undef Q8Q8_ROWS16
}

/* ---- Q6_K x Q8 tile kernel, AVX2: the Q8_0 AVX2 scheme (|w| x sign-carried activations) on
 * q6_k tiles; the vpmaddwd that widens each group's 16-bit pairs multiplies them by the row's
 * scale of that half (sc0 for groups 0..3 = columns 0..15, sc1 for groups 4..7, in both 16-bit
 * halves of the row's lane), so one int32 sum per row collects the exact sc0*dot0 + sc1*dot1
 * (|pair| <= 2 x 32 x 127, times |sc| <= 128, 16 pairs: far inside int32), times d·da. */
HTP_T_AVX2 static inline __attribute__((always_inline)) void q6kq8_rows16_avx2(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, uint32_t k, float *out,
    uint32_t ldo, uint32_t rows, uint32_t pass, const int NT) {
    float acc[4][16];
    for (int u = 0; u < NT; u++)
        for (int r = 0; r < 16; r++) acc[u][r] = 0.0f;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_Q6K_TILE_BYTES;
        const uint8_t *hd = tile + 32 * pass, *hs = tile + 64 + 32 * pass;
        /* the scale pairs (int8 sc0, sc1 at byte 64 + 2r): sc[h][v] = each row's scale of half h
         * in both 16-bit halves of its lane, for rows 8v..8v+7 of the pass */
        __m256i sc[2][2];
        for (int v = 0; v < 2; v++) {
            const __m256i x = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(hs + 16 * v)));
            const __m256i lo = _mm256_srai_epi32(_mm256_slli_epi32(x, 24), 24);
            const __m256i hi = _mm256_srai_epi32(x, 8);
            const __m256i low16 = _mm256_set1_epi32(0xffff);
            sc[0][v] = _mm256_or_si256(_mm256_and_si256(lo, low16), _mm256_slli_epi32(lo, 16));
            sc[1][v] = _mm256_or_si256(_mm256_and_si256(hi, low16), _mm256_slli_epi32(hi, 16));
        }
        __m256i isum[4][2];
        for (int u = 0; u < NT; u++) isum[u][0] = isum[u][1] = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
            const int h = g >> 2;
            const uint8_t *gp = tile + 128 + 128 * g + 64 * pass;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)gp);
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(gp + 32));
            const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
            for (int u = 0; u < NT; u++) {
                int32_t av;
                memcpy(&av, q + (size_t)u * k + 32 * j + 4 * g, 4);
                const __m256i b = _mm256_set1_epi32(av);
                const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(b, w0));
                const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(b, w1));
                isum[u][0] = _mm256_add_epi32(isum[u][0], _mm256_madd_epi16(p0, sc[h][0]));
                isum[u][1] = _mm256_add_epi32(isum[u][1], _mm256_madd_epi16(p1, sc[h][1]));
            }
        }
        const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd));
        const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + 16)));
        for (int u = 0; u < NT; u++) {
            const __m256 da = _mm256_set1_ps(d[(size_t)u * kb + j]);
            const __m256i i0 = isum[u][0], i1 = isum[u][1];
            _mm256_storeu_ps(acc[u], _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(dw0, da), _mm256_loadu_ps(acc[u])));
            _mm256_storeu_ps(acc[u] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(dw1, da), _mm256_loadu_ps(acc[u] + 8)));
        }
    }
    const uint32_t r0 = 16u * pass, live = rows - r0 < 16 ? rows - r0 : 16;
    for (int u = 0; u < NT; u++)
        for (uint32_t r = 0; r < live; r++) out[(size_t)u * ldo + r0 + r] = acc[u][r];
}

HTP_T_AVX2 static void q6kq8_strip_fast_avx2(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                             uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
#define Q6KQ8_ROWS16(NT) q6kq8_rows16_avx2(strip, kb, q, d, k, o, ldo, rows, pass, NT)
    AVX2_STRIP4(Q6KQ8_ROWS16);
#undef Q6KQ8_ROWS16
}

/* ---- MXFP4 x Q8 tile kernel, AVX2: the Q8_0 AVX2 scheme on mxfp4 tiles (16 rows a pass). Each
 * code becomes |value| (0..12, one vpshufb) for vpmaddubsw and its signed doubled E2M1 value
 * (another vpshufb) gives the activations its sign (vpsignb); a group's pairs sum to at most
 * 2 x 12 x 127 and a block's eight to 24384, so the 16-bit block sums are exact; vpmaddwd widens
 * them to int32, then the portable body's fp32 epilogue (product, then sum): the same bits. */
HTP_T_AVX2 static inline __attribute__((always_inline)) __m256 mx_half256(__m256i e) {
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(big, sub, small));
}

HTP_T_AVX2 HTP_NO_CONTRACT static inline __attribute__((always_inline)) void mxq8_rows16_avx2(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, uint32_t k, float *out,
    uint32_t ldo, uint32_t rows, uint32_t pass, const int NT) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i lut_abs = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1,
                                             2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12);
    const __m256i lut_sgn = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                             0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    float acc[4][16];
    for (int u = 0; u < NT; u++)
        for (int r = 0; r < 16; r++) acc[u][r] = 0.0f;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_MXFP4_TILE_BYTES;
        __m256i p16[4][2];
        for (int u = 0; u < NT; u++) p16[u][0] = p16[u][1] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const uint8_t *gp = tile + 32 + 128 * g + 64 * pass;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)gp);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(gp + 32));
            const __m256i cl0 = _mm256_and_si256(v0, m4), cl1 = _mm256_and_si256(v1, m4);
            const __m256i ch0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
            const __m256i ch1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
            const __m256i al0 = _mm256_shuffle_epi8(lut_abs, cl0), sl0 = _mm256_shuffle_epi8(lut_sgn, cl0);
            const __m256i al1 = _mm256_shuffle_epi8(lut_abs, cl1), sl1 = _mm256_shuffle_epi8(lut_sgn, cl1);
            const __m256i ah0 = _mm256_shuffle_epi8(lut_abs, ch0), sh0 = _mm256_shuffle_epi8(lut_sgn, ch0);
            const __m256i ah1 = _mm256_shuffle_epi8(lut_abs, ch1), sh1 = _mm256_shuffle_epi8(lut_sgn, ch1);
            for (int u = 0; u < NT; u++) {
                const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;
                int32_t alo, ahi;
                memcpy(&alo, qa, 4);
                memcpy(&ahi, qa + 16, 4);
                const __m256i bl = _mm256_set1_epi32(alo), bh = _mm256_set1_epi32(ahi);
                p16[u][0] = _mm256_add_epi16(p16[u][0], _mm256_maddubs_epi16(al0, _mm256_sign_epi8(bl, sl0)));
                p16[u][1] = _mm256_add_epi16(p16[u][1], _mm256_maddubs_epi16(al1, _mm256_sign_epi8(bl, sl1)));
                p16[u][0] = _mm256_add_epi16(p16[u][0], _mm256_maddubs_epi16(ah0, _mm256_sign_epi8(bh, sh0)));
                p16[u][1] = _mm256_add_epi16(p16[u][1], _mm256_maddubs_epi16(ah1, _mm256_sign_epi8(bh, sh1)));
                __asm__("" : "+x"(p16[u][0]), "+x"(p16[u][1]));
            }
        }
        const uint8_t *he = tile + 16 * pass;
        const __m256 e0 = mx_half256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)he)));
        const __m256 e1 = mx_half256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(he + 8))));
        for (int u = 0; u < NT; u++) {
            const __m256 da = _mm256_set1_ps(d[(size_t)u * kb + j]);
            const __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16[u][0], ones));
            const __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16[u][1], ones));
            const __m256 v0 = _mm256_mul_ps(p0, _mm256_mul_ps(e0, da));
            const __m256 v1 = _mm256_mul_ps(p1, _mm256_mul_ps(e1, da));
            _mm256_storeu_ps(acc[u], _mm256_add_ps(_mm256_loadu_ps(acc[u]), v0));
            _mm256_storeu_ps(acc[u] + 8, _mm256_add_ps(_mm256_loadu_ps(acc[u] + 8), v1));
        }
    }
    const uint32_t r0 = 16u * pass, live = rows - r0 < 16 ? rows - r0 : 16;
    for (int u = 0; u < NT; u++)
        for (uint32_t r = 0; r < live; r++) out[(size_t)u * ldo + r0 + r] = acc[u][r];
}

HTP_T_AVX2 HTP_NO_CONTRACT static void mxq8_strip_fast_avx2(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                            uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
#define MXQ8_ROWS16(NT) mxq8_rows16_avx2(strip, kb, q, d, k, o, ldo, rows, pass, NT)
    AVX2_STRIP4(MXQ8_ROWS16);
#undef MXQ8_ROWS16
}

/* ---- IQ4_NL, IQ4_XS, Q4_1, Q5_0, Q5_1 x Q8 tile kernel, AVX2: the AVX-512 kernel's values
 * (LQ_KERNEL) with the Q4_0 AVX2 scheme's 16 rows a pass and 4 tokens. vpmaddubsw sums adjacent
 * pairs into 16 bits: Q4_1 / Q5_0 / Q5_1 add a group's low and high pairs (4 products,
 * <= 4 x 31 x 127 = 15748) before one vpmaddwd widens them; the IQ4 pairs (up to 2 x 127 x 127)
 * are widened one by one. The integer sums are exact, and the fp32 epilogue is LQ_KERNEL's
 * (the portable body's, no fused multiply-add). */
/* the d (and m) of 8 rows: fp16 at 2r, or (d, m) pairs at 4r (the 32 bytes at p) */
HTP_T_AVX2 static inline __attribute__((always_inline)) void lq_dm256(const uint8_t *p, int hasm,
                                                                     __m256 *dv, __m256 *mv) {
    if (!hasm) {
        *dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        return;
    }
    const __m256i w = _mm256_loadu_si256((const __m256i *)p);
    const __m256i dm = _mm256_shuffle_epi8( /* per 128-bit half: the 4 d, then the 4 m */
        w, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9,
                            12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i o = _mm256_permute4x64_epi64(dm, 0xd8); /* 8 d, then 8 m */
    *dv = _mm256_cvtph_ps(_mm256_castsi256_si128(o));
    *mv = _mm256_cvtph_ps(_mm256_extracti128_si256(o, 1));
}

HTP_T_AVX2 HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lqq8_rows16_avx2(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s, uint32_t k,
    float *out, uint32_t ldo, uint32_t rows, uint32_t pass, const int NT, const int K) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i lut_abs = _mm256_setr_epi8(127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53,
                                             69, 89, 113, 127, 104, 83, 65, 49, 35, 22, 10, 1, 13,
                                             25, 38, 53, 69, 89, 113);
    const __m256i lut_sgn = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1,
                                             -1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1);
    float acc[4][16]; /* fp32 sums in L1: the registers hold the integer block sums */
    for (int u = 0; u < NT; u++)
        for (int r = 0; r < 16; r++) acc[u][r] = 0.0f;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * LQ_BYTES(K);
        __m256i p32[4][2];
        for (int u = 0; u < NT; u++)
            p32[u][0] = p32[u][1] = _mm256_set1_epi32(K == LQ_Q50 ? -16 * s[(size_t)u * kb + j] : 0);
        for (int g = 0; g < 4; g++) {
            const uint8_t *gp = tile + LQ_NIB(K) + 128 * g + 64 * pass;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)gp);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(gp + 32));
            __m256i l0 = _mm256_and_si256(v0, m4), l1 = _mm256_and_si256(v1, m4);
            __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
            __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
            if (LQ_IQ4(K)) {
                const __m256i sl0 = _mm256_shuffle_epi8(lut_sgn, l0);
                const __m256i sl1 = _mm256_shuffle_epi8(lut_sgn, l1);
                const __m256i sh0 = _mm256_shuffle_epi8(lut_sgn, h0);
                const __m256i sh1 = _mm256_shuffle_epi8(lut_sgn, h1);
                l0 = _mm256_shuffle_epi8(lut_abs, l0), l1 = _mm256_shuffle_epi8(lut_abs, l1);
                h0 = _mm256_shuffle_epi8(lut_abs, h0), h1 = _mm256_shuffle_epi8(lut_abs, h1);
                for (int u = 0; u < NT; u++) {
                    const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;
                    int32_t alo, ahi;
                    memcpy(&alo, qa, 4);
                    memcpy(&ahi, qa + 16, 4);
                    const __m256i bl = _mm256_set1_epi32(alo), bh = _mm256_set1_epi32(ahi);
                    const __m256i x0 = _mm256_maddubs_epi16(l0, _mm256_sign_epi8(bl, sl0));
                    const __m256i x1 = _mm256_maddubs_epi16(l1, _mm256_sign_epi8(bl, sl1));
                    const __m256i y0 = _mm256_maddubs_epi16(h0, _mm256_sign_epi8(bh, sh0));
                    const __m256i y1 = _mm256_maddubs_epi16(h1, _mm256_sign_epi8(bh, sh1));
                    p32[u][0] = _mm256_add_epi32(p32[u][0], _mm256_madd_epi16(x0, ones));
                    p32[u][1] = _mm256_add_epi32(p32[u][1], _mm256_madd_epi16(x1, ones));
                    p32[u][0] = _mm256_add_epi32(p32[u][0], _mm256_madd_epi16(y0, ones));
                    p32[u][1] = _mm256_add_epi32(p32[u][1], _mm256_madd_epi16(y1, ones));
                }
                continue;
            }
            if (LQ_Q5(K)) {
                const uint8_t *hb = tile + LQ_QH(K) + 64 * pass;
                l0 = q5k_fifth_avx2(l0, hb, g / 2, g % 2);
                l1 = q5k_fifth_avx2(l1, hb + 32, g / 2, g % 2);
                h0 = q5k_fifth_avx2(h0, hb, 2 + g / 2, g % 2);
                h1 = q5k_fifth_avx2(h1, hb + 32, 2 + g / 2, g % 2);
            }
            for (int u = 0; u < NT; u++) {
                const int8_t *qa = q + (size_t)u * k + 32 * j + 4 * g;
                int32_t alo, ahi;
                memcpy(&alo, qa, 4);
                memcpy(&ahi, qa + 16, 4);
                const __m256i bl = _mm256_set1_epi32(alo), bh = _mm256_set1_epi32(ahi);
                const __m256i x0 =
                    _mm256_add_epi16(_mm256_maddubs_epi16(l0, bl), _mm256_maddubs_epi16(h0, bh));
                const __m256i x1 =
                    _mm256_add_epi16(_mm256_maddubs_epi16(l1, bl), _mm256_maddubs_epi16(h1, bh));
                p32[u][0] = _mm256_add_epi32(p32[u][0], _mm256_madd_epi16(x0, ones));
                p32[u][1] = _mm256_add_epi32(p32[u][1], _mm256_madd_epi16(x1, ones));
            }
        }
        __m256 dw0, dw1, mw0 = _mm256_setzero_ps(), mw1 = _mm256_setzero_ps();
        const uint8_t *dp = tile + (LQ_HASM(K) ? 64 : 32) * pass;
        lq_dm256(dp, LQ_HASM(K), &dw0, &mw0);
        lq_dm256(dp + (LQ_HASM(K) ? 32 : 16), LQ_HASM(K), &dw1, &mw1);
        __m256i sc0 = _mm256_setzero_si256(), sc1 = _mm256_setzero_si256();
        if (K == LQ_IQ4XS) {
            sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 64 + 16 * pass)));
            sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 72 + 16 * pass)));
        }
        for (int u = 0; u < NT; u++) {
            const float dau = d[(size_t)u * kb + j];
            const __m256 da = _mm256_set1_ps(dau);
            __m256i i0 = p32[u][0], i1 = p32[u][1];
            if (K == LQ_IQ4XS) {
                i0 = _mm256_mullo_epi32(sc0, i0);
                i1 = _mm256_mullo_epi32(sc1, i1);
            }
            __m256 v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(dw0, da));
            __m256 v1 = _mm256_mul_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(dw1, da));
            if (LQ_HASM(K)) {
                const __m256 sa = _mm256_set1_ps((float)s[(size_t)u * kb + j]);
                v0 = _mm256_add_ps(v0, _mm256_mul_ps(sa, _mm256_mul_ps(mw0, da)));
                v1 = _mm256_add_ps(v1, _mm256_mul_ps(sa, _mm256_mul_ps(mw1, da)));
            }
            _mm256_storeu_ps(acc[u], _mm256_add_ps(_mm256_loadu_ps(acc[u]), v0));
            _mm256_storeu_ps(acc[u] + 8, _mm256_add_ps(_mm256_loadu_ps(acc[u] + 8), v1));
        }
    }
    const uint32_t r0 = 16u * pass, live = rows - r0 < 16 ? rows - r0 : 16;
    for (int u = 0; u < NT; u++)
        for (uint32_t r = 0; r < live; r++) out[(size_t)u * ldo + r0 + r] = acc[u][r];
}

HTP_T_AVX2 HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lqq8_strip_avx2(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int K) {
#define LQ_ROWS16(NT) lqq8_rows16_avx2(strip, kb, q, d, s, k, o, ldo, rows, pass, NT, K)
    AVX2_STRIP4(LQ_ROWS16);
#undef LQ_ROWS16
}
LQ_ENTRIES(fast_avx2, HTP_T_AVX2 HTP_NO_CONTRACT, lqq8_strip_avx2)

/* ---- fp32-activation GEMM, AVX-512: the strip is dequantized once into a [k][32] panel,
 * then 8 tokens x 32 rows of accumulators (16 zmm) take 2 panel loads + 8 broadcasts per column. */
HTP_T_AVX512 static inline __attribute__((always_inline)) void f32_block_avx512(
    const float *panel, uint32_t k, const float *x, uint32_t ldx, float *out, uint32_t ldo,
    uint32_t rows, const int NT) {
    __m512 acc[8][2];
    for (int u = 0; u < NT; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
    for (uint32_t c = 0; c < k; c++) {
        const __m512 p0 = _mm512_loadu_ps(panel + (size_t)c * 32);
        const __m512 p1 = _mm512_loadu_ps(panel + (size_t)c * 32 + 16);
        for (int u = 0; u < NT; u++) {
            const __m512 b = _mm512_set1_ps(x[(size_t)u * ldx + c]);
            acc[u][0] = _mm512_fmadd_ps(b, p0, acc[u][0]);
            acc[u][1] = _mm512_fmadd_ps(b, p1, acc[u][1]);
        }
    }
    store_rows32(out, ldo, acc, NT, rows);
}

HTP_T_AVX512 static void f32_strip_fast_avx512(const float *panel, uint32_t k, const float *x,
                                               uint32_t ldx, uint32_t nt, float *out,
                                               uint32_t ldo, uint32_t rows) {
    switch (nt) {
    case 8: f32_block_avx512(panel, k, x, ldx, out, ldo, rows, 8); break;
    case 7: f32_block_avx512(panel, k, x, ldx, out, ldo, rows, 7); break;
    case 6: f32_block_avx512(panel, k, x, ldx, out, ldo, rows, 6); break;
    case 5: f32_block_avx512(panel, k, x, ldx, out, ldo, rows, 5); break;
    case 4: f32_block_avx512(panel, k, x, ldx, out, ldo, rows, 4); break;
    case 3: f32_block_avx512(panel, k, x, ldx, out, ldo, rows, 3); break;
    case 2: f32_block_avx512(panel, k, x, ldx, out, ldo, rows, 2); break;
    case 1: f32_block_avx512(panel, k, x, ldx, out, ldo, rows, 1); break;
    default: break;
    }
}

/* ---- row quantization, AVX-512: one 32-block in two zmm; the same operations in the same
 * order as the generic body (amax / 127, x * (1 / d) rounded to nearest even by the current
 * mode, as nearbyintf), so the bytes are identical at every level. */
HTP_T_AVX512 static void quantize_q8_fast_avx512(const float *x, uint32_t k, int8_t *q, float *d,
                                                 int32_t *s) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (uint32_t j = 0; j < k / 32; j++) {
        const __m512 a = _mm512_loadu_ps(x + 32 * j), b = _mm512_loadu_ps(x + 32 * j + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const float dd = amax / 127.0f;
        const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
        _mm_storeu_si128((__m128i *)(q + 32 * j), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(q + 32 * j + 16), _mm512_cvtsepi32_epi8(qb));
        d[j] = dd;
        s[j] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

/* ---- instruction-mix peaks: one measure written once, instantiated per instruction ----
 * Twelve independent chains x = STEP(x) of the instruction, in named variables (on an array gcc
 * kept the AVX2 chains in memory, a store and a reload per step: ~150 instead of ~200 G
 * multiply-adds per core on Zen 3), summed at the end so no chain is dead. vpmaddubsw steps are
 * asm, as even named intrinsics left a few spills; each feeds its result back as the u8
 * operand, so nothing is loop-invariant. */
#define HTP_PEAK(NAME, TARGET, VT, INIT, STEP, ADD, OUT)                                        \
    TARGET static int32_t NAME(uint64_t iters) {                                                 \
        VT x0 = INIT(0), x1 = INIT(1), x2 = INIT(2), x3 = INIT(3), x4 = INIT(4), x5 = INIT(5);  \
        VT x6 = INIT(6), x7 = INIT(7), x8 = INIT(8), x9 = INIT(9), x10 = INIT(10), x11 = INIT(11); \
        for (uint64_t it = 0; it < iters; it++) {                                                \
            STEP(x0); STEP(x1); STEP(x2); STEP(x3); STEP(x4); STEP(x5);                          \
            STEP(x6); STEP(x7); STEP(x8); STEP(x9); STEP(x10); STEP(x11);                        \
        }                                                                                        \
        const VT r = ADD(ADD(ADD(ADD(x0, x1), ADD(x2, x3)), ADD(ADD(x4, x5), ADD(x6, x7))),      \
                         ADD(ADD(x8, x9), ADD(x10, x11)));                                       \
        return OUT(r);                                                                           \
    }

#define PK_I512(i) _mm512_set1_epi32(0x01020304 + (i))
#define PK_I256(i) _mm256_set1_epi32(0x01020304 + (i))
#define PK_F512(i) _mm512_set1_ps((float)(i))
#define PK_F256(i) _mm256_set1_ps((float)(i))
#define PK_OUT_I512(r) _mm512_reduce_add_epi32(r)
#define PK_OUT_F512(r) (int32_t)_mm512_reduce_add_ps(r)
#define PK_OUT_I256(r) (_mm256_extract_epi32((r), 0) + _mm256_extract_epi32((r), 7))
#define PK_OUT_F256(r) (int32_t)_mm256_cvtss_f32(r)
/* vpdpbusd (64 MACs per zmm), vpmaddubsw zmm (64) and ymm (32), vfmadd231ps zmm (16) and ymm
 * (8), vdpbf16ps (32) */
#define PK_VNNI(v) v = _mm512_dpbusd_epi32((v), _mm512_set1_epi32(0x01020304), _mm512_set1_epi32(0x05060708))
#define PK_BW(v) __asm__("vpmaddubsw %1, %0, %0" : "+v"(v) : "v"(_mm512_set1_epi32(0x05060708)))
#define PK_DOT2(v) __asm__("vpmaddubsw %1, %0, %0" : "+x"(v) : "x"(_mm256_set1_epi32(0x05060708)))
#define PK_FMA512(v) v = _mm512_fmadd_ps((v), _mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f))
#define PK_FMA256(v) v = _mm256_fmadd_ps((v), _mm256_set1_ps(0.999f), _mm256_set1_ps(1e-3f))
#define PK_BF16(v)                                                                               \
    v = _mm512_dpbf16_ps((v), (__m512bh)_mm512_set1_epi32(0x3f803f80), (__m512bh)_mm512_set1_epi32(0x3a833a83))

HTP_PEAK(peak_vnni, HTP_T_VNNI, __m512i, PK_I512, PK_VNNI, _mm512_add_epi32, PK_OUT_I512)
HTP_PEAK(peak_bw, HTP_T_AVX512, __m512i, PK_I512, PK_BW, _mm512_add_epi32, PK_OUT_I512)
HTP_PEAK(peak_fma, HTP_T_AVX512, __m512, PK_F512, PK_FMA512, _mm512_add_ps, PK_OUT_F512)
HTP_PEAK(peak_bf16, HTP_T_BF16, __m512, PK_F512, PK_BF16, _mm512_add_ps, PK_OUT_F512)
HTP_PEAK(peak_dot_avx2, HTP_T_AVX2, __m256i, PK_I256, PK_DOT2, _mm256_add_epi32, PK_OUT_I256)
HTP_PEAK(peak_fma_avx2, HTP_T_AVX2, __m256, PK_F256, PK_FMA256, _mm256_add_ps, PK_OUT_F256)

/* The Q4_0 / Q8_0 x Q8 kernels' mix: per 32-row block and token, 16 vpdpbusd (two 16-row
 * halves x 8 of the block's 32 columns x 4) and the fp32 step of the two halves (vmulps d_w*d_a,
 * vfmadd231ps acc += float(dot) * that). Sixteen dot chains, two multiply chains and two FMA
 * chains an iteration (the conversion, which the kernels also issue, is left out: it runs on
 * other pipes than the multiplies on the CPUs measured); only the dot products' MACs count. */
HTP_T_VNNI static int32_t peak_vnni_step(uint64_t iters) {
    __m512i x0 = PK_I512(0), x1 = PK_I512(1), x2 = PK_I512(2), x3 = PK_I512(3), x4 = PK_I512(4);
    __m512i x5 = PK_I512(5), x6 = PK_I512(6), x7 = PK_I512(7), x8 = PK_I512(8), x9 = PK_I512(9);
    __m512i x10 = PK_I512(10), x11 = PK_I512(11), x12 = PK_I512(12), x13 = PK_I512(13);
    __m512i x14 = PK_I512(14), x15 = PK_I512(15);
    __m512 m0 = _mm512_set1_ps(1.0f), m1 = _mm512_set1_ps(2.0f);
    __m512 f0 = _mm512_setzero_ps(), f1 = _mm512_setzero_ps();
    /* the multiply chains grow by 1 + 2^-23 a step: no subnormals (a decaying chain would reach
     * them) and no overflow before ~7e8 iterations (an infinity costs nothing either) */
    const __m512 s = _mm512_set1_ps(1.00000012f), t = _mm512_set1_ps(1e-3f);
    const __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x05060708);
    /* asm steps: with the intrinsic gcc copied and spilled chains every iteration */
#define PK_VNNI_ASM(v) __asm__("vpdpbusd %2, %1, %0" : "+v"(v) : "v"(a), "v"(b))
    for (uint64_t it = 0; it < iters; it++) {
        PK_VNNI_ASM(x0); PK_VNNI_ASM(x1); PK_VNNI_ASM(x2); PK_VNNI_ASM(x3);
        PK_VNNI_ASM(x4); PK_VNNI_ASM(x5); PK_VNNI_ASM(x6); PK_VNNI_ASM(x7);
        m0 = _mm512_mul_ps(m0, s);
        f0 = _mm512_fmadd_ps(m0, t, f0);
        PK_VNNI_ASM(x8); PK_VNNI_ASM(x9); PK_VNNI_ASM(x10); PK_VNNI_ASM(x11);
        PK_VNNI_ASM(x12); PK_VNNI_ASM(x13); PK_VNNI_ASM(x14); PK_VNNI_ASM(x15);
        m1 = _mm512_mul_ps(m1, s);
        f1 = _mm512_fmadd_ps(m1, t, f1);
    }
    const __m512i r = _mm512_add_epi32(
        _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(x0, x1), _mm512_add_epi32(x2, x3)),
                         _mm512_add_epi32(_mm512_add_epi32(x4, x5), _mm512_add_epi32(x6, x7))),
        _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(x8, x9), _mm512_add_epi32(x10, x11)),
                         _mm512_add_epi32(_mm512_add_epi32(x12, x13), _mm512_add_epi32(x14, x15))));
    return PK_OUT_I512(r) + PK_OUT_F512(_mm512_add_ps(f0, f1));
#undef PK_VNNI_ASM
}

/* ---- the tables ---- */
const htp_isa htp_isa_avx2 = {
    .level = HTP_SIMD_AVX2,
    .q4q8_strip = q4q8_strip_avx2,
    .q4q8_nt = 4,
    .q8q8_strip = q8q8_strip_fast_avx2,
    .q8q8_nt = 64,
    .q4kq8_strip = q4kq8_strip_fast_avx2,
    .q6kq8_strip = q6kq8_strip_fast_avx2,
    .kq8_nt = 64,
    .q5kq8_strip = q5kq8_strip_fast_avx2,
    .nlq8_strip = nlq8_strip_fast_avx2,
    .xsq8_strip = xsq8_strip_fast_avx2,
    .affq8_strip = affq8_strip_fast_avx2,
    .mxq8_strip = mxq8_strip_fast_avx2,
    .mxq8_nt = 64,
    .dequant_tile = dequant_avx2,
    .dequant_kq_tile = dequant_kq_avx2,
    .f32_strip = f32_strip_avx2,
    .f32_nt = 4,
    .quantize_row_q8 = quantize_q8_avx2,
    .attention_task = htp_attn_task_avx2,
    .attention_kt_cols = HTP_ATTN_COLS_AVX2,
    .attention_bf16_pack = NULL,
    .attention_bf16_task = NULL,
    .swiglu = htp_swiglu_avx2,
    .swiglu_oai = htp_swiglu_oai_avx2,
    .rms_rows = rms_rows_avx2,
    .matmul_f32 = matmul_f32_avx2,
    .dot_peak = peak_dot_avx2,
    .dot_macs_per_iter = 12 * 32,
    .fma_peak = peak_fma_avx2,
    .fma_macs_per_iter = 12 * 8,
};

/* The AVX-512 levels share every kernel but the Q4_0 x Q8 strip and the int8 peak. */
#define HTP_AVX512_COMMON                                                                        \
    .dequant_tile = dequant_avx512,                                                              \
    .f32_strip = f32_strip_fast_avx512, .f32_nt = 8, .quantize_row_q8 = quantize_q8_fast_avx512, \
    .attention_task = htp_attn_task_avx512, .attention_kt_cols = HTP_ATTN_COLS_AVX512,          \
    .attention_bf16_pack = htp_attn_bf16_pack_avx512,                                          \
    .attention_bf16_task = htp_attn_bf16_task_avx512,                                          \
    .attention_bf16_pv_task = htp_attn_bf16_pv_task_avx512, .swiglu = htp_swiglu_avx512,         \
    .swiglu_oai = htp_swiglu_oai_avx512,                                                         \
    .rms_rows = rms_rows_avx512,                                                                 \
    .matmul_f32 = matmul_f32_avx512, .fma_peak = peak_fma, .fma_macs_per_iter = 12 * 16,        \
    .bf16_peak = peak_bf16, .bf16_macs_per_iter = 12 * 32

const htp_isa htp_isa_avx512 = {
    .level = HTP_SIMD_AVX512,
    .q4q8_strip = q4q8_strip_bw,
    .q4q8_nt = 4,
    .q8q8_strip = q8q8_strip_avx512,
    .q8q8_nt = 4,
    .q4kq8_strip = q4kq8_strip_fast_bw,
    .q6kq8_strip = q6kq8_strip_fast_bw,
    .kq8_nt = 64,
    .q5kq8_strip = q5kq8_strip_fast_bw,
    .nlq8_strip = nlq8_strip_fast_bw,
    .xsq8_strip = xsq8_strip_fast_bw,
    .affq8_strip = affq8_strip_fast_bw,
    .mxq8_strip = mxq8_strip_fast_bw,
    .mxq8_nt = 64,
    .dequant_kq_tile = dequant_kq_avx512,
    .dot_peak = peak_bw,
    .dot_macs_per_iter = 12 * 64,
    HTP_AVX512_COMMON,
};

const htp_isa htp_isa_avx512vnni = {
    .level = HTP_SIMD_AVX512VNNI,
    .q4q8_strip = q4q8_strip_vnni,
    .q4q8_nt = HTP_Q4_VNNI_NT,
    .q8q8_strip = q8q8_strip_fast_vnni,
    .q8q8_nt = 64,
    .q4kq8_strip = q4kq8_strip_fast_vnni,
    .q6kq8_strip = q6kq8_strip_fast_vnni,
    .kq8_nt = 64,
    .q5kq8_strip = q5kq8_strip_fast_vnni,
    .nlq8_strip = nlq8_strip_fast_vnni,
    .xsq8_strip = xsq8_strip_fast_vnni,
    .affq8_strip = affq8_strip_fast_vnni,
    .mxq8_strip = mxq8_strip_fast_vnni,
    .mxq8_nt = 64,
    .dequant_kq_tile = dequant_kq_vnni,
    .dot_peak = peak_vnni,
    .dot_macs_per_iter = 12 * 64,
    .dotstep_peak = peak_vnni_step,
    .dotstep_macs_per_iter = 16 * 64,
    HTP_AVX512_COMMON,
};

/* AMX: the VNNI table with the Q4_0 x Q8 strip on the tile unit (htp_amx.c); its int8 peak is
 * the tile multiply's */
const htp_isa htp_isa_amx = {
    .level = HTP_SIMD_AMX,
    .q4q8_strip = htp_q4q8_strip_amx,
    .q4q8_nt = 64,
    .q8q8_strip = q8q8_strip_fast_vnni,
    .q8q8_nt = 64,
    .q4kq8_strip = q4kq8_strip_fast_vnni,
    .q6kq8_strip = q6kq8_strip_fast_vnni,
    .kq8_nt = 64,
    .q5kq8_strip = q5kq8_strip_fast_vnni,
    .nlq8_strip = nlq8_strip_fast_vnni,
    .xsq8_strip = xsq8_strip_fast_vnni,
    .affq8_strip = affq8_strip_fast_vnni,
    .mxq8_strip = mxq8_strip_fast_vnni,
    .mxq8_nt = 64,
    .dequant_kq_tile = dequant_kq_vnni,
    .dot_peak = htp_amx_peak,
    .dot_macs_per_iter = 4 * 16 * 16 * 64,
    HTP_AVX512_COMMON,
};
#endif
