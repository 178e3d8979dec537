"""Where wrap() finds a model's decoder layers, dense MLPs and family, and the order it serves values in.

Ground truth: the module tree itself (which ModuleList holds the decoder layers, which layer holds a
dense MLP), the config's own sub-config model type, and the plain transformers model's call order and
values recorded by torch forward hooks on an unwrapped copy.
"""

from __future__ import annotations

import copy
import warnings

import nnsight
import pytest
import torch
from transformers import LlavaConfig, MixtralConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP, Qwen2MoeSparseMoeBlock

import moelens
from moelens import families
from moelens.components import Mlp
from moelens.testing import tiny_inputs, tiny_model


class Towers(torch.nn.Module):
    """Decoder stacks in a numbered list (an ensemble, a multi-tower model): blocks at towers.<t>.layers.<i>.mlp."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.towers = torch.nn.ModuleList([tiny_model("qwen2_moe", mlp_only_layers=[1]).model for _ in range(count)])


def test_layers_nested_in_a_numbered_list_are_the_inner_decoder_layers():
    """The layer of towers.0.layers.3.mlp is cut at its last index: cut at the first (towers.0), model.layers
    would be the list of towers and the dense MLPs beside the MoE blocks would go unfound."""
    model = Towers(1)
    wrapped = moelens.wrap(model)
    decoder_layers = model.towers[0].layers
    assert len(wrapped.layers) == len(decoder_layers) == 4
    assert wrapped.layers[2]._module is decoder_layers[2]
    assert isinstance(decoder_layers[1].mlp, Qwen2MoeMLP) and type(wrapped.layers[1].mlp) is Mlp
    moes = [f"model.towers.0.layers.{index}.mlp" for index in (0, 2, 3)]
    assert isinstance(decoder_layers[0].mlp, Qwen2MoeSparseMoeBlock)
    assert [moe.path for moe in wrapped.moes] == moes


def first_of(output):
    return output[0] if isinstance(output, tuple) else output


def test_layers_are_indexed_by_layer_number_and_a_missing_layer_says_how_many_there_are():
    """nnsight looked a key up as an attribute name: model.layers[99] raised AttributeError about attribute '99',
    and model.layers['0'] or [1.0] were taken by name. Ground truth: the model's own ModuleList."""
    import numpy

    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    layers = hf.model.layers
    count = len(layers)
    assert [wrapped.layers[key]._module for key in (0, -1, numpy.int64(1), torch.tensor(2))] == [
        layers[0], layers[-1], layers[1], layers[2]]
    assert [layer._module for layer in wrapped.layers[1:3]] == list(layers[1:3])
    assert [layer._module for layer in wrapped.layers] == list(layers)
    for key in (count, -count - 1, 1.0, "0", True):
        with pytest.raises(moelens.LayerIndexError, match=rf"model\.layers\[{key!r}\]: expected an integer layer in "
                                                           rf"0\.\.{count - 1} .*the model has {count} decoder layers"):
            wrapped.layers[key]
    with pytest.raises(IndexError):  # a Python IndexError too
        wrapped.layers[count]
    seen = []
    handle = layers[-1].register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        with torch.no_grad(), wrapped.trace(torch.tensor([[1, 2, 3]])):
            last = wrapped.layers[-1].output.save()
    finally:
        handle.remove()
    assert torch.equal(first_of(last), first_of(seen[0]))


def test_every_towers_dense_mlps_are_found():
    """With two towers the dense MLPs of both (towers.<t>.layers.1.mlp) are found."""
    model = Towers(2)
    wrapped = moelens.wrap(model)
    for tower in range(2):
        assert isinstance(model.towers[tower].layers[1].mlp, Qwen2MoeMLP)
        assert type(wrapped.towers[tower].layers[1].mlp) is Mlp
        assert type(wrapped.towers[tower].layers[0].mlp) is not Mlp  # an MoE block (a Moe)
    with pytest.raises(AttributeError, match=r"has no 'layers': moelens found no list of decoder layers holding this "
                                             r"model's MoE blocks or dense MLPs, or several and none of them"):
        wrapped.layers  # two lists of layers, no single one to name (it said only "has no attribute 'layers'")


class ConfigOnly(torch.nn.Module):
    """A module with no MoE block whose config is a llava config with a mixtral text_config."""

    def __init__(self) -> None:
        super().__init__()
        self.config = LlavaConfig(text_config=MixtralConfig().to_dict())
        self.linear = torch.nn.Linear(2, 2)


def test_a_model_without_blocks_takes_its_family_from_its_text_config():
    """The sub-configs' model types count, not only the top-level one (llava): the text model is mixtral."""
    model = ConfigOnly()
    assert model.config.model_type == "llava" and model.config.text_config.model_type == "mixtral"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no MoE block: wrap() says so
        wrapped = moelens.wrap(model)
    assert wrapped.moes == [] and wrapped.family is families.get("mixtral")


def test_a_shared_expert_run_before_the_experts_is_served_in_that_order():
    """afmoe runs its shared experts between router and experts: order() puts shared_expert_output there, so
    reading values in order() raises no OrderError."""
    hf = tiny_model("afmoe", experts_implementation="grouped_mm")
    inputs = tiny_inputs(hf)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[0]
    plain_block = reference.get_submodule(moe.path.removeprefix("model."))

    calls, shared = [], []

    def on_shared(module, args, output):
        calls.append("shared")
        shared.append(output)

    handles = [plain_block.shared_experts.register_forward_hook(on_shared),
               plain_block.experts.register_forward_hook(lambda m, a, out: calls.append("experts") and None)]
    try:
        with torch.no_grad():
            reference(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["shared", "experts"]  # the plain model computes the shared experts first

    order = moe.order()
    assert order.index("shared_expert_output") < order.index("expert_weights")
    with torch.no_grad(), wrapped.trace(**inputs):
        values = nnsight.save({name: getattr(moe, name).save() for name in order})
    assert set(values) == set(order)
    torch.testing.assert_close(values["shared_expert_output"].reshape(shared[0].shape), shared[0])


def test_the_modules_checked_before_each_trace_are_those_the_model_holds_then():
    """Before every trace moelens walks the model down to its MoE blocks (to refuse a module compiled since wrapping
    and to find expert-parallel groups): the walk finds each module the model holds at that path then, and nothing
    under a module swapped for one without those children. Ground truth: torch's get_submodule."""
    from moelens.model import _around_blocks, _present, _walk_steps

    hf = tiny_model("qwen2_moe", mlp_only_layers=[1])
    blocks = ["model.layers.0.mlp", "model.layers.2.mlp"]
    paths = _around_blocks(hf, blocks)
    steps = _walk_steps(paths)

    def expected() -> dict[str, torch.nn.Module]:
        found = {}
        for path in paths:
            try:
                found[path] = hf.get_submodule(path)
            except AttributeError:
                continue
        return found

    assert {"", "model.layers.0.mlp.gate", "model.layers.2.mlp.shared_expert"} <= set(paths)
    assert dict(_present(hf, steps)) == expected()
    hf.model.layers[2].mlp = torch.nn.Identity()  # its router, experts and shared expert are gone
    hf.model.layers[0] = torch.nn.Linear(2, 2)
    walked = dict(_present(hf, steps))
    assert walked == expected() and walked["model.layers.0"] is hf.model.layers[0]
    assert not any(path.startswith(("model.layers.2.mlp.", "model.layers.0.")) for path in walked)


class MoeBesideMlp(torch.nn.Module):
    """A decoder whose even layers keep a dense MLP at ``mlp`` and odd layers a qwen2_moe block at ``moe``."""

    def __init__(self) -> None:
        super().__init__()
        source = tiny_model("qwen2_moe", mlp_only_layers=[0, 2]).model
        self.embed_tokens = source.embed_tokens
        self.layers = torch.nn.ModuleList()
        for index, layer in enumerate(source.layers[:4]):
            holder = torch.nn.Module()
            setattr(holder, "mlp" if index % 2 == 0 else "moe", layer.mlp)
            self.layers.append(holder)

    def forward(self, input_ids):
        hidden = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            hidden = hidden + (layer.mlp if index % 2 == 0 else layer.moe)(hidden)
        return hidden


def test_dense_mlps_at_mlp_are_found_beside_blocks_at_another_attribute():
    """Blocks at ``moe`` made wrap look for dense MLPs at ``moe`` alone: layers[0].mlp was a plain envoy and its
    mlp_output nnsight's bare AttributeError. Ground truth: the dense MLP's own output, by a torch hook."""
    model = MoeBesideMlp().eval()
    wrapped = moelens.wrap(model)
    assert [type(wrapped.layers[i].mlp).__name__ for i in range(4)] == ["Mlp", "Moe", "Mlp", "Moe"]
    assert wrapped.layers[2].mlp.path == "model.layers.2.mlp" and wrapped.layers[1].mlp.path == "model.layers.1.moe"
    _assert_mlp_output_is_the_modules(wrapped, 2, model.layers[2].mlp)


def test_a_granitemoehybrid_checkpoint_without_experts_has_its_shared_mlps_as_layers_mlp():
    """num_local_experts=0 (a Granite-4.0-H-Micro-like dense checkpoint) keeps only shared_mlp on every layer: wrap
    found no dense MLP ("at layers[i].block_sparse_moe") and gave no model.layers."""
    config = tiny_model("granitemoehybrid").config
    config.num_local_experts = 0
    torch.manual_seed(0)
    hf = type(tiny_model("granitemoehybrid"))(config).eval()
    with pytest.warns(UserWarning, match=r"its \d+ dense MLPs \(at layers\[i\]\.shared_mlp\) are Mlp components"):
        wrapped = moelens.wrap(hf)
    assert wrapped.moes == [] and len(wrapped.layers) == config.num_hidden_layers
    assert all(type(layer.mlp) is Mlp and layer.mlp.path.endswith(".shared_mlp") for layer in wrapped.layers)
    _assert_mlp_output_is_the_modules(wrapped, 1, hf.model.layers[1].shared_mlp)


def _assert_mlp_output_is_the_modules(wrapped, layer: int, module: torch.nn.Module) -> None:
    """``wrapped.layers[layer].mlp.mlp_output`` equals ``module``'s own output, recorded by a torch hook."""
    seen = []
    handle = module.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        with torch.no_grad(), wrapped.trace(torch.tensor([[3, 4, 5]])):
            dense = wrapped.layers[layer].mlp.mlp_output.save()
    finally:
        handle.remove()
    assert torch.equal(dense, seen[0])


def test_a_users_envoys_key_that_matches_a_block_leaves_it_a_moe():
    """wrap(..., envoys={"model.layers.0.mlp": MyEnvoy}): the user's key matched the block first, and wrap failed with
    a raw AttributeError ('MyEnvoy' object has no attribute 'family'). Other modules keep the user's envoy."""
    from nnsight.intervention.envoy import Envoy

    from moelens.components import Moe

    class MyEnvoy(Envoy):
        pass

    for key in ("model.layers.0.mlp", "mlp", "gate"):
        wrapped = moelens.wrap(tiny_model("mixtral"), envoys={key: MyEnvoy})
        assert all(isinstance(moe, Moe) for moe in wrapped.moes)
        assert isinstance(wrapped.moes[0].router, MyEnvoy) == (key == "gate")
    hf = tiny_model("mixtral")  # a class key: nnsight tries it before any path
    with pytest.raises(moelens.MoelensError, match=r"wrap\(envoys=...\) maps MixtralSparseMoeBlock to MyEnvoy, but "
                                                   r"model.layers.0.mlp is one, and moelens makes that block its own"):
        moelens.wrap(hf, envoys={type(hf.model.layers[0].mlp): MyEnvoy})
