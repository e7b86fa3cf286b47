"""Every kernel backend against the float64 NumPy reference (CPU in CI; the same checks on CUDA under `gpu`)."""
import numpy as np
import pytest
import torch

import paged_kernels
from paged_kernels import reference, split_k
from tests.cuda_build import compile_ptx
from tests.kernel_cases import make_decode_case, make_write_case, relative_error

CPU_BACKENDS = ["torch", "reference"]
GPU_BACKENDS = ["torch", "cupy"]


def reference_decode(case):
    return reference.paged_attention_decode(case.query.double().cpu().numpy(), case.key_cache.double().cpu().numpy(),
                                            case.value_cache.double().cpu().numpy(), case.block_tables.cpu().numpy(),
                                            case.seq_lens.cpu().numpy(), case.query.shape[-1] ** -0.5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 256])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_reference_cpu(backend, block_size, group):
    seq_lens = [1, block_size, 2 * block_size, 3 * block_size + 1, 37, 300]
    case = make_decode_case(seq_lens, block_size, num_kv_heads=2, group=group, head_dim=64)
    out = torch.full_like(case.query, float("nan"))  # poisoned: every element must be written
    returned = paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                              case.seq_lens, backend=backend, out=out)
    assert returned is out and relative_error(out, reference_decode(case)) < 1e-5


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gather"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("block_size", [1, 3, 7, 32])
def test_both_cpu_decode_paths_match_reference(in_place, dtype, tolerance, block_size, monkeypatch):
    """The torch backend's CPU decode attention reads the pool in place (``paged_kernels.cpu_extension``, built on
    first use) or, where that cannot be built, gathers the blocks: both against float64, in every cache dtype."""
    from paged_kernels import cpu_extension

    if in_place and cpu_extension.status() is not None:
        pytest.skip(f"the in-place CPU attention cannot be built here: {cpu_extension.status()}")
    monkeypatch.setattr("paged_kernels.torch_backend.IN_PLACE_CPU", in_place)
    case = make_decode_case([0, 1, block_size, 2 * block_size + 1, 45, 130], block_size, num_kv_heads=2, group=4,
                            head_dim=32, dtype=dtype)
    out = torch.full_like(case.query, float("nan"))
    paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, backend="torch", out=out)
    assert relative_error(out, reference_decode(case)) < tolerance and (out[0] == 0).all()


def reference_prefill(query, case, chunk_lens, cached):
    """Each chunk's rows against its sequence's tokens up to their own positions, in float64."""
    block_size, group = case.key_cache.shape[2], query.shape[1] // case.key_cache.shape[1]
    out, start = [], 0
    for s, (length, before) in enumerate(zip(chunk_lens, cached)):
        total = before + length
        positions = torch.arange(total)
        blocks = case.block_tables[s].long()[positions // block_size]
        keys, values = (cache[blocks, :, positions % block_size].double().repeat_interleave(group, 1)
                        for cache in (case.key_cache, case.value_cache))
        scores = torch.einsum("thd,khd->htk", query[start:start + length].double(), keys) * query.shape[-1] ** -0.5
        future = torch.arange(total)[None, :] > (before + torch.arange(length))[:, None]
        out.append(torch.einsum("htk,khd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), values))
        start += length
    return torch.cat(out).numpy()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 32, 256])
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(2, 2, 32), (8, 2, 128), (1, 6, 64), (2, 1, 32)])
def test_cpu_prefill_attention_reads_the_pool_in_place(dtype, tolerance, block_size, num_kv_heads, group, head_dim):
    """The CPU prefill attention (``paged_kernels.cpu_extension``): prompt chunks with and without cached prefixes,
    lengths that do not divide the block size or its tiles, against float64; slots past each sequence hold NaN and
    the output starts as NaN."""
    from paged_kernels import cpu_extension
    from paged_kernels.torch_backend import paged_attention_prefill

    if cpu_extension.status() is not None:
        pytest.skip(f"the in-place CPU attention cannot be built here: {cpu_extension.status()}")
    chunk_lens, cached = [5, 70, 1, 37, 130], [0, 13, 200, 64, 0]
    case = make_decode_case([c + n for c, n in zip(cached, chunk_lens)], block_size, num_kv_heads, group, head_dim,
                            dtype=dtype)
    generator = torch.Generator().manual_seed(block_size * head_dim)
    query = torch.randn(sum(chunk_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    out = torch.full_like(query, float("nan"))
    starts = torch.tensor([0, *np.cumsum(chunk_lens)], dtype=torch.long)
    assert paged_attention_prefill(query, case.key_cache, case.value_cache, case.block_tables.long(), starts,
                                   torch.tensor(cached), head_dim ** -0.5, out)
    assert relative_error(out, reference_prefill(query, case, chunk_lens, cached)) < tolerance


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("sharpness", [30.0, 300.0])
def test_cpu_prefill_attention_on_sharp_softmaxes(dtype, tolerance, sharpness):
    """Scores hundreds apart (queries scaled up): the kernel's own exponential underflows to exactly zero where the
    float64 reference's does, with no NaN or infinity, and the rows still match the reference."""
    from paged_kernels import cpu_extension
    from paged_kernels.torch_backend import paged_attention_prefill

    if cpu_extension.status() is not None:
        pytest.skip(f"the in-place CPU attention cannot be built here: {cpu_extension.status()}")
    chunk_lens, cached = [3, 129, 64], [0, 70, 200]
    case = make_decode_case([c + n for c, n in zip(cached, chunk_lens)], 7, 2, 2, 32, dtype=dtype)
    generator = torch.Generator().manual_seed(int(sharpness))
    query = (torch.randn(sum(chunk_lens), 4, 32, generator=generator) * sharpness).to(dtype)
    out = torch.full_like(query, float("nan"))
    starts = torch.tensor([0, *np.cumsum(chunk_lens)], dtype=torch.long)
    assert paged_attention_prefill(query, case.key_cache, case.value_cache, case.block_tables.long(), starts,
                                   torch.tensor(cached), 32 ** -0.5, out)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference_prefill(query, case, chunk_lens, cached)) < tolerance


def test_cpu_prefill_attention_declines_what_it_is_not_built_for():
    """A head size without an instantiation, or an output it cannot write in place (not contiguous), is left to the
    caller."""
    from paged_kernels.torch_backend import paged_attention_prefill

    case = make_decode_case([9], 4, 2, 2, 48)
    query, out = torch.randn(9, 4, 48), torch.empty(9, 4, 48)
    args = (case.key_cache, case.value_cache, case.block_tables.long(), torch.tensor([0, 9]), torch.tensor([0]), 0.1)
    assert not paged_attention_prefill(query, *args, out)
    assert not paged_attention_prefill(query, *args, torch.empty(4, 9, 48).transpose(0, 1))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_decode_with_host_max_seq_len_matches_reference(backend, block_size):
    """A runner passes the longest length it knows on the host (no device read-back); results are unchanged."""
    case = make_decode_case([0, 3, block_size + 2, 61], block_size, num_kv_heads=2, group=2, head_dim=32)
    out = torch.full_like(case.query, float("nan"))
    paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                   backend=backend, check=False, out=out, max_seq_len=61)
    assert relative_error(out, reference_decode(case)) < 1e-5 and (out[0] == 0).all()


def test_decode_rejects_a_wrong_max_seq_len():
    case = make_decode_case([5, 9], 4, num_kv_heads=1, group=2, head_dim=8)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    with pytest.raises(ValueError, match="max_seq_len=8 but the longest of seq_lens is 9"):
        paged_kernels.paged_attention_decode(*args, max_seq_len=8)
    for bad in (-1, 2.5, True, "9"):  # the type is checked even unchecked (no look at the data needed)
        with pytest.raises(ValueError, match="max_seq_len must be None or an integer >= 0"):
            paged_kernels.paged_attention_decode(*args, check=False, max_seq_len=bad)


def test_reference_takes_numpy_and_matches_plain_softmax():
    case = make_decode_case([5, 9], 4, num_kv_heads=1, group=2, head_dim=8)
    q, kc, vc = (t.double().numpy() for t in (case.query, case.key_cache, case.value_cache))
    out = paged_kernels.paged_attention_decode(q, kc, vc, case.block_tables.numpy(), case.seq_lens.numpy(), scale=0.3)
    for s, length in enumerate([5, 9]):
        rows = [b * 4 + o for b in case.block_tables[s].tolist() for o in range(4)][:length]
        keys, values = kc.transpose(0, 2, 1, 3).reshape(-1, 1, 8)[rows, 0], vc.transpose(0, 2, 1, 3).reshape(-1, 1, 8)[rows, 0]
        for h in range(2):
            scores = keys @ q[s, h] * 0.3
            p = np.exp(scores - scores.max())
            expected = p @ values / p.sum()
            # relative to the row's norm: an element that cancels to near zero carries the others' rounding (a
            # fresh case failed element-wise at 3.5e-12 on an entry of 1.4e-5, an absolute 4.9e-17)
            assert np.linalg.norm(out[s, h] - expected) <= 1e-12 * np.linalg.norm(expected), (s, h)


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_split_k_reduction_matches_reference(block_size):
    case = make_decode_case([1, 511, 512, 513, 1500], block_size, num_kv_heads=2, group=2, head_dim=32)
    out = split_k.split_k_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                 32 ** -0.5, partition_size=split_k.PARTITION_SIZE)
    assert relative_error(out, reference_decode(case)) < 1e-10
    m, l, _ = split_k.partition_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                          case.seq_lens, 32 ** -0.5)
    assert m.shape[-1] == 3 and torch.isinf(m[0, :, 1:]).all() and (l[0, :, 1:] == 0).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_write_kv_cache_scatters_and_skips_padding(backend, block_size):
    case = make_write_case(num_tokens=23, block_size=block_size, num_blocks=40)
    paged_kernels.write_kv_cache(case.key, case.value, case.key_cache, case.value_cache, case.slot_mapping, backend=backend)
    flat_k = case.key_cache.transpose(1, 2).reshape(-1, *case.key.shape[1:])
    flat_v = case.value_cache.transpose(1, 2).reshape(-1, *case.key.shape[1:])
    keep = case.slot_mapping >= 0
    assert torch.equal(flat_k[case.slot_mapping[keep]], case.key[keep])
    assert torch.equal(flat_v[case.slot_mapping[keep]], case.value[keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[case.slot_mapping[keep]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


@pytest.mark.parametrize("padding", ["some", "none", "all"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sync_free_padding_writes_what_dropping_it_writes(padding, cache_dtype):
    """The torch backend's write on a GPU (``redirect_padding``: no read-back, padding rows become duplicate writes
    of equal values) leaves the caches bit-identical to dropping the padding rows (its CPU path), slot 0 included
    when every row is padding; on caches of random values, so an overwritten slot shows."""
    from paged_kernels.torch_backend import drop_padding, redirect_padding

    case = make_write_case(num_tokens=13, block_size=3, num_blocks=9)
    slots = {"some": case.slot_mapping, "none": torch.randperm(27)[:13], "all": torch.full((13,), -1)}[padding]
    caches = [torch.randn(9, 2, 3, 8).to(cache_dtype) for _ in range(2)]
    written = []
    for padding_rows in (drop_padding, redirect_padding):
        key_cache, value_cache = (cache.clone() for cache in caches)
        rows = padding_rows(slots, case.key.to(cache_dtype), case.value.to(cache_dtype), key_cache, value_cache)
        paged_kernels.torch_backend.write_kv_cache(*rows[1:], key_cache, value_cache, rows[0])
        written.append((key_cache, value_cache))
    (dropped_k, dropped_v), (redirected_k, redirected_v) = written
    assert torch.equal(redirected_k, dropped_k) and torch.equal(redirected_v, dropped_v)
    if padding == "all":
        assert torch.equal(redirected_k, caches[0]) and torch.equal(redirected_v, caches[1])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_copy_blocks(backend):
    kc, vc = torch.randn(6, 2, 3, 4), torch.randn(6, 2, 3, 4)
    k0, v0 = kc.clone(), vc.clone()
    paged_kernels.copy_blocks(kc, vc, [(0, 4), (2, 5)], backend=backend)
    assert torch.equal(kc[4], k0[0]) and torch.equal(vc[5], v0[2]) and torch.equal(kc[:4], k0[:4])
    with pytest.raises(ValueError, match="outside"):
        paged_kernels.copy_blocks(kc, vc, [(0, 6)], backend=backend)
    with pytest.raises(ValueError, match="pairs"):
        paged_kernels.copy_blocks(kc, vc, [(0, 1, 2)], backend=backend)
    assert torch.equal(kc[:4], k0[:4])


CHAINED_MAPPINGS = [[(0, 4), (4, 5)], [(4, 5), (0, 4)], [(0, 3), (1, 3)], [(0, 1), (1, 2), (2, 0)]]


def sequential_copy(cache, mapping):
    expected = cache.clone()
    for src, dst in mapping:
        expected[dst] = expected[src].clone()
    return expected


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mapping", CHAINED_MAPPINGS)
def test_copy_blocks_pairs_take_effect_in_order(backend, mapping):
    kc, vc = torch.randn(6, 2, 3, 4), torch.randn(6, 2, 3, 4)
    expected_k, expected_v = sequential_copy(kc, mapping), sequential_copy(vc, mapping)
    paged_kernels.copy_blocks(kc, vc, mapping, backend=backend, check=False)
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_write_rejects_duplicate_slots_and_changes_nothing(backend):
    case = make_write_case(num_tokens=6, block_size=3, num_blocks=10)
    case.slot_mapping[:] = torch.tensor([4, -1, 9, 4, -1, 2])
    before = case.key_cache.clone()
    with pytest.raises(ValueError, match="slot 4 more than once"):
        paged_kernels.write_kv_cache(case.key, case.value, case.key_cache, case.value_cache, case.slot_mapping,
                               backend=backend)
    assert torch.equal(case.key_cache.nan_to_num(7), before.nan_to_num(7))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_empty_sequences_get_zeros_and_padding_is_ignored(backend, block_size):
    case = make_decode_case([0, 37, 0, 5], block_size, num_kv_heads=2, group=2, head_dim=16)
    tables = case.block_tables.clone()
    for row, length in enumerate([0, 37, 0, 5]):
        tables[row, -(-length // block_size):] = -1  # padding past each sequence's blocks
    out = paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, tables, case.seq_lens,
                                         backend=backend, out=torch.full_like(case.query, float("nan")))
    expected = reference_decode(case)
    assert (out[[0, 2]] == 0).all() and np.all(expected[[0, 2]] == 0)
    assert relative_error(out, expected) < 1e-5
    none = torch.zeros(4, dtype=torch.int32)
    out = paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, tables, none,
                                         backend=backend)
    assert (out == 0).all()


def test_split_k_twin_takes_padding_and_empty_sequences():
    case = make_decode_case([0, 700, 3], 16, num_kv_heads=1, group=2, head_dim=8)
    tables = case.block_tables.clone()
    tables[2, 1:] = -1
    out = split_k.split_k_decode(case.query, case.key_cache, case.value_cache, tables, case.seq_lens, 8 ** -0.5)
    assert relative_error(out, reference_decode(case)) < 1e-10 and (out[0] == 0).all()


def test_bad_input_names_the_argument():
    case = make_decode_case([5, 9], 4, num_kv_heads=2, group=2, head_dim=8)
    args = [case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens]

    def call(**changes):
        named = dict(zip(["query", "key_cache", "value_cache", "block_tables", "seq_lens"], args))
        named.update(changes)
        return paged_kernels.paged_attention_decode(**named)

    with pytest.raises(ValueError, match="query must have rank 3"):
        call(query=case.query[0])
    with pytest.raises(ValueError, match="not divisible"):
        call(query=torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        call(seq_lens=torch.tensor([5, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        call(seq_lens=torch.tensor([5, 99], dtype=torch.int32))
    bad_tables = case.block_tables.clone()
    bad_tables[0, 0] = 10_000
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\]"):
        call(block_tables=bad_tables)
    with pytest.raises(ValueError, match="dtype"):
        call(value_cache=case.value_cache.double())
    with pytest.raises(ValueError, match="out has shape"):
        call(out=torch.empty(1, 4, 8))
    for dtype in (torch.float32, torch.bfloat16, torch.bool):  # bfloat16 has no NumPy twin to ask for its kind
        with pytest.raises(ValueError, match="block_tables must hold integers"):
            call(block_tables=case.block_tables.to(dtype))
        with pytest.raises(ValueError, match="slot_mapping must hold integers"):
            paged_kernels.write_kv_cache(torch.randn(2, 2, 8), torch.randn(2, 2, 8), case.key_cache, case.value_cache,
                                   torch.tensor([0, 1]).to(dtype), check=False)
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_kernels.paged_attention_decode(*args, backend="triton")
    if "cupy" not in paged_kernels.available_backends():
        with pytest.raises(RuntimeError, match="cupy"):
            paged_kernels.paged_attention_decode(*args, backend="cupy")
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_kernels.write_kv_cache(torch.randn(2, 2, 8), torch.randn(2, 2, 8), case.key_cache, case.value_cache,
                               torch.tensor([0, 1, 2]))


def test_available_backends_on_cpu():
    assert {"reference", "torch"} <= set(paged_kernels.available_backends())
    usable, reason = paged_kernels.cupy_status()
    assert usable == ("cupy" in paged_kernels.available_backends()) and reason


def test_cuda_sources_compile_to_ptx_for_sm80():
    from paged_kernels.cupy_backend import all_kernel_names

    ptx = compile_ptx("80")
    assert ptx.count(".entry") == len(all_kernel_names())


# ---- CUDA --------------------------------------------------------------------------------------------------------
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 256])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 128), (4, 128)])
def test_decode_matches_reference_cuda(backend, dtype, block_size, group, head_dim):
    case = make_decode_case([1, block_size, 3 * block_size + 1, 37, 700, 1300], block_size, num_kv_heads=2,
                            group=group, head_dim=head_dim, dtype=dtype, device="cuda")
    out = torch.full_like(case.query, float("nan"))
    out = paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, backend=backend, out=out)
    assert out.dtype == dtype and relative_error(out, reference_decode(case)) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("block_size", [3, 16])
def test_decode_with_host_max_seq_len_cuda(backend, block_size):
    """The runner's path on CUDA: lengths' maximum given from the host, inputs unchecked."""
    lengths = [0, 1, 3 * block_size + 1, 700, 1300]
    case = make_decode_case(lengths, block_size, num_kv_heads=2, group=2, head_dim=128, device="cuda")
    out = torch.full_like(case.query, float("nan"))
    paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                   backend=backend, check=False, out=out, max_seq_len=max(lengths))
    assert relative_error(out, reference_decode(case)) < TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("partition_size", [None, 0, 512])
def test_cupy_contracts_match_the_cpu_backends(partition_size):
    """Empty sequences, -1 padding, permuted query and strided out, chained copies: as on the CPU."""
    from paged_kernels import cupy_backend

    if "cupy" not in paged_kernels.available_backends():
        pytest.skip("cupy cannot run kernels here")
    case = make_decode_case([0, 1300, 0, 5], 16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float16,
                            device="cuda")
    tables = case.block_tables.clone()
    tables[3, 1:] = -1
    permuted = case.query.transpose(0, 1).contiguous().transpose(0, 1)
    out = torch.full(case.query.shape[::-1], float("nan"), dtype=torch.float16, device="cuda").transpose(0, 2)
    returned = cupy_backend.paged_attention_decode(permuted, case.key_cache, case.value_cache, tables, case.seq_lens,
                                                   64 ** -0.5, partition_size=partition_size, out=out)
    assert returned is out and (out[[0, 2]] == 0).all()
    assert relative_error(out, reference_decode(case)) < TOLERANCE[torch.float16]
    for mapping in CHAINED_MAPPINGS:
        kc, vc = torch.randn(6, 2, 3, 64, device="cuda"), torch.randn(6, 2, 3, 64, device="cuda")
        expected_k, expected_v = sequential_copy(kc, mapping), sequential_copy(vc, mapping)
        paged_kernels.copy_blocks(kc, vc, mapping, backend="cupy")
        assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)


@pytest.mark.gpu
def test_cupy_tiles_batches_past_the_grid_limit():
    if "cupy" not in paged_kernels.available_backends():
        pytest.skip("cupy cannot run kernels here")
    from paged_kernels import cupy_backend

    case = make_decode_case([3] * (cupy_backend.MAX_GRID_YZ + 5), 1, num_kv_heads=1, group=2, head_dim=64,
                            dtype=torch.bfloat16, device="cuda")
    out = paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, backend="cupy", out=torch.full_like(case.query, float("nan")))
    assert relative_error(out, reference_decode(case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_tiny_preset_head_dim_runs_on_cuda_with_auto():
    case = make_decode_case([5, 40], 16, num_kv_heads=2, group=2, head_dim=32, dtype=torch.bfloat16, device="cuda")
    write = make_write_case(num_tokens=9, block_size=16, num_blocks=4, head_dim=32, dtype=torch.bfloat16,
                            device="cuda")
    paged_kernels.write_kv_cache(write.key, write.value, write.key_cache, write.value_cache, write.slot_mapping)
    out = paged_kernels.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens)
    assert relative_error(out, reference_decode(case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("partition_size", [0, 512])
def test_cupy_v1_and_v2_long_context(partition_size):
    from paged_kernels import cupy_backend

    if "cupy" not in paged_kernels.available_backends():
        pytest.skip("cupy cannot run kernels here")
    case = make_decode_case([32768, 5000, 1], 16, num_kv_heads=8, group=2, head_dim=128, device="cuda")
    out = cupy_backend.paged_attention_decode(case.query, case.key_cache, case.value_cache, case.block_tables,
                                              case.seq_lens, 128 ** -0.5, partition_size=partition_size,
                                              out=torch.full_like(case.query, float("nan")))
    assert relative_error(out, reference_decode(case)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_and_copy_cuda(backend, dtype):
    case = make_write_case(num_tokens=50, block_size=7, num_blocks=30, dtype=dtype, device="cuda")
    expected_k, expected_v = case.key_cache.cpu(), case.value_cache.cpu()  # the CPU write drops padding rows
    paged_kernels.write_kv_cache(case.key.cpu(), case.value.cpu(), expected_k, expected_v, case.slot_mapping.cpu(),
                           backend="torch")
    expected_k, expected_v = expected_k.cuda(), expected_v.cuda()
    paged_kernels.write_kv_cache(case.key, case.value, case.key_cache, case.value_cache, case.slot_mapping, backend=backend)
    assert torch.equal(case.key_cache.nan_to_num(7), expected_k.nan_to_num(7))
    assert torch.equal(case.value_cache.nan_to_num(7), expected_v.nan_to_num(7))
    paged_kernels.copy_blocks(case.key_cache, case.value_cache, [(1, 20), (3, 21)], backend=backend)
    assert torch.equal(case.key_cache[20].nan_to_num(7), case.key_cache[1].nan_to_num(7))
    assert torch.equal(case.value_cache[21].nan_to_num(7), case.value_cache[3].nan_to_num(7))


def test_cupy_dispatch_rule_and_instances():
    from paged_kernels.cupy_backend import PARTITION_SIZE, all_kernel_names, choose_partition_size

    assert choose_partition_size(1, 8, 512, 132) == 0  # one partition anyway
    assert choose_partition_size(1, 8, 4096, 132) == PARTITION_SIZE  # few blocks: split the context
    assert choose_partition_size(128, 8, 4096, 132) == 0  # 1024 thread blocks already fill 132 SMs
    assert choose_partition_size(64, 8, 32768, 132) == PARTITION_SIZE  # very long: always split
    names = all_kernel_names()
    assert "paged_attention_kernel<bf16_t,128,2,4>" in names and "reduce_partitions_kernel<half_t,64>" in names
    # per dtype: write + copy, attention per (head_dim, group), reduction per head_dim, and the three fused ops;
    # per dtype and FP8 format: write, attention per (head_dim, group), the fused write; one byte copy for FP8
    assert len(names) == 3 * (2 + 3 * 8 + 3 + 3) + 3 * 2 * (1 + 3 * 8 + 1) + 1
    assert "qk_norm_rope_write_kernel<bf16_t>" in names and "qk_norm_rope_write_kernel<bf16_t,fp8_e5m2_t>" in names
    assert "paged_attention_kernel<half_t,64,8,4,fp8_e4m3_t>" in names and "copy_blocks_kernel<unsigned char>" in names


def test_the_cpu_extension_s_build_is_found_by_its_inputs_not_its_path(tmp_path, monkeypatch):
    """A checkout elsewhere (or a fresh virtual environment) with the same source loads the binary already built,
    without running the build; another source gets a build of its own."""
    from paged_kernels import cpu_extension

    if cpu_extension.status() is not None:
        pytest.skip(f"the in-place CPU attention cannot be built here: {cpu_extension.status()}")
    name = cpu_extension._build_name()
    copy = tmp_path / "elsewhere" / "cpu_paged_attention.cpp"
    copy.parent.mkdir()
    copy.write_bytes(cpu_extension.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_extension, "SOURCE", copy)
    assert cpu_extension._build_name() == name
    monkeypatch.setattr(cpu_extension, "_build", lambda: pytest.fail("built again"))
    assert cpu_extension._built() is not None
    copy.write_bytes(copy.read_bytes() + b"\n// another source\n")
    assert cpu_extension._build_name() != name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_torch_s_argmax(dtype):
    """``greedy_argmax`` (the CPU extension's one pass over a row) gives ``torch.argmax(dim=-1)``'s index on seeded
    rows of every length from 1 to past 16 lanes: ties (the first wins), rounded values full of ties, -0.0 before
    0.0, rows of -inf, an inf, a NaN anywhere (torch ranks NaN highest) and rows all NaN."""
    from paged_kernels.cpu_extension import status
    from paged_kernels.torch_backend import greedy_argmax

    if status() is not None:
        pytest.skip(f"the CPU extension cannot be built here: {status()}")
    generator = torch.Generator().manual_seed(7)
    for trial in range(600):
        rows = int(torch.randint(1, 9, (1,), generator=generator))
        n = 1 + trial % 70 if trial < 300 else int(torch.randint(1, 3000, (1,), generator=generator))
        x = (torch.randn(rows, n, generator=generator) * 3).to(dtype)
        at = int(torch.randint(0, n, (1,), generator=generator))
        case = trial % 8
        if case == 1:
            x[:, at] = x.max()
        elif case == 2:
            x[0, at] = float("nan")
        elif case == 3:
            x[:] = float("-inf")
        elif case == 4:
            x = x.round()
        elif case == 5:
            x[:] = -1.0
            x[:, at] = -0.0
            x[:, n - 1] = 0.0
        elif case == 6:
            x[-1, :] = float("nan")
        elif case == 7:
            x[0, at] = float("inf")
        assert torch.equal(greedy_argmax(x), x.argmax(dim=-1)), (trial, case, dtype, n)
