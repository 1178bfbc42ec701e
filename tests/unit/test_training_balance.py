"""Balancing the routers of the trained examples where transformers has no balance loss
(DeepSeek): the tap's loss is transformers' own formula, and DeepSeek-V3's bias rule moves
every expert's correction bias towards an even load. No training: one forward pass each."""

import pytest
import torch

from moepipe.examples import EXAMPLES
from moepipe.examples.routing import RouterTap


def _model(name):
    import transformers

    ex = EXAMPLES[name]
    config = getattr(transformers, ex.config_class)(**ex.config, dtype="float32")
    torch.manual_seed(ex.seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-olmoe", "tiny-gpt-oss"])
def test_tap_loss_equals_transformers_load_balancing_loss(name):
    model = _model(name)
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RouterTap(model) as tap:
        out = model(input_ids=ids, output_router_logits=True)
        assert len(tap.calls) == model.config.num_hidden_layers
        assert torch.allclose(tap.aux_loss(), out.aux_loss, atol=1e-6)


def test_deepseek_v3_bias_rule_favours_the_underloaded_experts():
    model = _model("tiny-deepseek-v3")
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RouterTap(model) as tap:
        model(input_ids=ids)
        assert [type(m).__name__ for m in tap.routers] == ["DeepseekV3TopkRouter"] * 2
        before = [m.e_score_correction_bias.clone() for m in tap.routers]
        tap.update_correction_bias(1e-3)
        for (module, logits, indices), old in zip(tap.calls, before, strict=True):
            load = torch.bincount(indices.flatten(), minlength=logits.shape[-1]).float()
            step = module.e_score_correction_bias - old
            assert torch.allclose(step[load > load.mean()], torch.tensor(-1e-3))
            assert torch.allclose(step[load < load.mean()], torch.tensor(1e-3))
