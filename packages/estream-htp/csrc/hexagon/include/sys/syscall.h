/* The Hexagon runtime: see hx_libc.h. */
#include <hx_libc.h>
