"""``dare generate`` on a fixture (token ids) and on a tiny model saved with the tiny tokenizer (text, chat)."""
import json

import pytest
import torch

from dare.cli import main
from dare.models import tiny, tiny_tokenizer
from dare.rollout import SamplerConfig, generate
from tests.conftest import FIXTURES
from tests.rollout.fixture_cases import load_cases


def _run(capsys, argv):
    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_prompt_ids_on_a_fixture_reproduce_the_reference(capsys):
    case = next(c for c in load_cases("llada-tiny") if c.raw["fn"] == "generate_with_dual_cache" and c.raw["threshold"])
    cfg = case.config
    rc, out, _ = _run(capsys, ["--model", str(FIXTURES / "llada-tiny"), "--mask-token-id", "500", "--json",
                               "--prompt-ids", ",".join(map(str, case.prompt)), "--gen-length", str(cfg.gen_length),
                               "--block-length", str(cfg.block_length), "--steps", str(cfg.steps), "--cache", "dual",
                               "--threshold", str(cfg.threshold), "--no-block-stop", "--device", "cpu"])
    assert rc == 0
    res = json.loads(out)
    assert res["completions"][0]["ids"] == case.expected[:res["completions"][0]["num_tokens"]]
    assert res["nfe"] == case.ref_nfe and res["tokens"] == res["completions"][0]["num_tokens"]
    assert res["tokens_per_second"] > 0 and res["config"]["cache"] == "dual"
    # plain output: one line per completion (ids without a tokenizer) and a summary line
    rc, out, _ = _run(capsys, ["--model", str(FIXTURES / "sdar-tiny"), "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "7,8",
                               "--gen-length", "8", "--block-length", "4", "--steps-per-block", "2", "--cache", "block",
                               "--device", "cpu"])
    lines = out.strip().splitlines()
    assert rc == 0 and len(lines) == 3 and lines[0].startswith("[prompt 0 sample 0] ") and lines[2].startswith("nfe=")


def test_text_prompts_with_chat_template(tmp_path, capsys):
    tok = tiny_tokenizer()
    model = tiny("dream", tokenizer=tok, seed=1)
    model.save_pretrained(tmp_path, tokenizer=tok)
    rc, out, _ = _run(capsys, ["--model", str(tmp_path), "--prompt", "2+2=", "--chat", "--json", "--gen-length", "12",
                               "--block-length", "12", "--steps", "6", "--remasking", "entropy", "--temperature", "0.5",
                               "--n", "2", "--seed", "3", "--device", "cpu"])
    assert rc == 0
    res = json.loads(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    cfg = SamplerConfig(gen_length=12, block_length=12, steps=6, remasking="entropy", temperature=0.5)
    ref = generate(model, [ids], cfg, n=2, generator=torch.Generator().manual_seed(3))
    texts = ref.texts(tok)
    assert [c["text"] for c in res["completions"]] == texts
    assert [c["sample"] for c in res["completions"]] == [0, 1]
    for c, row, m in zip(res["completions"], ref.completion_ids, ref.completion_mask):
        assert c["ids"] == row[m.bool()].tolist()


def test_errors_are_one_line(capsys):
    rc, _, err = _run(capsys, ["--model", str(FIXTURES / "llada-tiny"), "--mask-token-id", "500"])
    assert rc == 2 and "--prompt" in err
    rc, _, err = _run(capsys, ["--model", str(FIXTURES / "llada-tiny"), "--mask-token-id", "500", "--prompt-ids", "1,2",
                               "--gen-length", "30", "--block-length", "8", "--device", "cpu"])
    assert rc == 2 and "gen_length=30 must be a multiple of block_length=8" in err


def test_a_non_finite_float_flag_and_a_prompt_that_is_not_utf8_are_one_line(tmp_path, capsys):
    """``--temperature nan`` decoded garbage without a word; a prompt of bytes that are not UTF-8 (they reach Python as
    lone surrogates) ended in the tokenizer's traceback (issue 41, finding 6)."""
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--model", str(FIXTURES / "llada-tiny"), "--prompt-ids", "1,2", f"--temperature={value}"])
        assert e.value.code == 2 and f"expected a finite number, got '{value}'" in capsys.readouterr().err
    tok = tiny_tokenizer()
    tiny("llada", tokenizer=tok, seed=1).save_pretrained(tmp_path, tokenizer=tok)
    argv_bytes = b"2+2=\xff\xfe".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    rc, _, err = _run(capsys, ["--model", str(tmp_path), "--prompt", argv_bytes, "--device", "cpu"])
    line = "dare generate: error: --prompt is not valid UTF-8 text (byte(s) ff fe at character 4)"
    assert rc == 2 and err.strip().splitlines() == [line]
