/* Hexagon HVX inner-loop table (128-byte vectors). Filled in step by step: see below. */
#include "htp_gemm_body.h"

#ifdef HTP_HVX
static void q4q8_strip_hvx(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                           float *out, uint32_t ldo, uint32_t rows) {
    htp_q8_strip_body(strip, HTP_FMT_Q4_0_T32R4, kb, a, nt, out, ldo, rows);
}

const htp_isa htp_isa_hvx = {
    .level = HTP_SIMD_HVX,
    .q4q8_strip = q4q8_strip_hvx,
    .q4q8_nt = 64,
    .q8q8_strip = htp_q8q8_strip_portable,
    .q8q8_nt = 64,
    .dequant_tile = htp_dequant_portable,
    .f32_strip = htp_f32_strip_portable,
    .f32_nt = 4,
    .quantize_row_q8 = htp_quantize_q8_portable,
    .attention_task = htp_attn_task_portable,
    .attention_wants_kt = 0,
    .swiglu = htp_swiglu_portable,
    .dot_peak = NULL,
    .dot_macs_per_iter = 0,
};
#endif
