/* estream-htp's freestanding Hexagon runtime: program entry, Linux system calls, memory, strings
 * and the little stdio the executor needs — no C library, no threads. Built with the library's
 * sources into the Hexagon executor (tools/htp_executor_main.c), which runs as a Linux user-mode
 * program: under qemu-hexagon here (the "DSP" process of the `hexagon` backend).
 *
 * System calls: `trap0(#1)` with the number in r6 and arguments in r0-r5, the result (or
 * -errno) in r0; the numbers are Linux's asm-generic table for 32-bit architectures (mmap is
 * mmap2, its offset in 4096-byte units; time-taking calls use the 32-bit timespec forms).
 *
 * Memory: a size-class allocator over anonymous mmap (classes of 2^7 .. 2^20 bytes carved from
 * 4 MiB chunks and recycled through per-class free lists; larger blocks are mapped and unmapped
 * whole). Every block is 128-byte aligned, which HVX vector loads want. */
#define HX_RUNTIME_IMPL 1
#include <hx_libc.h>

int errno;

/* ---- system calls ---- */
#define SYS_eventfd2 19
#define SYS_ftruncate64 46
#define SYS_close 57
#define SYS_read 63
#define SYS_write 64
#define SYS_ppoll 73
#define SYS_exit_group 94
#define SYS_clock_gettime 113
#define SYS_sched_yield 124
#define SYS_getpid 172
#define SYS_recvfrom 207
#define SYS_sendmsg 211
#define SYS_recvmsg 212
#define SYS_munmap 215
#define SYS_mmap2 222

static long hx_syscall(long n, long a, long b, long c, long d, long e, long f) {
    register long r0 __asm__("r0") = a;
    register long r1 __asm__("r1") = b;
    register long r2 __asm__("r2") = c;
    register long r3 __asm__("r3") = d;
    register long r4 __asm__("r4") = e;
    register long r5 __asm__("r5") = f;
    register long r6 __asm__("r6") = n;
    __asm__ __volatile__("trap0(#1)"
                         : "+r"(r0)
                         : "r"(r1), "r"(r2), "r"(r3), "r"(r4), "r"(r5), "r"(r6)
                         : "memory");
    return r0;
}

/* a negative errno becomes -1 with errno set */
static long ret(long r) {
    if (r < 0 && r > -4096) {
        errno = (int)-r;
        return -1;
    }
    return r;
}

ssize_t read(int fd, void *buf, size_t n) { return (ssize_t)ret(hx_syscall(SYS_read, fd, (long)buf, (long)n, 0, 0, 0)); }
ssize_t write(int fd, const void *buf, size_t n) {
    return (ssize_t)ret(hx_syscall(SYS_write, fd, (long)buf, (long)n, 0, 0, 0));
}
int close(int fd) { return (int)ret(hx_syscall(SYS_close, fd, 0, 0, 0, 0, 0)); }
pid_t getpid(void) { return (pid_t)hx_syscall(SYS_getpid, 0, 0, 0, 0, 0, 0); }
int sched_yield(void) { return (int)ret(hx_syscall(SYS_sched_yield, 0, 0, 0, 0, 0, 0)); }
int eventfd(unsigned int initval, int flags) {
    return (int)ret(hx_syscall(SYS_eventfd2, (long)initval, flags, 0, 0, 0, 0));
}
int ftruncate(int fd, off_t len) {
    /* a 64-bit argument takes an even/odd register pair: r2:r3 (r1 is padding) */
    return (int)ret(hx_syscall(SYS_ftruncate64, fd, 0, (long)(uint32_t)len, (long)(uint32_t)((uint64_t)len >> 32), 0, 0));
}
long sysconf(int name) { return name == _SC_PAGESIZE ? 4096 : (errno = EINVAL, -1); }

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    if (off & 4095) {
        errno = EINVAL;
        return MAP_FAILED;
    }
    const long r = hx_syscall(SYS_mmap2, (long)addr, (long)len, prot, flags, fd, (long)(off >> 12));
    if (r < 0 && r > -4096) {
        errno = (int)-r;
        return MAP_FAILED;
    }
    return (void *)r;
}
int munmap(void *addr, size_t len) { return (int)ret(hx_syscall(SYS_munmap, (long)addr, (long)len, 0, 0, 0, 0)); }

int clock_gettime(int clk, struct timespec *ts) {
    return (int)ret(hx_syscall(SYS_clock_gettime, clk, (long)ts, 0, 0, 0, 0));
}

int poll(struct pollfd *fds, unsigned int n, int timeout_ms) {
    struct timespec ts, *tp = NULL;
    if (timeout_ms >= 0) {
        ts.tv_sec = timeout_ms / 1000;
        ts.tv_nsec = (long)(timeout_ms % 1000) * 1000000L;
        tp = &ts;
    }
    return (int)ret(hx_syscall(SYS_ppoll, (long)fds, (long)n, (long)tp, 0, 8, 0));
}

ssize_t sendmsg(int fd, const struct msghdr *m, int flags) {
    return (ssize_t)ret(hx_syscall(SYS_sendmsg, fd, (long)m, flags, 0, 0, 0));
}
ssize_t recvmsg(int fd, struct msghdr *m, int flags) {
    return (ssize_t)ret(hx_syscall(SYS_recvmsg, fd, (long)m, flags, 0, 0, 0));
}
ssize_t recv(int fd, void *buf, size_t n, int flags) {
    return (ssize_t)ret(hx_syscall(SYS_recvfrom, fd, (long)buf, (long)n, flags, 0, 0));
}
struct cmsghdr *hx_cmsg_next(struct msghdr *m, struct cmsghdr *c) {
    if (c->cmsg_len < sizeof(struct cmsghdr)) return NULL;
    unsigned char *next = (unsigned char *)c + HX_CMSG_ALIGN(c->cmsg_len);
    unsigned char *end = (unsigned char *)m->msg_control + m->msg_controllen;
    if (next + sizeof(struct cmsghdr) > end) return NULL;
    struct cmsghdr *n = (struct cmsghdr *)next;
    if (next + HX_CMSG_ALIGN(n->cmsg_len) > end) return NULL;
    return n;
}

_Noreturn void exit(int status) {
    for (;;) hx_syscall(SYS_exit_group, status, 0, 0, 0, 0, 0);
}
_Noreturn void abort(void) {
    static const char msg[] = "estream-htp hexagon runtime: abort\n";
    write(2, msg, sizeof msg - 1);
    exit(134);
}

/* ---- entry: the kernel leaves argc at sp[0] and argv from sp[1] ---- */
int main(int argc, char **argv);
__attribute__((used)) _Noreturn void hx_start_c(int argc, char **argv) { exit(main(argc, argv)); }
__asm__(".text\n"
        ".globl _start\n"
        ".type _start,@function\n"
        "_start:\n"
        "  r0 = memw(r29+#0)\n"
        "  r1 = add(r29, #4)\n"
        "  r29 = and(r29, #-128)\n"
        "  r30 = #0\n"
        "  r31 = #0\n"
        "  call hx_start_c\n"
        ".size _start, .-_start\n");

/* ---- strings (byte loops with a word fast path; -fno-builtin keeps them calls-free) ---- */
void *memcpy(void *restrict d, const void *restrict s, size_t n) {
    unsigned char *dp = (unsigned char *)d;
    const unsigned char *sp = (const unsigned char *)s;
    if ((((uintptr_t)dp | (uintptr_t)sp) & 7) == 0) {
        for (; n >= 8; n -= 8, dp += 8, sp += 8) *(uint64_t *)dp = *(const uint64_t *)sp;
    }
    for (; n; n--) *dp++ = *sp++;
    return d;
}
/* what clang calls for copies of large aligned structs (descriptors) */
void *__hexagon_memcpy_likely_aligned_min32bytes_mult8bytes(void *d, const void *s, size_t n) {
    return memcpy(d, s, n);
}
void *memmove(void *d, const void *s, size_t n) {
    unsigned char *dp = (unsigned char *)d;
    const unsigned char *sp = (const unsigned char *)s;
    if (dp == sp || n == 0) return d;
    if (dp < sp || dp >= sp + n) {
        for (size_t i = 0; i < n; i++) dp[i] = sp[i];
    } else {
        for (size_t i = n; i-- > 0;) dp[i] = sp[i];
    }
    return d;
}
void *memset(void *d, int c, size_t n) {
    unsigned char *dp = (unsigned char *)d;
    if (((uintptr_t)dp & 7) == 0) {
        uint64_t v = (unsigned char)c;
        v |= v << 8;
        v |= v << 16;
        v |= v << 32;
        for (; n >= 8; n -= 8, dp += 8) *(uint64_t *)dp = v;
    }
    for (; n; n--) *dp++ = (unsigned char)c;
    return d;
}
int memcmp(const void *a, const void *b, size_t n) {
    const unsigned char *x = (const unsigned char *)a, *y = (const unsigned char *)b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
    return 0;
}
size_t strlen(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}
long strtol(const char *s, char **end, int base) {
    const char *p = s;
    long v = 0;
    int neg = 0, any = 0;
    if (base != 10) base = 10; /* the executor parses one decimal fd number */
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '-' || *p == '+') neg = *p++ == '-';
    for (; *p >= '0' && *p <= '9'; p++, any = 1) v = v * 10 + (*p - '0');
    if (end) *end = (char *)(any ? p : s);
    return neg ? -v : v;
}

/* ---- memory ---- */
#define HX_HDR 128u /* block header; keeps payloads 128-byte aligned */
#define HX_MIN_CLASS 7
#define HX_MAX_CLASS 20
#define HX_CHUNK (4u << 20)
#define HX_BIG 0xffffu

typedef struct hx_block {
    uint32_t cls;     /* size class, or HX_BIG for a block mapped on its own */
    uint32_t map_len; /* HX_BIG: bytes mapped (header included) */
    struct hx_block *next_free;
} hx_block;

static hx_block *free_list[HX_MAX_CLASS + 1];
static unsigned char *chunk_ptr, *chunk_end;

static void *map_anon(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void *malloc(size_t n) {
    if (n > 0x7fffffffu - 2 * 4096) {
        errno = ENOMEM;
        return NULL;
    }
    uint32_t cls = HX_MIN_CLASS;
    while (cls <= HX_MAX_CLASS && ((size_t)1 << cls) < n) cls++;
    hx_block *b;
    if (cls > HX_MAX_CLASS) {
        const size_t len = (n + HX_HDR + 4095) & ~(size_t)4095;
        b = (hx_block *)map_anon(len);
        if (!b) {
            errno = ENOMEM;
            return NULL;
        }
        b->cls = HX_BIG;
        b->map_len = (uint32_t)len;
        return (unsigned char *)b + HX_HDR;
    }
    if ((b = free_list[cls]) != NULL) {
        free_list[cls] = b->next_free;
        return (unsigned char *)b + HX_HDR;
    }
    const size_t need = HX_HDR + ((size_t)1 << cls);
    if (!chunk_ptr || (size_t)(chunk_end - chunk_ptr) < need) {
        unsigned char *c = (unsigned char *)map_anon(HX_CHUNK);
        if (!c) {
            errno = ENOMEM;
            return NULL;
        }
        chunk_ptr = c; /* the rest of the old chunk is abandoned (< 1 MiB + header) */
        chunk_end = c + HX_CHUNK;
    }
    b = (hx_block *)chunk_ptr;
    chunk_ptr += need;
    b->cls = cls;
    b->map_len = 0;
    return (unsigned char *)b + HX_HDR;
}

void free(void *p) {
    if (!p) return;
    hx_block *b = (hx_block *)((unsigned char *)p - HX_HDR);
    if (b->cls == HX_BIG) {
        munmap(b, b->map_len);
        return;
    }
    b->next_free = free_list[b->cls];
    free_list[b->cls] = b;
}

static size_t usable(const void *p) {
    const hx_block *b = (const hx_block *)((const unsigned char *)p - HX_HDR);
    return b->cls == HX_BIG ? b->map_len - HX_HDR : (size_t)1 << b->cls;
}

void *calloc(size_t n, size_t size) {
    size_t total;
    if (__builtin_mul_overflow(n, size, &total)) {
        errno = ENOMEM;
        return NULL;
    }
    void *p = malloc(total);
    if (p) memset(p, 0, total);
    return p;
}

void *realloc(void *p, size_t n) {
    if (!p) return malloc(n);
    const size_t have = usable(p);
    if (n <= have) return p;
    void *q = malloc(n);
    if (!q) return NULL;
    memcpy(q, p, have);
    free(p);
    return q;
}

int posix_memalign(void **out, size_t align, size_t n) {
    if (align == 0 || (align & (align - 1)) || align > HX_HDR) return EINVAL;
    void *p = malloc(n ? n : 1);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

/* ---- pthreads (single-threaded) ---- */
int pthread_mutex_init(pthread_mutex_t *m, const void *attr) {
    (void)m;
    (void)attr;
    return 0;
}
int pthread_mutex_destroy(pthread_mutex_t *m) {
    (void)m;
    return 0;
}
int pthread_mutex_lock(pthread_mutex_t *m) {
    (void)m;
    return 0;
}
int pthread_mutex_unlock(pthread_mutex_t *m) {
    (void)m;
    return 0;
}
int pthread_cond_init(pthread_cond_t *c, const void *attr) {
    (void)c;
    (void)attr;
    return 0;
}
int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m) {
    (void)c;
    (void)m;
    return 0;
}
int pthread_cond_broadcast(pthread_cond_t *c) {
    (void)c;
    return 0;
}
int pthread_create(pthread_t *t, const void *attr, void *(*fn)(void *), void *arg) {
    (void)t;
    (void)attr;
    (void)fn;
    (void)arg;
    return EAGAIN;
}
int pthread_join(pthread_t t, void **r) {
    (void)t;
    (void)r;
    return 0;
}

/* ---- stdio ---- */
static const FILE hx_stdout = {1}, hx_stderr = {2};
FILE *const stdout = (FILE *)&hx_stdout;
FILE *const stderr = (FILE *)&hx_stderr;

static int put_u(char *b, unsigned long long v, unsigned base) {
    char tmp[24];
    int n = 0;
    do {
        const unsigned d = (unsigned)(v % base);
        tmp[n++] = (char)(d < 10 ? '0' + d : 'a' + d - 10);
        v /= base;
    } while (v);
    for (int i = 0; i < n; i++) b[i] = tmp[n - 1 - i];
    return n;
}

static int vfmt(int fd, const char *fmt, va_list ap) {
    char buf[512];
    int n = 0;
    for (const char *p = fmt; *p && n < (int)sizeof buf - 32; p++) {
        if (*p != '%') {
            buf[n++] = *p;
            continue;
        }
        p++;
        int lng = 0;
        while (*p == 'l' || *p == 'z') lng++, p++;
        switch (*p) {
        case 's': {
            const char *s = va_arg(ap, const char *);
            for (; s && *s && n < (int)sizeof buf - 32; s++) buf[n++] = *s;
            break;
        }
        case 'd': {
            long long v = lng > 1 ? va_arg(ap, long long) : (long long)va_arg(ap, long);
            if (v < 0) buf[n++] = '-', v = -v;
            n += put_u(buf + n, (unsigned long long)v, 10);
            break;
        }
        case 'u':
        case 'x': {
            unsigned long long v = lng > 1 ? va_arg(ap, unsigned long long) : va_arg(ap, unsigned long);
            n += put_u(buf + n, v, *p == 'x' ? 16 : 10);
            break;
        }
        case '%': buf[n++] = '%'; break;
        default: buf[n++] = '?'; break;
        }
    }
    return (int)write(fd, buf, (size_t)n);
}

int fprintf(FILE *f, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int r = vfmt(f->fd, fmt, ap);
    va_end(ap);
    return r;
}
int printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int r = vfmt(1, fmt, ap);
    va_end(ap);
    return r;
}
