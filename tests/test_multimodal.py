"""Multimodal MoE models traced on prompts that hold images (and audio).

Whole tiny qwen3_vl_moe, glm4v_moe, qwen3_omni_moe (its thinker) and muse_spark models (a
two-layer vision tower, and an audio encoder for the last two, beside the tiny MoE decoder) run
on a left-padded batch whose rows each carry one image (16 patches merged into 4 image tokens)
and, for the last two, an audio clip. The decoder's MoE blocks then see text, image and audio
tokens mixed (with M-RoPE positions in the qwen and glm models): every value moelens serves must still equal plain nnsight's (and the experts
recomputed from their weights), and reading them must leave the logits bit-identical.
"""

from __future__ import annotations

import copy

import nnsight
import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.models.qwen3_omni_moe import (
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

import moelens
from moelens.testing import tiny_config
from moelens.testing.tiny import _reinit

from groundtruth import ascii_tokenizer, raw_values, slots_by_hand

IMAGE, VIDEO, START, END, AUDIO, AUDIO_START, AUDIO_END = 100, 101, 102, 103, 104, 105, 106
#: A small vision tower whose merged patches (2 x 2) land in the decoder's hidden size of 32.
VISION = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2)
#: Families whose audio encoder also feeds the decoder: the prompts carry a clip too.
AUDIO_FAMILIES = ("qwen3_omni_moe", "muse_spark")
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}


def _model(family: str, impl: str) -> torch.nn.Module:
    """The whole tiny multimodal model of ``family``: its tiny decoder, a two-layer vision tower (and audio encoder)."""
    text = tiny_config(family).to_dict()
    if family == "qwen3_vl_moe":
        text["rope_parameters"] = {**MROPE, "mrope_interleaved": True}
        config = AutoConfig.for_model(
            family, text_config=text,
            vision_config={**VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        )
    elif family == "glm4v_moe":
        config = AutoConfig.for_model(
            family, text_config=text, vision_config={**VISION, "image_size": 16},
            image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START, image_end_token_id=END,
            video_start_token_id=104, video_end_token_id=105,
        )
    elif family == "qwen3_omni_moe":  # its thinker: the model that reads the prompt (the talker speaks)
        text["rope_parameters"] = {**MROPE, "interleaved": True}
        config = Qwen3OmniMoeThinkerConfig(
            text_config=text, vision_config={**VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
            audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16,
                              d_model=16, output_dim=32, downsample_hidden_size=8),
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
            audio_token_id=AUDIO, audio_start_token_id=AUDIO_START, audio_end_token_id=AUDIO_END,
        )
        return Qwen3OmniMoeThinkerForConditionalGeneration._from_config(config, experts_implementation=impl)
    else:  # muse_spark: image and audio tokens with no markers around them
        config = AutoConfig.for_model(
            family, text_config=text, out_hidden_size=64, projector_hidden_size=32,
            vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                               patch_size=4, pos_emb_height=4, pos_emb_width=4, merge_size=2, patch_temporal=2),
            audio_config=dict(patch_sizes=[2, 2], hidden_sizes=[8, 16], depths=[1, 1], num_hidden_layers=2,
                              out_hidden_size=32),
            image_token_id=IMAGE, video_token_id=VIDEO, audio_token_id=AUDIO,
        )
    return AutoModelForImageTextToText.from_config(config, experts_implementation=impl)


def _prompts(family: str, batch: int = 2) -> dict[str, torch.Tensor]:
    """Left-padded rows of different lengths: text, one 4-token image (between its markers where the family has
    them), text, and for `AUDIO_FAMILIES` an audio clip's tokens and text."""
    gen = torch.Generator().manual_seed(1)
    marked = family != "muse_spark"
    image = [START] + [IMAGE] * 4 + [END] if marked else [IMAGE] * 4
    audio = {"qwen3_omni_moe": [AUDIO_START] + [AUDIO] * 5 + [AUDIO_END], "muse_spark": [AUDIO] * 2}.get(family, [])
    rows = [torch.randint(3, 90, (2 + row,), generator=gen).tolist() + image
            + torch.randint(3, 90, (3,), generator=gen).tolist() + audio + ([7, 8] if audio else []) for row in range(batch)]
    width = max(map(len, rows))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    prompts = {
        "input_ids": ids, "attention_mask": mask,
        "pixel_values": torch.randn(16 * batch, 3 * 2 * 4 * 4, generator=gen),  # channels x time x patch x patch
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
    }
    if family in ("qwen3_vl_moe", "glm4v_moe"):
        prompts["mm_token_type_ids"] = (ids == IMAGE).long()
    if family == "qwen3_omni_moe":  # 40 frames of 16 mel bins, downsampled to the 5 audio tokens
        prompts["input_features"] = torch.randn(batch, 16, 40, generator=gen)
        prompts["feature_attention_mask"] = torch.ones(batch, 40, dtype=torch.long)
    if family == "muse_spark":  # 8 raw samples, patched to the 2 audio tokens
        prompts["input_values"] = torch.randn(batch, 8, generator=gen)
    return prompts


def _negated(prompts: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    return {**prompts, key: -prompts[key]}


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "glm4v_moe", *AUDIO_FAMILIES])
def test_values_on_image_prompts_equal_plain_nnsight(family, impl):
    torch.manual_seed(0)
    hf = _model(family, impl)
    _reinit(hf, 0)
    hf.eval()
    inputs = _prompts(family)
    assert (inputs["input_ids"] == IMAGE).sum() == 8
    with torch.no_grad():
        plain = hf(**inputs).logits
        assert not torch.allclose(plain, hf(**_negated(inputs, "pixel_values")).logits)  # the images reach the decoder
        for clip in {"input_features", "input_values"} & set(inputs):
            assert not torch.allclose(plain, hf(**_negated(inputs, clip)).logits)  # and the audio
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    blocks = [moe.path.removeprefix("model.") for moe in wrapped.moes]
    assert blocks and all(".language_model.layers." in name for name in blocks)
    with torch.no_grad():  # as the trace below: some vision towers round differently with autograd on
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


def test_set_experts_implementation_takes_the_models_sub_config_names():
    """The dict form switches the decoder's experts by its sub-config's name, and names the keys there are when
    one names none (transformers' switch passed over a misspelt key without a word)."""
    model = moelens.wrap(_model("qwen3_vl_moe", "grouped_mm"))
    model.set_experts_implementation({"text_config": "eager"})
    assert {moe.experts_implementation for moe in model.moes} == {"eager"}
    with pytest.raises(moelens.MoelensError, match=r"'txt_config' names no sub-config of this model; its keys are "
                                                   r"\"\" \(the model's own config\), 'text_config', 'vision_config'\."):
        model.set_experts_implementation({"txt_config": "batched_mm"})
    assert {moe.experts_implementation for moe in model.moes} == {"eager"}


def test_routing_windows_are_cut_at_the_text_decoders_context():
    """A composite config keeps max_position_embeddings in its text config: the windows were 512 tokens long
    against a decoder context of 128 here (one run over all 288 tokens, positions past the context)."""
    from moelens.analysis import collect_routing

    hf = _model("qwen3_vl_moe", "grouped_mm").eval()
    context = hf.config.get_text_config().max_position_embeddings
    assert getattr(hf.config, "max_position_embeddings", None) is None and 2 * context < 288
    item = list(range(3, 99)) * 3  # one 288-token text item: windows [0, 128), [128, 256), [256, 288)
    experts = hf.model.language_model.layers[1].mlp.experts
    seen = []
    handle = experts.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    with torch.no_grad():
        hf(input_ids=torch.tensor([item[context:2 * context]]))  # the second window alone, from a fresh context
    handle.remove()
    cache = collect_routing(moelens.wrap(hf), [item], progress=False)
    second = (cache.position() >= context) & (cache.position() < 2 * context)
    assert torch.equal(cache.indices(1)[second].long().sort(-1).values, seen[0].sort(-1).values)


def test_image_inputs_split_between_invokes_are_refused_with_the_way_to_batch_them():
    """A model wrapped without a tokenizer refused several invokes carrying images by advising to pass them to
    model.trace(...), where nnsight then refused every invoke; the refusal says how to batch them instead. Wrapped with
    a tokenizer, a trace or a generation with images in one of several invokes failed with nnsight's bare "Can't batch
    these inputs; pass text or token ids", which named no input and whose advice drops the images."""
    hf_model = _model("qwen3_vl_moe", "batched_mm")
    prompts = _prompts("qwen3_vl_moe")
    one = {name: value[:16] if name == "pixel_values" else value[:1] for name, value in prompts.items()}
    refused = r"Inputs of other modalities \(image_grid_thw, pixel_values\) cannot be split between invokes: give " \
              r"the processor's whole batch to one invoke, or to model\.trace\(\.\.\.\) with no invokes\."
    plain, with_tokenizer = moelens.wrap(hf_model), moelens.wrap(hf_model, tokenizer=ascii_tokenizer())
    generating = {"max_new_tokens": 2}
    runs = [(plain, "trace", {}, one), (with_tokenizer, "trace", {}, one), (with_tokenizer, "generate", generating, one),
            (with_tokenizer, "generate", generating, {"input_ids": one["input_ids"]})]  # beside an invoke of text alone
    for wrapped, run, options, second in runs:
        with pytest.raises(moelens.MoelensError, match=refused):
            with getattr(wrapped, run)(**options) as tracer:
                with tracer.invoke(**one):
                    wrapped.moes[0].expert_indices.save()
                with tracer.invoke(**second):
                    wrapped.moes[0].expert_indices.save()
    for wrapped, run, options in ((plain, "trace", {}), (with_tokenizer, "trace", {}),
                                  (with_tokenizer, "generate", generating)):
        with getattr(wrapped, run)(**options) as tracer:
            with tracer.invoke(**prompts):  # the whole batch in one invoke
                indices = wrapped.moes[0].expert_indices.save()
        assert indices.shape[:2] == prompts["input_ids"].shape
    ids = one["input_ids"]

    def indices_of_two_text_invokes(**no_images) -> torch.Tensor:  # keywords set to None carry no image
        with with_tokenizer.trace() as tracer:
            with tracer.invoke(ids, **no_images):
                first = with_tokenizer.moes[0].expert_indices.save()
            with tracer.invoke(ids, **no_images):
                second = with_tokenizer.moes[0].expert_indices.save()
        return torch.cat([first, second])

    assert torch.equal(indices_of_two_text_invokes(pixel_values=None, image_grid_thw=None),
                       indices_of_two_text_invokes())


def test_per_token_type_ids_split_between_invokes_are_refused_naming_them():
    """The Qwen3-VL processor gives mm_token_type_ids for text alone too: two such invokes failed with nnsight's bare
    "Can't batch these inputs; pass text or token ids" (wrapped with a tokenizer), or with advice to wrap with one,
    which led there. Ground truth: the model runs each encoding alone, and both without the type ids."""
    hf_model = _model("qwen3_vl_moe", "batched_mm")
    ids = _prompts("qwen3_vl_moe")["input_ids"][:1, :4]
    types = torch.zeros_like(ids)
    hf_model(input_ids=ids, mm_token_type_ids=types)
    for wrapped, refused in (
            (moelens.wrap(hf_model, tokenizer=ascii_tokenizer()),
             r"got mm_token_type_ids, which it cannot split into rows\. Give the whole batch to one invoke"),
            (moelens.wrap(hf_model), r"an invoke got keyword\(s\) \['mm_token_type_ids'\] beside the ids\. Give the "
                                     r"whole batch to one invoke")):
        with pytest.raises(moelens.MoelensError, match=refused):
            with wrapped.trace() as tracer:
                for _ in range(2):
                    with tracer.invoke(ids, mm_token_type_ids=types):
                        wrapped.moes[0].expert_indices.save()
        with wrapped.trace() as tracer:
            for _ in range(2):
                with tracer.invoke(ids):
                    wrapped.moes[0].expert_indices.save()
    text = moelens.wrap(hf_model, tokenizer=ascii_tokenizer())
    with text.trace() as tracer:  # beside text, a tensor keyword is a setting of the whole batch's forward (nnsight's)
        for prompt in ("ab", "cd"):
            with tracer.invoke(prompt, logits_to_keep=torch.tensor([0, 1])):
                logits = text.output.logits.save()
    assert logits.shape[:2] == (1, 2)


def test_wrapping_a_vision_language_model_with_a_tokenizer_logs_no_pipeline_error():
    """nnsight builds a text-generation pipeline for it, and transformers logged a 4.5 KB error ("... is not supported
    for text-generation. Supported models are [~250 names]") on every load, the CLI's included: tracing needs none."""
    import logging

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    records, logger = Records(), logging.getLogger("transformers")  # transformers' own loggers do not propagate
    logger.addHandler(records)
    try:
        wrapped = moelens.wrap(_model("qwen3_vl_moe", "eager"), tokenizer=ascii_tokenizer())
    finally:
        logger.removeHandler(records)
    with wrapped.trace("hello"):
        logits = wrapped.output.logits.save()
    assert logits.shape[:2] == (1, 5) and not [message for message in records.messages if "not supported for" in message]


def _whole_qwen3_omni() -> torch.nn.Module:
    """The whole tiny Qwen3-Omni model (thinker only, no talker), which has no forward of its own."""
    thinker = _model("qwen3_omni_moe", "batched_mm")
    config = Qwen3OmniMoeConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False)
    return Qwen3OmniMoeForConditionalGeneration._from_config(config, experts_implementation="batched_mm").eval()


def test_a_trace_of_the_whole_qwen3_omni_model_says_to_wrap_its_thinker():
    """Qwen3-Omni's whole model has no forward of its own (it only generates through its thinker and talker): a trace
    blamed padding ("takes no attention_mask"), then failed with torch's bare TypeError from _forward_unimplemented."""
    whole = _whole_qwen3_omni()
    wrapped = moelens.wrap(whole)
    assert [moe.path.split(".", 2)[1] for moe in wrapped.moes] == ["thinker"] * len(wrapped.moes) and wrapped.moes
    prompts = _prompts("qwen3_omni_moe")
    for inputs in (prompts, {"input_ids": prompts["input_ids"][1:]}):
        with pytest.raises(moelens.MoelensError, match=r"Qwen3OmniMoeForConditionalGeneration has no forward of its own "
                                                       r".*wrap its thinker, .*moelens\.wrap\(hf_model\.thinker"):
            with wrapped.trace(**inputs):
                wrapped.moes[0].router_logits.save()
    with torch.no_grad():  # its thinker, wrapped as the message says, runs the same prompts
        with moelens.wrap(whole.thinker).trace(**prompts):
            pass


def test_a_late_read_in_a_generation_of_the_whole_qwen3_omni_model_is_refused_at_every_step():
    """moelens tells a generation's steps apart by the forwards of the model, which the whole Qwen3-Omni model never
    runs (its generate runs its thinker's): a value read out of order at a step between the first and the last was
    served the next step's, silently. Refused now, counting the thinker's forwards; in order, each step's own router
    logits (torch hooks on an unwrapped copy)."""
    whole = _whole_qwen3_omni()
    reference = copy.deepcopy(whole)
    wrapped = moelens.wrap(whole, tokenizer=ascii_tokenizer())
    first, second = wrapped.moes[0], wrapped.moes[1]
    ids, settings = torch.tensor([[40, 41, 42, 43]]), dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    truth = []
    router = reference.get_submodule(f"{first.path.removeprefix('model.')}.{first.family.router}")
    handle = router.register_forward_hook(lambda module, args, output: truth.append(output[0]))
    with torch.no_grad():
        reference.generate(input_ids=ids, **settings)
    handle.remove()
    with torch.no_grad(), wrapped.generate(input_ids=ids, **settings) as tracer:
        in_order = nnsight.save([])
        for _ in tracer.iter[1:3]:
            in_order.append(first.router_logits.save())
            second.router_logits.save()
    for got, want in zip(in_order, truth[1:3], strict=True):
        assert torch.equal(got.reshape(want.shape), want)
    with pytest.raises(moelens.errors.OrderError, match=r"layers\.1\.mlp\.router_logits was requested after the model"):
        with torch.no_grad(), wrapped.generate(input_ids=ids, **settings) as tracer:
            for _ in tracer.iter[1:3]:
                second.router_logits.save()
                first.router_logits.save()


def test_the_expert_logit_lens_of_a_vision_language_model_reads_out_through_its_text_decoders_norm():
    """The lens looked for the final norm on model and on the top module only: a *ForConditionalGeneration keeps it
    at model.language_model.norm, so lens.norm was None and the experts were read out unnormalised (tiny models hide
    it: their norm weights are all ones). Ground truth: lm_head(norm(mean output)) by hand."""
    from moelens import analysis

    hf = _model("qwen3_vl_moe", "grouped_mm").eval()
    _reinit(hf, 0)
    norm = hf.model.language_model.norm
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=torch.Generator().manual_seed(5)) * 2)
    generator = torch.Generator().manual_seed(3)
    corpus = [torch.randint(3, 90, (length,), generator=generator).tolist() for length in (5, 9, 13, 20)]
    lens = analysis.expert_logit_lens(moelens.wrap(hf), corpus, progress=False, top=5)
    assert lens.norm == "model.language_model.norm"
    with torch.no_grad():
        for row in range(len(lens.layers)):
            used = lens.counts[row] > 0
            by_hand = hf.lm_head(norm(lens.mean_outputs[row].float())).topk(5, -1).indices
            assert used.any() and torch.equal(lens.top_ids[row][used], by_hand[used])


def test_an_export_reads_the_context_of_the_text_decoder():
    """The export's context length read the top config's max_position_embeddings, which a composite config keeps in
    its text config: no limit was known for a whole vision-language model."""
    from moelens.export.target import resolve

    hf = _model("qwen3_vl_moe", "grouped_mm").eval()
    assert getattr(hf.config, "max_position_embeddings", None) is None
    assert resolve(hf).context_length == hf.config.get_text_config().max_position_embeddings


def test_a_converted_block_in_a_flat_vision_tower_is_refused_by_name():
    """A tomoe block converted inside qwen3_vl_moe's vision tower, which runs flat [patches, D] over every image:
    with a 16-patch and a 32-patch image its values were served as [2, 24, ...], row 0 holding image 0's patches and
    the first 8 of image 1 (and a write by row landed on both images). Refused now, as a dense MLP there is; the
    decoder's blocks are served as before. Ground truth: a forward hook on the converted model's router."""
    from moelens.compress import tomoe

    torch.manual_seed(0)
    hf = _model("qwen3_vl_moe", "batched_mm")
    _reinit(hf, 0)
    converted = tomoe(hf.eval(), num_experts=4, top_k=2, max_error=None, progress=False,
                      target_modules=r".*visual\.blocks\.0\.mlp\.linear_fc1")
    ids = torch.tensor([[5, 6, START] + [IMAGE] * 4 + [END, 7, 8, 9, 10, 11, 12], [5, START] + [IMAGE] * 8 + [END, 7, 8, 9]])
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE).long(),
                  pixel_values=torch.randn(48, 96, generator=torch.Generator().manual_seed(1)),
                  image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 8]]))
    seen = []
    router = converted.get_submodule("model.visual.blocks.0.mlp.linear_fc1.router")
    handle = router.register_forward_hook(lambda module, args, output: seen.append(output[0].clone()) and None)
    with torch.no_grad():
        converted(**inputs)
    handle.remove()
    wrapped = moelens.wrap(converted)
    tower = next(moe for moe in wrapped.moes if ".visual." in moe.path)
    for name in ("router_logits", "expert_indices", "mlp_output"):
        with pytest.raises(moelens.ValueUnavailable, match=rf"linear_fc1\.{name} cannot be served: this block runs "
                                                           r"outside the text decoder .* on flat tokens"):
            with torch.no_grad(), wrapped.trace(**inputs):
                getattr(tower, name).save()
    with torch.no_grad(), wrapped.trace(**inputs):
        raw = tower.router.output[0].save()  # plain nnsight, as the refusal says
        decoder = wrapped.moes[-1].expert_indices.save()
    assert torch.equal(raw, seen[0]) and decoder.shape[:2] == ids.shape


def test_a_block_of_a_skipped_layer_in_a_whole_qwen3_omni_generation_is_not_blamed_on_a_stop():
    """The whole Qwen3-Omni model's generate runs its thinker, never the root's own forward, so a block whose decoder
    layer was skipped was said to be unreached because of a tracer.stop() that was never called. Ground truth: a torch
    forward pre-hook on the block counts no call."""
    whole = _whole_qwen3_omni()
    wrapped = moelens.wrap(whole, tokenizer=ascii_tokenizer())
    block = wrapped.moes[1]
    calls = []
    handle = whole.get_submodule(block.path.removeprefix("model.")).register_forward_pre_hook(
        lambda module, args: calls.append(1))
    try:
        with pytest.raises(moelens.errors.OrderError, match=r"router_logits was not served: .* did not run in this "
                                                            r"trace: a module holding it \(its decoder layer\) was "
                                                            r"skipped") as refused:
            with torch.no_grad(), wrapped.generate(input_ids=torch.tensor([[40, 41, 42, 43]]), thinker_max_new_tokens=1,
                                                   do_sample=False):
                block.parent.skip(block.parent.inputs[0][0])
                block.router_logits.save()
    finally:
        handle.remove()
    assert not calls and "tracer.stop()" not in str(refused.value)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "glm4v_moe", "qwen3_omni_moe"])
def test_text_prompts_of_different_lengths_beside_an_image_keep_the_models_own_positions(family):
    """Texts the wrapped model tokenizes, left-padded, beside image keywords: nnsight gave the batch position_ids
    counted from the mask (its text-only rule, blind to the images beside the encoding), so the model skipped its own
    M-RoPE positions over the image grid and every row's image tokens ran at text positions (qwen3_vl_moe: logits
    0.06 to 0.12 off, other experts picked). Ground truth: the plain model on the same left-padded encoding."""
    hf = _model(family, "batched_mm")
    reference = copy.deepcopy(hf)
    tokenizer = ascii_tokenizer()
    marked = "".join(map(chr, [START, IMAGE, IMAGE, IMAGE, IMAGE, END]))
    texts = ["ab" + marked + "xyz", "abceh" + marked + "x"]  # one 4-token image each, rows of 11 and 12 tokens
    encoded = tokenizer(texts, padding=True, return_tensors="pt", padding_side="left")
    assert (encoded["input_ids"] == IMAGE).sum() == 8 and not encoded["attention_mask"].all()
    image = {key: value for key, value in _prompts(family).items() if key in ("pixel_values", "image_grid_thw")}
    if family != "qwen3_omni_moe":
        image["mm_token_type_ids"] = (encoded["input_ids"] == IMAGE).long()
    with torch.no_grad():
        expected = reference(**encoded, **image).logits
    wrapped = moelens.wrap(hf, tokenizer=tokenizer)
    with torch.no_grad(), wrapped.trace(texts, **image):
        logits = wrapped.output.logits.save()
    assert torch.equal(logits, expected)
