"""AOTInductor kernels of small functions of tensors, for `engine.compile_host` (CPU).

`AotKernels` exports a function (an `nn.Module` over positional tensors) with the dims it is told are dynamic
(the batch, a growing length), compiles it once per key with AOTInductor and hands back the package's loader,
whose `boxed_run` is called directly, skipping the packaged model's Python wrapper (it re-reads the pytree
spec and flattens the arguments on every call). A kernel does not check its inputs' shapes, so a key
must name every size that is not dynamic. A key is compiled once it has been asked for `COMPILE_AFTER`
times (~7 s each on this CPU): a fixed block size compiles after a few passes, while the many block sizes a
`block_complexity=auto` job tries once or twice never cost a compile. A function that fails to compile gets no
kernel (logged once). Without a kernel the caller runs the function eagerly.

Packages are kept by the exported program's fingerprint (its graph, its inputs' specs and its constants' values)
for the process (a benchmark's next setting, an actor's next engine) and on disk, in the machine's Inductor cache
directory ($TORCHINDUCTOR_CACHE_DIR, else /tmp/torchinductor_$USER): the actors of one machine build each kernel
once between them, and a restarted actor or the next job loads it (AOTInductor itself caches nothing across
processes). A package is built under a file lock, so processes that reach one kernel at once build it once (two
AOTInductor builds of one program in one cache directory overwrite each other's files) and then load it.
TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 turns the disk copy off, as it does Inductor's caches.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import torch

from ..model.errors import ModelLoadError

log = logging.getLogger(__name__)

COMPILE_AFTER = 32  # calls of a key before it is compiled
_COMPILED: dict[str, Any] = {}  # the exported program's fingerprint -> its package loader, for the process
_LOCK_TIMEOUT_S = 600  # longest wait for another process building the same package
_PACKAGES: Optional[tempfile.TemporaryDirectory] = None  # the packages' files, removed at exit (`_packages`)
# How the packages are built: the wrapper (C++ glue that calls the kernels) unoptimised, about a quarter less compile
# time for the same time per call (the kernels themselves are built at -O3 either way); and without line tables
# (-g1, for a debugger: no instruction changes), a fifth less compiler time for the wrapper.
_BUILD = {"aot_inductor.compile_wrapper_opt_level": "O0", "aot_inductor.enable_line_tables": False}


def require_compiler(device: torch.device) -> None:
    """engine.compile_host runs on a CPU and needs a C++ compiler: else a one-line error saying so."""
    if device.type != "cpu":
        raise ModelLoadError("engine.compile_host compiles the host work of a CPU run (on a GPU it is queued "
                             "behind the model's kernels); set engine.compile_host=false")
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - any failure means no usable compiler
        raise ModelLoadError(f"engine.compile_host needs a C++ compiler ({type(e).__name__}: {e}); install g++ "
                             f"or set engine.compile_host=false") from None


def _example(a: torch.Tensor, dims: dict[int, str]) -> torch.Tensor:
    """A copy of `a` to trace (tracing leaves the caller's tensors alone), each dynamic dim of size 1 made 2
    (a size of 1 is specialised) and a batch always 2 rows (its first, repeated)."""
    for dim, name in dims.items():
        if name == "batch" or a.shape[dim] < 2:
            size = list(a.shape)
            size[dim] = 2
            a = a.narrow(dim, 0, 1).expand(size)
    return a.clone(memory_format=torch.contiguous_format)


class AotKernels:
    """Kernels of one function, one per key (see the module docstring)."""

    def __init__(self, what: str):
        self.what = what  # for messages
        self._kernels: dict[tuple, Any] = {}  # key -> the package loader (None: compiling it failed)
        self._asked: dict[tuple, int] = {}  # key -> calls so far, until it is compiled
        self.compile_s = 0.0
        self.built = 0  # packages built here (the other kernels came from the process or the disk cache)

    @property
    def compiled(self) -> int:
        """Kernels compiled (or loaded from the process's or the disk's packages) so far."""
        return sum(k is not None for k in self._kernels.values())

    def get(self, key: tuple, make: Callable[[], torch.nn.Module], args: list[torch.Tensor],
            dynamic: list[dict[int, str]]) -> Optional[Any]:
        """The kernel of `key`, compiled at its COMPILE_AFTER-th call from `make()` traced on `args` (dense
        tensors) with dynamic[i] naming the dynamic dims of args[i] ({0: "batch"}: traced at a batch of 2, as a
        batch of 1 is specialised); None before that and when it does not compile."""
        kernel = self._kernels.get(key, False)
        if kernel is False:
            n = self._asked[key] = self._asked.get(key, 0) + 1
            if n < COMPILE_AFTER:
                return None
            kernel = self._kernels[key] = self._compile(key, make, args, dynamic)
        return kernel

    def _compile(self, key: tuple, make: Callable[[], torch.nn.Module], args: list[torch.Tensor],
                 dynamic: list[dict[int, str]]) -> Optional[Any]:
        t0 = time.perf_counter()
        dims = {name: torch.export.Dim(name, min=2 if name in ("length", "slots") else 1)
                for d in dynamic for name in d.values()}
        try:
            with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations inside export
                warnings.simplefilter("ignore", DeprecationWarning)
                examples = [_example(a, d) for a, d in zip(args, dynamic)]
                spec = tuple({i: dims[n] for i, n in d.items()} or None for d in dynamic)
                program = torch.export.export(make(), tuple(examples), dynamic_shapes=(spec,))
                fp = fingerprint(program)
                kernel = _COMPILED.get(fp)
                if kernel is None:
                    kernel = _COMPILED[fp] = self._load_or_build(program, fp)
        except Exception as e:  # noqa: BLE001 - an optimisation: the work runs eagerly instead
            log.warning("engine.compile_host: no %s kernel for %s (%s: %s); it runs eagerly", self.what, key,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            kernel = None
        self.compile_s += time.perf_counter() - t0
        return kernel

    def _load_or_build(self, program: Any, fp: str) -> Any:
        """The loader of `program`'s package: the disk cache's copy, else one built here and published there."""
        if torch._inductor.config.force_disable_caches:
            return _load(self._build(program))
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        from torch.utils._filelock import FileLock

        directory = os.path.join(cache_dir(), "esp-aot")
        os.makedirs(directory, exist_ok=True)
        isa = torch.backends.cpu.get_cpu_capability()  # the vector instructions the kernels were built for
        key = hashlib.sha256(f"{fp} {torch.__version__} {isa} {sorted(_BUILD.items())}".encode()).hexdigest()
        cached = os.path.join(directory, f"{key}.pt2")
        with FileLock(os.path.join(directory, f"{key}.lock"), timeout=_LOCK_TIMEOUT_S):
            if os.path.exists(cached):
                try:
                    return _load(cached)
                except Exception as e:  # noqa: BLE001 - a damaged copy (a full disk, say) is built again
                    log.info("engine.compile_host: the cached %s package did not load (%s); building it", self.what, e)
            built = self._build(program)
            shutil.copyfile(built, f"{cached}.{os.getpid()}")
            os.replace(f"{cached}.{os.getpid()}", cached)  # whole or absent, for a process that does not lock
        return _load(built)

    def _build(self, program: Any) -> str:
        """Build `program`'s package in the process's directory; its path."""
        with torch._inductor.config.patch(_BUILD):
            path = torch._inductor.aoti_compile_and_package(
                program, package_path=f"{_packages()}/{self.what}-{len(_COMPILED)}.pt2")
        self.built += 1
        return path


def _load(path: str) -> Any:
    """The loader of the package at `path` (its `boxed_run` runs the kernel)."""
    with _extracting_into(_packages()):
        return torch._inductor.aoti_load_package(path).loader


def _packages() -> str:
    """The process's directory for compiled packages, made at its first compile: every actor imports this module,
    and a directory made at import would be left behind by each one that is killed."""
    global _PACKAGES
    if _PACKAGES is None:
        _PACKAGES = tempfile.TemporaryDirectory(prefix="esp-aot-")
    return _PACKAGES.name


@contextlib.contextmanager
def _extracting_into(directory: str):
    """TMPDIR set to `directory` while a package loads. The loader unpacks the package's shared library into a
    fresh temporary directory (`std::filesystem::temp_directory_path`, which reads TMPDIR) and never removes it:
    about 2 MB left in /tmp per kernel per process. Under our own directory it goes when the process exits."""
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = directory
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old


def fingerprint(program: Any) -> str:
    """What a compiled package is a function of: the exported graph's code, its inputs' specs (dtypes, shapes
    with their symbols) and the values of the constants and buffers it captured."""
    h = hashlib.sha256()
    h.update(program.graph_module.code.encode())
    h.update(str(program.call_spec).encode())
    for node in program.graph.nodes:
        if node.op == "placeholder":
            h.update(f"{node.name}:{node.meta.get('val')!r}".encode())
    for name, value in sorted({**program.state_dict, **program.constants}.items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return h.hexdigest()
