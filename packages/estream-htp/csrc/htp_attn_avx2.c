/* AVX2 attention task (the body is htp_attn_task.h, fp32 products): register-blocked QKᵀ and PV
 * of 6 query rows x 16 columns (12 ymm accumulators, 2 column loads, 1 broadcast), vector exp by
 * exponent-field construction, K pre-transposed once per call. Head dims must be multiples of 16
 * (else the generic body runs). */
#include "htp_internal.h"

#ifdef HTP_X86
#include <immintrin.h>

#include "htp_attn_body.h"

/* exp(x) for lanes x <= 0: the scalar htp_exp_neg's reduction and polynomial, 2^n built in the
 * exponent field (n >= -126 after the clamp, so 2^n is a normal float). */
HTP_T_AVX2 static inline __m256 exp_neg_ps8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

HTP_T_AVX2 static inline float rmax_ps8(__m256 x) {
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

HTP_T_AVX2 static inline float radd_ps8(__m256 x) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* lanes 0..n-1 set (all bits), the rest clear */
HTP_T_AVX2 static inline __m256 first_ps8(int n) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

#define VF __m256
#define VW 8
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, x) _mm256_storeu_ps((p), (x))
#define V_SET1(x) _mm256_set1_ps(x)
#define V_ZERO() _mm256_setzero_ps()
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define V_SUB(a, b) _mm256_sub_ps((a), (b))
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_EXPNEG(x) exp_neg_ps8(x)
#define V_RMAX(x) rmax_ps8(x)
#define V_RADD(x) radd_ps8(x)
#define V_FIRST(n) first_ps8(n)
#define V_MAXM(a, m, x) _mm256_blendv_ps((a), _mm256_max_ps((a), (x)), (m))
#define V_ANDM(m, x) _mm256_and_ps((m), (x))
#define ATTN_MR 6
#define ATTN_MC 2

#define ATTN_NAME htp_attn_task_avx2
#define ATTN_TARGET HTP_T_AVX2
#define ATTN_BF16 0
#include "htp_attn_task.h"
#endif
