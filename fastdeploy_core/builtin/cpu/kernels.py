"""The cpu device's C++ kernels: custom ops built once per machine, loaded on first use.

``csrc/weight_only_gemm.cc`` (float32 and quantized linear layers), ``csrc/paged_attention.cc``
(rotary + KV write, paged attention), ``csrc/rms_norm.cc``, ``csrc/activation.cc`` (SwiGLU),
``csrc/sampling.cc`` (argmax), ``csrc/greedy_head.cc`` (greedy tokens from the float32 LM head
through an int8 screen), ``csrc/bf16_gemm.cc`` (bfloat16 linear layers), ``csrc/embedding.cc``
(token lookups), ``csrc/moe.cc`` (routed experts, grouped by expert), ``csrc/mla_attention.cc``
(latent attention, absorbed form), ``csrc/pool_check.cc`` (a self-check of the thread pool)
and ``csrc/graph.cc`` (captured
decode steps, see ``graph.h``) are compiled with ``paddle.utils.cpp_extension`` (gcc,
``-O3 -march=native``, its own thread pool) into a cache directory (``$FD_KERNEL_CACHE``, default
``~/.cache/fastdeploy/kernels``) under a name that hashes the source, the flags, the Paddle
version and the CPU's feature flags, so a changed source or another machine builds afresh and
an unchanged one loads the cached library in well under a second. A file lock keeps
concurrent processes from building the same library twice.

When the build fails (no compiler, no Python headers) or ``FD_CPU_KERNELS=0`` is set, :func:`load_kernels` returns ``None`` and logs why once; the cpu ops then run their
plain-Paddle reference path (and keep weights in the plain layout).

The kernels are written on 16-float vectors (``csrc/vector_math.h``): one AVX-512 register, or
on an AVX2 CPU a pair of 256-bit registers. A CPU with neither AVX-512 nor AVX2 with FMA would
keep such vectors in memory (as GCC did with plain 64-byte vector types on an AVX2 EPYC before
the pair: 7-24x slower than Paddle's own ops), so there the kernels are not loaded unless
``FD_CPU_KERNELS=1`` (or ``choose_kernels_on_any_cpu()``, which the test process calls, to
check their results on every CPU) asks for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import logging
import os
import threading
from pathlib import Path

from fastdeploy_core.builtin.cpu.process_env import KERNELS_ENV, kernels_disabled, kernels_forced
from fastdeploy_core.devices import host_cpu
from fastdeploy_core.devices.host_cpu import cpu_flags

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    _CSRC / "weight_only_gemm.cc",
    _CSRC / "paged_attention.cc",
    _CSRC / "rms_norm.cc",
    _CSRC / "activation.cc",
    _CSRC / "sampling.cc",
    _CSRC / "greedy_head.cc",
    _CSRC / "embedding.cc",
    _CSRC / "graph.cc",
    _CSRC / "moe.cc",
    _CSRC / "bf16_gemm.cc",
    _CSRC / "w8a8_gemm.cc",
    _CSRC / "mla_attention.cc",
    _CSRC / "pool_check.cc",
)
# Every header of the directory: the library's name hashes them (library_name), so an edit of
# any one rebuilds the kernels (a list by hand once missed tile_argmax.h).
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
CXX_FLAGS = ["-O3", "-march=native", "-pthread", "-std=c++17"]
LD_FLAGS = ["-pthread"]
CACHE_ENV = "FD_KERNEL_CACHE"

_lock = threading.Lock()
_module = None
_failure: str | None = None
_tried = False


def cache_dir() -> Path:
    """Where built kernel libraries are kept."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy", "kernels")
    return Path(root)


def library_name() -> str:
    """``fd_cpu_kernels_<hash>``: the hash covers what changes the binary."""
    import paddle

    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(CXX_FLAGS + LD_FLAGS).encode())
    digest.update(paddle.__version__.encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return f"fd_cpu_kernels_{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def _quiet_paddle_extension_log():
    """Paddle logs "using custom operator only" at INFO on every load of a custom-op library
    (``verbose=False`` does not reach that line), through a handler of its own and again through
    the root logger: it says nothing to a user, so its logger stays at WARNING while we load."""
    ext_logger = logging.getLogger("utils.cpp_extension")
    level = ext_logger.level
    ext_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        ext_logger.setLevel(level)


def _import_built(name: str, build_dir: Path):
    from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

    with _quiet_paddle_extension_log():
        return _import_module_from_library(name, str(build_dir / name), False)


def _build(name: str, build_dir: Path):
    from paddle.utils.cpp_extension import load

    # The build prints progress and warnings to stdout/stderr; keep them out of the server log
    # and report a failure through the exception instead.
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), _quiet_paddle_extension_log():
        return load(
            name=name,
            sources=[str(s) for s in SOURCES],
            extra_cxx_cflags=CXX_FLAGS,
            extra_ldflags=LD_FLAGS,
            build_directory=str(build_dir),
            verbose=False,
        )


def load_kernels():
    """The kernel module (``fd_f32_linear``, ``fd_f32_linear_silu``, ``fd_int8_linear``, ``fd_int4_linear``, ``fd_fp8_linear``,
    ``fd_rope_write_kv``, ``fd_paged_attention``, ``fd_rms_norm``, ``fd_add_rms_norm``, ``fd_silu_mul``,
    ``fd_argmax``, ``fd_greedy_head``, ``fd_greedy_head_prepare``, ``fd_fused_moe``, ``fd_bf16_linear``,
    ``fd_mla_absorbed_attention``...) or ``None``."""
    global _module, _failure, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            if kernels_disabled():
                raise RuntimeError(f"{KERNELS_ENV}=0 is set")
            if not kernel_vectors_fit() and not (kernels_forced() or _chosen_on_any_cpu):
                raise RuntimeError(
                    "this CPU has neither AVX-512 nor AVX2 with FMA: the kernels' 16-float vectors would live in "
                    "memory, many times slower than Paddle's own ops, so Paddle's are used "
                    f"({KERNELS_ENV}=1 uses the kernels anyway)"
                )
            name = library_name()
            build_dir = cache_dir()
            build_dir.mkdir(parents=True, exist_ok=True)
            with open(build_dir / f"{name}.lock", "w") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
                try:
                    if (build_dir / name / f"{name}.so").exists():
                        _module = _import_built(name, build_dir)
                    else:
                        logger.info("building the cpu kernels into %s (once per machine)", build_dir)
                        _module = _build(name, build_dir)
                finally:
                    fcntl.flock(lock_file, fcntl.LOCK_UN)
        except Exception as exc:  # noqa: BLE001 - any build or load problem means: use the reference path
            _failure = f"{type(exc).__name__}: {exc}"
            _module = None
            logger.warning(
                "cpu kernels unavailable (%s); every op runs the plain-Paddle reference path",
                _failure.splitlines()[0][:500],
            )
        _tried = True
        return _module


def kernel_vectors_fit() -> bool:
    """Whether the kernels' 16-float vectors fit this CPU's registers: one AVX-512 register, or two
    AVX2 ones (with FMA)."""
    return host_cpu.has_avx512f() or host_cpu.has_avx2_fma()


#: Set by :func:`choose_kernels_on_any_cpu`: this process uses the kernels even on a CPU whose
#: registers do not fit their vectors.
_chosen_on_any_cpu = False


def choose_kernels_on_any_cpu() -> None:
    """Use the kernels in this process whatever the CPU (as ``FD_CPU_KERNELS=1`` does, but not
    inherited by child processes): the test suite checks the kernels' results on every CPU while
    the servers its tests start choose as a user's would."""
    global _chosen_on_any_cpu
    _chosen_on_any_cpu = True


def has_int8_dot() -> bool:
    """Whether the kernels have integer dot products here (``csrc/int8_dot.h``, the kernels being
    built with ``-march=native``): ``vpdpbusd`` with AVX-512 VNNI, else ``vpmaddubsw`` +
    ``vpmaddwd`` with AVX2, FMA and F16C. ``fd_int4_linear`` then multiplies the int4 VNNI
    layout, and ``fd_greedy_head`` screens the LM head in int8."""
    flags = cpu_flags()
    return ("avx512_vnni" in flags and "avx512bw" in flags) or (host_cpu.has_avx2_fma() and "f16c" in flags)


def has_avx512_bf16() -> bool:
    """Whether this CPU lists AVX-512 BF16 (``fd_bf16_linear`` then multiplies with ``vdpbf16ps``;
    the kernel itself decides at run time, this is what tests and benchmarks report)."""
    return "avx512_bf16" in cpu_flags()


def has_amx_bf16() -> bool:
    """Whether this CPU lists AMX tiles with BF16 (``fd_bf16_linear``'s auto path then multiplies
    in tiles, once the OS grants the tile state and the tiles pass the kernel's self-check:
    ``fd_bf16_amx_state``)."""
    flags = cpu_flags()
    return "amx_bf16" in flags and "amx_tile" in flags


def has_amx_int8() -> bool:
    """Whether this CPU lists AMX tiles with INT8 (``fd_w8a8_linear``'s auto path then multiplies
    calls of 16 rows or more in tiles, once the OS grants the tile state and the tiles pass the
    kernel's self-check: ``fd_w8a8_amx_state``)."""
    flags = cpu_flags()
    return "amx_int8" in flags and "amx_tile" in flags


#: The kernels' AMX state ops: ``fd_bf16_linear``, ``fd_w8a8_linear`` and the attention of prompt
#: chunks over a bfloat16 KV cache.
AMX_STATE_OPS = ("fd_bf16_amx_state", "fd_w8a8_amx_state", "fd_attention_amx_state")


def amx_state(op: str, model: int = 0) -> int:
    """A kernel's AMX tiles in this process (``op``: one of :data:`AMX_STATE_OPS`): 0 none (no AMX
    here, or the OS refused the tile state), 1 its auto path uses them, 2 they failed the kernel's
    self-check. ``model=1`` runs that self-check on the software model of the tiles instead (1 it
    passes, 2 not); ``fd_bf16_amx_state`` also takes ``model=2``, tiles that fault (the check's
    safety net). 0 without kernels."""
    if op not in AMX_STATE_OPS:
        raise ValueError(f"{op!r} is not one of the AMX state ops {AMX_STATE_OPS}")
    if load_kernels() is None:
        return 0
    import paddle
    from paddle import _C_ops

    return int(_C_ops._run_custom_op(op, paddle.zeros([1]), int(model))[0].numpy()[0])


def matrix_paths() -> dict[str, str]:
    """Which arithmetic the auto paths of ``fd_bf16_linear``, ``fd_w8a8_linear`` and the attention
    of prompt chunks over a bfloat16 KV cache take in this process (what a benchmark result should
    say it measured); empty without kernels."""
    if load_kernels() is None:
        return {}

    def bf16(op: str) -> str:
        return "amx tiles (tdpbf16ps)" if amx_state(op) == 1 else "vdpbf16ps" if has_avx512_bf16() else "widen to float32"

    return {
        "bf16_linear": bf16("fd_bf16_amx_state"),
        "bf16_kv_prompt_attention": bf16("fd_attention_amx_state"),
        "int8_linear": "amx tiles (tdpbssd) from 16 rows, else vpdpbusd" if amx_state("fd_w8a8_amx_state") == 1
        else "vpdpbusd" if "avx512_vnni" in cpu_flags() else "vpmaddubsw" if has_int8_dot() else "scalar",
    }


def kernel_failure() -> str | None:
    """Why :func:`load_kernels` returned ``None`` (after it was called), else ``None``."""
    return _failure


def reset_for_tests() -> None:
    """Forget the loaded module so the next :func:`load_kernels` call tries again."""
    global _module, _failure, _tried
    with _lock:
        _module, _failure, _tried = None, None, False
