"""``python -m lab generate``: a prompt that looks like token ids is read as text by a model with a tokenizer, and
says so; ``--prompt-ids`` passes token ids with or without a tokenizer (issue 70, item 5)."""
import pytest

from lab.cli.main import main
from lab.models.qwen3 import save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny"))


def test_an_ids_look_alike_read_as_text_is_said(checkpoint, capsys):
    assert main(["generate", "--model", checkpoint, "--prompt", "1,2,3", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "--prompt '1,2,3' is read as text" in err and "--prompt-ids 1,2,3" in err


def test_plain_text_gets_no_note(checkpoint, capsys):
    assert main(["generate", "--model", checkpoint, "--prompt", "t1 t2 t3", "--max-tokens", "2"]) == 0
    assert "read as text" not in capsys.readouterr().err


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_prompt_ids_are_token_ids_with_or_without_a_tokenizer(checkpoint, capsys, with_tokenizer, tmp_path):
    model = checkpoint if with_tokenizer else "tiny"
    out = tmp_path / "m.csv"
    assert main(["generate", "--model", model, "--prompt-ids", "1,2,3", "--prompt-ids", "4, 5", "--max-tokens", "2",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "[0]" in captured.out and "[1]" in captured.out and "read as text" not in captured.err
    import pandas as pd

    assert pd.read_csv(out)["requests_finished"].iloc[0] == 2


@pytest.mark.parametrize("ids", ["1,x", "", "-1,2", ",,"])
def test_bad_prompt_ids_are_refused(ids, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse refuses the flag: one error line, no traceback
        main(["generate", f"--prompt-ids={ids}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --prompt-ids: expected comma-separated token ids" in err
    assert "Traceback" not in err


def test_prompt_ids_beside_random_prompt_options_are_refused(capsys):
    assert main(["generate", "--prompt-ids", "1,2", "--num-prompts", "3"]) == 2
    assert "--num-prompts would be ignored" in capsys.readouterr().err
