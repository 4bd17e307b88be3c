"""The family spec and its registry.

A family file declares what the family is: a ``FamilySpec`` subclass that recognises its published ``config.json``,
reads it into a ``ModelArch`` + ``FamilyAdapter``, names its tensors (published <-> native), its tiny config and which
builder makes its model (``builder``: dare's native ``DiffusionLM``, or a model transformers maintains). The specs
know nothing of modules or weights: ``dare.models.builder`` builds and loads them, so the families import no model
code and the model code imports no family. Adding a family = one module in this package that subclasses
``FamilySpec`` and calls ``register_family``; every module of the package is imported on first use
(``dare.models.families.load_builtin_families``).
"""
from __future__ import annotations

import re
from typing import Optional

from ..adapter import FamilyAdapter
from ..arch import ArchError, ModelArch

FAMILIES: dict[str, "FamilySpec"] = {}


class UnsupportedModelError(ValueError):
    pass


class FamilySpec:
    name: str = ""
    # How users recognise it in errors: "model_type (architectures)".
    description: str = ""
    # Where the family appears in listings (``dare models``, the README's support matrix): masked diffusion first,
    # then block diffusion, then encoder-decoder, as the README's families table reads.
    listing_order: int = 100
    # Which builder of ``dare.models.builder.BUILDERS`` makes and loads the model: "native" (``DiffusionLM`` from
    # ``arch``) or the key of a model class transformers maintains (DiffusionGemma).
    builder: str = "native"
    # (published name, native name) templates with numeric placeholders such as {i}; first match wins.
    # Names no rule matches are the same in both trees (Qwen/Llama-named checkpoints need no rules).
    key_rules: list[tuple[str, str]] = []
    # Config keys whose (non-default) values the native code does not implement: key -> allowed values.
    unsupported: dict[str, tuple] = {}
    # Strings of the mask token in this family's tokenizers (used when config.json has no mask_token_id).
    mask_token_strings: tuple[str, ...] = ("<|mask|>",)
    # Default block size of block-causal families whose config carries none.
    default_block_size: Optional[int] = None
    # False for uniform-noise families: no mask token is resolved (the adapter's mask_token_id is -1).
    uses_mask_token: bool = True
    # Generic size names (used by ``dare.models.tiny``) -> this family's config keys.
    size_keys: dict[str, tuple[str, ...]] = {
        "hidden_size": ("hidden_size",), "num_layers": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
        "num_kv_heads": ("num_key_value_heads",), "intermediate_size": ("intermediate_size",),
        "vocab_size": ("vocab_size",), "head_dim": ("head_dim",),
    }

    def matches(self, cfg: dict) -> bool:
        """Whether a published ``config.json`` (a dict) is this family's."""
        raise NotImplementedError

    def arch(self, cfg: dict) -> ModelArch:
        """The sizes and architecture flags read from ``cfg`` (unsupported values are an ``UnsupportedModelError``)."""
        raise NotImplementedError

    def read_arch(self, cfg: dict) -> ModelArch:
        """``arch(cfg)``, with a config that lacks a key, holds a value of the wrong type or an impossible size as
        one ``UnsupportedModelError`` that names the key (builders call this, families implement ``arch``)."""
        try:
            return self.arch(cfg)
        except KeyError as e:
            raise UnsupportedModelError(f"{self.name}: config.json has no {e.args[0]!r}") from None
        except ArchError as e:
            keys = self.size_keys.get(e.field)
            raise UnsupportedModelError(f"{self.name}: {e}" + (f" (config.json: {' / '.join(keys)})" if keys else "")) \
                from None
        except TypeError as e:
            raise UnsupportedModelError(f"{self.name}: config.json holds a value of the wrong type ({e})") from None

    def adapter(self, cfg: dict, mask_token_id: int) -> FamilyAdapter:
        """What samplers and trainers need to know (mask / stop ids, attention kind, block size, noise)."""
        raise NotImplementedError

    def tiny_config(self) -> dict:
        """A config.json in this family's real layout for a tiny random model (vocab 512, mask 500)."""
        raise NotImplementedError

    def config_section(self, cfg: dict) -> dict:
        """The dict that holds the text model's keys (sizes, token ids): the config itself, or a nested
        ``text_config`` for multimodal layouts."""
        return cfg

    # --- helpers ---------------------------------------------------------------------------------
    def check_supported(self, cfg: dict) -> None:
        for key, allowed in self.unsupported.items():
            if key in cfg and cfg[key] not in allowed:
                raise UnsupportedModelError(
                    f"{self.name}: config key {key}={cfg[key]!r} is not supported by dare's native implementation "
                    f"(supported: {', '.join(map(repr, allowed))})")

    @staticmethod
    def _pattern(template: str):
        # "model.layers.{i}.attention.dense.weight" -> regex with one numeric group per placeholder
        parts = re.split(r"\{\w+\}", template)
        return re.compile("^" + r"(\d+)".join(re.escape(p) for p in parts) + "$")

    @staticmethod
    def _fill(template: str, values: tuple) -> str:
        it = iter(values)
        return re.sub(r"\{\w+\}", lambda _: next(it), template)

    def _convert(self, key: str, src: int) -> str:
        for rule in self.key_rules:
            m = self._pattern(rule[src]).match(key)
            if m:
                return self._fill(rule[1 - src], m.groups())
        return key

    def to_native(self, key: str) -> str:
        return self._convert(key, 0)

    def to_published(self, key: str) -> str:
        return self._convert(key, 1)


def register_family(family: FamilySpec) -> FamilySpec:
    FAMILIES[family.name] = family
    return family


def supported_description() -> str:
    return "; ".join(f.description for f in FAMILIES.values())


def detect_family(cfg: dict) -> FamilySpec:
    hits = [f for f in FAMILIES.values() if f.matches(cfg)]
    if not hits:
        raise UnsupportedModelError(
            f"unsupported model: model_type={cfg.get('model_type')!r}, architectures={cfg.get('architectures')!r}. "
            f"Supported: {supported_description()}")
    return hits[0]


def get_family(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise UnsupportedModelError(f"unknown family {name!r}; registered: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def eos_ids(cfg: dict) -> tuple[Optional[int], list[int]]:
    """(primary eos, all stop ids) from a config value that may be an int or a list."""
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        return (eos[0] if eos else None), list(eos)
    return eos, ([eos] if eos is not None else [])
