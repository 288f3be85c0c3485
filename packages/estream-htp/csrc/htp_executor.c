/* The executor side of the host-process protocol (htp_protocol.h): serves one host over its
 * socket and ring, running every descriptor through a HOST backend of its own (validated there,
 * against the sizes the host registered). The standalone executor (tools/htp_executor_main.c,
 * also the Hexagon build) and estream_htp._executor call htp_executor_serve. */
#include "htp_protocol.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

static void reply(int sock, int32_t status, uint32_t id, uint32_t simd) {
    ctl_msg m = {.type = CTL_REPLY, .status = status, .id = id, .simd = simd};
    (void)htp_proto_send(sock, &m, NULL, 0);
}

/* Handles one control message; returns 1 to keep serving, 0 to stop. */
static int serve_control(int sock, htp_backend **bp) {
    ctl_msg m;
    int fds[1] = {-1}, nfds = 0;
    const int got = htp_proto_recv(sock, &m, fds, 1, &nfds);
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
    if (htp_proto_recv(sock, &m, fds, 3, &nfds) != 1 || m.type != CTL_HELLO || nfds != 3) {
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
                const uint64_t t0 = now_ns();
                memcpy(&op, &slot->op, sizeof op); /* validated and run from a private copy */
                slot->status = (int32_t)htp_op_run(b, &op);
                slot->started_ns = t0;
                slot->completed_ns = now_ns();
                /* an exchange, a full barrier here too (see the sleep below): a completion the
                 * host is waiting on always rings its doorbell */
                atomic_exchange_explicit(&q->completed, ++done, memory_order_seq_cst);
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
            /* Dekker with htp_remote_submit: announce the sleep, then look at the ring once more.
             * The announcement is an atomic exchange, a full barrier wherever this runs: under
             * qemu-user a guest's fence need not become a host one, and a store still in the
             * host's store buffer when the ring is read loses the host's doorbell. The sleep is
             * bounded too, so that no lost doorbell can stall the ring for longer than that. */
            atomic_exchange_explicit(&q->exec_sleeping, 1, memory_order_seq_cst);
            atomic_thread_fence(memory_order_seq_cst);
            if (atomic_load_explicit(&q->submitted, memory_order_acquire) == done) {
                struct pollfd p[2] = {{efd_submit, POLLIN, 0}, {sock, POLLIN, 0}};
                const int n = poll(p, 2, EXEC_SLEEP_MS);
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
