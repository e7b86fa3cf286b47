"""FP8 KV caches (issue 71): the NumPy contract (``paged_kernels.fp8``), every CPU backend against the float64
dequantized reference, saturation, and the copies that carry FP8 blocks as they are."""
import numpy as np
import pytest
import torch

import paged_kernels
from paged_kernels import fp8, reference
from paged_kernels.validate import KernelArgumentError
from paged_kernels.torch_backend import dequantize, paged_attention_prefill, quantize
from tests.kernel_cases import make_fp8_decode_case, relative_error

FORMATS = ["fp8_e4m3", "fp8_e5m2"]
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# FP8's own tolerance: half a unit in the last place relative to a value (3 mantissa bits: 2^-4; 2 bits: 2^-3)
FP8_ULP = {"fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}


def in_place_built() -> bool:
    from paged_kernels import cpu_extension

    return cpu_extension.status() is None


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_decode_table_is_torchs_float8(kv_cache_dtype):
    """Our bit-level decoding of all 256 codes equals torch's float8 dtypes (NaN where torch has NaN)."""
    torchs = torch.arange(256, dtype=torch.uint8).view(TORCH_FP8[kv_cache_dtype]).double().numpy()
    np.testing.assert_array_equal(fp8.decode_table(kv_cache_dtype), torchs)
    assert fp8.max_finite(kv_cache_dtype) == torch.finfo(TORCH_FP8[kv_cache_dtype]).max
    assert fp8.decode_table("fp8") is fp8.decode_table("fp8") and fp8.fp8_format("fp8") == "e4m3"


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.013, 7.5])
def test_numpy_and_torch_quantize_agree_and_saturate(kv_cache_dtype, scale):
    """The torch quantizer writes the NumPy contract's codes bit for bit, fresh random values across the whole range,
    those past the format saturating to +-max (never NaN, never inf)."""
    rng = np.random.default_rng()
    limit = fp8.max_finite(kv_cache_dtype)
    # float32 values, as the cache's writers take them (a float64 x made the bound below a float64 product)
    x = (rng.standard_normal(50_000) * 10.0 ** rng.uniform(-6, 6, 50_000)).astype(np.float32)
    x[:4] = [limit * scale * 1000, -limit * scale * 1000, 0.0, limit * scale]
    ours = fp8.quantize(x, scale, kv_cache_dtype)
    np.testing.assert_array_equal(quantize(torch.from_numpy(x), scale, kv_cache_dtype).numpy(), ours)
    values = fp8.dequantize(ours, 1.0, kv_cache_dtype)
    assert np.isfinite(values).all() and values[0] == limit and values[1] == -limit
    # rounding toward zero (vLLM's CPU write): never above the value of x * (1 / scale) (float32), less than one step
    # below it in the normal range, its sign kept
    y = (x * fp8.inverse_scale(scale)).astype(np.float64)
    finite = np.abs(y) < limit
    assert (np.abs(values[finite]) <= np.abs(y[finite])).all()
    assert (values[finite] * y[finite] >= 0).all()
    normal = finite & (np.abs(y) > 2.0 ** -5)
    assert (np.abs(y[normal]) - np.abs(values[normal]) < 2 * FP8_ULP[kv_cache_dtype] * np.abs(y[normal])).all()


def test_the_write_s_product_is_float32_even_where_float64_s_falls_just_below_a_code():
    """Found by the randomized test above (seed 207 of its family): 0.00121875 × float32(1 / 0.013) is 0.09374999…
    in float64 but exactly 0.09375, an e4m3 code, in float32, where the write multiplies (vLLM's CPU write). The code
    is 0.09375 in both writers, not the one below it."""
    x = np.array([0.0012187500039020861], dtype=np.float32)
    assert float(x[0] * fp8.inverse_scale(0.013)) == 0.09375 and float(x[0]) * float(fp8.inverse_scale(0.013)) < 0.09375
    ours = fp8.quantize(x, 0.013, "fp8_e4m3")
    assert fp8.dequantize(ours, 1.0, "fp8_e4m3")[0] == 0.09375
    np.testing.assert_array_equal(quantize(torch.from_numpy(x), 0.013, "fp8_e4m3").numpy(), ours)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.013, 7.5])
def test_the_cuda_write_divides_and_rounds_to_nearest_even(kv_cache_dtype, scale):
    """On a GPU vLLM writes ``x / scale`` rounded to nearest even and saturated (``__NV_SATFINITE``): the contract's
    ``device_type="cuda"`` codes are torch's own conversion of the clamped float32 quotient, bit for bit, fresh values
    across the whole range, and never further than half a step from the value."""
    rng = np.random.default_rng()
    limit = fp8.max_finite(kv_cache_dtype)
    # float32 values (a float64 array made torch divide and round in float64 where the write rounds x to float32
    # first: once in 300 seeds a quotient fell on the other side of a tie)
    x = (rng.standard_normal(50_000) * 10.0 ** rng.uniform(-6, 6, 50_000)).astype(np.float32)
    x[:3] = [limit * scale * 1000, -limit * scale * 1000, -0.0]
    y = torch.from_numpy(x / np.float32(scale))  # float32, correctly rounded, as CUDA's x / scale
    expected = y.clamp(-limit, limit).to(TORCH_FP8[kv_cache_dtype]).view(torch.uint8).numpy()
    codes = fp8.quantize(x, scale, kv_cache_dtype, "cuda")
    np.testing.assert_array_equal(codes, expected)
    values, exact = fp8.dequantize(codes, 1.0, kv_cache_dtype), y.double().numpy()
    assert values[0] == limit and values[1] == -limit and codes[2] == 0x80
    normal = np.abs(exact) < limit
    assert (np.abs(values[normal] - exact[normal]) <= np.abs(exact[normal]) * FP8_ULP[kv_cache_dtype] + 2.0 ** -10).all()
    with pytest.raises(KernelArgumentError, match="device_type"):
        fp8.quantize(x, scale, kv_cache_dtype, "tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_the_torch_write_on_a_gpu_writes_the_cuda_contract(kv_cache_dtype):
    """torch on a CUDA tensor quantizes as vLLM's CUDA build does (``fp8.quantize(..., "cuda")``)."""
    x = np.random.default_rng().standard_normal(20_000).astype(np.float32) * 100
    np.testing.assert_array_equal(quantize(torch.from_numpy(x).cuda(), 0.37, kv_cache_dtype).cpu().numpy(),
                                  fp8.quantize(x, 0.37, kv_cache_dtype, "cuda"))


# Values and the codes vLLM 0.32.0's CPU build writes for them (``torch.ops._C.cpu_attn_reshape_and_cache``, isa
# "vec", float32 K/V, the installed peer's binary): rounding toward zero after the multiply by float32(1 / scale),
# saturation, a zero of either sign to 0x00, a negative value under the smallest subnormal to 0x80.
VLLM_CPU_VALUES = [1.0, 1.1, 1.12, 1.124, 1.125, 1.187, 1.1875, 1.24, -1.24, 0.3, -0.3, 17.9, 447.9, 500.0, -1000000.0,
                   0.0, -0.0, 0.0015, -0.0015, 0.0029, -1e-09, 3e-05, 6.1e-05, 0.0153, 0.0155, 240.0, 250.0, 60000.0,
                   -57345.0, 0.7]
VLLM_CPU_CODES = [
    ("fp8_e4m3", 1.0, [56, 56, 56, 56, 57, 57, 57, 57, 185, 41, 169, 88, 125, 126, 254, 0, 0, 0, 128, 1, 128, 0, 0, 7,
                       7, 119, 119, 126, 254, 51]),
    ("fp8_e4m3", 0.37, [66, 67, 68, 68, 68, 68, 68, 69, 197, 52, 180, 100, 126, 126, 254, 0, 0, 2, 130, 4, 128, 0, 0,
                        18, 18, 126, 126, 126, 254, 63]),
    ("fp8_e5m2", 1.0, [60, 60, 60, 60, 60, 60, 60, 60, 188, 52, 180, 76, 94, 95, 251, 0, 0, 22, 150, 25, 128, 1, 3, 35,
                       35, 91, 91, 123, 251, 57]),
    ("fp8_e5m2", 0.37, [65, 65, 66, 66, 66, 66, 66, 66, 194, 58, 186, 82, 100, 101, 251, 0, 0, 28, 156, 32, 128, 5, 9,
                        41, 41, 97, 97, 123, 251, 63]),
]


@pytest.mark.parametrize("kv_cache_dtype, scale, codes", VLLM_CPU_CODES)
def test_quantize_writes_vllm_cpu_codes(kv_cache_dtype, scale, codes):
    """The NumPy contract and the torch quantizer write the codes vLLM's CPU backend writes for the same values and
    scale (recorded from its installed kernel): toward zero, where rounding to nearest differs on many of them
    (1.124 is e4m3's 1.125 to nearest, 1.0 toward zero)."""
    x = np.array(VLLM_CPU_VALUES, dtype=np.float32)
    np.testing.assert_array_equal(fp8.quantize(x, scale, kv_cache_dtype), np.array(codes, dtype=np.uint8))
    np.testing.assert_array_equal(quantize(torch.from_numpy(x), scale, kv_cache_dtype).numpy(),
                                  np.array(codes, dtype=np.uint8))


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("path", ["reference", "in-place", "gather"])
@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("head_dim, num_kv_heads, group", [(64, 2, 4), (128, 1, 8), (128, 4, 1)])
def test_fp8_decode_matches_dequantized_float64(kv_cache_dtype, path, block_size, head_dim, num_kv_heads, group,
                                                monkeypatch):
    """Each backend reading FP8 codes against the float64 attention over the dequantized K/V (codes x scale): the
    only error left is the kernels' float32 arithmetic. Unused slots hold NaN codes, the output starts as NaN."""
    if path == "in-place" and not in_place_built():
        pytest.skip("the in-place CPU attention cannot be built here")
    monkeypatch.setattr("paged_kernels.torch_backend.IN_PLACE_CPU", path == "in-place")
    k_scale, v_scale = np.random.default_rng().uniform(0.01, 2.0, 2)
    case = make_fp8_decode_case([0, 1, block_size, 2 * block_size + 1, 45, 130], block_size, num_kv_heads, group,
                                head_dim, kv_cache_dtype, k_scale, v_scale, spread=3.0)
    expected = reference.paged_attention_decode(
        case.query.double().numpy(), reference.dequantized(case.key_cache.numpy(), kv_cache_dtype, k_scale),
        reference.dequantized(case.value_cache.numpy(), kv_cache_dtype, v_scale), case.block_tables.numpy(),
        case.seq_lens.numpy(), head_dim ** -0.5)
    assert np.isfinite(expected).all()
    precision = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if path == "reference":
        out = paged_kernels.paged_attention_decode(case.query.numpy(), case.key_cache.numpy(),
                                                   case.value_cache.numpy(), case.block_tables.numpy(),
                                                   case.seq_lens.numpy(), backend="reference", **precision)
    else:
        out = torch.full_like(case.query, float("nan"))
        paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                             case.seq_lens, backend="torch", out=out, **precision)
    assert relative_error(out, expected) < 1e-5
    assert (np.asarray(out)[0] == 0).all()  # the empty sequence


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("query_dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(2, 2, 64), (1, 8, 128)])
def test_fp8_prefill_reads_and_dequantizes_the_pool_in_place(kv_cache_dtype, query_dtype, tolerance, block_size,
                                                             num_kv_heads, group, head_dim):
    """The C++ prefill attention over FP8 codes, chunks with and without cached prefixes, against float64 causal
    attention over the dequantized K/V."""
    if not in_place_built():
        pytest.skip("the in-place CPU attention cannot be built here")
    chunk_lens, cached = [5, 70, 1, 37], [0, 13, 100, 64]
    k_scale, v_scale = 0.05, 0.3
    case = make_fp8_decode_case([c + n for c, n in zip(cached, chunk_lens)], block_size, num_kv_heads, group,
                                head_dim, kv_cache_dtype, k_scale, v_scale)
    query = torch.randn(sum(chunk_lens), num_kv_heads * group, head_dim).to(query_dtype)
    out = torch.full_like(query, float("nan"))
    starts = torch.tensor([0, *np.cumsum(chunk_lens)], dtype=torch.long)
    assert paged_attention_prefill(query, case.key_cache, case.value_cache, case.block_tables.long(), starts,
                                   torch.tensor(cached), head_dim ** -0.5, out, kv_cache_dtype, k_scale, v_scale)
    keys = torch.from_numpy(reference.dequantized(case.key_cache.numpy(), kv_cache_dtype, k_scale))
    values = torch.from_numpy(reference.dequantized(case.value_cache.numpy(), kv_cache_dtype, v_scale))
    expected, start = [], 0
    for s, (length, before) in enumerate(zip(chunk_lens, cached)):
        positions = torch.arange(before + length)
        blocks = case.block_tables[s].long()[positions // block_size]
        k, v = (c[blocks, :, positions % block_size].repeat_interleave(group, 1) for c in (keys, values))
        scores = torch.einsum("thd,khd->htk", query[start:start + length].double(), k) * head_dim ** -0.5
        future = positions[None, :] > (before + torch.arange(length))[:, None]
        expected.append(torch.einsum("htk,khd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), v))
        start += length
    assert relative_error(out, torch.cat(expected).numpy()) < tolerance


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_fp8_write_quantizes_to_the_contract_and_skips_padding(kv_cache_dtype, backend):
    """The cache write stores ``fp8.quantize(K / k_scale)`` at each slot, leaves padding slots' bytes alone."""
    rng = np.random.default_rng()
    num_blocks, block_size, heads, head_dim = 6, 3, 2, 64
    key = torch.from_numpy(rng.standard_normal((12, heads, head_dim)).astype(np.float32) * 5)
    value = torch.from_numpy(rng.standard_normal((12, heads, head_dim)).astype(np.float32))
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:12])
    slots[::4] = -1
    key_cache = torch.full((num_blocks, heads, block_size, head_dim), 0xAB, dtype=torch.uint8)
    value_cache = key_cache.clone()
    paged_kernels.write_kv_cache(key, value, key_cache, value_cache, slots, backend=backend,
                                 kv_cache_dtype=kv_cache_dtype, k_scale=0.02, v_scale=0.5)
    for cache, x, cache_scale in ((key_cache, key, 0.02), (value_cache, value, 0.5)):
        for token, slot in enumerate(slots.tolist()):
            if slot >= 0:
                np.testing.assert_array_equal(cache[slot // block_size, :, slot % block_size].numpy(),
                                              fp8.quantize(x[token].numpy(), cache_scale, kv_cache_dtype))
        written = {s for s in slots.tolist() if s >= 0}
        untouched = [s for s in range(num_blocks * block_size) if s not in written]
        assert all((cache[s // block_size, :, s % block_size] == 0xAB).all() for s in untouched)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_fp8_round_trip_error_is_fp8s_own(kv_cache_dtype, block_size, monkeypatch):
    """End to end: K/V written through the quantizing write, attention read back, against float64 attention over the
    unquantized K/V: the error is FP8's (nonzero, under a unit in its last place: rounded toward zero, as vLLM's CPU
    write rounds), not a bug's."""
    rng = np.random.default_rng()
    heads, group, head_dim, length = 2, 4, 128, 200
    blocks = -(-length // block_size)
    key = rng.standard_normal((length, heads, head_dim)).astype(np.float32)
    value = rng.standard_normal((length, heads, head_dim)).astype(np.float32)
    query = rng.standard_normal((1, heads * group, head_dim)).astype(np.float32)
    cache_shape = (blocks, heads, block_size, head_dim)
    table = rng.permutation(blocks)
    slots = np.array([table[t // block_size] * block_size + t % block_size for t in range(length)])
    float_caches = [np.zeros(cache_shape), np.zeros(cache_shape)]
    reference.write_kv_cache(key, value, *float_caches, slots)
    exact = reference.paged_attention_decode(query, *float_caches, table[None], np.array([length]), head_dim ** -0.5)
    for path in ("in-place", "gather"):
        monkeypatch.setattr("paged_kernels.torch_backend.IN_PLACE_CPU", path == "in-place")
        caches = [torch.zeros(cache_shape, dtype=torch.uint8), torch.zeros(cache_shape, dtype=torch.uint8)]
        precision = dict(kv_cache_dtype=kv_cache_dtype, k_scale=1.0, v_scale=1.0)
        paged_kernels.write_kv_cache(torch.from_numpy(key), torch.from_numpy(value), *caches, torch.from_numpy(slots),
                                     backend="torch", **precision)
        out = paged_kernels.paged_attention_decode(torch.from_numpy(query), *caches, torch.from_numpy(table[None]),
                                                   torch.tensor([length]), backend="torch", **precision)
        error = np.linalg.norm(out.numpy() - exact) / np.linalg.norm(exact)
        assert 1e-4 < error < 2 * FP8_ULP[kv_cache_dtype], (path, error)  # toward zero: up to a whole step


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_saturating_scales_clamp_never_nan(kv_cache_dtype, monkeypatch):
    """A scale far too small for the data sends every element past the format's range: each is stored as +-max and
    attention stays finite, on every path."""
    limit = fp8.max_finite(kv_cache_dtype)
    case = make_fp8_decode_case([9, 40], 16, 2, 2, 64, kv_cache_dtype, k_scale=1e-6, v_scale=1e-6, spread=100.0)
    used = np.abs(fp8.dequantize(case.key_cache[case.block_tables[1, 0]].numpy(), 1.0, kv_cache_dtype))
    # standard normals times 1e8: all but the few within about 1e-5 of zero are past the range
    assert np.isfinite(used).all() and used.max() == limit and (used == limit).mean() > 0.98
    key = (torch.rand(4, 2, 64) + 1.0) * torch.where(torch.rand(4, 2, 64) < 0.5, -1.0, 1.0)
    caches = [torch.zeros(3, 2, 16, 64, dtype=torch.uint8) for _ in range(2)]
    paged_kernels.write_kv_cache(key, key, *caches, torch.arange(4), backend="torch", kv_cache_dtype=kv_cache_dtype,
                                 k_scale=1e-6, v_scale=1e-6)
    assert (dequantize(caches[0][0, :, :4], 1.0, kv_cache_dtype).abs() == limit).all()
    for path in ("in-place", "gather"):
        monkeypatch.setattr("paged_kernels.torch_backend.IN_PLACE_CPU", path == "in-place")
        out = paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                                   case.seq_lens, backend="torch", kv_cache_dtype=kv_cache_dtype,
                                                   k_scale=1e-6, v_scale=1e-6)
        assert torch.isfinite(out).all()


def test_fp8_arguments_are_checked():
    """A float cache named FP8, FP8 bytes named ``auto``, an unknown format or a bad scale: a KernelArgumentError
    naming it, before anything is written."""
    key = torch.randn(2, 1, 8)
    float_caches = [torch.zeros(2, 1, 4, 8) for _ in range(2)]
    byte_caches = [torch.zeros(2, 1, 4, 8, dtype=torch.uint8) for _ in range(2)]
    slots = torch.tensor([0, 1])
    with pytest.raises(paged_kernels.KernelArgumentError, match="uint8"):
        paged_kernels.write_kv_cache(key, key, *float_caches, slots, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(paged_kernels.KernelArgumentError, match="floating-point"):
        paged_kernels.write_kv_cache(key, key, *byte_caches, slots)
    with pytest.raises(paged_kernels.KernelArgumentError, match="kv_cache_dtype"):
        paged_kernels.write_kv_cache(key, key, *byte_caches, slots, kv_cache_dtype="fp8_e3m4")
    for bad in (0.0, -1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(paged_kernels.KernelArgumentError, match="k_scale"):
            paged_kernels.write_kv_cache(key, key, *byte_caches, slots, kv_cache_dtype="fp8", k_scale=bad)
    assert (byte_caches[0] == 0).all()
    with pytest.raises(paged_kernels.KernelArgumentError, match="uint8"):
        paged_kernels.paged_attention_decode(torch.randn(1, 1, 8), *float_caches, torch.tensor([[0]]),
                                             torch.tensor([3]), kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_block_copies_and_swaps_carry_fp8_bytes_as_they_are(backend):
    """Copy-on-write and swapping move FP8 blocks byte for byte (the prefix cache and the offload tier go through
    these)."""
    device = [torch.randint(0, 255, (5, 2, 4, 8), dtype=torch.uint8) for _ in range(2)]
    host = [torch.zeros(3, 2, 4, 8, dtype=torch.uint8) for _ in range(2)]
    before = [c.clone() for c in device]
    paged_kernels.copy_blocks(*device, [(0, 4)], backend=backend)
    assert torch.equal(device[0][4], before[0][0]) and torch.equal(device[1][4], before[1][0])
    paged_kernels.swap_blocks(*device, *host, [(1, 2)], backend=backend)
    assert torch.equal(host[0][2], device[0][1]) and torch.equal(host[1][2], device[1][1])


def test_cupy_takes_fp8_caches_named_as_fp8():
    """The CUDA kernels read and write FP8 codes (tests/test_cupy_fp8.py): ``uint8`` caches are accepted, for
    attention too, unless a ``kv_cache_dtype`` given does not match the caches' dtype."""
    from paged_kernels import cupy_backend

    caches = (torch.zeros(1, 1, 4, 64, dtype=torch.uint8),)
    query = torch.zeros(1, dtype=torch.float16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cupy_backend, "is_cuda", lambda tensor: True)
        assert cupy_backend.unsupported_reason(query, 64, 1, caches) is None
        assert cupy_backend.unsupported_reason(query, 64, 1, caches, "fp8_e5m2") is None
        assert cupy_backend.unsupported_reason(caches[0]) is None  # a write's or a copy's cache
        assert "does not match" in cupy_backend.unsupported_reason(query, 64, 1, caches, "auto")
        assert "does not match" in cupy_backend.unsupported_reason(query, 64, 1, (query,), "fp8")
        assert "dtype" in cupy_backend.unsupported_reason(torch.zeros(1, dtype=torch.int8))


def test_the_lab_s_kv_cache_dtypes_are_the_kernels():
    """``lab.kv_cache.precision`` restates the kernels' names (it may not load torch): they must stay equal."""
    from lab.kv_cache.precision import FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES, kv_element_bytes

    assert KV_CACHE_DTYPES == fp8.KV_CACHE_DTYPES == paged_kernels.KV_CACHE_DTYPES
    assert set(FP8_KV_CACHE_DTYPES) == set(fp8.FP8_FORMATS)
    assert all(kv_element_bytes(d, 2) == 1 for d in FP8_KV_CACHE_DTYPES) and kv_element_bytes("auto", 2) == 2


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_rope_write_quantizes_as_the_torch_op(kv_cache_dtype, dtype, monkeypatch):
    """The C++ q/k norm + rotary + cache write with FP8 caches stores the codes the torch op stores (which are the
    NumPy contract's, ``test_numpy_and_torch_quantize_agree_and_saturate``), saturating included, and skips padding."""
    if not in_place_built():
        pytest.skip("the CPU extension cannot be built here")
    tokens, q_heads, kv_heads, head_dim, block_size, blocks = 9, 4, 2, 64, 4, 5
    q = torch.randn(tokens, q_heads, head_dim).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    v = (torch.randn(tokens, kv_heads, head_dim) * 300).to(dtype)  # some past e4m3's 448 at v_scale 0.5
    weights = torch.rand(head_dim).to(dtype) + 0.5, torch.rand(head_dim).to(dtype) + 0.5
    angles = torch.arange(32)[:, None] * torch.rand(head_dim // 2)[None]
    cos_sin = torch.cat([angles.cos(), angles.cos(), angles.sin(), angles.sin()], dim=-1).to(dtype)
    positions = torch.randint(0, 32, (tokens,))
    slots = torch.randperm(blocks * block_size)[:tokens]
    slots[3] = -1
    from paged_kernels import torch_backend

    served = []
    inner = torch_backend._fused_qk_norm_rope_write
    monkeypatch.setattr(torch_backend, "_fused_qk_norm_rope_write",
                        lambda *args: served.append(inner(*args)) or served[-1])
    results = []
    for fused in (True, False):
        monkeypatch.setattr("paged_kernels.torch_backend.FUSED_CPU", fused)
        caches = [torch.full((blocks, kv_heads, block_size, head_dim), 0xAB, dtype=torch.uint8) for _ in range(2)]
        q_out, k_out = paged_kernels.qk_norm_rope_write(q, k, v, *weights, cos_sin, positions, *caches, slots,
                                                        backend="torch", kv_cache_dtype=kv_cache_dtype,
                                                        k_scale=0.03, v_scale=0.5)
        results.append((q_out, k_out, caches))
    assert len(served) == 1 and served[0] is not None  # the C++ pass wrote the first time
    (q_fused, k_fused, fused_caches), (q_torch, k_torch, torch_caches) = results
    assert torch.equal(q_fused, q_torch) and torch.equal(k_fused, k_torch)
    for ours, theirs in zip(fused_caches, torch_caches):
        assert torch.equal(ours, theirs)
    # the first token's slot was written: one code may equal the poison by chance (a key near -0.01 at k_scale
    # 0.03 is e4m3's 0xAB), a whole written row cannot
    assert (fused_caches[0][slots[0] // block_size, :, slots[0] % block_size] != 0xAB).any(dim=-1).all()
    limit = fp8.max_finite(kv_cache_dtype)
    assert np.isfinite(fp8.dequantize(fused_caches[1].numpy(), 1.0, kv_cache_dtype)).all()
    assert kv_cache_dtype != "fp8_e4m3" or (abs(fp8.dequantize(fused_caches[1].numpy(), 1.0, kv_cache_dtype))
                                            == limit).any()


def _encoder_probe_values(kv_cache_dtype, scale: float) -> np.ndarray:
    """float32 values that test a rounding toward zero: every code's value at ``scale`` and the floats just above
    and below it, both signs, the subnormal steps, float32's own subnormals, zeros, past the format's range, inf,
    NaN, and random magnitudes over the format's whole range."""
    values = fp8.decode_table(kv_cache_dtype)
    values = values[np.isfinite(values)].astype(np.float32) * np.float32(scale)
    near = [values, np.nextafter(values, np.float32(np.inf)), np.nextafter(values, np.float32(-np.inf))]
    rng = np.random.default_rng(7)
    wide = (np.exp2(rng.uniform(-30, 20, 4000)) * scale).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-39, -1e-39, 3e38, -3e38],
                       dtype=np.float32)
    probe = np.concatenate([*near, wide, special]).astype(np.float32)
    return np.concatenate([probe, -probe])


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0e-3])
def test_fused_write_encodes_every_boundary_as_the_numpy_contract(kv_cache_dtype, scale):
    """The C++ write's FP8 encoder (truncating the float's bits) gives the NumPy contract's code for each probe value
    (``_encoder_probe_values``): exact codes, one float either side of each, subnormals, zeros, saturation, NaN."""
    if not in_place_built():
        pytest.skip("the CPU extension cannot be built here")
    probe = _encoder_probe_values(kv_cache_dtype, scale)
    head_dim = 64
    probe = np.concatenate([probe, np.zeros(-len(probe) % head_dim, dtype=np.float32)])
    tokens = len(probe) // head_dim
    v = torch.from_numpy(probe).view(tokens, 1, head_dim)
    k = torch.randn(tokens, 1, head_dim)
    q = torch.randn(tokens, 1, head_dim)
    ones = torch.ones(head_dim)
    cos_sin = torch.cat([torch.ones(1, head_dim), torch.zeros(1, head_dim)], dim=-1)
    caches = [torch.full((tokens, 1, 1, head_dim), 0xAB, dtype=torch.uint8) for _ in range(2)]
    paged_kernels.qk_norm_rope_write(q, k, v, ones, ones, cos_sin, torch.zeros(tokens, dtype=torch.int64), *caches,
                                     torch.arange(tokens), backend="torch", kv_cache_dtype=kv_cache_dtype,
                                     k_scale=1.0, v_scale=scale)
    ours = caches[1].view(-1).numpy()
    expected = fp8.quantize(probe, scale, kv_cache_dtype)
    wrong = np.flatnonzero(ours != expected)
    assert not len(wrong), [(float(probe[i]), hex(ours[i]), hex(expected[i])) for i in wrong[:5]]


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_kernels_dequantize_by_bits_only_where_that_is_the_table(kv_cache_dtype):
    """The C++ kernels read FP8 codes 16 at a time through float16 where that gives the dequantization table's 256
    values bit for bit (checked per call), and by lookups where it does not: a table with one value changed, or
    (e4m3, whose factor is 2^8 * scale) a scale whose factor overflows float32, keeps the lookups."""
    if not in_place_built():
        pytest.skip("the CPU extension cannot be built here")
    from paged_kernels.cpu_extension import extension
    from paged_kernels.torch_backend import dequantization_table

    by_bits = extension().fp8_dequantizes_by_bits
    for scale in (1.0, 0.37, 3.0e-3, 17.0, -0.5):
        assert by_bits(dequantization_table(kv_cache_dtype, scale))
    changed = dequantization_table(kv_cache_dtype, 0.37).clone()
    changed[0x21] = torch.nextafter(changed[0x21], torch.tensor(1.0))
    assert not by_bits(changed)
    assert by_bits(dequantization_table(kv_cache_dtype, 2.0e36)) == (kv_cache_dtype == "fp8_e5m2")
