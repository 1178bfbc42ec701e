"""Numerical parity of a converted TensorRT-LLM checkpoint against Hugging Face ``transformers``.

The reference runtime runs the converted checkpoint (all ranks, combined as TensorRT-LLM would);
``transformers`` runs the source checkpoint. Compared: logits of every prompt token, and greedy
generation token for token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from moepipe.config import DEFAULT_PROMPTS


@dataclass
class PromptParity:
    prompt: str
    prompt_tokens: int
    max_abs_diff: float
    hf_tokens: list[int]
    moepipe_tokens: list[int]

    @property
    def tokens_match(self) -> bool:
        return self.hf_tokens == self.moepipe_tokens


@dataclass
class ParityReport:
    hf: str
    checkpoint: str
    tolerance: float
    prompts: list[PromptParity] = field(default_factory=list)

    @property
    def max_abs_diff(self) -> float:
        return max(p.max_abs_diff for p in self.prompts)

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance and all(p.tokens_match for p in self.prompts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["max_abs_diff"] = self.max_abs_diff
        d["passed"] = self.passed
        for p, pd in zip(self.prompts, d["prompts"], strict=True):
            pd["tokens_match"] = p.tokens_match
        return d


def check_parity(hf_dir: str | Path, ckpt_dir: str | Path, prompts: list[str] | None = None,
                 max_new_tokens: int = 16, tolerance: float = 1e-4,
                 trust_remote_code: bool = False) -> ParityReport:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from moepipe.arch.hf import open_hf_checkpoint
    from moepipe.runtime.checkpoint import load_checkpoint
    from moepipe.runtime.generate import generate
    from moepipe.runtime.model import Batch, ReferenceModel

    hf_logging.disable_progress_bar()
    src = open_hf_checkpoint(hf_dir)  # validates the folder and the architecture first
    # Safetensors only: a folder of pickles (pytorch_model.bin) is refused before
    # transformers sees it (its loader would unpickle them).
    src.reader().close()
    model = ReferenceModel(load_checkpoint(ckpt_dir))
    tok = AutoTokenizer.from_pretrained(src.path, trust_remote_code=trust_remote_code)
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, use_safetensors=True,
                                              trust_remote_code=trust_remote_code).eval()
    eos = src.spec.eos_token_id
    report = ParityReport(str(hf_dir), str(ckpt_dir), tolerance)
    for prompt in prompts or DEFAULT_PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
            hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos,
                                 pad_token_id=src.spec.pad_token_id or eos)
        ours = model.forward(Batch.single(ids), all_logits=True)
        new = generate(model, [ids], max_new_tokens, end_id=eos)[0]
        report.prompts.append(PromptParity(
            prompt=prompt, prompt_tokens=len(ids),
            max_abs_diff=float((ours - ref).abs().max()),
            hf_tokens=hf_out[0, len(ids):].tolist(), moepipe_tokens=new))
    return report
