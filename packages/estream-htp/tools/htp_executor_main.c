/* A standalone executor for host-process backends: `htp_executor SOCKET_FD`.
 *
 * The same loop as `python -m estream_htp._executor` (htp_executor_serve), as a plain C program
 * linked with the library's sources: what a build for another processor (a DSP) compiles, with
 * no Python on that side. Use it with `estream_htp.Backend("host-process", executor=[path])`. */
#include <stdio.h>
#include <stdlib.h>

#include "htp.h"

int main(int argc, char **argv) {
    char *end = NULL;
    const long fd = argc == 2 ? strtol(argv[1], &end, 10) : -1;
    if (argc != 2 || !end || *end || fd < 0) {
        fprintf(stderr, "usage: %s SOCKET_FD\n", argv[0]);
        return 2;
    }
    return htp_executor_serve((int)fd);
}
