"""Blocks the tract export must refuse up front, and the close neighbour it must accept.

Ground truth: the documented refusals (an `ExportRefused` naming what tract cannot express, no file
written), and for the accepted neighbour the torch block itself run on the same hidden states as the
exported archive in tract.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

import moelens
from moelens import families
from moelens.export import ExportError, ExportRefused, run, to_nnef
from moelens.testing import tiny_model

pytest.importorskip("torch_to_nnef", reason="the export extra is not installed (pip install 'moelens[export]')")
pytest.importorskip("tract", reason="the export extra is not installed (pip install 'moelens[export]')")


def two_layer_mixtral(**overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model("mixtral", num_hidden_layers=2, **overrides)


def test_a_block_replaced_after_wrapping_is_refused_naming_it(tmp_path):
    """A block replaced in the torch model after wrapping: the wrapped model's export crashed with a KeyError (the
    id of the old block), and its Moe's export wrote the old block, which the model no longer runs, and verified it
    against itself. Wrapped again, the archive is the new block (ground truth: the new block in torch)."""
    hf = two_layer_mixtral()
    wrapped = moelens.wrap(hf)
    old_block = wrapped.moes[0]
    new = copy.deepcopy(hf.model.layers[0].mlp)
    with torch.no_grad():
        new.experts.down_proj.mul_(2.0)
    hf.model.layers[0].mlp = new
    replaced = r"model\.model\.layers\.0\.mlp is no longer the module this model was wrapped with .*: {}\. Wrap the model again"
    with pytest.raises(ExportError, match=replaced.format("model.moes lists the blocks as wrapped")):
        to_nnef(wrapped, tmp_path / "model.nnef.tgz", verify=False)
    with pytest.raises(ExportError, match=replaced.format("the archive would hold the old block")):
        to_nnef(old_block, tmp_path / "block.nnef.tgz", verify=False)
    assert not list(tmp_path.iterdir())
    hidden = torch.randn(1, 6, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    report = to_nnef(moelens.wrap(hf).moes[0], tmp_path / "again.nnef.tgz", example_inputs=hidden)
    with torch.no_grad():
        expected = new(hidden)
    np.testing.assert_allclose(run(report.path, hidden), expected.numpy(), atol=1e-4, rtol=5e-4)


def test_experts_with_exact_erf_gelu_are_refused(tmp_path):
    """Guards against exact GELU passing for tract's tanh GELU (up to 5e-4 apart): the block would not match."""
    hf = two_layer_mixtral(hidden_act="gelu")
    experts = hf.model.layers[0].mlp.experts
    probe = torch.linspace(-4, 4, 101)
    assert torch.equal(experts.act_fn(probe), F.gelu(probe))  # transformers' "gelu" is the exact one
    path = tmp_path / "erf.nnef.tgz"
    with pytest.raises(ExportRefused, match=r"mixtral: the experts use exact \(erf\) GELU"):
        to_nnef(moelens.wrap(hf).moes[0], path)
    assert not path.exists()


class CappedSiLU(torch.nn.Module):
    """SiLU capped at 10: silu itself on [-8, 8], not beyond."""

    def forward(self, x):
        return F.silu(x).clamp(max=10.0)


def test_an_activation_that_is_silu_only_on_small_values_is_refused(tmp_path):
    """The activation was identified on [-8, 8] alone: a SiLU capped at 10 exported as swiglu, and the checks
    passed (their inputs keep pre-activations small), though the archive is 72% off the block at inputs x100."""
    hf = two_layer_mixtral()
    hf.model.layers[0].mlp.experts.act_fn = CappedSiLU()
    probe = torch.linspace(-8, 8, 101)
    assert torch.equal(CappedSiLU()(probe), F.silu(probe)) and CappedSiLU()(torch.tensor(20.0)) < 20
    path = tmp_path / "capped.nnef.tgz"
    with pytest.raises(ExportRefused, match=r"mixtral: the experts' activation CappedSiLU is none of"):
        to_nnef(moelens.wrap(hf).moes[0], path)
    assert not path.exists()


def test_experts_with_tanh_gelu_export_and_match_the_block(tmp_path):
    """The neighbour of the refusal above: tanh GELU is tract's gelu and must still export."""
    hf = two_layer_mixtral(hidden_act="gelu_pytorch_tanh")
    moe = moelens.wrap(hf).moes[0]
    hidden = torch.randn(2, 6, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    report = to_nnef(moe, tmp_path / "tanh.nnef.tgz", example_inputs=hidden)
    assert report.blocks[0].activation == "gelu"
    with torch.no_grad():
        expected = hf.model.layers[0].mlp(hidden)
    np.testing.assert_allclose(run(report.path, hidden), expected.numpy(), atol=1e-4, rtol=5e-4)


class CappedRouter(MixtralTopKRouter):
    """mixtral's router with a logit softcap: its scores are softmax(tanh(logits / c) * c)."""

    logit_cap = 5.0

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        capped = torch.tanh(router_logits / self.logit_cap) * self.logit_cap
        router_probs = torch.nn.functional.softmax(capped.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value, router_indices


@pytest.fixture
def capped_family():
    base = families.get("mixtral")
    family = families.register(dataclasses.replace(
        base, name="capped", scoring=dataclasses.replace(base.scoring, softcap="router.logit_cap")), replace=True)
    yield family
    families.unregister("capped")


def test_a_router_softcap_is_refused_naming_it(capped_family, tmp_path):
    """Guards against a registered family with a router softcap exporting its router as a plain softmax of the logits."""
    hf = two_layer_mixtral()
    for layer in hf.model.layers:
        layer.mlp.gate.__class__ = CappedRouter
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    assert moe.family is capped_family and capped_family.softcap_of(moe._module) == 5.0
    ids = torch.tensor([[5, 9, 40, 71, 88, 12]])
    with torch.no_grad(), wrapped.trace(ids):
        logits, probs, indices = moe.router_logits.save(), moe.router_probs.save(), moe.expert_indices.save()
    # the family describes the model: the capped softmax of the logits, by hand, picks the experts it ran
    by_hand = torch.softmax(torch.tanh(logits / 5.0) * 5.0, dim=-1)
    torch.testing.assert_close(probs, by_hand)
    assert torch.equal(indices.sort(-1).values, by_hand.topk(2, dim=-1).indices.sort(-1).values)
    path = tmp_path / "capped.nnef.tgz"
    with pytest.raises(ExportRefused, match=r"capped: router logits softcapped before scoring"):
        to_nnef(moe, path)
    assert not path.exists()


class FlooredRouter(MixtralTopKRouter):
    """mixtral's router renormalising as ernie4_5's does: its k weights divided by clamp(sum, min=norm_min)."""

    norm_min = 0.9

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return router_logits, router_top_value, router_indices


@pytest.fixture
def floored_family():
    base = families.get("mixtral")
    family = families.register(dataclasses.replace(
        base, name="floored", scoring=dataclasses.replace(base.scoring, normalize_min="router.norm_min")), replace=True)
    yield family
    families.unregister("floored")


def _floored_mixtral(norm_min: float):
    hf = two_layer_mixtral()
    for layer in hf.model.layers:
        layer.mlp.gate.__class__ = FlooredRouter
        layer.mlp.gate.norm_min = norm_min
    return hf


def test_a_renormalisation_floor_that_can_bind_is_refused_naming_it(floored_family, tmp_path):
    """Guards against a router dividing by clamp(sum, min=floor) (ernie4_5's moe_norm_min) exporting as tract's
    softmax_topk, which always renormalises to sum to one: with the floor 0.9 above k/E = 2/8 the weights differ."""
    hf = _floored_mixtral(0.9)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    assert moe.family is floored_family
    ids = torch.tensor([[5, 9, 40, 71, 88, 12]])
    with torch.no_grad(), wrapped.trace(ids):
        logits, weights = moe.router_logits.save(), moe.expert_weights.save()
    chosen = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1).values
    torch.testing.assert_close(weights.float(), chosen / chosen.sum(-1, keepdim=True).clamp(min=0.9))  # by hand
    assert not torch.allclose(weights.float().sum(-1), torch.ones(weights.shape[:-1]))  # the floor binds here
    assert families.check(wrapped, ids) == [moe.path for moe in wrapped.moes]  # the entry describes the model
    path = tmp_path / "floored.nnef.tgz"
    with pytest.raises(ExportRefused, match=r"floored: the k softmax weights are divided by their sum clamped at "
                                            r">= 0\.9 \(Scoring\.normalize_min = 'router\.norm_min', a floor such as "
                                            r"ernie4_5's moe_norm_min\), above k/E = 2/8"):
        to_nnef(moe, path)
    assert not path.exists()


def test_a_renormalisation_floor_that_cannot_bind_exports_and_matches_the_block(floored_family, tmp_path):
    """The neighbour of the refusal above: a floor of 1e-12 (ernie4_5's default moe_norm_min) is below the least the
    top 2 of 8 softmax scores sum to (2/8), so tract's softmax_topk is the router's maths and the block exports."""
    from moelens.export.gate import family_support

    hf = _floored_mixtral(1e-12)
    moe = moelens.wrap(hf).moes[0]
    hidden = torch.randn(2, 6, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    report = to_nnef(moe, tmp_path / "floored.nnef.tgz", example_inputs=hidden)
    with torch.no_grad():
        expected = hf.model.layers[0].mlp(hidden)
    np.testing.assert_allclose(run(report.path, hidden), expected.numpy(), atol=1e-4, rtol=5e-4)
    support = family_support(floored_family)
    assert support.status == "if" and "router.norm_min <= k/E" in support.condition


def test_inputs_longer_than_the_models_context_are_refused_before_anything_is_written(tmp_path, capsys):
    """moelens-tiny's context is 256 positions: `export --tokens 300` baked 300 positions into the archive without a
    word (and a huge --tokens just ran). A block takes no positions, so its inputs may be longer."""
    from moelens.cli import main
    from moelens.export import ExportError

    model = moelens.load()
    context = model.config.max_position_embeddings
    ids = torch.randint(3, 100, (1, context + 1))
    with pytest.raises(ExportError, match=rf"{context + 1} tokens is longer than the model's context "
                                          rf"\(max_position_embeddings={context}\)"):
        to_nnef(model, tmp_path / "model.nnef.tgz", example_inputs=ids, verify=False)
    assert main(["export", "tiny", str(tmp_path / "cli.nnef.tgz"), "--tokens", str(context + 1)]) == 2
    assert f"--tokens {context + 1}: {context + 1} tokens is longer than the model's context" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    block = to_nnef(model.moes[0], tmp_path / "block.nnef.tgz", example_inputs=torch.randn(1, context + 1, model.config.hidden_size),
                    verify=False)
    assert block.path.exists()


def test_the_archive_and_the_model_given_in_the_wrong_order_are_refused_saying_which_comes_first(tmp_path):
    """to_nnef(model, path) and verify(path, model) take their arguments in opposite orders; swapped, they failed with
    pathlib's bare TypeError."""
    from moelens.export import ExportError, verify

    model = moelens.wrap(tiny_model("mixtral"))
    with pytest.raises(ExportError, match=r"verify's path must be a path .* got MoeNNsight \(verify takes the archive "
                                          r"first: verify\(path, model\)"):
        verify(model, tmp_path / "x.nnef.tgz")
    with pytest.raises(ExportError, match=r"to_nnef.s path must be a path .* got MoeNNsight \(to_nnef takes the model first"):
        to_nnef(tmp_path / "x.nnef.tgz", model)
    with pytest.raises(ExportError, match=r"path must be a path \(a str or a pathlib.Path\), got NoneType"):
        run(None, torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("given", [3, "mixtral", ["mixtral"]], ids=["int", "str", "list-of-names"])
def test_the_support_table_takes_family_entries_only(given):
    from moelens.export import ExportError, support_table

    with pytest.raises(ExportError, match=r"support_table\(families=...\) takes a list of Family entries"):
        support_table(given)
    assert "| mixtral |" in support_table([families.get("mixtral")])


def test_a_torch_to_nnef_failure_is_named_in_one_line_and_kept_whole_as_the_cause(tmp_path, monkeypatch):
    """lara_mini's whole-model export failed inside torch-to-nnef with an error that printed whole tensors: the
    ExportError ran to 5.7 KB before saying what to do. Its message keeps the first line; the error stays chained."""
    import torch_to_nnef

    from moelens.export import ExportError

    printed = "aten.linalg_solve_triangular failed on\n" + "\n".join(["tensor([[nan, inf, -2.5e31, ...]])"] * 100)

    def fails(*args, **kwargs):
        raise RuntimeError(printed)

    monkeypatch.setattr(torch_to_nnef, "export_model_to_nnef", fails)
    with pytest.raises(ExportError) as caught:
        to_nnef(moelens.wrap(tiny_model("mixtral")), tmp_path / "model.nnef.tgz", verify=False)
    message = str(caught.value)
    assert "(RuntimeError: aten.linalg_solve_triangular failed on ...). The MoE blocks were accepted" in message
    assert "tensor(" not in message and len(message) < 600
    assert caught.value.__cause__.args == (printed,)


def _routed_around_by_hand(block, hidden, removed):
    """A Mixtral block's output with the ``removed`` experts' logits -inf, the routing made by hand (softmax, top-k,
    renormalised, as MixtralTopKRouter) and each expert's SwiGLU from its own weights."""
    router, experts = block.gate, block.experts
    x = hidden.reshape(-1, hidden.shape[-1])
    logits = F.linear(x, router.weight)
    logits[:, removed] = float("-inf")
    weights, chosen = logits.softmax(-1).topk(router.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for slot in range(router.top_k):
        for token, expert in enumerate(chosen[:, slot].tolist()):
            gate, up = F.linear(x[token], experts.gate_up_proj[expert]).chunk(2)
            out[token] += weights[token, slot] * F.linear(F.silu(gate) * up, experts.down_proj[expert])
    return out.reshape(hidden.shape)


@pytest.mark.parametrize("k, removed", [(2, [0, 1, 2, 3, 4, 5, 6]), (8, [3, 5])], ids=["7-of-8-top-2", "top-k=E"])
def test_routing_around_until_fewer_than_k_experts_are_left_exports_them_at_weight_zero(tmp_path, k, removed):
    """Routing around 7 of a top-2 layer's 8 experts, or any expert at top_k = E, was refused ("a router bias of -inf
    cannot express" it), though the intervention serves it: the router fills its last slots with removed experts at
    weight 0, and tract's gates give a -inf logit weight 0 too. Exported and verified now; ground truth: the block
    recomputed by hand from its weights with those logits -inf."""
    from moelens.export import Edits

    hf = two_layer_mixtral(num_experts_per_tok=k)
    reference = copy.deepcopy(hf.model.layers[1].mlp)
    moe = moelens.wrap(hf).moes[1]
    hidden = torch.randn(1, 6, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    report = to_nnef(moe, tmp_path / "around.nnef.tgz", edits=Edits(route_around={1: removed}), example_inputs=hidden)
    with torch.no_grad():
        expected = _routed_around_by_hand(reference, hidden, removed)
    np.testing.assert_allclose(run(report.path, hidden), expected.numpy(), atol=1e-4, rtol=5e-4)


def test_routing_around_every_expert_of_a_sigmoid_gate_exports_a_routed_output_of_zero(tmp_path):
    """Under a sigmoid gate that does not renormalise, every expert routed around weighs 0 (sigmoid(-inf)), as the
    intervention takes it: the block's output is its shared expert's alone. It was refused as NaN, which only a
    softmax gate gives. Ground truth: the shared expert of the unwrapped block, run in torch."""
    from moelens.export import Edits

    hf = tiny_model("cohere2_moe", expert_selection_fn="sigmoid", norm_topk_prob=False)
    moe = moelens.wrap(hf).moes[-1]
    block = copy.deepcopy(moe._module)
    assert block.shared_expert_combination_strategy == "average" and block.num_shared_experts > 0
    hidden = torch.randn(1, 6, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    report = to_nnef(moe, tmp_path / "every.nnef.tgz", example_inputs=hidden,
                     edits=Edits(route_around={moe.layer: list(range(moe.num_experts))}))
    with torch.no_grad():
        expected = block.shared_experts(hidden) / 2  # averaged with a routed output of 0
    np.testing.assert_allclose(run(report.path, hidden), expected.numpy(), atol=1e-5, rtol=5e-4)


def test_routing_around_every_expert_is_refused_saying_what_to_do_instead(tmp_path, capsys):
    """Every expert of a layer routed around leaves the router nothing to pick (its softmax over -inf alone is NaN):
    refused with the zero ablation that removes them all, in the API's words and the command line's. Ground truth:
    the checkpoint's config (E), and the advice followed exporting."""
    from moelens.cli import main
    from moelens.export import Edits

    model = moelens.load()
    every = list(range(model.config.num_experts))
    with pytest.raises(ExportRefused, match=rf"^Edits\.route_around\[1\] names every one of the layer's {len(every)} "
                                            r"experts: .*softmax_topk gate weighs -inf logits alone as NaN; zero-ablate "
                                            r"them instead \(Edits\.ablate\[1\]: their slots stay, contributing "
                                            r"nothing\)\.$"):
        to_nnef(model, tmp_path / "every.nnef.tgz", edits=Edits(route_around={1: every}), verify=False)
    argv = ["export", "tiny", str(tmp_path / "cli.nnef.tgz"), "--no-verify",
            "--route-around", "1:" + ",".join(map(str, every))]
    assert main(argv) == 2
    assert ("--route-around of layer 1 names every one of the layer's" in (err := capsys.readouterr().err)
            and "zero-ablate them instead (--ablate of layer 1: their slots stay" in err)
    assert not list(tmp_path.iterdir())
    followed = Edits(ablate={1: every})
    assert to_nnef(model, tmp_path / "ablated.nnef.tgz", edits=followed, verify=False).path.exists()


def test_too_few_example_tokens_are_named_as_the_option_or_argument_given(tmp_path, capsys):
    """`moelens export --tokens 0` said "... got --tokens 0, batch=1", naming a batch the command has no option for.
    The command's user reads --tokens alone; the Python user reads default_inputs' own argument, tokens or batch."""
    from moelens.cli import main
    from moelens.export import ExportError
    from moelens.export.exporter import default_inputs
    from moelens.export.target import resolve

    for tokens in ("0", "-2"):
        assert main(["export", "tiny", str(tmp_path / "x.nnef.tgz"), "--tokens", tokens, "--no-verify"]) == 2
        err = capsys.readouterr().err
        assert f"--tokens {tokens}: example inputs need at least one token; give --tokens 1 or more." in err
        assert "batch" not in err
    target = resolve(moelens.load())
    with pytest.raises(ExportError, match=r"^tokens=0: example inputs need at least one token; give tokens=1 or more"):
        default_inputs(target, tokens=0)
    with pytest.raises(ExportError, match=r"^batch=0: example inputs need at least one row; give batch=1 or more"):
        default_inputs(target, batch=0)
    assert not list(tmp_path.iterdir())


def test_a_block_refused_for_its_groups_alone_is_told_where_its_family_exports(tmp_path):
    """tiny mistral4 (the best 2 of 4 groups) was refused without the condition family_support and docs/export.md
    give: one group, or every group kept. Ground truth: the same block keeping all 4 groups exports; deepseek_v3,
    refused for its selection bias too, is not told its groups would do."""
    from moelens.export import family_support

    path = tmp_path / "m4.nnef.tgz"
    condition = "router.num_group == 1 or router.topk_group == router.num_group"
    assert family_support("mistral4").condition.startswith(condition)
    with pytest.raises(ExportRefused, match=r"\(the best 2 of 4 groups\): tract picks the top-k over all experts; "
                                            r"a mistral4 block exports only where there is one group or every group is kept "
                                            rf"\({condition}\): see moelens\.export\.family_support\('mistral4'\)\.$"):
        to_nnef(moelens.wrap(tiny_model("mistral4")).moes[0], path)
    assert not path.exists()
    assert to_nnef(moelens.wrap(tiny_model("mistral4", topk_group=4)).moes[0], path, verify=False).path.exists()
    with pytest.raises(ExportRefused, match="correction bias") as caught:
        to_nnef(moelens.wrap(tiny_model("deepseek_v3")).moes[0], tmp_path / "d3.nnef.tgz")
    assert "(the best 2 of 4 groups)" in str(caught.value) and "exports only where" not in str(caught.value)


def test_a_router_linear_under_a_peft_adapter_is_refused_naming_the_adapter(tmp_path):
    """A PEFT LoRA on hunyuan's router Linear (gate.wg): the export said the logits op 'is not one linear layer',
    blaming the family; the logits are the base weight and the adapters together. Ground truth: the same block
    without the adapter exports (tested for hunyuan_v1_moe with the other families)."""
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(tiny_model("hunyuan_v1_moe"), peft.LoraConfig(r=4, target_modules=["wg"]))
    with pytest.raises(ExportRefused, match=r"the router's linear layer gate\.wg is a PEFT adapter layer .*"
                                            r"merge_and_unload\(\)"):
        to_nnef(moelens.wrap(adapted).moes[1], tmp_path / "block.nnef.tgz")
    assert not list(tmp_path.iterdir())
