"""llama.cpp (through llama-cpp-python) as an oracle: install it once, run it in a subprocess.

llama-cpp-python compiles llama.cpp from source (~10 min on 2 cores), so the built wheel is
cached under ``<repo>/.cache/wheels/llama-cpp-noamx`` (gitignored) and reused by every later
install. The build leaves out llama.cpp's AMX path: on Intel Xeons with AMX its Q4_0 matmul
crashes with SIGSEGV in ``ggml_backend_amx_mul_mat`` (seen here on a synthetic OLMoE; upstream
ggml-org/llama.cpp#20824, closed unfixed), so every benchmark would lose its baseline. AVX-512,
VNNI, BF16 and the weight repacking stay on. Each
evaluation (and each run of llama.cpp's quantizer, :func:`llama_quantize`) runs in a child process: a GGUF llama.cpp refuses can end in ``GGML_ASSERT`` →
``abort()``, and we want the exact message it printed, not a dead benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "LLAMA_CPP_PYTHON",
    "WHEEL_DIR",
    "LlamaCppError",
    "ensure_llama_cpp",
    "llama_cpp_version",
    "llama_logits",
    "llama_quantize",
]

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / ".cache" / "wheels" / "llama-cpp-noamx"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
BUILD_LOG = Path(tempfile.gettempdir()) / "llamacpp-build.log"
# A plain CPU build tuned for this machine; no tools/examples/tests/multimodal, no curl.
# GCC keeps an explicit -mno-* over what -march=native turns on, whatever their order.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS = (
    "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    f"-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF '-DCMAKE_C_FLAGS={NO_AMX}' '-DCMAKE_CXX_FLAGS={NO_AMX}'"
)


class LlamaCppError(RuntimeError):
    """llama.cpp could not load or evaluate a model; ``log`` holds what it printed."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


def _importable(python: str) -> bool:
    """llama_cpp imports, and is a build without the AMX path (an older cached build had it)."""
    probe = subprocess.run(
        [python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0 and "AMX_INT8 = 1" not in probe.stdout


def _cached_wheel() -> Path | None:
    wheels = sorted(WHEEL_DIR.glob("llama_cpp_python-0.3.36-*.whl"))
    return wheels[-1] if wheels else None


def ensure_llama_cpp(python: str = sys.executable) -> None:
    """Make ``import llama_cpp`` work for ``python``, building the wheel only if not cached."""
    if _importable(python):
        return
    if _cached_wheel() is None:
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        print(
            f"building {LLAMA_CPP_PYTHON} from source (many minutes on 2 cores), log: {BUILD_LOG}",
            flush=True,
        )
        env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL="2")
        with BUILD_LOG.open("w") as log:
            done = subprocess.run(
                ["nice", "-n", "10", python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
                 LLAMA_CPP_PYTHON, "-w", str(WHEEL_DIR)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        if done.returncode != 0 or _cached_wheel() is None:
            raise LlamaCppError(f"building {LLAMA_CPP_PYTHON} failed; see {BUILD_LOG}")
    # deps first (a no-op when present), then this wheel over any other build of the version
    pip = [python, "-m", "pip", "install", "-q", "--find-links", str(WHEEL_DIR)]
    subprocess.run([*pip, LLAMA_CPP_PYTHON], check=True)
    subprocess.run([*pip, "--force-reinstall", "--no-deps", LLAMA_CPP_PYTHON], check=True)


def llama_cpp_version(python: str = sys.executable) -> str:
    out = subprocess.run(
        [python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


# Runs in the child: load, evaluate all positions in one batch, save the logits.
_CHILD = r"""
import json, sys
import numpy as np
import llama_cpp
spec = json.loads(sys.argv[1])
tokens = spec["tokens"]
n = len(tokens)
llm = llama_cpp.Llama(
    model_path=spec["model"], n_ctx=max(n, 64), n_batch=n, n_ubatch=n,
    n_threads=spec["threads"], n_threads_batch=spec["threads"], logits_all=True,
    embedding=False, verbose=True, use_mmap=True, seed=0,
    **({"type_k": 0, "type_v": 0} if spec["kv_f32"] else {}),  # 0 = GGML_TYPE_F32
)
llm.eval(tokens)
np.save(spec["out"], np.asarray(llm.scores[:n], dtype=np.float32))
"""


def llama_logits(
    gguf_path: str | os.PathLike[str],
    tokens: Sequence[int],
    *,
    n_threads: int = 2,
    kv_f32: bool = False,
    python: str = sys.executable,
    timeout: float = 1800.0,
) -> np.ndarray:
    """All-position logits ``[T, n_vocab]`` (float32) llama.cpp computes for ``tokens``.

    ``kv_f32`` keeps the KV cache in F32 instead of llama.cpp's default F16. Raises
    :class:`LlamaCppError` with the tail of llama.cpp's log if it refuses the model.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        spec = {
            "model": os.fspath(gguf_path),
            "tokens": [int(t) for t in tokens],
            "threads": n_threads,
            "kv_f32": kv_f32,
            "out": str(out),
        }
        done = subprocess.run(
            [python, "-c", _CHILD, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0 or not out.exists():
            log = done.stderr + done.stdout
            raise LlamaCppError(_error_lines(log) or f"exit code {done.returncode}", log)
        return np.load(out)


# llama_ftype values (llama.h) of the quantizations the benchmarks ask llama.cpp for.
LLAMA_FTYPES = {"F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
                "MXFP4_MOE": 38}  # fmt: skip

# Runs in the child: llama.cpp's own quantizer (what the llama-quantize tool calls).
_QUANT_CHILD = r"""
import ctypes, json, sys
import llama_cpp
spec = json.loads(sys.argv[1])
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = spec["ftype"]
params.nthread = spec["threads"]
rc = llama_cpp.llama_model_quantize(spec["src"].encode(), spec["dst"].encode(), ctypes.byref(params))
sys.exit(0 if rc == 0 else 3)
"""


def llama_quantize(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    ftype: str,
    *,
    n_threads: int = 2,
    python: str = sys.executable,
    timeout: float = 1800.0,
) -> str:
    """Quantize the GGUF ``src`` to ``dst`` with llama.cpp's quantizer (``llama_model_quantize``,
    the function behind ``llama-quantize``), ``ftype`` one of :data:`LLAMA_FTYPES`, e.g.
    ``"Q4_K_M"``. Written under a temporary name and renamed; returns llama.cpp's log. Raises
    :class:`LlamaCppError` with the lines of the log that say why if it fails."""
    if ftype not in LLAMA_FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; choose from {sorted(LLAMA_FTYPES)}")
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    spec = {"src": os.fspath(src), "dst": str(tmp), "ftype": LLAMA_FTYPES[ftype],
            "threads": n_threads}  # fmt: skip
    try:
        done = subprocess.run(
            [python, "-c", _QUANT_CHILD, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        log = done.stderr + done.stdout
        if done.returncode != 0 or not tmp.exists():
            raise LlamaCppError(_error_lines(log) or f"exit code {done.returncode}", log)
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return log


def _error_lines(log: str) -> str:
    """The lines of a llama.cpp log that say what went wrong."""
    keys = ("error", "failed", "GGML_ASSERT", "exception", "what():", "Error", "abort")
    lines = [ln.strip() for ln in log.splitlines() if any(k in ln for k in keys)]
    return "\n".join(dict.fromkeys(lines))[-4000:]
