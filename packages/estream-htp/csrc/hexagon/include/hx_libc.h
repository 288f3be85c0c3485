/* estream-htp's freestanding Hexagon runtime: the few libc declarations the library's sources
 * use, for a Linux user-mode program with no C library (qemu-hexagon here; see hx_runtime.c).
 * The standard header names in this directory (stdlib.h, sys/socket.h, ...) all include this
 * one file. Only what the kernels, the backend and the executor loop call is declared; every
 * constant is the Linux asm-generic value for a 32-bit architecture. No threads. */
#ifndef HX_LIBC_H
#define HX_LIBC_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#ifndef __hexagon__
#error "hx_libc.h is the Hexagon runtime's libc; host builds use the system headers"
#endif

typedef int ssize_t;
typedef long long off_t;
typedef int pid_t;
typedef unsigned int socklen_t;
typedef long time_t;

/* ---- errno ---- */
extern int errno;
#define EINTR 4
#define EAGAIN 11
#define ENOMEM 12
#define EINVAL 22
#define ENOSYS 38

/* ---- string / stdlib ---- */
void *memcpy(void *restrict d, const void *restrict s, size_t n);
void *memmove(void *d, const void *s, size_t n);
void *memset(void *d, int c, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);
void *malloc(size_t n);
void *calloc(size_t n, size_t size);
void *realloc(void *p, size_t n);
void free(void *p);
int posix_memalign(void **out, size_t align, size_t n);
long strtol(const char *s, char **end, int base);
_Noreturn void exit(int status);
_Noreturn void abort(void);

/* ---- stdio: fprintf of %s %d %u %x %ld %lu %zu to stdout/stderr only ---- */
typedef struct hx_file { int fd; } FILE;
extern FILE *const stdout;
extern FILE *const stderr;
int fprintf(FILE *f, const char *fmt, ...);
int printf(const char *fmt, ...);

/* ---- unistd ---- */
ssize_t read(int fd, void *buf, size_t n);
ssize_t write(int fd, const void *buf, size_t n);
int close(int fd);
pid_t getpid(void);
int ftruncate(int fd, off_t len);
long sysconf(int name);
#define _SC_PAGESIZE 30

/* ---- mmap ---- */
#define PROT_READ 1
#define PROT_WRITE 2
#define MAP_SHARED 1
#define MAP_PRIVATE 2
#define MAP_ANONYMOUS 0x20
#define MAP_FAILED ((void *)-1)
void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off);
int munmap(void *addr, size_t len);

/* ---- time, sched ---- */
struct timespec {
    time_t tv_sec;
    long tv_nsec;
};
#define CLOCK_MONOTONIC 1
int clock_gettime(int clk, struct timespec *ts);
int sched_yield(void);

/* ---- poll, eventfd ---- */
struct pollfd {
    int fd;
    short events, revents;
};
#define POLLIN 1
#define POLLERR 8
#define POLLHUP 16
#define POLLNVAL 32
int poll(struct pollfd *fds, unsigned int n, int timeout_ms);
#define EFD_NONBLOCK 04000
#define EFD_CLOEXEC 02000000
int eventfd(unsigned int initval, int flags);

/* ---- sockets (the executor's control channel) ---- */
struct iovec {
    void *iov_base;
    size_t iov_len;
};
struct msghdr {
    void *msg_name;
    socklen_t msg_namelen;
    struct iovec *msg_iov;
    size_t msg_iovlen;
    void *msg_control;
    size_t msg_controllen;
    int msg_flags;
};
struct cmsghdr {
    size_t cmsg_len;
    int cmsg_level;
    int cmsg_type;
};
#define SOL_SOCKET 1
#define SCM_RIGHTS 1
#define MSG_PEEK 2
#define MSG_DONTWAIT 0x40
#define MSG_NOSIGNAL 0x4000
#define MSG_CMSG_CLOEXEC 0x40000000
#define HX_CMSG_ALIGN(n) (((n) + sizeof(size_t) - 1) & ~(sizeof(size_t) - 1))
#define CMSG_SPACE(n) (HX_CMSG_ALIGN(n) + HX_CMSG_ALIGN(sizeof(struct cmsghdr)))
#define CMSG_LEN(n) (HX_CMSG_ALIGN(sizeof(struct cmsghdr)) + (n))
#define CMSG_DATA(c) ((unsigned char *)(c) + HX_CMSG_ALIGN(sizeof(struct cmsghdr)))
#define CMSG_FIRSTHDR(m) \
    ((m)->msg_controllen >= sizeof(struct cmsghdr) ? (struct cmsghdr *)(m)->msg_control : (struct cmsghdr *)0)
struct cmsghdr *hx_cmsg_next(struct msghdr *m, struct cmsghdr *c);
#define CMSG_NXTHDR(m, c) hx_cmsg_next((m), (c))
ssize_t sendmsg(int fd, const struct msghdr *m, int flags);
ssize_t recvmsg(int fd, struct msghdr *m, int flags);
ssize_t recv(int fd, void *buf, size_t n, int flags);

/* ---- pthreads: no threads. Mutexes and condition variables are no-ops (one thread);
 * pthread_create fails with EAGAIN (the pool refuses more than one thread before that). ---- */
typedef struct { int unused; } pthread_mutex_t;
typedef struct { int unused; } pthread_cond_t;
typedef int pthread_t;
int pthread_mutex_init(pthread_mutex_t *m, const void *attr);
int pthread_mutex_destroy(pthread_mutex_t *m);
int pthread_mutex_lock(pthread_mutex_t *m);
int pthread_mutex_unlock(pthread_mutex_t *m);
int pthread_cond_init(pthread_cond_t *c, const void *attr);
int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m);
int pthread_cond_broadcast(pthread_cond_t *c);
int pthread_create(pthread_t *t, const void *attr, void *(*fn)(void *), void *arg);
int pthread_join(pthread_t t, void **ret);

/* ---- math (hx_math.c): double functions accurate to a few ulp; the float ones the kernels
 * call are compiler built-ins ---- */
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define isfinite(x) __builtin_isfinite(x)
#define isnan(x) __builtin_isnan(x)
#define fabsf(x) __builtin_fabsf(x)
#define fabs(x) __builtin_fabs(x)
double sqrt(double x);
double exp(double x);
double log(double x);
double pow(double x, double y);
double sin(double x);
double cos(double x);
double floor(double x);
double ceil(double x);
double fmax(double a, double b);
double fmin(double a, double b);
float nearbyintf(float x);
float sqrtf(float x);
float expf(float x);

/* In the library's translation units, the string functions are the compiler's built-ins (small
 * constant sizes become loads and stores); the runtime defines the out-of-line versions. */
#ifndef HX_RUNTIME_IMPL
#define memcpy(d, s, n) __builtin_memcpy((d), (s), (n))
#define memset(d, c, n) __builtin_memset((d), (c), (n))
#define memcmp(a, b, n) __builtin_memcmp((a), (b), (n))
#endif

#endif
