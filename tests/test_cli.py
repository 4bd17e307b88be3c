"""The command line answers bad input with one line on stderr (exit code 2), never a traceback."""
import pytest
import torch

from dare.cli import main
from tests.conftest import FIXTURES


def one_line_error(capsys, *argv):
    rc = main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys):
    line = one_line_error(capsys, "generate", "--model", "tiny:llada", "--prompt-ids", "1,2", "--device", "cuda")
    assert line.startswith("dare generate: error: --device cuda: CUDA is not available here") and "--device cpu" in line
    line = one_line_error(capsys, "eval", "--model", "tiny:llada", "--benchmarks", "sudoku", "--device", "cuda:1")
    assert "CUDA is not available here" in line
    assert "not a device name" in one_line_error(capsys, "generate", "--model", "tiny:llada", "--prompt-ids", "1",
                                                 "--device", "gpu0")


def test_token_ids_outside_the_vocabulary(capsys):
    line = one_line_error(capsys, "generate", "--model", str(FIXTURES / "llada-tiny"), "--mask-token-id", "500",
                          "--prompt-ids", "1,2,999999", "--device", "cpu", "--gen-length", "4", "--block-length", "4")
    assert line == "dare generate: error: prompt 0: token id(s) [999999] outside the model's vocabulary [0, 512)"


def test_a_prompt_longer_than_the_model_allows(capsys):
    ids = ",".join(["5"] * 1100)
    line = one_line_error(capsys, "generate", "--model", str(FIXTURES / "llada-tiny"), "--mask-token-id", "500",
                          "--prompt-ids", ids, "--device", "cpu", "--gen-length", "8", "--block-length", "8")
    assert line == ("dare generate: error: prompt 0 has 1100 tokens, but the model has 1024 positions and "
                    "--gen-length=8 leaves 1016 for the prompt")


def test_eval_limit_zero_is_not_a_score(capsys, tmp_path):
    line = one_line_error(capsys, "eval", "--model", "tiny:llada", "--benchmarks", "sudoku", "--limit", "0",
                          "--output-dir", str(tmp_path))
    assert line == "dare eval: error: EvalConfig: limit must be >= 1 (leave it unset for every example), got 0"
    assert not any(tmp_path.iterdir())


def test_long_messages_are_clipped(capsys):
    line = one_line_error(capsys, "train", "recipes/sft_tiny.yaml", "algorithm.name=" + "x" * 100_000)
    assert "unknown algorithm 'xxxx" in line and len(line) < 3000
