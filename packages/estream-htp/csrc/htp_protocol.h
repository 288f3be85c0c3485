/* The host-process protocol shared by the host side (htp_remote.c) and the executor
 * (htp_executor.c): control messages over a SOCK_SEQPACKET socket (fds by SCM_RIGHTS) and the
 * shared-memory submission ring. See htp_remote.c for the design. */
#ifndef HTP_PROTOCOL_H
#define HTP_PROTOCOL_H

#include "htp_internal.h"

#include <stdatomic.h>
#include <time.h>

#define QUEUE_MAGIC 0x48545051u /* "HTPQ" */
#define SPIN_NS 50000           /* host: poll the ring this long before sleeping on a doorbell */
#define EXEC_SPIN_NS 200000     /* executor: the same, longer, to bridge the host's work between ops */
#define PAUSE_NS 2000           /* of which the first part spins; the rest yields the CPU */
#define EXEC_SLEEP_MS 100       /* executor: longest sleep before it looks at the ring again */

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

/* started_ns / completed_ns: the executor's CLOCK_MONOTONIC around running the op (the DSP
 * queue of a trace), written before `completed` is advanced past the slot. */
typedef struct queue_slot {
    htp_op_desc op;
    int32_t status;
    uint32_t reserved;
    uint64_t started_ns, completed_ns;
} queue_slot;
_Static_assert(sizeof(queue_slot) == 296, "queue_slot");

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

static inline uint64_t now_ns(void) {
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

/* One control message with up to 4 fds; 0 on success. */
int htp_proto_send(int sock, const ctl_msg *m, const int *fds, int nfds);
/* Receives one message; fds received beyond `maxfds` are closed. Returns 1 on a message, 0 on
 * EOF, -1 on error. */
int htp_proto_recv(int sock, ctl_msg *m, int *fds, int maxfds, int *nfds);

#endif
