"""Offline builds of the CUDA source with the machine's nvcc and ptxas (no GPU needed); tests skip without them."""
import fcntl
import functools
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

CUDA_TYPE_MANGLING = {"float": "f", "half_t": "6half_t", "bf16_t": "6bf16_t", "fp8_e4m3_t": "10fp8_e4m3_t",
                      "fp8_e5m2_t": "10fp8_e5m2_t"}


SUITE_ARCHS = ("90", "80")  # the suite checks both: the first request builds them side by side (nvcc is one core)
_builds: dict[str, Future] = {}
_pool = ThreadPoolExecutor(len(SUITE_ARCHS))


CACHE = Path(tempfile.gettempdir()) / "minipaged-cuda-build"  # shared by the suite's worker processes


def _shared(kind: str, key: str, make):
    """``make()``'s JSON-able result, made once across processes: the suite's two workers may both ask for the same
    build, and the second waits for the first's (an exclusive lock per key) instead of building it again. The key
    hashes everything the result depends on (the sources as compiled, the arch, the tool's version)."""
    CACHE.mkdir(exist_ok=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    path, lock = CACHE / f"{kind}-{name}.json", CACHE / f"{kind}-{name}.lock"
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        result = make()
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(result))
        temporary.replace(path)
        return result


@functools.lru_cache(maxsize=None)
def _tool_version(tool: str) -> str:
    return subprocess.run([tool, "--version"], capture_output=True, text=True).stdout


def _nvcc_ptx(arch: str) -> str:
    from cupy.cuda import compiler

    from paged_kernels.cupy_backend import instantiation_source

    source = instantiation_source()

    def make() -> str:
        ptx = compiler.compile_using_nvcc(source, arch=arch, code_type="ptx")
        return ptx.decode() if isinstance(ptx, bytes) else ptx
    return _shared("ptx", f"{arch}\n{_tool_version('nvcc')}\n{source}", make)


def _build(arch: str) -> Future:
    if arch not in _builds:
        _builds[arch] = _pool.submit(_nvcc_ptx, arch)
    return _builds[arch]


def _compile_ptx(arch: str) -> str:
    return _build(arch).result()


def compile_ptx(arch: str) -> str:
    """PTX of every template instance for ``sm_<arch>``."""
    pytest.importorskip("cupy.cuda.compiler", reason="cupy is not installed")
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on this machine: the CUDA sources cannot be compile-checked")
    for other in SUITE_ARCHS:
        _build(other)
    return _compile_ptx(arch)


def ptx_entries(ptx: str) -> dict[str, str]:
    """Mangled entry name -> its PTX body."""
    pieces = re.split(r"\.visible \.entry (\w+)\(", ptx)
    return dict(zip(pieces[1::2], pieces[2::2]))


@functools.lru_cache(maxsize=None)
def _ptxas_report(arch: str) -> dict[str, dict[str, int]]:
    ptx = _compile_ptx(arch)
    return _shared("ptxas", f"{arch}\n{_tool_version('ptxas')}\n{ptx}", lambda: _run_ptxas(arch, ptx))


def _run_ptxas(arch: str, ptx: str) -> dict[str, dict[str, int]]:
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernels.ptx"
        source.write_text(ptx)
        result = subprocess.run(["ptxas", "-v", "--split-compile", "0", f"-arch=sm_{arch}", "-o",
                                 str(Path(folder) / "k.cubin"), str(source)], capture_output=True, text=True,
                                check=True)  # --split-compile 0: every core (the report is the same)
    report = {}
    for block in re.split(r"Compiling entry function", result.stderr)[1:]:
        name = re.search(r"'(\w+)'", block).group(1)
        report[name] = {"registers": int(re.search(r"Used (\d+) registers", block).group(1)),
                        "spill_stores": int(re.search(r"(\d+) bytes spill stores", block).group(1)),
                        "spill_loads": int(re.search(r"(\d+) bytes spill loads", block).group(1))}
    return report


def ptxas_report(arch: str) -> dict[str, dict[str, int]]:
    """Per entry: registers and spill bytes, as ``ptxas -v`` reports them."""
    compile_ptx(arch)
    if shutil.which("ptxas") is None:
        pytest.skip("no ptxas on this machine")
    return _ptxas_report(arch)


def attention_symbol(cuda_type: str, head_dim: int, group: int, num_warps: int, cache_type: str | None = None) -> str:
    """The mangled-name prefix of ``paged_attention_kernel<cuda_type, head_dim, group, num_warps, cache_type>``
    (``cache_type`` None: the default, ``cuda_type`` itself; a struct type repeated is the substitution ``S0_``)."""
    if cache_type is None or cache_type == cuda_type:
        cache = "f" if cuda_type == "float" else "S0_"
    else:
        cache = CUDA_TYPE_MANGLING[cache_type]
    return (f"_Z22paged_attention_kernelI{CUDA_TYPE_MANGLING[cuda_type]}Li{head_dim}ELi{group}ELi{num_warps}E"
            f"{cache}E")
