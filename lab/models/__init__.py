"""The models the runtime serves: Qwen3 presets with random weights and local checkpoints, checked before they load.

May import: ``lab`` (errors, checks)."""
