"""File hygiene: every file a user hands the lab is read by ``lab.user_files``. First the reader itself, then one case
per finding of the hostile probe (issue 70) on the real loaders: each raised a raw error or was taken silently
before, and is now refused with the file, the line and the field named."""
import json
import sqlite3

import pytest

from lab import user_files
from lab.errors import LabError
from lab.user_files import UserFileError

DEEP = 100_000


def refused(call, *words, error=LabError):
    """``call()`` raises ``error`` whose message holds every one of ``words`` and stays short."""
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert all(word in message for word in words), message
    assert len(message) < 600, message
    return message


# ---- the reader -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data, words", [
    (b"\xef\xbb\xbfa,b\n", ["f.csv", "byte-order mark"]),
    ("a,b\n".encode("utf-16"), ["f.csv", "UTF-16"]),
    ("a,b\n1,2\n".encode("utf-16-le"), ["f.csv", "line 1", "NUL", "UTF-16"]),
    ("a,b\n".encode("utf-32"), ["f.csv", "UTF-32"]),
    (b"a,b\n1,\xff\n", ["f.csv", "line 2", "0xff", "not valid UTF-8"]),
])
def test_decoding_is_strict_and_names_the_encoding(data, words):
    refused(lambda: user_files.decode(data, "f.csv"), *words, error=UserFileError)


def test_a_file_past_its_size_bound_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.json"
    path.write_text("[" + "0," * 100 + "0]")
    refused(lambda: user_files.read_json(path, max_bytes=100), "big.json", "203 bytes; at most 100")
    assert user_files.read_json(path) == [0] * 101
    refused(lambda: user_files.decode(b"x" * 101, "up.csv", max_bytes=100), "up.csv", "at most 100")


@pytest.mark.parametrize("text, words", [
    ('{"a": 1,\n "b": {"c": 1,\n  "c": 2}}', ["line 2", "'c'", "given twice"]),
    ('[{"a": 1}, {"a": 1, "a": 1}]', ["line 1", "'a'", "given twice"]),
    ('{"a": 1}\n' + "[" * DEEP + "]" * DEEP, ["line 2", "nested more than 64 deep"]),
    ('{"a":\n' + "9" * 400 + "}", ["line 2", "400 digits"]),
    ('{"a": -' + "1" * 41 + "}", ["41 digits"]),
    ('{"a": [1,\n 2', ["line 2", "not valid JSON"]),
])
def test_json_refuses_repeated_keys_deep_nesting_and_huge_integers(text, words):
    refused(lambda: user_files.loads_json(text, "f.json"), "f.json", *words, error=UserFileError)


def test_json_keeps_what_the_lab_writes():
    """Brackets inside strings are not nesting; 40-digit integers, long floats, NaN and inf (sweep rows) read."""
    text = json.dumps({"s": "[" * 1000, "i": 10**39, "f": 1.5e300, "n": float("nan"), "x": [[[1]]]})
    value = user_files.loads_json(text, "f.json")
    assert value["s"] == "[" * 1000 and value["i"] == 10**39 and value["x"] == [[[1]]]
    assert user_files.loads_json('{"a": 1}', "f.jsonl", line=7) == {"a": 1}
    refused(lambda: user_files.loads_json('{"a": ]', "f.jsonl", line=7), "f.jsonl: line 7", error=UserFileError)


@pytest.mark.parametrize("text, words", [
    ("a: [1]\nb: [2]\na: [3]\n", ["line 3", "'a'", "given twice"]),
    ("a:\n  b: 1\n  b: 2\n", ["line 3", "'b'", "given twice"]),
    ("a: &x [1, 2]\nb: [*x, *x]\n", ["line 2", "alias", "anchors and aliases"]),
    ("a: " + "[" * 20_000 + "]" * 20_000 + "\n", ["line 1", "nested more than 64 deep"]),
    ("- " * 70 + "1\n", ["nested more than 64 deep"]),
    ("a: " + "9" * 400 + "\n", ["line 1", "400 digits"]),
    ("a: 0x" + "f" * 60 + "\n", ["line 1", "digits"]),
    ("? [1]\n: 2\n", ["line 1", "a key that is a list or mapping"]),
    ("a: [1,\n", ["line 2", "not valid YAML"]),
])
def test_yaml_refuses_repeated_keys_aliases_deep_nesting_and_huge_integers(text, words):
    refused(lambda: user_files.loads_yaml(text, "g.yaml"), "g.yaml", *words, error=UserFileError)


def test_a_billion_laughs_is_refused_at_its_first_alias():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
    refused(lambda: user_files.loads_yaml(bomb, "g.yaml"), "g.yaml: line 2", "alias *a", error=UserFileError)


@pytest.mark.parametrize("text, words", [
    ("a,b, a \n1,2,3\n", ["line 1", "'a'", "more than once"]),
    ("a,b\n1,2\n3,4,5\n", ["line 3 has 3 fields", "header has 2", "extra field '5'"]),
    ("a,b\n1,2\n3\n", ["line 3 has 1 fields"]),
    ("a,b\n1,2\n\n3,4\n", ["line 3 is blank"]),
    ("a,b\n", ["no rows"]),
    ("", ["no header"]),
    ("a,b\n1,\"2\n", ["not a readable CSV"]),
])
def test_csv_refuses_repeated_columns_and_rows_of_another_width(text, words):
    refused(lambda: user_files.csv_frame(text, "k.csv"), "k.csv", *words, error=UserFileError)


def test_csv_rows_are_indexed_by_their_line_and_a_message_never_echoes_a_huge_field():
    frame = user_files.csv_frame("a,b\n1,2\n3,4\n\n", "k.csv")
    assert frame.index.tolist() == [2, 3] and frame["b"].tolist() == ["2", "4"]
    huge = "7" * 100_000
    message = refused(lambda: user_files.csv_frame(f"a,b\n1,2,{huge}\n", "k.csv"), "k.csv", "line 2",
                      error=UserFileError)
    assert huge[:61] not in message
    message = refused(lambda: user_files.numeric_column(user_files.csv_frame(f"a\n{huge}x\n", "k.csv"), "a", "k.csv"),
                      "line 2", "column a", error=UserFileError)
    assert huge[:61] not in message


def test_lines_split_on_newlines_only():
    text = '{"x": "a\u2028b\u0085c"}\r\n{"y": 1}'
    assert list(user_files.lines(text)) == [(1, '{"x": "a\u2028b\u0085c"}'), (2, '{"y": 1}')]


# ---- the findings, on the real loaders --------------------------------------------------------------------------
def _profile() -> dict:
    from lab.profiling.profile import PROFILE_VERSION, feature_names

    knots = [1, 4]
    return {"version": PROFILE_VERSION, "model": "tiny", "device": "cpu", "dtype": "torch.float32",
            "backend": "torch", "block_size": 4, "coefficients": {name: 1e-4 for name in feature_names(knots)},
            "decode_knots": knots, "samples": []}


def test_a_profile_giving_a_key_twice_or_a_huge_coefficient_or_deep_nesting_is_refused(tmp_path):
    from lab.profiling.profile import Profile, ProfileError

    path = tmp_path / "p.json"
    text = json.dumps(_profile(), indent=1)
    path.write_text(text)
    assert Profile.load(path).block_size == 4
    twice = text.replace('\n "decode_knots"', '\n "coefficients": {"constant": 1.0},\n "decode_knots"')
    path.write_text(twice)
    refused(lambda: Profile.load(path), "p.json", "'coefficients'", "given twice", error=ProfileError)
    path.write_text(text.replace('"constant": 0.0001', '"constant": ' + "9" * 400))
    refused(lambda: Profile.load(path), "p.json", "line ", "400 digits", error=ProfileError)
    path.write_text(text.replace('"samples": []', '"samples": ' + "[" * DEEP + "]" * DEEP))
    refused(lambda: Profile.load(path), "p.json", "nested more than 64 deep", error=ProfileError)
    refused(lambda: Profile.from_bytes(text.encode("utf-16"), "up.json"), "up.json", "UTF-16", error=ProfileError)


KERNELS = "kernel,batch,context,kv_gb_per_s,block_size\nsdpa-contiguous,8,1024,90,16\ntorch,8,1024,60,16\n"


@pytest.mark.parametrize("text, words", [
    ("kernel,batch,context,kv_gb_per_s,kv_gb_per_s\ntorch,8,1024,60,5\n", ["line 1", "'kv_gb_per_s'",
                                                                         "more than once"]),
    (KERNELS + "torch,8,1024,60,16,extra\n", ["line 4 has 6 fields", "extra field 'extra'"]),
    (KERNELS + "torch,8\n", ["line 4 has 2 fields"]),
    (KERNELS + "torch,eight,1024,60,16\n", ["line 4", "column batch", "'eight'"]),
    (KERNELS + "torch,8,1024.5,60,16\n", ["line 4", "column context", "whole number"]),
    (KERNELS + "torch,8,1024,60," + "9" * 400 + "\n", ["line 4", "column block_size"]),
    (KERNELS + "torch,8,1024,-1,16\n", ["line 4", "column kv_gb_per_s", "bandwidth"]),
    (KERNELS.replace("torch", "sdpa-contiguous"), ["no paged-kernel rows"]),
])
def test_a_kernel_csv_is_read_strictly(tmp_path, text, words):
    from simulator.core.models import CostModel, get_gpu, get_model

    path = tmp_path / "kernels.csv"
    path.write_text(text)
    cost = CostModel(get_model("qwen3-8b"), get_gpu("h100-80gb"))
    refused(lambda: cost.calibrate_from_kernel_csv(path), "kernels.csv", *words)


def test_a_valid_kernel_csv_calibrates_as_before(tmp_path):
    from simulator.core.models import CostModel, get_gpu, get_model

    path = tmp_path / "kernels.csv"
    path.write_text(KERNELS + "torch,1,512,1,16\n")
    assert CostModel(get_model("qwen3-8b"), get_gpu("h100-80gb")).calibrate_from_kernel_csv(path) == 60e9


def _checkpoint(tmp_path, text: str):
    (tmp_path / "config.json").write_text(text)
    return tmp_path


@pytest.mark.parametrize("text, words", [
    ('{"model_type": "qwen3",\n "vocab_size": 100,\n "vocab_size": 200}', ["line 1", "'vocab_size'", "given twice"]),
    (json.dumps({"model_type": "qwen3", "num_hidden_layers": 1_000_000}), ["num_hidden_layers=1000000",
                                                                           "[1, 1024]"]),
    (json.dumps({"model_type": "qwen3", "hidden_size": "x" * 500}), ["hidden_size=", "characters"]),
    (json.dumps({"model_type": "qwen3", "num_hidden_layers": 1024, "hidden_size": 65536,
                 "intermediate_size": 262144}), ["weights", "at most"]),
    ('{"model_type": "qwen3", "rope_scaling": ' + "[" * DEEP + "]" * DEEP + "}", ["nested more than 64 deep"]),
    ('{"model_type": "qwen3", "vocab_size": ' + "1" * 400 + "}", ["400 digits"]),
])
def test_a_checkpoint_config_is_read_strictly_and_its_sizes_are_bounded(tmp_path, text, words):
    from lab.models.qwen3 import CheckpointError, checkpoint_vocab_size, read_config

    folder = _checkpoint(tmp_path, text)
    refused(lambda: read_config(folder), "config.json", *words, error=CheckpointError)
    refused(lambda: checkpoint_vocab_size(folder), "config.json", error=CheckpointError)


def test_a_valid_checkpoint_config_reads(tmp_path):
    from lab.models.qwen3 import checkpoint_vocab_size, read_config

    folder = _checkpoint(tmp_path, json.dumps({"model_type": "qwen3", "vocab_size": 1024, "head_dim": None,
                                               "num_hidden_layers": 94, "hidden_size": 4096}))
    assert read_config(folder)["num_hidden_layers"] == 94 and checkpoint_vocab_size(folder) == 1024


MOONCAKE = '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'


@pytest.mark.parametrize("line, words", [
    ('{"timestamp": ' + "9" * 400 + ', "input_length": 10, "output_length": 5}', ["line 2", "400 digits"]),
    ('{"timestamp": 1, "input_length": 10, "output_length": ' + "9" * 400 + "}", ["line 2", "400 digits"]),
    ('{"timestamp": 1, "input_length": ' + "9" * 400 + ', "output_length": 5}', ["line 2", "400 digits"]),
    ('{"timestamp": 1, "input_length": 10, "output_length": 5, "x": ' + "[" * DEEP + "]" * DEEP + "}",
     ["line 2", "nested more than 64 deep"]),
])
def test_a_mooncake_trace_refuses_huge_integers_and_deep_nesting(tmp_path, line, words):
    from simulator.core.workloads import TraceFormatError, load_trace

    path = tmp_path / "t.jsonl"
    path.write_text(MOONCAKE + line + "\n")
    refused(lambda: load_trace(path), "t.jsonl", *words, error=TraceFormatError)


def test_a_mooncake_record_holding_a_line_separator_in_a_string_reads(tmp_path):
    from simulator.core.workloads import load_trace

    path = tmp_path / "t.jsonl"
    path.write_text(MOONCAKE + '{"timestamp": 5, "input_length": 7, "output_length": 3, "note": "a\u2028b\u0085"}\n'
                    + MOONCAKE.replace('"timestamp": 0', '"timestamp": 9'), encoding="utf-8")
    workload = load_trace(path)
    assert workload.prompt_tokens.tolist() == [10, 7, 10] and workload.arrival_s.tolist() == [0.0, 0.005, 0.009]


@pytest.mark.parametrize("first, second", [("1900", "2200"), ("2200", "1900"), ("2023", "2200")])
def test_azure_timestamps_centuries_apart_are_named(tmp_path, first, second):
    from simulator.core.workloads import TraceFormatError, load_trace

    path = tmp_path / "azure.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{first}-11-16 18:15:46.6805900,10,5\n"
                    f"{second}-11-16 18:15:46.6805900,10,5\n")
    refused(lambda: load_trace(path), "azure.csv", "row 3, column TIMESTAMP", "years", error=TraceFormatError)


def _grid(tmp_path, text, encoding="utf-8"):
    path = tmp_path / "grid.yaml"
    path.write_text(text, encoding=encoding)
    return path


@pytest.mark.parametrize("text, encoding, words", [
    ("workload: [fixed]\nblock_size: [16]\n", "utf-16", ["UTF-16"]),
    ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nblock_size: [16]\n", "utf-8",
     ["line 2", "alias"]),
    ("block_size: " + "[" * 20_000 + "]" * 20_000 + "\n", "utf-8", ["line 1", "nested more than 64 deep"]),
    ("block_size: [16]\nseed: [" + "9" * 400 + "]\n", "utf-8", ["line 2", "400 digits"]),
    ("workload: [fixed]\nkernel_csv: [/no/such/kernels.csv]\n", "utf-8", ["kernel_csv", "/no/such/kernels.csv",
                                                                          "cannot read"]),
    ("workload: [fixed]\ncapacity_tokens: [4096]\nprofile: [/no/such/profile.json]\n", "utf-8",
     ["profile", "cannot read"]),
])
def test_a_grid_is_read_strictly_and_the_files_it_names_when_it_is_read(tmp_path, text, encoding, words):
    from simulator.experiments.sweep import GridError, load_grid

    refused(lambda: load_grid(_grid(tmp_path, text, encoding)), "grid.yaml", *words, error=GridError)


def test_a_grid_s_malformed_kernel_csv_is_named_when_the_grid_is_read(tmp_path):
    from simulator.experiments.sweep import GridError, load_grid

    kernels = tmp_path / "k.csv"
    kernels.write_text(KERNELS + "torch,eight,1024,60,16\n")
    grid = _grid(tmp_path, f"workload: [fixed]\nkernel_csv: [{kernels}]\n")
    refused(lambda: load_grid(grid), "grid.yaml", "k.csv", "line 4", "column batch", error=GridError)
    kernels.write_text(KERNELS)
    assert load_grid(grid)["kernel_csv"] == [str(kernels)]


@pytest.mark.parametrize("row", ["[1, 2]", '{"run_key": "k"}', '{"error": 5}', "{not json", '"text"',
                                 '{"error": "", "error": "x"}'])
def test_a_sweep_store_row_that_is_not_a_run_is_refused_when_the_store_opens(tmp_path, row):
    from simulator.experiments.sweep import ResultStore, StoreError

    path = tmp_path / "store.sqlite"
    ResultStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO runs VALUES (?, ?)", ("k", row))
    refused(lambda: ResultStore(path), "store.sqlite", "not a readable results store", "run 'k'", error=StoreError)


def test_an_exported_table_is_read_strictly(tmp_path):
    from lab.report.results import ResultStore as Results
    from simulator.experiments.sweep import read_table

    refused(lambda: read_table(b"run_key,a,a\nk,1,2\n", "t.csv"), "t.csv", "'a'", "more than once")
    refused(lambda: read_table(b"run_key,a\nk,1,2\n", "t.csv"), "t.csv", "line 2 has 3 fields")
    assert read_table(b"run_key,a\nk,1\n", "t.csv")["a"].tolist() == [1]
    refused(lambda: Results().load_csv("a,b\n1,2\n".encode("utf-16"), "up.csv"), "up.csv", "UTF-16")
