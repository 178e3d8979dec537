"""`analysis.collect_generation`: a generation's ids and the routing of every token the model read.

Ground truth: the plain transformers model (an unwrapped copy) generating with the same settings, the
arguments of every experts call (and the router's output, for the logits) recorded by torch forward
hooks, step by step; which tokens are real is worked out here row by row, from the plain ids.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import moelens
from moelens import analysis
from moelens.errors import MoelensError
from groundtruth import ascii_tokenizer
from moelens.testing import tiny_model

PROMPTS = [[110, 57, 95, 45, 28], [40, 41, 42]]  # of different lengths: the second is left-padded
FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "olmoe"]
NEW = 6


def plain_generation(reference: torch.nn.Module, prompts: list[list[int]], pad: int, **kwargs):
    """The plain model's ids and, per experts module, each step's ``(indices, weights)`` ``[b, s, k]`` and the
    router's first output (its logits) ``[b, s, E]``."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[pad] * (width - len(prompt)) + prompt for prompt in prompts])
    mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    steps: dict[str, list] = {}
    logits: dict[str, list] = {}
    hooks = []
    for name, module in reference.named_modules():
        if name.endswith("mlp.experts"):
            hooks.append(module.register_forward_pre_hook(
                lambda module, args, name=name: steps.setdefault(name, []).append((args[1].clone(), args[2].clone()))))
        if name.endswith("mlp.gate"):
            hooks.append(module.register_forward_hook(
                lambda module, args, output, name=name: logits.setdefault(name, []).append(output[0].clone())))
    try:
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    rows = len(prompts)
    shaped = {name: [(i.reshape(rows, -1, i.shape[-1]), w.reshape(rows, -1, w.shape[-1])) for i, w in calls]
              for name, calls in steps.items()}
    return out, mask, shaped, {name: [v.reshape(rows, -1, v.shape[-1]) for v in calls] for name, calls in logits.items()}


def expected_routing(calls, prompts, width: int, lengths: list[int]):
    """Per row: the routing of each token read (the prompt's tokens at step 0, then one generated token per step
    while the row still generated), by hand."""
    indices, weights = [], []
    for row, prompt in enumerate(prompts):
        first_indices, first_weights = calls[0]
        indices += list(first_indices[row, width - len(prompt):])
        weights += list(first_weights[row, width - len(prompt):])
        for step in range(1, lengths[row]):
            indices.append(calls[step][0][row, 0])
            weights.append(calls[step][1][row, 0])
    return torch.stack(indices), torch.stack(weights)


def assert_routed_as(result, calls, lengths: list[int]) -> None:
    """``result``'s cache holds, layer by layer, the routing ``expected_routing`` makes of the plain run's ``calls``."""
    width = max(len(prompt) for prompt in PROMPTS)
    for layer, name in zip(result.cache.layers, sorted(calls)):
        indices, weights = expected_routing(calls[name], PROMPTS, width, lengths)
        assert torch.equal(result.cache.indices(layer).long(), indices)
        torch.testing.assert_close(result.cache.weights(layer), weights.float())


def generated_lengths(out: torch.Tensor, width: int, eos: int | None) -> list[int]:
    lengths = []
    for row in out[:, width:].tolist():
        lengths.append(row.index(eos) + 1 if eos in row else len(row))
    return lengths


@pytest.mark.parametrize("family", FAMILIES)
def test_the_routing_of_a_generation_is_every_step_of_the_plain_run(family):
    """Each prompt's tokens and then each token it generated are routed as the plain generation routed them, step by
    step; a row that ended early (its end-of-sequence token) has no routing for the steps the other row went on."""
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    pad = hf.config.pad_token_id if isinstance(hf.config.pad_token_id, int) else 0
    greedy, _, _, _ = plain_generation(copy.deepcopy(hf), PROMPTS, pad)
    width = max(len(prompt) for prompt in PROMPTS)
    eos = int(greedy[1, width + 2])  # the second row ends after 3 tokens (the first row maybe too)
    out, _, calls, _ = plain_generation(reference, PROMPTS, pad, eos_token_id=eos, pad_token_id=pad)
    lengths = generated_lengths(out, width, eos)
    assert lengths[1] == 3 and max(lengths) > 3  # one row ends before the other

    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    result = analysis.collect_generation(wrapped, PROMPTS, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                                         pad_token_id=pad)
    assert torch.equal(result.ids, out)
    assert result.prompt_length == width and result.lengths.tolist() == lengths
    assert result.prompt_lengths.tolist() == [len(prompt) for prompt in PROMPTS]
    assert [result.generated(row).tolist() for row in range(2)] == [out[row, width: width + lengths[row]].tolist()
                                                                    for row in range(2)]
    cache = result.cache
    assert cache.num_texts == 2
    reads = [len(prompt) + length - 1 for prompt, length in zip(PROMPTS, lengths)]
    assert cache.text_index().tolist() == [0] * reads[0] + [1] * reads[1]
    assert cache.position().tolist() == list(range(reads[0])) + list(range(reads[1]))
    read_ids = [token for row, prompt in enumerate(PROMPTS)
                for token in prompt + out[row, width: width + lengths[row] - 1].tolist()]
    assert cache.token_ids().tolist() == read_ids
    for row in range(2):  # generated token j at position prompt_lengths[row] + j, the last one never read
        at = (cache.text_index() == row) & (cache.position() >= int(result.prompt_lengths[row]))
        assert cache.token_ids()[at].tolist() == result.generated(row)[:-1].tolist()
    names = sorted(calls)
    assert [f"model.layers.{layer}.mlp.experts" for layer in cache.layers] == names
    for layer, name in zip(cache.layers, names):
        indices, weights = expected_routing(calls[name], PROMPTS, width, lengths)
        assert torch.equal(cache.indices(layer).long(), indices)
        torch.testing.assert_close(cache.weights(layer), weights.float())


def test_router_logits_of_a_generation_and_the_default_model():
    """logits=True caches each read token's router logits, as the plain router returned them at its step; the
    prompts are texts, tokenized by the model's tokenizer."""
    from transformers import AutoModelForCausalLM

    from moelens.data import TINY_MODEL_PATH

    model = moelens.load()
    reference = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)  # plain: a copy of model._module is instrumented
    prompts = ["import os", "def add(a, b):"]
    token_lists = [model.tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    out, _, calls, logits = plain_generation(reference, token_lists, analysis.corpus.pad_id(model))
    result = analysis.collect_generation(model, prompts, max_new_tokens=NEW, logits=True, do_sample=False)
    assert torch.equal(result.ids, out)
    width = result.prompt_length
    lengths = result.lengths.tolist()
    for layer, name in zip(result.cache.layers, sorted(logits)):
        expected = torch.cat([torch.cat([logits[name][0][row, width - len(prompt):]]
                                        + [logits[name][step][row] for step in range(1, lengths[row])])
                              for row, prompt in enumerate(token_lists)])
        torch.testing.assert_close(result.cache.logits(layer), expected.float())
    assert analysis.expert_usage(result.cache).counts.sum() == result.cache.num_tokens * len(result.cache.layers) * 2


def test_a_generation_leaves_no_warning_and_passes_the_callers_streamer():
    """nnsight's warning at the end of the open step loop is moelens' own business; a streamer given is handed
    every chunk (the prompt, then each step's tokens), as generate hands it."""

    class Kept:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.ended = True

    model = moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())
    kept = Kept()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = analysis.collect_generation(model, PROMPTS, max_new_tokens=3, do_sample=False, streamer=kept)
    assert kept.ended and len(kept.chunks) == 4
    assert torch.equal(torch.cat([kept.chunks[0]] + [chunk[:, None] for chunk in kept.chunks[1:]], 1), result.ids)


@pytest.mark.parametrize(("settings", "message"), [
    ({"num_beams": 2}, r"these settings run 2 \(num_beams=2, num_return_sequences=1\): beam search reorders"),
    ({"num_return_sequences": 3, "do_sample": True}, r"run 3 \(num_beams=1, num_return_sequences=3\).*repeat it"),
    ({"stop_strings": ["x"]}, r"cannot take stop_strings"),
    ({"stopping_criteria": [lambda ids, scores: False]}, r"cannot take stopping_criteria"),
    ({"input_ids": torch.tensor([[1, 2]])}, r"takes the prompts as its prompts argument, got input_ids"),
])
def test_settings_whose_routing_cannot_be_told_per_row_are_refused(settings, message):
    model = moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())
    with pytest.raises(MoelensError, match=message):
        analysis.collect_generation(model, PROMPTS, max_new_tokens=2, **settings)


@pytest.mark.parametrize(("prompts", "new", "message"), [
    ([[1, 2], []], 2, r"prompt 1 has no tokens"),
    ([], 2, r"got no prompts"),
    ([[1, 100000]], 2, r"the prompt holds token id 100000, outside the model's vocabulary"),
    ([[1, 2], [1, 100000]], 2, r"prompt 1 holds token id 100000, outside the model's vocabulary"),
    ([[1, 2]], 0, r"max_new_tokens must be an integer of at least 1, got 0"),
    ([[1] * 500], 20, r"the prompt has 500 tokens, and with max_new_tokens=20 .*\(max_position_embeddings=512\)"),
])
def test_bad_prompts_are_refused_by_name(prompts, new, message):
    model = moelens.wrap(tiny_model("mixtral", max_position_embeddings=512), tokenizer=ascii_tokenizer())
    with pytest.raises(MoelensError, match=message):
        analysis.collect_generation(model, prompts, max_new_tokens=new)


def test_generated_refuses_a_row_the_generation_does_not_have():
    model = moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())
    result = analysis.collect_generation(model, PROMPTS, max_new_tokens=2, do_sample=False)
    with pytest.raises(MoelensError, match=r"row must be below the generation's 2 rows .* got 2"):
        result.generated(2)


def test_a_generation_without_a_key_value_cache_is_routed_at_each_new_token():
    """use_cache=False runs every step over the whole sequence: its new token is the last one, routed as the plain
    run routed it there (not the earlier tokens, which the step runs again)."""
    hf = tiny_model("mixtral")
    reference = copy.deepcopy(hf)
    out, _, calls, _ = plain_generation(reference, PROMPTS, 0, use_cache=False)
    last = {name: [calls[name][0]] + [(indices[:, -1:], weights[:, -1:]) for indices, weights in calls[name][1:]]
            for name in calls}
    result = analysis.collect_generation(moelens.wrap(hf, tokenizer=ascii_tokenizer()), PROMPTS, max_new_tokens=NEW,
                                         do_sample=False, use_cache=False)
    assert torch.equal(result.ids, out) and result.lengths.tolist() == [NEW, NEW]
    assert_routed_as(result, last, [NEW, NEW])


def test_the_token_view_of_a_generated_row_and_the_dense_weights():
    """A row's token view holds its prompt and the generated tokens read, each token's experts highest weight
    first; the cache's dense weights put each slot's weight in its expert's column (recounted by hand)."""
    model = moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())
    result = analysis.collect_generation(model, PROMPTS, max_new_tokens=4, do_sample=False, logits=True)
    cache = result.cache
    for row, prompt in enumerate(PROMPTS):
        view = result.token_routing(row)
        kept = cache.text_index() == row
        assert view.token_ids.tolist() == prompt + result.generated(row)[:-1].tolist()
        for place, layer in enumerate(cache.layers):
            for position in range(len(view.token_ids)):
                pairs = sorted(zip(cache.weights(layer)[kept][position].tolist(),
                                   cache.indices(layer)[kept][position].tolist()), reverse=True)
                assert view.indices[place, position].tolist() == [expert for _, expert in pairs]
            torch.testing.assert_close(view.probs[place], cache.probs(layer)[kept])
    for layer in cache.layers:
        dense = cache.dense_weights(layer)
        expected = torch.zeros(cache.num_tokens, cache.num_experts[layer])
        for token, (experts, weights) in enumerate(zip(cache.indices(layer).tolist(), cache.weights(layer).tolist())):
            for expert, weight in zip(experts, weights):
                expected[token, expert] += weight
        assert torch.equal(dense, expected)
    with pytest.raises(MoelensError, match=r"row must be below the generation's 2 rows"):
        result.token_routing(2)


def test_eos_token_id_none_runs_every_row_to_max_new_tokens():
    """eos_token_id=None turns the model's end-of-sequence token off (transformers sets the config's to None): no
    row ends at it, so every generated token but the last is read and cached."""
    hf = tiny_model("mixtral")
    width = max(len(prompt) for prompt in PROMPTS)
    greedy, _, _, _ = plain_generation(copy.deepcopy(hf), PROMPTS, 0)
    hf.generation_config.eos_token_id = int(greedy[1, width + 1])  # the model's own eos: row 1's second token
    out, _, calls, _ = plain_generation(copy.deepcopy(hf), PROMPTS, 0, eos_token_id=None)
    result = analysis.collect_generation(moelens.wrap(hf, tokenizer=ascii_tokenizer()), PROMPTS, max_new_tokens=NEW,
                                         do_sample=False, eos_token_id=None)
    assert torch.equal(result.ids, out) and result.lengths.tolist() == [NEW, NEW]
    assert_routed_as(result, calls, [NEW, NEW])


def test_a_prompt_run_in_chunks_is_routed_as_one():
    """prefill_chunk_size runs the prompts in several forwards: their routing is put back together."""
    hf = tiny_model("mixtral")
    out, _, calls, _ = plain_generation(copy.deepcopy(hf), PROMPTS, 0, prefill_chunk_size=2)
    merged = {name: [tuple(torch.cat([call[part] for call in steps[:3]], 1) for part in range(2))] + steps[3:]
              for name, steps in calls.items()}  # 5 prompt columns: chunks of 2, 2 and 1
    result = analysis.collect_generation(moelens.wrap(hf, tokenizer=ascii_tokenizer()), PROMPTS, max_new_tokens=NEW,
                                         do_sample=False, prefill_chunk_size=2)
    assert torch.equal(result.ids, out)
    assert_routed_as(result, merged, [NEW, NEW])


def test_a_set_of_prompts_is_refused():
    model = moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())
    with pytest.raises(MoelensError, match=r"is a set"):
        analysis.collect_generation(model, {"ab", "cd"}, max_new_tokens=2)


@pytest.mark.parametrize(("prompts", "message"), [
    (5, r"^prompts must be texts, token-id sequences or a token-id tensor, got int"),
    (torch.zeros(1, 2, 3, dtype=torch.long), r"^prompts as a tensor of token ids must be 1-D or 2-D, got shape \(1, 2, 3\)"),
    (b"ab", r"^prompts is bytes"),
])
def test_prompts_of_no_known_form_are_refused_as_prompts(prompts, message):
    model = moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())
    with pytest.raises(MoelensError, match=message):
        analysis.collect_generation(model, prompts, max_new_tokens=2)


def test_a_generation_steered_through_intervene_is_the_plain_run_with_the_biased_router():
    """collect_generation(intervene=...) runs the intervention on every block at every step before reading its routing:
    the ids and the cache are those of the plain generation whose layer-1 router adds the bias to expert 3's logit
    (F.linear's output for that router's weight, patched), step by step; the steer puts expert 3 in every token's slots
    there. A zero ablation is the plain run whose experts get the expert's weights zeroed (a forward pre-hook), its
    slots cached at weight 0; with logits=True it is refused (the logits come before the weights it wrote)."""
    from unittest import mock

    hf = tiny_model("mixtral")
    reference = copy.deepcopy(hf)
    router = reference.model.layers[1].mlp.gate.weight
    linear = torch.nn.functional.linear

    def biased(x, weight, bias=None):
        out = linear(x, weight, bias)
        return out + torch.nn.functional.one_hot(torch.tensor(3), out.shape[-1]) * 6.0 if weight is router else out

    pad = hf.config.pad_token_id if isinstance(hf.config.pad_token_id, int) else 0
    with mock.patch.object(torch.nn.functional, "linear", biased):
        out, _, calls, _ = plain_generation(reference, PROMPTS, pad, pad_token_id=pad)
    width = max(len(prompt) for prompt in PROMPTS)
    lengths = generated_lengths(out, width, None)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())

    def steer(moe):
        if moe.layer == 1:
            moelens.steer(moe, 3, 6.0)

    result = analysis.collect_generation(wrapped, PROMPTS, max_new_tokens=NEW, do_sample=False, pad_token_id=pad,
                                         intervene=steer)
    assert torch.equal(result.ids, out)
    assert_routed_as(result, calls, lengths)
    assert (result.cache.indices(1) == 3).any(-1).all() and not (result.cache.indices(0) == 3).any(-1).all()
    unsteered = analysis.collect_generation(wrapped, PROMPTS, max_new_tokens=NEW, do_sample=False, pad_token_id=pad)
    assert not torch.equal(unsteered.cache.indices(1), result.cache.indices(1))
    busiest = int(unsteered.cache.indices(0).flatten().mode().values)

    def zeroed(module, args):  # ablate(moe, busiest) on layer 0's experts
        return args[0], args[1], args[2].masked_fill(args[1] == busiest, 0), *args[3:]

    reference = tiny_model("mixtral")  # the same seeded weights, never wrapped (a copy of hf is instrumented)
    hook = reference.model.layers[0].mlp.experts.register_forward_pre_hook(zeroed)
    try:
        out, _, calls, _ = plain_generation(reference, PROMPTS, pad, pad_token_id=pad)
    finally:
        hook.remove()
    ablated = analysis.collect_generation(wrapped, PROMPTS, max_new_tokens=NEW, do_sample=False, pad_token_id=pad,
                                          intervene=lambda moe: moelens.ablate(moe, busiest) if moe.layer == 0 else None)
    assert torch.equal(ablated.ids, out)
    assert_routed_as(ablated, calls, generated_lengths(out, width, None))
    assert not ablated.cache.weights(0)[ablated.cache.indices(0) == busiest].any()
    with pytest.raises(MoelensError, match=r"collect_generation\(intervene=\.\.\.\): model\.model\.layers\.0\.mlp's "
                                           r"router_logits could not be read after intervene\(block\) ran on it.*"
                                           r"or leave logits=True out"):
        analysis.collect_generation(wrapped, PROMPTS, max_new_tokens=2, logits=True,
                                    intervene=lambda moe: moelens.ablate(moe, 3))
    with pytest.raises(MoelensError, match=r"layers\.2\.mlp's expert_weights could not be read after intervene\(block\) "
                                           r"ran on it: the intervention read or wrote a value the block makes after "
                                           r"expert_weights \(its output, expert_outputs, routed_output\)\.") as refused:
        analysis.collect_generation(wrapped, PROMPTS, max_new_tokens=2,
                                    intervene=lambda moe: moe.output.save() if moe.layer == 2 else None)
    assert "logits=True" not in str(refused.value)
    with pytest.raises(MoelensError, match=r"intervene takes a function of an MoE block .*got dict"):
        analysis.collect_generation(wrapped, PROMPTS, max_new_tokens=2, intervene={1: 3})
