"""The CuPy backend's FP8 KV-cache kernels (issue 71), checked as far as a machine without a GPU can: the device
conversions compiled as host code by nvcc and compared bit for bit with ``paged_kernels.fp8``; the launches of every
FP8 call recorded (kernel instance, the module that holds it, geometry, arguments); the PTX of the FP8 instances. The
``gpu`` tests run the kernels against the float64 reference where a GPU is lent (scripts/gpu_check.sh)."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

import paged_kernels
from paged_kernels import cupy_backend, fp8, reference
from tests.cuda_build import attention_symbol, compile_ptx, ptx_entries, ptxas_report
from tests.kernel_cases import make_fp8_decode_case, relative_error

FORMATS = ["fp8_e4m3", "fp8_e5m2"]
FP8_TYPES = {"fp8_e4m3": "fp8_e4m3_t", "fp8_e5m2": "fp8_e5m2_t"}


# ---- the device conversions, compiled as host code -------------------------------------------------------------------
HARNESS = r"""
extern "C" void minipaged_encode(const float* x, float scale, long long n, int e5m2, unsigned char* out) {
  for (long long i = 0; i < n; ++i) {
    const float y = x[i] / scale;  // as to_cache divides (IEEE float32 on the host's SSE and on the device)
    out[i] = e5m2 ? fp8_encode<fp8_e5m2_t>(y) : fp8_encode<fp8_e4m3_t>(y);
  }
}
extern "C" void minipaged_pairs(const unsigned int* words, long long n, int e5m2, unsigned int* out) {
  for (long long i = 0; i < n; ++i) fp8_pairs(words[i], out[2 * i], out[2 * i + 1], !e5m2);
}
"""


@pytest.fixture(scope="module")
def host_conversions(tmp_path_factory):
    """``csrc/paged_attention.cu`` (with ``common.cuh``) and a host harness, built by nvcc into a shared library: the
    very functions the kernels call (``fp8_encode``, ``fp8_pairs`` are ``__host__ __device__``)."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on this machine: the device conversions cannot be built as host code")
    folder = tmp_path_factory.mktemp("fp8_host")
    source = folder / "fp8_host.cu"
    source.write_text(f"{cupy_backend.source(cupy_backend.SOURCE_PATH)}\n{HARNESS}")
    library = folder / "libfp8_host.so"
    subprocess.run(["nvcc", "--std=c++17", "-arch=sm_80", "-shared", "-Xcompiler", "-fPIC", "-o", str(library),
                    str(source)], check=True, capture_output=True, text=True, timeout=600)
    lib = ctypes.CDLL(str(library))
    lib.minipaged_encode.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_longlong, ctypes.c_int,
                                     ctypes.c_void_p]
    lib.minipaged_pairs.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
    return lib


def host_encode(lib, x: np.ndarray, scale: float, kv_cache_dtype: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.uint8)
    lib.minipaged_encode(x.ctypes.data, float(np.float32(scale)), x.size, fp8.fp8_format(kv_cache_dtype) == "e5m2",
                         out.ctypes.data)
    return out


def interesting_floats() -> np.ndarray:
    """Every float32 whose low 16 bits are 0, 1, 0x7FFF, 0x8000 or 0xFFFF (all signs, exponents and the top seven
    mantissa bits: zeros, float subnormals, FP8 subnormals, normals, ties, huge values, inf and NaN), every midpoint of
    two neighbouring FP8 values of either format and the floats either side of it, the formats' largest values and
    the midpoints past them, and random floats of every magnitude."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    patterns = [high | low for low in (0, 1, 0x7FFF, 0x8000, 0xFFFF)]
    values = [np.concatenate(patterns).view(np.float32)]
    for kv_cache_dtype in FORMATS:
        table = fp8.decode_table(kv_cache_dtype)
        finite = np.sort(table[np.isfinite(table)])
        middles = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact in float32: one more mantissa bit
        top = np.float32(fp8.max_finite(kv_cache_dtype))
        edges = np.array([top, top * np.float32(1.0625), top * np.float32(1.125), top * np.float32(1.0703125)],
                         dtype=np.float32)
        for v in (middles, edges):
            values += [v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf)), -v]
    rng = np.random.default_rng()
    with np.errstate(over="ignore"):
        values.append((rng.standard_normal(200_000) * 10.0 ** rng.uniform(-45, 38, 200_000)).astype(np.float32))
    return np.concatenate(values).astype(np.float32)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_device_encoder_is_fp8_quantize_bit_for_bit(host_conversions, kv_cache_dtype):
    """``fp8_encode`` (what the write kernels store) against the contract, on about 530,000 floats at scale 1."""
    x = interesting_floats()
    with np.errstate(all="ignore"):
        expected = fp8.quantize(x, 1.0, kv_cache_dtype, "cuda")
    ours = host_encode(host_conversions, x, 1.0, kv_cache_dtype)
    wrong = np.flatnonzero(ours != expected)
    assert wrong.size == 0, [(hex(int(x[i:i + 1].view(np.uint32)[0])), hex(ours[i]), hex(expected[i]))
                             for i in wrong[:10]]
    limit = fp8.max_finite(kv_cache_dtype)
    values = fp8.dequantize(ours[~np.isnan(x)], 1.0, kv_cache_dtype)
    assert np.isfinite(values).all() and np.abs(values).max() == limit  # saturating: never inf, never NaN


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("scale", [0.013, 7.5, 1e-6, 3.0e4, 1.0 / 3.0])
def test_device_encoder_divides_by_the_scale_as_the_contract(host_conversions, kv_cache_dtype, scale):
    """``x / scale`` in float32, then the code: the midpoints times the scale (ties after the division) included."""
    rng = np.random.default_rng()
    table = fp8.decode_table(kv_cache_dtype)
    finite = np.sort(table[np.isfinite(table)])
    middles = ((finite[1:] + finite[:-1]) / 2 * scale).astype(np.float32)
    x = np.concatenate([middles, -middles, (rng.standard_normal(100_000) * 10.0 ** rng.uniform(-12, 12, 100_000))
                        .astype(np.float32), np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], dtype=np.float32)])
    with np.errstate(all="ignore"):
        expected = fp8.quantize(x, scale, kv_cache_dtype, "cuda")
    np.testing.assert_array_equal(host_encode(host_conversions, x, scale, kv_cache_dtype), expected)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_device_decoding_reads_every_code_as_its_value(host_conversions, kv_cache_dtype):
    """``fp8_pairs`` (the integer half of the attention kernel's FP8 unpack) turns each byte of a loaded word into
    the f16 that cvt.f32.f16 reads as value(code) / UNIT, in memory order; e4m3's NaN codes read as +-1.875, the one
    value the kernel replaces with NaN (no finite code reads as it)."""
    e5m2 = fp8.fp8_format(kv_cache_dtype) == "e5m2"
    unit = 1.0 if e5m2 else 256.0
    codes = np.arange(256, dtype=np.uint8)
    rng = np.random.default_rng()
    words_bytes = np.concatenate([np.repeat(codes, 4).reshape(-1, 4), np.roll(np.repeat(codes, 4).reshape(-1, 4), 1),
                                  rng.integers(0, 256, (4096, 4), dtype=np.uint8)]).astype(np.uint8)
    words = np.ascontiguousarray(words_bytes).view("<u4").ravel()
    out = np.empty(2 * words.size, dtype=np.uint32)
    host_conversions.minipaged_pairs(words.ctypes.data, words.size, e5m2, out.ctypes.data)
    even, odd = out[0::2], out[1::2]
    halves = np.stack([even & 0xFFFF, odd & 0xFFFF, even >> 16, odd >> 16], axis=1).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        read = halves.view(np.float16).astype(np.float64) * unit  # dst[0..3] in the kernel's order
    table = fp8.decode_table(kv_cache_dtype)
    expected = table[words_bytes]
    if not e5m2:
        nan_codes = (words_bytes & 0x7F) == 0x7F
        assert (np.abs(read[nan_codes]) == 480.0).all()
        assert not (np.abs(read[~nan_codes]) == 480.0).any()
        read[nan_codes] = np.nan
    np.testing.assert_array_equal(read, expected)


# ---- launches recorded without a GPU ---------------------------------------------------------------------------------
class _Module:
    """Stands in for a CuPy RawModule: knows the name expressions it would compile; ``get_function`` of any other
    name fails, as it would on a GPU."""

    def __init__(self, names):
        self.names = list(names)

    def get_function(self, name):
        assert name in self.names, (name, self.names)
        return name


@pytest.fixture
def launches(monkeypatch):
    """Like tests/test_cupy_launcher.py's: CPU tensors count as CUDA and launches are recorded, but kernels come
    through the real ``_kernel`` from stand-in modules, so a kernel asked of a module that does not hold it fails."""
    recorded = []

    def record(kernel, grid, block, args, device, shared_mem=0):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                rows = kernel.startswith("qk_norm_rope_write") and arg.dim() == 3 and arg.stride(2) == 1
                assert arg.is_contiguous() or rows, f"{kernel} would get a strided tensor"
        recorded.append(dict(kernel=kernel, grid=tuple(grid), block=tuple(block), args=tuple(args),
                             shared_mem=shared_mem))

    monkeypatch.setattr(cupy_backend, "_launch", record)
    monkeypatch.setattr(cupy_backend, "_module", lambda *key: _Module(cupy_backend.kernel_names(*key)))
    monkeypatch.setattr(cupy_backend, "_fused_module", lambda *key: _Module(cupy_backend.fused_kernel_names(*key)))
    monkeypatch.setattr(cupy_backend, "_sm_count", lambda device: 132)
    monkeypatch.setattr(cupy_backend, "is_cuda", lambda tensor: True)
    monkeypatch.setattr(paged_kernels, "cupy_status", lambda: (True, "ok"))
    cupy_backend._kernel.cache_clear()
    yield recorded
    cupy_backend._kernel.cache_clear()  # no stand-in kernel outlives the test


def fp8_decode_inputs(num_seqs=3, num_kv_heads=2, group=2, head_dim=128, block_size=16, seq_len=40,
                      dtype=torch.bfloat16):
    blocks = -(-seq_len // block_size)
    cache = torch.zeros(num_seqs * blocks + 1, num_kv_heads, block_size, head_dim, dtype=torch.uint8)
    tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    query = torch.randn(num_seqs, num_kv_heads * group, head_dim).to(dtype)
    return query, cache, cache.clone(), tables, seq_lens


@pytest.mark.parametrize("kv_cache_dtype, cuda_type", [("fp8", "fp8_e4m3_t"), ("fp8_e4m3", "fp8_e4m3_t"),
                                                       ("fp8_e5m2", "fp8_e5m2_t")])
def test_fp8_decode_launches_the_fp8_instance_with_the_scales(launches, kv_cache_dtype, cuda_type):
    query, kc, vc, tables, lens = fp8_decode_inputs(num_seqs=5, num_kv_heads=8, group=2, head_dim=128)
    out = paged_kernels.paged_attention_decode(query, kc, vc, tables, lens, backend="auto",
                                               kv_cache_dtype=kv_cache_dtype, k_scale=0.1, v_scale=3.0)
    (launch,) = launches
    assert launch["kernel"] == f"paged_attention_kernel<bf16_t,128,2,4,{cuda_type}>"
    assert launch["grid"] == (8, 5, 1) and launch["block"] == (128,)
    assert launch["shared_mem"] == cupy_backend.attention_shared_bytes(128, 2)  # the same as 16-bit caches'
    args = launch["args"]
    assert args[5] is kc and args[6] is vc and kc.dtype == torch.uint8 and args[4].dtype == torch.bfloat16
    assert [type(a) for a in args[9:]] == [np.float32] + [np.int32] * 6 + [np.float32] * 2
    assert args[16] == np.float32(0.1) and args[17] == np.float32(3.0)
    assert args[9] == np.float32(128 ** -0.5)  # the softmax scale alone: the kernel folds k_scale in itself
    assert out.dtype == torch.bfloat16 and out.shape == query.shape


def test_fp8_split_k_shares_the_reduction(launches):
    query, kc, vc, tables, lens = fp8_decode_inputs(num_seqs=2, head_dim=64, block_size=7, seq_len=1300,
                                                    dtype=torch.float16)
    cupy_backend.paged_attention_decode(query, kc, vc, tables, lens, 0.125, partition_size=512,
                                        kv_cache_dtype="fp8_e5m2", k_scale=2.0, v_scale=0.5)
    attention, reduce = (launch["kernel"] for launch in launches)
    assert attention == "paged_attention_kernel<half_t,64,2,4,fp8_e5m2_t>"
    assert reduce == "reduce_partitions_kernel<half_t,64>"  # partitions are float32 whatever the caches hold
    assert launches[0]["grid"] == (2, 2, 3) and launches[1]["grid"] == (4, 2)


@pytest.mark.parametrize("dtype, cuda_type", [(torch.bfloat16, "bf16_t"), (torch.float16, "half_t"),
                                              (torch.float32, "float")])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_fp8_write_launches_with_the_scales(launches, dtype, cuda_type, kv_cache_dtype):
    cache = torch.zeros(6, 2, 3, 8, dtype=torch.uint8)
    key = torch.randn(4, 2, 8).to(dtype)
    paged_kernels.write_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, -1, 5, 7]), backend="auto",
                                 kv_cache_dtype=kv_cache_dtype, k_scale=0.02, v_scale=7.0)
    (write,) = launches
    assert write["kernel"] == f"write_kv_cache_kernel<{cuda_type},{FP8_TYPES[kv_cache_dtype]}>"
    assert write["grid"] == (4,) and write["block"] == (32,) and write["args"][2].dtype == torch.uint8
    assert write["args"][4].dtype == torch.int64
    assert [type(a) for a in write["args"][5:]] == [np.int32] * 3 + [np.float32] * 2
    assert write["args"][8:] == (np.float32(0.02), np.float32(7.0))


def test_fp8_write_takes_one_dtype_for_k_and_v(launches):
    cache = torch.zeros(6, 2, 3, 8, dtype=torch.uint8)
    with pytest.raises(paged_kernels.KernelArgumentError, match="dtype"):
        cupy_backend.write_kv_cache(torch.randn(2, 2, 8).to(torch.bfloat16), torch.randn(2, 2, 8), cache,
                                    cache.clone(), torch.tensor([0, 1]), "fp8_e4m3", 1.0, 1.0)
    assert launches == []


def test_auto_caches_keep_their_instances_and_pass_unit_scales(launches):
    cache = torch.zeros(6, 2, 3, 8, dtype=torch.bfloat16)
    key = torch.randn(4, 2, 8).to(torch.bfloat16)
    paged_kernels.write_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, -1, 5, 7]), backend="cupy")
    assert launches[0]["kernel"] == "write_kv_cache_kernel<bf16_t>" and launches[0]["args"][8:] == (1.0, 1.0)


def test_fp8_blocks_copy_as_bytes(launches):
    cache = torch.randint(0, 255, (6, 2, 3, 8), dtype=torch.uint8)
    paged_kernels.copy_blocks(cache, cache.clone(), [(0, 4), (4, 5)], backend="auto")
    assert [launch["kernel"] for launch in launches] == ["copy_blocks_kernel<unsigned char>"] * 2
    assert int(launches[0]["args"][3]) == 2 * 3 * 8 and launches[0]["grid"] == (1,)


def test_fp8_swaps_move_whole_blocks_of_bytes(launches, monkeypatch):
    import types

    import cupy

    copies = []
    monkeypatch.setattr(cupy.cuda.runtime, "memcpyAsync", lambda dst, src, size, kind, stream:
                        copies.append((dst, src, size, stream)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=77))
    device = [torch.randint(0, 255, (5, 2, 4, 8), dtype=torch.uint8) for _ in range(2)]
    host = [torch.zeros(3, 2, 4, 8, dtype=torch.uint8) for _ in range(2)]
    cupy_backend.swap_blocks(*device, *host, np.array([[1, 2], [4, 0]]))
    block = 2 * 4 * 8
    assert copies == [(host[0].data_ptr() + 2 * block, device[0].data_ptr() + block, block, 77),
                      (host[0].data_ptr(), device[0].data_ptr() + 4 * block, block, 77),
                      (host[1].data_ptr() + 2 * block, device[1].data_ptr() + block, block, 77),
                      (host[1].data_ptr(), device[1].data_ptr() + 4 * block, block, 77)]


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_fused_write_launches_the_fp8_instance(launches, kv_cache_dtype):
    tokens, q_heads, kv_heads, head_dim = 3, 4, 2, 64
    q, k, v = (torch.randn(tokens, h, head_dim).to(torch.bfloat16) for h in (q_heads, kv_heads, kv_heads))
    weight = torch.ones(head_dim, dtype=torch.bfloat16)
    cos_sin = torch.ones(16, 2 * head_dim, dtype=torch.bfloat16)
    caches = [torch.zeros(4, kv_heads, 4, head_dim, dtype=torch.uint8) for _ in range(2)]
    paged_kernels.qk_norm_rope_write(q, k, v, weight, weight, cos_sin, torch.arange(3), *caches,
                                     torch.tensor([0, 5, -1]), backend="auto", kv_cache_dtype=kv_cache_dtype,
                                     k_scale=0.5, v_scale=0.25)
    (launch,) = launches
    assert launch["kernel"] == f"qk_norm_rope_write_kernel<bf16_t,{FP8_TYPES[kv_cache_dtype]}>"
    assert launch["grid"] == (3, q_heads + kv_heads) and launch["block"] == (32,)
    assert launch["args"][9] is caches[0] and launch["args"][-2:] == (np.float32(0.5), np.float32(0.25))


def test_fp8_names_and_caches_must_agree(launches):
    query, kc, vc, tables, lens = fp8_decode_inputs()
    with pytest.raises(paged_kernels.KernelArgumentError, match="floating-point"):
        cupy_backend.paged_attention_decode(query, kc, vc, tables, lens, 0.1)  # uint8 caches named auto
    with pytest.raises(paged_kernels.KernelArgumentError, match="uint8"):
        cupy_backend.paged_attention_decode(query, kc.to(torch.bfloat16), vc.to(torch.bfloat16), tables, lens, 0.1,
                                            kv_cache_dtype="fp8")
    with pytest.raises(paged_kernels.KernelArgumentError, match="k_scale"):
        cupy_backend.paged_attention_decode(query, kc, vc, tables, lens, 0.1, kv_cache_dtype="fp8", k_scale=0.0)
    assert launches == []


def test_fp8_attention_keeps_the_other_limits(launches):
    """head_dim and GQA group as the 16-bit instances; auto goes to torch outside them."""
    probe, caches = torch.empty(0, dtype=torch.bfloat16), (torch.empty(0, dtype=torch.uint8),)
    assert paged_kernels.resolve_backend("auto", probe, 128, 8, caches) == "cupy"
    assert paged_kernels.resolve_backend("auto", probe, 96, 1, caches) == "torch"
    assert paged_kernels.resolve_backend("auto", probe, 128, 16, caches) == "torch"
    assert paged_kernels.resolve_backend("auto", caches[0]) == "cupy"  # a write's or a copy's cache


def test_every_fp8_kernel_name_is_compiled_by_some_module():
    """What the dispatcher can ask for (all_kernel_names) is what the modules' name expressions hold."""
    names = set(cupy_backend.all_kernel_names())
    fp8_names = {n for n in names if "fp8" in n or "unsigned char" in n}
    assert len(fp8_names) == 3 * 2 * (1 + 3 * 8 + 1) + 1
    for dtype in cupy_backend.CUDA_TYPES:
        for kv_cache_dtype in ("fp8", *FORMATS):
            for head_dim in cupy_backend.SUPPORTED_HEAD_DIMS:
                assert set(cupy_backend.kernel_names(dtype, head_dim, 8, kv_cache_dtype)) <= names
            assert set(cupy_backend.fused_kernel_names(dtype, kv_cache_dtype)) <= names


# ---- the compiled FP8 instances (nvcc / ptxas, no GPU) ---------------------------------------------------------------
def fp8_attention_body(entries, cuda_type, head_dim, group, kv_cache_dtype):
    prefix = attention_symbol(cuda_type, head_dim, group, cupy_backend.NUM_WARPS, FP8_TYPES[kv_cache_dtype])
    (body,) = [body for name, body in entries.items() if name.startswith(prefix)]
    return body


@pytest.mark.parametrize("arch", ["90", "80"])
def test_fp8_instances_compile_for_each_arch(arch):
    entries = ptx_entries(compile_ptx(arch))
    assert len(entries) == len(cupy_backend.all_kernel_names())
    assert sum("fp8_e" in name for name in entries) == 3 * 2 * (1 + 3 * 8 + 1)


@pytest.mark.parametrize("cuda_type", ["bf16_t", "half_t", "float"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_fp8_attention_reads_kv_with_64_bit_loads(cuda_type, head_dim, kv_cache_dtype):
    """8 FP8 codes a load (8-byte chunks: 8 elements a lane, like the 16-bit caches' 16-byte chunks); no byte loads
    of K/V in the loop."""
    body = fp8_attention_body(ptx_entries(compile_ptx("90")), cuda_type, head_dim, 2, kv_cache_dtype)
    assert body.count("ld.global.nc.v2.u32") >= 2  # K and V
    loop = body.split("ld.global.nc.v2.u32", 1)[1]
    assert "ld.global.nc.u8" not in loop and "ld.global.u8" not in loop
    assert "cvt.f32.f16" in body


@pytest.mark.parametrize("arch", ["90", "80"])
def test_fp8_writes_divide_exactly(arch):
    """The scale divides in IEEE float32 (div.rn.f32), as fp8.quantize(..., "cuda") does: no approximate
    division."""
    entries = ptx_entries(compile_ptx(arch))
    writers = {name: body for name, body in entries.items()
               if name.startswith(("_Z21write_kv_cache_kernel", "_Z25qk_norm_rope_write_kernel")) and "fp8_e" in name}
    assert len(writers) == 2 * 3 * 2
    for name, body in writers.items():
        assert "div.rn.f32" in body and "div.approx" not in body and "div.full" not in body, name


@pytest.mark.parametrize("arch", ["90", "80"])
def test_fp8_instances_do_not_spill(arch):
    report = ptxas_report(arch)
    fp8_entries = {name: r for name, r in report.items()
                   if "fp8_e" in name or name.startswith("_Z18copy_blocks_kernelIh")}
    assert len(fp8_entries) == 3 * 2 * (1 + 3 * 8 + 1) + 1
    assert not {name: r for name, r in fp8_entries.items() if r["spill_stores"] or r["spill_loads"]}


@pytest.mark.parametrize("arch", ["90", "80"])
def test_qwen3_06b_fp8_configuration_fits_128_registers(arch):
    report = ptxas_report(arch)
    for kv_cache_dtype in FORMATS:
        prefix = attention_symbol("bf16_t", 128, 2, cupy_backend.NUM_WARPS, FP8_TYPES[kv_cache_dtype])
        (registers,) = [r["registers"] for name, r in report.items() if name.startswith(prefix)]
        assert registers <= 128, (kv_cache_dtype, registers)


# ---- on a GPU --------------------------------------------------------------------------------------------------------
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _dequantized_reference(case, kv_cache_dtype, k_scale, v_scale, head_dim):
    return reference.paged_attention_decode(
        case.query.double().cpu().numpy(),
        reference.dequantized(case.key_cache.cpu().numpy(), kv_cache_dtype, k_scale),
        reference.dequantized(case.value_cache.cpu().numpy(), kv_cache_dtype, v_scale),
        case.block_tables.cpu().numpy(), case.seq_lens.cpu().numpy(), head_dim ** -0.5)


def _on_cuda(case):
    for name in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"):
        setattr(case, name, getattr(case, name).cuda())
    return case


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("head_dim, num_kv_heads, group", [(64, 2, 4), (128, 1, 8), (128, 8, 2)])
@pytest.mark.parametrize("partition_size", [0, 512])
def test_fp8_decode_matches_the_dequantized_reference_cuda(kv_cache_dtype, dtype, block_size, head_dim, num_kv_heads,
                                                           group, partition_size):
    """The CuPy kernel reading FP8 codes against float64 attention over the dequantized K/V (codes x scale), v1 and
    v2; unused slots hold NaN codes, the output starts as NaN, sequence 0 is empty."""
    k_scale, v_scale = np.random.default_rng().uniform(0.01, 2.0, 2)
    case = _on_cuda(make_fp8_decode_case([0, 1, block_size, 2 * block_size + 1, 45, 700], block_size, num_kv_heads,
                                         group, head_dim, kv_cache_dtype, k_scale, v_scale, dtype=dtype, spread=3.0))
    expected = _dequantized_reference(case, kv_cache_dtype, k_scale, v_scale, head_dim)
    out = torch.full_like(case.query, float("nan"))
    cupy_backend.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                        case.seq_lens, head_dim ** -0.5, partition_size=partition_size, out=out,
                                        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert (out[0] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_fp8_decode_through_the_public_api_picks_cupy_cuda(kv_cache_dtype):
    case = _on_cuda(make_fp8_decode_case([5, 40], 16, 2, 2, 128, kv_cache_dtype, 0.5, 0.25, dtype=torch.bfloat16))
    assert paged_kernels.resolve_backend("auto", case.query, 128, 2, (case.key_cache, case.value_cache)) == "cupy"
    out = paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                               case.seq_lens, kv_cache_dtype=kv_cache_dtype, k_scale=0.5,
                                               v_scale=0.25)
    expected = _dequantized_reference(case, kv_cache_dtype, 0.5, 0.25, 128)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.013, 1e-6])
def test_fp8_write_stores_the_contract_s_codes_cuda(kv_cache_dtype, dtype, scale):
    """The write kernel stores ``fp8.quantize(K, k_scale, dtype, "cuda")`` bit for bit (saturating at 1e-6, NaN keys
    included) and leaves padding slots' bytes alone."""
    rng = np.random.default_rng()
    num_blocks, block_size, heads, head_dim = 9, 3, 2, 64
    key = torch.from_numpy((rng.standard_normal((20, heads, head_dim)) * 10.0 ** rng.uniform(-3, 3, (20, heads, 1)))
                           .astype(np.float32)).to(dtype)
    key[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
    value = (torch.randn(20, heads, head_dim) * 500).to(dtype)
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:20])
    slots[1::4] = -1
    caches = [torch.full((num_blocks, heads, block_size, head_dim), 0xAB, dtype=torch.uint8, device="cuda")
              for _ in range(2)]
    paged_kernels.write_kv_cache(key.cuda(), value.cuda(), *caches, slots.cuda(), backend="cupy",
                                 kv_cache_dtype=kv_cache_dtype, k_scale=scale, v_scale=scale * 2)
    expected = [torch.full(caches[0].shape, 0xAB, dtype=torch.uint8) for _ in range(2)]
    for cache, x, cache_scale in ((expected[0], key, scale), (expected[1], value, scale * 2)):
        for token, slot in enumerate(slots.tolist()):
            if slot >= 0:
                codes = fp8.quantize(x[token].float().numpy(), cache_scale, kv_cache_dtype, "cuda")
                cache[slot // block_size, :, slot % block_size] = torch.from_numpy(codes)
    assert torch.equal(caches[0].cpu(), expected[0]) and torch.equal(caches[1].cpu(), expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_fp8_saturating_scales_clamp_never_nan_cuda(kv_cache_dtype):
    """A scale far too small: every element stored as +-max, attention finite."""
    limit = fp8.max_finite(kv_cache_dtype)
    key = ((torch.rand(40, 2, 128) + 1.0) * torch.where(torch.rand(40, 2, 128) < 0.5, -1.0, 1.0)).cuda()
    key = key.to(torch.bfloat16)
    caches = [torch.zeros(3, 2, 16, 128, dtype=torch.uint8, device="cuda") for _ in range(2)]
    paged_kernels.write_kv_cache(key, key, *caches, torch.arange(40, device="cuda"), backend="cupy",
                                 kv_cache_dtype=kv_cache_dtype, k_scale=1e-6, v_scale=1e-6)
    values = fp8.dequantize(caches[0].cpu().numpy()[:2], 1.0, kv_cache_dtype)
    assert (np.abs(values) == limit).all()
    out = paged_kernels.paged_attention_decode(torch.randn(1, 4, 128, device="cuda").to(torch.bfloat16), *caches,
                                               torch.tensor([[0, 1, 2]], dtype=torch.int32, device="cuda"),
                                               torch.tensor([40], dtype=torch.int32, device="cuda"), backend="cupy",
                                               kv_cache_dtype=kv_cache_dtype, k_scale=1e-6, v_scale=1e-6)
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_fused_write_stores_the_torch_op_s_codes_cuda(kv_cache_dtype, dtype):
    """The fused q/k norm + rotary + cache write with FP8 caches: the torch op's q, k and codes (which are the NumPy
    contract's), padding skipped."""
    tokens, q_heads, kv_heads, head_dim, block_size, blocks = 9, 4, 2, 128, 4, 5
    q = torch.randn(tokens, q_heads, head_dim).to(dtype).cuda()
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype).cuda()
    v = (torch.randn(tokens, kv_heads, head_dim) * 300).to(dtype).cuda()
    weights = (torch.rand(head_dim) + 0.5).to(dtype).cuda(), (torch.rand(head_dim) + 0.5).to(dtype).cuda()
    angles = torch.arange(32)[:, None] * torch.rand(head_dim // 2)[None]
    cos_sin = torch.cat([angles.cos(), angles.cos(), angles.sin(), angles.sin()], dim=-1).to(dtype).cuda()
    positions = torch.randint(0, 32, (tokens,)).cuda()
    slots = torch.randperm(blocks * block_size)[:tokens].cuda()
    slots[3] = -1
    results = []
    for backend in ("cupy", "torch"):
        caches = [torch.full((blocks, kv_heads, block_size, head_dim), 0xAB, dtype=torch.uint8, device="cuda")
                  for _ in range(2)]
        q_out, k_out = paged_kernels.qk_norm_rope_write(q, k, v, *weights, cos_sin, positions, *caches, slots,
                                                        backend=backend, kv_cache_dtype=kv_cache_dtype,
                                                        k_scale=0.03, v_scale=0.5)
        results.append((q_out, k_out, caches))
    (q_cupy, k_cupy, cupy_caches), (q_torch, k_torch, torch_caches) = results
    tolerance = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q_cupy, q_torch, **tolerance)
    torch.testing.assert_close(k_cupy, k_torch, **tolerance)
    assert torch.equal(cupy_caches[1], torch_caches[1])  # v: no arithmetic before the code
    # k: the codes of the kernel's own rotated keys (fp8.quantize of k_cupy), wherever the slot is not padding
    for token, slot in enumerate(slots.tolist()):
        stored = cupy_caches[0][slot // block_size, :, slot % block_size].cpu().numpy()
        if slot >= 0:
            np.testing.assert_array_equal(stored, fp8.quantize(k_cupy[token].float().cpu().numpy(), 0.03,
                                                               kv_cache_dtype, "cuda"))


@pytest.mark.gpu
def test_fp8_copy_and_swap_carry_bytes_cuda():
    device = [torch.randint(0, 255, (5, 2, 4, 8), dtype=torch.uint8, device="cuda") for _ in range(2)]
    before = [c.clone() for c in device]
    paged_kernels.copy_blocks(*device, [(0, 4), (4, 3)], backend="cupy")
    assert torch.equal(device[0][4], before[0][0]) and torch.equal(device[1][3], before[1][0])
    host = [torch.zeros(3, 2, 4, 8, dtype=torch.uint8).pin_memory() for _ in range(2)]
    paged_kernels.swap_blocks(*device, *host, [(1, 2)], backend="cupy")
    torch.cuda.synchronize()
    assert torch.equal(host[0][2], device[0][1].cpu()) and torch.equal(host[1][2], device[1][1].cpu())


@pytest.mark.gpu
def test_fp8_decode_time_against_bf16_cuda():
    """The CuPy decode kernel over bf16 caches and FP8 caches at Qwen3-0.6B's attention shape (16 q heads, 8 kv
    heads, head_dim 128), 64 sequences of 512 and of 4,096 tokens: the table goes to the log (pytest -s in
    scripts/gpu_check.sh). FP8 reads half the bytes; its dequantization must not cost more than that saves at long
    context by a wide margin, and its errors are FP8's."""
    from lab.bench.kernels import KernelBenchConfig, run_precision_bench

    config = KernelBenchConfig(device="cuda", dtype=torch.bfloat16, shapes=((64, 512), (64, 4096)), repeats=5)
    table = run_precision_bench(config, backend="cupy")
    print("\nFP8 vs bf16 decode, CuPy kernels\n" + table.to_string(index=False))
    assert (table["kernel_rel_err"] < TOLERANCE[torch.bfloat16]).all(), table
    long = table[(table["context"] == 4096) & (table["kv_cache_dtype"] != "auto")]
    assert (long["vs_auto"] < 1.5).all(), table
