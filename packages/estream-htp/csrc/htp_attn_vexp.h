/* exp(x) for vector lanes x <= 0 (attention scores minus their running max), written once over
 * the vector vocabulary of htp_attn_task.h plus V_MAX, V_ROUND (to nearest), V_FNMADD(a, b, c)
 * = c - a·b and V_SCALE2(p, n) = p·2^n: the scalar htp_exp_neg's clamp, two-constant reduction
 * and degree-6 polynomial. Included once per translation unit, after the vocabulary, with
 * VEXP_TARGET the target attribute. */
#ifndef ESTREAM_HTP_ATTN_VEXP_H
#define ESTREAM_HTP_ATTN_VEXP_H

VEXP_TARGET static inline VF htp_vexp_neg(VF x) {
    x = V_MAX(x, V_SET1(-87.0f));
    const VF n = V_ROUND(V_MUL(x, V_SET1(1.44269504088896341f)));
    VF r = V_FNMADD(n, V_SET1(0.693145751953125f), x);
    r = V_FNMADD(n, V_SET1(1.428606765330187045e-06f), r);
    VF p = V_SET1(1.0f / 720.0f);
    p = V_FMA(p, r, V_SET1(1.0f / 120.0f));
    p = V_FMA(p, r, V_SET1(1.0f / 24.0f));
    p = V_FMA(p, r, V_SET1(1.0f / 6.0f));
    p = V_FMA(p, r, V_SET1(0.5f));
    p = V_FMA(p, r, V_SET1(1.0f));
    p = V_FMA(p, r, V_SET1(1.0f));
    return V_SCALE2(p, n);
}

#endif
