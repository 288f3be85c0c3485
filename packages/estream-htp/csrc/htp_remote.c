/* REMOTE backends: the same ops run in an executor process that maps the registered buffers
 * itself and takes descriptors from a shared-memory submission ring (a dspqueue-like design).
 *
 * Channels between the host and the executor:
 *  - a connected SOCK_SEQPACKET socket for control requests (hello, register a buffer, which
 *    carries the buffer's fd by SCM_RIGHTS, unregister, configure, shutdown) and their replies.
 *    The socket is also the liveness signal: when either process dies, the other's end reads
 *    EOF / POLLHUP at once.
 *  - a shared memory queue (memfd): HTP_QUEUE_DEPTH descriptor slots, a `submitted` counter the
 *    host advances and a `completed` counter the executor advances (the completion fence of
 *    op n is `completed >= n`), plus each slot's status.
 *  - two eventfd doorbells, rung only when the other side has said it is about to sleep
 *    (a flag in the queue, Dekker-style with sequentially consistent fences), so a busy pipeline
 *    makes no system calls at all. A sleeping side polls its eventfd *and* the socket, so the
 *    death of the peer wakes it like a doorbell does.
 * The executor copies each descriptor out of the shared slot before validating it and runs it
 * through a HOST backend of its own: every reference is checked against the sizes it registered.
 */
#include "htp_internal.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define QUEUE_MAGIC 0x48545051u /* "HTPQ" */
#define SPIN_NS 50000           /* host: poll the ring this long before sleeping on a doorbell */
#define EXEC_SPIN_NS 200000     /* executor: the same, longer, to bridge the host's work between ops */
#define PAUSE_NS 2000           /* of which the first part spins; the rest yields the CPU */

enum { CTL_HELLO = 1, CTL_REGISTER, CTL_UNREGISTER, CTL_CONFIGURE, CTL_SHUTDOWN, CTL_REPLY };

typedef struct ctl_msg {
    uint32_t type;
    int32_t status;
    uint32_t id;
    uint32_t flags;
    uint64_t offset;
    uint64_t size;
    uint32_t n_threads;
    uint32_t simd;
    uint32_t abi_version;
    uint32_t reserved;
} ctl_msg;
_Static_assert(sizeof(ctl_msg) == 48, "ctl_msg");

typedef struct queue_slot {
    htp_op_desc op;
    int32_t status;
    uint32_t reserved[3];
} queue_slot;
_Static_assert(sizeof(queue_slot) == 256, "queue_slot");

typedef struct htp_queue {
    uint32_t magic, abi_version, depth, slot_bytes;
    uint8_t pad0[48];
    _Atomic uint64_t submitted; /* host: descriptors 1..submitted are in the ring */
    uint8_t pad1[56];
    _Atomic uint64_t completed; /* executor: ops 1..completed are done, statuses written */
    uint8_t pad2[56];
    _Atomic uint32_t exec_sleeping;
    uint8_t pad3[60];
    _Atomic uint32_t host_waiting;
    uint8_t pad4[60];
    queue_slot slot[HTP_QUEUE_DEPTH];
} htp_queue;

struct htp_remote {
    int sock, qfd, efd_submit, efd_done;
    htp_queue *q;
    uint64_t submitted;
    uint64_t slot_fence[HTP_QUEUE_DEPTH];
    uint8_t consumed[HTP_QUEUE_DEPTH];
    int dead;
    uint32_t timeout_ms;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ---- control messages ---- */
static int send_msg(int sock, const ctl_msg *m, const int *fds, int nfds) {
    struct iovec iov = {(void *)m, sizeof *m};
    union {
        char buf[CMSG_SPACE(sizeof(int) * 4)];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (nfds > 0) {
        memset(&u, 0, sizeof u);
        mh.msg_control = u.buf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t n;
    do n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)sizeof *m ? 0 : -1;
}

/* Receives one message; fds received beyond `maxfds` are closed. Returns 1 on a message, 0 on
 * EOF, -1 on error. */
static int recv_msg(int sock, ctl_msg *m, int *fds, int maxfds, int *nfds) {
    struct iovec iov = {m, sizeof *m};
    union {
        char buf[CMSG_SPACE(sizeof(int) * 8)];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof u.buf;
    ssize_t n;
    do n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (nfds) *nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const int cnt = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        int got[8];
        memcpy(got, CMSG_DATA(c), sizeof(int) * (size_t)(cnt < 8 ? cnt : 8));
        for (int i = 0; i < cnt && i < 8; i++) {
            if (fds && nfds && *nfds < maxfds)
                fds[(*nfds)++] = got[i];
            else
                close(got[i]);
        }
    }
    if (n == 0) return 0;
    if (n != (ssize_t)sizeof *m) return -1;
    return 1;
}

/* Host: one request, one reply, bounded by the backend's timeout. */
static htp_status request(htp_remote *r, ctl_msg *m, const int *fds, int nfds) {
    if (r->dead) return HTP_E_DEAD;
    if (send_msg(r->sock, m, fds, nfds) != 0) {
        r->dead = 1;
        return HTP_E_DEAD;
    }
    struct pollfd p = {r->sock, POLLIN, 0};
    int rc;
    do rc = poll(&p, 1, r->timeout_ms ? (int)r->timeout_ms : -1);
    while (rc < 0 && errno == EINTR);
    if (rc == 0) {
        /* a late reply would be taken for the answer to the next request: the channel can no
         * longer be trusted, so the backend is treated as gone from here on */
        r->dead = 1;
        return HTP_E_TIMEOUT;
    }
    ctl_msg rep;
    const int got = recv_msg(r->sock, &rep, NULL, 0, NULL);
    if (got <= 0) {
        r->dead = 1;
        return HTP_E_DEAD;
    }
    if (rep.type != CTL_REPLY) return HTP_E_PROTOCOL;
    *m = rep;
    return HTP_OK;
}

/* ---- host side ---- */
static int make_memfd(const char *name) {
#ifdef SYS_memfd_create
    return (int)syscall(SYS_memfd_create, name, 1u /* MFD_CLOEXEC */);
#else
    (void)name;
    errno = ENOSYS;
    return -1;
#endif
}

void htp_remote_close(htp_remote *r) {
    if (!r) return;
    if (!r->dead && r->sock >= 0) {
        ctl_msg m = {.type = CTL_SHUTDOWN};
        (void)request(r, &m, NULL, 0);
    }
    if (r->q) munmap(r->q, sizeof(htp_queue));
    if (r->qfd >= 0) close(r->qfd);
    if (r->efd_submit >= 0) close(r->efd_submit);
    if (r->efd_done >= 0) close(r->efd_done);
    if (r->sock >= 0) close(r->sock);
    free(r);
}

htp_status htp_remote_open(const htp_backend_desc *desc, htp_remote **out) {
    *out = NULL;
    if (desc->sock_fd < 0) return HTP_E_INVALID;
    htp_remote *r = (htp_remote *)calloc(1, sizeof(*r));
    if (!r) return HTP_E_NOMEM;
    r->sock = desc->sock_fd; /* owned from here on */
    r->qfd = r->efd_submit = r->efd_done = -1;
    r->timeout_ms = desc->timeout_ms;
    r->qfd = make_memfd("estream-htp-queue");
    r->efd_submit = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    r->efd_done = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (r->qfd < 0 || r->efd_submit < 0 || r->efd_done < 0 ||
        ftruncate(r->qfd, (off_t)sizeof(htp_queue)) != 0) {
        htp_remote_close(r);
        return HTP_E_NOMEM;
    }
    void *m = mmap(NULL, sizeof(htp_queue), PROT_READ | PROT_WRITE, MAP_SHARED, r->qfd, 0);
    if (m == MAP_FAILED) {
        htp_remote_close(r);
        return HTP_E_MAP;
    }
    r->q = (htp_queue *)m;
    r->q->magic = QUEUE_MAGIC;
    r->q->abi_version = HTP_ABI_VERSION;
    r->q->depth = HTP_QUEUE_DEPTH;
    r->q->slot_bytes = sizeof(queue_slot);
    ctl_msg hello = {.type = CTL_HELLO, .abi_version = HTP_ABI_VERSION};
    const int fds[3] = {r->qfd, r->efd_submit, r->efd_done};
    htp_status st = request(r, &hello, fds, 3);
    if (st == HTP_OK && hello.status != HTP_OK) st = (htp_status)hello.status;
    if (st != HTP_OK) {
        r->dead = 1; /* no orderly shutdown to ask for */
        htp_remote_close(r);
        return st;
    }
    *out = r;
    return HTP_OK;
}

htp_status htp_remote_configure(htp_remote *r, uint32_t n_threads, uint32_t simd, uint32_t *got) {
    ctl_msg m = {.type = CTL_CONFIGURE, .n_threads = n_threads, .simd = simd};
    htp_status st = request(r, &m, NULL, 0);
    if (st != HTP_OK) return st;
    if (m.status == HTP_OK) *got = m.simd;
    return (htp_status)m.status;
}

htp_status htp_remote_register(htp_remote *r, const htp_buffer_desc *d, uint32_t *id) {
    ctl_msg m = {.type = CTL_REGISTER, .flags = d->flags, .offset = d->offset, .size = d->size};
    htp_status st = request(r, &m, &d->fd, 1);
    if (st != HTP_OK) return st;
    if (m.status == HTP_OK) *id = m.id;
    return (htp_status)m.status;
}

htp_status htp_remote_unregister(htp_remote *r, uint32_t id) {
    ctl_msg m = {.type = CTL_UNREGISTER, .id = id};
    htp_status st = request(r, &m, NULL, 0);
    return st != HTP_OK ? st : (htp_status)m.status;
}

htp_status htp_remote_submit(htp_remote *r, const htp_op_desc *op, uint64_t *fence) {
    if (r->dead) return HTP_E_DEAD;
    const uint64_t f = r->submitted + 1;
    const uint32_t s = (uint32_t)((f - 1) % HTP_QUEUE_DEPTH);
    if (r->slot_fence[s] && !r->consumed[s]) return HTP_E_CAPACITY;
    memcpy(&r->q->slot[s].op, op, sizeof *op);
    r->q->slot[s].status = -1;
    atomic_store_explicit(&r->q->submitted, f, memory_order_release);
    r->submitted = f;
    r->slot_fence[s] = f;
    r->consumed[s] = 0;
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&r->q->exec_sleeping, memory_order_relaxed)) {
        const uint64_t one = 1;
        ssize_t n = write(r->efd_submit, &one, sizeof one);
        (void)n; /* EAGAIN only if the counter is saturated: the executor is awake then */
    }
    *fence = f;
    return HTP_OK;
}

/* Has the executor gone away? (EOF or hang-up on the socket; no message is expected now.) */
static int peer_gone(int sock, short revents) {
    if (revents & (POLLHUP | POLLERR | POLLNVAL)) return 1;
    if (revents & POLLIN) {
        char c;
        const ssize_t n = recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        return n == 0;
    }
    return 0;
}

htp_status htp_remote_wait(htp_remote *r, uint64_t f, uint32_t timeout_ms, htp_status *op_status) {
    const uint32_t s = (uint32_t)((f ? f - 1 : 0) % HTP_QUEUE_DEPTH);
    if (f == 0 || f > r->submitted || r->slot_fence[s] != f || r->consumed[s]) return HTP_E_FENCE;
    htp_queue *q = r->q;
    const uint64_t t0 = now_ns();
    const uint64_t limit = timeout_ms == UINT32_MAX ? UINT64_MAX : t0 + (uint64_t)timeout_ms * 1000000ull;
    int done = atomic_load_explicit(&q->completed, memory_order_acquire) >= f;
    if (!done && timeout_ms == 0) return HTP_E_TIMEOUT; /* a poll: look once, never spin */
    for (uint32_t i = 0; !done; i++) {
        if (atomic_load_explicit(&q->completed, memory_order_acquire) >= f) {
            done = 1;
        } else if ((i & 15) == 0) {
            const uint64_t dt = now_ns() - t0;
            if (dt > SPIN_NS) break;
            if (dt > PAUSE_NS) sched_yield(); /* a busy machine: let the executor run here */
        } else {
            relax();
        }
    }
    while (!done) {
        if (r->dead) return HTP_E_DEAD;
        atomic_store_explicit(&q->host_waiting, 1, memory_order_relaxed);
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(&q->completed, memory_order_acquire) >= f) {
            atomic_store_explicit(&q->host_waiting, 0, memory_order_relaxed);
            break;
        }
        const uint64_t now = now_ns();
        if (now >= limit) {
            atomic_store_explicit(&q->host_waiting, 0, memory_order_relaxed);
            return HTP_E_TIMEOUT;
        }
        const uint64_t left_ms = limit == UINT64_MAX ? 1000 : (limit - now + 999999) / 1000000;
        struct pollfd p[2] = {{r->efd_done, POLLIN, 0}, {r->sock, POLLIN, 0}};
        const int rc = poll(p, 2, (int)(left_ms > 1000 ? 1000 : left_ms));
        atomic_store_explicit(&q->host_waiting, 0, memory_order_relaxed);
        if (rc > 0 && (p[0].revents & POLLIN)) {
            uint64_t v;
            ssize_t n = read(r->efd_done, &v, sizeof v);
            (void)n;
        }
        if (atomic_load_explicit(&q->completed, memory_order_acquire) >= f) break;
        if (rc > 0 && peer_gone(r->sock, p[1].revents)) r->dead = 1;
    }
    *op_status = (htp_status)q->slot[s].status;
    r->consumed[s] = 1;
    return HTP_OK;
}

/* ---- executor side ---- */
static void reply(int sock, int32_t status, uint32_t id, uint32_t simd) {
    ctl_msg m = {.type = CTL_REPLY, .status = status, .id = id, .simd = simd};
    (void)send_msg(sock, &m, NULL, 0);
}

/* Handles one control message; returns 1 to keep serving, 0 to stop. */
static int serve_control(int sock, htp_backend **bp) {
    ctl_msg m;
    int fds[1] = {-1}, nfds = 0;
    const int got = recv_msg(sock, &m, fds, 1, &nfds);
    if (got <= 0) return 0; /* the host is gone */
    htp_backend *b = *bp;
    switch (m.type) {
    case CTL_REGISTER: {
        uint32_t id = 0;
        htp_status st = HTP_E_INVALID;
        if (nfds == 1) {
            const htp_buffer_desc d = {fds[0], m.flags, m.offset, m.size, 0};
            st = htp_buffer_register(b, &d, &id);
        }
        if (nfds == 1) close(fds[0]); /* the mapping (if any) stays */
        reply(sock, st, id, 0);
        return 1;
    }
    case CTL_UNREGISTER: reply(sock, htp_buffer_unregister(b, m.id), 0, 0); return 1;
    case CTL_CONFIGURE: {
        const htp_status st = htp_backend_configure(b, m.n_threads, m.simd);
        reply(sock, st, 0, htp_backend_simd(b));
        return 1;
    }
    case CTL_SHUTDOWN: reply(sock, HTP_OK, 0, 0); return 0;
    default:
        for (int i = 0; i < nfds; i++) close(fds[i]);
        reply(sock, HTP_E_PROTOCOL, 0, 0);
        return 1;
    }
}

int htp_executor_serve(int sock) {
    ctl_msg m;
    int fds[3] = {-1, -1, -1}, nfds = 0;
    if (recv_msg(sock, &m, fds, 3, &nfds) != 1 || m.type != CTL_HELLO || nfds != 3) {
        for (int i = 0; i < nfds; i++) close(fds[i]);
        reply(sock, HTP_E_PROTOCOL, 0, 0);
        return 2;
    }
    const int qfd = fds[0], efd_submit = fds[1], efd_done = fds[2];
    htp_queue *q = (htp_queue *)mmap(NULL, sizeof(htp_queue), PROT_READ | PROT_WRITE, MAP_SHARED, qfd, 0);
    htp_backend *b = NULL;
    htp_status st = HTP_OK;
    if (q == MAP_FAILED) {
        q = NULL;
        st = HTP_E_MAP;
    } else if (m.abi_version != HTP_ABI_VERSION || q->magic != QUEUE_MAGIC ||
               q->abi_version != HTP_ABI_VERSION || q->depth != HTP_QUEUE_DEPTH ||
               q->slot_bytes != sizeof(queue_slot)) {
        st = HTP_E_UNSUPPORTED;
    } else {
        const htp_backend_desc d = {HTP_ABI_VERSION, HTP_BACKEND_HOST, 1, HTP_SIMD_BEST, -1, 0, {0, 0}};
        st = htp_backend_init(&d, &b);
    }
    reply(sock, st, 0, 0);
    int rc = 0;
    if (st == HTP_OK) {
        uint64_t done = atomic_load_explicit(&q->completed, memory_order_acquire);
        int running = 1;
        while (running) {
            if (atomic_load_explicit(&q->submitted, memory_order_acquire) > done) {
                queue_slot *slot = &q->slot[done % HTP_QUEUE_DEPTH];
                htp_op_desc op;
                memcpy(&op, &slot->op, sizeof op); /* validated and run from a private copy */
                slot->status = (int32_t)htp_op_run(b, &op);
                atomic_store_explicit(&q->completed, ++done, memory_order_release);
                atomic_thread_fence(memory_order_seq_cst);
                if (atomic_load_explicit(&q->host_waiting, memory_order_relaxed)) {
                    const uint64_t one = 1;
                    ssize_t n = write(efd_done, &one, sizeof one);
                    (void)n;
                }
                continue;
            }
            /* idle: poll the ring a little (spin, then yield), then sleep on the doorbell and the
             * control socket */
            const uint64_t t0 = now_ns();
            int woke = 0;
            for (uint32_t i = 0;; i++) {
                if (atomic_load_explicit(&q->submitted, memory_order_acquire) > done) {
                    woke = 1;
                    break;
                }
                if ((i & 15) == 0) {
                    const uint64_t dt = now_ns() - t0;
                    if (dt > EXEC_SPIN_NS) break;
                    if (dt > PAUSE_NS) sched_yield();
                } else {
                    relax();
                }
            }
            if (woke) continue;
            atomic_store_explicit(&q->exec_sleeping, 1, memory_order_relaxed);
            atomic_thread_fence(memory_order_seq_cst);
            if (atomic_load_explicit(&q->submitted, memory_order_acquire) == done) {
                struct pollfd p[2] = {{efd_submit, POLLIN, 0}, {sock, POLLIN, 0}};
                const int n = poll(p, 2, -1);
                if (n > 0 && (p[0].revents & POLLIN)) {
                    uint64_t v;
                    ssize_t k = read(efd_submit, &v, sizeof v);
                    (void)k;
                }
                if (n > 0 && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
                    /* control requests are served between ops, when the ring is idle */
                    if (!serve_control(sock, &b)) running = 0;
                }
            }
            atomic_store_explicit(&q->exec_sleeping, 0, memory_order_relaxed);
        }
    } else {
        rc = 1;
    }
    htp_backend_free(b);
    if (q) munmap(q, sizeof(htp_queue));
    close(qfd);
    close(efd_submit);
    close(efd_done);
    close(sock);
    return rc;
}
