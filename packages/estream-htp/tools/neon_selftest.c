/* Self-test of the arm64 kernel table (HTP_SIMD_NEON), for cross builds run under qemu-aarch64
 * (tests/test_cross_arm64.py). Exits 1 on any mismatch, 2 when the CPU lacks the dot-product
 * extension (the library must then report the portable level as its best).
 *
 *   neon_selftest [--first-failure]      every check below (or up to the first that fails);
 *                                        last line "OK" or "FAILED"
 *   neon_selftest strip FMT KB NT SIMD   one Q8-activation GEMM of one 32-row strip (KB tiles,
 *                                        NT tokens, FMT q4_0 | q8_0 | q4_k | q5_k | q6_k |
 *                                        mxfp4 | iq4_nl | q4_1 | q5_0 | q5_1 | iq4_xs, SIMD neon |
 *                                        portable, one thread): the workload that
 *                                        tools/neon_instr_mix.py traces
 *   neon_selftest attention              the attention checks alone
 *   neon_selftest attention-task f32|bf16 DK NKB SIMD
 *                                        one (head, query block) attention task (64 causal
 *                                        queries after NKB - 1 context key blocks, dk = dv =
 *                                        DK, one thread): the instruction mix's other workload
 *
 * Checks, each on awkward shapes (fixed ones and ones drawn with a fixed seed: rows not a
 * multiple of 32 or of 16, token counts across the kernels' token blocks, strided inputs and
 * outputs) with NaN-poisoned outputs whose margins (columns past n of a wider row) must stay
 * poisoned and whose written part must be finite:
 * - GEMM, every tile format (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, Q4_1, Q5_0, Q5_1, IQ4_XS) x both activation formats, NEON and portable tables, 1 and 2
 *   threads: each within the rounding bound of its fp32 sums of a float64 reference (Q8: of the
 *   library's own quantized activations), 1 and 2 threads bit-identical.
 * - Q8-activation GEMM of every tile format on 5 awkward shapes: the NEON kernel gives the
 *   portable table's bits (its SMMLA form where the CPU has FEAT_I8MM, else its SDOT form: the
 *   second line says which, and that the library agrees with HWCAP2_I8MM).
 * - GEMM of F16 / BF16 dense tiles: fp32 products under either act, the values read exactly.
 * - GEMM from Q8 rows quantized once and GEMM of three matrices sharing one input: bit-identical
 *   to the one-matrix GEMM of the fp32 input.
 * - GEMM whose float arithmetic is exact (unit scales, integer activations that quantize to
 *   themselves): every output equals the int64 dot product, so the NEON integer partial sums are
 *   bit-identical to the portable ones and to the reference.
 * - The expert op (every tile format, both activation formats): fp32 products within 1e-5 of
 *   a float64 reference, Q8 products within 1e-6 of the portable table; rows of unrouted tokens
 *   untouched.
 * - Attention with fp32 and with bf16 products (check_attention): the portable table's bits on
 *   every shape, both within the products' tolerance of float64; bf16 runs the native
 *   BFMLALT / BFMLALB task where the CPU has FEAT_BF16 (the first line says which, and that
 *   the library agrees with HWCAP2_BF16).
 * - Q8 quantization (bit-identical to the portable table), SwiGLU and the fp32 matmul (within
 *   1e-6 of the portable table, both within 1e-5 of float64): the remaining entries. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/auxv.h>

#include "htp.h"

#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
/* the library's FEAT_I8MM test (htp_internal.h): its NEON level then runs the SMMLA kernels */
int htp_neon_i8mm_supported(void);
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
/* the library's own test for the native bf16 attention kernels (htp_internal.h) */
int htp_cpu_bf16(void);

static uint32_t rng_state = 12345u;
static uint32_t rnd(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}
static float frand(void) { return (float)(rnd() % 20001) / 10000.0f - 1.0f; }

#define POISON 0x7fc0deadu
static void poison(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) memcpy(p + i, &(uint32_t){POISON}, 4);
}
static int is_poison(const float *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u == POISON;
}
/* y[rows][ld]: the first n of each row written and finite, the rest still poisoned. */
static int check_written(const char *what, const float *y, size_t rows, size_t n, size_t ld) {
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < ld; c++) {
            const float *v = y + r * ld + c;
            if (c < n ? !isfinite(*v) : !is_poison(v)) {
                printf("%s: element [%zu][%zu] %s\n", what, r, c,
                       c < n ? "not written or not finite" : "margin overwritten");
                return 1;
            }
        }
    return 0;
}

static double f16_to_double(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 0x3ff;
    const double v = e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return (h & 0x8000) ? -v : v;
}
/* A row scale: mostly 2^-7..2^-2, sometimes zero, subnormal, or the largest finite half. */
static uint16_t awkward_f16(void) {
    const uint16_t sign = (uint16_t)((rnd() & 1) << 15);
    switch (rnd() % 16) {
    case 0: return sign;
    case 1: return (uint16_t)(sign | (1 + rnd() % 0x3ff));
    case 2: return (uint16_t)(sign | 0x7bff);
    default: return (uint16_t)(sign | ((8 + rnd() % 6) << 10) | (rnd() & 0x3ff));
    }
}

/* ---- one op on a fresh HOST backend, buffers registered in reference order ---- */
typedef struct {
    void *p;
    size_t n;
    uint32_t flags;
} buf;
#define RD HTP_BUF_READ
#define RW (HTP_BUF_READ | HTP_BUF_WRITE)

static int run(uint32_t simd, uint32_t threads, htp_op_desc *op, const buf *b, uint32_t nb) {
    const htp_backend_desc bd = {HTP_ABI_VERSION, HTP_BACKEND_HOST, threads, simd, -1, 0, {0, 0}};
    htp_backend *be = NULL;
    if (htp_backend_init(&bd, &be) != HTP_OK) {
        printf("backend init failed (simd %u)\n", simd);
        return 1;
    }
    int bad = htp_backend_simd(be) != simd;
    if (bad) printf("asked for simd %u, backend runs %u\n", simd, htp_backend_simd(be));
    for (uint32_t i = 0; i < nb && !bad; i++) {
        const htp_buffer_desc d = {-1, b[i].flags, 0, b[i].n, (uint64_t)(uintptr_t)b[i].p};
        uint32_t id;
        if (htp_buffer_register(be, &d, &id) != HTP_OK) bad = 1;
        op->ref[i].buffer = id, op->ref[i].offset = 0;
    }
    op->n_refs = nb;
    htp_status st = HTP_OK;
    if (!bad && (st = htp_op_run(be, op)) != HTP_OK) {
        printf("op %u failed: status %d\n", op->opcode, (int)st);
        bad = 1;
    }
    htp_backend_free(be);
    return bad;
}

/* ---- weights: strips of 32x32 tiles (docs/format.md section 1) ---- */
static int is_q45k(uint32_t fmt) { return fmt == HTP_FMT_Q4_K_T32R4 || fmt == HTP_FMT_Q5_K_T32R4; }
static int is_kq(uint32_t fmt) { return is_q45k(fmt) || fmt == HTP_FMT_Q6_K_T32R4; }
/* IQ4_XS: fp16 d at 2r, the int8 sub-block scale ls - 32 at 64 + r, IQ4_NL codes from 96 */
static int is_xs(uint32_t fmt) { return fmt == HTP_FMT_IQ4_XS_T32R4; }
/* Q4_1 / Q5_1: an fp16 (d, m) pair per row at 4r; Q5_0 / Q5_1: the rows' fifth bits as words */
static int has_m(uint32_t fmt) { return fmt == HTP_FMT_Q4_1_T32R4 || fmt == HTP_FMT_Q5_1_T32R4; }
static int is_aff(uint32_t fmt) { return has_m(fmt) || fmt == HTP_FMT_Q5_0_T32R4; }
static size_t tile_bytes(uint32_t fmt) {
    switch (fmt) {
    case HTP_FMT_Q4_0_T32R4: return 576;
    case HTP_FMT_Q8_0_T32R4: return 1088;
    case HTP_FMT_Q4_K_T32R4: return 704;
    case HTP_FMT_MXFP4_T32R4: return 544;
    case HTP_FMT_Q5_K_T32R4: return 832;
    case HTP_FMT_IQ4_NL_T32R4: return 576;
    case HTP_FMT_Q4_1_T32R4: return 640;
    case HTP_FMT_Q5_0_T32R4: return 704;
    case HTP_FMT_Q5_1_T32R4: return 768;
    case HTP_FMT_IQ4_XS_T32R4: return 608;
    case HTP_FMT_F16_T32R4:
    case HTP_FMT_BF16_T32R4: return 2048;
    default: return 1152; /* HTP_FMT_Q6_K_T32R4 */
    }
}
static size_t htp_matrix_bytes_of(uint32_t fmt, uint32_t n, uint32_t k) {
    return (size_t)((n + 31) / 32) * (k / 32) * tile_bytes(fmt);
}
static const char *fmt_name(uint32_t fmt) {
    switch (fmt) {
    case HTP_FMT_Q4_0_T32R4: return "q4_0";
    case HTP_FMT_Q8_0_T32R4: return "q8_0";
    case HTP_FMT_Q4_K_T32R4: return "q4_k";
    case HTP_FMT_MXFP4_T32R4: return "mxfp4";
    case HTP_FMT_Q5_K_T32R4: return "q5_k";
    case HTP_FMT_IQ4_NL_T32R4: return "iq4_nl";
    case HTP_FMT_Q4_1_T32R4: return "q4_1";
    case HTP_FMT_Q5_0_T32R4: return "q5_0";
    case HTP_FMT_Q5_1_T32R4: return "q5_1";
    case HTP_FMT_IQ4_XS_T32R4: return "iq4_xs";
    default: return "q6_k";
    }
}

/* n x k matrix of random tiles. unit: every fp16 scale 1.0 and the integer scales small
 * (Q4_K sub-block scales and mins 0..3, Q6_K half scales -2..2), so that the integer sums of the
 * exact-arithmetic check stay below 2^24. */
static uint8_t *make_weights(uint32_t fmt, uint32_t n, uint32_t k, int unit) {
    const size_t tiles = (size_t)((n + 31) / 32) * (k / 32), tb = tile_bytes(fmt);
    uint8_t *w = malloc(tiles * tb);
    for (size_t i = 0; i < tiles; i++) {
        uint8_t *tile = w + i * tb;
        for (size_t b = 0; b < tb; b++) tile[b] = (uint8_t)rnd();
        for (int r = 0; r < 32; r++) {
            const uint16_t h = unit ? 0x3c00 : awkward_f16();
            memcpy(tile + 2 * r, &h, 2);
            if (is_q45k(fmt)) {
                const uint16_t hm = unit ? 0x3c00 : awkward_f16();
                memcpy(tile + 64 + 2 * r, &hm, 2);
                tile[128 + r] = (uint8_t)(rnd() % (unit ? 4 : 64));
                tile[160 + r] = (uint8_t)(rnd() % (unit ? 4 : 64));
            } else if (is_xs(fmt)) { /* ls - 32: -32..31, or -2..2 */
                tile[64 + r] = (uint8_t)(int8_t)(unit ? (int)(rnd() % 5) - 2 : (int)(rnd() % 64) - 32);
            } else if (fmt == HTP_FMT_Q6_K_T32R4 && unit) {
                tile[64 + 2 * r] = (uint8_t)(int8_t)((int)(rnd() % 5) - 2);
                tile[65 + 2 * r] = (uint8_t)(int8_t)((int)(rnd() % 5) - 2);
            }
        }
        if (fmt == HTP_FMT_Q6_K_T32R4)
            for (size_t b = 128; b < tb; b++) tile[b] = (uint8_t)(int8_t)((int)(rnd() % 64) - 32);
        if (has_m(fmt)) /* (d, m) pairs: unit d = m = 1 */
            for (int h = 0; h < 64; h++) {
                const uint16_t v = unit ? 0x3c00 : awkward_f16();
                memcpy(tile + 2 * h, &v, 2);
            }
        if (fmt == HTP_FMT_MXFP4_T32R4) /* E8M0 exponents: scale 2^(e-128) = 1, or 2^-16..2^8 */
            for (int r = 0; r < 32; r++) tile[r] = (uint8_t)(unit ? 128 : 112 + rnd() % 25);
    }
    return w;
}
static const uint8_t *tile_at(const uint8_t *w, uint32_t fmt, uint32_t k, uint32_t row, uint32_t j) {
    return w + ((size_t)(row / 32) * (k / 32) + j) * tile_bytes(fmt);
}
static double f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_double(h);
}
/* MXFP4: the E2M1 value of each code, doubled (OCP's table), and the block scale's half. */
static const int mx_kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static double mx_half(const uint8_t *tile, uint32_t r) { return ldexp(1.0, (int)tile[r] - 128); }
/* IQ4_NL: llama.cpp's kvalues_iq4nl, the int8 value of each code. */
static const int nl_kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* The stored integer of W[row][col] (Q4_0: nibble - 8; Q4_K: nibble 0..15; MXFP4: the doubled
 * E2M1 value of the code; IQ4_NL, IQ4_XS: kvalues_iq4nl[code]; else int8). */
static int w_q(const uint8_t *w, uint32_t fmt, uint32_t k, uint32_t row, uint32_t col) {
    const uint8_t *tile = tile_at(w, fmt, k, row, col / 32);
    const uint32_t r = row % 32, c = col % 32;
    if (fmt == HTP_FMT_MXFP4_T32R4) {
        const uint8_t v = tile[32 + 128 * ((c % 16) / 4) + 4 * r + c % 4];
        return mx_kv[c < 16 ? (v & 15) : (v >> 4)];
    }
    if (is_aff(fmt)) { /* Q4_1: nibble; Q5_1: + 16 x fifth bit; Q5_0: that - 16 */
        const uint32_t hdr = has_m(fmt) ? 128 : 64, nib = fmt == HTP_FMT_Q4_1_T32R4 ? 128 : hdr + 128;
        const uint8_t v = tile[nib + 128 * ((c % 16) / 4) + 4 * r + c % 4];
        int q = c < 16 ? (v & 15) : (v >> 4);
        if (fmt != HTP_FMT_Q4_1_T32R4) q += 16 * ((tile[hdr + 4 * r + c / 8] >> (c % 8)) & 1);
        return fmt == HTP_FMT_Q5_0_T32R4 ? q - 16 : q;
    }
    if (fmt == HTP_FMT_Q8_0_T32R4) return (int8_t)tile[64 + 128 * (c / 4) + 4 * r + c % 4];
    if (fmt == HTP_FMT_Q6_K_T32R4) return (int8_t)tile[128 + 128 * (c / 4) + 4 * r + c % 4];
    const uint8_t v = tile[(is_q45k(fmt) ? 192 : is_xs(fmt) ? 96 : 64) + 128 * ((c % 16) / 4) + 4 * r + c % 4];
    const int q = c < 16 ? (v & 15) : (v >> 4);
    if (fmt == HTP_FMT_Q5_K_T32R4) /* the fifth bit: bit c of row r's word at 704 + 4r */
        return q + 16 * ((tile[704 + 4 * r + c / 8] >> (c % 8)) & 1);
    if (fmt == HTP_FMT_IQ4_NL_T32R4 || is_xs(fmt)) return nl_kv[q];
    return fmt == HTP_FMT_Q4_K_T32R4 ? q : q - 8;
}
/* W[row][col] in float64; *mag (if not NULL) the sum of its parts' magnitudes. */
static double w_val(const uint8_t *w, uint32_t fmt, uint32_t k, uint32_t row, uint32_t col,
                    double *mag) {
    const uint8_t *tile = tile_at(w, fmt, k, row, col / 32);
    const uint32_t r = row % 32, c = col % 32;
    const double d = fmt == HTP_FMT_MXFP4_T32R4 ? mx_half(tile, r)
                     : has_m(fmt)                ? f16_at(tile + 4 * r)
                                                 : f16_at(tile + 2 * r);
    const int q = w_q(w, fmt, k, row, col);
    double v = d * q, m = fabs(v);
    if (has_m(fmt)) {
        const double mn = f16_at(tile + 4 * r + 2);
        v = d * q + mn;
        m = fabs(d * q) + fabs(mn);
    }
    if (is_q45k(fmt)) {
        const double lo = f16_at(tile + 64 + 2 * r) * tile[160 + r];
        v = d * tile[128 + r] * q - lo;
        m = fabs(d * tile[128 + r] * q) + fabs(lo);
    } else if (fmt == HTP_FMT_Q6_K_T32R4) {
        v = d * (int8_t)tile[64 + 2 * r + (c >= 16)] * q;
        m = fabs(v);
    } else if (is_xs(fmt)) {
        v = d * (int8_t)tile[64 + r] * q;
        m = fabs(v);
    }
    if (mag) *mag = m;
    return v;
}
/* One 32-block of a row against int8 activations a[32]: the exact integer parts, so that the
 * block's value is (s1 * i1 - s2 * i2) * (activation scale), s1 the row's fp16 d and s2 its
 * fp16 dmin (Q4_K; i2 = 0 otherwise). */
static void w_block(const uint8_t *w, uint32_t fmt, uint32_t k, uint32_t row, uint32_t j,
                    const int8_t *a, int64_t *i1, int64_t *i2, double *s1, double *s2) {
    const uint8_t *tile = tile_at(w, fmt, k, row, j);
    const uint32_t r = row % 32;
    int64_t lo = 0, hi = 0, sa = 0;
    for (uint32_t c = 0; c < 32; c++) {
        const int64_t p = (int64_t)w_q(w, fmt, k, row, 32 * j + c) * a[c];
        if (c < 16) lo += p;
        else hi += p;
        sa += a[c];
    }
    *s1 = fmt == HTP_FMT_MXFP4_T32R4 ? mx_half(tile, r) : f16_at(tile + 2 * r), *s2 = 0, *i2 = 0;
    if (has_m(fmt)) { /* d * dot + m * sum(a): s1 * i1 - s2 * i2 with s2 = m, i2 = -sum(a) */
        *s1 = f16_at(tile + 4 * r), *s2 = f16_at(tile + 4 * r + 2);
        *i1 = lo + hi, *i2 = -sa;
    } else if (is_q45k(fmt)) {
        *i1 = tile[128 + r] * (lo + hi), *i2 = tile[160 + r] * sa;
        *s2 = f16_at(tile + 64 + 2 * r);
    } else if (fmt == HTP_FMT_Q6_K_T32R4) {
        *i1 = (int8_t)tile[64 + 2 * r] * lo + (int8_t)tile[65 + 2 * r] * hi;
    } else if (is_xs(fmt)) {
        *i1 = (int8_t)tile[64 + r] * (lo + hi);
    } else {
        *i1 = lo + hi;
    }
}

/* Q8 rows of x[t][k] as the library computes them (its QUANTIZE op, portable table). */
typedef struct {
    uint8_t *raw;
    int8_t *q;
    float *d;
    int32_t *s;
} q8rows;
static int quantize(uint32_t simd, const float *x, uint32_t t, uint32_t k, q8rows *out) {
    const size_t bytes = (size_t)t * (k + k / 4);
    out->raw = malloc(bytes);
    memset(out->raw, 0xa5, bytes);
    out->q = (int8_t *)out->raw;
    out->d = (float *)(out->raw + (size_t)t * k);
    out->s = (int32_t *)(out->raw + (size_t)t * k + (size_t)t * (k / 32) * 4);
    htp_op_desc op;
    memset(&op, 0, sizeof op);
    op.opcode = HTP_OP_QUANTIZE;
    op.p.quantize = (htp_quantize_params){t, k};
    const buf b[2] = {{(void *)x, sizeof(float) * t * k, RD}, {out->raw, bytes, RW}};
    return run(simd, 1, &op, b, 2);
}

/* ---- GEMM ---- */
#define U32 (1.0 / 16777216.0) /* unit roundoff of fp32 */

static int gemm(uint32_t simd, uint32_t threads, uint32_t fmt, uint32_t act, const uint8_t *w,
                uint32_t n, uint32_t k, uint32_t t, const float *x, uint32_t ldx, float *y,
                uint32_t ldy) {
    htp_op_desc op;
    memset(&op, 0, sizeof op);
    op.opcode = HTP_OP_GEMM;
    op.act = act;
    op.p.gemm.format = fmt, op.p.gemm.n = n, op.p.gemm.k = k, op.p.gemm.t = t;
    op.p.gemm.ldx = ldx, op.p.gemm.ldy = ldy;
    poison(y, (size_t)t * ldy);
    const buf b[3] = {{(void *)w, (size_t)((n + 31) / 32) * (k / 32) * tile_bytes(fmt), RD},
                      {(void *)x, sizeof(float) * t * ldx, RD},
                      {y, sizeof(float) * t * ldy, RW}};
    return run(simd, threads, &op, b, 3);
}

/* Every output within the rounding bound of fp32 sums, (terms + e) * u * sum |part|, of the
 * float64 value: Q8 activations sum kb block products (scale * exact integer), fp32 ones k
 * products; e = 2 roundings per term (Q4_0, Q8_0: the dequantized weight is exact), 4 for the
 * K-quants (scale products and the Q4_K min subtracted). */
static void gemm_ref(uint32_t fmt, uint32_t act, const uint8_t *w, uint32_t n, uint32_t k,
                     uint32_t t, const float *x, uint32_t ldx, const q8rows *q, double *ref,
                     double *mag) {
    const uint32_t kb = k / 32;
    for (uint32_t tt = 0; tt < t; tt++)
        for (uint32_t r = 0; r < n; r++) {
            double v = 0, m = 0;
            for (uint32_t j = 0; j < kb; j++) {
                if (act == HTP_ACT_Q8) {
                    int64_t i1, i2;
                    double s1, s2;
                    w_block(w, fmt, k, r, j, q->q + (size_t)tt * k + 32 * j, &i1, &i2, &s1, &s2);
                    const double da = q->d[(size_t)tt * kb + j];
                    const double t1 = s1 * da * (double)i1, t2 = s2 * da * (double)i2;
                    v += t1 - t2, m += fabs(t1) + fabs(t2);
                } else {
                    for (uint32_t c = 32 * j; c < 32 * j + 32; c++) {
                        double wm;
                        const double xv = x[(size_t)tt * ldx + c];
                        v += w_val(w, fmt, k, r, c, &wm) * xv, m += wm * fabs(xv);
                    }
                }
            }
            ref[(size_t)tt * n + r] = v, mag[(size_t)tt * n + r] = m;
        }
}
static int check_gemm_ref(const char *what, const float *y, uint32_t ldy, uint32_t fmt,
                          uint32_t act, uint32_t n, uint32_t k, uint32_t t, const double *ref,
                          const double *mag) {
    const double terms = (act == HTP_ACT_Q8 ? k / 32 : k) + (is_kq(fmt) || has_m(fmt) || is_xs(fmt) ? 4 : 2);
    for (uint32_t tt = 0; tt < t; tt++)
        for (uint32_t r = 0; r < n; r++) {
            const double want = ref[(size_t)tt * n + r], bound = terms * U32 * mag[(size_t)tt * n + r];
            const double got = y[(size_t)tt * ldy + r];
            if (!(fabs(got - want) <= bound + 1e-37)) {
                printf("%s: y[%u][%u] = %.9g, float64 reference %.9g (bound %.3g)\n", what, tt, r,
                       got, want, bound);
                return 1;
            }
        }
    return 0;
}

static int check_gemm(uint32_t fmt, uint32_t act, uint32_t n, uint32_t k, uint32_t t) {
    const uint32_t ldx = k + 5, ldy = n + 3;
    uint8_t *w = make_weights(fmt, n, k, 0);
    float *x = malloc(sizeof(float) * t * ldx), *xc = malloc(sizeof(float) * t * k);
    for (size_t i = 0; i < (size_t)t * ldx; i++) x[i] = frand();
    for (uint32_t tt = 0; tt < t; tt++) memcpy(xc + (size_t)tt * k, x + (size_t)tt * ldx, 4 * k);
    q8rows q = {0};
    int bad = act == HTP_ACT_Q8 && quantize(HTP_SIMD_PORTABLE, xc, t, k, &q);
    double *ref = malloc(sizeof(double) * t * n), *mag = malloc(sizeof(double) * t * n);
    if (!bad) gemm_ref(fmt, act, w, n, k, t, x, ldx, &q, ref, mag);
    float *y[2][2] = {{NULL, NULL}, {NULL, NULL}};
    const uint32_t levels[2] = {HTP_SIMD_PORTABLE, HTP_SIMD_NEON};
    char what[128];
    for (int l = 0; l < 2 && !bad; l++)
        for (uint32_t th = 1; th <= 2 && !bad; th++) {
            float *o = y[l][th - 1] = malloc(sizeof(float) * t * ldy);
            snprintf(what, sizeof what, "gemm %s act=%s %s n=%u k=%u t=%u threads=%u",
                     fmt_name(fmt), act ? "q8" : "f32", l ? "neon" : "portable", n, k, t, th);
            bad |= gemm(levels[l], th, fmt, act, w, n, k, t, x, ldx, o, ldy);
            bad = bad || check_written(what, o, t, n, ldy);
            bad = bad || check_gemm_ref(what, o, ldy, fmt, act, n, k, t, ref, mag);
            if (!bad && th == 2 && memcmp(o, y[l][0], sizeof(float) * t * ldy)) {
                printf("%s: differs from 1 thread\n", what);
                bad = 1;
            }
        }
    if (!bad) printf("gemm %s act=%s n=%u k=%u t=%u: ok\n", fmt_name(fmt), act ? "q8" : "f32", n, k, t);
    for (int l = 0; l < 2; l++) free(y[l][0]), free(y[l][1]);
    free(w), free(x), free(xc), free(q.raw), free(ref), free(mag);
    return bad;
}

/* The NEON table's int8 GEMM gives the portable table's bits (every tile format: exact integer
 * dots, then the portable body's fp32 epilogue): random codes and awkward scales (zero,
 * subnormal, the largest half; MXFP4 also the subnormal E8M0 exponents 0 and 1), activation
 * blocks of +-127, token counts off the kernel's 2-token step, rows off its 16-row halves, odd
 * block counts; the output's margins stay poisoned. */
static int check_gemm_bits(uint32_t fmt, uint32_t n, uint32_t k, uint32_t t) {
    const uint32_t ldy = n + 3;
    uint8_t *w = make_weights(fmt, n, k, 0);
    if (fmt == HTP_FMT_MXFP4_T32R4) /* E8M0 exponents 0, 1 (subnormal scales), 2 in some rows */
        for (size_t tile = 0; tile < (size_t)((n + 31) / 32) * (k / 32); tile++)
            for (uint32_t r = 0; r < 32; r += 5) w[tile * tile_bytes(fmt) + r] = (uint8_t)(r % 3);
    float *x = malloc(sizeof(float) * t * k);
    float *y0 = malloc(sizeof(float) * t * ldy), *y1 = malloc(sizeof(float) * t * ldy);
    for (size_t i = 0; i < (size_t)t * k; i++) x[i] = frand() * (float)(1 + rnd() % 1000);
    for (size_t i = 0; i < (size_t)t * k && i < 2 * (size_t)k; i += 2) x[i] = 5000.0f; /* +-127 */
    char what[128];
    snprintf(what, sizeof what, "gemm %s neon = portable bits n=%u k=%u t=%u", fmt_name(fmt), n, k, t);
    int bad = gemm(HTP_SIMD_PORTABLE, 1, fmt, HTP_ACT_Q8, w, n, k, t, x, k, y0, ldy);
    bad = bad || gemm(HTP_SIMD_NEON, 1, fmt, HTP_ACT_Q8, w, n, k, t, x, k, y1, ldy);
    bad = bad || check_written(what, y1, t, n, ldy);
    for (size_t i = 0; i < (size_t)t * ldy && !bad; i++)
        if (memcmp(&y0[i], &y1[i], 4)) {
            printf("%s: y[%zu][%zu] neon %.9g portable %.9g\n", what, i / ldy, i % ldy, y1[i], y0[i]);
            bad = 1;
        }
    if (!bad) printf("%s: ok\n", what);
    free(w), free(x), free(y0), free(y1);
    return bad;
}

/* Unit fp16 scales, small integer scales and integer activations in [-127, 127] with 127 in
 * every 32-block: the activation scale is exactly 1, every product and sum is an integer below
 * 2^24, so every output must equal the int64 dot product exactly, whatever the order of the
 * fp32 sums. */
static int check_gemm_exact(uint32_t fmt, uint32_t n, uint32_t k, uint32_t t) {
    uint8_t *w = make_weights(fmt, n, k, 1);
    float *x = malloc(sizeof(float) * t * k), *y = malloc(sizeof(float) * t * n);
    for (size_t i = 0; i < (size_t)t * k; i++) x[i] = (float)((int)(rnd() % 255) - 127);
    for (size_t i = 0; i < (size_t)t * k; i += 32) x[i + rnd() % 32] = (rnd() & 1) ? 127.0f : -127.0f;
    float *y0 = malloc(sizeof(float) * t * n);
    int bad = gemm(HTP_SIMD_PORTABLE, 1, fmt, HTP_ACT_Q8, w, n, k, t, x, k, y0, n);
    bad = bad || gemm(HTP_SIMD_NEON, 1, fmt, HTP_ACT_Q8, w, n, k, t, x, k, y, n);
    for (uint32_t tt = 0; tt < t && !bad; tt++)
        for (uint32_t r = 0; r < n && !bad; r++) {
            int64_t dot = 0;
            for (uint32_t j = 0; j < k / 32; j++) {
                int8_t a[32];
                int64_t i1, i2;
                double s1, s2;
                for (int c = 0; c < 32; c++) a[c] = (int8_t)x[(size_t)tt * k + 32 * j + c];
                w_block(w, fmt, k, r, j, a, &i1, &i2, &s1, &s2);
                dot += i1 - i2;
            }
            const float want = (float)dot, got = y[(size_t)tt * n + r];
            if (memcmp(&got, &want, 4) || memcmp(&y0[(size_t)tt * n + r], &want, 4)) {
                printf("gemm %s exact n=%u k=%u t=%u: y[%u][%u] neon %.9g portable %.9g, int dot %lld\n",
                       fmt_name(fmt), n, k, t, tt, r, got, y0[(size_t)tt * n + r], (long long)dot);
                bad = 1;
            }
        }
    if (!bad) printf("gemm %s exact integer sums n=%u k=%u t=%u: ok\n", fmt_name(fmt), n, k, t);
    free(w), free(x), free(y), free(y0);
    return bad;
}

/* The GEMM's other input forms on the NEON table: Q8 rows quantized once (x_q8 = 1) and three
 * matrices sharing one input (n_more = 2); every output bit-identical to the one-matrix GEMM of
 * the fp32 input. */
static int check_gemm_forms(uint32_t fmt, uint32_t k, uint32_t t) {
    const uint32_t n[3] = {33, 64, 7};
    uint8_t *w[3];
    float *y[3], *ys[3], *yq = malloc(sizeof(float) * t * n[0]);
    float *x = malloc(sizeof(float) * t * k);
    for (size_t i = 0; i < (size_t)t * k; i++) x[i] = frand();
    int bad = 0;
    for (int m = 0; m < 3; m++) {
        w[m] = make_weights(fmt, n[m], k, 0);
        y[m] = malloc(sizeof(float) * t * n[m]);
        ys[m] = malloc(sizeof(float) * t * n[m]);
        poison(ys[m], (size_t)t * n[m]);
        bad |= gemm(HTP_SIMD_NEON, 2, fmt, HTP_ACT_Q8, w[m], n[m], k, t, x, k, y[m], n[m]);
    }
    q8rows q = {0};
    bad = bad || quantize(HTP_SIMD_NEON, x, t, k, &q);
    htp_op_desc op;
    memset(&op, 0, sizeof op);
    op.opcode = HTP_OP_GEMM;
    op.act = HTP_ACT_Q8;
    op.p.gemm.format = fmt, op.p.gemm.n = n[0], op.p.gemm.k = k, op.p.gemm.t = t;
    op.p.gemm.ldx = k, op.p.gemm.ldy = n[0];
    op.p.gemm.x_q8 = 1;
    poison(yq, (size_t)t * n[0]);
    const buf bq[3] = {{w[0], htp_matrix_bytes_of(fmt, n[0], k), RD},
                       {q.raw, (size_t)t * (k + k / 4), RD},
                       {yq, sizeof(float) * t * n[0], RW}};
    bad = bad || run(HTP_SIMD_NEON, 2, &op, bq, 3);
    if (!bad && memcmp(yq, y[0], sizeof(float) * t * n[0])) {
        printf("gemm %s from Q8 rows k=%u t=%u: differs from the fp32 input's\n", fmt_name(fmt), k, t);
        bad = 1;
    }
    op.p.gemm.x_q8 = 0;
    op.p.gemm.n_more = 2, op.p.gemm.n_b = n[1], op.p.gemm.n_c = n[2];
    const buf bs[7] = {{w[0], htp_matrix_bytes_of(fmt, n[0], k), RD},
                       {x, sizeof(float) * t * k, RD},
                       {ys[0], sizeof(float) * t * n[0], RW},
                       {w[1], htp_matrix_bytes_of(fmt, n[1], k), RD},
                       {ys[1], sizeof(float) * t * n[1], RW},
                       {w[2], htp_matrix_bytes_of(fmt, n[2], k), RD},
                       {ys[2], sizeof(float) * t * n[2], RW}};
    bad = bad || run(HTP_SIMD_NEON, 2, &op, bs, 7);
    for (int m = 0; m < 3 && !bad; m++)
        if (memcmp(ys[m], y[m], sizeof(float) * t * n[m])) {
            printf("gemm %s shared input, matrix %d k=%u t=%u: differs from its own GEMM\n",
                   fmt_name(fmt), m, k, t);
            bad = 1;
        }
    if (!bad) printf("gemm %s from Q8 rows and shared input k=%u t=%u: bit-identical\n", fmt_name(fmt), k, t);
    for (int m = 0; m < 3; m++) free(w[m]), free(y[m]), free(ys[m]);
    free(yq), free(x), free(q.raw);
    return bad;
}

/* ---- expert op ---- */
static double rel_l2(const double *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* y[T][d] += sum over routes of weight * down(act(gate x, up x)), E experts in scattered
 * slots (stride past the matrix), one unrouted token and one expert without routes; act is the
 * op's `glu` (SwiGLU, ReGLU, SwiGLU-OAI with alpha 1.702 and limit 7), and with `bias` each
 * expert's f32 rows are added to gate and up before it and to down's output. */
static int check_expert(uint32_t fmt, uint32_t act, uint32_t d, uint32_t ff, uint32_t T,
                        uint32_t capacity, uint32_t glu, int bias) {
    enum { E = 4 };
    const int32_t slot_of[E] = {2, -1, 0, 1}; /* expert 1 is not resident and never routed */
    const size_t bytes[3] = {(size_t)(ff / 32) * (d / 32) * tile_bytes(fmt),
                             (size_t)(ff / 32) * (d / 32) * tile_bytes(fmt),
                             (size_t)(d / 32) * (ff / 32) * tile_bytes(fmt)};
    uint8_t *plane[3];
    uint64_t stride[3];
    for (int j = 0; j < 3; j++) {
        stride[j] = bytes[j] + 4096;
        plane[j] = malloc(3 * stride[j]);
        for (int s = 0; s < 3; s++) {
            uint8_t *m = j < 2 ? make_weights(fmt, ff, d, 0) : make_weights(fmt, d, ff, 0);
            memcpy(plane[j] + s * stride[j], m, bytes[j]);
            memset(plane[j] + s * stride[j] + bytes[j], 0xee, 4096);
            free(m);
        }
    }
    float *x = malloc(sizeof(float) * T * d);
    for (size_t i = 0; i < (size_t)T * d; i++) x[i] = frand();
    const uint32_t R = 2 * (T - 1); /* token T-1 is never routed */
    int32_t *tok = malloc(4 * R), *ex = malloc(4 * R);
    float *wt = malloc(4 * R);
    for (uint32_t r = 0; r < R; r++) {
        tok[r] = (int32_t)(r / 2);
        ex[r] = (r % 2) ? 3 : (r == 0 || rnd() % 2) ? 2 : 0;
        wt[r] = 0.25f + (float)(rnd() % 100) / 100.0f;
    }
    float *y0 = malloc(sizeof(float) * T * d), *y[2];
    for (size_t i = 0; i < (size_t)T * d; i++) y0[i] = frand();
    /* gate [E][ff], up [E][ff], down [E][d]: large enough to reach SwiGLU-OAI's clamps */
    const size_t nbias = (size_t)E * (2 * ff + d);
    float *bb = malloc(sizeof(float) * nbias);
    for (size_t i = 0; i < nbias; i++) bb[i] = 8.0f * frand();
    const float alpha = 1.702f, limit = 7.0f;
    const uint32_t levels[2] = {HTP_SIMD_PORTABLE, HTP_SIMD_NEON};
    int bad = 0;
    for (int l = 0; l < 2; l++) {
        y[l] = malloc(sizeof(float) * T * d);
        memcpy(y[l], y0, sizeof(float) * T * d);
        htp_op_desc op;
        memset(&op, 0, sizeof op);
        op.opcode = HTP_OP_EXPERT;
        op.act = act;
        op.p.expert.d_model = d, op.p.expert.d_ff = ff, op.p.expert.n_tokens = T;
        op.p.expert.n_routes = R, op.p.expert.n_experts = E, op.p.expert.capacity = capacity;
        op.p.expert.format = fmt;
        for (int j = 0; j < 3; j++) op.p.expert.slot_stride[j] = stride[j];
        op.p.expert.glu = glu;
        if (glu == HTP_GLU_SWIGLU_OAI) op.p.expert.glu_alpha = alpha, op.p.expert.glu_limit = limit;
        if (bias) {
            op.p.expert.has_bias = 1;
            op.p.expert.bias_up = 4 * (uint64_t)E * ff, op.p.expert.bias_down = 8 * (uint64_t)E * ff;
        }
        const buf b[10] = {{x, sizeof(float) * T * d, RD},  {tok, 4 * R, RD},
                           {ex, 4 * R, RD},                 {wt, 4 * R, RD},
                           {(void *)slot_of, 4 * E, RD},    {plane[0], 3 * stride[0], RD},
                           {plane[1], 3 * stride[1], RD},   {plane[2], 3 * stride[2], RD},
                           {y[l], sizeof(float) * T * d, RW}, {bb, sizeof(float) * nbias, RD}};
        bad |= run(levels[l], 2, &op, b, bias ? 10 : 9);
    }
    /* float64 reference */
    double *ref = malloc(sizeof(double) * T * d), *h = malloc(sizeof(double) * ff);
    for (size_t i = 0; i < (size_t)T * d; i++) ref[i] = y0[i];
    for (uint32_t r = 0; r < R; r++) {
        const size_t s = (size_t)slot_of[ex[r]], e = (size_t)ex[r];
        const float *xr = x + (size_t)tok[r] * d;
        for (uint32_t f = 0; f < ff; f++) {
            double g = bias ? bb[e * ff + f] : 0, u = bias ? bb[(E + e) * ff + f] : 0;
            for (uint32_t c = 0; c < d; c++) {
                g += w_val(plane[0] + s * stride[0], fmt, d, f, c, NULL) * xr[c];
                u += w_val(plane[1] + s * stride[1], fmt, d, f, c, NULL) * xr[c];
            }
            if (glu == HTP_GLU_REGLU) {
                h[f] = (g > 0 ? g : 0) * u;
            } else if (glu == HTP_GLU_SWIGLU_OAI) {
                g = g < limit ? g : limit;
                u = u < -limit ? -limit : (u > limit ? limit : u);
                h[f] = g / (1.0 + exp(-alpha * g)) * (u + 1);
            } else {
                h[f] = g / (1.0 + exp(-g)) * u;
            }
        }
        for (uint32_t o = 0; o < d; o++) {
            double acc = bias ? bb[2 * (size_t)E * ff + e * d + o] : 0;
            for (uint32_t c = 0; c < ff; c++)
                acc += w_val(plane[2] + s * stride[2], fmt, ff, o, c, NULL) * h[c];
            ref[(size_t)tok[r] * d + o] += wt[r] * acc;
        }
    }
    const char *an = act ? "q8" : "f32";
    for (int l = 0; l < 2 && !bad; l++) {
        if (memcmp(y[l] + (size_t)(T - 1) * d, y0 + (size_t)(T - 1) * d, sizeof(float) * d)) {
            printf("expert %s act=%s: the unrouted token's row changed\n", fmt_name(fmt), an);
            bad = 1;
        }
        for (size_t i = 0; i < (size_t)T * d && !bad; i++)
            if (!isfinite(y[l][i])) {
                printf("expert %s act=%s: y[%zu] not finite\n", fmt_name(fmt), an, i);
                bad = 1;
            }
    }
    /* the op's own contribution, y - y0, in float64: fp32 products of both tables against
     * the reference, Q8 products of the NEON table against the portable one */
    double *got = malloc(sizeof(double) * T * d), *want = malloc(sizeof(double) * T * d);
    for (int l = act == HTP_ACT_F32 ? 0 : 1; l < 2 && !bad; l++) {
        for (size_t i = 0; i < (size_t)T * d; i++) {
            got[i] = (double)y[l][i] - y0[i];
            want[i] = (act == HTP_ACT_F32 ? ref[i] : (double)y[0][i]) - y0[i];
        }
        const double e = rel_l2(got, want, (size_t)T * d), tol = act == HTP_ACT_F32 ? 1e-5 : 1e-6;
        printf("expert %s act=%s %s d=%u ff=%u T=%u capacity=%u glu=%u bias=%d: rel %.3g vs %s\n",
               fmt_name(fmt), an, l ? "neon" : "portable", d, ff, T, capacity, glu, bias, e,
               act == HTP_ACT_F32 ? "float64" : "portable");
        if (!(e <= tol)) bad = 1;
    }
    free(got), free(want);
    for (int j = 0; j < 3; j++) free(plane[j]);
    free(x), free(tok), free(ex), free(wt), free(y0), free(y[0]), free(y[1]), free(ref), free(h);
    free(bb);
    return bad;
}

/* ---- the remaining table entries: NEON table vs portable table ---- */
static double rel_f(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* Run op on both tables (out = the last buffer, poisoned first): written part finite, margin
 * (columns n..ld of each of rows rows) still poisoned, NEON within tol of portable (relative L2
 * per row; tol 0: the same bits, every element), and both within reftol (relative L2; 1e-5 is
 * the package's fp32 op tolerance) of the float64 reference ref[rows][n]. */
static int both_tol(const char *what, htp_op_desc *op, buf *b, uint32_t nb, size_t rows, size_t n,
                    size_t ld, double tol, double reftol, const double *ref) {
    float *out = b[nb - 1].p;
    const size_t cnt = rows * ld;
    float *o[2] = {malloc(4 * cnt), malloc(4 * cnt)};
    const uint32_t levels[2] = {HTP_SIMD_PORTABLE, HTP_SIMD_NEON};
    int bad = 0;
    for (int l = 0; l < 2 && !bad; l++) {
        poison(out, cnt);
        htp_op_desc c = *op;
        bad = run(levels[l], 2, &c, b, nb) || check_written(what, out, rows, n, ld);
        memcpy(o[l], out, 4 * cnt);
    }
    if (!bad) {
        double e = 0, er[2];
        for (size_t r = 0; r < rows; r++) e = fmax(e, rel_f(o[1] + r * ld, o[0] + r * ld, n));
        for (int l = 0; l < 2; l++) {
            double num = 0, den = 0;
            for (size_t r = 0; r < rows; r++)
                for (size_t c = 0; c < n; c++) {
                    const double dlt = (double)o[l][r * ld + c] - ref[r * n + c];
                    num += dlt * dlt, den += ref[r * n + c] * ref[r * n + c];
                }
            er[l] = sqrt(num / (den > 0 ? den : 1));
        }
        if (tol == 0) {
            size_t diff = 0, first = 0;
            for (size_t i = cnt; i-- > 0;)
                if (memcmp(o[1] + i, o[0] + i, 4)) diff++, first = i;
            if (diff) {
                uint32_t a, p;
                memcpy(&a, o[1] + first, 4), memcpy(&p, o[0] + first, 4);
                printf("%s: differs from portable in %zu elements (first [%zu][%zu]: neon %08x, "
                       "portable %08x)\n", what, diff, first / ld, first % ld, a, p);
            }
            printf("%s: %s portable; vs float64: neon %.3g, portable %.3g\n", what,
                   diff ? "NOT the bits of" : "bit-identical to", er[1], er[0]);
            bad = diff != 0;
        } else {
            printf("%s: rel %.3g vs portable; vs float64: neon %.3g, portable %.3g\n", what, e,
                   er[1], er[0]);
            bad = !(e <= tol);
        }
        bad = bad || !(er[0] <= reftol) || !(er[1] <= reftol);
    }
    free(o[0]), free(o[1]);
    return bad;
}
static int both(const char *what, htp_op_desc *op, buf *b, uint32_t nb, size_t rows, size_t n,
                size_t ld, double tol, const double *ref) {
    return both_tol(what, op, b, nb, rows, n, ld, tol, 1e-5, ref);
}

/* Attention on the NEON table against the portable table, bit for bit, with fp32, bf16 and
 * bf16-pv products (bf16: the native BFMLALT / BFMLALB task where the CPU has FEAT_BF16, else
 * the portable emulation it must reproduce; bf16-pv: the emulation), and each within the
 * products' tolerance of a float64 reference (fp32 1e-5; bf16 1e-2, its roundings of q·scale,
 * K, V and the weights are ~3e-3; bf16-pv 5e-3, V and the weights only):
 * causal GQA with awkward lengths, not causal, MLA's 192/128 head dims with a sliding window
 * and sinks, head dims that are not multiples of 16 (the generic body), dk = dv = 128 with
 * several key blocks, values of magnitude ~2^-125 whose products and sums fall below FLT_MIN
 * (bf16 flushes them to zero, as vdpbf16ps: checked against the portable bits only), and one
 * sum just under FLT_MIN that rounds up to it (kept). */
static int check_attention(void) {
    static const char *const products_name[] = {"f32", "bf16", "bf16-pv"};
    int bad = 0;
    const uint32_t shapes[][9] = {{67, 4, 2, 64, 64, 1, 0, 0, 0},
                                  {33, 2, 1, 48, 32, 0, 0, 0, 0},
                                  {130, 2, 2, 32, 32, 1, 0, 0, 0},
                                  {150, 4, 2, 192, 128, 1, 29, 1, 0},
                                  {45, 3, 1, 40, 24, 1, 0, 1, 0},
                                  {200, 2, 1, 128, 128, 1, 0, 0, 0},
                                  {90, 2, 1, 64, 64, 1, 0, 0, 1}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (uint32_t products = HTP_PRODUCTS_F32; products <= HTP_PRODUCTS_BF16_PV; products++) {
            const uint32_t t = shapes[i][0], hq = shapes[i][1], hkv = shapes[i][2];
            const uint32_t dk = shapes[i][3], dv = shapes[i][4], window = shapes[i][6];
            const uint32_t has_sinks = shapes[i][7], tiny = shapes[i][8];
            const float vs = tiny ? ldexpf(1.0f, -125) : 1.0f;
            float *q = malloc(4 * t * hq * dk), *k = malloc(4 * t * hkv * dk),
                  *v = malloc(4 * t * hkv * dv), *o = malloc(4 * t * hq * dv), *sk = malloc(4 * hq);
            for (uint32_t h = 0; h < hq; h++) sk[h] = 4 * frand();
            for (size_t j = 0; j < (size_t)t * hq * dk; j++) q[j] = frand();
            for (size_t j = 0; j < (size_t)t * hkv * dk; j++) k[j] = frand();
            for (size_t j = 0; j < (size_t)t * hkv * dv; j++) v[j] = vs * frand();
            htp_op_desc op;
            memset(&op, 0, sizeof op);
            op.opcode = HTP_OP_ATTENTION;
            op.p.attention = (htp_attention_params){t, hq, hkv, dk, dv, shapes[i][5],
                                                    1.0f / sqrtf((float)dk), products, 0, window, has_sinks};
            buf b[5] = {{q, 4 * t * hq * dk, RD}, {k, 4 * t * hkv * dk, RD}, {v, 4 * t * hkv * dv, RD},
                        {sk, 4 * hq, RD}, {o, 4 * t * hq * dv, RW}};
            if (!has_sinks) b[3] = b[4];
            double *ref = malloc(sizeof(double) * t * hq * dv), *p = malloc(sizeof(double) * t);
            const double scale = op.p.attention.scale;
            for (uint32_t qi = 0; qi < t; qi++)
                for (uint32_t h = 0; h < hq; h++) {
                    const uint32_t g = h / (hq / hkv), end = shapes[i][5] ? qi + 1 : t;
                    const uint32_t begin = window && qi + 1 > window ? qi + 1 - window : 0;
                    double mx = has_sinks ? sk[h] : -INFINITY, sum = 0;
                    for (uint32_t j = begin; j < end; j++) {
                        double sc = 0;
                        for (uint32_t c = 0; c < dk; c++)
                            sc += (double)q[((size_t)qi * hq + h) * dk + c] *
                                  k[((size_t)j * hkv + g) * dk + c];
                        p[j] = sc * scale;
                        mx = fmax(mx, p[j]);
                    }
                    if (has_sinks) sum = exp(sk[h] - mx); /* joins the denominator only */
                    for (uint32_t j = begin; j < end; j++) sum += (p[j] = exp(p[j] - mx));
                    for (uint32_t c = 0; c < dv; c++) {
                        double acc = 0;
                        for (uint32_t j = begin; j < end; j++) acc += p[j] * v[((size_t)j * hkv + g) * dv + c];
                        ref[((size_t)qi * hq + h) * dv + c] = acc / sum;
                    }
                }
            char what[160];
            snprintf(what, sizeof what,
                     "attention products=%s t=%u hq=%u hkv=%u dk=%u dv=%u causal=%u window=%u sinks=%u%s",
                     products_name[products], t, hq, hkv, dk, dv, shapes[i][5], window, has_sinks,
                     tiny ? " v~2^-125" : "");
            /* values near FLT_MIN: the bf16 flushes make the float64 reference meaningless */
            const double reftol = tiny && products ? INFINITY : (const double[]){1e-5, 1e-2, 5e-3}[products];
            bad |= both_tol(what, &op, b, has_sinks ? 5 : 4, t, hq * dv, hq * dv, 0, reftol, ref);
            free(q), free(k), free(v), free(o), free(sk), free(ref), free(p);
        }
    /* A sum whose exact value lies just under FLT_MIN and rounds up to it: query 1 sees key 1
     * (score 0, weight 1, value 2^-126) and key 0 (score -69.5, weight ~2^-100.25, value
     * -2^-51), so with bf16 products o = fma(1, 2^-126, 0) (the odd key first) then
     * fma(~2^-100.25, -2^-51, 2^-126) = 2^-126 - ~2^-151.25 exactly, which rounds to 2^-126:
     * kept by the portable flush (vdpbf16ps's "results below FLT_MIN"), but zero under Arm's
     * FPCR.FZ, which flushes on the value before rounding. */
    for (uint32_t products = HTP_PRODUCTS_F32; products <= HTP_PRODUCTS_BF16_PV; products++) {
        const uint32_t t = 2, d = 16;
        float q[2 * 16] = {0}, k[2 * 16] = {0}, v[2 * 16], o[2 * 16];
        q[d] = 1.0f, k[0] = -69.5f;
        for (uint32_t c = 0; c < d; c++) v[c] = -ldexpf(1.0f, -51), v[d + c] = ldexpf(1.0f, -126);
        htp_op_desc op;
        memset(&op, 0, sizeof op);
        op.opcode = HTP_OP_ATTENTION;
        op.p.attention = (htp_attention_params){t, 1, 1, d, d, 1, 1.0f, products, 0, 0, 0};
        buf b[4] = {{q, sizeof q, RD}, {k, sizeof k, RD}, {v, sizeof v, RD}, {o, sizeof o, RW}};
        double ref[2 * 16];
        const double p0 = exp(-69.5);
        for (uint32_t c = 0; c < d; c++)
            ref[c] = v[c], ref[d + c] = (p0 * v[c] + v[d + c]) / (1.0 + p0);
        char what[96];
        snprintf(what, sizeof what, "attention products=%s t=2 dk=dv=16 a sum rounding up to FLT_MIN",
                 products_name[products]);
        bad |= both_tol(what, &op, b, 4, t, d, d, 0, (const double[]){1e-5, 1e-2, 5e-3}[products], ref);
        if (o[d] != ldexpf(1.0f, -126)) { /* the NEON table's, the last run */
            printf("%s: o[1][0] = %a, not 0x1p-126\n", what, o[d]);
            bad = 1;
        }
    }
    return bad;
}

static int check_others(void) {
    int bad = 0;
    { /* Q8 quantization: integer rows, bit-identical */
        const uint32_t t = 5, k = 160;
        float *x = malloc(sizeof(float) * t * k);
        for (size_t i = 0; i < (size_t)t * k; i++) x[i] = frand() * (float)(1 + i % 7);
        for (uint32_t i = 0; i < k; i++) x[2 * k + i] = 0.0f; /* an all-zero row */
        q8rows a = {0}, b = {0};
        bad |= quantize(HTP_SIMD_PORTABLE, x, t, k, &a) || quantize(HTP_SIMD_NEON, x, t, k, &b);
        if (!bad && memcmp(a.raw, b.raw, (size_t)t * (k + k / 4))) bad = 1;
        printf("quantize t=%u d=%u: %s\n", t, k, bad ? "differs from portable" : "bit-identical");
        free(x), free(a.raw), free(b.raw);
    }
    bad |= check_attention();
    { /* SwiGLU over an odd length */
        const uint64_t n = 1001;
        float *g = malloc(4 * n), *u = malloc(4 * n), *o = malloc(4 * n);
        for (uint64_t i = 0; i < n; i++) g[i] = 8 * frand(), u[i] = frand();
        htp_op_desc op;
        memset(&op, 0, sizeof op);
        op.opcode = HTP_OP_SWIGLU;
        op.p.eltwise.n = n;
        buf b[3] = {{g, 4 * n, RD}, {u, 4 * n, RD}, {o, 4 * n, RW}};
        double *ref = malloc(sizeof(double) * n);
        for (uint64_t i = 0; i < n; i++) ref[i] = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        bad |= both("swiglu n=1001", &op, b, 3, 1, n, n, 0, ref); /* the portable bits */
        /* SwiGLU-OAI (gpt-oss's), both clamps reached (limit 3) */
        for (uint64_t i = 0; i < n; i++) u[i] = 6 * frand();
        op.p.eltwise.glu = HTP_GLU_SWIGLU_OAI;
        op.p.eltwise.alpha = 1.702f, op.p.eltwise.limit = 3.0f;
        for (uint64_t i = 0; i < n; i++) {
            const double x = fmin((double)g[i], 3.0), v = fmin(fmax((double)u[i], -3.0), 3.0);
            ref[i] = x / (1.0 + exp(-1.702 * x)) * (v + 1);
        }
        bad |= both("swiglu_oai n=1001", &op, b, 3, 1, n, n, 0, ref);
        free(g), free(u), free(o), free(ref);
    }
    { /* fp32 matmul: every column block width */
        const uint32_t shapes[][3] = {{3, 37, 5}, {7, 64, 32}, {2, 100, 61}};
        for (size_t i = 0; i < 3; i++) {
            const uint32_t t = shapes[i][0], k = shapes[i][1], n = shapes[i][2];
            float *x = malloc(4 * t * k), *w = malloc(4 * k * n), *y = malloc(4 * t * n);
            for (size_t j = 0; j < (size_t)t * k; j++) x[j] = frand();
            for (size_t j = 0; j < (size_t)k * n; j++) w[j] = frand();
            htp_op_desc op;
            memset(&op, 0, sizeof op);
            op.opcode = HTP_OP_MATMUL_F32;
            op.p.matmul = (htp_matmul_params){t, k, n};
            buf b[3] = {{x, 4 * t * k, RD}, {w, 4 * k * n, RD}, {y, 4 * t * n, RW}};
            char what[64];
            snprintf(what, sizeof what, "matmul_f32 t=%u k=%u n=%u", t, k, n);
            double *ref = calloc((size_t)t * n, sizeof(double));
            for (uint32_t r = 0; r < t; r++)
                for (uint32_t c = 0; c < k; c++)
                    for (uint32_t j = 0; j < n; j++)
                        ref[(size_t)r * n + j] += (double)x[(size_t)r * k + c] * w[(size_t)c * n + j];
            bad |= both(what, &op, b, 3, t, n, n, 1e-6, ref);
            free(x), free(w), free(y), free(ref);
        }
    }
    return bad;
}

/* One Q8-activation GEMM of one 32-row strip: the traced workload of tools/neon_instr_mix.py. */
static int strip(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s strip q4_0|q8_0|q4_k|q5_k|q6_k|mxfp4|iq4_nl|q4_1|q5_0|q5_1|iq4_xs KB NT neon|portable\n", argv[0]);
        return 64;
    }
    uint32_t fmt = 0;
    for (uint32_t f = HTP_FMT_Q4_0_T32R4; f <= HTP_FMT_IQ4_XS_T32R4; f++)
        if (f != HTP_FMT_F16 && f != HTP_FMT_F32 && !strcmp(argv[2], fmt_name(f))) fmt = f;
    if (!fmt) {
        fprintf(stderr, "unknown tile format %s (q4_0, q8_0, q4_k, q5_k, q6_k, mxfp4, iq4_nl, q4_1, q5_0, q5_1, iq4_xs)\n", argv[2]);
        return 64;
    }
    const uint32_t kb = (uint32_t)atoi(argv[3]), nt = (uint32_t)atoi(argv[4]);
    const uint32_t simd = !strcmp(argv[5], "portable") ? HTP_SIMD_PORTABLE : HTP_SIMD_NEON;
    if (kb < 1 || nt < 1) {
        fprintf(stderr, "KB and NT must be positive\n");
        return 64;
    }
    uint8_t *w = make_weights(fmt, 32, 32 * kb, 0);
    float *x = malloc(sizeof(float) * nt * 32 * kb), *y = malloc(sizeof(float) * nt * 32);
    for (size_t i = 0; i < (size_t)nt * 32 * kb; i++) x[i] = frand();
    const int bad = gemm(simd, 1, fmt, HTP_ACT_Q8, w, 32, 32 * kb, nt, x, 32 * kb, y, 32);
    free(w), free(x), free(y);
    return bad;
}

/* One (head, query block) attention task: one head, 64 queries (one query block) attending
 * causally after NKB - 1 blocks of 64 context keys (NKB key blocks), dk = dv = DK, fp32 or bf16
 * products, one thread: the traced workload of tools/neon_instr_mix.py. */
static int attention_task(int argc, char **argv) {
    const uint32_t dk = argc == 6 ? (uint32_t)atoi(argv[3]) : 0, nkb = argc == 6 ? (uint32_t)atoi(argv[4]) : 0;
    if (argc != 6 || (strcmp(argv[2], "f32") && strcmp(argv[2], "bf16")) || dk < 16 || dk % 16 ||
        nkb < 1) {
        fprintf(stderr, "usage: %s attention-task f32|bf16 DK NKB neon|portable (DK a multiple of "
                        "16, NKB >= 1)\n", argv[0]);
        return 64;
    }
    const uint32_t t = 64, ctx = 64 * (nkb - 1), rows = ctx + t;
    const uint32_t simd = !strcmp(argv[5], "portable") ? HTP_SIMD_PORTABLE : HTP_SIMD_NEON;
    float *q = malloc(4 * (size_t)t * dk), *k = malloc(4 * (size_t)rows * dk),
          *v = malloc(4 * (size_t)rows * dk), *o = malloc(4 * (size_t)t * dk);
    for (size_t j = 0; j < (size_t)t * dk; j++) q[j] = frand();
    for (size_t j = 0; j < (size_t)rows * dk; j++) k[j] = frand(), v[j] = frand();
    htp_op_desc op;
    memset(&op, 0, sizeof op);
    op.opcode = HTP_OP_ATTENTION;
    op.p.attention = (htp_attention_params){t, 1, 1, dk, dk, 1, 1.0f / sqrtf((float)dk),
                                            strcmp(argv[2], "bf16") ? HTP_PRODUCTS_F32 : HTP_PRODUCTS_BF16,
                                            ctx, 0, 0};
    buf b[4] = {{q, 4 * (size_t)t * dk, RD}, {k, 4 * (size_t)rows * dk, RD},
                {v, 4 * (size_t)rows * dk, RD}, {o, 4 * (size_t)t * dk, RW}};
    const int bad = run(simd, 1, &op, b, 4);
    free(q), free(k), free(v), free(o);
    return bad;
}

/* F16 / BF16 tiles (2048 B, no header; the value of row r, column c at 128 * (c / 2) + 4r +
 * 2 * (c % 2)): random values of both signs around 2^-4..2^4 with zeros and subnormals mixed
 * in. Under either act the products are fp32 (the same bits), within fp32 rounding of the
 * float64 value, NEON equal to portable, 2 threads to 1; multiplied by the identity they are
 * the values themselves, bit for bit (exact conversion). */
static double f16t_value(uint32_t fmt, uint16_t h) {
    if (fmt == HTP_FMT_F16_T32R4) return f16_to_double(h);
    const int e = (h >> 7) & 255, m = h & 127;
    const double v = e ? ldexp(128 + m, e - 134) : ldexp(m, -133);
    return (h & 0x8000) ? -v : v;
}
static uint16_t f16t_random(uint32_t fmt) {
    const uint16_t sign = (uint16_t)((rnd() & 1) << 15);
    const int f16 = fmt == HTP_FMT_F16_T32R4;
    switch (rnd() % 16) {
    case 0: return sign;
    case 1: return (uint16_t)(sign | (1 + rnd() % (f16 ? 0x3ff : 0x7f))); /* subnormal */
    default:
        return f16 ? (uint16_t)(sign | ((11 + rnd() % 8) << 10) | (rnd() & 0x3ff))
                   : (uint16_t)(sign | ((123 + rnd() % 8) << 7) | (rnd() & 0x7f));
    }
}
static int check_float_tiles(uint32_t fmt, uint32_t n, uint32_t k, uint32_t t) {
    const char *name = fmt == HTP_FMT_F16_T32R4 ? "f16" : "bf16";
    const size_t bytes = (size_t)((n + 31) / 32) * (k / 32) * 2048;
    uint8_t *w = calloc(bytes, 1);
    double *val = malloc(sizeof(double) * n * k);
    for (uint32_t row = 0; row < n; row++)
        for (uint32_t col = 0; col < k; col++) {
            const uint16_t h = f16t_random(fmt);
            const size_t tile = ((size_t)(row / 32) * (k / 32) + col / 32) * 2048;
            const uint32_t r = row % 32, c = col % 32;
            memcpy(w + tile + 128 * (c / 2) + 4 * r + 2 * (c % 2), &h, 2);
            val[(size_t)row * k + col] = f16t_value(fmt, h);
        }
    const uint32_t ldx = k + 3, ldy = n + 2;
    float *x = malloc(sizeof(float) * t * ldx), *y[2][2][2];
    for (size_t i = 0; i < (size_t)t * ldx; i++) x[i] = frand();
    const uint32_t levels[2] = {HTP_SIMD_PORTABLE, HTP_SIMD_NEON};
    char what[128];
    int bad = 0;
    for (int l = 0; l < 2; l++)
        for (uint32_t act = 0; act < 2; act++)
            for (uint32_t th = 1; th <= 2; th++) {
                float *o = y[l][act][th - 1] = malloc(sizeof(float) * t * ldy);
                snprintf(what, sizeof what, "gemm %s act=%s %s n=%u k=%u t=%u threads=%u", name,
                         act ? "q8" : "f32", l ? "neon" : "portable", n, k, t, th);
                bad = bad || gemm(levels[l], th, fmt, act, w, n, k, t, x, ldx, o, ldy);
                bad = bad || check_written(what, o, t, n, ldy);
                for (uint32_t tt = 0; tt < t && !bad; tt++)
                    for (uint32_t r = 0; r < n && !bad; r++) {
                        double v = 0, m = 0;
                        for (uint32_t c = 0; c < k; c++) {
                            const double p = val[(size_t)r * k + c] * x[(size_t)tt * ldx + c];
                            v += p, m += fabs(p);
                        }
                        const double got = o[(size_t)tt * ldy + r];
                        if (!(fabs(got - v) <= (k + 2) * U32 * m + 1e-37)) {
                            printf("%s: y[%u][%u] = %.9g, float64 reference %.9g\n", what, tt, r, got, v);
                            bad = 1;
                        }
                    }
                if (!bad && (act || th == 2 || l) &&
                    memcmp(o, y[0][0][0], sizeof(float) * t * ldy)) {
                    printf("%s: differs from portable act=f32 with 1 thread\n", what);
                    bad = 1;
                }
            }
    /* the identity: y[c][r] = W[r][c] exactly (-0.0 summed from +0.0 reads +0.0) */
    float *eye = calloc((size_t)k * k, sizeof(float)), *yi = malloc(sizeof(float) * k * n);
    for (uint32_t c = 0; c < k; c++) eye[(size_t)c * k + c] = 1.0f;
    for (int l = 0; l < 2 && !bad; l++) {
        bad = gemm(levels[l], 2, fmt, HTP_ACT_F32, w, n, k, k, eye, k, yi, n);
        for (uint32_t c = 0; c < k && !bad; c++)
            for (uint32_t r = 0; r < n && !bad; r++)
                if (yi[(size_t)c * n + r] != (float)val[(size_t)r * k + c]) {
                    printf("gemm %s identity %s: W[%u][%u] = %.9g, read %.9g\n", name,
                           l ? "neon" : "portable", r, c, val[(size_t)r * k + c], yi[(size_t)c * n + r]);
                    bad = 1;
                }
    }
    if (!bad) printf("gemm %s n=%u k=%u t=%u: ok\n", name, n, k, t);
    for (int l = 0; l < 2; l++)
        for (int a = 0; a < 2; a++) free(y[l][a][0]), free(y[l][a][1]);
    free(w), free(val), free(x), free(eye), free(yi);
    return bad;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "strip")) return strip(argc, argv);
    if (argc > 1 && !strcmp(argv[1], "attention-task")) return attention_task(argc, argv);
    const int first = argc > 1 && !strcmp(argv[1], "--first-failure");
    const int att_only = argc > 1 && !strcmp(argv[1], "attention");
    if (argc > 2 || (argc > 1 && !first && !att_only)) {
        fprintf(stderr, "usage: %s [--first-failure | attention] | strip FMT KB NT SIMD | "
                        "attention-task f32|bf16 DK NKB SIMD\n", argv[0]);
        return 64;
    }
    if (htp_simd_best() != HTP_SIMD_NEON) {
        printf("NEON dot-product level not available (best = %u)\n", htp_simd_best());
        return 2;
    }
    int bad = 0;
    { /* bf16 attention products: native where the CPU has FEAT_BF16, as the library decides */
        const int hw = (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0;
        printf("bf16 attention products: %s\n",
               hw ? "native (FEAT_BF16: BFMLALT / BFMLALB)" : "emulated (no FEAT_BF16)");
        if (htp_cpu_bf16() != hw) {
            printf("the library's FEAT_BF16 test says %d, HWCAP2_BF16 %d\n", htp_cpu_bf16(), hw);
            bad = 1;
        }
    }
    { /* int8 products: SMMLA on token pairs where the CPU has FEAT_I8MM, SDOT otherwise */
        const int hw = (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
        printf("int8 products: %s\n", hw ? "SMMLA on token pairs (FEAT_I8MM)" : "SDOT (no FEAT_I8MM)");
        if (htp_neon_i8mm_supported() != hw) {
            printf("the library's FEAT_I8MM test says %d, HWCAP2_I8MM %d\n",
                   htp_neon_i8mm_supported(), hw);
            bad = 1;
        }
    }
    if (att_only) {
        bad |= check_attention();
        printf(bad ? "FAILED\n" : "OK\n");
        return bad ? 1 : 0;
    }
#define CHECK(x)                                                                                  \
    do {                                                                                          \
        bad |= (x);                                                                               \
        if (bad && first) goto done;                                                              \
    } while (0)
    /* n: one row, rows 16 | 17 of the last strip (the kernel's 16-row halves), 33, 100;
     * t across the NEON kernel's 2-token and the portable kernel's 64-token blocks */
    const uint32_t shapes[][3] = {{1, 32, 1},  {48, 64, 3}, {49, 96, 2},   {33, 64, 4},
                                  {100, 96, 7}, {64, 256, 17}, {17, 512, 65}, {200, 160, 5}};
    const uint32_t fmts[11] = {HTP_FMT_Q4_0_T32R4, HTP_FMT_Q8_0_T32R4, HTP_FMT_Q4_K_T32R4,
                               HTP_FMT_Q6_K_T32R4, HTP_FMT_MXFP4_T32R4, HTP_FMT_Q5_K_T32R4,
                               HTP_FMT_IQ4_NL_T32R4, HTP_FMT_Q4_1_T32R4, HTP_FMT_Q5_0_T32R4,
                               HTP_FMT_Q5_1_T32R4, HTP_FMT_IQ4_XS_T32R4};
    for (int f = 0; f < 11; f++) {
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            for (uint32_t act = 0; act < 2; act++)
                CHECK(check_gemm(fmts[f], act, shapes[i][0], shapes[i][1], shapes[i][2]));
        for (int i = 0; i < 6; i++) { /* drawn shapes (fixed seed, so every run checks the same) */
            const uint32_t n = 1 + rnd() % 130, k = 32 * (1 + rnd() % 12), t = 1 + rnd() % 20;
            for (uint32_t act = 0; act < 2; act++) CHECK(check_gemm(fmts[f], act, n, k, t));
        }
        { /* every format's NEON kernel gives the portable bits */
            const uint32_t bs[][3] = {{1, 32, 1}, {17, 96, 5}, {31, 32, 3}, {70, 160, 7}, {33, 256, 4}};
            for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++)
                CHECK(check_gemm_bits(fmts[f], bs[i][0], bs[i][1], bs[i][2]));
        }
        CHECK(check_gemm_exact(fmts[f], 49, 512, 5));
        CHECK(check_gemm_exact(fmts[f], 100, 1024, 3));
        CHECK(check_gemm_forms(fmts[f], 96, 5));
        for (uint32_t act = 0; act < 2; act++) {
            CHECK(check_expert(fmts[f], act, 64, 96, 9, 64, HTP_GLU_SWIGLU, 0));
            CHECK(check_expert(fmts[f], act, 96, 64, 13, 5, HTP_GLU_SWIGLU, 0)); /* split passes */
        }
    }
    /* the other activations, with and without biases (Q4_0 and Q8_0 tiles) */
    for (int f = 0; f < 2; f++)
        for (uint32_t glu = HTP_GLU_SWIGLU; glu <= HTP_GLU_SWIGLU_OAI; glu++)
            for (uint32_t act = 0; act < 2; act++) {
                CHECK(check_expert(fmts[f], act, 64, 96, 9, 64, glu, 1));
                if (glu != HTP_GLU_SWIGLU) CHECK(check_expert(fmts[f], act, 96, 64, 13, 5, glu, 0));
            }
    for (uint32_t fmt = HTP_FMT_F16_T32R4; fmt <= HTP_FMT_BF16_T32R4; fmt++)
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            CHECK(check_float_tiles(fmt, shapes[i][0], shapes[i][1], shapes[i][2]));
    CHECK(check_others());
#undef CHECK
done:
    printf(bad ? "FAILED\n" : "OK\n");
    return bad ? 1 : 0;
}
