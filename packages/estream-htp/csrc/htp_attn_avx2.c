/* AVX2 attention task (the body is htp_attn_task.h, fp32 products): register-blocked QKᵀ and
 * PV of 6 query rows x 16 columns (12 ymm accumulators, 2 column loads, 1 broadcast), the shared
 * vector exp (htp_attn_vexp.h) with 2^n built in the exponent field, K laid in 16-column panels
 * once per call. Head dims must be multiples of 16 (else the generic body runs). The same
 * vocabulary and exp give the AVX2 SwiGLU (htp_vswiglu.h). */
#include "htp_internal.h"

#ifdef HTP_X86
#include <immintrin.h>

#include "htp_attn_body.h"

/* p·2^n for integral n >= -126 (the exp's clamp): 2^n built in the exponent field */
HTP_T_AVX2 static inline __m256 scale2_ps8(__m256 p, __m256 n) {
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
#define V_EXPNEG(x) htp_vexp_neg(x)
#define V_RMAX(x) rmax_ps8(x)
#define V_RADD(x) radd_ps8(x)
#define V_FIRST(n) first_ps8(n)
#define V_MASK_ANDNOT(a, b) _mm256_andnot_ps((a), (b))
#define V_MAXM(a, m, x) _mm256_blendv_ps((a), _mm256_max_ps((a), (x)), (m))
#define V_ANDM(m, x) _mm256_and_ps((m), (x))
#define ATTN_MR 6
#define ATTN_MC 2
_Static_assert(ATTN_MC * VW == HTP_ATTN_COLS_AVX2, "the K panels the table asks for are the register block's columns");
#define V_MAX(a, b) _mm256_max_ps((a), (b))
#define V_ROUND(x) _mm256_round_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_FNMADD(a, b, c) _mm256_fnmadd_ps((a), (b), (c))
#define V_SCALE2(p, n) scale2_ps8((p), (n))
#define VEXP_TARGET HTP_T_AVX2
#include "htp_attn_vexp.h"

#define V_DIV(a, b) _mm256_div_ps((a), (b))
#define V_SEL_GE0(x, a, b) _mm256_blendv_ps((b), (a), _mm256_cmp_ps((x), _mm256_setzero_ps(), _CMP_GE_OQ))
#define V_SEL_GT(a, b, x, y) _mm256_blendv_ps((y), (x), _mm256_cmp_ps((a), (b), _CMP_GT_OQ))
#define VSWIGLU_NAME htp_swiglu_avx2
#define VSWIGLU_OAI_NAME htp_swiglu_oai_avx2
#include "htp_vswiglu.h"

#define ATTN_NAME htp_attn_task_avx2
#define ATTN_TARGET HTP_T_AVX2
#define ATTN_BF16 0
#include "htp_attn_task.h"
#endif
