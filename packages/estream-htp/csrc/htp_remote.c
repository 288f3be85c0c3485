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
#include "htp_protocol.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

struct htp_remote {
    int sock, qfd, efd_submit, efd_done;
    htp_queue *q;
    uint64_t submitted;
    uint64_t slot_fence[HTP_QUEUE_DEPTH];
    uint64_t slot_submitted_ns[HTP_QUEUE_DEPTH];
    uint8_t consumed[HTP_QUEUE_DEPTH];
    int dead;
    uint32_t timeout_ms;
};

/* Host: one request, one reply, bounded by the backend's timeout. */
static htp_status request(htp_remote *r, ctl_msg *m, const int *fds, int nfds) {
    if (r->dead) return HTP_E_DEAD;
    if (htp_proto_send(r->sock, m, fds, nfds) != 0) {
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
    const int got = htp_proto_recv(r->sock, &rep, NULL, 0, NULL);
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
    r->q->slot[s].started_ns = r->q->slot[s].completed_ns = 0;
    r->slot_submitted_ns[s] = now_ns();
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

htp_status htp_remote_wait(htp_remote *r, uint64_t f, uint32_t timeout_ms, htp_status *op_status,
                           htp_op_times *times) {
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
    if (times) {
        times->submitted_ns = r->slot_submitted_ns[s];
        times->started_ns = q->slot[s].started_ns;
        times->completed_ns = q->slot[s].completed_ns;
        times->reserved = 0;
    }
    r->consumed[s] = 1;
    return HTP_OK;
}

