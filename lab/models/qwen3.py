"""Qwen3 models: presets with random weights, local checkpoints (weights, config, tokenizer) checked before they
load. ``lab.worker.model_runner`` runs them over the paged KV cache."""
from __future__ import annotations

from pathlib import Path

import torch

from lab import user_files
from lab.checks import check_int
from lab.errors import InputError, LabError

PRESETS = {
    # name: (layers, hidden, q heads, kv heads, head_dim, intermediate, vocab, tied)
    "tiny": (4, 128, 4, 2, 32, 256, 1024, True),
    "tiny-hd64": (2, 256, 4, 2, 64, 512, 1024, True),  # the smallest shape the CuPy attention kernel takes
    "qwen3-0.6b-random": (28, 1024, 16, 8, 128, 3072, 151936, True),
    "qwen3-0.6b-random-4l": (4, 1024, 16, 8, 128, 3072, 151936, True),  # its shapes, 4 of 28 layers (CPU benches)
    "qwen3-1.7b-random": (28, 2048, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b-random": (36, 2560, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b-random": (36, 4096, 32, 8, 128, 12288, 151936, False),
}


class CheckpointError(LabError):
    """A local checkpoint is missing, incomplete or not a Qwen3 model."""


# The sizes a checkpoint's config.json may give (the largest Qwen3 has 94 layers, hidden size 4096 and a 151,936
# token vocabulary): past these a config is junk, and building its model would exhaust memory before failing.
CONFIG_BOUNDS = {"num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 262144,
                 "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096, "vocab_size": 2**22,
                 "max_position_embeddings": 2**24}
MAX_CONFIG_PARAMETERS = 10**12  # a trillion weights: four times the largest Qwen3


def preset_config(name: str):
    """A ``Qwen3Config`` for a preset name."""
    from transformers import Qwen3Config

    if name not in PRESETS:
        raise InputError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} (or a local directory)")
    layers, hidden, heads, kv_heads, head_dim, inter, vocab, tied = PRESETS[name]
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=40960, rope_theta=1e6, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 1e6},
                       tie_word_embeddings=tied, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                       initializer_range=0.02 if not name.startswith("tiny") else 0.25)


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """``(hf_model, tokenizer_or_None)`` from a preset name (random weights, seeded) or a local checkpoint directory.
    Nothing is downloaded."""
    from transformers import Qwen3ForCausalLM

    if model in PRESETS:
        torch.manual_seed(seed)
        with torch.device(device):
            hf = Qwen3ForCausalLM(preset_config(model)).to(dtype)
        return hf.eval(), None
    path = check_model(model)
    try:
        hf = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
    except Exception as exc:  # corrupt or truncated weights surface as many library-specific types
        raise CheckpointError(f"{path}: the weights could not be loaded ({type(exc).__name__}: {exc})") from exc
    try:
        tokenizer = _load_tokenizer(path)
    except Exception as exc:
        raise CheckpointError(f"{path}: the tokenizer could not be loaded ({type(exc).__name__}: {exc})") from exc
    return hf.eval(), tokenizer


def checkpoint_vocab_size(checkpoint: str | Path) -> int:
    """The vocabulary size of a checkpoint directory (its ``config.json``): the range a separate process's random
    prompts are drawn from."""
    return int(read_config(Path(checkpoint)).get("vocab_size", 151936))  # Qwen3Config's default


def checkpoint_dir(model: str, folder: str | Path, dtype: torch.dtype = torch.float32) -> str:
    """``model`` when it is a checkpoint directory, else the preset of that name saved into ``folder``
    (``save_checkpoint``; once: a folder that already holds it is reused): what a separate process such as the vLLM
    peer loads."""
    if Path(model).is_dir():
        return str(model)
    if model not in PRESETS:
        raise InputError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
    saved = Path(folder) / f"{model}-{str(dtype).removeprefix('torch.')}"
    if (saved / "tokenizer.json").exists():  # written last: the weights before it are complete
        return str(saved)
    return str(save_checkpoint(model, saved, dtype))


def save_checkpoint(preset: str, out: str | Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Save a preset (random weights, seeded as ``load_hf_model`` seeds them) as a Hugging Face checkpoint
    directory that our engine, HF transformers and vLLM all load: ``config.json``, safetensors weights in ``dtype``
    and a word-level tokenizer built here (``tokenizers``; nothing downloaded) whose token ``tN`` is id ``N``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    hf, _ = load_hf_model(preset, dtype, torch.device("cpu"), seed)
    vocab = hf.config.vocab_size
    hf.config.architectures = ["Qwen3ForCausalLM"]
    hf.save_pretrained(out, safe_serialization=True)
    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="t0",
                            model_max_length=hf.config.max_position_embeddings).save_pretrained(out)
    return out


def read_config(path: Path) -> dict:
    """A checkpoint directory's ``config.json``, read by ``lab.user_files`` and checked: a Qwen3 config whose sizes
    are integers within ``CONFIG_BOUNDS`` (those it gives; Hugging Face fills in the rest)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face Qwen3 checkpoint directory)")
    config = user_files.read_json(config_file, CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    if config.get("model_type") != "qwen3":
        raise CheckpointError(f"{config_file}: model_type is {user_files.shown(config.get('model_type'))}, expected "
                              f"'qwen3'")
    for name, high in CONFIG_BOUNDS.items():
        check_int(str(config_file), name, config.get(name), 1, high, optional=True, error=CheckpointError)
    sizes = {name: config.get(name) or 1 for name in CONFIG_BOUNDS}
    parameters = sizes["num_hidden_layers"] * sizes["hidden_size"] * (4 * sizes["hidden_size"] +
                                                                       3 * sizes["intermediate_size"]) \
        + sizes["vocab_size"] * sizes["hidden_size"]
    if parameters > MAX_CONFIG_PARAMETERS:
        raise CheckpointError(f"{config_file}: its sizes make about {parameters:.2g} weights; at most "
                              f"{MAX_CONFIG_PARAMETERS:.0e} are loaded")
    return config


def check_model(model: str) -> Path | None:
    """What can be told of ``model`` without loading it: None for a preset; for a local checkpoint directory, its
    path once its ``config.json`` reads as an object and its weights are there (each safetensors file's header
    parses). Raises ``CheckpointError`` naming the problem otherwise, in milliseconds, before a run starts."""
    if model in PRESETS:
        return None
    path = Path(model)
    if not path.is_dir():
        raise CheckpointError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory")
    read_config(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards and not list(path.glob("*.bin")):
        raise CheckpointError(f"{path}: no weights (*.safetensors or *.bin)")
    from safetensors import safe_open

    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as weights:
                weights.keys()
        except Exception as exc:  # the library's own error types differ by version
            raise CheckpointError(f"{shard}: the weights could not be loaded ({type(exc).__name__}: {exc})") from exc
    return path


def _load_tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def head_dim_of(config) -> int:
    """A Qwen3 config's attention head size (``head_dim``, else hidden size / query heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
