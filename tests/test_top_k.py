"""`moelens.set_top_k`: every family's routers run at the k set, where the family keeps it, and get their old k back.

Ground truth: the routing recomputed from the router's raw logits op at the new k (`families.check`), the model
transformers builds with that k in its config (the same weights), the plain model's logits before and after, and for renormalising families the model kept at its k with all but the best slots
dropped (`keep_top(renormalize=True)`, which edits the weights instead of the router).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import moelens
from moelens import ArgumentError, FamilyError, MoelensError, families
from moelens.testing import EXPERTS_IMPLEMENTATIONS, FAMILIES, tiny_inputs, tiny_model
from test_tiny_models import _one_thread  # noqa: F401  (tiny models run fastest on one thread)

CASES = [(family, impl) for family in FAMILIES for impl in EXPERTS_IMPLEMENTATIONS[family] if family != "phimoe"]


@functools.lru_cache(maxsize=None)
def _wrapped(family: str, impl: str | None = None):
    return moelens.wrap(tiny_model(family, experts_implementation=impl))


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model._module(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.mark.parametrize("family,impl", CASES, ids=[f"{family}-{impl}" for family, impl in CASES])
def test_every_family_routes_at_the_k_set_and_gets_its_k_back(family, impl):
    model = _wrapped(family, impl)
    inputs = tiny_inputs(model._module)
    ks = [moe.top_k for moe in model.moes]
    before = _logits(model, inputs)
    new_k = ks[-1] + 1  # k = 1 breaks longcat_flash's own eager experts (a squeeze of the k axis)
    hashed = [moe.SCORING.select == "hash" for moe in model.moes]
    with moelens.set_top_k(model, new_k):
        indices = []
        with torch.no_grad(), model.trace(**inputs):
            for moe in model.moes:
                if not moe.runs_only_on:
                    indices.append(moe.expert_indices.save())
            logits = model.output[0].save()
        expected = [k if hash_routed else new_k for k, hash_routed in zip(ks, hashed)]
        assert [moe.top_k for moe in model.moes] == expected
        ran = [k for moe, k in zip(model.moes, expected) if not moe.runs_only_on]
        assert [index.shape[-1] for index in indices] == ran
        if impl == EXPERTS_IMPLEMENTATIONS[family][0]:
            assert families.check(model, **inputs)  # the routing recomputed from the raw logits at the new k
        plain = _logits(model, inputs)
        torch.testing.assert_close(logits, plain, rtol=0, atol=0)  # the trace runs the model as it is
        assert not torch.equal(plain, before)  # the model computed something else
    assert [moe.top_k for moe in model.moes] == ks
    torch.testing.assert_close(_logits(model, inputs), before, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_top_1_equals_keeping_the_best_slot_renormalised(family):
    """A family that renormalises its top-k at k = 1 gives its best expert weight 1: the same as the model at k = 2
    with the other slot dropped and the kept weight renormalised (interventions.md)."""
    hf = tiny_model(family, norm_topk_prob=True) if family == "qwen3_moe" else tiny_model(family)
    model = moelens.wrap(hf)
    inputs = tiny_inputs(hf)
    with torch.no_grad(), model.trace(**inputs):
        for moe in model.moes:
            moelens.keep_top(moe, 1, renormalize=True)
        kept = model.output.logits.save()
    with moelens.set_top_k(model, 1), torch.no_grad(), model.trace(**inputs):
        top1 = model.output.logits.save()
    torch.testing.assert_close(top1, kept, atol=1e-5, rtol=1e-5)


def test_a_setting_without_with_lasts_until_restored_and_blocks_can_be_set_alone():
    model = moelens.wrap(tiny_model("mixtral"))
    setting = moelens.set_top_k(model.moes[1], 3)
    assert [moe.top_k for moe in model.moes] == [2, 3, 2, 2]
    assert model.moes[1].router._module.top_k == 3
    setting.restore()
    setting.restore()  # a second time: nothing more
    assert [moe.top_k for moe in model.moes] == [2, 2, 2, 2]
    with moelens.set_top_k([model.moes[0], model.moes[3]], 1):
        assert [moe.top_k for moe in model.moes] == [1, 2, 2, 1]
    assert [moe.top_k for moe in model.moes] == [2, 2, 2, 2]


def test_where_each_family_keeps_k_is_the_place_set():
    """dbrx reads its block's top_k (setting router.top_k there changes nothing); gemma4 its config, shared by every
    layer: one block alone is refused, the whole model sets it once."""
    dbrx = moelens.wrap(tiny_model("dbrx"))
    with moelens.set_top_k(dbrx, 1):
        assert all(moe._module.top_k == 1 for moe in dbrx.moes)
    gemma4 = moelens.wrap(tiny_model("gemma4"))
    config = gemma4.moes[0].router._module.config
    with pytest.raises(ArgumentError, match=r"keeps its k in router\.config\.top_k_experts .* which "
                                            r"model\.model\.layers\.\d reads too \(not given\): setting it would change "
                                            r"both\. Give both blocks, or the whole model"):
        moelens.set_top_k(gemma4.moes[1], 1)
    assert config.top_k_experts == 2
    with moelens.set_top_k(gemma4, 1):
        assert config.top_k_experts == 1
    assert config.top_k_experts == 2
    # llama4: moelens derives the indices from the logits (families.check cannot compare them); its router's own
    # scores, by a hook, are nonzero at k experts a token
    llama4 = moelens.wrap(tiny_model("llama4"))
    scores = []
    hook = llama4.moes[0].router._module.register_forward_hook(lambda module, args, out: scores.append(out[0]))
    try:
        with moelens.set_top_k(llama4, 3), torch.no_grad():
            llama4._module(**tiny_inputs(llama4._module))
    finally:
        hook.remove()
    assert (scores[0] > 0).sum(-1).tolist() == [3] * scores[0].shape[0]


def test_hash_routed_layers_keep_their_table_width():
    model = moelens.wrap(tiny_model("deepseek_v4"))
    assert model.moes[0].SCORING.select == "hash"
    with pytest.raises(ArgumentError, match=r"no block given routes by a top-k \(model\.model\.layers\.0\.mlp take "
                                            r"their experts from a token-id table"):
        moelens.set_top_k(model.moes[0], 1)
    with moelens.set_top_k(model, 1):
        assert model.moes[0].router._module.top_k == 2 and model.moes[1].router._module.top_k == 1


def test_bad_arguments_are_refused_saying_what_to_give():
    model = moelens.wrap(tiny_model("mixtral"))
    other = moelens.wrap(tiny_model("mixtral"))
    refusals = {
        r"k=0 routes no expert; give 1 or more \(.*keep_top\(moe, 0\)": 0,
        r"k=9 is more than the 8 experts of model\.model\.layers\.0\.mlp; give at most 8\.": 9,
        r"k must be a whole number of experts per token, got float 1\.5\.": 1.5,
        r"k must be a whole number of experts per token, got bool True\.": True,
    }
    for message, k in refusals.items():
        with pytest.raises(ArgumentError, match=message):
            moelens.set_top_k(model, k)
    with pytest.raises(ArgumentError, match=r"takes a wrapped model, an MoE block .* got model\.model\.layers\.0 "
                                            r"\(MixtralDecoderLayer\), which is no MoE block \(it holds model\.model\.layers\.0\.mlp "
                                            r"\(model\.moes\[0\]\): pass that\)\."):
        moelens.set_top_k(model.model.layers[0], 1)
    with pytest.raises(ArgumentError, match=r"got Tensor"):
        moelens.set_top_k(torch.zeros(2), 1)
    with pytest.raises(ArgumentError, match="different wrapped models"):
        moelens.set_top_k([model.moes[0], other.moes[0]], 1)
    with pytest.raises(FamilyError, match=r"\(phimoe\) picks 2 experts per token in its router's code"):
        moelens.set_top_k(moelens.wrap(tiny_model("phimoe")), 1)
    with pytest.raises(MoelensError, match="call it before the trace"), model.trace(**tiny_inputs(model._module)):
        moelens.set_top_k(model, 1)
    assert [moe.top_k for moe in model.moes] == [2, 2, 2, 2]  # nothing was set


def test_the_docs_examples_run_as_written(tmp_path):
    """docs/interventions.md's top-1 and top-p examples on moelens-tiny (qwen2_moe, norm_topk_prob on). Ground truth:
    top-1 is keep_top(moe, 1, renormalize=True) at k = 2; top-p's experts per token counted by hand from the softmax
    of block 1's router logits, taken by a hook on the plain model."""
    from test_analysis import _run_docs_example

    model = moelens.load()
    prompt = "import os\nprint(os.path"
    with torch.no_grad(), model.trace(prompt):
        clean = model.output.logits[0, -1].softmax(-1).save()
    with torch.no_grad(), model.trace(prompt):
        for moe in model.moes:
            moelens.keep_top(moe, 1, renormalize=True)
        kept = model.output.logits[0, -1].softmax(-1).save()
    names = {"moelens": moelens, "model": model, "prompt": prompt, "clean": clean}
    top1 = _run_docs_example("interventions.md", "moelens.set_top_k(model, 1)", tmp_path, names)["top1"]
    torch.testing.assert_close(top1, kept)
    logits = []
    hook = model.moes[1].router._module.register_forward_hook(lambda module, args, out: logits.append(out[0]))
    try:
        with torch.no_grad():
            model._module(**model.tokenizer(prompt, return_tensors="pt"))
    finally:
        hook.remove()
    ranked = logits[0].float().softmax(-1).sort(-1, descending=True).values
    expected = ((ranked.cumsum(-1) - ranked) < 0.6).sum(-1)
    (tmp_path / "top_p").mkdir()  # nnsight reads a file's source once: another file for the other example
    top_p = _run_docs_example("interventions.md", "moelens.set_top_k(block, block.num_experts)", tmp_path / "top_p",
                              names)
    assert top_p["used"].flatten().tolist() == expected.tolist() and expected.max() > 1
    assert [moe.top_k for moe in model.moes] == [2] * len(model.moes)


#: The config settings families keep k in (on the config, or on its text / ffn sub-config).
K_SETTINGS = ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_top_k", "num_experts_per_token", "top_k",
              "moe_k")


def _configs(config):
    yield config
    for name in ("text_config", "ffn_config"):
        if hasattr(getattr(config, name, None), "to_dict"):
            yield from _configs(getattr(config, name))


def _built_at(hf, k: int, was: int = 2):
    """Ground truth: the same weights in a model whose config says k where it said ``was`` (transformers itself)."""
    import copy

    config = copy.deepcopy(hf.config)
    settings = [(each, name) for each in _configs(config) for name in K_SETTINGS if each.__dict__.get(name) == was]
    assert settings, f"no k setting of {type(config).__name__} holds {was}"
    for each, name in settings:
        setattr(each, name, k)
    other = type(hf)._from_config(config).eval()
    other.load_state_dict(hf.state_dict())
    return other


#: phimoe's k is fixed in code; deepseek_v4's hash layers keep a table as wide as the config's k.
BUILT_AT_K = [family for family in FAMILIES if family not in ("phimoe", "deepseek_v4")]


@pytest.mark.parametrize("family", BUILT_AT_K)
def test_every_family_runs_as_the_model_built_at_that_k(family):
    model = moelens.wrap(tiny_model(family))
    k = model.moes[-1].top_k
    reference = moelens.wrap(_built_at(model._module, k + 1, was=k))
    assert [moe.top_k for moe in reference.moes] == [k + 1] * len(model.moes)
    inputs = tiny_inputs(model._module)
    with moelens.set_top_k(model, k + 1):
        torch.testing.assert_close(_logits(model, inputs), _logits(reference, inputs), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["openai_privacy_filter", "mixtral"])
def test_the_model_equals_the_one_built_at_that_k(family):
    """openai_privacy_filter's router divides its weights by k and its block multiplies the output by
    config.num_experts_per_tok again: both follow the k set. The router aux loss (output_router_logits=True) counts
    the new k too, where every block is set (the causal-LM model's num_experts_per_tok)."""
    hf = tiny_model(family)
    model = moelens.wrap(hf)
    inputs = tiny_inputs(hf)
    for k in (1, 3):
        reference = _built_at(hf, k)
        with torch.no_grad():
            expected = reference(**inputs, output_router_logits=family == "mixtral")
            with moelens.set_top_k(model, k):
                got = hf(**inputs, output_router_logits=family == "mixtral")
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-6)
        if family == "mixtral":
            torch.testing.assert_close(got.aux_loss, expected.aux_loss)
    if family == "openai_privacy_filter":
        assert all(moe._module.num_experts == 2 for moe in model.moes)  # put back with the router's k
    else:
        assert hf.num_experts_per_tok == 2


def test_a_peft_model_counts_its_aux_loss_at_the_k_set():
    """PEFT's model reads num_experts_per_tok through to the transformers model but keeps a write for itself: the aux
    loss still counted k = 2, and the PeftModel kept a stale attribute after restore. Ground truth: the model built at
    k = 1 (zero-initialised LoRA adds nothing)."""
    peft = pytest.importorskip("peft")
    hf = tiny_model("mixtral")
    expected = _built_at(hf, 1)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model, inputs = moelens.wrap(tuned), tiny_inputs(hf)
    with torch.no_grad():
        with moelens.set_top_k(model, 1):
            got = tuned(**inputs, output_router_logits=True)
        torch.testing.assert_close(got.aux_loss, expected(**inputs, output_router_logits=True).aux_loss)
    assert "num_experts_per_tok" not in vars(tuned) and hf.num_experts_per_tok == 2


def test_a_copy_of_a_peft_model_under_a_setting_of_its_inner_model_routes_at_the_old_k():
    """The transformers model wrapped apart from the PEFT model around it: a setting on that wrap, then a copy of the
    PEFT model's wrap, kept the k set for good (the settings undone were the copied wrap's alone)."""
    import copy

    peft = pytest.importorskip("peft")
    hf = tiny_model("mixtral")
    reference, inputs = copy.deepcopy(hf), tiny_inputs(hf)
    inner = moelens.wrap(hf)
    outer = moelens.wrap(peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj"])))
    with moelens.set_top_k(inner, 1):
        with pytest.warns(UserWarning, match=r"^deepcopy: moelens\.set_top_k\(1\) is held on \(part of\) this model"):
            twin = copy.deepcopy(outer)
    assert [moe.top_k for moe in twin.moes] == [2, 2, 2, 2]
    with torch.no_grad():
        torch.testing.assert_close(twin._module(**inputs).logits, reference(**inputs).logits, rtol=0, atol=0)


def test_settings_restored_out_of_order_put_the_first_k_back():
    model = moelens.wrap(tiny_model("mixtral"))
    first = moelens.set_top_k(model, 3)
    second = moelens.set_top_k(model, 1)
    first.restore()
    assert [moe.top_k for moe in model.moes] == [1, 1, 1, 1]  # the later setting stays in force
    second.restore()
    assert [moe.top_k for moe in model.moes] == [2, 2, 2, 2]
    assert model._module.num_experts_per_tok == 2


def test_a_copy_made_under_a_setting_routes_at_the_k_its_config_names():
    """No setting's restore reaches a deep copy: it kept the k set for good, while its config (and its
    save_pretrained) named the old one. Ground truth: the model as built, and as built at k = 1."""
    import copy

    hf = tiny_model("mixtral")
    model, reference, at_1 = moelens.wrap(hf), copy.deepcopy(hf), _built_at(hf, 1)
    inputs = tiny_inputs(hf)
    with moelens.set_top_k(model, 3), moelens.set_top_k(model.moes[1], 1):
        with pytest.warns(UserWarning, match=r"^deepcopy: moelens\.set_top_k\(1, 3\) is held on \(part of\) this "
                                             r"model; the copy routes at the k from before it .* set it on the copy to route it so\."):
            twin = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # another model's settings: nothing to undo or warn of
            copy.deepcopy(moelens.wrap(copy.deepcopy(reference)))
        assert [moe.top_k for moe in twin.moes] == [2, 2, 2, 2] and twin._module.num_experts_per_tok == 2
        with torch.no_grad():
            torch.testing.assert_close(_logits(twin, inputs), reference(**inputs).logits, rtol=0, atol=0)
    with moelens.set_top_k(twin, 1):  # the copy's own settings work as on any model
        torch.testing.assert_close(_logits(twin, inputs), _logits(moelens.wrap(at_1), inputs), rtol=0, atol=0)
    assert [moe.top_k for moe in model.moes] == [2, 2, 2, 2]


def test_a_k_beyond_the_experts_of_the_kept_groups_is_warned_of():
    """deepseek_v3's tiny router keeps 2 of 4 groups of 8 experts: 4 experts to pick from. Ground truth: the router's
    own choice at k = 5 holds an expert outside the 2 best groups for every token (the masked scores)."""
    model = moelens.wrap(tiny_model("deepseek_v3"))
    block = model.moes[0]
    assert block.family.groups_of(block._module) == (4, 2)
    with pytest.warns(UserWarning, match=r"k=5 is more than the experts of the best groups that "
                                         r"model\.model\.layers\.1\.mlp \(2 of 4 groups: 4 experts\), .* pick from"):
        setting = moelens.set_top_k(model, 5)
    indices = []
    hook = block.experts._module.register_forward_pre_hook(lambda module, args: indices.append(args[1]))
    try:
        with torch.no_grad():
            model._module(**tiny_inputs(model._module))
    finally:
        hook.remove()
        setting.restore()
    groups = indices[0] // 2  # 8 experts in 4 groups of 2
    assert all(len(set(row.tolist())) > 2 for row in groups)  # more than the 2 kept groups
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moelens.set_top_k(model, 4).restore()


def test_selection_scores_writes_at_a_k_beyond_the_kept_groups_need_only_the_experts_those_groups_hold():
    """At k = 5 over 4 reachable experts, every selection_scores write was refused (it asked for 5 experts above -inf
    in the kept groups, which hold 4), an unchanged one too. Ground truth: the model's own logits at that k."""
    model = moelens.wrap(tiny_model("deepseek_v3"))
    inputs = tiny_inputs(model._module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the k beyond the groups, warned of above
        setting = moelens.set_top_k(model, 5)
    try:
        with torch.no_grad(), model.trace(**inputs):
            block = model.moes[0]
            block.selection_scores = block.selection_scores.clone()
            logits = model.output.logits.save()
        torch.testing.assert_close(logits, _logits(model, inputs), rtol=0, atol=0)
        with pytest.raises(moelens.WriteError, match=r"fewer than 4 entries of some token are above -inf inside the "
                                                     r"best 2 of its 4 expert groups"):
            with torch.no_grad(), model.trace(**inputs):
                scores = model.moes[0].selection_scores.clone()
                scores[..., 3:] = float("-inf")
                model.moes[0].selection_scores = scores
    finally:
        setting.restore()
