"""Vision-language MoE models traced on prompts that hold images.

Whole tiny qwen3_vl_moe and glm4v_moe models (a two-layer vision tower beside the tiny MoE
decoder) run on a left-padded batch whose rows each carry one image (16 patches merged into 4
image tokens). The decoder's MoE blocks then see text and image tokens mixed, with M-RoPE
positions: every value moelens serves must still equal plain nnsight's (and the experts
recomputed from their weights), and reading them must leave the logits bit-identical.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

import moelens
from moelens.testing import tiny_config
from moelens.testing.tiny import _reinit

from groundtruth import raw_values, slots_by_hand

IMAGE, VIDEO, START, END = 100, 101, 102, 103
#: A small vision tower whose merged patches (2 x 2) land in the decoder's hidden size of 32.
VISION = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2)


def _config(family: str):
    text = tiny_config(family).to_dict()
    if family == "qwen3_vl_moe":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                   "mrope_interleaved": True}
        return AutoConfig.for_model(
            family, text_config=text,
            vision_config={**VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        )
    return AutoConfig.for_model(
        family, text_config=text, vision_config={**VISION, "image_size": 16},
        image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START, image_end_token_id=END,
        video_start_token_id=104, video_end_token_id=105,
    )


def _image_prompts(batch: int = 2) -> dict[str, torch.Tensor]:
    """Left-padded rows of different lengths: text, one 4-token image between its markers, text."""
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 90, (2 + row,), generator=gen).tolist() + [START] + [IMAGE] * 4 + [END]
            + torch.randint(3, 90, (3,), generator=gen).tolist() for row in range(batch)]
    width = max(map(len, rows))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    return {
        "input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.randn(16 * batch, 3 * 2 * 4 * 4, generator=gen),  # channels x time x patch x patch
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
    }


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "glm4v_moe"])
def test_values_on_image_prompts_equal_plain_nnsight(family, impl):
    torch.manual_seed(0)
    hf = AutoModelForImageTextToText.from_config(_config(family), experts_implementation=impl)
    _reinit(hf, 0)
    hf.eval()
    inputs = _image_prompts()
    assert (inputs["input_ids"] == IMAGE).sum() == 8
    with torch.no_grad():
        plain = hf(**inputs).logits
        other_images = hf(**{**inputs, "pixel_values": -inputs["pixel_values"]}).logits
    assert not torch.allclose(plain, other_images)  # the images reach the decoder
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    blocks = [moe.path.removeprefix("model.") for moe in wrapped.moes]
    assert blocks and all(".language_model.layers." in name for name in blocks)
    raw = raw_values(reference, inputs, blocks, wrapped.moes[0].family)

    with torch.no_grad(), wrapped.trace(**inputs):
        values = wrapped.save_all()  # layer -> value name -> tensor, for every block
        logits = wrapped.output.logits.save()

    assert torch.equal(logits, plain)
    mask = inputs["attention_mask"].bool()
    for name, saved in zip(blocks, values.values(), strict=True):
        truth = raw[name]
        hidden, indices, weights = truth.experts_args
        assert torch.equal(saved["router_logits"].flatten(0, 1), truth.logits)
        assert torch.equal(saved["expert_indices"].flatten(0, 1), indices)
        assert torch.equal(saved["expert_weights"].flatten(0, 1), weights)
        assert torch.equal(saved["routed_output"].flatten(0, 1), truth.experts_output)
        assert torch.equal(saved["mlp_output"], truth.block_output)
        if impl == "eager":
            assert "expert_outputs" not in saved
            continue
        experts = reference.get_submodule(f"{name}.experts")
        activations, outputs = slots_by_hand(experts, hidden, indices, weights)
        # the image tokens (and every other real token) are where they were: compare them all
        torch.testing.assert_close(saved["expert_outputs"][mask], outputs.view(*mask.shape, *outputs.shape[1:])[mask])
        torch.testing.assert_close(saved["expert_activations"].flatten(0, 1), activations)
        torch.testing.assert_close(saved["expert_outputs"].sum(2).flatten(0, 1), truth.experts_output)
