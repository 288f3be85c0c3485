/* Control messages of the host-process protocol (htp_protocol.h), both sides. */
#include "htp_protocol.h"

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- control messages ---- */
#define HTP_PROTO_MAX_SEND_FDS 4

int htp_proto_send(int sock, const ctl_msg *m, const int *fds, int nfds) {
    if (nfds > HTP_PROTO_MAX_SEND_FDS) return -1; /* the control buffer holds this many */
    struct iovec iov = {(void *)m, sizeof *m};
    union {
        char buf[CMSG_SPACE(sizeof(int) * HTP_PROTO_MAX_SEND_FDS)];
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

int htp_proto_recv(int sock, ctl_msg *m, int *fds, int maxfds, int *nfds) {
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

