"""Loss-parity cases of d-OPSD (docs/loss_parity.md).

The authors' own rollout path runs: ``dOPSDTrainer._generate_and_score_completions`` (xingzhejun/d-OPSD
``d-opsd/d_opsd_trainer.py``) decodes each prompt with their ``utils.generate`` (semi-AR low-confidence sampler,
greedy), records the pre-step states, and builds the self-future teacher states; then ``compute_loss`` runs every
micro-step (``batch_divide`` chunks of the states): teacher forward, top-2 selection, student forward,
``generalized_jsd_loss``, correctness gate. Stand-ins: the sampler's model returns, for each prompt, logits whose
argmax at every position is a fixed answer (EOS 126081 where it stops) with a distinct confidence per position, so the
decoding order is the authors' sampler's own; ``compute_loss``'s model returns the teacher tables (fixed logits per
state) and the student leaves (float64 logits per state) in call order; ``get_all_parsed_answer`` says which samples
are correct. The random reveal (unseeded ``randperm``) runs under ``torch.manual_seed`` and the case saves what it
revealed, which dare's test substitutes. Harness glue: one prompt per "device" (the authors' per-device batch),
the step loss is the mean over devices, summed over the micro-steps (each state is in one micro-step, so the gradient
of every state's leaf is its micro-step's).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import torch

from loss_parity_lib import repository, case, load_reference, record, trainer
from tests.algorithms.parity_io import block_logits

D_OPSD = repository("d_opsd", "xingzhejun/d-OPSD")

AUTHORS_EOS = 126081  # hard-coded in the authors' sampler and trainer
EOS, MASK = 1, 2  # the ids dare's side uses (the case stores small ids)
FIRST, VOCAB = 4, 24  # answer tokens; VOCAB = the logits' width in compute_loss (> top_k 20)
P, GEN, BLOCK, STEPS, DIVIDE = 3, 24, 4, 12, 3


class SamplerModel:
    """The generation stand-in: logits [1, L, V] with the answer's token at every position (probability
    sigmoid(a_k): distinct confidences), rest of the mass on token 0. Logs every input state."""

    def __init__(self, answer: torch.Tensor, strength: torch.Tensor):
        self.answer, self.strength = answer, strength
        self.dtype, self.device = torch.float64, torch.device("cpu")
        self.calls = []

    def __call__(self, x):
        self.calls.append(x.clone())
        L = x.shape[1]
        logits = torch.full((1, L, AUTHORS_EOS + 1), -1.0e4, dtype=torch.float64)
        logits[0, :, 0] = 0.0
        logits[0, torch.arange(L), self.answer] = self.strength
        return SimpleNamespace(logits=logits)


def _answers(g: torch.Generator):
    """Three samples: (answer [P + GEN] in the authors' ids, confidence strengths, correct). Stops: in the last block
    (every trained state reveals), mid-way (a wrong answer: gated out), and at 17 in block 4 with its first real
    position (16) decoded last, so the block's states are recorded and trained with nothing to reveal (the next
    block starts after the stop)."""
    out = []
    for eos_at, correct in ((21, True), (13, False), (17, True)):
        prompt = torch.randint(FIRST, VOCAB, (P,), generator=g)
        comp = torch.randint(FIRST, VOCAB, (GEN,), generator=g)
        comp[eos_at:] = AUTHORS_EOS
        strength = 1.0 + 4.0 * torch.rand(P + GEN, generator=g, dtype=torch.float64)
        if eos_at == 17:
            strength[P + 16] = 0.5
        out.append((torch.cat([prompt, comp]), strength, correct))
    return out


def _step_map(calls: list, final: torch.Tensor, mask: int) -> torch.Tensor:
    """The step that wrote each completion position, from the sampler's logged input states."""
    states = [c[0, P:] for c in calls] + [final[P:]]
    step = torch.full((GEN,), -1, dtype=torch.long)
    for s in range(len(states) - 1):
        step[(states[s] == mask) & (states[s + 1] != mask)] = s
    return step


def _small(ids: torch.Tensor) -> torch.Tensor:
    return torch.where(ids == AUTHORS_EOS, torch.full_like(ids, EOS), ids)


def dopsd_case(ref, seed: int, beta: float, clip, note: str):
    rel = "d-opsd/d_opsd_trainer.py"
    utils = load_reference(ref.file("d-opsd/utils.py"), "d_opsd_utils")
    answers = _answers(torch.Generator().manual_seed(seed))
    verdicts = {str(i): ok for i, (_, _, ok) in enumerate(answers)}

    @contextlib.contextmanager
    def unwrap(model, accelerator):
        yield current["sampler"]

    current = {}
    overrides = {
        "utils": {"generate": utils.generate, "main_print": lambda *a: None,
                  "get_all_parsed_answer": lambda text, answer, dataset: (None, verdicts[answer])},
        "transformers": {"Trainer": SimpleNamespace(_prepare_inputs=lambda self, inputs: inputs)},
        "trl.models": {"unwrap_model_for_generation": unwrap},
        "trl.data_utils": {"maybe_apply_chat_template": lambda example, tok: {"prompt": example["prompt"]}},
        "accelerate.utils": {"is_peft_model": lambda model: True},  # LoRA: the teacher runs with the adapter disabled
    }
    mod = load_reference(ref.file(rel), "d_opsd", overrides)
    args = SimpleNamespace(max_completion_length=GEN, block_length=BLOCK, diffusion_steps=STEPS, temperature=0.0,
                           cfg_scale=0.0, remasking="low_confidence", mask_id=MASK, fp16=False)
    metrics = defaultdict(lambda: defaultdict(list))
    acc = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda v: v, unwrap_model=lambda m: m)
    tr = trainer(mod.dOPSDTrainer, args=args, accelerator=acc, _metrics=metrics,
                 control=SimpleNamespace(should_evaluate=False),
                 log_completions=False, debug1=False, passk=1, passk_temperature=0.9, add_ref=False,
                 teacher_retain_ratio=0.25, batch_divide=DIVIDE, fixed_teacher=True, top_k_loss=20, jsd_token_clip=clip,
                 diff_student_mask=False, dataset_name="gsm8k", sudoku_threshold=0.25, beta=beta,
                 max_prompt_length=None, model_wrapped=None,
                 processing_class=SimpleNamespace(batch_decode=lambda ids, **kw: ["text"]))
    g = torch.Generator().manual_seed(seed + 1)
    rollouts = []
    for i, (seq, strength, _) in enumerate(answers):
        current["sampler"] = SamplerModel(seq, strength)
        tr.processing_class = _Tokenizer(seq[:P], tr.processing_class.batch_decode)
        torch.manual_seed(seed + 10 + i)  # the reference's unseeded randperm (teacher reveals)
        out = tr._generate_and_score_completions([{"prompt": "p", "answer": str(i)}])
        calls = current["sampler"].calls
        assert len(calls) == STEPS, len(calls)  # passk 1: one decode, every step a forward
        rollouts.append((out, _step_map(calls, seq, MASK)))  # greedy: the final sequence is the answer
    S = max(o["trajectory"].shape[0] for o, _ in rollouts)
    L = P + GEN
    # logits of each state's current block (the only ones compute_loss reads; parity_io.block_logits places them)
    teacher_tables = torch.randn(len(answers), S, BLOCK, VOCAB, generator=g, dtype=torch.float64) * 2.0
    noise = torch.randn(teacher_tables.shape, generator=g, dtype=torch.float64)
    student = (teacher_tables + 0.6 * noise).requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for j in range(DIVIDE):
        losses = []
        for i, (out, _) in enumerate(rollouts):
            b = (out["trajectory"].shape[0] - 1) // DIVIDE
            span = slice(j * b, (j + 1) * b)
            t_in, s_in = out["teacher_trajectory"][span], out["trajectory"][span]
            tables = [block_logits(teacher_tables[i, span], t_in, P, BLOCK, MASK),
                      block_logits(student[i, span], s_in, P, BLOCK, MASK)]
            tr._step = j + 1
            losses.append(tr.compute_loss(_Tables(tables), out))
        total = total + torch.stack(losses).mean()  # DDP: the mean over devices (one prompt each)
    T = torch.zeros(len(answers), S, L, dtype=torch.long)
    teacher = torch.zeros_like(T)
    for i, (out, _) in enumerate(rollouts):
        n = out["trajectory"].shape[0]
        T[i, :n], teacher[i, :n] = _small(out["trajectory"]), _small(out["teacher_trajectory"])
    seqs = torch.stack([_small(s) for s, _, _ in answers])
    inputs = {"prompt_ids": seqs[:, :P], "prompt_mask": torch.ones(len(answers), P, dtype=torch.bool),
              "completion_ids": seqs[:, P:], "completion_mask": _completion_mask(seqs[:, P:]),
              "step_map": torch.stack([m for _, m in rollouts]),
              "rewards": torch.tensor([float(ok) for _, _, ok in answers], dtype=torch.float64),
              "trajectory": T, "teacher_trajectory": teacher, "teacher_logits": teacher_tables,
              "recorded": torch.tensor([o["trajectory"].shape[0] for o, _ in rollouts]), "block_length": BLOCK}
    config = dict(inner_iterations=DIVIDE, passk=1, correct_reward=1.0, train_reward=None, reveal_ratio=0.25, top_k=20,
                  jsd_beta=beta, token_clip=clip, fixed_teacher=True, positions="teacher")
    return record("d_opsd", config, inputs, {"student_logits": student}, total,
                  ref.meta(rel, "_generate_and_score_completions (utils.generate, teacher states), compute_loss "
                                "(selection, generalized_jsd_loss, gate) per micro-step"),
                  runner="d_opsd", note=note)


class _Tables:
    """``compute_loss``'s model: the teacher's table on the first call (inside ``disable_adapter``: the frozen base),
    the student's leaf on the second."""

    def __init__(self, tables: list):
        self.tables, self.device = iter(tables), torch.device("cpu")
        self.adapter_off = False

    @contextlib.contextmanager
    def disable_adapter(self):
        self.adapter_off = True
        yield

    def __call__(self, ids):
        logits = next(self.tables)
        assert logits.shape[:2] == ids.shape, (logits.shape, ids.shape)
        return SimpleNamespace(logits=logits)


class _Tokenizer:
    """``processing_class``: the prompt's ids whatever the text (one prompt per call), and a decoder."""

    def __init__(self, prompt: torch.Tensor, batch_decode):
        self.prompt, self.batch_decode = prompt, batch_decode

    def __call__(self, **kw):
        return {"input_ids": self.prompt[None].clone()}


def _completion_mask(comp: torch.Tensor) -> torch.Tensor:
    stop = comp == EOS
    first = torch.where(stop.any(1), stop.float().argmax(1), torch.full((comp.shape[0],), comp.shape[1]))
    return torch.arange(comp.shape[1])[None] <= first[:, None]


@case("d_opsd", D_OPSD)
def d_opsd(ref):
    return dopsd_case(ref, 61, 1.0, 0.05, "reverse KL, clip 0.05 (the run scripts); three prompts (stop in the last "
                                          "block / a wrong answer / trained states without reveal), batch_divide 3")


@case("d_opsd_jsd", D_OPSD)
def d_opsd_jsd(ref):
    return dopsd_case(ref, 71, 0.5, 0.04, "generalised JSD beta 0.5, clip 0.04 (math); same layout")
