"""Backends: where the ops run, the buffers they may touch, and completion fences.

A `Backend` owns a C backend (ABI v2). Operands cross into it as *references* — (buffer id,
offset) into memory registered with the backend — never as pointers. Two kinds:

* ``"host"``: ops run in this process (the caller's thread plus a pool).
* ``"host-process"``: ops run in an executor child process (``python -m estream_htp._executor``)
  that maps every registered buffer itself from its file descriptor and takes descriptors from a
  shared-memory ring; a fence completes when the executor has run the op.
* ``"hexagon"``: the same protocol, the executor being the library compiled for Hexagon
  (v67 + HVX, csrc/hexagon's freestanding runtime) run under ``qemu-hexagon-static`` — the
  "DSP" process maps the very memfds the host fills (see `estream_htp._hexagon`). One thread.

Numpy arrays that are not inside registered memory are handled per call: a host backend
registers them for the duration of the op; a host-process backend copies them through a shared
staging buffer (inputs before, outputs after). Memory the executor should read in place (the
arena's planes, activation buffers reused across ops) is registered once: `register_fd`, or
allocated shared with `Backend.empty` / `Backend.share`.
"""

from __future__ import annotations

import _thread
import contextlib
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from estream_htp._ffi import ffi, lib

__all__ = [
    "BACKENDS",
    "ActivationArena",
    "Backend",
    "CapacityError",
    "ExecutorDiedError",
    "ExpertNotResidentError",
    "Fence",
    "HTPDescriptorError",
    "HTPError",
    "HTPInputError",
    "HTPTimeoutError",
    "HTPUnsupportedError",
    "RouteBuffers",
]

BACKENDS = ("host", "host-process", "hexagon")
SIMD_LEVELS = {
    "portable": lib.HTP_SIMD_PORTABLE,
    "avx2": lib.HTP_SIMD_AVX2,
    "avx512": lib.HTP_SIMD_AVX512,
    "avx512vnni": lib.HTP_SIMD_AVX512VNNI,
    "neon": lib.HTP_SIMD_NEON,
    "hvx": lib.HTP_SIMD_HVX,
    "amx": lib.HTP_SIMD_AMX,
}
SIMD_NAMES = {v: k for k, v in SIMD_LEVELS.items()}
ACT = {"f32": lib.HTP_ACT_F32, "q8": lib.HTP_ACT_Q8}
_NO_TIMEOUT = 0xFFFFFFFF


class HTPError(RuntimeError):
    """The kernel library reported an error."""


class HTPInputError(HTPError, ValueError):
    """An argument has the wrong shape, dtype, layout or value (checked before calling C)."""


class HTPDescriptorError(HTPInputError):
    """The backend rejected a descriptor: unknown buffer, reference out of bounds, write into a
    read-only buffer, or a malformed op. Nothing was executed."""


class HTPUnsupportedError(HTPError):
    """The requested SIMD level, format or backend is not available on this CPU/build."""


class ExpertNotResidentError(HTPError, LookupError):
    """A route names an expert whose slot is -1 (not resident)."""


class CapacityError(HTPError):
    """More tokens than the object was sized for, or too many fences outstanding."""


class _NeverIssued(HTPError):
    """A fence the C side does not know (or no longer: its completion was taken already)."""


class HTPTimeoutError(HTPError, TimeoutError):
    """A fence did not complete in the time asked (the op is still pending)."""


class ExecutorDiedError(HTPError):
    """The executor process of a host-process backend is gone; the backend is closed."""


_STATUS_NAMES = {
    lib.HTP_E_BAD_BUFFER: "a reference names a buffer that is not registered",
    lib.HTP_E_BOUNDS: "a reference reaches past the end of its registered buffer",
    lib.HTP_E_READONLY: "an op would write into a read-only buffer",
    lib.HTP_E_BAD_OP: "malformed descriptor (opcode, reference count, flags or reserved fields)",
}


def check(status: int, what: str) -> None:
    """Turn a status code into the matching exception."""
    if status == lib.HTP_OK:
        return
    if status == lib.HTP_E_INVALID:
        raise HTPInputError(f"{what}: the kernel rejected an argument (index or size out of range)")
    if status == lib.HTP_E_NOMEM:
        raise MemoryError(f"{what}: out of memory")
    if status == lib.HTP_E_UNSUPPORTED:
        raise HTPUnsupportedError(f"{what}: not supported on this CPU, build or backend")
    if status == lib.HTP_E_NOT_RESIDENT:
        raise ExpertNotResidentError(f"{what}: a routed expert has slot -1 (not resident)")
    if status == lib.HTP_E_CAPACITY:
        raise CapacityError(f"{what}: more tokens than t_max, or too many fences outstanding")
    if status in _STATUS_NAMES:
        raise HTPDescriptorError(f"{what}: {_STATUS_NAMES[status]} (status {status})")
    if status == lib.HTP_E_TIMEOUT:
        raise HTPTimeoutError(f"{what}: timed out")
    if status == lib.HTP_E_DEAD:
        raise ExecutorDiedError(f"{what}: the executor process is gone")
    if status == lib.HTP_E_MAP:
        raise HTPError(f"{what}: mapping a registered file descriptor failed")
    if status == lib.HTP_E_FENCE:
        raise HTPError(f"{what}: unknown fence, or its completion was already consumed")
    raise HTPError(f"{what}: status {status}")


class _SharedMap(mmap.mmap):
    """An mmap that can carry a finalizer (plain mmap objects take no weak references)."""


class Fence:
    """Completion of one submitted op. `wait` returns once the op ran (raising its error, if
    any) and keeps the op's operands alive until then."""

    __slots__ = ("__weakref__", "_after", "_backend", "_error", "_keep", "done", "value", "what")

    def __init__(
        self,
        backend: Backend,
        value: int,
        what: str,
        keep: list[Any],
        after: list[Callable[[], None]],
    ) -> None:
        self._backend = backend
        self.value = value
        self.what = what
        self._keep: list[Any] | None = keep
        self._after = after
        self.done = False
        self._error: BaseException | None = None

    def poll(self) -> bool:
        """True once the op completed (its error, if any, is raised by `wait`)."""
        if not self.done:
            try:
                self._backend._wait(self, 0)
            except HTPTimeoutError:
                return False
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the op; ``timeout`` in seconds (None: no bound). Raises the op's error,
        `HTPTimeoutError` if it is still pending, `ExecutorDiedError` if the executor died."""
        if not self.done:
            ms = _NO_TIMEOUT if timeout is None else max(0, min(int(timeout * 1000), 2**31))
            self._backend._wait(self, ms)
        if self._error is not None:
            raise self._error


def _page_round(n: int) -> int:
    return max(mmap.PAGESIZE, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)


class Backend:
    """Where ops run: ``Backend("host")``, ``Backend("host-process")`` or
    ``Backend("hexagon")`` (see module doc).

    ``n_threads`` sizes the pool of the process that runs the ops, ``simd`` picks a kernel set
    (default: the best the CPU supports), ``act`` is the activation format ops use when they are
    not given one, ``timeout`` (s) bounds control requests to the executor, ``executor`` is the
    command that starts one (the socket's fd number is appended; default: this Python running
    ``estream_htp._executor``; ``tools/htp_executor_main.c`` builds a C one)."""

    def __init__(
        self,
        kind: str = "host",
        *,
        n_threads: int | None = None,
        simd: str | None = None,
        act: str = "q8",
        timeout: float = 60.0,
        executor: Sequence[str] | None = None,
    ) -> None:
        # long: the constructor's option checks, this backend's state, then one descriptor
        if kind not in BACKENDS:
            raise HTPInputError(f"backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
        if act not in ACT:
            raise HTPInputError(f"activation format must be one of {sorted(ACT)}, got {act!r}")
        if simd is not None and simd not in SIMD_LEVELS:
            raise HTPInputError(
                f"unknown SIMD level {simd!r}; expected one of {sorted(SIMD_LEVELS)}"
            )
        self.kind = kind
        self.act = act
        # the ops read this process's memory by address (no executor to map it for)
        self._in_process = kind == "host"
        self._lock = threading.RLock()
        self._b: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._regions: list[tuple[int, int, int]] = []  # (start, end, id), this process's view
        self._stage: np.ndarray | None = None
        self._stage_id = 0
        self._null: np.ndarray | None = None
        self._dead: str | None = None
        # fences submitted and not waited for, held strongly: a fence keeps its op's operands
        # alive, and one its caller dropped (a pass interrupted half-way) still holds a slot
        # of the queue and may still be run by the executor (see `drain`)
        self._pending: dict[int, Fence] = {}
        # The C side numbers fences 1, 2, ... per backend. `_issued`: the last number this side
        # saw; `_cut`: the fence of a submit cut short between the C call and its bookkeeping
        # (a KeyboardInterrupt raised as the call returns), numbered `_issued + 1` if the C
        # side issued it (`_settle` finds out)
        self._issued = 0
        self._cut: Fence | None = None
        self.ops_submitted = 0  # descriptors submitted (run or submit)
        self.ops_completed = 0  # of those, completions seen with the executing side's times
        self.staged_bytes = 0  # bytes copied through staging (operands outside registered memory)
        # When a list: one (op name, submitted, started, completed) per completed op, in
        # `time.perf_counter` seconds (see `clock_offset`); None: not recorded.
        self.trace: list[tuple[str, float, float, float]] | None = None
        self.clock_offset = _clock_offset()
        if kind == "hexagon":
            n_threads = 1 if n_threads is None else int(n_threads)
            if n_threads != 1:
                raise HTPInputError(
                    "the hexagon executor runs one thread (no threads in its runtime), "
                    f"got {n_threads}"
                )
            if executor is None:
                from estream_htp._hexagon import HexagonToolError, executor_command

                try:
                    executor = executor_command()
                except HexagonToolError as e:
                    raise HTPUnsupportedError(f"Backend('hexagon'): {e}") from None
        n = int(n_threads) if n_threads is not None else default_threads()
        if not 1 <= n <= 64:
            raise HTPInputError(f"n_threads must be in [1, 64], got {n}")
        desc = ffi.new("htp_backend_desc *")
        desc.abi_version = lib.HTP_ABI_VERSION
        desc.n_threads = n
        desc.simd = lib.HTP_SIMD_BEST if simd is None else SIMD_LEVELS[simd]
        desc.sock_fd = -1
        desc.timeout_ms = max(1, int(timeout * 1000))
        pp = ffi.new("htp_backend **")
        if kind == "host":
            desc.kind = lib.HTP_BACKEND_HOST
            st = lib.htp_backend_init(desc, pp)
        else:
            desc.kind = lib.HTP_BACKEND_REMOTE
            desc.sock_fd = self._start_executor(executor)  # the C backend owns it from here
            st = lib.htp_backend_init(desc, pp)
            if st != lib.HTP_OK:
                self._reap(5.0)
        if st == lib.HTP_E_UNSUPPORTED and simd is not None:
            raise HTPUnsupportedError(
                f"SIMD level {simd!r} is not supported by this CPU/build (best is {best_simd_level()!r})"
            )
        check(st, f"Backend({kind!r})")
        self._b = pp[0]
        self._finalizer = weakref.finalize(self, Backend._free, self._b, self._proc)

    def _start_executor(self, executor: Sequence[str] | None) -> int:
        """Start the executor process (``executor``, or this Python running
        ``estream_htp._executor``) on one end of a socket pair; the other end's fd."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = list(executor) if executor else [sys.executable, "-m", "estream_htp._executor"]
        try:
            self._proc = subprocess.Popen(
                [*cmd, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours.detach()

    # ------------------------------------------------------------------ lifetime
    @staticmethod
    def _free(b: Any, proc: subprocess.Popen[bytes] | None) -> None:
        lib.htp_backend_free(b)  # asks the executor to exit, closes the socket and doorbells
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - an executor stuck in an op
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Free the backend (and stop its executor). Later calls raise."""
        with self._lock:
            if self._b is not None:
                self._b = None
                self._finalizer()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._b is None

    @property
    def pid(self) -> int | None:
        """The executor's process id (host-process backends)."""
        return self._proc.pid if self._proc is not None else None

    def _reap(self, timeout: float) -> str:
        p = self._proc
        if p is None:
            return ""
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        return f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"

    def _handle(self) -> Any:
        if self._dead is not None:
            raise ExecutorDiedError(self._dead)
        if self._b is None:
            raise HTPError("the backend is closed")
        return self._b

    def _check(self, status: int, what: str) -> None:
        if status == lib.HTP_E_DEAD and self._b is not None:
            how = self._reap(5.0)
            self._dead = (
                f"{what}: the executor process (pid {self.pid}) died ({how}); "
                "the host-process backend is closed"
            )
            self._regions.clear()
            self._stage = self._null = None
            self._b = None
            self._finalizer()
            err = ExecutorDiedError(self._dead)
            for f in list(self._pending.values()):  # no op can still read its operands
                f.done, f._error, f._keep, f._after = True, err, None, []
            self._pending = {}
            raise err
        check(status, what)

    # ------------------------------------------------------------------ configuration
    @property
    def n_threads(self) -> int:
        return int(lib.htp_backend_threads(self._handle()))

    @property
    def simd(self) -> str:
        return SIMD_NAMES[int(lib.htp_backend_simd(self._handle()))]

    def configure(self, *, n_threads: int | None = None, simd: str | None = None) -> None:
        """Resize the pool and/or switch the kernel set (of the executor, for host-process)."""
        with self._lock:
            b = self._handle()
            n = self.n_threads if n_threads is None else n_threads
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= 64:
                raise HTPInputError(f"n_threads must be an int in [1, 64], got {n!r}")
            if simd is not None and simd not in SIMD_LEVELS:
                raise HTPInputError(
                    f"unknown SIMD level {simd!r}; expected one of {sorted(SIMD_LEVELS)}"
                )
            level = int(lib.htp_backend_simd(b)) if simd is None else SIMD_LEVELS[simd]
            st = lib.htp_backend_configure(b, int(n), level)
            if st == lib.HTP_E_UNSUPPORTED:
                raise HTPUnsupportedError(
                    f"SIMD level {simd!r} is not supported by this CPU/build "
                    f"(best is {best_simd_level()!r})"
                )
            self._check(st, "Backend.configure")

    # ------------------------------------------------------------------ buffers
    def register_fd(
        self,
        fd: int,
        size: int,
        *,
        offset: int = 0,
        writable: bool = True,
        address: int | None = None,
    ) -> int:
        """Register ``size`` bytes of file ``fd`` from ``offset`` (page-aligned); returns the
        buffer id. ``address``: where this process has that range mapped, so that arrays and
        addresses inside it resolve to references of this buffer."""
        if size <= 0 or offset < 0 or offset % mmap.PAGESIZE:
            raise HTPInputError(
                f"size must be > 0 and offset a multiple of {mmap.PAGESIZE}, got {size}, {offset}"
            )
        d = ffi.new("htp_buffer_desc *")
        d.fd = int(fd)
        d.flags = lib.HTP_BUF_READ | (lib.HTP_BUF_WRITE if writable else 0)
        d.offset = offset
        d.size = size
        out = ffi.new("uint32_t *")
        with self._lock:
            self._check(lib.htp_buffer_register(self._handle(), d, out), "register_fd")
            bid = int(out[0])
            if address is not None:
                self._regions.append((int(address), int(address) + int(size), bid))
        return bid

    def _register_host(self, address: int, size: int, writable: bool) -> int:
        d = ffi.new("htp_buffer_desc *")
        d.fd = -1
        d.flags = lib.HTP_BUF_READ | (lib.HTP_BUF_WRITE if writable else 0)
        d.size = size
        d.host_addr = address
        out = ffi.new("uint32_t *")
        self._check(lib.htp_buffer_register(self._handle(), d, out), "register")
        return int(out[0])

    def register_array(self, arr: np.ndarray, *, writable: bool = True) -> int:
        """Register a numpy array's memory by address (host backends only: an executor cannot
        map another process's private memory — use `empty`/`share` for those)."""
        if self.kind != "host":
            raise HTPInputError("only a host backend can register process memory by address")
        if not arr.flags.c_contiguous or arr.nbytes == 0:
            raise HTPInputError("register_array needs a non-empty C-contiguous array")
        with self._lock:
            addr = int(arr.ctypes.data)
            bid = self._register_host(addr, int(arr.nbytes), writable)
            self._regions.append((addr, addr + int(arr.nbytes), bid))
        return bid

    def unregister(self, bid: int) -> None:
        """Forget a buffer. No op that references it may still be in flight."""
        with self._lock:
            self._regions = [r for r in self._regions if r[2] != bid]
            if self._b is not None:
                self._check(lib.htp_buffer_unregister(self._b, int(bid)), "unregister")

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """A new array in shared memory (a memfd) registered with this backend: ops read and
        write it in place, in this process or in the executor. Freed with the array."""
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        size = _page_round(nbytes)
        fd = os.memfd_create("estream-htp-shared", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = _SharedMap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        addr = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
        with self._lock:
            try:
                if self.kind == "host":
                    bid = self._register_host(addr, size, True)
                    self._regions.append((addr, addr + size, bid))
                else:
                    bid = self.register_fd(fd, size, address=addr)
            except BaseException:
                mm.close()
                os.close(fd)
                raise
        os.close(fd)  # the mapping (ours and the executor's) keeps the memory
        weakref.finalize(mm, _unregister_quietly, weakref.ref(self), bid)
        return np.frombuffer(mm, dtype=dt, count=nbytes // dt.itemsize).reshape(shp)

    # ------------------------------------------------------------------ memory for callers
    @property
    def accelerator(self) -> bool:
        """Whether the executor is an accelerator meant to run every op of a pass (hexagon:
        the DSP), not only the expert ops."""
        return self.kind == "hexagon"

    @property
    def shared_memory(self) -> bool:
        """Whether memory the ops are to read in place must be shared memory the backend maps
        itself (a memfd, `expose` with its fd): True when the ops run in an executor process,
        False when they read this process's memory by address."""
        return not self._in_process

    def buffer(
        self,
        shape: int | tuple[int, ...],
        dtype: Any = np.float32,
        *,
        private: Callable[[int], np.ndarray] | None = None,
    ) -> np.ndarray:
        """A new array the ops read and write in place: private memory of this process when
        they run here (``private(nbytes)``, a uint8 array of at least that size, when given —
        e.g. a huge-page mapping —, else numpy's), shared memory registered with the executor
        otherwise (`empty`)."""
        if not self._in_process:
            return self.empty(shape, dtype)
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if private is None:
            return np.empty(shp, dt)
        n = int(np.prod(shp, dtype=np.int64))
        return private(n * dt.itemsize)[: n * dt.itemsize].view(dt).reshape(shp)

    def visible(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` as the ops read it in place: itself when they run in this process, else a
        shared copy (`share`; ``arr`` itself if it already lies in registered memory)."""
        return arr if self._in_process else self.share(arr)

    def expose(
        self, address: int, size: int, *, fd: int | None = None, writable: bool = True
    ) -> int:
        """Make the ``size`` bytes this process has mapped at ``address`` a buffer of the
        backend (its id), so that arrays inside resolve to references: by address when the ops
        run in this process, through ``fd`` (the memfd behind the mapping; required) when they
        run in an executor, which maps it itself. Undone with `unregister`."""
        if self._in_process:
            with self._lock:
                bid = self._register_host(int(address), int(size), writable)
                self._regions.append((int(address), int(address) + int(size), bid))
            return bid
        if fd is None:
            raise HTPInputError(
                f"an executor ({self.kind}) maps shared memory itself: expose needs its fd"
            )
        return self.register_fd(fd, size, writable=writable, address=address)

    def activations(self) -> ActivationArena:
        """A new `ActivationArena` of this backend: where a pass's activations live."""
        return ActivationArena(self)

    def route_buffers(self) -> RouteBuffers:
        """A new `RouteBuffers` of this backend: route arrays as the expert op reads them."""
        return RouteBuffers(self)

    def share(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` itself when it already lies in registered memory, else a shared copy."""
        if arr.flags.c_contiguous and self._resolve(int(arr.ctypes.data), arr.nbytes):
            return arr
        s = self.empty(arr.shape, arr.dtype)
        s[...] = arr
        return s

    def _resolve(self, address: int, nbytes: int) -> tuple[int, int] | None:
        for start, end, bid in self._regions:
            if start <= address and address + nbytes <= end:
                return bid, address - start
        return None

    def _null_ref(self) -> tuple[int, int]:
        if self._null is None:
            self._null = self.empty(64, np.uint8)
        r = self._resolve(int(self._null.ctypes.data), 64)
        assert r is not None
        return r

    def _staging(self, nbytes: int) -> np.ndarray:
        """The shared buffer synchronous calls copy unregistered operands through."""
        if self._stage is None or self._stage.nbytes < nbytes:
            self._stage = None  # the old one unregisters when collected; no op uses it now
            self._stage = self.empty(max(nbytes, 1 << 20) * 2, np.uint8)
        return self._stage

    # ------------------------------------------------------------------ ops
    def call(self, opcode: int, act: str | None = None) -> Call:
        """A descriptor under construction (see `Call`)."""
        return Call(self, opcode, act)

    def _submit(self, c: Call, *, sync: bool) -> Fence:
        with self._lock:
            b = self._handle()
            self._settle()
            keep, after = c._finish(sync)
            out = ffi.new("uint64_t *")
            # recorded before the call: an exception raised as it returns loses no op
            f = self._cut = Fence(self, 0, c.what, keep, after)
            st = lib.htp_op_submit(b, c.desc, out)
            if st != lib.HTP_OK:
                self._cut = None
                for fn in after:
                    fn()
                self._check(st, c.what)
            f.value = self._issued = int(out[0])
            self._pending[f.value] = f
            self._cut = None
            self.ops_submitted += 1
            return f

    def _settle(self) -> None:
        """Wait for the op of a submit cut short (`_cut`) if the C side issued it: its number is
        the one after the last seen, and nothing else can have waited for it."""
        f, self._cut = self._cut, None
        if f is None or self._b is None:
            return
        f.value = self._issued + 1
        self._pending[f.value] = f
        self._wait(f, _NO_TIMEOUT)
        if not isinstance(f._error, _NeverIssued):
            self._issued = f.value

    def _wait(self, f: Fence, timeout_ms: int) -> None:
        with self._lock:
            try:
                b = self._handle()
            except HTPError as e:
                f.done, f._error, f._keep, f._after = True, e, None, []
                raise
            opst = ffi.new("htp_status *")
            tm = ffi.new("htp_op_times *")
            st = lib.htp_fence_wait_timed(b, f.value, timeout_ms, opst, tm)
            if st == lib.HTP_E_FENCE:  # never issued, or waited for by a wait cut short
                self._pending.pop(f.value, None)
                f.done, f._error, f._keep = True, _NeverIssued(f"{f.what}: fence {f.value}"), None
                after, f._after = f._after, []
                for fn in after:
                    fn()
                return
            if st == lib.HTP_E_TIMEOUT:
                raise HTPTimeoutError(f"{f.what}: fence {f.value} still pending")
            try:
                self._check(st, f.what)
            except HTPError as e:  # the executor is gone: nothing reads the operands any more
                f.done, f._error, f._keep, f._after = True, e, None, []
                raise
            f.done = True
            self._pending.pop(f.value, None)
            if tm.started_ns:
                self.ops_completed += 1
                if self.trace is not None:
                    o = self.clock_offset
                    self.trace.append(
                        (
                            f.what,
                            tm.submitted_ns * 1e-9 + o,
                            tm.started_ns * 1e-9 + o,
                            tm.completed_ns * 1e-9 + o,
                        )
                    )
            try:
                for fn in f._after:
                    fn()
            finally:
                f._keep = None
                f._after = []
            try:
                check(int(opst[0]), f.what)
            except HTPError as e:
                f._error = e

    def run(self, c: Call) -> None:
        """Submit and wait: the op's error is raised."""
        if self.kind == "host":
            # one C call: operands outside registered memory become per-call buffers
            with self._lock:
                b = self._handle()
                tmp, n = c._host_tmp()
                self.ops_submitted += 1
                self._check(lib.htp_op_run_tmp(b, c.desc, tmp, n), c.what)
            return
        self._submit(c, sync=True).wait()

    def drain(self) -> None:
        """Wait for every op submitted and not waited for yet, ignoring the ops' own errors:
        after a caller dropped its fences half-way (an exception or Ctrl-C between submit and
        wait), so that no op still reads or writes memory about to be freed or reused and the
        queue has all its slots again. Raises `ExecutorDiedError` if the executor is gone."""
        while True:
            with self._lock:
                if self._b is not None:
                    self._settle()
                fences = list(self._pending.values())
            if not fences:
                return
            for f in fences:
                try:
                    f.wait()
                except ExecutorDiedError:
                    raise
                except HTPError:
                    pass
                finally:
                    with self._lock:
                        self._pending.pop(f.value, None)

    def stats(self) -> dict[str, int]:
        """Counters since creation (or `reset_stats`): ``ops_submitted``; ``ops_completed``,
        completions that carried the executing side's start/end times (every op waited for
        through a fence; a host backend's synchronous `run` has none); ``staged_bytes``, bytes
        copied through staging buffers in and out because an operand was not in memory
        registered with the backend (0 when every operand is passed by reference)."""
        return {
            "ops_submitted": self.ops_submitted,
            "ops_completed": self.ops_completed,
            "staged_bytes": self.staged_bytes,
        }

    def reset_stats(self) -> None:
        self.ops_submitted = self.ops_completed = self.staged_bytes = 0

    def submit(self, c: Call) -> Fence:
        """Queue an op; operands not in registered memory are copied into fresh shared buffers
        (host-process) or registered until the fence completes (host)."""
        return self._submit(c, sync=False)


class ActivationArena:
    """Where the activations of a pass live: memory the backend's ops read and write in place
    (`Backend.buffer`: private memory on the host kind, shared memory registered with the
    executor on the others), so every op takes its operands by reference.

    Three bump arenas: ``pass`` (the pass's inputs: token ids, positions, row indices), and two
    that alternate stage by stage (the embedding, each layer, the head): a stage allocates from
    its own arena, reset when the stage starts, and reads its input — the previous stage's
    output — from the other one. An arena that had to grow during a stage (extra chunks) is
    coalesced at its next reset into one chunk of what that stage used, so each settles at the
    largest stage it served (at least 1 MiB) and the whole at about twice the largest stage's
    activations plus the inputs, whatever the number of layers; it is reused across layers and
    passes (registered once: steady passes register nothing) and keeps its size."""

    ALIGN = 128  # bytes: HVX vector loads, cache lines

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._arenas = [_BumpArena(backend) for _ in range(3)]
        self._stage = 0
        self._cur = self._arenas[0]

    @property
    def nbytes(self) -> int:
        """Bytes of memory the arena holds."""
        return sum(a.nbytes for a in self._arenas)

    def begin_pass(self) -> None:
        for a in self._arenas:
            a.reset()
        self._stage = 0
        self._cur = self._arenas[0]

    def begin_stage(self) -> None:
        """The next stage of the pass (embedding, layer, head): its arena is reset."""
        self._stage += 1
        self._cur = self._arenas[1 + self._stage % 2]
        self._cur.reset()

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return self._cur.alloc(shape, np.dtype(dtype))

    def owns(self, a: np.ndarray) -> bool:
        addr = int(a.__array_interface__["data"][0])
        return any(arena.owns(addr) for arena in self._arenas)

    def put_input(self, a: np.ndarray) -> np.ndarray:
        """A host array (token ids, positions) copied into the pass arena: the pass's input."""
        dst = self._arenas[0].alloc(a.shape, a.dtype)
        dst[...] = a
        return dst


class _BumpArena:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.chunks: list[np.ndarray] = []
        self.off = 0
        self.used = 0  # bytes handed out since the last reset (the stage's activations)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def owns(self, addr: int) -> bool:
        for c in self.chunks:
            base = int(c.ctypes.data)
            if base <= addr < base + c.nbytes:
                return True
        return False

    def reset(self) -> None:
        if len(self.chunks) > 1:  # grown during the last use: one chunk of what it used
            self.chunks = []
            self.chunks = [self._chunk(max(self.used, 1 << 20))]
        self.off = 0
        self.used = 0

    def _chunk(self, nbytes: int) -> np.ndarray:
        # page-aligned in either memory, so ALIGN-rounded offsets stay aligned
        return self.backend.buffer(nbytes, np.uint8, private=_private_pages)

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        step = max(ActivationArena.ALIGN, -(-n // ActivationArena.ALIGN) * ActivationArena.ALIGN)
        if not self.chunks or self.off + step > self.chunks[-1].nbytes:
            last = self.chunks[-1].nbytes if self.chunks else 0
            self.chunks.append(self._chunk(max(step, 2 * last, 1 << 20)))
            self.off = 0
        c = self.chunks[-1]
        out = c[self.off : self.off + n].view(dtype).reshape(shape)
        self.off += step
        self.used += step
        return out


def _private_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` of private anonymous memory, page-aligned (freed with the array)."""
    mm = mmap.mmap(-1, _page_round(nbytes), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


class RouteBuffers:
    """Route arrays (tokens, experts, weights, slot maps: the expert op's descriptor data,
    made on the host from the router's output) and activations as the backend's ops read them
    in place: for an executor, copied into cached shared buffers (grown when too small) unless
    already in registered memory; when the ops run in this process, the arrays themselves."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._bufs: dict[str, np.ndarray] = {}

    def put(self, name: str, a: np.ndarray) -> np.ndarray:
        """``a`` where the ops read it (the buffer ``name`` is reused by the next `put`)."""
        if self.backend._in_process:
            return a
        buf = self._bufs.get(name)
        if buf is None or buf.size < a.size or buf.dtype != a.dtype:
            buf = self._bufs[name] = self.backend.empty(max(a.size, 1), a.dtype)
        v = buf[: a.size].reshape(a.shape)
        v[...] = a
        return v

    def in_place(self, a: np.ndarray) -> bool:
        """Whether the ops read and write ``a`` itself (no copy through `put`)."""
        if self.backend._in_process:
            return True
        return (
            a.flags.c_contiguous and self.backend._resolve(int(a.ctypes.data), a.nbytes) is not None
        )

    def activation(self, name: str, a: np.ndarray) -> np.ndarray:
        """``a`` itself when the ops read it in place, else its copy in the buffer ``name``."""
        return a if self.in_place(a) else self.put(name, a)


def _unregister_quietly(ref: weakref.ref[Backend], bid: int) -> None:
    """Finalizer of a registered mapping. It runs wherever the collector runs, so a signal
    handler's exception (Ctrl-C) can land inside it, where Python would print and drop it: the
    buffer would stay registered and its range in `_regions`, and a later mapping at the same
    address would resolve to the stale buffer. So the unregistration is finished first, then
    a KeyboardInterrupt is raised again in the main thread."""
    b = ref()
    if b is None or b._b is None:
        return
    with b._lock:  # no other thread registers (and reuses the id) between the two attempts
        try:
            with contextlib.suppress(HTPError):  # the backend may have died meanwhile
                b.unregister(bid)
        except BaseException as exc:
            with contextlib.suppress(HTPError):  # done already: an error, nothing freed twice
                b.unregister(bid)
            if not isinstance(exc, KeyboardInterrupt):
                raise
            _thread.interrupt_main()  # seen by the code the collector interrupted


class Call:
    """One descriptor being built: `ref` adds operands in the op's order, `p` holds the op's
    parameters (``c.p.gemm.n = ...``)."""

    def __init__(self, backend: Backend, opcode: int, act: str | None) -> None:
        self.backend = backend
        self.desc = ffi.new("htp_op_desc *")
        self.desc.opcode = opcode
        a = backend.act if act is None else act
        if a not in ACT:
            raise HTPInputError(f"activation format must be one of {sorted(ACT)}, got {a!r}")
        self.desc.act = ACT[a]
        self.p = self.desc.p
        self.what = "op"
        self._ops: list[
            tuple[int, Any, int, int, str]
        ] = []  # (slot, array|None, addr, nbytes, mode)

    def ref(self, arr: np.ndarray, mode: str = "r") -> Call:
        """Operand: a C-contiguous array, read ("r"), written ("w") or both ("rw")."""
        i = len(self._ops)
        self._ops.append((i, arr, arr.__array_interface__["data"][0], arr.nbytes, mode))
        self.desc.n_refs = i + 1
        return self

    def ref_span(self, arr: np.ndarray, nbytes: int, mode: str = "r") -> Call:
        """Operand: the ``nbytes`` from the first element of ``arr`` (a row-strided view: its
        rows lie inside that span). It must be in registered memory on an executor backend
        (nothing is staged for it); a host backend registers the span for the op."""
        i = len(self._ops)
        addr = arr.__array_interface__["data"][0]
        self._ops.append((i, arr if arr.flags.c_contiguous else None, addr, int(nbytes), mode))
        self.desc.n_refs = i + 1
        return self

    def ref_address(self, address: int, nbytes: int) -> Call:
        """Operand given by address (must resolve to registered memory, or be host memory on
        a host backend, registered for the op)."""
        i = len(self._ops)
        self._ops.append((i, None, int(address), int(nbytes), "r"))
        self.desc.n_refs = i + 1
        return self

    def _host_tmp(self) -> tuple[Any, int]:
        """Host backends: unresolved operands as per-call buffers ``HTP_TMP_BUFFER + i``."""
        be = self.backend
        tmp = []
        d = self.desc
        for slot, _arr, addr, nbytes, mode in self._ops:
            r = be._null_ref() if nbytes == 0 else be._resolve(addr, nbytes)
            if r is not None:
                d.ref[slot].buffer, d.ref[slot].offset = r
                continue
            flags = lib.HTP_BUF_READ | (lib.HTP_BUF_WRITE if "w" in mode else 0)
            d.ref[slot].buffer = lib.HTP_TMP_BUFFER + len(tmp)
            tmp.append((-1, flags, 0, nbytes, addr))
        return (ffi.new("htp_buffer_desc[]", tmp) if tmp else ffi.NULL), len(tmp)

    def _finish(self, sync: bool) -> tuple[list[Any], list[Callable[[], None]]]:
        be = self.backend
        keep: list[Any] = []
        after: list[Callable[[], None]] = []
        pending: list[tuple[int, Any, int, int, str]] = []
        for slot, arr, addr, nbytes, mode in self._ops:
            keep.append(arr)
            r = be._null_ref() if nbytes == 0 else be._resolve(addr, nbytes)
            if r is None:
                pending.append((slot, arr, addr, nbytes, mode))
                continue
            self.desc.ref[slot].buffer, self.desc.ref[slot].offset = r
        if not pending:
            return keep, after
        if be.kind == "host":
            for slot, _arr, addr, nbytes, mode in pending:
                bid = be._register_host(addr, nbytes, "w" in mode)
                self.desc.ref[slot].buffer = bid
                after.append(
                    lambda bid=bid: be._check(lib.htp_buffer_unregister(be._b, bid), "unregister")
                )
            return keep, after
        # host-process: copy through shared memory
        for _slot, arr, _addr, _nbytes, _mode in pending:
            if arr is None:
                raise HTPInputError(
                    f"{self.what}: an operand address is not inside memory registered with this "
                    "host-process backend (register the memfd with Backend.register_fd)"
                )
        offs = []
        total = 0
        for _slot, _arr, _addr, nbytes, _mode in pending:
            offs.append(total)
            total += -(-nbytes // 64) * 64
        stage = be._staging(total) if sync else be.empty(max(total, 64), np.uint8)
        base = be._resolve(int(stage.ctypes.data), total)
        assert base is not None
        keep.append(stage)
        for (slot, arr, _addr, nbytes, mode), off in zip(pending, offs):
            view = stage[off : off + nbytes]
            be.staged_bytes += nbytes * (("r" in mode) + ("w" in mode))
            if "r" in mode:
                view[...] = arr.reshape(-1).view(np.uint8)
            self.desc.ref[slot].buffer = base[0]
            self.desc.ref[slot].offset = base[1] + off
            if "w" in mode:
                after.append(lambda a=arr, v=view: a.reshape(-1).view(np.uint8).__setitem__(..., v))
        return keep, after


def _clock_offset() -> float:
    """``time.perf_counter()`` minus CLOCK_MONOTONIC (seconds): the executor stamps its op
    times with CLOCK_MONOTONIC (under qemu-user the host kernel's, the same clock), the
    host's spans use perf_counter. The two are the same clock on Linux (offset ~0); measured
    anyway (the smallest of a few bracketing reads) so the conversion is explicit."""
    best = None
    for _ in range(5):
        a = time.perf_counter()
        m = time.clock_gettime(time.CLOCK_MONOTONIC)
        b = time.perf_counter()
        if best is None or b - a < best[0]:
            best = (b - a, (a + b) / 2 - m)
    assert best is not None
    return best[1]


# ---------------------------------------------------------------------- defaults
def default_threads() -> int:
    env = os.environ.get("ESTREAM_HTP_THREADS", "").strip()
    if env:
        return int(env)
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 64))


def best_simd_level() -> str:
    return SIMD_NAMES[int(lib.htp_simd_best())]
