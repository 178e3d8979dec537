"""Token views under batching: several invokes, padding with a mask, generation, bfloat16."""

from __future__ import annotations

import copy
import io
import warnings

import nnsight
import pytest
import torch

import moelens
from groundtruth import CASES, IDS, ascii_tokenizer, built, first_tensor
from moelens.testing import FAMILIES, NOT_DECORATED, tiny_inputs, tiny_model

VALUES = ("router_logits", "expert_weights", "expert_indices", "routed_output", "mlp_output")
DEFAULT_CASES = [case for case in CASES if case[1] == "grouped_mm" or case[0] in NOT_DECORATED]
DEFAULT_IDS = [i for case, i in zip(CASES, IDS) if case in DEFAULT_CASES]
#: Families whose forward needs more than token ids and an attention mask to batch
#: (inputs the padding collator does not know), or whose routing reads token ids.
NO_PADDING = {"deepseek_v4"}


def first_moe(wrapped):
    return next(moe for moe in wrapped.moes if not moe.runs_only_on)


def values_of(moe, names=VALUES):
    order = moe.order()
    return {name: getattr(moe, name).save() for name in order if name in names}


def single(wrapped, ids):
    with wrapped.trace(ids):
        values = nnsight.save(values_of(first_moe(wrapped)))
    return values


@pytest.mark.parametrize(("family", "impl"), CASES, ids=IDS)
def test_invokes_of_different_lengths_see_their_own_tokens(family, impl):
    hf, wrapped, inputs, plain, reference = built(family, impl)
    generator = torch.Generator().manual_seed(1)
    long = torch.randint(4, 120, (1, 7), generator=generator)
    short = torch.randint(4, 120, (2, 3), generator=generator)
    with wrapped.trace() as tracer:
        with tracer.invoke(long):
            first = nnsight.save(values_of(first_moe(wrapped)))
        with tracer.invoke(short):
            second = nnsight.save(values_of(first_moe(wrapped)))
    alone_long, alone_short = single(wrapped, long), single(wrapped, short)
    for name in first:
        assert first[name].shape[:2] == (1, 7) and second[name].shape[:2] == (2, 7), name
        torch.testing.assert_close(first[name], alone_long[name], atol=1e-5, rtol=1e-4)
        if family in NO_PADDING:
            continue
        # the short invoke is left-padded to 7: its own tokens are the last 3 positions
        if name == "expert_indices":
            # a padded batch may route a near-tie differently; compare where the weights agree
            continue
        torch.testing.assert_close(second[name][:, -3:], alone_short[name], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in NO_PADDING])
def test_padded_batch_with_mask_matches_each_row(family):
    hf, wrapped, inputs, plain, reference = built(family, dict(DEFAULT_CASES)[family] if family in dict(DEFAULT_CASES) else "grouped_mm")
    rows = [torch.tensor([[5, 17, 33, 48, 60]]), torch.tensor([[70, 81, 92]])]
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.zeros(2, 5, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, 5 - row.shape[1]:] = row
        mask[index, 5 - row.shape[1]:] = 1
    with wrapped.trace(input_ids=ids, attention_mask=mask):
        batched = nnsight.save(values_of(first_moe(wrapped)))
    for index, row in enumerate(rows):
        alone = single(wrapped, row)
        for name, value in batched.items():
            assert value.shape[:2] == (2, 5)
            if name == "expert_indices":
                continue
            torch.testing.assert_close(value[index : index + 1, 5 - row.shape[1]:], alone[name], atol=1e-4, rtol=1e-3)


GENERATE = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "granitemoeshared", "olmoe", "jamba", "llama4",
            "longcat_flash"]


@pytest.mark.parametrize("family", GENERATE)
def test_generation_serves_values_per_step(family):
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = first_moe(wrapped)
    steps = 3
    with wrapped.generate("hello", max_new_tokens=steps, do_sample=False, min_new_tokens=steps) as tracer:
        logits = nnsight.save([])
        weights = nnsight.save([])
        for _ in tracer.iter[:steps]:
            logits.append(moe.router_logits.save())
            weights.append(moe.expert_weights.save())
    assert [tuple(x.shape[:2]) for x in logits] == [(1, 5)] + [(1, 1)] * (steps - 1)
    assert [tuple(x.shape) for x in weights] == [(1, 5, moe.top_k)] + [(1, 1, moe.top_k)] * (steps - 1)
    # ground truth: the same steps with plain nnsight on the router's own output
    plain = nnsight.NNsight(hf)
    ids = wrapped.tokenizer("hello", return_tensors="pt")["input_ids"]
    generated = hf.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    with plain.trace(generated[:, :-1]):
        full = plain.get(moe.path.removeprefix("model.")).get(moe.family.router).source.__getattr__(
            moe.family.logits_op).output.save()
    full = full.reshape(1, generated.shape[1] - 1, -1)
    step_logits = torch.cat(logits, dim=1)
    torch.testing.assert_close(step_logits, full, atol=1e-5, rtol=1e-4)


def test_selection_scores_ranked_inside_a_router_method_per_step():
    """longcat_flash ranks softmax + bias inside its router's get_topk_indices (drilled into in the run): from
    the second generation step on, selection_scores is that step's softmax(router_logits) + correction bias."""
    hf = tiny_model("longcat_flash")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = wrapped.moes[1]
    with wrapped.generate("hello", max_new_tokens=3, do_sample=False, min_new_tokens=3) as tracer:
        logits, ranked = nnsight.save([]), nnsight.save([])
        for _ in tracer.iter[1:3]:
            logits.append(moe.router_logits.save())
            ranked.append(moe.selection_scores.save())
    assert len(ranked) == 2
    bias = moe._module.router.e_score_correction_bias
    for step_logits, step_ranked in zip(logits, ranked):
        assert step_ranked.shape == (1, 1, moe.num_experts)
        torch.testing.assert_close(step_ranked, step_logits.softmax(-1) + bias)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_model(family):
    hf = tiny_model(family, dtype=torch.bfloat16)  # keeps the family's fp32-only tensors in fp32
    from moelens.testing import tiny_inputs

    inputs = tiny_inputs(hf)
    with torch.no_grad():
        plain = first_tensor(hf(**inputs))
    wrapped = moelens.wrap(hf)
    moe = first_moe(wrapped)
    with wrapped.trace(**inputs):
        values = moe.save_all()
        output = wrapped.output.save()
    assert torch.equal(first_tensor(output), plain)
    batch, seq = inputs["input_ids"].shape
    for name, value in values.items():
        assert value.shape[:2] == (batch, seq), name
    assert values["mlp_output"].dtype == torch.bfloat16 if "mlp_output" in values else True
    if "expert_outputs" in values and "routed_output" in values:
        torch.testing.assert_close(values["expert_outputs"].sum(2).float(), values["routed_output"].float(),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_per_slot_values_first_read_at_a_later_step_are_that_steps(family, impl):
    """nnsight starts counting the ops inside the experts implementation at their first read, while
    ``tracer.iter`` asks for a step counted from the start: reads and writes at steps 1 and 3 only
    must still be those steps' (routed_output, read at the experts module, is counted from step 0)."""
    wrapped = moelens.wrap(tiny_model(family, experts_implementation=impl), tokenizer=ascii_tokenizer())
    moe = first_moe(wrapped)
    steps = 5
    calls = []  # the experts module's output at every step, from a plain forward hook
    handle = moe.experts._module.register_forward_hook(lambda module, args, out: calls.append(out.detach().clone()))
    with wrapped.generate("hello", max_new_tokens=steps, do_sample=False, min_new_tokens=steps) as tracer:
        slots, routed = nnsight.save({}), nnsight.save({})
        for step in tracer.iter[:steps]:
            if step in (1, 3):
                slots[step] = moe.expert_outputs.save()
                routed[step] = moe.routed_output.save()
    handle.remove()
    assert sorted(slots) == [1, 3] and len(calls) == steps
    for step in slots:
        torch.testing.assert_close(slots[step].sum(2), calls[step].reshape(routed[step].shape), atol=1e-6, rtol=1e-5)

    def step_logits(edit) -> list[torch.Tensor]:
        with wrapped.generate("hello", max_new_tokens=steps, do_sample=False, min_new_tokens=steps) as tracer:
            logits = nnsight.save([])
            for step in tracer.iter[:steps]:
                if step == 2:
                    edit()
                logits.append(wrapped.output.logits[:, -1].save())
        return logits

    def zero_first_slot_output():
        moe.expert_outputs[..., 0, :] = 0

    def zero_first_slot_weight():  # the same edit, at the experts call's arguments (counted from step 0)
        moe.expert_weights[..., 0] = 0

    by_output, by_weight = step_logits(zero_first_slot_output), step_logits(zero_first_slot_weight)
    assert len(by_output) == len(by_weight) == steps
    for got, expected in zip(by_output, by_weight):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    untouched = step_logits(lambda: None)
    assert torch.equal(by_output[1], untouched[1]) and not torch.allclose(by_output[2], untouched[2])


def test_generation_rows_follow_the_models_own_config_under_a_given_one():
    """A generation_config that leaves num_return_sequences unset runs the model's own (2): each prompt's two rows
    were served side by side as one [1, 10, k] row, silently; and moelens' disable_compile beside the config made
    transformers warn that the user's call was deprecated."""
    import warnings

    from transformers import GenerationConfig

    hf = tiny_model("mixtral")
    hf.generation_config.do_sample, hf.generation_config.num_return_sequences = True, 2
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = first_moe(wrapped)
    calls = []
    experts = hf.get_submodule(moe.path.removeprefix("model.")).get_submodule(moe.family.experts)
    hook = experts.register_forward_hook(lambda module, args, output: calls.append(args[1].clone()))
    given = GenerationConfig(max_new_tokens=2, do_sample=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with wrapped.generate("hello", generation_config=given):
                indices = moe.expert_indices.save()
    finally:
        hook.remove()
    assert tuple(indices.shape) == (2, 5, 2) and torch.equal(indices, calls[0].view(2, 5, 2))
    assert not [w for w in caught if "generation-related arguments" in str(w.message)]
    assert given.disable_compile is not True  # the user's config is left as it was


def test_beams_from_the_models_own_config_under_a_given_one():
    """num_beams set only in the model's config, with a generation_config given: nnsight read the beams from the
    given config alone, added its streamer, and transformers refused it under beam search."""
    from transformers import GenerationConfig

    hf = tiny_model("mixtral")
    hf.generation_config.num_beams = 2
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    with wrapped.generate("hello", generation_config=GenerationConfig(max_new_tokens=2)):
        indices = first_moe(wrapped).expert_indices.save()
    assert tuple(indices.shape) == (2, 5, 2)  # two beams of the one prompt


@pytest.mark.parametrize(
    "settings", [{"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2}], ids=["beams", "sequences"]
)
def test_generation_with_beams_or_sequences_serves_each_expanded_row(settings):
    """transformers runs every prompt row as max(num_beams, num_return_sequences) consecutive
    rows: each invoke's view holds its prompts' rows, [rows, seq, ...] at every step."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = first_moe(wrapped)
    calls, outputs = [], []
    block = hf.get_submodule(moe.path.removeprefix("model."))
    hooks = [block.get_submodule(moe.family.experts).register_forward_hook(
                 lambda module, args, output: calls.append(args[1].clone())),
             block.register_forward_hook(lambda module, args, output: outputs.append(output.clone()))]

    def generate(second_invoke):
        torch.manual_seed(0)
        with wrapped.generate(max_new_tokens=2, min_new_tokens=2, **settings) as tracer:
            with tracer.invoke(["hello", "abcde"]):
                first = nnsight.save([(moe.expert_indices.save(), moe.mlp_output.save()) for _ in tracer.iter[:2]])
            with tracer.invoke("world"):
                second = nnsight.save([second_invoke() for _ in tracer.iter[:2]])
        return first, second

    try:
        first, second = generate(lambda: (moe.expert_indices.save(), moe.mlp_output.save()))
        steps = outputs[:]
        outputs.clear()
        generate(lambda: moe.mlp_output.zero_())  # an in-place write lands on this invoke's rows
        generate(lambda: setattr(moe, "mlp_output", torch.zeros_like(moe.mlp_output)))  # [2, s, D] spliced in
    finally:
        for hook in hooks:
            hook.remove()
    assert [(tuple(i.shape), tuple(o.shape)) for i, o in first] == [((4, 5, 2), (4, 5, 32)), ((4, 1, 2), (4, 1, 32))]
    assert [(tuple(i.shape), tuple(o.shape)) for i, o in second] == [((2, 5, 2), (2, 5, 32)), ((2, 1, 2), (2, 1, 32))]
    for step, seq in enumerate((5, 1)):
        rows = calls[step].view(6, seq, 2)  # 3 prompts x 2 rows each, in invoke order
        assert torch.equal(first[step][0], rows[:4]) and torch.equal(second[step][0], rows[4:])
        # mlp_output: the block keeps [B, S, D], which nnsight does not cut by invoke under beams
        assert torch.equal(first[step][1], steps[step][:4]) and torch.equal(second[step][1], steps[step][4:])
    for written in (outputs[:2], outputs[2:]):  # the zeroing run's steps, then the assigning run's
        for step in written:
            assert (step[4:] == 0).all() and (step[:4] != 0).any(dim=-1).all()


@pytest.mark.parametrize("image_tokens", [2, 3], ids=["even-split", "uneven-split"])
def test_blocks_given_a_modality_subset_refuse_a_batch_layout(image_tokens):
    """ernie4_5_vl_moe sends image tokens (moe_mm_token_type_ids) to vision_moe and the rest to text_moe, each
    gathered out of the batch: with a token count divisible by the batch size both were served as
    [batch, count / batch, ...], rows mixing tokens of different sequences."""
    hf = tiny_model("ernie4_5_vl_moe")
    wrapped = moelens.wrap(hf)
    text_moe, vision_moe = wrapped.moes[0], wrapped.moes[1]
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9], [5, 6, 7, 10, 11, 12, 8, 9]])
    types = torch.zeros_like(ids)
    types[0, 3:3 + image_tokens] = 1  # images in the first row only
    for moe in (text_moe, vision_moe):
        with pytest.raises(moelens.ValueUnavailable, match=r"ran on part of the tokens, gathered out of the batch"):
            with wrapped.trace(input_ids=ids, moe_mm_token_type_ids=types):
                moe.router_logits.save()
    with wrapped.trace(input_ids=ids):  # text only: text_moe sees every token
        logits = text_moe.router_logits.save()
    assert logits.shape == (2, 8, text_moe.num_experts)


def test_save_all_that_reads_none_of_the_values_asked_says_why():
    """ernie4_5_vl_moe's text_moe on a prompt with image tokens, and per-slot values asked of an eager block, gave
    empty dicts without a word. Each warns with the reason strict=True raises; a save_all that reads a value does
    not warn."""
    wrapped = moelens.wrap(tiny_model("ernie4_5_vl_moe"))
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9], [5, 6, 7, 10, 11, 12, 8, 9]])
    types = torch.zeros_like(ids)
    types[0, 3:5] = 1
    gathered = r"cannot be served: this call of the block ran on part of the tokens, gathered out of the batch"
    with pytest.warns(UserWarning, match=r"^model.save_all\(\) read none of the values asked of "
                                         r"model.layers.1.mlp.text_moe \(and 2 more blocks\): model.layers.1.mlp."
                                         rf"text_moe.router_logits {gathered}.* Pass strict=True to raise this"):
        with torch.no_grad(), wrapped.trace(input_ids=ids, moe_mm_token_type_ids=types):
            values = wrapped.save_all()
    assert values == {1: {}, 2: {}, 3: {}}
    with pytest.raises(moelens.ValueUnavailable, match=gathered):
        with torch.no_grad(), wrapped.trace(input_ids=ids, moe_mm_token_type_ids=types):
            wrapped.save_all(strict=True)
    wrapped.set_experts_implementation("eager")
    per_slot = r"expert_activations cannot be served: per-slot values exist only inside the grouped_mm"
    with pytest.warns(UserWarning, match=rf"^model.layers.1.mlp.text_moe.save_all\(\) read none of the values asked: "
                                         rf"model.layers.1.mlp.text_moe.{per_slot}"):
        with torch.no_grad(), wrapped.trace(input_ids=ids):
            values = wrapped.moes[0].save_all(["expert_outputs", "expert_activations"])
    assert values == {}
    with pytest.raises(moelens.ValueUnavailable, match=per_slot):
        with torch.no_grad(), wrapped.trace(input_ids=ids):
            wrapped.moes[0].save_all(["expert_outputs", "expert_activations"], strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), wrapped.trace(input_ids=ids):
            values = wrapped.save_all()
        with torch.no_grad(), wrapped.trace(input_ids=ids):
            some = wrapped.moes[0].save_all(["expert_outputs", "router_logits"])
        with torch.no_grad(), wrapped.trace(input_ids=ids):
            nothing = wrapped.save_all([])
        with torch.no_grad(), wrapped.trace(input_ids=ids):
            first = wrapped.save_all()[1]  # one block's dict, taken out in the trace (it was a NameError after it)
    assert list(some) == ["router_logits"] and all("router_logits" in block for block in values.values())
    assert nothing == {1: {}, 2: {}, 3: {}} and torch.equal(first["router_logits"], values[1]["router_logits"])
    mixtral = moelens.wrap(tiny_model("mixtral"))  # a value outside order(): no shared expert in this family
    with pytest.warns(UserWarning, match=r"^model.model.layers.0.mlp.save_all\(\) read none of the values asked: "
                                         r"model.model.layers.0.mlp.shared_expert_output cannot be served: the mixtral"):
        with torch.no_grad(), mixtral.trace(input_ids=ids):
            values = mixtral.moes[0].save_all(value for value in ["shared_expert_output"])
    assert values == {}


def test_a_modality_block_called_by_keyword_is_refused_as_by_position():
    """A block given its gathered tokens by keyword (block(hidden_states=x), as a custom layer may call it) was
    noted as getting the whole batch (the note's pre-hook saw positional arguments only): its values were served
    as a made-up [2, 7, ...] view, row 1 starting at the last text token of sequence 0."""
    hf = tiny_model("ernie4_5_vl_moe")
    blocks = [layer.mlp.text_moe for layer in hf.layers if hasattr(layer.mlp, "text_moe")]
    by_keyword = lambda module, args, kwargs: ((), {"hidden_states": args[0], **kwargs}) if args else None  # noqa: E731
    handles = [block.register_forward_pre_hook(by_keyword, with_kwargs=True) for block in blocks]  # before wrap's
    seen = []
    handles.append(blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((len(args), kwargs["hidden_states"].dim())), with_kwargs=True))
    try:
        wrapped = moelens.wrap(hf)
        ids = torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9], [5, 6, 7, 10, 11, 12, 8, 9]])
        types = torch.zeros_like(ids)
        types[0, 3:5] = 1  # 14 text tokens: a made-up [2, 7, ...] view would fit
        with pytest.raises(moelens.ValueUnavailable, match=r"ran on part of the tokens, gathered out of the batch"):
            with wrapped.trace(input_ids=ids, moe_mm_token_type_ids=types):
                wrapped.moes[0].router_logits.save()
        assert seen and seen[0][0] == 0 and seen[0][1] < 3  # the block did get its 14 tokens flat, by keyword
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("name", ["router_logits", "expert_weights", "expert_indices"])
def test_blocks_given_a_modality_subset_refuse_a_write_too(name):
    """A write to a block whose call got tokens gathered out of the batch was laid flat over them, as if they were
    [batch, count / batch]: half of row 0's values landed on row 1's tokens, with no error. It is refused as the
    read is; caught in the trace, the model runs unedited (ground truth: the unwrapped model's output)."""
    hf = tiny_model("ernie4_5_vl_moe")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    text_moe = wrapped.moes[0]
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9], [5, 6, 7, 10, 11, 12, 8, 9]], device=hf.device)
    types = torch.zeros_like(ids)
    types[0, 3:5] = 1  # 14 text tokens: a made-up [2, 7, ...] view would fit
    with torch.no_grad():
        plain = first_tensor(reference(input_ids=ids, moe_mm_token_type_ids=types))
    width = text_moe.num_experts if name == "router_logits" else text_moe.top_k
    refusals = []
    with torch.no_grad(), wrapped.trace(input_ids=ids, moe_mm_token_type_ids=types):
        written = torch.zeros(2, 7, width, dtype=torch.long if name == "expert_indices" else torch.float32)
        try:
            setattr(text_moe, name, written)
        except moelens.ValueUnavailable as refusal:
            refusals.append(str(refusal))
        logits = first_tensor(wrapped.output).save()
    assert len(refusals) == 1 and "ran on part of the tokens, gathered out of the batch" in refusals[0]
    torch.testing.assert_close(logits, plain, rtol=0, atol=0)


def test_the_hook_noting_gathered_calls_goes_with_its_wrapper():
    """ernie4_5_vl_moe's blocks note each call's input shape in a forward pre-hook: it stayed on the user's
    model once the wrapped model was gone. Each wrapper now has its own, taken off when it is collected."""
    import gc

    hf = tiny_model("ernie4_5_vl_moe")
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9], [5, 6, 7, 10, 11, 12, 8, 9]])
    types = torch.zeros_like(ids)
    types[0, 3:5] = 1
    hooked = lambda: {name: len(module._forward_pre_hooks) for name, module in hf.named_modules()  # noqa: E731
                      if module._forward_pre_hooks}
    first, second = moelens.wrap(hf), moelens.wrap(hf)
    blocks = {moe._module for moe in first.moes}
    with second.trace(input_ids=ids):  # text only: served, and noted as a call on every token
        second.moes[0].expert_indices.save()
    assert set(hooked().values()) == {2} and len(hooked()) == len(blocks)
    del first, second
    locals()  # refreshes this frame's locals snapshot, which nnsight read in the trace (Python 3.11 keeps it)
    gc.collect()
    assert hooked() == {}
    assert not any("_moelens_tokens_gathered" in vars(block) for block in blocks)
    third = moelens.wrap(hf)
    with pytest.raises(moelens.ValueUnavailable, match=r"ran on part of the tokens"):
        with third.trace(input_ids=ids, moe_mm_token_type_ids=types):
            third.moes[1].router_logits.save()


def test_copies_of_a_wrapped_model_do_not_keep_its_gathered_call_hooks():
    """copy.deepcopy copies a module's hooks: a copy of the wrapped model had its blocks noted twice, and kept one
    hook for good once its wrapper was gone; a copy of the transformers model kept one for good."""
    import copy
    import gc

    hf = tiny_model("ernie4_5_vl_moe")
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9]], device=hf.device)
    hooks = lambda model: sorted({len(module._forward_pre_hooks) for module in model.modules()  # noqa: E731
                                  if type(module).__name__ == "Ernie4_5_VLMoeSparseMoeBlock"})
    wrapped = moelens.wrap(hf)
    copied = copy.deepcopy(wrapped)
    assert hooks(copied._module) == [1] and hooks(hf) == [1]  # its own, not the original's too
    module = copied._module
    del copied
    gc.collect()
    assert hooks(module) == [0]
    with torch.no_grad(), wrapped.trace(input_ids=ids, moe_mm_token_type_ids=torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0]])):
        wrapped.output.save()  # the blocks' calls noted on them: the copy below takes the notes along (kept for good)
    plain = copy.deepcopy(hf)  # taken while hf is wrapped: its hooks come along, and go at each block's first call
    with torch.no_grad():
        plain(input_ids=ids, moe_mm_token_type_ids=torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0]], device=hf.device))  # text and image blocks
    assert hooks(plain) == [0] and not any("_moelens_tokens_gathered" in vars(m) for m in plain.modules())
    assert hooks(hf) == [1]
    saved = io.BytesIO()
    torch.save(hf, saved)  # the hook pickles too (a weak reference did not), as a note of no wrapper
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
    loaded(input_ids=ids, moe_mm_token_type_ids=torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0]], device=hf.device))
    assert hooks(loaded) == [0] and hooks(hf) == [1]


def test_a_model_pickled_with_the_earlier_hook_function_loads_and_sheds_it():
    """moelens 0.1 pickled the hook of a wrapped ernie4_5_vl_moe block as the function
    moelens.components.moe._note_gathered: such a model still loads, its hook inert until the block's first call."""
    import pickle

    earlier = pickle.loads(b"cmoelens.components.moe\n_note_gathered\n.")  # the global such a pickle names
    hf = tiny_model("ernie4_5_vl_moe")
    for module in hf.modules():
        if type(module).__name__ == "Ernie4_5_VLMoeSparseMoeBlock":
            module.register_forward_pre_hook(earlier)  # as the loaded model holds it
    with torch.no_grad():
        hf(input_ids=torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9]], device=hf.device),
           moe_mm_token_type_ids=torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0]], device=hf.device))
    assert not [module for module in hf.modules() if module._forward_pre_hooks or "_moelens_tokens_gathered" in vars(module)]


def test_a_shallow_copy_of_a_block_leaves_the_original_noted():
    """copy.copy of a block shares its hooks: calling the copy took the original's hook off, so the original's
    note went stale (a gathered call served as [batch, seq], rows mixing sequences)."""
    import copy

    hf = tiny_model("ernie4_5_vl_moe")
    wrapped = moelens.wrap(hf)
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 8, 9], [5, 6, 7, 10, 11, 12, 8, 9]])
    types = torch.zeros_like(ids)
    types[0, 3:5] = 1
    block = wrapped.moes[0]._module
    with torch.no_grad():
        copy.copy(block)(torch.zeros(2, 8, hf.config.hidden_size, device=hf.device))  # a call of the copy, every token
    with pytest.raises(moelens.ValueUnavailable, match=r"ran on part of the tokens"):
        with wrapped.trace(input_ids=ids, moe_mm_token_type_ids=types):
            wrapped.moes[0].router_logits.save()


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("no_grad", [False, True])
def test_a_transplant_between_invokes_at_a_barrier_lands(impl, no_grad):
    """Routing patched from a clean invoke into a corrupted one (nnsight's tracer.barrier), the corrupted
    invoke having read its own first: the clean invoke's write-back, landing later, handed back the
    whole flat [T, k] tensor it had read and undid the write, silently."""
    hf, wrapped, inputs, plain, reference = built("mixtral", impl)
    moe = wrapped.moes[0]
    clean, corrupt = torch.tensor([[5, 9, 14, 3, 30]]), torch.tensor([[7, 9, 21, 3, 40]])
    seq = clean.shape[1]
    experts = reference.get_submodule(moe.experts.path.removeprefix("model."))

    def by_hand(positions: list[int]) -> torch.Tensor:
        """The corrupted row's logits, run with the clean row's expert indices at ``positions``."""
        def patched(module, args):
            indices = args[1].clone()
            indices[[seq + p for p in positions]] = indices[positions]
            return (args[0], indices, args[2])

        hook = experts.register_forward_pre_hook(patched)
        try:
            with torch.no_grad():
                return first_tensor(reference(torch.cat([clean, corrupt]).to(hf.device)))[1]
        finally:
            hook.remove()

    def transplant(patch) -> torch.Tensor:
        box = []
        with torch.set_grad_enabled(not no_grad), wrapped.trace() as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke(clean):
                box.append(moe.expert_indices)
                barrier()
            with tracer.invoke(corrupt):
                own = moe.expert_indices  # looked at before the barrier
                barrier()
                patch(own, box[0])
                logits = first_tensor(wrapped.output)[0].save()
        return logits.detach()

    def assign(own, clean_indices):
        moe.expert_indices = clean_indices

    def position_two(own, clean_indices):
        own[:, 2] = clean_indices[:, 2]  # in place

    whole, position = transplant(assign), transplant(position_two)
    assert not torch.allclose(whole, by_hand([]))
    torch.testing.assert_close(whole, by_hand(list(range(seq))))
    torch.testing.assert_close(position, by_hand([2]))


def two_invokes_edited_by_hand(impl: str):
    """(the wrapped mixtral, its first block, two prompts' ids, the logits of the unwrapped model run on both with
    slot 0 of the first prompt's tokens sent to expert 1 and of the second's to expert 2 by a pre-hook on its
    experts): the ground truth of edits made in two invokes."""
    hf, wrapped, inputs, plain, reference = built("mixtral", impl)
    moe = wrapped.moes[0]
    first, second = torch.tensor([[5, 9, 14, 3, 30]]), torch.tensor([[7, 9, 21, 3, 40]])
    seq = first.shape[1]
    experts = reference.get_submodule(moe.experts.path.removeprefix("model."))

    def patched(module, args):
        indices = args[1].clone()
        indices[:seq, 0], indices[seq:, 0] = 1, 2
        return (args[0], indices, args[2])

    hook = experts.register_forward_pre_hook(patched)
    try:
        with torch.no_grad():
            expected = first_tensor(reference(torch.cat([first, second]).to(hf.device)))
    finally:
        hook.remove()
    return wrapped, moe, first, second, expected


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("order", ["in-place-first", "assignment-first"])
def test_both_invokes_edit_their_own_rows_after_a_barrier(impl, grad, order):
    """Each invoke edits its own rows of the experts call's indices after a barrier, one in place and one by
    assignment: both land. Ground truth: the model run with both edits made by a pre-hook on its experts."""
    wrapped, moe, first, second, expected = two_invokes_edited_by_hand(impl)

    def in_place(own, expert):
        own[:, :, 0] = expert

    def assignment(own, expert):
        moe.expert_indices = own.clone().index_fill_(-1, torch.tensor([0], device=own.device), expert)

    edits = (in_place, assignment) if order == "in-place-first" else (assignment, in_place)
    logits = []
    with torch.set_grad_enabled(grad), wrapped.trace() as tracer:
        barrier = tracer.barrier(2)
        for ids, edit, expert in ((first, edits[0], 1), (second, edits[1], 2)):
            with tracer.invoke(ids):
                own = moe.expert_indices
                barrier()
                edit(own, expert)
                logits.append(first_tensor(wrapped.output)[0].save())
    torch.testing.assert_close(torch.stack([row.detach() for row in logits]), expected)


def _encoder(kind):
    """A tiny encoder: RoBERTa and I-BERT count positions past their padding id (from padding_idx + 1); a BERT whose
    position table has a padding_idx (as LXMERT's) counts from 0 all the same."""
    from transformers import BertConfig, BertModel, IBertConfig, IBertModel, RobertaConfig, RobertaModel

    torch.manual_seed(0)
    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=70, pad_token_id=1)
    model_class, config_class = {"roberta": (RobertaModel, RobertaConfig), "ibert": (IBertModel, IBertConfig),
                                 "bert-padding-idx": (BertModel, BertConfig)}[kind]
    model = model_class(config_class(**sizes)).eval()
    if kind == "bert-padding-idx":
        model.embeddings.position_embeddings.padding_idx = 0
    return model


@pytest.mark.parametrize("kind", ["roberta", "ibert", "bert-padding-idx"])
@pytest.mark.parametrize("second_length", [5, 9], ids=["shorter", "same-length"])
def test_token_id_invokes_of_a_model_counting_positions_past_its_padding_run_as_alone(kind, second_length):
    """A model wrapped without a tokenizer, token-id invokes: moelens gave every row positions counted from 0, and
    RoBERTa and I-BERT (dense models moelens wraps too) count their own past the padding id, from padding_idx + 1:
    every token moved, by up to 3 in the output, also where no row was padded. A model counting from 0 beside a
    padding_idx in its position table keeps the positions moelens gives. Ground truth: each invoke's ids alone."""
    hf = _encoder(kind)
    wrapped = moelens.wrap(hf)
    first, second = torch.randint(3, 128, (1, 9)), torch.randint(3, 128, (1, second_length))
    with torch.no_grad():
        expected = [hf(input_ids=ids).last_hidden_state for ids in (first, second)]
        with wrapped.trace() as tracer:
            with tracer.invoke(first):
                first_out = wrapped.output.last_hidden_state.save()
            with tracer.invoke(second):
                second_out = wrapped.output.last_hidden_state.save()
    torch.testing.assert_close(first_out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second_out[:, -second_length:], expected[1], rtol=1e-5, atol=1e-5)


def _prefilled(hf, prompt):
    with torch.no_grad():
        return hf(input_ids=prompt, use_cache=True).past_key_values


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_token_id_invokes_over_a_cache_run_at_the_cached_positions(family):
    """Without a tokenizer, invokes of one length over a key-value cache run as transformers runs their ids
    together (the cache attended, positions after it); the values are that step's router's."""
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    moe = first_moe(wrapped)
    prompt = torch.tensor([[5, 17, 33, 48, 60], [70, 81, 92, 11, 12]], device=hf.device)
    step = torch.tensor([[40], [50]], device=hf.device)
    with torch.no_grad():
        expected = hf(input_ids=step, past_key_values=_prefilled(hf, prompt)).logits
        plain = nnsight.NNsight(hf)
        with plain.trace(input_ids=step, past_key_values=_prefilled(hf, prompt)):
            router = plain.get(moe.path.removeprefix("model.")).get(moe.family.router)
            expected_logits = router.source.__getattr__(moe.family.logits_op).output.save()
        with wrapped.trace(past_key_values=_prefilled(hf, prompt)) as tracer:
            with tracer.invoke(step[:1]):
                first_logits, first = moe.router_logits.save(), wrapped.output.logits.save()
            with tracer.invoke(step[1:]):
                second_logits, second = moe.router_logits.save(), wrapped.output.logits.save()
    torch.testing.assert_close(torch.cat([first, second]), expected, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([first_logits, second_logits]).reshape(expected_logits.shape),
                               expected_logits, rtol=0, atol=0)


def test_token_id_invokes_of_different_lengths_over_a_cache_need_the_traces_mask():
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    prompt = torch.tensor([[5, 17, 33], [70, 81, 92]], device=hf.device)
    long, short = torch.tensor([[40, 41]]), torch.tensor([[50]])
    with pytest.raises(moelens.MoelensError, match=r"different lengths over a key-value cache .* pass attention_mask "
                                                   r"\(over the cache and the new tokens\) and position_ids"):
        with wrapped.trace(past_key_values=_prefilled(hf, prompt)) as tracer:
            with tracer.invoke(long):
                wrapped.output.logits.save()
            with tracer.invoke(short):
                wrapped.output.logits.save()
    # with the trace's own mask and positions, the left-padded step is transformers' with them
    ids = torch.tensor([[40, 41], [0, 50]], device=hf.device)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1]], device=hf.device)
    positions = torch.tensor([[3, 4], [3, 3]], device=hf.device)
    with pytest.raises(moelens.MoelensError, match=r"and position_ids to model.trace\(...\) \(not given: position_ids\)"):
        with wrapped.trace(past_key_values=_prefilled(hf, prompt), attention_mask=mask) as tracer:  # positions from
            with tracer.invoke(long):  # the cache alone would ignore the left padding
                wrapped.output.logits.save()
            with tracer.invoke(short):
                wrapped.output.logits.save()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions,
                      past_key_values=_prefilled(hf, prompt)).logits
        with wrapped.trace(past_key_values=_prefilled(hf, prompt), attention_mask=mask, position_ids=positions) as tracer:
            with tracer.invoke(long):
                first = wrapped.output.logits.save()
            with tracer.invoke(short):
                second = wrapped.output.logits.save()
    torch.testing.assert_close(torch.cat([first, second]), expected, rtol=0, atol=0)


def test_text_invokes_over_a_cache_given_to_the_trace_attend_the_cache():
    """With a tokenizer, text in an invoke over model.trace(past_key_values=...) ran with the mask built for the new
    tokens alone (the check looked for the cache among the invokes' keywords only): the cached tokens were not
    attended, silently (the same text given to model.trace itself was refused). An unpadded batch now runs as
    transformers runs it over a cache without a mask; a padded one (invokes of different lengths) needs the trace's
    mask over the cache and its positions. Ground truth: plain transformers on the cached and new tokens in one
    forward, each row alone."""
    hf = tiny_model("mixtral")
    reference = copy.deepcopy(hf)
    tokenizer = ascii_tokenizer()
    wrapped = moelens.wrap(hf, tokenizer=tokenizer)

    def prefilled(*prompts):
        with torch.no_grad(), wrapped.trace(list(prompts), use_cache=True):
            out = wrapped.output.save()
        return out.past_key_values

    with torch.no_grad():
        whole = reference(**tokenizer(["helloab"], return_tensors="pt")).logits
        alone = reference(**tokenizer(["worldc"], return_tensors="pt")).logits
        with wrapped.trace("ab", past_key_values=prefilled("hello")):
            given = wrapped.output.logits.save()
        with wrapped.trace(past_key_values=prefilled("hello")) as tracer:
            with tracer.invoke("ab"):
                invoked = wrapped.output.logits.save()
        with wrapped.trace(past_key_values=prefilled("hello"), attention_mask=torch.ones(1, 7, dtype=torch.long)) as tracer:
            with tracer.invoke("ab"):
                masked = wrapped.output.logits.save()
        with wrapped.trace(past_key_values=prefilled("hello", "world")) as tracer:  # one length: no padding
            with tracer.invoke("ab"):
                first_same = wrapped.output.logits.save()
            with tracer.invoke("cd"):
                wrapped.output.logits.save()
    for continued in (given, invoked, masked, first_same):
        torch.testing.assert_close(continued[0, -1], whole[0, -1], rtol=1e-5, atol=1e-5)
    built = r"the attention_mask of shape \(2, 2\) \(built for the invokes' own tokens, not the cached ones: over a cache " \
            r"pass attention_mask=, covering the cached and the new tokens, to model.trace\(...\)\) does not fit"
    with pytest.raises(moelens.MoelensError, match=built), torch.no_grad():
        with wrapped.trace(past_key_values=prefilled("hello", "world")) as tracer:
            with tracer.invoke("ab"):
                wrapped.output.logits.save()
            with tracer.invoke("c"):
                wrapped.output.logits.save()
    mask = torch.tensor([[1] * 7, [1] * 5 + [0, 1]])
    with pytest.raises(moelens.MoelensError, match=r"invokes of different lengths over a key-value cache .* their "
                                                   r"position_ids are counted from 0 in each row"), torch.no_grad():
        with wrapped.trace(past_key_values=prefilled("hello", "world"), attention_mask=mask) as tracer:
            with tracer.invoke("ab"):
                wrapped.output.logits.save()
            with tracer.invoke("c"):
                wrapped.output.logits.save()
    with torch.no_grad():  # with positions after the cache too: each row's continuation
        with wrapped.trace(past_key_values=prefilled("hello", "world"), attention_mask=mask,
                           position_ids=torch.tensor([[5, 6], [5, 5]])) as tracer:
            with tracer.invoke("ab"):
                first = wrapped.output.logits.save()
            with tracer.invoke("c"):
                second = wrapped.output.logits.save()
    torch.testing.assert_close(first[0, -1], whole[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[0, -1], alone[0, -1], rtol=1e-5, atol=1e-5)


def test_text_over_a_cache_on_a_model_that_cannot_generate_attends_the_cache():
    """A base model (feature-extraction pipeline): the cache given to model.trace beside text went to the forward
    after the batch's checks, so the mask of the new tokens alone was kept and the cache not attended (off by 1.8).
    Ground truth: transformers on the whole text in one forward."""
    from transformers import MixtralModel

    from moelens.testing import tiny_config

    torch.manual_seed(0)
    hf = MixtralModel(tiny_config("mixtral")).eval()
    reference = copy.deepcopy(hf)
    tokenizer = ascii_tokenizer()
    wrapped = moelens.wrap(hf, tokenizer=tokenizer)
    with torch.no_grad():
        whole = reference(**tokenizer(["helloab"], return_tensors="pt")).last_hidden_state
        cache = reference(**tokenizer(["hello"], return_tensors="pt"), use_cache=True).past_key_values
        with wrapped.trace("ab", past_key_values=cache):
            continued = wrapped.output.last_hidden_state.save()
    torch.testing.assert_close(continued[0, -1], whole[0, -1], rtol=1e-5, atol=1e-5)


def test_token_id_invokes_over_a_cache_on_a_model_with_a_tokenizer_attend_the_cache():
    """The mask nnsight built for ids of an invoke covered the new tokens alone (the cache unattended, silently).
    Ground truth: transformers on the ids over the same cache, given no mask."""
    hf = tiny_model("mixtral")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    prompt, step = torch.tensor([[104, 101, 108, 108, 111]]), torch.tensor([[97, 98]])
    with torch.no_grad():
        expected = reference(input_ids=step, past_key_values=_prefilled(reference, prompt)).logits
        with wrapped.trace(past_key_values=_prefilled(hf, prompt)) as tracer:
            with tracer.invoke(step):
                logits = wrapped.output.logits.save()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_cache_given_by_transformers_new_keyword_is_one():
    """transformers 5.25 takes the key-value cache as cache= (past_key_values= deprecated): moelens looked for the old
    name only, so text over cache= kept the mask of the new tokens alone (the cache unattended, off by 0.29), a mask
    over the cache and the new ids was refused as misfit, and invokes of different lengths ran silently off. Ground
    truth: transformers on the cached and the new tokens in one forward, and over the same cache. Before 5.25 the
    forward's **kwargs take cache= and drop it: refused there."""
    import inspect

    hf = tiny_model("qwen3_moe")
    reference = copy.deepcopy(hf)
    tokenizer = ascii_tokenizer()
    prompt, step = tokenizer(["hello"], return_tensors="pt").input_ids, tokenizer(["ab"], return_tensors="pt").input_ids
    if "cache" not in inspect.signature(hf.forward).parameters:  # before 5.25: **kwargs take it, and it is not used
        with pytest.raises(moelens.MoelensError, match=r"cache= is not a keyword of Qwen3MoeForCausalLM.forward: "
                                                       r"transformers before 5.25 takes the key-value cache as "
                                                       r"past_key_values, and would run the model without it"):
            with torch.no_grad(), moelens.wrap(hf).trace(step, cache=_prefilled(reference, prompt)):
                pass
        return
    with torch.no_grad():
        whole = reference(input_ids=torch.cat([prompt, step], 1)).logits
        over = reference(input_ids=step, cache=_prefilled(reference, prompt)).logits
        with_tokenizer = moelens.wrap(hf, tokenizer=tokenizer)
        with with_tokenizer.trace("ab", cache=_prefilled(hf, prompt)):
            text = with_tokenizer.output.logits.save()
        wrapped = moelens.wrap(copy.deepcopy(reference))
        mask = torch.ones(1, prompt.shape[1] + step.shape[1], dtype=torch.long)
        with wrapped.trace(step, attention_mask=mask, cache=_prefilled(reference, prompt)):
            ids = wrapped.output.logits.save()
    torch.testing.assert_close(text[0, -1], whole[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ids, over, rtol=0, atol=0)
    with pytest.raises(moelens.MoelensError, match=r"invokes of different lengths over a key-value cache"):
        with torch.no_grad(), wrapped.trace(cache=_prefilled(reference, prompt)) as tracer:
            with tracer.invoke(step):
                wrapped.output.logits.save()
            with tracer.invoke(step[:, :1]):
                wrapped.output.logits.save()


@pytest.mark.parametrize(("invoke", "named"), [
    (lambda tracer, ids: tracer.invoke(ids, use_cache=False), r"an invoke got keyword\(s\) \['use_cache'\] beside the ids"),
    (lambda tracer, ids: tracer.invoke(ids, torch.ones_like(ids)), r"an invoke got 2 inputs \(ids and a Tensor\)"),
], ids=["keyword", "second-positional"])
def test_token_id_invokes_with_more_than_ids_are_refused_by_name(invoke, named):
    wrapped = moelens.wrap(tiny_model("mixtral"))
    ids = torch.tensor([[5, 17, 33]])
    with pytest.raises(moelens.MoelensError, match=named + r".*Pass settings that hold for the whole batch to model\.trace"):
        with wrapped.trace() as tracer:
            with invoke(tracer, ids):
                wrapped.output.logits.save()
            with tracer.invoke(ids):
                wrapped.output.logits.save()


def test_top_1_activations_in_a_batched_single_token_step_are_refused_not_mixed_up():
    """With top-1 routing nnsight cuts grouped_mm's expert-sorted rows by invoke in a decode step: the rows of
    two invokes would be mixed up (an IndexError here); moelens refuses the read and names the way out."""
    hf = tiny_model("mixtral", experts_implementation="grouped_mm", num_experts_per_tok=1)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = wrapped.moes[0]
    with pytest.raises(moelens.ValueUnavailable, match=r"nnsight cuts the expert-sorted rows by invoke, which mixes "
                                                       r'up tokens.*set_experts_implementation\("batched_mm"\)'):
        with torch.no_grad(), wrapped.generate(max_new_tokens=2, min_new_tokens=2) as tracer:
            with tracer.invoke("hello"):
                for _ in tracer.iter[:2]:
                    moe.expert_activations.save()
            with tracer.invoke("world"):
                for _ in tracer.iter[:2]:
                    moe.expert_activations.save()


def test_an_edit_after_save_all_whose_last_value_is_refused_late_lands_or_says_why():
    """save_all asks for each value it was given; one refused only as the model reaches it (top-1 activations in a
    batched single-token step) has run the model past the value read before it. Where that value is a view of the
    model's tensor (no_grad), the model still reads the edit: zero routing weights give a zero routed output.
    Where it is a copy (inference_mode), the edit is lost, and the late-edit error said "after the model had used
    it (a later value of the run was read first)" of a value the model had not used and save_all left out: it now
    says the value was handed back, and names the refusal."""
    hf = tiny_model("mixtral", experts_implementation="grouped_mm", num_experts_per_tok=1)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = wrapped.moes[0]

    def edited_after_save_all(mode):
        with mode(), wrapped.generate(max_new_tokens=2, min_new_tokens=2) as tracer:
            with tracer.invoke("hello"):
                for _ in tracer.iter[1:2]:  # the decode step: one token per row, both invokes batched
                    values = moe.save_all(["expert_weights", "expert_activations"])
                    values["expert_weights"].mul_(0)
                    routed = moe.routed_output.save()
                    names = nnsight.save(list(values))
            with tracer.invoke("world"):
                pass
        return names, routed

    names, routed = edited_after_save_all(torch.no_grad)
    assert names == ["expert_weights"] and routed.abs().max() == 0
    with pytest.raises(moelens.OrderError, match=rf"{moe.path}.expert_weights was edited in place after moelens had "
                                                 r"handed it back to the model \(once a later value of the run was "
                                                 r"asked for: read, or refused only once the model had run on to it"):
        edited_after_save_all(torch.inference_mode)


#: Families whose router upcasts its linear layer's output (``F.linear(x, W).float()``), read at that cast.
UPCAST_LOGITS = [family.name for family in moelens.families.supported() if family.logits_cast_op]


def test_upcasting_routers_are_the_families_that_name_their_cast():
    """Routers whose logits are ``linear(x).float()`` (or ``.to(float32)``); mixtral's softmax(router_logits.float())
    upcasts in its scoring: its logits (as its router returns them) are the model's dtype, and no cast is named."""
    assert set(UPCAST_LOGITS) == {"granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid", "laguna",
                                  "afmoe"}


@pytest.mark.parametrize("family", UPCAST_LOGITS)
def test_a_bfloat16_router_that_upcasts_serves_and_steers_its_float32_logits(family):
    """granitemoe's router ranks F.linear(x, W).float(): moelens served the bfloat16 linear output, so steer's bias
    was rounded to bfloat16 (2.0 landed as 1.996 to 2.008, 1e-4 as 0) before the router upcast it."""
    hf = tiny_model(family, dtype=torch.bfloat16)
    inputs = tiny_inputs(hf)
    wrapped = moelens.wrap(hf)
    moe = first_moe(wrapped)
    params = moe.params()  # the router's own linear layer: weight [E, D] and bias
    expert, bias = 3, 2.0 + 2 ** -12  # no bfloat16 step of logits this size: rounded, it would be 2.0
    with wrapped.trace(**inputs):
        read = moe.router.inputs[0][0].save()  # what the router's linear layer reads
    with wrapped.trace(**inputs):
        moelens.steer(moe, expert, bias)
        steered = moe.router_logits.save()
    flat = read.reshape(-1, read.shape[-1])
    expected = torch.nn.functional.linear(flat, params.router, params.router_bias).float().reshape(steered.shape)
    expected[..., expert] += bias  # in float32, where the router ranks them
    assert steered.dtype == torch.float32
    assert torch.equal(steered, expected)


@pytest.mark.parametrize("switch", ["wrapper", "transformers"])
def test_an_experts_implementation_switched_between_steps_is_the_one_read_after(switch):
    """A switch of the experts implementation in the intervention code between generation steps (moelens' or
    transformers' own) is the one the next read sees (read once per run, the next per-slot read drilled into
    grouped_mm ops the eager forward never runs, and the generation ended silently at that step)."""
    wrapped = moelens.wrap(tiny_model("mixtral", experts_implementation="grouped_mm"), tokenizer=ascii_tokenizer())
    moe = first_moe(wrapped)
    switched = wrapped if switch == "wrapper" else wrapped._module
    try:
        with pytest.raises(moelens.MoelensError, match=r"expert_outputs cannot be served: .* this block runs 'eager'"):
            with wrapped.generate("hello", max_new_tokens=3, do_sample=False, min_new_tokens=3) as tracer:
                for step in tracer.iter[:3]:
                    if step == 1:
                        switched.set_experts_implementation("eager")
                        moe.expert_indices.save()
                    else:
                        moe.expert_outputs.save()
        assert moe.experts_implementation == "eager"
        with wrapped.generate("hello", max_new_tokens=3, do_sample=False, min_new_tokens=3) as tracer:
            shapes = nnsight.save([])
            for step in tracer.iter[:3]:
                if step == 1:
                    switched.set_experts_implementation("batched_mm")
                if step != 0:
                    shapes.append(tuple(moe.expert_outputs.save().shape))
        assert [shape[:3] for shape in shapes] == [(1, 1, 2), (1, 1, 2)]
    finally:
        wrapped.set_experts_implementation("grouped_mm")


def test_a_top_k_changed_between_steps_is_the_one_served_after():
    """A router's top_k lowered in the intervention code between generation steps: the later steps' slots are the
    experts call's, as plain transformers generates with the same change made by a forward pre-hook (moelens read k
    once per run, and refused the step's indices as a wrong family entry)."""
    hf = tiny_model("mixtral", num_experts_per_tok=3)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    ids = wrapped.tokenizer("hello", return_tensors="pt").input_ids
    settings = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    routers = [moe.router._module for moe in wrapped.moes]
    with wrapped.generate(ids, **settings) as tracer:
        served = nnsight.save([])
        last = nnsight.save([])
        for step in tracer.iter[:3]:
            if step == 1:
                for router in routers:
                    router.top_k = 2
            served.append((wrapped.moes[0].top_k, wrapped.moes[0].expert_indices.save()))
            last.append(wrapped.moes[-1].expert_indices.save())  # the body reaches step 1 after step 0's last block
    assert [tuple(indices.shape) for indices in last] == [(1, ids.shape[1], 3), (1, 1, 2), (1, 1, 2)]
    steps, called = [0], []

    def lower_at_step_1(module, args):
        if steps[0] == 1:
            for moe in wrapped.moes:
                reference.get_submodule(f"{moe.path.removeprefix('model.')}.gate").top_k = 2
        steps[0] += 1

    reference.register_forward_pre_hook(lower_at_step_1)
    first = wrapped.moes[0].path.removeprefix("model.")
    reference.get_submodule(f"{first}.experts").register_forward_pre_hook(lambda m, a: called.append(a[1].clone()))
    with torch.no_grad():
        reference.generate(ids, **settings)
    assert [k for k, _ in served] == [3, 2, 2]
    assert [tuple(indices.shape) for _, indices in served] == [(1, ids.shape[1], 3), (1, 1, 2), (1, 1, 2)]
    for (_, indices), expected in zip(served, called):
        assert torch.equal(indices.reshape(expected.shape), expected)


def test_a_top_k_changed_between_two_reads_of_one_step_is_named():
    """Changed after a step's first read of the block, the step's next read was refused as a wrong family entry."""
    wrapped = moelens.wrap(tiny_model("mixtral", num_experts_per_tok=3), tokenizer=ascii_tokenizer())
    moe = first_moe(wrapped)
    with pytest.raises(moelens.FamilyError, match=r"expert_indices holds 3 slots per token, but router.top_k reads 2 "
                                                  r"now. Either it was changed between two reads of this block at one "
                                                  r"generation step"):
        with wrapped.generate("hello", max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[:3]:
                moe.expert_weights.save()
                if step == 1:
                    moe.router._module.top_k = 2
                moe.expert_indices.save()


def _experts_calls(experts, monkeypatch):
    """A list that gets, per call of the torch module ``experts``, its (hidden, top_k_index, top_k_weights) and whether
    it sorted its rows by expert (``torch.sort``, which grouped_mm runs and batched_mm does not): torch hooks on the
    module, seen whatever nnsight runs inside it."""
    calls, inside, sort = [], [False], torch.sort

    def sorting(*args, **kwargs):
        if inside[0]:
            calls[-1]["sorted"] = True
        return sort(*args, **kwargs)

    def entered(module, args):
        inside[0] = True
        calls.append({"args": tuple(arg.detach().clone() for arg in args[:3]), "sorted": False})

    def left(module, args, output):
        inside[0] = False

    monkeypatch.setattr(torch, "sort", sorting)
    handles = [experts.register_forward_pre_hook(entered), experts.register_forward_hook(left)]
    return calls, handles


@pytest.mark.parametrize(("start", "switched_to"), [("grouped_mm", "batched_mm"), ("batched_mm", "grouped_mm"),
                                                    ("grouped_mm", "eager")])
def test_a_switch_between_steps_after_a_per_slot_read_runs_the_new_implementation(monkeypatch, start,
                                                                                         switched_to):
    """A switch between generation steps, after a per-slot read in the same generate, went on running nnsight's
    instrumented copy of the first implementation (kept for the run under the op path of the implementation call)
    while moelens reported and read the second: grouped_mm -> batched_mm served expert_activations in grouped_mm's
    expert-sorted row order as token-slot order, batched_mm -> grouped_mm waited for a sort that never ran and
    generation ended silently after the first step, and grouped_mm -> eager kept sorting (grouped_mm ran on).
    Ground truth: what ran (torch hooks, torch.sort counted) and the slots recomputed from the experts' weights."""
    from groundtruth import slots_by_hand

    wrapped = moelens.wrap(tiny_model("mixtral", experts_implementation=start), tokenizer=ascii_tokenizer())
    moe = first_moe(wrapped)
    experts = moe.experts._module
    calls, handles = _experts_calls(experts, monkeypatch)
    ids = torch.tensor([[40, 41, 42, 43], [50, 51, 52, 53]])
    try:
        with wrapped.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3) as tracer:
            reads = nnsight.save([])
            for step in tracer.iter[:3]:
                if step == 1:
                    wrapped.set_experts_implementation(switched_to)
                per_slot = switched_to != "eager" or step == 0  # eager's loop has no per-slot tensors
                reads.append((moe.experts_implementation, moe.expert_activations.clone() if per_slot else None,
                              moe.expert_outputs.clone() if per_slot else None))
    finally:
        for handle in handles:
            handle.remove()
    assert [implementation for implementation, _, _ in reads] == [start, switched_to, switched_to]
    assert [call["sorted"] for call in calls] == [implementation == "grouped_mm" for implementation, _, _ in reads]
    for step, (_, activations, outputs) in enumerate(reads):
        if activations is None:
            continue
        expected_activations, expected_outputs = slots_by_hand(experts, *calls[step]["args"])
        torch.testing.assert_close(activations, expected_activations.view(activations.shape), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outputs, expected_outputs.view(outputs.shape), atol=1e-5, rtol=1e-5)


def test_a_switch_in_a_run_of_several_invokes_is_refused():
    """With two invokes, a switch made by one took effect where its code ran, mid-step: the other invoke's pending
    per-slot read was served from the other implementation's ops (batched_mm -> grouped_mm: expert_activations 0.02
    off), its loop ended after one step (grouped_mm -> batched_mm), or it raised a false OrderError."""
    wrapped = moelens.wrap(tiny_model("mixtral", experts_implementation="batched_mm"), tokenizer=ascii_tokenizer())
    with pytest.raises(moelens.MoelensError, match=r"set_experts_implementation\('grouped_mm'\) in a run of 2 invokes: "
                                                   r".*Switch between traces, or in a trace or generate of one invoke"):
        with wrapped.generate(max_new_tokens=2, do_sample=False) as tracer:
            with tracer.invoke(torch.tensor([[40, 41, 42]])):
                first_moe(wrapped).expert_activations.save()
            with tracer.invoke(torch.tensor([[50, 51]])):
                wrapped.set_experts_implementation("grouped_mm")
    assert first_moe(wrapped).experts_implementation == "batched_mm"  # nothing was switched
    wrapped.set_experts_implementation("grouped_mm")  # outside a run, as before
    assert first_moe(wrapped).experts_implementation == "grouped_mm"


@pytest.mark.parametrize("pad_token_id", [-1, 128, 32000])
def test_token_id_invokes_are_padded_with_an_id_the_model_embeds(pad_token_id):
    """The padding of invokes of different lengths took the config's pad_token_id even where the model cannot embed
    it (-1 in some configs): valid ids were refused, the padding counted as ids "outside the model's embeddings"."""
    hf = tiny_model("mixtral")
    hf.config.pad_token_id = pad_token_id
    wrapped, long, short = moelens.wrap(hf), torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[10, 11, 12]])
    with torch.no_grad():
        expected = hf(short).logits
    with torch.no_grad(), wrapped.trace() as tracer:
        with tracer.invoke(long):
            pass
        with tracer.invoke(short):
            logits = wrapped.output.logits.save()
    torch.testing.assert_close(logits[:, -3:], expected, atol=1e-6, rtol=1e-6)


def test_token_id_invokes_reach_a_forward_whose_first_argument_has_another_name():
    """Several invokes handed the padded ids over as input_ids=, which forward(self, tokens) does not take (a bare
    TypeError); one invoke passed them positionally."""
    from custom_models import CustomModel, custom_family, custom_model

    class TokensModel(CustomModel):
        def forward(self, tokens):
            return super().forward(tokens)

    family = moelens.families.register(custom_family(), replace=True)
    try:
        base = custom_model()
        hf = TokensModel(base.config)
        hf.load_state_dict(base.state_dict())
        hf.eval()
        wrapped, first, second = moelens.wrap(hf), torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6, 7, 8]])
        with torch.no_grad(), wrapped.trace() as tracer:
            with tracer.invoke(first):
                pass
            with tracer.invoke(second):
                output = wrapped.output.save()
        with torch.no_grad():
            torch.testing.assert_close(output, hf(second), atol=1e-6, rtol=1e-6)
    finally:
        moelens.families.unregister(family.name)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_several_invokes_with_output_router_logits_serve_each_their_rows(family):
    """With output_router_logits=True the model's output holds a 0-d aux_loss, and nnsight cut every tensor of an
    output by its first dimension: reading the output in one of several invokes failed with an IndexError. The
    truth: the plain model's forward of the same batch (each invoke's rows of its logits, the batch's aux_loss)."""
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    ids = torch.randint(3, hf.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), wrapped.trace(output_router_logits=True) as tracer:
        with tracer.invoke(ids[:1]):
            first = wrapped.output.save()
        with tracer.invoke(ids[1:]):
            second = wrapped.output.logits.save()
    with torch.no_grad():
        expected = reference(ids, output_router_logits=True)
    torch.testing.assert_close(first.logits, expected.logits[:1])
    torch.testing.assert_close(second, expected.logits[1:])
    torch.testing.assert_close(first.aux_loss, expected.aux_loss)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_several_invokes_each_read_the_up_projections_and_the_activations(impl):
    """The sort permutation read for expert_pre_activations is reused by expert_activations in the same call, per
    invoke: a second invoke's read does not take the first invoke's (under grouped_mm it raised an OrderError, and
    save_all in two invokes did). Both recomputed from the weights on the experts' own input (a torch hook)."""
    from groundtruth import pre_activations_by_hand

    hf = tiny_model("mixtral", experts_implementation=impl)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    experts = moe.experts._module
    seen = []
    hook = experts.register_forward_pre_hook(lambda module, args: seen.append((args[0].clone(), args[1].clone())))
    try:
        ids = [tiny_inputs(hf, batch=1, seq=5, seed=seed)["input_ids"] for seed in (1, 2)]
        read = []
        with wrapped.trace() as tracer:
            for row in ids:
                with tracer.invoke(row):
                    read.append((moe.expert_pre_activations.save(), moe.expert_activations.save()))
        with wrapped.trace() as tracer:
            for row in ids:
                with tracer.invoke(row):
                    read.append(wrapped.save_all())
    finally:
        hook.remove()
    hidden, indices = seen[0]
    expected = pre_activations_by_hand(experts, hidden, indices).view(2, 1, 5, moe.top_k, -1)
    for row, (pre, activations) in enumerate(read[:2]):
        torch.testing.assert_close(pre, expected[row], atol=1e-5, rtol=0)
        torch.testing.assert_close(activations, experts._apply_gate(expected[row]), atol=1e-5, rtol=0)
    for row, values in enumerate(read[2:]):
        torch.testing.assert_close(values[0]["expert_pre_activations"], expected[row], atol=1e-5, rtol=0)
