"""Models without an MoE block, and non-MLP layers: dense MLPs are `Mlp` components, nothing else is."""

from __future__ import annotations

import nnsight
import pytest
import torch
from nnsight import Envoy
from transformers import LlamaConfig, LlamaForCausalLM

import moelens
from moelens.components import Mlp
from moelens.testing import tiny_inputs, tiny_model


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def test_moelens_warnings_point_at_the_users_line_whichever_entry_point_raised_them():
    """moelens.load("tiny-dense") reached wrap's warning one call deeper than wrap does, and the warning named
    moelens/loading.py's `return wrap(model, ...)` line. Ground truth: this test file, where the calls are."""
    for call in (lambda: moelens.wrap(llama()), lambda: moelens.load("tiny-dense")):
        with pytest.warns(UserWarning, match="found no MoE block") as seen:
            call()
        assert [w.filename for w in seen if "found no MoE block" in str(w.message)] == [__file__]


def test_a_dense_model_serves_its_mlps_and_says_it_has_no_moe_block():
    hf = llama()
    with pytest.warns(UserWarning, match="found no MoE block"):
        wrapped = moelens.wrap(hf)
    assert wrapped.moes == [] and wrapped.family is None
    assert repr(wrapped.moes) == "MoeList of 0 MoE blocks (moelens serves no MoE block of this model)"  # no index
    assert all(isinstance(layer.mlp, Mlp) for layer in wrapped.layers)
    assert wrapped.model.layers[0].mlp is wrapped.layers[0].mlp  # the native path is the same component
    with pytest.raises(moelens.ValueUnavailable, match="This model has no MoE layer"):
        wrapped.layers[0].mlp.router_logits
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad(), wrapped.trace(ids):
        activation = wrapped.layers[1].mlp.mlp_activation.save()
        output = wrapped.layers[1].mlp.mlp_output.save()
    plain = nnsight.NNsight(hf)
    with torch.no_grad(), plain.trace(ids):
        x = plain.model.layers[1].mlp.input.save()
        raw_activation = plain.model.layers[1].mlp.down_proj.input.save()
        raw_output = plain.model.layers[1].mlp.output.save()
    mlp = hf.model.layers[1].mlp
    with torch.no_grad():
        expected = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    assert torch.equal(activation, raw_activation) and torch.equal(output, raw_output)
    torch.testing.assert_close(activation, expected)
    torch.testing.assert_close(output, mlp.down_proj(expected).detach())


def test_an_moe_family_checkpoint_without_moe_layers_gets_mlps_and_layers():
    with pytest.warns(UserWarning, match="found no MoE block"):
        wrapped = moelens.wrap(tiny_model("qwen2_moe", mlp_only_layers=[0, 1, 2, 3]))
    assert wrapped.family.name == "qwen2_moe" and wrapped.moes == []
    assert len(wrapped.layers) == 4 and all(isinstance(layer.mlp, Mlp) for layer in wrapped.layers)


def test_a_mamba_mixer_is_not_served_as_a_dense_mlp():
    hf = tiny_model("nemotron_h", layers_block_type=["mamba", "moe", "mlp", "moe"])
    wrapped = moelens.wrap(hf)
    mamba, dense = wrapped.layers[0], wrapped.layers[2]
    assert type(mamba.mixer) is Envoy and not hasattr(mamba, "mlp")  # like an attention layer: no block there
    assert isinstance(dense.mlp, Mlp) and [moe.layer for moe in wrapped.moes] == [1, 3]
    seen = {}
    down = hf.model.layers[2].mixer.down_proj
    handle = down.register_forward_pre_hook(lambda module, args: seen.update(x=args[0].detach().clone()))
    with torch.no_grad(), wrapped.trace(**tiny_inputs(hf), use_cache=False):
        activation = dense.mlp.mlp_activation.save()
    handle.remove()
    assert activation.shape[-1] == down.in_features
    torch.testing.assert_close(activation, seen["x"].reshape(activation.shape))


@pytest.mark.parametrize("mode", ["autograd", "inference_mode"])
def test_an_edit_reaches_the_model_through_an_alias_read_after_it(mode):
    """mlp_neurons read after mlp_activation was edited in place made a second copy of the model's tensor (autograd
    on) whose write-back undid the edit (the output was the unedited one) or showed stale values (inference_mode)."""
    with pytest.warns(UserWarning, match="found no MoE block"):
        wrapped = moelens.wrap(llama())
    mlp = wrapped.layers[1].mlp
    down = wrapped._module.model.layers[1].mlp.down_proj
    context = torch.inference_mode() if mode == "inference_mode" else torch.enable_grad()
    ids = torch.tensor([[1, 2, 3, 4]])
    with context:
        with wrapped.trace(ids):
            activation = mlp.mlp_activation
            activation[:, 1] = 0.5
            neurons = mlp.mlp_neurons.save()
            output = mlp.mlp_output.save()
        with wrapped.trace() as tracer:  # several invokes: each request is served a fresh slice of the batch
            with tracer.invoke(ids):
                mlp.mlp_activation[:, 1] = 0.5
                batched = mlp.mlp_neurons.save()
                batched_output = mlp.mlp_output.save()
            with tracer.invoke(ids):
                pass
        with wrapped.trace(ids):  # a write through the alias after a read of the other name
            mlp.mlp_activation.save()
            mlp.mlp_neurons = torch.ones(1, 4, 48)
            written = mlp.mlp_output.save()
    assert (neurons[:, 1] == 0.5).all() and not (neurons[:, 0] == 0.5).all()
    torch.testing.assert_close(batched, neurons)
    with torch.no_grad():
        torch.testing.assert_close(output.detach(), down(neurons.detach()))
        torch.testing.assert_close(batched_output.detach(), output.detach())
        torch.testing.assert_close(written.detach(), down(torch.ones(1, 4, 48)))


def test_dense_blocks_of_other_shapes_serve_what_they_add():
    """bloom's MLP adds the residual stream itself: mlp_output held it too (zeroing it wiped the stream);
    gpt-j's fc_in / fc_out MLPs were not found, nor model.layers of a dense vision-language model."""
    from transformers import BloomConfig, BloomForCausalLM, GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4)).eval()
    gptj = GPTJForCausalLM(GPTJConfig(vocab_size=100, n_embd=32, n_layer=2, n_head=4, rotary_dim=4)).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    for hf, down in ((bloom, "dense_4h_to_h"), (gptj, "fc_out")):
        with pytest.warns(UserWarning, match=r"its 2 dense MLPs \(at layers\[i\].mlp\)"):
            wrapped = moelens.wrap(hf)
        mlp = wrapped.layers[1].mlp
        projection = getattr(mlp._module, down)
        with torch.no_grad(), wrapped.trace(ids):
            activation = mlp.mlp_activation.save()
            output = mlp.mlp_output.save()
        torch.testing.assert_close(output, projection(activation).detach())
        with torch.no_grad(), wrapped.trace(ids):
            mlp.mlp_output[:] = 0
            zeroed = wrapped.output.logits.save()
        hook = projection.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
        try:
            with torch.no_grad():
                expected = hf(ids).logits
        finally:
            hook.remove()
        torch.testing.assert_close(zeroed, expected)
    bloom.config.pretraining_tp, bloom.config.slow_but_exact = 2, True  # its projection in slices, never called
    for block in bloom.transformer.h:
        block.mlp.pretraining_tp, block.mlp.slow_but_exact = 2, True
    with pytest.warns(UserWarning, match="found no MoE block"):
        wrapped = moelens.wrap(bloom)
    with pytest.raises(moelens.ValueUnavailable, match=r"runs its down projection as slices of its weight.*on each "
                                                        r"block's MLP"):
        with wrapped.trace(ids):
            wrapped.layers[0].mlp.mlp_output.save()
    for block in bloom.transformer.h:  # what the refusal says to do
        block.mlp.slow_but_exact = False
    with torch.no_grad(), wrapped.trace(ids):
        output = wrapped.layers[0].mlp.mlp_output.save()
    assert output.shape == (1, 4, 32)


def test_a_dense_vision_language_model_names_its_language_models_layers():
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=16, patch_size=8),
        text_config=llama().config.to_dict(),
    )
    hf = LlavaForConditionalGeneration(config).eval()
    with pytest.warns(UserWarning, match=r"in model.vision_tower.encoder.layers, model.language_model.layers; "
                                         r"layers is model.language_model.layers"):
        wrapped = moelens.wrap(hf)
    assert wrapped.layers[0].mlp is wrapped.model.language_model.layers[0].mlp
    assert isinstance(wrapped.layers[0].mlp, Mlp)


def test_falcon_mlp_output_is_the_mlps_own_though_its_layer_adds_attention_to_it_in_place():
    """falcon's decoder layer (parallel_attn) adds the attention output to its MLP's output in place: the read
    value was MLP + attention, patching a run's own value back changed the logits, and the tensor written was
    changed by the model."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    hf = FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    seen = {}
    handle = hf.transformer.h[1].mlp.register_forward_hook(lambda m, a, out: seen.update(mlp=out.detach().clone()))
    with torch.no_grad():
        plain = hf(ids).logits
    handle.remove()

    def zero_position_2(module, args, out):
        out = out.clone()
        out[:, 2] = 0
        return out

    handle = hf.transformer.h[1].mlp.register_forward_hook(zero_position_2)
    with torch.no_grad():
        zeroed = hf(ids).logits
    handle.remove()
    with pytest.warns(UserWarning, match="found no MoE block"):
        model = moelens.wrap(hf)
    with torch.no_grad(), model.trace(ids):
        read = model.layers[1].mlp.mlp_output.save()
        logits = model.output.logits.save()
    assert torch.equal(read, seen["mlp"]) and torch.equal(logits, plain)
    patch = read.clone()
    with torch.no_grad(), model.trace(ids):
        model.layers[1].mlp.mlp_output = patch
        patched = model.output.logits.save()
    assert torch.equal(patched, plain) and torch.equal(patch, read)  # the written tensor is left as it was
    with torch.no_grad(), model.trace(ids):
        model.layers[1].mlp.mlp_output[:, 2] = 0  # an in-place edit of the reader's copy still lands
        edited = model.output.logits.save()
    torch.testing.assert_close(edited, zeroed, rtol=0, atol=1e-6)


def test_a_model_whose_mlps_are_not_found_says_why_it_has_no_layers():
    """OPT keeps its MLP projections on the decoder layer itself (fc1 / fc2): no Mlp, no model.layers; the warning
    and model.layers said only that nothing was found and that there was no attribute."""
    from transformers import OPTConfig, OPTForCausalLM

    hf = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=24, num_hidden_layers=2,
                                  num_attention_heads=2, word_embed_proj_dim=16)).eval()
    with pytest.warns(UserWarning, match=r"no dense MLP was found either .*, so there is no model.layers \(reach "
                                         r"modules by their native paths\)"):
        model = moelens.wrap(hf)
    with pytest.raises(AttributeError, match=r"has no 'layers': moelens found no list of decoder layers"):
        model.layers
    assert model.model.decoder.layers[0].fc1 is not None  # native paths work


def test_a_converted_falcon_down_projection_serves_its_own_output_too():
    """moelens.compress (target_modules=["dense_4h_to_h"]) turns the down projection FalconMLP returns as is into an
    MoE block: its mlp_output read as the block's output plus the attention output, which the layer adds in place
    (only the MLP itself was served as a copy)."""
    from transformers import FalconConfig, FalconForCausalLM

    from moelens.compress import tomoe

    torch.manual_seed(0)
    dense = FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                           ffn_hidden_size=128)).eval()
    generator = torch.Generator().manual_seed(1)
    converted = tomoe(dense, num_experts=4, top_k=2, calibration=torch.randint(0, 128, (4, 16), generator=generator),
                      max_error=None, progress=False, target_modules=["dense_4h_to_h"])
    model = moelens.wrap(converted)
    moe, ids = model.moes[0], torch.randint(0, 128, (2, 6), generator=generator)
    assert moe.path.endswith("h.0.mlp.dense_4h_to_h")
    seen = {}
    handle = moe._module.register_forward_hook(lambda module, args, out: seen.update(out=out.detach().clone()))
    with torch.no_grad():
        plain = converted(ids).logits
    handle.remove()
    mine = torch.zeros(2, 6, 48)
    with torch.no_grad(), model.trace(ids):
        read = moe.mlp_output.save()
        logits = model.output.logits.save()
    assert torch.equal(read, seen["out"].reshape(read.shape)) and torch.equal(logits, plain)
    with torch.no_grad(), model.trace(ids):
        moe.mlp_output = mine
        written = model.output.logits.save()
    assert not mine.any() and not torch.equal(written, plain)  # the written tensor is the user's still


def test_one_mlp_module_called_by_two_layers_is_refused():
    """Tied layers: layers[1].mlp read and wrote layer 0's call of the shared module, without a word."""
    model = llama()
    model.model.layers[1].mlp = model.model.layers[0].mlp
    with pytest.raises(moelens.FamilyError, match=r"model\.layers\.1\.mlp is the same dense MLP module as "
                                                  r"model\.layers\.0\.mlp: .*assign a copy\.deepcopy of it"):
        moelens.wrap(model)


def test_a_vision_tower_mlp_on_flat_patches_is_refused_by_name():
    """A dense Qwen2-VL's vision blocks run [patches, D] over every image: the 24 patches of two images were cut
    into two 'rows' of 12 and served as the invoke's [batch, seq, I] (row 1 mixing both images)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=1, in_channels=3),
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        image_token_id=100, vision_start_token_id=101, vision_end_token_id=102, video_token_id=103)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    wrapped = moelens.wrap(model)
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])  # 16 and 8 patches
    ids = torch.tensor([[5, 101] + [100] * 4 + [102, 6, 7, 8, 9], [10, 101] + [100] * 2 + [102, 11, 12, 13, 14, 15, 16]])
    inputs = dict(input_ids=ids, pixel_values=torch.randn(24, 12), image_grid_thw=grid, mm_token_type_ids=(ids == 100).long())
    vision = wrapped.model.visual.blocks[1].mlp
    assert isinstance(vision, Mlp)
    for name in ("mlp_activation", "mlp_output"):
        with pytest.raises(moelens.ValueUnavailable, match=rf"visual\.blocks\.1\.mlp\.{name} cannot be served: this dense "
                                                           r"MLP runs outside the text decoder's layers .* on 24 flat "
                                                           r"tokens .*Read its tensors with plain nnsight"):
            with torch.no_grad(), wrapped.trace(**inputs):
                getattr(vision, name).save()
    with torch.no_grad(), wrapped.trace(**inputs):  # the text decoder's MLPs are served as before
        text = wrapped.layers[0].mlp.mlp_activation.save()
    assert text.shape == (2, ids.shape[1], 48)
