"""Reference decoder parameters of the golden fixtures -> ``SamplerConfig`` (the mapping of
tests/assets/fixtures/README.md), plus the reference output's generated part."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dare.rollout import SamplerConfig

# Not tests.conftest's: benchmarks/gpu_check.py reads these cases on machines without pytest.
FIXTURES = Path(__file__).resolve().parents[1] / "assets" / "fixtures"

FOLDERS = ["llada-tiny", "lladamoe-tiny", "dream-tiny", "sdar-tiny", "sdarmoe-tiny", "llada2-tiny", "llada21-tiny",
           "rnd1-tiny", "fastdllmv2-tiny", "nemotron-tiny"]
LLADA_CACHE = {"generate": "none", "generate_with_prefix_cache": "prefix", "generate_with_dual_cache": "dual"}
SDAR_REMASKING = {"low_confidence_static": "static", "low_confidence_dynamic": "dynamic", "sequential": "sequential"}


@dataclass
class Case:
    folder: str
    index: int
    raw: dict
    config: SamplerConfig
    prompt: list
    expected: list  # reference generated tokens, cut after the first stop token where it has one
    stop_ids: list
    dtype: torch.dtype
    ref_nfe: Optional[int]
    # How our nfe relates to the reference's (None: not comparable, e.g. no nfe recorded).
    nfe_offset: Optional[int]
    # "eq": nfe == reference + offset; "le": <= (our early stop can only end sooner, see docs/samplers.md).
    nfe_relation: str = "eq"
    # [1, gen_length] tokens fixed in the completion before decoding (-1: none), or None
    hints: Optional[torch.Tensor] = None

    @property
    def id(self) -> str:
        r = self.raw
        keys = [k for k in ("fn", "alg", "remasking_strategy", "decoder", "mask_semantics", "model_dtype") if k in r]
        return f"{self.folder}-{self.index}-" + "-".join(str(r[k]) for k in keys)


def load_cases(folder: str) -> list[Case]:
    data = json.loads((FIXTURES / folder / "expected_generate.json").read_text())
    return [_case(folder, i, c, data) for i, c in enumerate(data["cases"])]


def _cut(gen: list, stops: list, G: int) -> list:
    gen = gen[:G]
    for j, t in enumerate(gen):
        if t in stops:
            return gen[:j + 1]
    return gen


def _case(folder: str, i: int, c: dict, top: dict) -> Case:
    prompt = c["prompt"]
    P = len(prompt)
    dtype = torch.float32
    nfe_offset = 0
    relation = "eq"
    hints = None
    if "fn" in c:  # LLaDA / LLaDA-MoE: Fast-dLLM generate / prefix / dual cache
        cfg = SamplerConfig(gen_length=c["gen_length"], block_length=c["block_length"], steps=c["steps"],
                            remasking=c["remasking"], threshold=c["threshold"], cache=LLADA_CACHE[c["fn"]], block_stop=False)
        gen, stops = c["output"][P:], [top.get("eos_token_id", 501)]
    elif "alg" in c:  # Dream diffusion_generate
        # top_k=50: Dream's generation config inherits transformers' GenerationConfig default (top_k 50), which
        # the reference applies even at temperature 0, where it renormalises the confidences over the top 50.
        cfg = SamplerConfig(gen_length=c["max_new_tokens"], block_length=c["max_new_tokens"], steps=c["steps"],
                            remasking=c["alg"], alg_temp=top.get("alg_temp") or None, eps=top["eps"], top_k=50,
                            block_stop=False)
        gen, stops = c["output"][P:], [501]
        nfe_offset = None
    elif "denoising_steps" in c:  # SDAR / SDAR-MoE block_diffusion_generate
        crit = c["stopping_criteria_idx"]
        cfg = SamplerConfig(gen_length=c["gen_length"], block_length=c["block_length"], steps_per_block=c["denoising_steps"],
                            remasking=SDAR_REMASKING[c["remasking_strategy"]], threshold=c["confidence_threshold"],
                            cache="block", stop_token_ids=list(crit or []), block_stop=bool(crit))
        gen, stops = c["output"][P:], list(crit or [top.get("eos_token_id", 501)])
        # The reference spends one extra forward per block (and one prefill) only on storing keys/values; ours
        # store them during the next denoising step, so our forwards are exactly its denoising forwards.
        c = dict(c, nfe=c["nfe_denoise"])
    elif c["decoder"] == "rnd1.diffusion_sample":
        # RND1 with a prefix: seq_len - P - 1 masks, then one slot reserved for the pad token (add_eos_at_end off),
        # which the bidirectional model attends to: a hint at the completion's last column; one block, entropy order,
        # the linear count schedule. Its NFE is num_steps (one forward per step, the last step fills the rest).
        G = c["seq_len"] - P
        cfg = SamplerConfig(gen_length=G, block_length=G, steps=c["num_steps"], remasking="entropy", schedule="linear",
                            block_stop=False)
        hints = torch.full((1, G), -1, dtype=torch.long)
        hints[0, -1] = c["pad_token_id"]
        gen, stops = c["output"][P:], [c["eos_token_id"]]
        nfe_offset = None
    elif c["decoder"] == "fast_dllm_v2.generate":
        # Blocks of block_size (attention and decoding), sub-blocks left to right, {p > threshold} or the most
        # probable mask of the sub-block each step (dynamic with one token per step); the block's first token from
        # the previous block's last row (its own step). The reference decodes max_new_tokens // block_size blocks
        # from the prompt's block (+ that next token); we decode ceil((P + G) / B) - P // B blocks, a superset:
        # block-causal attention makes the shared part the same, so its tokens are compared.
        B = c["block_size"]
        cfg = SamplerConfig(gen_length=c["max_new_tokens"], block_length=B, steps_per_block=B, remasking="dynamic",
                            threshold=float(c["threshold"]), sub_block_length=c["small_block_size"],
                            cache="dual" if c["use_block_cache"] else "none", stop_token_ids=[c["stop_token"]],
                            block_stop=True)
        gen, stops = c["output"][P:], [c["stop_token"]]
        nfe_offset = None
    elif c["decoder"].startswith("nemotron."):
        # generate: blocks after the prompt, one token per step over block_length steps (the reference's fixed
        # schedule) or Fast-dLLM's threshold rule, against the exact cache of what precedes the block: stored causally
        # with the next token seeding the block (causal_context) or with full attention. The reference's nfe counts
        # the denoising steps and one store per block, not the prefill; ours counts the prefill and not the store
        # after the last block: the same number. ar_generate: the causal cache with blocks of one token.
        # linear_spec_generate: a bidirectional draft of each block (every mask at once: threshold 0, or the
        # threshold rule per forward), a causal verify, the longest agreeing prefix plus one kept; its nfe: the
        # prefill, drafts and verifies.
        causal = c.get("causal_context", True)
        cfg = SamplerConfig(gen_length=c["max_new_tokens"], block_length=c.get("block_length", 1),
                            steps=c["max_new_tokens"], threshold=c.get("threshold") or None,
                            cache="causal" if causal else "block", speculative=c["decoder"].endswith("linear_spec_generate"),
                            stop_token_ids=[c["eos_token_id"]], eos_early_stop=True, block_stop=True)
        gen, stops = c["output"][P:], [c["eos_token_id"]]
    elif c["decoder"] == "llada2.0_generate":
        cfg = SamplerConfig(gen_length=c["gen_length"], block_length=c["block_length"], steps_per_block=c["steps"],
                            remasking="dynamic", threshold=c["threshold"], eos_early_stop=c["eos_early_stop"],
                            stop_token_ids=[c["eos_id"]], minimal_topk=c["minimal_topk"], cache="none", block_stop=True)
        gen, stops = c["output"], [c["eos_id"]]
        if gen[:P] == prompt:  # the mid-step early return hands back the prompt too
            gen = gen[P:]
        if c["eos_early_stop"]:
            # LLaDA2.0 tests for "no mask before the first EOS" only on steps that commit an EOS; we finish the row
            # as soon as it holds, which can save forwards but never changes the completion.
            relation = "le"
    else:  # LLaDA2.1 generate with token editing
        cfg = SamplerConfig(gen_length=c["gen_length"], block_length=c["block_length"], threshold=c["threshold"],
                            editing_threshold=c["editing_threshold"], max_post_steps=c["max_post_steps"],
                            num_to_transfer=c["num_to_transfer"], eos_early_stop=c["eos_early_stop"],
                            stop_token_ids=[c["eos_id"]], cache="none", block_stop=c["eos_early_stop"])
        gen, stops = c["output"], [c["eos_id"]]
    if c.get("model_dtype") == "bfloat16":
        dtype = torch.bfloat16
    return Case(folder, i, c, cfg, prompt, _cut(gen, stops, cfg.gen_length), stops, dtype, c.get("nfe"),
                nfe_offset if c.get("nfe") is not None else None, relation, hints)
