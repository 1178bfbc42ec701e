"""Stage ``quality``: how much quantization changed the model, measured on held-out text.

The unquantized model is Hugging Face ``transformers`` (float32) on the source checkpoint; the
quantized one is moepipe's reference runtime on the converted, quantized TensorRT-LLM
checkpoint - all ranks, the dtype and the fake-quant arithmetic of what is deployed. Both read
the held-out sequences the quantize stage kept back from calibration (``heldout.json``).

* ``top1_agreement``: fraction of positions whose most likely next token is the same;
* ``logit_cosine``: mean cosine similarity of the two logit vectors over positions;
* ``ppl`` / ``ppl_quantized`` / ``ppl_delta``: perplexity of the held-out text (next-token
  cross-entropy) before and after, and the increase.

The thresholds of ``quantize.quality`` are checked by :func:`check_quality` each time a build
or a deploy reads the stage, so changing a threshold needs no new measurement.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moepipe.config import MoepipeConfig
from moepipe.errors import MoepipeError
from moepipe.stages.base import BuildContext, Stage


class QualityError(MoepipeError):
    pass


def measure_quality(source: Path, quantized: Path, checkpoint: Path | None,
                    trust_remote_code: bool = False,
                    step: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Compare the quantized model (``checkpoint``, or a tp=1 conversion of ``quantized`` when
    there is none) with the unquantized one on ``quantized/heldout.json``."""
    if checkpoint is not None:
        return _measure(source, quantized, checkpoint, trust_remote_code, step)
    from moepipe.arch.hf import open_hf_checkpoint
    from moepipe.conversion.write import convert_into
    from moepipe.mapping import Mapping

    with tempfile.TemporaryDirectory(prefix="moepipe-quality-") as tmp:
        out = Path(tmp) / "checkpoint"
        out.mkdir()
        convert_into(open_hf_checkpoint(quantized), out, Mapping.create(tp=1), dtype="auto")
        return _measure(source, quantized, out, trust_remote_code, step)


def _measure(source: Path, quantized: Path, checkpoint: Path, trust_remote_code: bool,
             step: Callable[[str], None]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from moepipe.runtime.checkpoint import load_checkpoint
    from moepipe.runtime.model import Batch, ReferenceModel

    hf_logging.disable_progress_bar()
    try:
        sequences = json.loads((quantized / "heldout.json").read_text())["sequences"]
    except (OSError, ValueError, KeyError):
        raise MoepipeError(f"{quantized}: no readable heldout.json",
                           "run `moepipe build --force quantize`") from None
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                              trust_remote_code=trust_remote_code).eval()
    model = ReferenceModel(load_checkpoint(checkpoint))
    agree = positions = 0
    cosine = nll_ref = nll_q = 0.0
    for n, ids in enumerate(sequences, 1):
        step(f"held-out sequence {n}/{len(sequences)}")
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        ours = model.forward(Batch.single(ids), all_logits=True).float()
        agree += int((ref.argmax(-1) == ours.argmax(-1)).sum())
        positions += len(ids)
        cosine += float(F.cosine_similarity(ref, ours, dim=-1).sum())
        target = torch.tensor(ids[1:])
        nll_ref += float(F.cross_entropy(ref[:-1], target, reduction="sum"))
        nll_q += float(F.cross_entropy(ours[:-1], target, reduction="sum"))
    predicted = positions - len(sequences)
    ppl, ppl_q = math.exp(nll_ref / predicted), math.exp(nll_q / predicted)
    return {"sequences": len(sequences), "positions": positions,
            "top1_agreement": round(agree / positions, 6),
            "logit_cosine": round(cosine / positions, 6),
            "ppl": round(ppl, 4), "ppl_quantized": round(ppl_q, 4),
            "ppl_delta": round(ppl_q - ppl, 4)}


def check_quality(cfg: MoepipeConfig, measured: dict[str, Any]) -> None:
    """Raise QualityError, with the numbers, when ``measured`` misses a threshold."""
    q = cfg.quantize.quality
    failures = []
    if q.min_top1_agreement is not None and measured["top1_agreement"] < q.min_top1_agreement:
        failures.append(f"top-1 agreement {measured['top1_agreement']:.4f} < "
                        f"{q.min_top1_agreement}")
    if q.min_logit_cosine is not None and measured["logit_cosine"] < q.min_logit_cosine:
        failures.append(f"logit cosine {measured['logit_cosine']:.4f} < {q.min_logit_cosine}")
    if q.max_ppl_delta is not None and measured["ppl_delta"] > q.max_ppl_delta:
        failures.append(f"perplexity delta {measured['ppl_delta']:.4f} > {q.max_ppl_delta} "
                        f"({measured['ppl']:.3f} -> {measured['ppl_quantized']:.3f})")
    if failures:
        raise QualityError(
            f"{cfg.quantize.format} quantization misses the quality gate: {'; '.join(failures)}",
            "try another quantize.format, more calibration data (quantize.calibration), or "
            "relax quantize.quality")


# -- the stage ---------------------------------------------------------------------------------
def _run(ctx: BuildContext, out: Path) -> dict[str, Any]:
    source = ctx.source_dir
    if source is None:
        raise KeyError("the quality stage needs the source stage's output")
    result = measure_quality(source, ctx.model_dir, ctx.outputs.get("convert"),
                             ctx.cfg.model.trust_remote_code, step=ctx.step)
    (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    ctx.echo(f"  quality: top-1 agreement {result['top1_agreement']:.4f}, logit cosine "
             f"{result['logit_cosine']:.4f}, perplexity {result['ppl']:.3f} -> "
             f"{result['ppl_quantized']:.3f} ({result['sequences']} held-out sequences)")
    return result


def _check(cfg: MoepipeConfig, details: dict[str, Any]) -> None:
    if details:
        check_quality(cfg, details)


STAGE = Stage("quality", 1, applies=lambda cfg: cfg.quantize.format != "none",
              settings=lambda cfg: {"dtype": cfg.model.dtype,
                                    "trust_remote_code": cfg.model.trust_remote_code},
              inputs=("source", "quantize", "convert"), tools=("torch", "transformers"),
              run=_run, check=_check)
