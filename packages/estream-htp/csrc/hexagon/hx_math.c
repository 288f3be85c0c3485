/* estream-htp's freestanding Hexagon runtime: the compiler's run-time helpers and the double
 * math functions the library calls (no libm, no compiler-rt for Hexagon in the toolchain).
 *
 * Double addition and multiplication are instructions on v67 (dfadd, dfmpy*); division, square
 * root and integer division are calls to the helpers below. Division and square root are
 * correctly rounded (round to nearest even: bit-serial long division / square root on the
 * integer mantissas), as IEEE 754 and the host's libm require, so the portable kernels compute
 * the same values here as on the host. exp and log are within 2 double ulp of glibc, sin/cos
 * within 4 (Cody-Waite reduction, Taylor polynomials), pow = exp(y log x) within about
 * 2 + 4|y ln x| ulp (tools/hexagon_selftest.c); the kernels round these to float. */
#define HX_RUNTIME_IMPL 1
#include <hx_libc.h>

#define SIGN_BIT 0x8000000000000000ull
#define FRAC_MASK 0x000fffffffffffffull
#define HIDDEN 0x0010000000000000ull

static inline uint64_t dbits(double x) {
    uint64_t u;
    __builtin_memcpy(&u, &x, 8);
    return u;
}
static inline double dfrom(uint64_t u) {
    double x;
    __builtin_memcpy(&x, &u, 8);
    return x;
}

/* ---- integer division (shift and subtract) ---- */
static uint64_t udivmod64(uint64_t n, uint64_t d, uint64_t *rem) {
    if (d == 0) { /* undefined in C; return all ones like the hardware-less helpers do */
        if (rem) *rem = n;
        return ~0ull;
    }
    uint64_t q = 0, r = 0;
    int bits = 64;
    while (bits > 0 && !(n >> 63)) { /* skip leading zeros */
        n <<= 1;
        bits--;
    }
    for (; bits > 0; bits--) {
        r = (r << 1) | (n >> 63);
        n <<= 1;
        q <<= 1;
        if (r >= d) {
            r -= d;
            q |= 1;
        }
    }
    if (rem) *rem = r;
    return q;
}
static uint32_t udivmod32(uint32_t n, uint32_t d, uint32_t *rem) {
    uint64_t r;
    const uint64_t q = udivmod64(n, d, &r);
    if (rem) *rem = (uint32_t)r;
    return (uint32_t)q;
}

uint32_t __hexagon_udivsi3(uint32_t a, uint32_t b) { return udivmod32(a, b, NULL); }
uint32_t __hexagon_umodsi3(uint32_t a, uint32_t b) {
    uint32_t r;
    udivmod32(a, b, &r);
    return r;
}
int32_t __hexagon_divsi3(int32_t a, int32_t b) {
    const uint32_t ua = a < 0 ? 0u - (uint32_t)a : (uint32_t)a, ub = b < 0 ? 0u - (uint32_t)b : (uint32_t)b;
    const uint32_t q = udivmod32(ua, ub, NULL);
    return (int32_t)((a < 0) != (b < 0) ? 0u - q : q);
}
int32_t __hexagon_modsi3(int32_t a, int32_t b) {
    const uint32_t ua = a < 0 ? 0u - (uint32_t)a : (uint32_t)a, ub = b < 0 ? 0u - (uint32_t)b : (uint32_t)b;
    uint32_t r;
    udivmod32(ua, ub, &r);
    return (int32_t)(a < 0 ? 0u - r : r);
}
uint64_t __hexagon_udivdi3(uint64_t a, uint64_t b) { return udivmod64(a, b, NULL); }
uint64_t __hexagon_umoddi3(uint64_t a, uint64_t b) {
    uint64_t r;
    udivmod64(a, b, &r);
    return r;
}
int64_t __hexagon_divdi3(int64_t a, int64_t b) {
    const uint64_t ua = a < 0 ? 0ull - (uint64_t)a : (uint64_t)a, ub = b < 0 ? 0ull - (uint64_t)b : (uint64_t)b;
    const uint64_t q = udivmod64(ua, ub, NULL);
    return (int64_t)((a < 0) != (b < 0) ? 0ull - q : q);
}
int64_t __hexagon_moddi3(int64_t a, int64_t b) {
    const uint64_t ua = a < 0 ? 0ull - (uint64_t)a : (uint64_t)a, ub = b < 0 ? 0ull - (uint64_t)b : (uint64_t)b;
    uint64_t r;
    udivmod64(ua, ub, &r);
    return (int64_t)(a < 0 ? 0ull - r : r);
}

/* ---- double division, correctly rounded ---- */
/* mantissa with the hidden bit (subnormals normalised); *e gets the biased exponent */
static uint64_t unpack(uint64_t u, int *e) {
    int ex = (int)((u >> 52) & 0x7ff);
    uint64_t m = u & FRAC_MASK;
    if (ex == 0) {
        ex = 1;
        while (!(m & HIDDEN)) {
            m <<= 1;
            ex--;
        }
    } else {
        m |= HIDDEN;
    }
    *e = ex;
    return m;
}

/* q holds the result's mantissa with two extra low bits; biased exponent e (may be <= 0) */
static double round_pack(uint64_t sign, int e, uint64_t q, int sticky) {
    if (e <= 0) { /* subnormal: shift further right, keeping what falls off as sticky */
        const int sh = 1 - e;
        if (sh >= 60) {
            sticky |= q != 0;
            q = 0;
        } else {
            sticky |= (q & ((1ull << sh) - 1)) != 0;
            q >>= sh;
        }
        e = 0;
    }
    uint64_t mant = q >> 2;
    const int rbit = (int)((q >> 1) & 1), lower = (int)(q & 1) | sticky;
    if (rbit && (lower || (mant & 1))) mant++;
    if (e == 0) return dfrom(sign | mant); /* a carry into bit 52 makes it the smallest normal */
    if (mant >> 53) {
        mant >>= 1;
        e++;
    }
    if (e >= 0x7ff) return dfrom(sign | 0x7ff0000000000000ull);
    return dfrom(sign | ((uint64_t)e << 52) | (mant & FRAC_MASK));
}

double __hexagon_divdf3(double a, double b) {
    const uint64_t ua = dbits(a), ub = dbits(b);
    const uint64_t sign = (ua ^ ub) & SIGN_BIT;
    const uint64_t aa = ua & ~SIGN_BIT, ab = ub & ~SIGN_BIT;
    const uint64_t inf = 0x7ff0000000000000ull, qnan = 0x7ff8000000000000ull;
    if (aa > inf) return dfrom(ua | qnan);
    if (ab > inf) return dfrom(ub | qnan);
    if (aa == inf) return ab == inf ? dfrom(qnan) : dfrom(sign | inf);
    if (ab == inf) return dfrom(sign);
    if (aa == 0) return ab == 0 ? dfrom(qnan) : dfrom(sign);
    if (ab == 0) return dfrom(sign | inf);
    int ea, eb;
    uint64_t ma = unpack(aa, &ea), mb = unpack(ab, &eb);
    int e = ea - eb + 1023;
    if (ma < mb) {
        ma <<= 1;
        e--;
    }
    uint64_t q = 0, rem = ma; /* 55 quotient bits: 1.52 bits of the result and two more */
    for (int i = 0; i < 55; i++) {
        q <<= 1;
        if (rem >= mb) {
            rem -= mb;
            q |= 1;
        }
        rem <<= 1;
    }
    return round_pack(sign, e, q, rem != 0);
}

/* ---- square root, correctly rounded ---- */
double sqrt(double x) {
    const uint64_t u = dbits(x);
    if ((u & ~SIGN_BIT) == 0) return x; /* +-0 */
    if ((u & ~SIGN_BIT) > 0x7ff0000000000000ull) return dfrom(u | 0x7ff8000000000000ull);
    if (u & SIGN_BIT) return dfrom(0x7ff8000000000000ull);
    if (u == 0x7ff0000000000000ull) return x;
    int e;
    uint64_t m = unpack(u, &e);
    int ue = e - 1023; /* x = (m / 2^52) * 2^ue */
    if (ue & 1) {
        m <<= 1;
        ue--;
    }
    /* root = floor(sqrt(m * 2^56)): 55 bits, the result's 53 and two more; the radicand's bits
     * are m's followed by 56 zeros, taken two at a time from the top */
    uint64_t root = 0, rem = 0;
    for (int i = 54; i >= 0; i--) {
        const int sh = 2 * i - 56;
        const uint64_t pair = sh >= 0 ? (m >> sh) & 3 : 0;
        rem = (rem << 2) | pair;
        const uint64_t trial = (root << 2) | 1;
        if (rem >= trial) {
            rem -= trial;
            root = (root << 1) | 1;
        } else {
            root <<= 1;
        }
    }
    return round_pack(0, ue / 2 + 1023, root, rem != 0);
}
float sqrtf(float x) { return (float)sqrt((double)x); } /* double rounding is exact for sqrt */

/* ---- rounding ---- */
double floor(double x) {
    const uint64_t u = dbits(x);
    const int e = (int)((u >> 52) & 0x7ff) - 1023;
    if (e >= 52) return x; /* integral, inf or nan */
    if (e < 0) return (u & SIGN_BIT) ? ((u << 1) ? -1.0 : x) : dfrom(0);
    const uint64_t frac = FRAC_MASK >> e;
    if (!(u & frac)) return x;
    uint64_t t = u & ~frac;
    double r = dfrom(t);
    return (u & SIGN_BIT) ? r - 1.0 : r;
}
double ceil(double x) { return -floor(-x); }
double fmax(double a, double b) { return a != a ? b : b != b ? a : a > b ? a : b; }
double fmin(double a, double b) { return a != a ? b : b != b ? a : a < b ? a : b; }

float nearbyintf(float x) { /* round half to even (the default rounding mode) */
    const float two23 = 8388608.0f;
    const float ax = __builtin_fabsf(x);
    if (!(ax < two23)) return x; /* integral already, inf or nan */
    /* the sum rounds to an integer; the empty asm keeps the compiler from folding it away
     * while t stays in a register (a volatile stack slot made a store and its reload of one
     * address in one packet, which qemu-hexagon 7.2 can answer with the slot's old bytes) */
    float t = ax + two23;
    __asm__("" : "+r"(t));
    float r = t - two23;
    return __builtin_copysignf(r, x);
}

/* ---- exp, log, pow ---- */
static const double LN2_HI = 6.93147180369123816490e-01; /* ln 2 with the low 32 bits zero */
static const double LN2_LO = 1.90821492927058770002e-10;
static const double INV_LN2 = 1.44269504088896338700e+00;

static double scale2(double p, int k) { /* p * 2^k */
    while (k > 1023) {
        p *= dfrom(0x7fe0000000000000ull); /* 2^1023 */
        k -= 1023;
    }
    while (k < -1022) {
        p *= dfrom(0x0010000000000000ull); /* 2^-1022 */
        k += 1022;
    }
    return p * dfrom((uint64_t)(k + 1023) << 52);
}

double exp(double x) {
    if (x != x) return x;
    if (x > 709.782712893384) return dfrom(0x7ff0000000000000ull);
    if (x < -745.1332191019412) return 0.0;
    const double kd = floor(x * INV_LN2 + 0.5);
    const int k = (int)kd;
    const double r = (x - kd * LN2_HI) - kd * LN2_LO; /* |r| <= 0.35 */
    double p = 1.0 / 6227020800.0;                    /* 1/13! */
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r * r + r; /* exp(r) - 1, summed small terms first */
    return scale2(1.0 + p, k);
}

float expf(float x) { return (float)exp((double)x); }

double log(double x) {
    const uint64_t u = dbits(x);
    if (x != x) return x;
    if ((u & ~SIGN_BIT) == 0) return -dfrom(0x7ff0000000000000ull);
    if (u & SIGN_BIT) return dfrom(0x7ff8000000000000ull);
    if (u == 0x7ff0000000000000ull) return x;
    int e;
    uint64_t m = unpack(u, &e);
    int k = e - 1023;
    double f = dfrom((m & FRAC_MASK) | 0x3ff0000000000000ull); /* in [1, 2) */
    if (f > 1.4142135623730951) {
        f *= 0.5;
        k++;
    }
    const double g = f - 1.0; /* exact, in [-0.293, 0.415) */
    const double s = g / (2.0 + g), z = s * s; /* log f = 2 atanh(s), |s| < 0.172 */
    double p = 1.0 / 23.0;
    p = p * z + 1.0 / 21.0;
    p = p * z + 1.0 / 19.0;
    p = p * z + 1.0 / 17.0;
    p = p * z + 1.0 / 15.0;
    p = p * z + 1.0 / 13.0;
    p = p * z + 1.0 / 11.0;
    p = p * z + 1.0 / 9.0;
    p = p * z + 1.0 / 7.0;
    p = p * z + 1.0 / 5.0;
    p = p * z + 1.0 / 3.0;
    /* 2s = g - s*g exactly in real arithmetic; g - s*(g - 2zp/... ) keeps g's exactness */
    const double hg = 0.5 * g * g;
    const double lf = g - hg + s * (hg + 2.0 * z * p);
    return (double)k * LN2_HI + ((double)k * LN2_LO + lf);
}

double pow(double x, double y) {
    if (y == 0.0 || x == 1.0) return 1.0;
    if (x != x || y != y) return x + y;
    if (x > 0.0) return exp(y * log(x));
    const double yi = floor(y);
    if (x == 0.0) return y > 0.0 ? 0.0 : dfrom(0x7ff0000000000000ull);
    if (yi != y) return dfrom(0x7ff8000000000000ull); /* negative base, non-integral power */
    const double r = exp(y * log(-x));
    const double half = floor(y * 0.5);
    return half * 2.0 == y ? r : -r;
}

/* ---- sin, cos: reduction by pi/2 in three parts (accurate for |x| up to ~1e6) ---- */
static const double INV_PIO2 = 6.36619772367581382433e-01;
static const double PIO2_1 = 1.57079632673412561417e+00;
static const double PIO2_2 = 6.07710050630396597660e-11;
static const double PIO2_3 = 2.02226624871116645580e-21;
static const double PIO2_3T = 8.47842766036889956997e-32;

static double sin_poly(double r) { /* |r| <= pi/4 */
    const double z = r * r;
    double p = -1.0 / 121645100408832000.0; /* -1/19! */
    p = p * z + 1.0 / 355687428096000.0;
    p = p * z - 1.0 / 1307674368000.0;
    p = p * z + 1.0 / 6227020800.0;
    p = p * z - 1.0 / 39916800.0;
    p = p * z + 1.0 / 362880.0;
    p = p * z - 1.0 / 5040.0;
    p = p * z + 1.0 / 120.0;
    p = p * z - 1.0 / 6.0;
    return r + r * z * p;
}
static double cos_poly(double r) {
    const double z = r * r;
    double p = 1.0 / 6402373705728000.0; /* 1/18! */
    p = p * z - 1.0 / 20922789888000.0;
    p = p * z + 1.0 / 87178291200.0;
    p = p * z - 1.0 / 479001600.0;
    p = p * z + 1.0 / 3628800.0;
    p = p * z - 1.0 / 40320.0;
    p = p * z + 1.0 / 720.0;
    p = p * z - 1.0 / 24.0;
    p = p * z + 0.5;
    return 1.0 - z * p;
}

static double reduce(double x, int *quadrant) {
    const double kd = floor(x * INV_PIO2 + 0.5);
    *quadrant = (int)((int64_t)kd & 3);
    return ((x - kd * PIO2_1) - kd * PIO2_2) - kd * PIO2_3 - kd * PIO2_3T;
}

double sin(double x) {
    if (!__builtin_isfinite(x)) return x - x;
    int q;
    const double r = reduce(x, &q);
    switch (q) {
    case 0: return sin_poly(r);
    case 1: return cos_poly(r);
    case 2: return -sin_poly(r);
    default: return -cos_poly(r);
    }
}
double cos(double x) {
    if (!__builtin_isfinite(x)) return x - x;
    int q;
    const double r = reduce(x, &q);
    switch (q) {
    case 0: return cos_poly(r);
    case 1: return -sin_poly(r);
    case 2: return -cos_poly(r);
    default: return sin_poly(r);
    }
}
