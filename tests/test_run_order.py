"""Blocks in the order the forward reaches them, and their layer numbers, on models converted by moelens.compress
whose layers define their parts in another order than they run them (OPT) or keep them in lists of their own (T5).
Ground truth: torch forward hooks on the converted model."""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import nnsight
import pytest
import torch
import transformers

import moelens
from moelens import families
from moelens.call_order import in_run_order
from moelens.compress import tomoe

VOCAB = 64


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def converted(model: torch.nn.Module, calibration, **settings) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tomoe(model, num_experts=4, top_k=2, calibration=calibration, max_error=None, progress=False, **settings)


@pytest.fixture(scope="module")
def opt():
    """OPT's attention defines k_proj, v_proj, q_proj and calls q_proj first."""
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    pad_token_id=0)
    model = transformers.OPTForCausalLM(config).eval()
    return converted(model, ids(8, 16), target_attention_only=True)


def test_blocks_are_listed_and_read_in_the_order_they_run(opt):
    """model.save_all and families.check raised OrderError: they read q_proj after k_proj and v_proj."""
    ran = []
    hooks = [module.register_forward_hook(lambda module, args, output, name=name: ran.append(name))
             for name, module in opt.named_modules() if name.endswith("_proj") and "layers.0.self_attn" in name]
    try:
        with torch.no_grad():
            opt(ids(1, 5))
    finally:
        for hook in hooks:
            hook.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = moelens.wrap(opt)
    listed = [moe.path.removeprefix("model.") for moe in wrapped.moes if ".layers.0." in moe.path]
    assert listed == ran == [f"model.decoder.layers.0.self_attn.{part}_proj" for part in ("q", "k", "v", "out")]
    with torch.no_grad(), wrapped.trace(ids(1, 5)):
        saved = wrapped.save_all(["router_logits"])
    assert list(saved) == [moe.path for moe in wrapped.moes]
    assert families.check(wrapped, ids(1, 5)) == [moe.path for moe in wrapped.moes]


def test_siblings_sort_by_when_the_forward_runs_them_where_it_runs_them_all():
    """Calls count after their arguments; a read that runs nothing (``self.late.weight``, as SmolVLM reads its text
    model's embeddings before running its vision tower) is no run; a parent with a child it runs out of sight
    (through getattr or a helper method) keeps its definition order."""
    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.late = torch.nn.Linear(2, 2)
            self.unseen = torch.nn.Linear(2, 2)
            self.early = torch.nn.Linear(2, 2)

        def forward(self, x):
            x = x.to(self.late.weight.dtype)
            return self.late(self.early(x)) + getattr(self, "unseen")(x)

    assert in_run_order(Parent(), ["late", "early"]) == ["early", "late"]
    assert in_run_order(Parent(), ["unseen", "early", "late"]) == ["late", "unseen", "early"]


def test_a_t5_block_s_layer_is_its_block_number():
    """Every block reported the index of its sub-layer inside T5's block (encoder blocks 0 and 1: layer 1)."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model = converted(model, {"input_ids": ids(8, 16), "decoder_input_ids": ids(8, 8, 1)}, target_modules=["wi", "wo"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = moelens.wrap(model)
    layers = {moe.path.removeprefix("model."): moe.layer for moe in wrapped.moes}
    assert layers == {f"{stack}.block.{block}.layer.{sub}.DenseReluDense.{part}": block
                      for stack, sub in (("encoder", 1), ("decoder", 2)) for block in (0, 1) for part in ("wi", "wo")}


def test_describe_probes_an_encoder_decoder_model_with_decoder_tokens():
    """describe's probe gave a converted T5 no decoder_input_ids: transformers' raw ValueError ("You must specify
    exactly one of input_ids or inputs_embeds")."""
    from moelens.analysis import describe

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0)
    model = converted(transformers.T5ForConditionalGeneration(config).eval(),
                      {"input_ids": ids(8, 16), "decoder_input_ids": ids(8, 8, 1)}, target_modules=["wi"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = moelens.wrap(model)
    report = str(describe(wrapped, probe=True))
    assert "router_logits          [1, 4, 4]" in report and "mlp_output             [1, 4, 64]" in report
    assert "unavailable" not in report


def test_a_layer_is_the_first_module_list_index_of_its_path():
    """The first integer of a path was taken: a sentence-transformers model (an nn.Sequential holding the encoder)
    put every block at layer 0; the last one gives T5's sub-layer index. Layers kept in an nn.Sequential keep the
    last integer."""
    from moelens.components.base import layer_of

    bert = transformers.BertModel(transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                                          num_hidden_layers=3, num_attention_heads=2))
    assert layer_of("0.encoder.layer.2.intermediate", torch.nn.Sequential(bert)) == 2
    t5 = transformers.T5EncoderModel(transformers.T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8,
                                                           num_layers=2, num_heads=2))
    assert layer_of("encoder.block.0.layer.1.DenseReluDense.wi", t5) == 0
    stacked = torch.nn.Module()
    stacked.layers = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3)))
    assert layer_of("layers.2", stacked) == 2


def test_routing_analysis_refuses_an_encoder_decoder_model_and_names_a_telling_part():
    """On a converted T5, collect_routing suggested blocks='wo', which both colliding blocks end in, and then failed
    in T5's forward (no decoder tokens); describe reported 'MoE layers 0, 1, 2 (3 of 2)'."""
    from moelens.analysis import collect_routing, describe
    from moelens.analysis.collect import _telling_part

    assert _telling_part(["m.encoder.block.0.layer.1.DenseReluDense.wo",
                          "m.decoder.block.0.layer.2.DenseReluDense.wo"]) == "encoder"
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=3,
                                   num_heads=4, decoder_start_token_id=0)
    model = converted(transformers.T5ForConditionalGeneration(config).eval(),
                      {"input_ids": ids(8, 16), "decoder_input_ids": ids(8, 8, 1)}, target_modules=["wo"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = moelens.wrap(model)
    with pytest.raises(moelens.MoelensError, match=r"T5ForConditionalGeneration is an encoder-decoder model, whose "
                                                   r"forward needs decoder tokens too"):
        collect_routing(wrapped, [ids(1, 8)])
    report = str(describe(wrapped, probe=False))
    assert "layers                 5 (encoder.block 2, decoder.block 3)" in report
    assert ("MoE layers             encoder.block 0, encoder.block 1, decoder.block 0, decoder.block 1, "
            "decoder.block 2 (5 of 5)") in report


def ran_in_order(model: torch.nn.Module, paths: list[str], *args, **kwargs) -> list[str]:
    """The modules at ``paths`` in the order one forward of ``model`` first runs them (torch forward hooks)."""
    ran: list[str] = []
    hooks = [model.get_submodule(path).register_forward_hook(lambda module, inputs, output, path=path: ran.append(path))
             for path in paths]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return list(dict.fromkeys(ran))


def assert_listed_and_read_in_run_order(model: torch.nn.Module, *args, **kwargs) -> None:
    """model.moes lists the converted blocks in the order the forward runs them, and save_all reads them all."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = moelens.wrap(model)
    listed = [moe.path.removeprefix("model.") for moe in wrapped.moes]
    assert listed == ran_in_order(model, listed, *args, **kwargs)
    with torch.no_grad(), wrapped.trace(*args, **kwargs):
        saved = wrapped.save_all(["router_logits"])
    assert list(saved) == [moe.path for moe in wrapped.moes]


def test_blocks_of_lists_one_loop_runs_together_are_listed_layer_by_layer():
    """XLM runs self.attentions[i] and self.ffns[i] in one `for i in range(self.n_layers)`: model.moes listed
    every attention block before every FFN block, and save_all raised OrderError at ffns.0."""
    torch.manual_seed(0)
    config = transformers.XLMConfig(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=64)
    model = converted(transformers.XLMModel(config).eval(), ids(8, 16), target_modules=["q_lin", "lin1"])
    assert_listed_and_read_in_run_order(model, ids(1, 5))
    # describe counted the two lists as two stacks of layers: "layers 4 (attentions 2, ffns 2)"
    from moelens.analysis import describe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = describe(moelens.wrap(model), probe=False)
    assert (report.num_layers, report.layer_stacks) == (config.n_layers, {})
    assert "MoE layers             0, 1 (2 of 2), 4 MoE blocks" in str(report)


def test_a_child_handed_to_a_helper_that_reads_it_runs_where_the_forward_calls_it():
    """BltModel hands self.local_encoder to compute_hash_embeddings (which reads its embeddings) before it runs
    self.patcher, then runs the encoder: the hand-off counted as the encoder's run, model.moes listed the encoder's
    blocks first and save_all raised OrderError at the patcher's."""
    torch.manual_seed(0)
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, vocab_size=260)
    config = transformers.BltConfig(
        patcher_config=dict(small), encoder_config=dict(small, hidden_size_global=64),
        decoder_config=dict(small, hidden_size_global=64),
        global_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48),
        encoder_hash_byte_group_vocab=50, max_position_embeddings=128, local_attention_window_len=64,
        patching_threshold=1.0)
    tokens = torch.randint(4, 260, (4, 12), generator=torch.Generator().manual_seed(0))
    model = converted(transformers.BltModel(config).eval(), {"input_ids": tokens, "use_cache": False},
                      target_modules=["down_proj"])
    assert_listed_and_read_in_run_order(model, tokens[:1], use_cache=False)


def test_items_of_lists_run_in_one_loop_interleave_and_only_runners_count_hand_offs():
    """Siblings of a parent whose loop runs two lists item by item (by index and by iterating) sort by item, then
    by when the loop's body runs them; a child handed to a reading helper before it is called runs at its call,
    one handed to torch's checkpoint runs there. Before, every item of the first list came first, and the read
    counted as a run."""
    def read(module: torch.nn.Module) -> torch.dtype:
        return module.weight.dtype

    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.late = torch.nn.Linear(2, 2)
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(2) for _ in range(2))
            self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
            self.checkpointed = torch.nn.Linear(2, 2)

        def forward(self, x):
            x = x.to(read(self.late))
            for i, layer in enumerate(self.layers):
                x = self.norms[i](layer(x))
            x = torch.utils.checkpoint.checkpoint(self.checkpointed, x, use_reentrant=False)
            return self.late(x)

    parent = Parent()
    paths = [name for name, module in parent.named_modules() if not isinstance(module, (Parent, torch.nn.ModuleList))]
    assert in_run_order(parent, paths) == ran_in_order(parent, paths, torch.ones(1, 2)) == [
        "layers.0", "norms.0", "layers.1", "norms.1", "checkpointed", "late"]


STEPS = 3


def _generated_per_call(model: torch.nn.Module, ids: torch.Tensor, paths: list[str],
                        replace_first: dict[str, object] | None = None) -> dict[str, list]:
    """Ground truth: what each module at ``paths`` outputs at every call of a greedy generation of ``STEPS`` tokens on
    ``model`` (torch forward hooks, no nnsight); ``replace_first`` maps a path to what its first call outputs instead
    (as nnsight's ``.skip(value)`` at the first step hands on)."""
    replace_first = replace_first or {}
    outputs: dict[str, list] = {path: [] for path in paths}

    def hook(module, args, output, path):
        if not outputs[path] and path in replace_first:
            output = replace_first[path]
        outputs[path].append(output)
        return output

    hooks = [model.get_submodule(path).register_forward_hook(lambda m, a, o, path=path: hook(m, a, o, path))
             for path in paths]
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    finally:
        for handle in hooks:
            handle.remove()
    return outputs


@pytest.fixture(scope="module")
def qwen2_moe_generation():
    """(wrapped tiny qwen2_moe, an unwrapped copy, the prompt's ids, its block, the router's and experts' paths in
    the copy)."""
    import copy

    from groundtruth import ascii_tokenizer
    from moelens.testing import tiny_model

    hf = tiny_model("qwen2_moe", experts_implementation="grouped_mm")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = wrapped.moes[0]
    block = moe.path.removeprefix("model.")
    paths = (f"{block}.{moe.family.router}", f"{block}.{moe.family.experts}")
    ids = wrapped.tokenizer("hello", return_tensors="pt")["input_ids"]
    return wrapped, reference, ids, moe, paths


def _generate(wrapped, at_step) -> list:
    """What ``at_step(step)`` returns at each step of a greedy generation of ``STEPS`` tokens on ``wrapped`` (None
    where it returns none), and the statements after the loop ran."""
    with torch.no_grad(), wrapped.generate("hello", max_new_tokens=STEPS, min_new_tokens=STEPS,
                                           do_sample=False) as tracer:
        values = nnsight.save([])
        for step in tracer.iter[:STEPS]:
            values.append(at_step(step))
        finished = nnsight.save(True)
    assert finished
    return values


def test_values_read_inside_the_router_and_the_experts_are_each_step_s_own(qwen2_moe_generation):
    """With no module skipped, router_logits (read at an op in the router's forward) and expert_outputs (inside the
    experts implementation) at every generation step are that step's: the router's logits and the experts' output
    of the same call of the model's own generation (torch hooks on an unwrapped copy)."""
    wrapped, reference, ids, moe, (router, experts) = qwen2_moe_generation
    values = _generate(wrapped, lambda step: (moe.router_logits, moe.expert_outputs))
    truth = _generated_per_call(reference, ids, [router, experts])
    assert len(values) == len(truth[router]) == STEPS
    for (logits, slots), router_output, experts_output in zip(values, truth[router], truth[experts]):
        torch.testing.assert_close(logits.reshape(router_output[0].shape), router_output[0], rtol=0, atol=0)
        torch.testing.assert_close(slots.sum(2).reshape(experts_output.shape), experts_output, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("skipped, value", [("router", "router_logits"), ("experts", "expert_outputs")])
@pytest.mark.parametrize("read_at", [(1, 2), (2,)])
def test_a_value_inside_a_module_skipped_at_an_earlier_step_is_refused(qwen2_moe_generation, skipped, value, read_at):
    """nnsight counts the runs of each op in a forward apart, and `.skip()` bypasses the forward: after the router
    (or the experts) was skipped at step 0, router_logits (expert_outputs) read at step 1 was step 2's, and the read
    at step 2 never came (nnsight only warned, and the statements after the loop did not run). Now refused."""
    wrapped, reference, ids, moe, _ = qwen2_moe_generation
    tokens, top_k, experts, hidden = ids.shape[1], moe.top_k, moe.num_experts, wrapped._module.config.hidden_size
    module = getattr(moe, skipped)
    replacement = ((torch.zeros(tokens, experts), torch.full((tokens, top_k), 0.5),
                    torch.arange(top_k).repeat(tokens, 1)) if skipped == "router" else torch.zeros(tokens, hidden))

    def at_step(step):
        if step == 0:
            module.skip(replacement)
        return getattr(moe, value) if step in read_at else None

    refused = rf"{value} cannot be served at this tracer.iter step: {module.path} was skipped with \.skip\(\) at an"
    with pytest.raises(moelens.errors.OrderError, match=refused) as caught:
        _generate(wrapped, at_step)
    assert caught.value.__cause__ is None  # the traceback opens with this message, not nnsight's


def test_a_read_at_the_step_another_invoke_skips_the_module_says_it_may_be_this_step():
    """A skip in an empty (batch-wide) invoke at step 1, and another invoke's read at every step: the refusal at step
    1 said the experts were skipped "at an earlier step" only."""
    model = moelens.load()
    with pytest.raises(moelens.errors.OrderError, match=r"expert_outputs cannot be served at this tracer.iter step: "
                                                        r".*experts was skipped with \.skip\(\) at an earlier step of "
                                                        r"this generation \(or at this one, by another invoke"):
        with torch.no_grad(), model.generate(max_new_tokens=3, do_sample=False) as tracer:
            with tracer.invoke("x = 1"):
                for _ in tracer.iter[:3]:
                    model.moes[2].expert_outputs.save()
            with tracer.invoke():
                for _ in tracer.iter[1]:
                    model.moes[2].experts.skip(torch.zeros(1, 128))


def test_a_module_s_own_values_after_it_was_skipped_are_each_step_s_own(qwen2_moe_generation):
    """The refusal leaves the values read at the module's own input and output alone: after the router was skipped at
    step 0, expert_weights (the experts call's argument) and routed_output (the experts' output) at steps 1 and 2
    are those of the copy's generation whose router's first call handed on the same replacement."""
    wrapped, reference, ids, moe, (router, experts) = qwen2_moe_generation
    tokens, top_k = ids.shape[1], moe.top_k
    replacement = (torch.zeros(tokens, moe.num_experts), torch.full((tokens, top_k), 0.5),
                   torch.arange(top_k).repeat(tokens, 1))

    def at_step(step):
        if step == 0:
            moe.router.skip(replacement)
            return None
        return moe.expert_weights, moe.routed_output

    values = _generate(wrapped, at_step)
    truth = _generated_per_call(reference, ids, [router, experts], replace_first={router: replacement})
    for step in (1, 2):
        weights, routed = values[step]
        torch.testing.assert_close(weights.reshape(truth[router][step][1].shape), truth[router][step][1])
        torch.testing.assert_close(routed.reshape(truth[experts][step].shape), truth[experts][step])


def test_llama4_derived_routing_after_the_router_s_output_names_the_value_asked_for():
    """llama4 has no experts call: moelens recomputes expert_weights / expert_indices from router_logits, read at an
    op inside the router's forward. Read after the router's output (moe.router.output), they raised an OrderError
    naming router_logits, which the user had read in order; the error names the value asked for (with or without
    router_logits read before: the router's output may have been written since, and the block goes on with it). Read
    before it, they are the router's own (top-k of its logits, the sigmoid scores it hands on; a torch hook on an
    unwrapped copy)."""
    import copy

    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("llama4")
    inputs = tiny_inputs(hf)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    with torch.no_grad(), wrapped.trace(**inputs):
        moe.router_logits.save()
        weights = moe.expert_weights.save()
        indices = moe.expert_indices.save()
        moe.router.output.save()
    router_path = f"{moe.path.removeprefix('model.')}.{moe.family.router}"
    called = []
    handle = reference.get_submodule(router_path).register_forward_hook(lambda m, a, output: called.append(output))
    try:
        with torch.no_grad():
            reference(**inputs)
    finally:
        handle.remove()
    scores, logits = called[0]
    expected_indices = logits.topk(moe.top_k, dim=-1).indices
    assert torch.equal(indices.reshape(expected_indices.shape).sort(-1).values, expected_indices.sort(-1).values)
    torch.testing.assert_close(weights.reshape(-1, moe.top_k), scores.gather(-1, indices.reshape(-1, moe.top_k)))
    for logits_first in (False, True):
        for name in ("expert_weights", "expert_indices"):
            with pytest.raises(moelens.errors.OrderError, match=rf"{name} could not be served: the llama4 block calls "
                                                                rf"no experts module, so moelens recomputes {name} from "
                                                                r"router_logits, read inside the router's forward"):
                with torch.no_grad(), wrapped.trace(**inputs):
                    if logits_first:
                        moe.router_logits.save()
                    moe.router.output.save()
                    getattr(moe, name).save()


def test_save_all_after_an_intervention_that_ran_the_model_past_a_value_says_what_to_do():
    """moe.save_all() after moelens.ablate on the same block (mode zero writes expert_weights, so the model had run past
    router_logits), and model.save_all() after one on a later block, raised the OrderError of a single read, whose
    advice was "... or save everything at once with save_all()", and model.save_all's named block 0's router_logits
    but not save_all. The error names save_all and the value, and says what to do; as it says, values= (and moes=)
    with only the values after the intervention read them. Ground truth: torch forward pre-hooks on the experts of an
    unwrapped copy, one zeroing the ablated expert's weights, as ablate's mode zero does."""
    import copy

    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    inputs = tiny_inputs(hf)
    reference = copy.deepcopy(hf)
    model = moelens.wrap(hf)
    with torch.no_grad():
        plain = ran_experts(reference, inputs, [model.moes[i].experts.path for i in (2, 3)], ablated=4)
    advice = "save everything at once"
    with pytest.raises(moelens.OrderError, match=r"^model\.model\.layers\.1\.mlp\.save_all\(\) could not read "
                                                 r"router_logits: the model had already run past it .*Call save_all\(\) "
                                                 r"before that read or intervention, or pass values= with only the "
                                                 r"values after it") as refused:
        with torch.no_grad(), model.trace(**inputs):
            moelens.ablate(model.moes[1], 4)
            model.moes[1].save_all()
    assert advice not in str(refused.value)
    with pytest.raises(moelens.OrderError, match=r"^model\.save_all\(\) could not read model\.model\.layers\.0\.mlp\."
                                                 r"router_logits: .*Call model\.save_all\(\) before that read or "
                                                 r"intervention, or pass moes= with only the blocks after") as refused:
        with torch.no_grad(), model.trace(**inputs):
            moelens.ablate(model.moes[2], 4)
            model.save_all()
    assert advice not in str(refused.value)
    later = ["expert_weights", "expert_indices"]
    with torch.no_grad(), model.trace(**inputs):  # as the errors say
        moelens.ablate(model.moes[2], 4)
        block = model.moes[2].save_all(values=later)
        after = model.save_all(later, moes=model.moes[3:4])
    assert (plain[0][1][plain[0][0] == 4] == 0).all() and (plain[0][0] == 4).any()
    for values, (indices, weights) in zip((block, after[3]), plain):
        assert torch.equal(values["expert_indices"].reshape(indices.shape), indices)
        torch.testing.assert_close(values["expert_weights"].reshape(weights.shape), weights)


def ran_experts(model: torch.nn.Module, inputs: dict, paths: list[str],
                ablated: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (top-k indices, top-k weights) each experts module at ``paths`` (wrapped paths) was called with in a plain
    forward of ``model``, where the first of them runs expert ``ablated``'s slots with weight 0 (None: none)."""
    seen = []
    first = model.get_submodule(paths[0].removeprefix("model."))
    hooks = [] if ablated is None else [first.register_forward_pre_hook(
        lambda module, args: (args[0], args[1], args[2].masked_fill(args[1] == ablated, 0), *args[3:]))]
    hooks += [model.get_submodule(path.removeprefix("model.")).register_forward_pre_hook(
        lambda module, args: seen.append((args[1], args[2]))) for path in paths]
    try:
        model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("spelling", ["reversed list", "tuple", "set", "generator"])
def test_model_save_all_reads_the_given_blocks_in_model_order(spelling):
    """model.save_all(moes=...) read the blocks in the order given: [moes[2], moes[0]], or a set of blocks (iterated
    in id-hash order), raised an OrderError blaming "a read or an intervention earlier in this trace" though the trace
    read nothing else. It reads them in model order, whatever order or collection they come in, and keys the result
    in model order. Ground truth: forward pre-hooks on the experts modules of an unwrapped copy (the top-k indices
    and weights each is called with), and the same blocks' own save_all, one by one in model order."""
    import copy

    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    inputs = tiny_inputs(hf)
    reference = copy.deepcopy(hf)
    model = moelens.wrap(hf)
    chosen = [model.moes[i] for i in (3, 2, 0)]
    given = {"reversed list": chosen, "tuple": tuple(chosen), "set": set(chosen),
             "generator": (moe for moe in chosen)}[spelling]
    values = ["expert_indices", "expert_weights"]
    with torch.no_grad(), model.trace(**inputs):
        saved = model.save_all(values, moes=given)
    one_by_one = {}
    with torch.no_grad(), model.trace(**inputs):
        for i in (0, 2, 3):
            one_by_one[model.moes[i].layer] = model.moes[i].save_all(values)
    with torch.no_grad():
        called = ran_experts(reference, inputs, [model.moes[i].experts.path for i in (0, 2, 3)])
    assert list(saved) == [model.moes[i].layer for i in (0, 2, 3)] == list(one_by_one)
    for layer, (indices, weights) in zip(saved, called):
        assert sorted(saved[layer]) == sorted(values)
        for name in values:
            assert torch.equal(saved[layer][name], one_by_one[layer][name])
        assert torch.equal(saved[layer]["expert_indices"].reshape(indices.shape), indices)
        assert torch.equal(saved[layer]["expert_weights"].reshape(weights.shape), weights)


def test_model_save_all_refuses_a_lone_block_and_a_block_given_twice():
    """model.save_all(moes=model.moes[1]) iterated the block's children and named its router (".mlp.gate ... which is
    no MoE block"); moes=[moes[0], moes[0]] was accepted and switched the keys from layers to paths (saved[0] then a
    KeyError). Each is refused up front, naming the block and what to pass."""
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    inputs = tiny_inputs(hf)
    model = moelens.wrap(hf)
    path = model.moes[1].path
    with pytest.raises(moelens.errors.MoelensError, match=rf"got the one block {path}: pass it in a list, "
                                                          r"moes=\[model\.moes\[1\]\], or call the block's own "
                                                          r"save_all, model\.moes\[1\]\.save_all\(\)"):
        with torch.no_grad(), model.trace(**inputs):
            model.save_all(moes=model.moes[1])
    first = model.moes[0].path
    with pytest.raises(moelens.errors.MoelensError, match=rf"got the block {first} more than once.*pass each block "
                                                          r"once"):
        with torch.no_grad(), model.trace(**inputs):
            model.save_all(moes=[model.moes[0], model.moes[1], model.moes[0]])
    with pytest.raises(moelens.errors.MoelensError, match=r"takes a list of MoE blocks of this model .*got str"):
        with torch.no_grad(), model.trace(**inputs):  # a path is no block (its characters were each refused)
            model.save_all(moes=path)


def test_llama4_derived_routing_after_a_write_of_router_logits_follows_the_write():
    """llama4's expert_weights / expert_indices are recomputed from router_logits: after `moe.router_logits = new`
    they must be those of ``new`` (a stop's attempt to reuse the logits read earlier in the router call served the
    old ones). Ground truth: the scores the router hands on in the same trace (router.output[0], nonzero on the
    experts it picked) and top-k of the written logits by hand."""
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("llama4")
    inputs = tiny_inputs(hf)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    bias = torch.zeros(moe.num_experts)
    bias[1] = 100.0
    with torch.no_grad(), wrapped.trace(**inputs):
        original = moe.router_logits.save()
        moe.router_logits = moe.router_logits + bias
        indices = moe.expert_indices.save()
        weights = moe.expert_weights.save()
        scores = moe.router.output[0].save()
    flat = indices.reshape(-1, moe.top_k)
    by_hand = (original.reshape(-1, moe.num_experts) + bias).topk(moe.top_k).indices
    assert torch.equal(flat.sort(-1).values, by_hand.sort(-1).values)
    assert (flat == 1).any(-1).all()
    picked = scores.reshape(-1, moe.num_experts) > 0
    assert torch.equal(picked, torch.zeros_like(picked).scatter(-1, flat, True))
    torch.testing.assert_close(weights.reshape(-1, moe.top_k), scores.reshape(-1, moe.num_experts).gather(-1, flat))


@pytest.mark.parametrize("steps", ["iter[2]", "iter[1:3]"])
def test_a_late_read_at_the_last_step_of_a_generation_is_refused(steps):
    """Inside tracer.iter, a value read after a later one of its block at the last step the loop reaches (there is no
    next step whose value nnsight would serve) was never served: the loop ended with nnsight's warning that a step
    "was never reached" (false: the step ran, as hooks on an unwrapped copy show) and the statements after the loop
    silently did not run. It raises moelens' OrderError now; a loop asking for steps the run did not make (an open
    loop) still ends with nnsight's warning, having read every step the run made."""
    import copy
    import warnings

    from groundtruth import ascii_tokenizer
    from moelens.testing import tiny_model

    hf = tiny_model("qwen2_moe", experts_implementation="grouped_mm")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = wrapped.moes[0]
    ids = wrapped.tokenizer("hello", return_tensors="pt")["input_ids"]
    calls = []
    router = reference.get_submodule(f"{moe.path.removeprefix('model.')}.{moe.family.router}")
    handle = router.register_forward_hook(lambda module, args, output: calls.append(output))
    try:
        with torch.no_grad():
            reference.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    finally:
        handle.remove()
    assert len(calls) == 3  # the router ran at every step: the late read's step ran
    with pytest.raises(moelens.errors.OrderError, match=r"router_logits was requested after the model had already run "
                                                        r"past it"):
        with torch.no_grad(), wrapped.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            for _ in (tracer.iter[2] if steps == "iter[2]" else tracer.iter[1:3]):
                moe.mlp_output.save()
                moe.router_logits.save()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), wrapped.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            seen = nnsight.save([])
            for step in tracer.iter[0:5]:  # two steps more than the run makes, read in order
                moe.router_logits.save()
                seen.append(step)
    assert list(seen) == [0, 1, 2]
    assert any("never reached" in str(warning.message) for warning in caught)


#: Loops asking for steps a generation of ``STEPS`` tokens does not make (iter[0:5]: two more than it makes).
OPEN_LOOPS = {"all()": lambda tracer: tracer.all(), "iter[:]": lambda tracer: tracer.iter[:],
              "iter[0:5]": lambda tracer: tracer.iter[0:5]}


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def open_loop_models(request):
    """(wrapped tiny model of the family, plain nnsight on an unwrapped copy, the prompt's ids, the wrapped model's
    first block, that block's path in the copy)."""
    import copy

    from groundtruth import ascii_tokenizer
    from moelens.testing import tiny_model

    hf = tiny_model(request.param, experts_implementation="grouped_mm")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    with warnings.catch_warnings():  # nnsight 0.8 deprecates LanguageModel
        warnings.simplefilter("ignore")
        plain = nnsight.LanguageModel(reference, tokenizer=ascii_tokenizer())
    moe = wrapped.moes[0]
    ids = wrapped.tokenizer("hello", return_tensors="pt")["input_ids"]
    return wrapped, plain, ids, moe, moe.path.removeprefix("model.")


class Generated(NamedTuple):
    """What a greedy generation of ``STEPS`` tokens did (`_generated`)."""

    #: The steps the loop body ran at.
    steps: list[int]
    #: The token each forward picked: the argmax of the lm_head's last position (torch hook).
    tokens: list[int]
    #: The experts the block's router picked for each token at each forward (torch hook on ``router``).
    picked: list[torch.Tensor]
    #: Whether the run ended with nnsight's warning that a step "was never reached" (an open loop's end).
    warned: bool


def _generated(model: Any, ids: torch.Tensor, router: torch.nn.Module, loop: str | None,
               at_step: Callable[[], None]) -> Generated:
    """A greedy generation of ``STEPS`` tokens on ``model`` (moelens' or plain nnsight's) with ``at_step()`` the last
    request of every step of the loop ``OPEN_LOOPS[loop]`` (no loop: None); ``router`` is the torch module whose
    picks are recorded (its output's third item)."""
    tokens, picked = [], []
    hooks = [router.register_forward_hook(lambda module, args, output: picked.append(output[2])),
             model._module.lm_head.register_forward_hook(
                 lambda module, args, output: tokens.append(int(output[0, -1].argmax())))]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad(), model.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS,
                                                 do_sample=False) as tracer:
                steps = nnsight.save([])
                for step in OPEN_LOOPS[loop](tracer) if loop is not None else ():
                    at_step()
                    steps.append(step)  # (no request: the edit's write-back still waits as the next step asks)
    finally:
        for hook in hooks:
            hook.remove()
    return Generated(list(steps), tokens, picked, any("never reached" in str(warning.message) for warning in caught))


def _ground_truth(plain: Any, ids: torch.Tensor, moe: Any, block: str, edited: bool = True) -> Generated:
    """Plain nnsight on the unwrapped copy, in an open loop, writing 5 into the first 8 features of the output of
    ``moe``'s experts module (at ``block`` in the copy) in place at every step (what ``moe.routed_output[..., :8] =
    5.0`` edits); not ``edited``: the generation alone."""

    def edit() -> None:
        plain.get(f"{block}.{moe.family.experts}").output[..., :8] = 5.0

    router = plain._module.get_submodule(f"{block}.{moe.family.router}")
    return _generated(plain, ids, router, "iter[0:5]" if edited else None, edit)


@pytest.mark.parametrize("loop", list(OPEN_LOOPS))
def test_an_open_loop_that_edits_in_place_ends_with_nnsight_s_warning(open_loop_models, loop):
    """An in-place edit of a value at every step of a loop asking for steps the run did not make raised a false
    OrderError at the end of generate (every step's edit applied), where reads alone end with nnsight's warning: the
    edit's write-back, landed as the step the run never made was asked for, relaxed nnsight's pin to that step, and
    the refusal took the request for a late read. It ends with the warning now, each step edited as plain nnsight on
    an unwrapped copy editing the experts' output in place in the same loop (its tokens, which the edit changes)."""
    wrapped, plain, ids, moe, block = open_loop_models
    truth, unedited = _ground_truth(plain, ids, moe, block), _ground_truth(plain, ids, moe, block, edited=False)
    assert truth.warned and truth.steps == [0, 1, 2] and truth.tokens != unedited.tokens  # the edit tells

    def edit() -> None:
        moe.routed_output[..., :8] = 5.0

    run = _generated(wrapped, ids, moe.router._module, loop, edit)
    assert run.warned
    assert run.steps == [0, 1, 2]
    assert run.tokens == truth.tokens


@pytest.mark.parametrize("loop", list(OPEN_LOOPS))
@pytest.mark.parametrize("intervention", ["steer", "route_around"])
def test_an_open_loop_that_steers_or_routes_around_ends_with_nnsight_s_warning(open_loop_models, loop, intervention):
    """moelens.steer and moelens.ablate(mode="route_around") write the router's logits: at every step of an open loop
    they raised the same false OrderError at the end of generate. Now the loop ends with nnsight's warning, and the
    router (torch hook) picked expert 1 for every token at every step (steered by +30), or for none (routed around)."""
    wrapped, _, ids, moe, _ = open_loop_models

    def intervene() -> None:
        moelens.steer(moe, 1, 30.0) if intervention == "steer" else moelens.ablate(moe, 1, mode="route_around")

    run = _generated(wrapped, ids, moe.router._module, loop, intervene)
    assert run.warned
    assert run.steps == [0, 1, 2]
    assert len(run.picked) == STEPS
    for picked in run.picked:
        assert (picked == 1).any(-1).all() if intervention == "steer" else not (picked == 1).any()


def test_a_lasting_edit_with_an_open_loop_serves_every_later_generation(open_loop_models):
    """A lasting edit (model.edit(inplace=True)) editing a value in place at every step of tracer.iter[:] failed every
    later generate with a false OrderError. Each now ends with nnsight's warning, each step edited as plain nnsight on
    an unwrapped copy editing the experts' output in place in an open loop."""
    wrapped, plain, ids, moe, block = open_loop_models
    truth = _ground_truth(plain, ids, moe, block)
    with wrapped.edit(inplace=True) as tracer:
        for _ in tracer.iter[:]:
            moe.routed_output[..., :8] = 5.0
    try:
        runs = [_generated(wrapped, ids, moe.router._module, None, lambda: None) for _ in range(2)]
    finally:
        wrapped.clear_edits()
    for run in runs:
        assert run.warned
        assert run.tokens == truth.tokens


@pytest.mark.parametrize("loop", ["iter[1:3]", "iter[1]", "all()"])
@pytest.mark.parametrize("late", ["read", "write", "layer"])
def test_a_late_read_at_a_step_before_the_last_is_refused(qwen2_moe_generation, loop, late):
    """Inside tracer.iter, nnsight pins only a step's first request; a value read (or written) after the model had
    run past it at a step that is not the last was served at the next visit, the next step's: silently another step's
    router logits (a write landed on the next step). It raises moelens' OrderError now, as at the first and the
    last step; the same reads in the model's order keep serving each step's own values (hooks on an unwrapped copy)."""
    wrapped, reference, ids, moe, (router, _) = qwen2_moe_generation
    later = wrapped.moes[1]
    loops = {"iter[1:3]": lambda tracer: tracer.iter[1:3], "iter[1]": lambda tracer: tracer.iter[1],
             "all()": lambda tracer: tracer.all()}

    def body(in_order: bool) -> None:
        if late == "layer":  # a block read after a later block
            first, then = (lambda: moe.mlp_output.save(), lambda: later.router_logits.save())
        else:  # a block's value read (written) after a later value of the block
            first = lambda: moe.router_logits.save()  # noqa: E731
            then = (lambda: moe.mlp_output.save()) if late == "read" else \
                (lambda: setattr(moe, "mlp_output", moe.mlp_output))
        if in_order:
            first()
            then()
        else:
            then()
            first()

    refused = r"requested after the model had already run past it"
    with pytest.raises(moelens.errors.OrderError, match=refused):
        with torch.no_grad(), wrapped.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False) as tracer:
            for step in loops[loop](tracer):
                body(in_order=step != 1)  # step 1 of 4: a next step whose value nnsight served
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the open loop ends with nnsight's warning
        with torch.no_grad(), wrapped.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS,
                                               do_sample=False) as tracer:
            logits = nnsight.save([])
            for step in tracer.iter[1:STEPS]:
                logits.append(moe.router_logits.save())
                body(in_order=True)
    truth = _generated_per_call(reference, ids, [router])[router]
    assert len(logits) == STEPS - 1
    for got, want in zip(logits, truth[1:]):
        torch.testing.assert_close(got.reshape(want[0].shape), want[0], rtol=0, atol=0)


@pytest.mark.parametrize("edit", [False, True])
@pytest.mark.parametrize("loops", [(1, 1), (2, 1)])
def test_a_read_pinned_to_a_step_the_model_already_ran_is_refused(qwen2_moe_generation, edit, loops):
    """A second loop over a step (``tracer.iter[1]`` after ``tracer.iter[1]`` or ``tracer.iter[2]``) asks, pinned, for
    a visit the model already made: nnsight serves a pinned request only at its visit, so the read waited for the
    run's end, which ended the loop with the warning of a step the run did not make (the value never set, the code
    after the loop not run). It raises OrderError; a loop over a later step, in the model's order, serves it (the
    truth: the router's output at that step, hooked on an unwrapped copy)."""
    wrapped, reference, ids, moe, (router, _) = qwen2_moe_generation
    later = wrapped.moes[1]
    first, second = loops

    def generate(again: int) -> torch.Tensor:
        with torch.no_grad(), wrapped.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False) as tracer:
            for _ in tracer.iter[first]:
                routed = later.routed_output
                if edit:
                    routed[..., :4] = 5.0
            for _ in tracer.iter[again]:
                logits = moe.router_logits.save()
        return logits

    with pytest.raises(moelens.errors.OrderError, match=r"router_logits was requested after the model had already "
                                                        r"run past it.* In a run of several steps \(generate\), a read "
                                                        r"outside a tracer.iter loop asks for step 0"):
        generate(second)
    if not edit:
        seen = []
        handle = reference.get_submodule(router).register_forward_hook(lambda module, args, output: seen.append(
            (output[0] if isinstance(output, tuple) else output).detach().clone()))
        try:
            with torch.no_grad():
                reference.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        finally:
            handle.remove()
        torch.testing.assert_close(generate(first + 1).reshape(seen[first + 1].shape), seen[first + 1])


def test_a_long_generation_lets_go_of_the_views_the_user_dropped(qwen2_moe_generation):
    """Each step's read of a value served as a copy (expert_activations, in token-slot order) kept its entry among
    the views watched for late edits to the run's end, dropped or not: a long generation grew by one a step. The
    entries of views the user keeps stay watched."""
    from moelens.components import served

    wrapped, reference, ids, moe, _ = qwen2_moe_generation
    steps = 3 * served.PRUNE_AT
    with torch.no_grad(), wrapped.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False) as tracer:
        sizes, kept = nnsight.save([]), []
        for step in tracer.iter[:steps]:
            activations = moe.expert_activations
            if step == 0:
                kept.append(activations)
            watched = served.RUNS[wrapped.interleaver].views
            sizes.append(len(watched))
        first_watched = nnsight.save(id(kept[0]) in watched)
    assert len(sizes) == steps and max(sizes) <= served.PRUNE_AT < steps and first_watched


def test_a_read_after_a_loop_over_later_steps_is_told_it_asks_for_step_0(qwen2_moe_generation):
    """Its OrderError spoke only of the order of values in a block and of layers, which the reads kept; the order
    error of reads of one step (in a trace, or at a generation's step) does not speak of steps."""
    wrapped, reference, ids, moe, _ = qwen2_moe_generation
    steps = r"In a run of several steps \(generate\), a read outside a tracer.iter loop asks for step 0"
    for read in ("router_logits", "router_probs", "expert_outputs", "save_all"):  # (the last three had no hint)
        with pytest.raises(moelens.errors.OrderError, match=steps):
            with torch.no_grad(), wrapped.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False) as tracer:
                for _ in tracer.iter[1:3]:
                    wrapped.moes[1].router_logits.save()
                wrapped.moes[1].save_all() if read == "save_all" else getattr(wrapped.moes[1], read).save()
    for generating in (False, True):
        with pytest.raises(moelens.errors.OrderError) as caught:  # a step's own reads out of order: no step passed
            with torch.no_grad(), (wrapped.generate(ids, max_new_tokens=3, min_new_tokens=3) if generating else
                                   wrapped.trace(ids)):
                wrapped.moes[1].router_logits.save()
                moe.router_logits.save()
        assert "several steps" not in str(caught.value)


@pytest.mark.parametrize(("skipped", "value", "read_at"), [
    *((skipped, value, read_at) for skipped in ("block", "decoder layer")
      for value, read_at in (("router_logits", 0), ("router_logits", 1), ("expert_outputs", 1))),
    ("decoder layer", "mlp_output", 1),  # (the skipped block's own output still counts each step: read there, fine)
])
def test_a_value_inside_a_block_or_layer_skipped_at_an_earlier_step_is_refused(qwen2_moe_generation, skipped, value,
                                                                               read_at):
    """Skipping the block (or its decoder layer) with `.skip()` bypasses every module inside it, so they all ran one
    step fewer than the model: a value read there at a later step (or right after the skip, at step 0) was silently
    the next step's (its router logits, its experts' outputs). Refused now; a block of another layer keeps serving
    each step's own values (torch hooks on an unwrapped copy)."""
    wrapped, reference, ids, moe, (router, _) = qwen2_moe_generation
    module = moe if skipped == "block" else wrapped.model.layers[moe.layer]

    def at_step(step):
        if step == 0:
            module.skip(module.inputs[0][0])  # the hidden states go on unchanged
        return getattr(moe, value) if step == read_at else None

    with pytest.raises(moelens.errors.OrderError, match=rf"{value} cannot be served at this step: .* did not run at an "
                                                        r"earlier step of this generation \(it or a module holding it"):
        _generate(wrapped, at_step)

    later = wrapped.moes[1]
    other = later if skipped == "block" else wrapped.model.layers[later.layer]

    def at_other_step(step):
        logits = moe.router_logits
        if step == 0:
            other.skip(other.inputs[0][0])
        return logits

    values = _generate(wrapped, at_other_step)  # every step's, none refused
    truth = _generated_per_call(reference, ids, [router])[router]  # the skip comes after this block: same at step 0
    torch.testing.assert_close(values[0].reshape(truth[0][0].shape), truth[0][0], rtol=0, atol=0)


@pytest.mark.parametrize("whole", [True, False])
def test_save_all_after_an_intervention_at_a_later_step_keeps_its_own_advice(qwen2_moe_generation, whole):
    """Inside tracer.iter, save_all called after an intervention that ran the model past router_logits was refused at
    steps after the first with the advice of a single read ("or save everything at once with save_all()"), which the
    user had called; it says to call save_all before the intervention at every step, as at the first."""
    wrapped, _, ids, moe, _ = qwen2_moe_generation
    advice = r"model\.save_all\(\) could not read" if whole else r"save_all"
    with pytest.raises(moelens.errors.OrderError, match=rf"{advice}.*router_logits.*Call (model\.)?save_all\(\) before"):
        with torch.no_grad(), wrapped.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False) as tracer:
            for _ in tracer.iter[1:3]:
                moelens.ablate(moe, 1)
                wrapped.save_all() if whole else moe.save_all()


def test_blocks_above_an_early_exit_layer_serve_each_of_their_calls(qwen2_moe_generation):
    """An early-exit assistant (assistant_early_exit=1) drafts with the model's first layer alone, so the model runs
    more forwards than the blocks above that layer: reads of those blocks were refused as if a module had been
    skipped. Each tracer.iter call of the last block serves that call of its router (torch hooks on an unwrapped
    copy running the same generation)."""
    wrapped, reference, ids, _, _ = qwen2_moe_generation
    moe = wrapped.moes[-1]
    assert moe.layer > 1
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, assistant_early_exit=1)
    router = f"{moe.path.removeprefix('model.')}.{moe.family.router}"
    calls = []
    handle = reference.get_submodule(router).register_forward_hook(lambda module, args, output: calls.append(output[0]))
    try:
        with torch.no_grad():
            reference.generate(ids, **settings)
    finally:
        handle.remove()
    with torch.no_grad(), wrapped.generate(ids, **settings) as tracer:
        served = nnsight.save([])
        for _ in tracer.iter[0:2]:
            served.append(moe.router_logits.save())
    assert len(calls) >= 2
    for got, want in zip(served, calls[:2], strict=True):
        assert torch.equal(got.reshape(want.shape), want)


def test_a_block_skipped_where_the_layers_are_no_numbered_list_is_caught_too():
    """The modules compared with a read's step are those of its decoder layer, found as the first numbered module on
    its path: where the layers are attributes (l0, l1, ...), only the router was compared, and a read after its block
    was skipped at an earlier step got the next step's logits, silently. The block's parent stands for the layer."""
    from groundtruth import ascii_tokenizer
    from moelens.testing import tiny_model

    class NamedLayers(torch.nn.Module):  # the decoder layers as attributes, not a ModuleList
        def __init__(self, layers) -> None:
            super().__init__()
            for index, layer in enumerate(layers):
                self.add_module(f"l{index}", layer)

        def __getitem__(self, index):
            return list(self._modules.values())[index]

        def __iter__(self):
            return iter(self._modules.values())

        def __len__(self) -> int:
            return len(self._modules)

    hf = tiny_model("qwen2_moe", experts_implementation="grouped_mm")
    hf.model.layers = NamedLayers(list(hf.model.layers))
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    moe = wrapped.moes[-1]
    assert not any(part.isdigit() for part in moe.path.split("."))
    with pytest.raises(moelens.errors.OrderError, match=r"router_logits cannot be served at this step: .* did not run"):
        with torch.no_grad(), wrapped.generate("hello", max_new_tokens=STEPS, min_new_tokens=STEPS,
                                               do_sample=False) as tracer:
            for step in tracer.iter[0:2]:
                if step == 0:
                    moe.skip(moe.inputs[0][0])
                else:
                    moe.router_logits.save()


def test_a_block_the_run_never_reached_says_why_not_that_it_was_read_late():
    """A tracer.stop() in one invoke ends the batch's run (every invoke's), and a read of a later block in another
    invoke, by itself, by save_all or by model.save_all, was refused as "requested after the model had already run
    past it", blaming the read order; so was a read of a block whose decoder layer was skipped. The error says the run
    was stopped, or the block did not run; a block that ran and was read late keeps the order error. Ground truth:
    torch forward pre-hooks counting the blocks' calls in the same traces."""
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    ids = tiny_inputs(hf)["input_ids"]
    model = moelens.wrap(hf)
    calls = {1: 0, 2: 0}
    hooks = [hf.model.layers[i].mlp.register_forward_pre_hook(
        lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1)) for i in calls]
    reads = {"the value": lambda: model.moes[1].router_logits.save(), "save_all": lambda: model.moes[1].save_all(),
             "model.save_all": lambda: model.save_all(moes=model.moes[1:])}
    try:
        for read in reads.values():
            with pytest.raises(moelens.OrderError, match=r"layers\.1\.mlp\.router_logits was not served: the run "
                                                         r"was stopped \(tracer\.stop\(\)\) before the model reached "
                                                         r"model\.model\.layers\.1\.mlp\. A stop ends the run of every "
                                                         r"invoke") as refused:
                with torch.no_grad(), model.trace() as tracer:
                    with tracer.invoke(ids):
                        model.moes[0].router_logits.save()
                        tracer.stop()
                    with tracer.invoke(ids):
                        read()
            assert "run past it" not in str(refused.value)
        assert calls == {1: 0, 2: 0}
        with pytest.raises(moelens.OrderError, match=r"router_logits was not served: model\.model\.layers\.1\.mlp did "
                                                     r"not run in this trace: a module holding it \(its decoder "
                                                     r"layer\) was skipped with \.skip\(\)"):
            with torch.no_grad(), model.trace(ids):
                model.model.layers[1].skip(model.model.layers[1].inputs[0][0])
                model.moes[1].router_logits.save()
        assert calls == {1: 0, 2: 1}
        with pytest.raises(moelens.OrderError, match=r"layers\.2\.mlp\.router_logits was requested after the model "
                                                     r"had already run past it"):  # it ran: the order error stands
            with torch.no_grad(), model.trace(ids):
                model.moes[2].routed_output.save()
                model.moes[2].router_logits.save()
        assert calls == {1: 1, 2: 2}
    finally:
        for hook in hooks:
            hook.remove()


def test_a_read_after_an_intervention_on_a_later_block_says_the_intervention_moved_the_model_on():
    """moelens.steer on layer 1, then a read of layer 0: the order error said only to read values and blocks in
    order, not that the steer was what moved the model on (the refusal itself is checked against hooks above)."""
    from moelens.testing import tiny_inputs, tiny_model

    hf = tiny_model("mixtral", experts_implementation="grouped_mm")
    model = moelens.wrap(hf)
    with pytest.raises(moelens.OrderError, match=r"layers\.0\.mlp\.router_logits was requested after the model had "
                                                 r"already run past it\..* An intervention moves the model on as a "
                                                 r"read does \(moelens\.steer, force, ablate write values of their "
                                                 r"block\): call it after the reads of earlier values and blocks\."):
        with torch.no_grad(), model.trace(**tiny_inputs(hf)):
            moelens.steer(model.moes[1], 3, 5.0)
            model.moes[0].router_logits.save()
