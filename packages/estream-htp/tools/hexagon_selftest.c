/* Self-test of the freestanding Hexagon runtime's arithmetic (csrc/hexagon/hx_math.c and the
 * compiler's inline float division), run under qemu-hexagon by tests/test_hexagon.py, which
 * compares every result with the host's IEEE arithmetic and libm.
 *
 * stdin: uint32 n, then double a[n], b[n], c[n], int64 i[n], j[n] (j never 0).
 * stdout: double a/b, sqrt|a|, exp c, log|a|, sin c, cos c, pow(|a|, c/100), floor a, ceil a;
 *         float (float)a/(float)b, nearbyintf((float)c); int64 u/, u%, s/, s% (64-bit) and
 *         u/, u%, s/, s% of the low 32 bits (as int64), each as an array of n. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <math.h>

static int read_all(void *p, size_t n) {
    uint8_t *b = (uint8_t *)p;
    while (n) {
        const ssize_t r = read(0, b, n);
        if (r <= 0) return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}
static int write_all(const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    while (n) {
        const ssize_t r = write(1, b, n);
        if (r <= 0) return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

int main(void) {
    uint32_t n;
    if (read_all(&n, 4)) return 2;
    double *a = malloc(8 * (size_t)n), *b = malloc(8 * (size_t)n), *c = malloc(8 * (size_t)n);
    int64_t *i = malloc(8 * (size_t)n), *j = malloc(8 * (size_t)n);
    double *od = malloc(8 * (size_t)n);
    float *of = malloc(4 * (size_t)n);
    int64_t *oi = malloc(8 * (size_t)n);
    if (!a || !b || !c || !i || !j || !od || !of || !oi) return 3;
    if (read_all(a, 8 * (size_t)n) || read_all(b, 8 * (size_t)n) || read_all(c, 8 * (size_t)n) ||
        read_all(i, 8 * (size_t)n) || read_all(j, 8 * (size_t)n))
        return 2;
    for (int f = 0; f < 9; f++) {
        for (uint32_t k = 0; k < n; k++) {
            const double x = a[k], y = b[k], z = c[k];
            switch (f) {
            case 0: od[k] = x / y; break;
            case 1: od[k] = sqrt(fabs(x)); break;
            case 2: od[k] = exp(z); break;
            case 3: od[k] = log(fabs(x)); break;
            case 4: od[k] = sin(z); break;
            case 5: od[k] = cos(z); break;
            case 6: od[k] = pow(fabs(x), z / 100.0); break;
            case 7: od[k] = floor(x); break;
            default: od[k] = ceil(x); break;
            }
        }
        if (write_all(od, 8 * (size_t)n)) return 4;
    }
    for (uint32_t k = 0; k < n; k++) of[k] = (float)a[k] / (float)b[k];
    if (write_all(of, 4 * (size_t)n)) return 4;
    for (uint32_t k = 0; k < n; k++) of[k] = nearbyintf((float)c[k]);
    if (write_all(of, 4 * (size_t)n)) return 4;
    for (int f = 0; f < 8; f++) {
        for (uint32_t k = 0; k < n; k++) {
            const uint64_t u = (uint64_t)i[k], v = (uint64_t)j[k];
            const uint32_t u3 = (uint32_t)u, v3 = (uint32_t)v ? (uint32_t)v : 1u;
            const int32_t s3 = (int32_t)u3, t3 = (int32_t)v3;
            switch (f) {
            case 0: oi[k] = (int64_t)(u / v); break;
            case 1: oi[k] = (int64_t)(u % v); break;
            case 2: oi[k] = i[k] / j[k]; break;
            case 3: oi[k] = i[k] % j[k]; break;
            case 4: oi[k] = (int64_t)(u3 / v3); break;
            case 5: oi[k] = (int64_t)(u3 % v3); break;
            case 6: oi[k] = (t3 == -1 && s3 == INT32_MIN) ? 0 : s3 / t3; break;
            default: oi[k] = (t3 == -1 && s3 == INT32_MIN) ? 0 : s3 % t3; break;
            }
        }
        if (write_all(oi, 8 * (size_t)n)) return 4;
    }
    return 0;
}
