"""The fused layer ops (``paged_kernels.rms_norm``, ``silu_and_mul``, ``qk_norm_rope_write``) against the float64
reference: fresh random inputs, outputs and caches poisoned first, block sizes that do not divide the lengths; the
torch backend bit for bit against HF's own modules; the CuPy launcher's geometry recorded without a GPU; the same
checks on CUDA under ``gpu``."""
import numpy as np
import pytest
import torch

import paged_kernels
from paged_kernels import reference
from tests.kernel_cases import relative_error
from tests.test_cupy_launcher import launches  # noqa: F401 - the recorder fixture

CPU_BACKENDS = ["torch", "reference"]


def table(max_position: int, head_dim: int, dtype=torch.float32, device="cpu"):
    """A rotary table as HF's default rope builds it (theta 1e6), cos then sin over the whole head."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None]
    angles = torch.cat([freqs, freqs], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)


def qk_case(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)  # noqa: E731
    qkv = rand(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)  # one merged projection: views below
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    num_blocks = -(-num_tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::5] = -1  # padding rows
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator)
    caches = [torch.full((num_blocks, num_kv_heads, block_size, head_dim), float("nan"), dtype=dtype, device=device)
              for _ in range(2)]
    return dict(q=q.view(num_tokens, num_q_heads, head_dim), k=k.view(num_tokens, num_kv_heads, head_dim),
                v=v.view(num_tokens, num_kv_heads, head_dim), q_weight=1 + 0.1 * rand(head_dim),
                k_weight=1 + 0.1 * rand(head_dim), cos_sin_cache=table(4096, head_dim, dtype, device),
                positions=positions.to(device), key_cache=caches[0], value_cache=caches[1],
                slot_mapping=slots.to(device))


def reference_qk(case, eps=1e-6):
    key_cache = np.full(tuple(case["key_cache"].shape), np.nan)
    value_cache = key_cache.copy()
    numpy = {name: case[name].double().cpu().numpy() for name in ("q", "k", "v", "q_weight", "k_weight",
                                                                   "cos_sin_cache")}
    q, k = reference.qk_norm_rope_write(numpy["q"], numpy["k"], numpy["v"], numpy["q_weight"], numpy["k_weight"],
                                        numpy["cos_sin_cache"], case["positions"].cpu().numpy(), key_cache,
                                        value_cache, case["slot_mapping"].cpu().numpy(), eps)
    return q, k, key_cache, value_cache


def assert_caches_match(case, key_cache, value_cache, tolerance):
    written = case["slot_mapping"].cpu().numpy() >= 0
    blocks = torch.as_tensor(case["slot_mapping"].cpu().numpy()[written]) // case["key_cache"].shape[2]
    offsets = torch.as_tensor(case["slot_mapping"].cpu().numpy()[written]) % case["key_cache"].shape[2]
    for cache, expected in ((case["key_cache"], key_cache), (case["value_cache"], value_cache)):
        got = cache.cpu()[blocks, :, offsets]
        assert relative_error(got, expected[blocks.numpy(), :, offsets.numpy()]) < tolerance
        untouched = torch.ones(cache.shape[0] * cache.shape[2], dtype=torch.bool)
        untouched[case["slot_mapping"].cpu()[written]] = False
        assert cache.cpu().permute(0, 2, 1, 3).reshape(-1, *cache.shape[1:2], cache.shape[3])[untouched].isnan().all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (3, 7, 130)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(backend, shape, with_residual):
    generator = torch.Generator().manual_seed(sum(shape))
    x, residual = torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)
    weight = torch.randn(shape[-1], generator=generator)
    normed, total = paged_kernels.rms_norm(x, weight, 1e-6, residual if with_residual else None, backend=backend)
    want_normed, want_total = reference.rms_norm(x.double().numpy(), weight.double().numpy(), 1e-6,
                                                 residual.double().numpy() if with_residual else None)
    assert relative_error(normed, want_normed) < 1e-6 and relative_error(total, want_total) < 1e-6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(1, 2), (4, 96), (2, 3, 2 * 771)])
def test_silu_and_mul_matches_reference(backend, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    assert relative_error(paged_kernels.silu_and_mul(x, backend=backend), reference.silu_and_mul(x.double().numpy())) < 1e-6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("heads", [(4, 2), (16, 8), (2, 2)])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_qk_norm_rope_write_matches_reference(backend, block_size, heads, head_dim):
    case = qk_case(11, *heads, head_dim, block_size, seed=block_size + head_dim)
    q, k, key_cache, value_cache = reference_qk(case)
    q_out, k_out = paged_kernels.qk_norm_rope_write(**case, backend=backend)
    assert relative_error(q_out, q) < 1e-6 and relative_error(k_out, k) < 1e-6
    assert_caches_match(case, key_cache, value_cache, 1e-6)


def test_the_torch_backend_is_hf_bit_for_bit():
    """What keeps the engine's tokens HF's: the same float32 arithmetic as ``Qwen3RMSNorm``, SiLU-and-multiply and
    ``apply_rotary_pos_emb`` (after the q/k norms), to the last bit."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(3)
    norm = Qwen3RMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64, generator=generator)
    x, residual = torch.randn(9, 64, generator=generator), torch.randn(9, 64, generator=generator)
    assert torch.equal(paged_kernels.rms_norm(x, norm.weight.data, 1e-6, residual, backend="torch")[0], norm(x + residual))
    gate_up = torch.randn(9, 128, generator=generator)
    assert torch.equal(paged_kernels.silu_and_mul(gate_up, backend="torch"),
                       torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:])
    case = qk_case(9, 4, 2, 64, 3, seed=5)
    q_out, k_out = paged_kernels.qk_norm_rope_write(**case, backend="torch")
    q_norm, k_norm = Qwen3RMSNorm(64, eps=1e-6), Qwen3RMSNorm(64, eps=1e-6)
    q_norm.weight.data, k_norm.weight.data = case["q_weight"], case["k_weight"]
    rows = case["cos_sin_cache"][case["positions"]]
    q_hf, k_hf = apply_rotary_pos_emb(q_norm(case["q"]), k_norm(case["k"]), rows[:, :64], rows[:, 64:],
                                      unsqueeze_dim=1)
    assert torch.equal(q_out, q_hf) and torch.equal(k_out, k_hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
def test_cpu_fused_qk_norm_rope_write_is_the_torch_ops_bit_for_bit(dtype, head_dim, monkeypatch):
    """The C++ pass (``FUSED_CPU``; bfloat16 heads of a multiple of 32 by whole registers, others element by element)
    writes the q and k outputs and the caches the torch ops write, to the last bit (finite inputs; NaN payloads may
    differ), padding rows included."""
    from paged_kernels import cpu_extension

    if cpu_extension.status() is not None:
        pytest.skip(f"the CPU extension cannot be built here: {cpu_extension.status()}")
    results = []
    for fused in (True, False):
        monkeypatch.setattr("paged_kernels.torch_backend.FUSED_CPU", fused)
        case = qk_case(37, 6, 2, head_dim, 7, dtype=dtype, seed=head_dim)
        spread = torch.randn(case["q"].shape[:2], generator=torch.Generator().manual_seed(head_dim))
        case["q"] = case["q"] * (4.0 ** spread)[..., None].to(dtype)  # heads of very different scales
        outputs = paged_kernels.qk_norm_rope_write(**case, backend="torch")
        results.append([x.view(torch.int16 if dtype != torch.float32 else torch.int32)
                        for x in (*outputs, case["key_cache"], case["value_cache"])])
    for fused, unfused in zip(*results):
        assert torch.equal(fused, unfused)


@pytest.mark.parametrize("bad,message", [
    (dict(eps=-1), "eps"), (dict(positions=torch.tensor([5000] * 11)), "positions must be in"),
    (dict(slot_mapping=torch.tensor([0] * 11)), "more than once"),
    (dict(cos_sin_cache=torch.zeros(10, 63)), "cos_sin_cache must be"),
    (dict(q_weight=torch.zeros(7)), "q_weight must be"),
])
def test_bad_qk_arguments_are_named(bad, message):
    case = qk_case(11, 4, 2, 32, 3)
    with pytest.raises(ValueError, match=message):
        paged_kernels.qk_norm_rope_write(**{**case, **bad}, backend="torch")


def test_bad_norm_and_activation_arguments_are_named():
    with pytest.raises(ValueError, match="weight must be"):
        paged_kernels.rms_norm(torch.zeros(2, 8), torch.zeros(7))
    with pytest.raises(ValueError, match="residual shape"):
        paged_kernels.rms_norm(torch.zeros(2, 8), torch.zeros(8), residual=torch.zeros(3, 8))
    with pytest.raises(ValueError, match=r"\[\.\.\., 2 \* d\]"):
        paged_kernels.silu_and_mul(torch.zeros(2, 7))


def test_fused_launch_geometry(launches):  # noqa: F811
    """One launch per op, whole warps per block, merged-projection views passed with their row stride."""
    x = torch.randn(6, 1024, dtype=torch.bfloat16)
    paged_kernels.rms_norm(x, torch.ones(1024, dtype=torch.bfloat16), 1e-6, x.clone(), backend="cupy")
    paged_kernels.silu_and_mul(torch.randn(6, 2 * 3072, dtype=torch.bfloat16), backend="cupy")
    case = qk_case(6, 16, 8, 128, 16, dtype=torch.bfloat16)
    paged_kernels.qk_norm_rope_write(**case, backend="cupy", check=False)
    norm, silu, qk = launches
    assert (norm.kernel, norm.grid, norm.block) == ("rms_norm_kernel<bf16_t>", (6,), (1024,))
    assert (silu.kernel, silu.grid, silu.block) == ("silu_and_mul_kernel<bf16_t>", (6,), (1024,))
    assert (qk.kernel, qk.grid, qk.block) == ("qk_norm_rope_write_kernel<bf16_t>", (6, 24), (64,))
    row = (16 + 2 * 8) * 128
    assert [int(a) for a in qk.args[-5:-2]] == [row, row, row]  # q, k and v read in place from the merged output
    assert [float(a) for a in qk.args[-2:]] == [1.0, 1.0]  # k_scale and v_scale: ignored by a cache of the model's dtype
    assert qk.args[2].data_ptr() == case["q"].data_ptr()
    small = qk_case(3, 4, 2, 32, 3, dtype=torch.bfloat16)
    paged_kernels.qk_norm_rope_write(**small, backend="cupy", check=False)
    assert launches[-1].block == (32,)  # 16 pairs, one whole warp


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_fused_ops_match_reference_cuda(dtype, tolerance, block_size):
    case = qk_case(37, 16, 8, 128, block_size, dtype=dtype, device="cuda", seed=block_size)
    q, k, key_cache, value_cache = reference_qk(case)
    q_out, k_out = paged_kernels.qk_norm_rope_write(**case, backend="cupy")
    assert relative_error(q_out, q) < tolerance and relative_error(k_out, k) < tolerance
    assert_caches_match(case, key_cache, value_cache, tolerance)
    x, residual = torch.randn(37, 1024, device="cuda").to(dtype), torch.randn(37, 1024, device="cuda").to(dtype)
    weight = torch.randn(1024, device="cuda").to(dtype)
    normed, total = paged_kernels.rms_norm(x, weight, 1e-6, residual, backend="cupy")
    want = reference.rms_norm(x.double().cpu().numpy(), weight.double().cpu().numpy(), 1e-6,
                              residual.double().cpu().numpy())
    assert relative_error(normed, want[0]) < tolerance and relative_error(total, want[1]) < tolerance
    gate_up = torch.randn(37, 2 * 3072, device="cuda").to(dtype)
    assert relative_error(paged_kernels.silu_and_mul(gate_up, backend="cupy"),
                          reference.silu_and_mul(gate_up.double().cpu().numpy())) < tolerance
