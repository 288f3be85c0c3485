/* out = silu(g)·u (u may be NULL: silu alone) over vector lanes, written once over the vector
 * vocabulary of htp_attn_task.h and htp_attn_vexp.h plus V_DIV and V_SEL_GE0(x, a, b) (a where
 * x >= 0, else b). The scalar body's formula (htp_swiglu_body): sigmoid through e = exp(-|x|),
 * which cannot overflow, as (x >= 0 ? 1 : e) / (1 + e); the product x·sig, then ·u. A tail
 * shorter than a vector goes through the same vector code in a padded copy, so every element
 * gets the same bits wherever it sits. Included once per translation unit, after the
 * vocabulary and htp_attn_vexp.h, with VSWIGLU_NAME and VSWIGLU_OAI_NAME the functions' names. */

VEXP_TARGET static inline VF htp_vswiglu_lanes(VF x, const float *u) {
    const VF zero = V_ZERO(), one = V_SET1(1.0f);
    const VF e = htp_vexp_neg(V_SUB(zero, V_MAX(x, V_SUB(zero, x))));
    const VF sig = V_DIV(V_SEL_GE0(x, one, e), V_ADD(one, e));
    const VF s = V_MUL(x, sig);
    return u ? V_MUL(s, V_LOAD(u)) : s;
}

VEXP_TARGET void VSWIGLU_NAME(const float *g, const float *u, uint64_t n, float *out) {
    uint64_t i = 0;
    for (; i + VW <= n; i += VW) V_STORE(out + i, htp_vswiglu_lanes(V_LOAD(g + i), u ? u + i : NULL));
    if (i < n) {
        float gt[VW], ut[VW], ot[VW];
        for (uint64_t j = 0; j < VW; j++) {
            gt[j] = i + j < n ? g[i + j] : 0.0f;
            ut[j] = u && i + j < n ? u[i + j] : 0.0f;
        }
        V_STORE(ot, htp_vswiglu_lanes(V_LOAD(gt), u ? ut : NULL));
        for (uint64_t j = 0; i + j < n; j++) out[i + j] = ot[j];
    }
}

/* SwiGLU-OAI (htp_swiglu_oai_body) over vector lanes, with V_SEL_GT(a, b, x, y): x where
 * a > b (an ordered compare: false for NaN), else y; the scalar body's clamps exactly, NaN
 * passing through. Padded tails as above. */
VEXP_TARGET static inline VF htp_vswiglu_oai_lanes(VF g, VF u, VF alpha, VF lim, VF nlim) {
    const VF zero = V_ZERO(), one = V_SET1(1.0f);
    const VF x = V_SEL_GT(g, lim, lim, g);
    const VF v = V_SEL_GT(u, lim, lim, V_SEL_GT(nlim, u, nlim, u));
    const VF z = V_MUL(alpha, x);
    const VF e = htp_vexp_neg(V_SUB(zero, V_MAX(z, V_SUB(zero, z))));
    const VF sig = V_DIV(V_SEL_GE0(z, one, e), V_ADD(one, e));
    return V_MUL(V_MUL(x, sig), V_ADD(v, one));
}

VEXP_TARGET void VSWIGLU_OAI_NAME(const float *g, const float *u, uint64_t n, float alpha,
                                  float limit, float *out) {
    const VF a = V_SET1(alpha), lim = V_SET1(limit), nlim = V_SET1(-limit);
    uint64_t i = 0;
    for (; i + VW <= n; i += VW)
        V_STORE(out + i, htp_vswiglu_oai_lanes(V_LOAD(g + i), V_LOAD(u + i), a, lim, nlim));
    if (i < n) {
        float gt[VW], ut[VW], ot[VW];
        for (uint64_t j = 0; j < VW; j++) {
            gt[j] = i + j < n ? g[i + j] : 0.0f;
            ut[j] = i + j < n ? u[i + j] : 0.0f;
        }
        V_STORE(ot, htp_vswiglu_oai_lanes(V_LOAD(gt), V_LOAD(ut), a, lim, nlim));
        for (uint64_t j = 0; i + j < n; j++) out[i + j] = ot[j];
    }
}

#undef VSWIGLU_NAME
#undef VSWIGLU_OAI_NAME
