"""Tokenizers from each family's published files, without remote code, plus a tiny character tokenizer.

Dream's tokenizer_config names a custom ``DreamTokenizer`` (remote code); it is the Qwen2 BPE, so it is
mapped to the stock ``Qwen2Tokenizer``. The mask token is resolved and exposed as ``tokenizer.mask_token``.
"""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Optional

from .loading import resolve_path

log = logging.getLogger(__name__)

# Custom tokenizer classes named by published checkpoints -> the stock transformers class they are.
STOCK_TOKENIZER_FOR = {
    "DreamTokenizer": "Qwen2Tokenizer",
    "DreamTokenizerFast": "Qwen2Tokenizer",
}
MASK_TOKEN_STRINGS = ("<|mask|>", "<|mdm_mask|>", "<|MASK|>", "<MASK>")


def _tokenizer_folder(path_or_id) -> Path:
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    return resolve_path(path_or_id)


def load_tokenizer(path_or_id, mask_token: Optional[str] = None):
    """Load a family's tokenizer from its published files (no ``trust_remote_code``)."""
    import transformers
    folder = _tokenizer_folder(path_or_id)
    # One line naming the folder or the file, not a sentencepiece hint or a JSON position without a file name.
    known = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")
    if folder.is_dir() and not any((folder / name).exists() for name in known):
        raise ValueError(f"{folder}: no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.json + merges.txt "
                         f"or tokenizer.model); point the tokenizer setting at the folder that holds them")
    cfg_file = folder / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.exists() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not a valid JSON file ({e})") from None

    def load():
        cls_name = STOCK_TOKENIZER_FOR.get(cfg.get("tokenizer_class", ""))
        if cls_name is None:
            # AutoTokenizer also parses config.json with the base config class, which warns that our model_type is
            # not one transformers knows (and, for published configs with ``rope_scaling``, that the key is
            # deprecated); the tokenizer depends on neither, so keep both warnings out of users' logs.
            verbosity = transformers.logging.get_verbosity()
            transformers.logging.set_verbosity_error()
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*rope_scaling.*deprecated", category=FutureWarning)
                    return transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
            except ValueError as e:  # a custom class we do not know: fall back on the files that are there
                if (folder / "tokenizer.json").exists():
                    cls_name = "PreTrainedTokenizerFast"
                elif (folder / "vocab.json").exists() and (folder / "merges.txt").exists():
                    cls_name = "Qwen2Tokenizer"
                else:
                    raise ValueError(f"cannot load the tokenizer in {folder} without remote code: {e}") from e
                log.warning("tokenizer class %r needs remote code; loading %s instead", cfg.get("tokenizer_class"),
                            cls_name)
            finally:
                transformers.logging.set_verbosity(verbosity)
        return getattr(transformers, cls_name).from_pretrained(str(folder))

    try:
        tok = load()
    except Exception:
        # Only now is tokenizer.json read as JSON to name it (a real one is ~10 MB: every load would pay the parse).
        path = folder / "tokenizer.json"
        try:
            if path.exists():
                json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a valid JSON file ({e})") from None
        raise
    if mask_token is not None:
        tok.add_special_tokens({"mask_token": mask_token})
    elif tok.mask_token is None:
        vocab = tok.get_vocab()
        for s in MASK_TOKEN_STRINGS:
            if s in vocab:
                tok.mask_token = s
                break
    return tok


# --- the tiny character tokenizer (tests and the CPU quickstart) --------------------------------------
TINY_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|mask|>", "<|startoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|eot|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] != 'assistant' or not loop.last %}<|eot|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 128):
    """A character-level tokenizer (specials + printable ASCII + newline), padded to ``vocab_size`` ids.

    Every digit and symbol is one token, which is what lets a tiny model learn Sudoku or Countdown on a CPU.
    Ids: eos (also pad, as in every published family) 1, mask 2, bos 3; id 0 is the unknown token.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + chars)}
    for i in range(len(vocab), vocab_size):
        vocab[f"<|reserved_{i}|>"] = i
    if len(vocab) > vocab_size:
        raise ValueError(f"tiny tokenizer needs at least {len(vocab)} ids, got vocab_size={vocab_size}")
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|endoftext|>", mask_token="<|mask|>",
        bos_token="<|startoftext|>", unk_token="<|pad|>", additional_special_tokens=TINY_SPECIALS[4:],
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok
