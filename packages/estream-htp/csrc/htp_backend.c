/* Backends: the buffer registry, descriptor validation (every reference bounds-checked against
 * its registered size before anything is read or written), fences, and dispatch to the HOST
 * execution context or to a REMOTE executor (htp_remote.c). */
#include "htp_internal.h"

#include <errno.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define HTP_MAX_BUFFERS 1024

typedef struct htp_buf {
    uint8_t *base;  /* where the registered region starts in this process */
    void *map;      /* our own mapping (fd buffers), unmapped on unregister */
    size_t map_len;
    uint64_t size;
    uint32_t flags;
    uint32_t in_use;
} htp_buf;

typedef struct htp_done {
    uint64_t fence;
    int32_t status;
    uint32_t consumed;
    htp_op_times times;
} htp_done;

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef struct htp_backend_vt htp_backend_vt;

struct htp_backend {
    const htp_backend_vt *vt; /* what this kind of backend does (HOST or REMOTE) */
    uint32_t kind;
    uint32_t simd;
    uint32_t remote_threads; /* REMOTE: the executor's pool size */
    pthread_mutex_t lock; /* one call at a time (cffi releases the GIL) */
    pid_t pid;
    htp_exec ex;
    htp_buf *bufs;
    uint64_t next_fence; /* HOST: last fence issued */
    htp_done done[HTP_QUEUE_DEPTH];
    htp_remote *remote;
};

/* A backend is a table of functions, as ggml's backend interface: the HOST execution context and
 * the REMOTE executor each implement it, and only the constructor looks at the kind. The public
 * functions check their arguments, take the lock and call the table. */
struct htp_backend_vt {
    htp_status (*open)(htp_backend *b, const htp_backend_desc *desc, uint32_t level, uint32_t nth);
    uint32_t (*threads)(const htp_backend *b);
    /* under the lock: */
    htp_status (*configure)(htp_backend *b, uint32_t n_threads, uint32_t simd, uint32_t level);
    htp_status (*reg)(htp_backend *b, const htp_buffer_desc *d, uint32_t *id);
    htp_status (*unreg)(htp_backend *b, uint32_t id);
    htp_status (*submit)(htp_backend *b, const htp_op_desc *op, uint64_t *fence);
    htp_status (*wait)(htp_backend *b, uint64_t fence, uint32_t timeout_ms, htp_status *op_status,
                       htp_op_times *times);
    /* takes the lock itself: */
    htp_status (*run_tmp)(htp_backend *b, const htp_op_desc *op, const htp_buffer_desc *tmp,
                          uint32_t n_tmp);
    htp_status (*mac_peak)(htp_backend *b, uint32_t chain, uint64_t iters, double *macs_per_s);
};

static const htp_backend_vt host_vt, remote_vt;

/* ---- locking, fork ---- */
static void enter(htp_backend *b) {
    if (b->pid != getpid()) {
        /* forked child: no worker threads and possibly a lock copied mid-call; start over
         * single-threaded (the child is single-threaded at this point) */
        pthread_mutex_init(&b->lock, NULL);
        if (b->ex.pool) htp_pool_after_fork(b->ex.pool);
        b->pid = getpid();
    }
    pthread_mutex_lock(&b->lock);
}
static void leave(htp_backend *b) { pthread_mutex_unlock(&b->lock); }

/* ---- init / free ---- */
htp_status htp_backend_init(const htp_backend_desc *desc, htp_backend **out) {
    if (!out) return HTP_E_INVALID;
    *out = NULL;
    if (!desc) return HTP_E_INVALID;
    if (desc->abi_version != HTP_ABI_VERSION) return HTP_E_UNSUPPORTED;
    if (desc->reserved[0] || desc->reserved[1]) return HTP_E_INVALID;
    if (desc->kind != HTP_BACKEND_HOST && desc->kind != HTP_BACKEND_REMOTE) return HTP_E_UNSUPPORTED;
    const uint32_t level = desc->simd == HTP_SIMD_BEST ? htp_simd_best() : desc->simd;
    const uint32_t nth = desc->n_threads ? desc->n_threads : 1;
    htp_backend *b = (htp_backend *)calloc(1, sizeof(*b));
    if (!b) return HTP_E_NOMEM;
    pthread_mutex_init(&b->lock, NULL);
    b->pid = getpid();
    b->kind = desc->kind;
    b->vt = desc->kind == HTP_BACKEND_HOST ? &host_vt : &remote_vt;
    const htp_status st = b->vt->open(b, desc, level, nth);
    if (st != HTP_OK) {
        htp_backend_free(b);
        return st;
    }
    *out = b;
    return HTP_OK;
}

void htp_backend_free(htp_backend *b) {
    if (!b) return;
    if (b->remote) htp_remote_close(b->remote);
    if (b->bufs) {
        for (uint32_t i = 0; i < HTP_MAX_BUFFERS; i++)
            if (b->bufs[i].in_use && b->bufs[i].map) munmap(b->bufs[i].map, b->bufs[i].map_len);
        free(b->bufs);
    }
    htp_pool_free(b->ex.pool);
    htp_expert_ws_free(b->ex.ws);
    htp_rope_table_free(b->ex.rope);
    pthread_mutex_destroy(&b->lock);
    free(b);
}

uint32_t htp_backend_kind_of(const htp_backend *b) { return b ? b->kind : UINT32_MAX; }
uint32_t htp_backend_simd(const htp_backend *b) { return b ? b->simd : UINT32_MAX; }

uint32_t htp_backend_threads(const htp_backend *b) { return b ? b->vt->threads(b) : 0; }

htp_status htp_backend_configure(htp_backend *b, uint32_t n_threads, uint32_t simd) {
    if (!b || n_threads == 0) return HTP_E_INVALID;
    const uint32_t level = simd == HTP_SIMD_BEST ? htp_simd_best() : simd;
    enter(b);
    const htp_status st = b->vt->configure(b, n_threads, simd, level);
    leave(b);
    return st;
}

/* ---- HOST: ops run here, on the calling thread and a pool ---- */
static htp_status host_open(htp_backend *b, const htp_backend_desc *desc, uint32_t level,
                            uint32_t nth) {
    (void)desc;
    b->ex.isa = htp_isa_for(level);
    b->simd = level;
    b->bufs = (htp_buf *)calloc(HTP_MAX_BUFFERS, sizeof(htp_buf));
    b->ex.pool = htp_pool_new();
    if (!b->ex.isa) return HTP_E_UNSUPPORTED;
    if (!b->bufs || !b->ex.pool) return HTP_E_NOMEM;
    return htp_pool_resize(b->ex.pool, nth);
}

static uint32_t host_threads(const htp_backend *b) { return htp_pool_nth(b->ex.pool); }

static htp_status host_configure(htp_backend *b, uint32_t n_threads, uint32_t simd,
                                 uint32_t level) {
    (void)simd;
    const htp_isa *isa = htp_isa_for(level);
    if (!isa) return HTP_E_UNSUPPORTED;
    const htp_status st = htp_pool_resize(b->ex.pool, n_threads);
    if (st == HTP_OK) {
        b->ex.isa = isa;
        b->simd = level;
    }
    return st;
}

/* ---- REMOTE: ops run in an executor process (htp_remote.c) ---- */
static htp_status remote_open(htp_backend *b, const htp_backend_desc *desc, uint32_t level,
                              uint32_t nth) {
    (void)level;
    htp_status st = htp_remote_open(desc, &b->remote);
    /* HTP_SIMD_BEST travels as such: the executor picks the best level of *its* processor */
    if (st == HTP_OK) st = htp_remote_configure(b->remote, nth, desc->simd, &b->simd);
    if (st == HTP_OK) b->remote_threads = nth;
    return st;
}

static uint32_t remote_threads(const htp_backend *b) { return b->remote_threads; }

static htp_status remote_configure(htp_backend *b, uint32_t n_threads, uint32_t simd,
                                   uint32_t level) {
    (void)level;
    uint32_t got = 0;
    const htp_status st = htp_remote_configure(b->remote, n_threads, simd, &got);
    if (st == HTP_OK) {
        b->simd = got;
        b->remote_threads = n_threads;
    }
    return st;
}

static htp_status remote_reg(htp_backend *b, const htp_buffer_desc *d, uint32_t *id) {
    if (d->fd < 0) return HTP_E_INVALID; /* memory crosses the boundary as file descriptors */
    return htp_remote_register(b->remote, d, id);
}

static htp_status remote_unreg(htp_backend *b, uint32_t id) {
    return htp_remote_unregister(b->remote, id);
}

static htp_status remote_submit(htp_backend *b, const htp_op_desc *op, uint64_t *fence) {
    return htp_remote_submit(b->remote, op, fence);
}

static htp_status remote_wait(htp_backend *b, uint64_t fence, uint32_t timeout_ms,
                              htp_status *op_status, htp_op_times *times) {
    return htp_remote_wait(b->remote, fence, timeout_ms, op_status, times);
}

static htp_status remote_run_tmp(htp_backend *b, const htp_op_desc *op, const htp_buffer_desc *tmp,
                                 uint32_t n_tmp) {
    (void)b, (void)op, (void)tmp, (void)n_tmp;
    return HTP_E_UNSUPPORTED; /* an executor cannot read this process's memory */
}

static htp_status remote_mac_peak(htp_backend *b, uint32_t chain, uint64_t iters,
                                  double *macs_per_s) {
    (void)b, (void)chain, (void)iters, (void)macs_per_s;
    return HTP_E_UNSUPPORTED; /* measures this process's CPU */
}

/* ---- buffers ---- */
htp_status htp_buffer_register(htp_backend *b, const htp_buffer_desc *d, uint32_t *id) {
    if (!b || !d || !id) return HTP_E_INVALID;
    *id = 0;
    if (d->size == 0 || (d->flags & ~(uint32_t)(HTP_BUF_READ | HTP_BUF_WRITE)) || !d->flags)
        return HTP_E_INVALID;
    enter(b);
    const htp_status st = b->vt->reg(b, d, id);
    leave(b);
    return st;
}

static htp_status host_reg(htp_backend *b, const htp_buffer_desc *d, uint32_t *id) {
    uint32_t i = 0;
    while (i < HTP_MAX_BUFFERS && b->bufs[i].in_use) i++;
    if (i == HTP_MAX_BUFFERS) return HTP_E_CAPACITY;
    htp_buf nb = {0};
    nb.size = d->size;
    nb.flags = d->flags;
    if (d->fd >= 0) {
        const long page = sysconf(_SC_PAGESIZE);
        if (d->offset % (uint64_t)page || d->size > SIZE_MAX) return HTP_E_INVALID;
        const int prot = ((d->flags & HTP_BUF_READ) ? PROT_READ : 0) | ((d->flags & HTP_BUF_WRITE) ? PROT_WRITE : 0);
        void *m = mmap(NULL, (size_t)d->size, prot, MAP_SHARED, d->fd, (off_t)d->offset);
        if (m == MAP_FAILED) return HTP_E_MAP;
        nb.map = m;
        nb.map_len = (size_t)d->size;
        nb.base = (uint8_t *)m;
    } else {
        if (!d->host_addr || d->offset) return HTP_E_INVALID;
        nb.base = (uint8_t *)(uintptr_t)d->host_addr;
    }
    nb.in_use = 1;
    b->bufs[i] = nb;
    *id = i + 1;
    return HTP_OK;
}

htp_status htp_buffer_unregister(htp_backend *b, uint32_t id) {
    if (!b) return HTP_E_INVALID;
    enter(b);
    const htp_status st = b->vt->unreg(b, id);
    leave(b);
    return st;
}

static htp_status host_unreg(htp_backend *b, uint32_t id) {
    if (id == 0 || id > HTP_MAX_BUFFERS || !b->bufs[id - 1].in_use) return HTP_E_BAD_BUFFER;
    htp_buf *x = &b->bufs[id - 1];
    if (x->map) munmap(x->map, x->map_len);
    memset(x, 0, sizeof(*x));
    return HTP_OK;
}

/* ---- validation ---- */
static int mul_ok(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_mul_overflow(a, b, r); }

/* Bytes of `n` elements of `esize` each; UINT64_MAX on overflow (never fits a buffer). */
static uint64_t nbytes(uint64_t n, uint64_t esize) {
    uint64_t r;
    return mul_ok(n, esize, &r) ? r : UINT64_MAX;
}
static uint64_t nbytes3(uint64_t a, uint64_t b, uint64_t esize) {
    uint64_t r;
    return mul_ok(a, b, &r) ? nbytes(r, esize) : UINT64_MAX;
}

#define RD 0
#define WR 1

/* Resolve a reference to `bytes` bytes; `align` is the element alignment the op needs. */
static htp_status ref_get(htp_backend *b, const htp_ref *r, uint64_t bytes, int write,
                          uint32_t align, void **p) {
    *p = NULL;
    if (r->reserved) return HTP_E_BAD_OP;
    if (r->buffer == 0 || r->buffer > HTP_MAX_BUFFERS || !b->bufs[r->buffer - 1].in_use)
        return HTP_E_BAD_BUFFER;
    const htp_buf *x = &b->bufs[r->buffer - 1];
    if (r->offset > x->size || bytes > x->size - r->offset) return HTP_E_BOUNDS;
    if (!(x->flags & HTP_BUF_READ)) return HTP_E_READONLY; /* every operand is read */
    if (write && !(x->flags & HTP_BUF_WRITE)) return HTP_E_READONLY;
    uint8_t *q = x->base + r->offset;
    if (align > 1 && ((uintptr_t)q % align)) return HTP_E_INVALID;
    *p = q;
    return HTP_OK;
}

/* Bytes of t Q8 rows of d values (htp.h): [t][d] int8, [t][d/32] fp32, [t][d/32] int32;
 * UINT64_MAX (fails every bounds check) on overflow. */
static uint64_t q8_rows_bytes(uint32_t t, uint32_t d) {
    return nbytes3(t, (uint64_t)d + d / 4, 1);
}

#define GET(i, bytes, wr, align, var)                                                    \
    do {                                                                                 \
        void *p_;                                                                        \
        const htp_status st_ = ref_get(b, &op->ref[(i)], (bytes), (wr), (align), &p_);   \
        if (st_ != HTP_OK) return st_;                                                   \
        var = p_;                                                                        \
    } while (0)

static uint32_t refs_of(const htp_op_desc *op) {
    switch (op->opcode) {
    case HTP_OP_NOP: return 0;
    case HTP_OP_GEMM: return op->p.gemm.n_more <= 2 ? 3 + 2 * op->p.gemm.n_more : UINT32_MAX;
    case HTP_OP_EXPERT: /* a tenth reference with the biases */
        return op->p.expert.has_bias <= 1 ? 9 + op->p.expert.has_bias : UINT32_MAX;
    case HTP_OP_GET_ROWS: return 3;
    case HTP_OP_RMS_NORM: return op->p.rms_norm.has_weight ? 3 : 2;
    case HTP_OP_ROPE: return 2;
    case HTP_OP_ATTENTION: return op->p.attention.has_sinks ? 5 : 4;
    case HTP_OP_SILU: return 2;
    case HTP_OP_SWIGLU: return 3;
    case HTP_OP_ROUTER_TOPK: return op->p.router.has_bias ? 4 : 3;
    case HTP_OP_CONV1D: return op->p.conv1d.has_state ? 4 : 3;
    case HTP_OP_MATMUL_F32: return 3;
    case HTP_OP_ADD:
    case HTP_OP_MUL: return 3;
    case HTP_OP_COPY_ROWS: return 2;
    case HTP_OP_FILL: return 1;
    case HTP_OP_QUANTIZE: return 2;
    default: return UINT32_MAX;
    }
}

/* a gated activation's parameters (the expert op's and HTP_OP_SWIGLU's): a known htp_glu;
 * SwiGLU-OAI's alpha and limit positive and finite, and for the others both 0 */
static htp_status glu_check(uint32_t glu, float alpha, float limit) {
    if (glu > HTP_GLU_SWIGLU_OAI) return HTP_E_INVALID;
    if (glu == HTP_GLU_SWIGLU_OAI)
        return alpha > 0.0f && isfinite(alpha) && limit > 0.0f && isfinite(limit) ? HTP_OK
                                                                                   : HTP_E_INVALID;
    return alpha != 0.0f || limit != 0.0f ? HTP_E_BAD_OP : HTP_OK; /* unused fields must be 0 */
}

static htp_status exec_expert(htp_backend *b, const htp_op_desc *op) {
    const htp_expert_params *p = &op->p.expert;
    if (p->x_q8 > 1) return HTP_E_BAD_OP;
    uint32_t fmt[3];
    if (htp_expert_formats(p, fmt) != HTP_OK) return HTP_E_UNSUPPORTED;
    const uint32_t d = p->d_model, ff = p->d_ff, T = p->n_tokens, R = p->n_routes, E = p->n_experts;
    if (!d || !ff || d % 32 || ff % 32 || !p->capacity) return HTP_E_INVALID;
    if (p->x_q8 && op->act != HTP_ACT_Q8) return HTP_E_INVALID; /* Q8 rows need Q8 products */
    const htp_status gs = glu_check(p->glu, p->glu_alpha, p->glu_limit);
    if (gs != HTP_OK) return gs;
    if (!p->has_bias && (p->bias_up || p->bias_down)) return HTP_E_BAD_OP;
    if (p->has_bias && (p->bias_up % 4 || p->bias_down % 4)) return HTP_E_INVALID;
    const float *x = NULL, *w;
    const int32_t *tok_s, *exp_s, *slot_s;
    const uint8_t *xr = NULL;
    float *y;
    if (p->x_q8) GET(0, q8_rows_bytes(T, d), RD, 4, xr);
    else GET(0, nbytes3(T, d, 4), RD, 4, x);
    GET(1, nbytes(R, 4), RD, 4, tok_s);
    GET(2, nbytes(R, 4), RD, 4, exp_s);
    GET(3, nbytes(R, 4), RD, 4, w);
    GET(4, nbytes(E, 4), RD, 4, slot_s);
    GET(8, nbytes3(T, d, 4), WR, 4, y);
    const float *bias[3] = {NULL, NULL, NULL};
    if (p->has_bias) { /* gate's rows at the reference, up's and down's at their offsets */
        const uint64_t gb = nbytes3(E, ff, 4), db = nbytes3(E, d, 4);
        uint64_t span = gb;
        if (p->bias_up > UINT64_MAX - gb || p->bias_down > UINT64_MAX - db) return HTP_E_BOUNDS;
        span = HTP_MAX(span, HTP_MAX(p->bias_up + gb, p->bias_down + db));
        const uint8_t *bb;
        GET(9, span, RD, 4, bb);
        bias[0] = (const float *)bb;
        bias[1] = (const float *)(bb + p->bias_up);
        bias[2] = (const float *)(bb + p->bias_down);
    }
    if (R == 0) return HTP_OK;
    /* Index arrays are copied before they are checked, so a submitter writing to them while
     * the op runs cannot steer the kernels outside the buffers. */
    int32_t *idx = (int32_t *)malloc(((size_t)2 * R + E) * 4);
    if (!idx) return HTP_E_NOMEM;
    int32_t *tokens = idx, *experts = idx + R, *slot = idx + 2 * (size_t)R;
    memcpy(tokens, tok_s, (size_t)R * 4);
    memcpy(experts, exp_s, (size_t)R * 4);
    memcpy(slot, slot_s, (size_t)E * 4);
    htp_status st = HTP_OK;
    int32_t max_slot = -1;
    for (uint32_t r = 0; r < R && st == HTP_OK; r++) {
        if (tokens[r] < 0 || (uint32_t)tokens[r] >= T) st = HTP_E_INVALID;
        else if (experts[r] < 0 || (uint32_t)experts[r] >= E) st = HTP_E_INVALID;
        else if (slot[experts[r]] < 0) st = HTP_E_NOT_RESIDENT;
        else if (slot[experts[r]] > max_slot) max_slot = slot[experts[r]];
    }
    const uint8_t *planes[3] = {NULL, NULL, NULL};
    const uint64_t need[3] = {htp_matrix_bytes(fmt[0], ff, d), htp_matrix_bytes(fmt[1], ff, d),
                              htp_matrix_bytes(fmt[2], d, ff)};
    for (int j = 0; j < 3 && st == HTP_OK; j++) {
        /* slots must not overlap, and the highest routed slot must end inside the plane */
        if (max_slot > 0 && p->slot_stride[j] < need[j]) {
            st = HTP_E_INVALID;
            break;
        }
        uint64_t span;
        if (!mul_ok((uint64_t)max_slot, p->slot_stride[j], &span) || span > UINT64_MAX - need[j]) {
            st = HTP_E_BOUNDS;
            break;
        }
        void *pp;
        st = ref_get(b, &op->ref[5 + j], span + need[j], RD, 1, &pp);
        planes[j] = (const uint8_t *)pp;
    }
    const htp_act_q8 rows = xr ? htp_q8_rows(xr, T, d) : (htp_act_q8){NULL, NULL, NULL};
    if (st == HTP_OK)
        st = htp_exec_expert(&b->ex, p, op->act, x, tokens, experts, w, slot, planes, y, xr ? &rows : NULL,
                             bias);
    free(idx);
    return st;
}

static htp_status exec_get_rows(htp_backend *b, const htp_op_desc *op) {
    const htp_get_rows_params *p = &op->p.get_rows;
    if (!p->n_rows || !p->n_cols) return HTP_E_INVALID;
    uint64_t need;
    switch (p->format) {
    case HTP_FMT_F32: need = nbytes3(p->n_rows, p->n_cols, 4); break;
    case HTP_FMT_F16: need = nbytes3(p->n_rows, p->n_cols, 2); break;
    case HTP_FMT_Q4_0_T32R4:
    case HTP_FMT_Q8_0_T32R4:
    case HTP_FMT_Q4_K_T32R4:
    case HTP_FMT_Q6_K_T32R4:
    case HTP_FMT_MXFP4_T32R4:
    case HTP_FMT_Q5_K_T32R4:
    case HTP_FMT_IQ4_NL_T32R4:
    case HTP_FMT_Q4_1_T32R4:
    case HTP_FMT_Q5_0_T32R4:
    case HTP_FMT_Q5_1_T32R4:
    case HTP_FMT_IQ4_XS_T32R4:
    case HTP_FMT_F16_T32R4:
    case HTP_FMT_BF16_T32R4:
        if (p->n_cols % 32) return HTP_E_INVALID;
        need = htp_matrix_bytes(p->format, p->n_rows, p->n_cols);
        break;
    default: return HTP_E_INVALID;
    }
    const uint8_t *table;
    const int32_t *ids_s;
    float *out;
    GET(0, need, RD, 1, table);
    GET(1, nbytes(p->t, 4), RD, 4, ids_s);
    GET(2, nbytes3(p->t, p->n_cols, 4), WR, 4, out);
    int32_t *ids = (int32_t *)malloc((size_t)p->t * 4 + 4);
    if (!ids) return HTP_E_NOMEM;
    memcpy(ids, ids_s, (size_t)p->t * 4);
    for (uint32_t i = 0; i < p->t; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= p->n_rows) {
            free(ids);
            return HTP_E_INVALID;
        }
    htp_exec_get_rows(p, table, ids, out);
    free(ids);
    return HTP_OK;
}

/* Bytes spanned by `rows` rows of `cols` 4-byte elements, `ld` elements apart (ld >= cols). */
static uint64_t span_bytes(uint32_t rows, uint32_t cols, uint32_t ld) {
    if (!rows || !cols) return 0;
    uint64_t r;
    if (!mul_ok((uint64_t)rows - 1, ld, &r) || r > UINT64_MAX / 8) return UINT64_MAX;
    return (r + cols) * 4;
}

static int overlaps(const void *a, uint64_t na, const void *b, uint64_t nb) {
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return na && nb && x < y + nb && y < x + na;
}

htp_status htp_host_execute(htp_backend *b, const htp_op_desc *op) {
    const uint32_t n = refs_of(op);
    if (n == UINT32_MAX) return HTP_E_BAD_OP;
    if (op->n_refs != n || op->flags) return HTP_E_BAD_OP;
    static const htp_ref zero;
    for (uint32_t i = n; i < HTP_MAX_REFS; i++)
        if (memcmp(&op->ref[i], &zero, sizeof zero)) return HTP_E_BAD_OP;
    if (op->act > HTP_ACT_Q8) return HTP_E_INVALID;
    switch (op->opcode) {
    case HTP_OP_NOP: return HTP_OK;
    case HTP_OP_GEMM: {
        const htp_gemm_params *p = &op->p.gemm;
        if (!htp_is_dense_format(p->format)) return HTP_E_INVALID;
        if (p->k == 0 || p->k % 32 || p->n == 0 || p->ldx < p->k || p->ldy < p->n) return HTP_E_INVALID;
        if ((p->n_more < 1 && p->n_b) || (p->n_more < 2 && p->n_c)) return HTP_E_BAD_OP;
        if ((p->n_more >= 1 && !p->n_b) || (p->n_more >= 2 && !p->n_c)) return HTP_E_INVALID;
        if (p->x_q8 > 1) return HTP_E_BAD_OP;
        if (p->x_q8 && (op->act != HTP_ACT_Q8 || p->ldx != p->k)) return HTP_E_INVALID;
        if (p->x_q8 && HTP_IS_FLOAT_TILE(p->format)) return HTP_E_INVALID; /* fp32 products only */
        const float *x = NULL;
        const uint8_t *xr = NULL;
        htp_gemm_mat m[3];
        GET(0, htp_matrix_bytes(p->format, p->n, p->k), RD, 1, m[0].w);
        if (p->x_q8) GET(1, q8_rows_bytes(p->t, p->k), RD, 4, xr);
        else GET(1, nbytes3(p->t, p->ldx, 4), RD, 4, x);
        GET(2, nbytes3(p->t, p->ldy, 4), WR, 4, m[0].y);
        m[0].n = p->n, m[0].ldy = p->ldy;
        const uint32_t more[2] = {p->n_b, p->n_c};
        for (uint32_t i = 0; i < p->n_more; i++) {
            GET(3 + 2 * i, htp_matrix_bytes(p->format, more[i], p->k), RD, 1, m[1 + i].w);
            GET(4 + 2 * i, nbytes3(p->t, more[i], 4), WR, 4, m[1 + i].y);
            m[1 + i].n = more[i], m[1 + i].ldy = more[i];
        }
        const htp_act_q8 rows = xr ? htp_q8_rows(xr, p->t, p->k) : (htp_act_q8){NULL, NULL, NULL};
        return htp_exec_gemm(&b->ex, m, 1 + p->n_more, p->format, p->k, x, p->t, p->ldx, op->act,
                             xr ? &rows : NULL);
    }
    case HTP_OP_EXPERT: return exec_expert(b, op);
    case HTP_OP_GET_ROWS: return exec_get_rows(b, op);
    case HTP_OP_RMS_NORM: {
        const htp_rms_norm_params *p = &op->p.rms_norm;
        if (p->d == 0 || p->n_groups == 0 || !(p->eps >= 0.0f) || p->has_weight > 1) return HTP_E_INVALID;
        const uint64_t bytes = nbytes(nbytes3(p->t, p->n_groups, 1), (uint64_t)p->d * 4);
        const float *x, *w = NULL;
        float *out;
        GET(0, bytes, RD, 4, x);
        if (p->has_weight) GET(1, nbytes(p->d, 4), RD, 4, w);
        GET(p->has_weight ? 2 : 1, bytes, WR, 4, out);
        htp_exec_rms_norm(&b->ex, p, x, w, out);
        return HTP_OK;
    }
    case HTP_OP_ROPE: {
        const htp_rope_params *p = &op->p.rope;
        if (p->n_rot > p->head_dim || p->n_rot % 2 || p->mode > HTP_ROPE_NEOX || !(p->freq_base > 0.0f))
            return HTP_E_INVALID;
        if (p->yarn > 1 || (p->yarn && !(isfinite(p->ext_factor) && isfinite(p->attn_factor) &&
                                         isfinite(p->corr_low) && isfinite(p->corr_high) &&
                                         p->freq_scale > 0.0f && isfinite(p->freq_scale))))
            return HTP_E_INVALID;
        float *x;
        const int32_t *pos;
        GET(0, nbytes(nbytes3(p->t, p->n_heads, 1), (uint64_t)p->head_dim * 4), WR, 4, x);
        GET(1, nbytes(p->t, 4), RD, 4, pos);
        return htp_exec_rope(&b->ex, p, x, pos);
    }
    case HTP_OP_ATTENTION: {
        const htp_attention_params *p = &op->p.attention;
        if (!p->n_q_heads || !p->n_kv_heads || !p->dk || !p->dv || p->n_q_heads % p->n_kv_heads ||
            p->products > HTP_PRODUCTS_BF16_PV || p->has_sinks > 1 || (p->window && !p->causal))
            return HTP_E_INVALID;
        const float *q, *k, *v, *sinks = NULL;
        float *out;
        const uint64_t tk = (uint64_t)p->t + p->n_ctx; /* key rows */
        if (tk > UINT32_MAX) return HTP_E_INVALID;
        GET(0, nbytes(nbytes3(p->t, p->n_q_heads, 1), (uint64_t)p->dk * 4), RD, 4, q);
        GET(1, nbytes(nbytes3(tk, p->n_kv_heads, 1), (uint64_t)p->dk * 4), RD, 4, k);
        GET(2, nbytes(nbytes3(tk, p->n_kv_heads, 1), (uint64_t)p->dv * 4), RD, 4, v);
        if (p->has_sinks) GET(3, nbytes(p->n_q_heads, 4), RD, 4, sinks);
        GET(3 + p->has_sinks, nbytes(nbytes3(p->t, p->n_q_heads, 1), (uint64_t)p->dv * 4), WR, 4, out);
        return htp_exec_attention(&b->ex, p, q, k, v, sinks, out);
    }
    case HTP_OP_SILU:
    case HTP_OP_SWIGLU: {
        const htp_eltwise_params *p = &op->p.eltwise;
        const htp_status gs = glu_check(p->glu, p->alpha, p->limit);
        if (gs != HTP_OK) return gs;
        /* SiLU is SwiGLU's activation alone; ReGLU is the expert op's only */
        if (p->glu == HTP_GLU_REGLU || (op->opcode == HTP_OP_SILU && p->glu != HTP_GLU_SWIGLU))
            return HTP_E_BAD_OP;
        const uint64_t bytes = nbytes(p->n, 4);
        const float *g, *u = NULL;
        float *out;
        GET(0, bytes, RD, 4, g);
        if (op->opcode == HTP_OP_SWIGLU) GET(1, bytes, RD, 4, u);
        GET(op->opcode == HTP_OP_SWIGLU ? 2 : 1, bytes, WR, 4, out);
        /* out is an input element for element (in place) or apart from it: any other overlap
         * would make the result depend on the order the pool's threads run in */
        if ((overlaps(g, bytes, out, bytes) && g != out) || (u && overlaps(u, bytes, out, bytes) && u != out))
            return HTP_E_INVALID;
        htp_exec_swiglu(&b->ex, g, u, p->n, p->glu, p->alpha, p->limit, out);
        return HTP_OK;
    }
    case HTP_OP_ROUTER_TOPK: {
        const htp_router_params *p = &op->p.router;
        if (p->k == 0 || p->k > p->n_experts || p->gating > HTP_GATING_SIGMOID || p->has_bias > 1)
            return HTP_E_INVALID;
        const float *logits, *bias = NULL;
        int32_t *ids;
        float *wts;
        const uint32_t o = p->has_bias ? 1 : 0;
        GET(0, nbytes3(p->t, p->n_experts, 4), RD, 4, logits);
        if (p->has_bias) GET(1, nbytes(p->n_experts, 4), RD, 4, bias);
        GET(1 + o, nbytes3(p->t, p->k, 4), WR, 4, ids);
        GET(2 + o, nbytes3(p->t, p->k, 4), WR, 4, wts);
        return htp_exec_router(&b->ex, p, logits, bias, ids, wts);
    }
    case HTP_OP_CONV1D: {
        const htp_conv1d_params *p = &op->p.conv1d;
        if (!p->channels || !p->taps || p->has_state > 1) return HTP_E_INVALID;
        const uint64_t row = nbytes(p->channels, 4);
        const float *x, *w, *state = NULL;
        float *out;
        GET(0, nbytes(p->t, row), RD, 4, x);
        GET(1, nbytes3(p->channels, p->taps, 4), RD, 4, w);
        if (p->has_state) GET(2, nbytes(p->taps - 1, row), RD, 4, state);
        GET(p->has_state ? 3 : 2, nbytes(p->t, row), WR, 4, out);
        return htp_exec_conv1d(p, x, w, state, out);
    }
    case HTP_OP_MATMUL_F32: {
        const htp_matmul_params *p = &op->p.matmul;
        if (!p->k || !p->n) return HTP_E_INVALID;
        const float *x, *w;
        float *y;
        GET(0, nbytes3(p->t, p->k, 4), RD, 4, x);
        GET(1, nbytes3(p->k, p->n, 4), RD, 4, w);
        GET(2, nbytes3(p->t, p->n, 4), WR, 4, y);
        return htp_exec_matmul_f32(&b->ex, p, x, w, y);
    }
    case HTP_OP_ADD:
    case HTP_OP_MUL: {
        const htp_binary_params *p = &op->p.binary;
        if (p->lda < p->cols || p->ldb < p->cols || p->ldo < p->cols) return HTP_E_INVALID;
        const float *x, *y;
        float *out;
        const uint64_t na = span_bytes(p->rows, p->cols, p->lda);
        const uint64_t nb = span_bytes(p->rows, p->cols, p->ldb);
        const uint64_t no = span_bytes(p->rows, p->cols, p->ldo);
        GET(0, na, RD, 4, x);
        GET(1, nb, RD, 4, y);
        GET(2, no, WR, 4, out);
        /* out is an input element for element (in place) or apart from it: any other overlap
         * would make the result depend on the order rows are done in */
        if ((overlaps(x, na, out, no) && !(x == out && p->lda == p->ldo)) ||
            (overlaps(y, nb, out, no) && !(y == out && p->ldb == p->ldo)))
            return HTP_E_INVALID;
        htp_exec_binary(&b->ex, op->opcode, p, x, y, out);
        return HTP_OK;
    }
    case HTP_OP_COPY_ROWS: {
        const htp_copy_params *p = &op->p.copy;
        if (!p->rep || p->ld_src < p->cols || p->ld_dst < p->cols) return HTP_E_INVALID;
        const uint32_t src_rows = p->rows ? (p->rows - 1) / p->rep + 1 : 0;
        const uint64_t ns = span_bytes(src_rows, p->cols, p->ld_src);
        const uint64_t nd = span_bytes(p->rows, p->cols, p->ld_dst);
        const uint32_t *src;
        uint32_t *dst;
        GET(0, ns, RD, 4, src);
        GET(1, nd, WR, 4, dst);
        if (overlaps(src, ns, dst, nd)) return HTP_E_INVALID;
        htp_exec_copy_rows(&b->ex, p, src, dst);
        return HTP_OK;
    }
    case HTP_OP_FILL: {
        const htp_fill_params *p = &op->p.fill;
        if (p->reserved) return HTP_E_BAD_OP;
        uint32_t *out;
        GET(0, nbytes(p->n, 4), WR, 4, out);
        htp_exec_fill(p, out);
        return HTP_OK;
    }
    case HTP_OP_QUANTIZE: {
        const htp_quantize_params *p = &op->p.quantize;
        if (p->d == 0 || p->d % 32) return HTP_E_INVALID;
        const float *x;
        uint8_t *out;
        GET(0, nbytes3(p->t, p->d, 4), RD, 4, x);
        GET(1, q8_rows_bytes(p->t, p->d), WR, 4, out);
        htp_exec_quantize(&b->ex, p, x, out);
        return HTP_OK;
    }
    default: return HTP_E_BAD_OP;
    }
}

/* ---- submission and fences ---- */
htp_status htp_op_submit(htp_backend *b, const htp_op_desc *op, uint64_t *fence) {
    if (!b || !op || !fence) return HTP_E_INVALID;
    *fence = 0;
    enter(b);
    const htp_status st = b->vt->submit(b, op, fence);
    leave(b);
    return st;
}

static htp_status host_submit(htp_backend *b, const htp_op_desc *op, uint64_t *fence) {
    const uint64_t f = b->next_fence + 1;
    htp_done *slot = &b->done[(f - 1) % HTP_QUEUE_DEPTH];
    if (slot->fence && !slot->consumed)
        return HTP_E_CAPACITY; /* HTP_QUEUE_DEPTH completions nobody has waited for */
    htp_op_desc local;
    slot->times.submitted_ns = mono_ns();
    memcpy(&local, op, sizeof local);
    slot->times.started_ns = mono_ns();
    slot->status = (int32_t)htp_host_execute(b, &local);
    slot->times.completed_ns = mono_ns();
    slot->times.reserved = 0;
    slot->fence = f;
    slot->consumed = 0;
    b->next_fence = f;
    *fence = f;
    return HTP_OK;
}

htp_status htp_fence_wait(htp_backend *b, uint64_t fence, uint32_t timeout_ms, htp_status *op_status) {
    return htp_fence_wait_timed(b, fence, timeout_ms, op_status, NULL);
}

htp_status htp_fence_wait_timed(htp_backend *b, uint64_t fence, uint32_t timeout_ms,
                                htp_status *op_status, htp_op_times *times) {
    if (!b || !op_status) return HTP_E_INVALID;
    enter(b);
    const htp_status st = b->vt->wait(b, fence, timeout_ms, op_status, times);
    leave(b);
    return st;
}

static htp_status host_wait(htp_backend *b, uint64_t fence, uint32_t timeout_ms,
                            htp_status *op_status, htp_op_times *times) {
    (void)timeout_ms; /* a host op completed when it was submitted */
    htp_done *slot = &b->done[(fence ? fence - 1 : 0) % HTP_QUEUE_DEPTH];
    if (fence == 0 || fence > b->next_fence || slot->fence != fence || slot->consumed)
        return HTP_E_FENCE;
    slot->consumed = 1;
    *op_status = (htp_status)slot->status;
    if (times) *times = slot->times;
    return HTP_OK;
}

htp_status htp_op_run(htp_backend *b, const htp_op_desc *op) {
    uint64_t f;
    htp_status st = htp_op_submit(b, op, &f);
    if (st != HTP_OK) return st;
    htp_status op_st = HTP_OK;
    st = htp_fence_wait(b, f, UINT32_MAX, &op_st);
    return st != HTP_OK ? st : op_st;
}

htp_status htp_op_run_tmp(htp_backend *b, const htp_op_desc *op, const htp_buffer_desc *tmp,
                          uint32_t n_tmp) {
    if (!b || !op || (n_tmp && !tmp) || n_tmp > HTP_MAX_REFS) return HTP_E_INVALID;
    return b->vt->run_tmp(b, op, tmp, n_tmp);
}

static htp_status host_run_tmp(htp_backend *b, const htp_op_desc *op, const htp_buffer_desc *tmp,
                               uint32_t n_tmp) {
    for (uint32_t i = 0; i < n_tmp; i++)
        if (tmp[i].fd != -1 || !tmp[i].host_addr || !tmp[i].size || tmp[i].offset ||
            !tmp[i].flags || (tmp[i].flags & ~(uint32_t)(HTP_BUF_READ | HTP_BUF_WRITE)))
            return HTP_E_INVALID;
    enter(b);
    uint32_t ids[HTP_MAX_REFS];
    uint32_t n = 0, slot = 0;
    htp_status st = HTP_OK;
    for (; n < n_tmp; n++) {
        while (slot < HTP_MAX_BUFFERS && b->bufs[slot].in_use) slot++;
        if (slot == HTP_MAX_BUFFERS) {
            st = HTP_E_CAPACITY;
            break;
        }
        htp_buf *x = &b->bufs[slot];
        memset(x, 0, sizeof(*x));
        x->base = (uint8_t *)(uintptr_t)tmp[n].host_addr;
        x->size = tmp[n].size;
        x->flags = tmp[n].flags;
        x->in_use = 1;
        ids[n] = slot + 1;
    }
    if (st == HTP_OK) {
        htp_op_desc local;
        memcpy(&local, op, sizeof local);
        for (uint32_t i = 0; i < HTP_MAX_REFS && st == HTP_OK; i++) {
            const uint32_t id = local.ref[i].buffer;
            if (id >= HTP_TMP_BUFFER) {
                if (id - HTP_TMP_BUFFER >= n_tmp) st = HTP_E_BAD_BUFFER;
                else local.ref[i].buffer = ids[id - HTP_TMP_BUFFER];
            }
        }
        if (st == HTP_OK) st = htp_host_execute(b, &local);
    }
    for (uint32_t i = 0; i < n; i++) memset(&b->bufs[ids[i] - 1], 0, sizeof(htp_buf));
    leave(b);
    return st;
}

/* ---- diagnostics ---- */
/* The clock runs from a barrier every thread has reached to one every thread has reached after
 * its chain: all of them run the whole time it measures. A clock around htp_parallel counted
 * the time the pool's threads took to wake (milliseconds on a VM whose idle vCPUs halt) as
 * time of a ~3 ms chain, and a 2-thread peak came out at half, now and then. */
typedef struct peak_ctx {
    htp_pool *pool;
    int32_t (*fn)(uint64_t iters);
    uint64_t iters;
    struct timespec t0, t1; /* thread 0's, at the two barriers */
    volatile int32_t sink[64];
} peak_ctx;

static void peak_task(void *arg, uint32_t ith, uint32_t nth) {
    (void)nth;
    peak_ctx *c = (peak_ctx *)arg;
    htp_barrier(c->pool);
    if (ith == 0) clock_gettime(CLOCK_MONOTONIC, &c->t0);
    c->sink[ith % 64] = c->fn(c->iters);
    htp_barrier(c->pool);
    if (ith == 0) clock_gettime(CLOCK_MONOTONIC, &c->t1);
}

htp_status htp_bench_dot_peak(htp_backend *b, uint64_t iters, double *macs_per_s) {
    return htp_bench_mac_peak(b, 0, iters, macs_per_s);
}

htp_status htp_bench_mac_peak(htp_backend *b, uint32_t kind, uint64_t iters, double *macs_per_s) {
    if (!b || !macs_per_s || iters == 0 || kind > 3) return HTP_E_INVALID;
    return b->vt->mac_peak(b, kind, iters, macs_per_s);
}

static htp_status host_mac_peak(htp_backend *b, uint32_t chain, uint64_t iters,
                                double *macs_per_s) {
    const htp_isa *isa = b->ex.isa; /* chain: 0 int8 dot, 1 fp32 FMA, 2 bf16, 3 int8 + step */
    int32_t (*const fns[4])(uint64_t) = {isa->dot_peak, isa->fma_peak, isa->bf16_peak,
                                         isa->dotstep_peak};
    const uint32_t pers[4] = {isa->dot_macs_per_iter, isa->fma_macs_per_iter,
                              isa->bf16_macs_per_iter, isa->dotstep_macs_per_iter};
    int32_t (*fn)(uint64_t) = fns[chain];
    const uint32_t per = pers[chain];
    if (!fn || (chain == 2 && !htp_cpu_bf16())) return HTP_E_UNSUPPORTED;
    enter(b);
    peak_ctx c = {.pool = b->ex.pool, .fn = fn, .iters = iters};
    htp_parallel(b->ex.pool, peak_task, &c);
    const double sec =
        (double)(c.t1.tv_sec - c.t0.tv_sec) + 1e-9 * (double)(c.t1.tv_nsec - c.t0.tv_nsec);
    *macs_per_s = (double)iters * per * htp_pool_nth(b->ex.pool) / sec;
    leave(b);
    return HTP_OK;
}

static const htp_backend_vt host_vt = {
    host_open, host_threads, host_configure, host_reg,     host_unreg,
    host_submit, host_wait,  host_run_tmp,   host_mac_peak,
};

static const htp_backend_vt remote_vt = {
    remote_open,   remote_threads, remote_configure, remote_reg,      remote_unreg,
    remote_submit, remote_wait,    remote_run_tmp,   remote_mac_peak,
};
