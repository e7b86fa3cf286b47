"""Argument checks shared by every backend: each error names the offending argument."""
from __future__ import annotations

import functools

import numpy as np


class KernelArgumentError(ValueError):
    """An argument of a ``paged_kernels`` call is wrong (the message names it); nothing was written."""


class BackendUnavailableError(KernelArgumentError, RuntimeError):
    """The requested backend cannot run on this machine (no GPU, no CuPy)."""


def shape_of(x) -> tuple[int, ...]:
    return tuple(x.shape)  # a torch.Size or a NumPy shape: ints either way


def check_rank(name: str, x, rank: int) -> tuple[int, ...]:
    """``x``'s shape, after checking it is an array of that rank."""
    check_array(name, x)
    shape = shape_of(x)
    if len(shape) != rank:
        raise KernelArgumentError(f"{name} must have rank {rank}, got shape {shape}")
    return shape


def check_array(name: str, x) -> None:
    """A torch tensor or a NumPy array."""
    if not (_is_numpy(x) or type(x).__module__.startswith("torch") and hasattr(x, "detach")):
        raise KernelArgumentError(f"{name} must be a torch tensor or a NumPy array, got {type(x).__name__} {x!r:.60}")


MAX_SCALE = 1e6  # softmax(scale * q.k): far past any head_dim ** -0.5


def check_scale(scale) -> float:
    """The softmax scale as a float: a finite number > 0."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) or \
            not 0 < float(scale) <= MAX_SCALE:
        raise KernelArgumentError(f"scale must be a number in (0, {MAX_SCALE:g}], got {scale!r:.60}")
    return float(scale)


FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_float(name: str, x) -> None:
    """``x`` holds real floating-point numbers (``FLOAT_DTYPES``): integer, bool or complex data would be computed
    on as something it is not (truncated, or its imaginary part dropped)."""
    dtype = str(x.dtype).replace("torch.", "")
    if dtype not in FLOAT_DTYPES:
        raise KernelArgumentError(f"{name} must hold floating-point numbers ({', '.join(FLOAT_DTYPES)}), got dtype "
                                  f"{dtype}")


def check_cache_pair(key_cache, value_cache, kv_cache_dtype: str | None = "auto") -> tuple[int, int, int, int]:
    """Return ``(num_blocks, num_kv_heads, block_size, head_dim)`` after checking both caches agree and hold
    floating-point numbers (``kv_cache_dtype`` ``auto``) or FP8 bytes (``uint8``, an FP8 ``kv_cache_dtype``); None:
    either (block copies move bytes whatever they mean)."""
    shape, value_shape = check_rank("key_cache", key_cache, 4), check_rank("value_cache", value_cache, 4)
    stores_bytes = str(key_cache.dtype).replace("torch.", "") == "uint8"
    if kv_cache_dtype is None and not stores_bytes or kv_cache_dtype == "auto":
        check_float("key_cache", key_cache)
    elif not stores_bytes:
        raise KernelArgumentError(f"key_cache must hold FP8 bytes (uint8) for kv_cache_dtype={kv_cache_dtype!r}, "
                                  f"got dtype {str(key_cache.dtype).replace('torch.', '')}")
    if shape != value_shape:
        raise KernelArgumentError(f"value_cache shape {value_shape} differs from key_cache {shape}")
    if min(shape) < 1:
        raise KernelArgumentError(f"key_cache shape {shape}: num_blocks, num_kv_heads, block_size and head_dim must all be >= 1")
    check_same_kind("value_cache", value_cache, "key_cache", key_cache)
    return shape


def check_same_kind(name: str, x, ref_name: str, ref) -> None:
    """Same dtype and same device (torch) or both NumPy."""
    if _is_numpy(x) != _is_numpy(ref):  # a torch Parameter is a tensor like any other
        raise KernelArgumentError(f"{name} is a {type(x).__name__} but {ref_name} is a {type(ref).__name__}")
    if x.dtype != ref.dtype:
        raise KernelArgumentError(f"{name} has dtype {x.dtype} but {ref_name} has dtype {ref.dtype}")
    if getattr(x, "device", None) != getattr(ref, "device", None):
        raise KernelArgumentError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def check_against_cache(name: str, x, key_cache, kv_cache_dtype: str) -> None:
    """``x`` (K/V, a query, a weight) goes with ``key_cache``: the same dtype when the cache stores the model's
    dtype (``auto``); floating-point, on the same device, when it stores FP8 bytes."""
    if kv_cache_dtype == "auto":
        return check_same_kind(name, x, "key_cache", key_cache)
    check_float(name, x)
    if _is_numpy(x) != _is_numpy(key_cache):
        raise KernelArgumentError(f"{name} is a {type(x).__name__} but key_cache is a {type(key_cache).__name__}")
    if getattr(x, "device", None) != getattr(key_cache, "device", None):
        raise KernelArgumentError(f"{name} is on {x.device} but key_cache is on {key_cache.device}")


def check_integer(name: str, x) -> None:
    if _dtype_kind(x.dtype) not in "iu":
        raise KernelArgumentError(f"{name} must hold integers, got dtype {x.dtype}")


@functools.lru_cache(maxsize=None)
def _dtype_kind(dtype) -> str:
    """NumPy's kind letter of a NumPy or torch dtype (``?`` for a torch dtype NumPy lacks: bfloat16, float8)."""
    try:
        return np.dtype(str(dtype).replace("torch.", "")).kind
    except TypeError:
        return "?"


def check_write_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype: str = "auto") -> None:
    """Shapes, then the slots' values: in range and, where non-negative, distinct (a slot written twice in one call
    has no defined winner on a GPU)."""
    num_blocks, _, block_size, _ = check_write_shapes(key, value, key_cache, value_cache, slot_mapping,
                                                      kv_cache_dtype)
    slots = to_numpy(slot_mapping)
    if slots.size and slots.max() >= num_blocks * block_size:
        raise KernelArgumentError(f"slot_mapping holds slot {int(slots.max())} beyond the cache's "
                         f"{num_blocks * block_size} slots")
    used = slots[slots >= 0]
    if np.unique(used).size != used.size:
        values, counts = np.unique(used, return_counts=True)
        raise KernelArgumentError(f"slot_mapping names slot {int(values[counts > 1][0])} more than once; non-negative slots "
                         f"must be distinct")


def check_write_shapes(key, value, key_cache, value_cache, slot_mapping,
                       kv_cache_dtype: str = "auto") -> tuple[int, int, int, int]:
    """Everything about a cache write that needs no look at the data (no device sync); returns the cache shape."""
    num_blocks, num_kv_heads, block_size, head_dim = check_cache_pair(key_cache, value_cache, kv_cache_dtype)
    key_shape, value_shape = check_rank("key", key, 3), check_rank("value", value, 3)
    if key_shape != value_shape:
        raise KernelArgumentError(f"value shape {value_shape} differs from key shape {key_shape}")
    if key_shape[1:] != (num_kv_heads, head_dim):
        raise KernelArgumentError(f"key must be [num_tokens, {num_kv_heads}, {head_dim}] to match key_cache, got {key_shape}")
    check_against_cache("key", key, key_cache, kv_cache_dtype)
    check_against_cache("value", value, key_cache, kv_cache_dtype)
    check_same_kind("value", value, "key", key)
    num_slots = check_rank("slot_mapping", slot_mapping, 1)[0]
    check_integer("slot_mapping", slot_mapping)
    if num_slots != key_shape[0]:
        raise KernelArgumentError(f"slot_mapping has {num_slots} entries for {key_shape[0]} tokens")
    check_same_device("slot_mapping", slot_mapping, key_cache)
    return num_blocks, num_kv_heads, block_size, head_dim


def check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, kv_cache_dtype: str = "auto") -> None:
    """Shapes, then the values: every block a sequence reads exists."""
    num_blocks, _, block_size, _ = check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens,
                                                          kv_cache_dtype)
    check_used_blocks(to_numpy(block_tables), to_numpy(seq_lens), block_size, num_blocks)


def check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens,
                           kv_cache_dtype: str = "auto") -> tuple[int, int, int, int]:
    """Everything about a decode call that needs no look at the data (no device sync); returns the cache shape."""
    num_blocks, num_kv_heads, block_size, head_dim = check_cache_pair(key_cache, value_cache, kv_cache_dtype)
    num_seqs, num_q_heads, q_head_dim = check_rank("query", query, 3)
    if q_head_dim != head_dim:
        raise KernelArgumentError(f"query head_dim {q_head_dim} differs from key_cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise KernelArgumentError(f"query's {num_q_heads} heads are not divisible by key_cache's {num_kv_heads} kv heads")
    check_against_cache("query", query, key_cache, kv_cache_dtype)
    table_rows = check_rank("block_tables", block_tables, 2)[0]
    check_integer("block_tables", block_tables)
    num_lens = check_rank("seq_lens", seq_lens, 1)[0]
    check_integer("seq_lens", seq_lens)
    if table_rows != num_seqs or num_lens != num_seqs:
        raise KernelArgumentError(f"block_tables rows ({table_rows}) and seq_lens entries ({num_lens}) must equal query's "
                         f"{num_seqs} sequences")
    check_same_device("block_tables", block_tables, key_cache)
    check_same_device("seq_lens", seq_lens, key_cache)
    return num_blocks, num_kv_heads, block_size, head_dim


def check_max_seq_len(max_seq_len, seq_lens=None) -> None:
    """``max_seq_len`` is None or an int >= 0; with ``seq_lens`` (a look at the data) it must equal their maximum (0
    for none)."""
    if max_seq_len is None:
        return
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) or max_seq_len < 0:
        raise KernelArgumentError(f"max_seq_len must be None or an integer >= 0, got {max_seq_len!r}")
    if seq_lens is not None:
        lens = to_numpy(seq_lens)
        longest = int(lens.max()) if lens.size else 0
        if max_seq_len != longest:
            raise KernelArgumentError(f"max_seq_len={max_seq_len} but the longest of seq_lens is {longest}")


def check_out(out, query) -> None:
    """``out`` must match ``query`` in shape, dtype and device."""
    if shape_of(out) != shape_of(query):
        raise KernelArgumentError(f"out has shape {shape_of(out)}, query {shape_of(query)}")
    check_same_kind("out", out, "query", query)


def check_used_blocks(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int, num_blocks: int) -> None:
    """seq_lens must be >= 0 (0 gives a row of zeros) and fit their rows, and every block a sequence reads must
    exist; entries past a sequence's blocks are padding and may hold anything (-1 by convention)."""
    if seq_lens.size and seq_lens.min() < 0:
        raise KernelArgumentError(f"seq_lens must be >= 0, got {int(seq_lens.min())}")
    used = -(-seq_lens.astype(np.int64) // block_size)
    if used.size and used.max() > block_tables.shape[1]:
        row = int(used.argmax())
        raise KernelArgumentError(f"seq_lens[{row}]={int(seq_lens[row])} needs {int(used[row])} blocks but block_tables "
                         f"has {block_tables.shape[1]} columns")
    mask = np.arange(block_tables.shape[1])[None, :] < used[:, None]
    bad = mask & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        row, col = map(int, np.argwhere(bad)[0])
        raise KernelArgumentError(f"block_tables[{row}, {col}]={int(block_tables[row, col])} is outside the cache's "
                         f"{num_blocks} blocks")


def as_block_pairs(block_mapping) -> np.ndarray:
    """``(src, dst)`` integer pairs (a list, an array or a tensor) as int64 NumPy ``[n, 2]``."""
    raw = to_numpy(block_mapping, "block_mapping")
    if raw.size == 0:
        return np.zeros((0, 2), np.int64)
    if raw.dtype.kind not in "iu" or raw.ndim > 2 or raw.shape[-1] != 2 or (raw.ndim == 1 and raw.size != 2):
        raise KernelArgumentError(f"block_mapping must be (src, dst) integer pairs, got dtype {raw.dtype} shape {raw.shape}")
    return raw.astype(np.int64).reshape(-1, 2)


def check_block_mapping(block_mapping, num_blocks: int) -> np.ndarray:
    """Return the ``[n, 2]`` (src, dst) mapping as int64 NumPy after checking its shape and block ids. Pairs take
    effect in order (a pair may read what an earlier one wrote), in every backend."""
    mapping = as_block_pairs(block_mapping)
    if mapping.size and (mapping.min() < 0 or mapping.max() >= num_blocks):
        raise KernelArgumentError(f"block_mapping refers to a block outside the cache's {num_blocks} blocks")
    return mapping


def check_swap_args(src_key_cache, src_value_cache, dst_key_cache, dst_value_cache, block_mapping) -> np.ndarray:
    """Both cache pairs agree in block shape and dtype; the ``(src, dst)`` pairs are in range and the destinations
    distinct. Returns the mapping as int64 NumPy ``[n, 2]``."""
    src_shape = check_cache_pair(src_key_cache, src_value_cache, None)
    dst_shape = check_cache_pair(dst_key_cache, dst_value_cache, None)
    if src_shape[1:] != dst_shape[1:]:
        raise KernelArgumentError(f"source blocks {src_shape[1:]} and destination blocks {dst_shape[1:]} differ in shape")
    if src_key_cache.dtype != dst_key_cache.dtype:
        raise KernelArgumentError(f"source dtype {src_key_cache.dtype} differs from destination dtype {dst_key_cache.dtype}")
    mapping = as_block_pairs(block_mapping)
    if not mapping.size:
        return mapping
    for column, name, count in ((0, "source", src_shape[0]), (1, "destination", dst_shape[0])):
        values = mapping[:, column]
        if values.min() < 0 or values.max() >= count:
            raise KernelArgumentError(f"block_mapping refers to a {name} block outside the {count} blocks there")
    if np.unique(mapping[:, 1]).size != len(mapping):
        raise KernelArgumentError("block_mapping names a destination block twice")
    return mapping


def is_cuda(tensor) -> bool:
    """Whether ``tensor`` (a torch tensor or a NumPy array) lives on a GPU. The backends import it by name, so a
    test can stand in for a GPU by patching a backend's ``is_cuda``."""
    return bool(getattr(tensor, "is_cuda", False))


def check_same_device(name: str, x, ref) -> None:
    """Index tensors may live on the CPU for a CUDA cache (they are moved), but not on another GPU."""
    if _is_numpy(ref) or _is_numpy(x) or not x.is_cuda:
        return
    if x.device != ref.device:
        raise KernelArgumentError(f"{name} is on {x.device} but key_cache is on {ref.device}")


def index_like(x, cache):
    """An index array (slot mapping, block tables, lengths) of the cache's kind: a NumPy one becomes a CPU tensor
    for a torch cache (the backend moves it), a tensor becomes NumPy for a NumPy cache."""
    if _is_numpy(x) and not _is_numpy(cache):
        import torch

        return torch.from_numpy(np.ascontiguousarray(x))
    if not _is_numpy(x) and _is_numpy(cache):
        return to_numpy(x)
    return x


def to_numpy(x, name: str = "argument") -> np.ndarray:
    if _is_numpy(x):
        return x
    if isinstance(x, (list, tuple)):
        try:
            return np.asarray(x)
        except (ValueError, TypeError, OverflowError):
            raise KernelArgumentError(f"{name} must be a rectangular list of integers, got {x!r:.60}") from None
    check_array(name, x)
    return x.detach().cpu().numpy()


def to_numpy_float(x) -> np.ndarray:
    """float64 NumPy copy of an array or tensor of any float dtype and device."""
    if _is_numpy(x):
        return x.astype(np.float64)
    return x.detach().double().cpu().numpy()


def _is_numpy(x) -> bool:
    return isinstance(x, np.ndarray)


def check_eps(eps) -> float:
    """A norm's epsilon: a finite number in [0, 1]."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) or not 0 <= float(eps) <= 1:
        raise KernelArgumentError(f"eps must be a number in [0, 1], got {eps!r:.60}")
    return float(eps)


def check_rms_norm_args(x, weight, residual) -> None:
    """``x [..., hidden]``, ``weight [hidden]``, ``residual`` like ``x``."""
    check_array("x", x)
    check_float("x", x)
    shape = shape_of(x)
    if not shape or shape[-1] < 1:
        raise KernelArgumentError(f"x must have a last axis of at least 1 element, got shape {shape}")
    if check_rank("weight", weight, 1) != shape[-1:]:
        raise KernelArgumentError(f"weight must be [{shape[-1]}] to match x's last axis, got {shape_of(weight)}")
    check_same_kind("weight", weight, "x", x)
    if residual is not None:
        check_array("residual", residual)
        if shape_of(residual) != shape:
            raise KernelArgumentError(f"residual shape {shape_of(residual)} differs from x {shape}")
        check_same_kind("residual", residual, "x", x)


def check_silu_and_mul_args(x) -> None:
    """``x [..., 2 * d]``."""
    check_array("x", x)
    check_float("x", x)
    shape = shape_of(x)
    if not shape or shape[-1] % 2 or shape[-1] < 2:
        raise KernelArgumentError(f"x must be [..., 2 * d] (gate, then up), got shape {shape}")


def check_qk_norm_rope_write_args(q, k, v, q_weight, k_weight, cos_sin_cache, positions, key_cache, value_cache,
                                  slot_mapping, kv_cache_dtype: str = "auto") -> None:
    """Shapes, dtypes and devices (no look at the data): ``q [T, Hq, D]``, ``k``/``v [T, Hk, D]`` as the caches,
    weights ``[D]``, ``cos_sin_cache [P, 2 D]``, ``positions [T]``, ``slot_mapping [T]``; ``D`` even."""
    num_tokens, num_q_heads, head_dim = check_rank("q", q, 3)
    check_float("q", q)
    check_write_shapes(k, v, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    if shape_of(k)[0] != num_tokens or shape_of(k)[2] != head_dim:
        raise KernelArgumentError(f"k shape {shape_of(k)} does not match q {shape_of(q)} (tokens and head_dim)")
    if head_dim % 2:
        raise KernelArgumentError(f"rotary needs an even head_dim, got {head_dim}")
    if num_q_heads % shape_of(k)[1]:
        raise KernelArgumentError(f"q's {num_q_heads} heads are not a multiple of k's {shape_of(k)[1]}")
    check_same_kind("q", q, "k", k)
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if check_rank(name, weight, 1) != (head_dim,):
            raise KernelArgumentError(f"{name} must be [{head_dim}], got {shape_of(weight)}")
        check_same_kind(name, weight, "k", k)
    table = check_rank("cos_sin_cache", cos_sin_cache, 2)
    if table[1] != 2 * head_dim:
        raise KernelArgumentError(f"cos_sin_cache must be [max_position, {2 * head_dim}] (cos, then sin), got {table}")
    check_same_kind("cos_sin_cache", cos_sin_cache, "k", k)
    if check_rank("positions", positions, 1)[0] != num_tokens:
        raise KernelArgumentError(f"positions has {shape_of(positions)[0]} entries for {num_tokens} tokens")
    check_integer("positions", positions)
    check_same_device("positions", positions, key_cache)


def check_positions(positions, max_position: int) -> None:
    """Every position has a row in the rotary table (reads the data: ``check=True`` only)."""
    values = to_numpy(positions)
    if values.size and (values.min() < 0 or values.max() >= max_position):
        raise KernelArgumentError(f"positions must be in [0, {max_position}) (the rotary table's rows), got "
                         f"{int(values.min())}..{int(values.max())}")
