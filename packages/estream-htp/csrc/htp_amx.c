/* Q4_0 x Q8 strip kernel on Intel AMX (TMUL, int8 tiles): the AVX-512 VNNI table with its
 * hottest inner loop moved onto the tile unit.
 *
 * One tile multiply (tdpbssd) sums a 16-token x 32-value block of activations (tile A, rows of
 * the Q8 rows as they lie in memory, stride k) against 16 weight rows of one Q4_0 block (tile B,
 * the VNNI layout: 8 rows of 16 lanes x 4 k-values) into 16 x 16 int32. That is the per-block
 * integer dot product of the VNNI kernel, exactly; the block's fp32 epilogue is the same
 * instruction sequence (cvt, dw * da, fma into the running sum, blocks in order), so every output
 * is bit-identical to the AVX-512 VNNI kernel's (tested).
 *
 * Our tile layout already is the B layout after a nibble split: the low nibbles of group g of a
 * 32x32 tile are, for rows 0..15 (first 64 bytes) and 16..31 (next 64), k-values 4g..4g+3 (B row
 * g), the high nibbles 16+4g.. (B row 4+g). The strip is unpacked once per call into signed
 * bytes (nibble - 8, so no offset correction is needed) and reused by every 16-token block.
 *
 * The OS must grant the tile data state (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM)); htp_amx_usable
 * asks once per process. Each call loads its tile configuration and releases the tiles on
 * return, so no thread keeps 8 KiB of tile state across context switches. */
#include "htp_internal.h"

#ifdef HTP_X86
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define HTP_T_AMX HTP_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,amx-tile,amx-int8")

/* Our own tile instructions: the compiler's macros name no memory operand for tileloadd, so it
 * could move the unpacking stores past the load that reads them; these clobber memory. */
#define TLOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define TSTORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(base)), "r"((long)(stride)) : "memory")
#define TZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TDP(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

typedef struct __attribute__((packed, aligned(64))) tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

#define KC 32 /* Q4_0 blocks unpacked at a time: 32 KiB of B tiles, in L1 beside A */
#define TB 16 /* tokens per tile */

/* ---- availability (once per process) ---- */
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* the AVX-512 VNNI half of the level is checked by the caller (cpu_supports) */
static int amx_probe(void) {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return 0; /* AMX-TILE, AMX-INT8 */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) != 0) return 0;
    return (mask >> XFEATURE_XTILEDATA) & 1;
}

int htp_amx_usable(void) {
    static int state = -1; /* racing first callers compute the same answer */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = amx_probe();
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s;
}

/* tiles: 0/5 A (16 tokens x 32 bytes), 1/2 B (8 x 64), 3/4 C (16 x 64). Two sets, so that the
 * tile unit could work on block j+1 while the vector unit finishes block j; on the Xeon this was
 * measured on, the two did not overlap (see the README) */
HTP_T_AMX static void config(tilecfg *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    cfg->colsb[0] = cfg->colsb[5] = 32, cfg->rows[0] = cfg->rows[5] = TB;
    cfg->colsb[1] = cfg->colsb[2] = 64, cfg->rows[1] = cfg->rows[2] = 8;
    cfg->colsb[3] = cfg->colsb[4] = 64, cfg->rows[3] = cfg->rows[4] = TB;
    _tile_loadconfig(cfg);
}

/* signed B tiles of blocks [j0, j0 + nb) of the strip: bt[j][half][8 rows][64] */
HTP_T_AMX static void unpack(const uint8_t *strip, uint32_t j0, uint32_t nb, int8_t *bt) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
    for (uint32_t j = 0; j < nb; j++) {
        const uint8_t *tile = strip + (size_t)(j0 + j) * HTP_Q4_TILE_BYTES;
        int8_t *o = bt + (size_t)j * 1024;
        for (int g = 0; g < 4; g++)
            for (int half = 0; half < 2; half++) {
                const __m512i v = _mm512_loadu_si512((const void *)(tile + 64 + 128 * g + 64 * half));
                const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(v, m4), eight);
                const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), eight);
                _mm512_storeu_si512((void *)(o + 512 * half + 64 * g), lo);
                _mm512_storeu_si512((void *)(o + 512 * half + 64 * (4 + g)), hi);
            }
    }
}

/* acc[u] += cvt(C[u]) * (dw * da[u]) for the 16 rows of one half of block i; the block's 16
 * scales dt[16 i + u] lie together (one base register for every broadcast) */
#define EPILOGUE(cb) EPILOGUE_AT(cb, i)
#define EPILOGUE_AT(cb, i)                                                                         \
    do {                                                                                           \
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32 * half))); \
        const float *di = dt + (size_t)TB * (i);                                                   \
        for (int u = 0; u < TB; u++) {                                                             \
            const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)((cb) + 16 * u)));  \
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(di[u]));                             \
            acc[u] = _mm512_fmadd_ps(f, s, acc[u]);                                                \
        }                                                                                          \
    } while (0)

/* one 16-token block x one 16-row half of nb blocks: the blocks' tiles from `tiles`, their
 * activations q (rows of stride ldq bytes) and scales dt[16 i + u] (block i, token u), running
 * sums in acc16 */
HTP_T_AMX static void half_block(const int8_t *q, size_t ldq, const float *dt,
                                 const uint8_t *tiles, const int8_t *bt, uint32_t nb, int half,
                                 float *acc16) {
    int32_t cb[2][TB * 16] __attribute__((aligned(64)));
    __m512 acc[TB];
    for (int u = 0; u < TB; u++) acc[u] = _mm512_load_ps(acc16 + 16 * u);
    const int8_t *b0 = bt + 512 * half;
    /* prologue: block j0 on tile set 0 */
    TLOAD(0, q, ldq);
    TLOAD(1, b0, 64);
    TZERO(3);
    TDP(3, 0, 1);
    TSTORE(3, cb[0], 64);
    for (uint32_t i = 0; i < nb; i += 2) {
        if (i + 1 < nb) { /* block i + 1 on set 1 while block i's epilogue runs */
            TLOAD(5, q + 32 * (size_t)(i + 1), ldq);
            TLOAD(2, b0 + 1024 * (size_t)(i + 1), 64);
            TZERO(4);
            TDP(4, 5, 2);
            TSTORE(4, cb[1], 64);
        }
        {
            const uint8_t *tile = tiles + (size_t)i * HTP_Q4_TILE_BYTES;
            EPILOGUE(cb[0]);
        }
        if (i + 1 >= nb) break;
        if (i + 2 < nb) { /* block i + 2 on set 0 while block i + 1's epilogue runs */
            TLOAD(0, q + 32 * (size_t)(i + 2), ldq);
            TLOAD(1, b0 + 1024 * (size_t)(i + 2), 64);
            TZERO(3);
            TDP(3, 0, 1);
            TSTORE(3, cb[0], 64);
        }
        {
            const uint32_t i1 = i + 1;
            const uint8_t *tile = tiles + (size_t)i1 * HTP_Q4_TILE_BYTES;
            EPILOGUE_AT(cb[1], i1);
        }
    }
    for (int u = 0; u < TB; u++) _mm512_store_ps(acc16 + 16 * u, acc[u]);
}

/* The htp_isa q4q8_strip entry: nt <= 64 tokens (q4q8_nt) x one 32-row strip of kb blocks.
 * Whole 16-token blocks go to the tile unit when there are at least two of them (the strip's
 * unpacking then pays); the rest of the tokens, and calls of fewer than 32, to the VNNI kernel
 * (the same bits). Measured on one core, 2048-deep strips: at 8 / 16 / 24 tokens the tile path
 * ran at 87 / 189 / 168 GMAC/s against VNNI's 195 / 205 / 208, at 32 / 64 at 233 / 258. */
HTP_T_AMX void htp_q4q8_strip_amx(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                  uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t n_amx = nt >= 2 * TB ? nt / TB * TB : 0;
    for (uint32_t t0 = n_amx; t0 < nt; t0 += HTP_Q4_VNNI_NT) {
        const htp_act_q8 t = {a->q + (size_t)t0 * kb * 32, a->d + (size_t)t0 * kb, a->s + (size_t)t0 * kb};
        htp_q4q8_strip_vnni(strip, kb, &t, HTP_MIN(HTP_Q4_VNNI_NT, nt - t0), out + (size_t)t0 * ldo, ldo, rows);
    }
    if (n_amx == 0) return;
    nt = n_amx;
    enum { NTMAX = 64 };
    int8_t bt[KC * 1024] __attribute__((aligned(64)));
    float acc[NTMAX / TB][2][TB * 16] __attribute__((aligned(64)));
    float dt[KC * TB] __attribute__((aligned(64))); /* the token block's scales, block-major */
    tilecfg cfg;
    const uint32_t k = kb * 32, nblk = nt / TB, halves = rows > 16 ? 2 : 1;
    memset(acc, 0, sizeof acc);
    config(&cfg);
    for (uint32_t j0 = 0; j0 < kb; j0 += KC) {
        const uint32_t nb = HTP_MIN(KC, kb - j0);
        unpack(strip, j0, nb, bt);
        for (uint32_t tb = 0; tb < nblk; tb++) {
            const uint32_t t0 = tb * TB;
            const int8_t *q = a->q + (size_t)t0 * k + 32 * (size_t)j0;
            const float *da = a->d + (size_t)t0 * kb + j0;
            for (uint32_t i = 0; i < nb; i++)
                for (uint32_t u = 0; u < TB; u++) dt[TB * i + u] = da[(size_t)u * kb + i];
            const uint8_t *tiles = strip + (size_t)j0 * HTP_Q4_TILE_BYTES;
            for (uint32_t half = 0; half < halves; half++)
                half_block(q, k, dt, tiles, bt, nb, (int)half, acc[tb][half]);
        }
    }
    _tile_release();
    const __mmask16 k0 = rows >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1u);
    const __mmask16 k1 = rows >= 32 ? (__mmask16)0xffff
                         : rows > 16 ? (__mmask16)((1u << (rows - 16)) - 1u)
                                     : (__mmask16)0;
    for (uint32_t u = 0; u < nt; u++) {
        const float *s0 = acc[u / TB][0] + 16 * (u % TB), *s1 = acc[u / TB][1] + 16 * (u % TB);
        _mm512_mask_storeu_ps(out + (size_t)u * ldo, k0, _mm512_load_ps(s0));
        if (halves > 1) _mm512_mask_storeu_ps(out + (size_t)u * ldo + 16, k1, _mm512_load_ps(s1));
    }
}

/* peak: 4 independent tdpbssd chains on full 16x64 tiles (16 x 16 x 64 MACs each) */
HTP_T_AMX int32_t htp_amx_peak(uint64_t iters) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    int8_t src[16 * 64] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 64; i++) src[i] = (int8_t)(i % 7 - 3);
    TLOAD(4, src, 64);
    TLOAD(5, src, 64);
    TZERO(0);
    TZERO(1);
    TZERO(2);
    TZERO(3);
    for (uint64_t it = 0; it < iters; it++) {
        TDP(0, 4, 5);
        TDP(1, 4, 5);
        TDP(2, 4, 5);
        TDP(3, 4, 5);
    }
    int32_t c[16 * 16] __attribute__((aligned(64)));
    TSTORE(0, c, 64);
    _tile_release();
    return c[0];
}
#endif
