"""`Moe.params`: router and expert weights as views of the model's parameters, on every family.

Ground truth: the experts module's own forward (every token routed to one expert with
weight 1) against that expert's maths written out from the served views, before and
after random in-place edits of the views (so a copy, a wrong gate/up split or a wrong
transposition fails); the router's logits from a plain nnsight trace of an unwrapped
copy, after one router row was overwritten through its view.
"""

from __future__ import annotations

import copy
import typing

import pytest
import torch
import torch.nn.functional as F
from torch.nn import functional as fn

import nnsight

import moelens
from annotations import assert_annotations_hold
from custom_models import LinearRouter
from groundtruth import ROUTER_LOGITS, raw_values
from moelens.components.params import MoeParams
from moelens.errors import ValueUnavailable
from moelens.testing import FAMILIES, tiny_inputs, tiny_model
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter


#: Families whose router logits are not one linear layer's output with E rows (inkling: E + 1 rows;
#: muse_spark: times an output multiplier; zaya: a router MLP).
LOGITS_NOT_ONE_LINEAR = {"inkling", "muse_spark", "zaya"}


def with_weights(moe) -> int:
    """How many of the block's experts have weights (longcat_flash's last ones are zero-compute)."""
    return moe.num_experts - moe.family.identity_count(moe._module)


def wrapped(family: str):
    hf = tiny_model(family)
    return hf, moelens.wrap(hf)


def expert_output_by_module(experts: torch.nn.Module, family, x: torch.Tensor, expert: int) -> torch.Tensor:
    """What the experts module computes for rows ``x`` all routed to ``expert`` with weight 1."""
    with torch.no_grad():
        if not family.experts_call:  # llama4: every expert runs on its own rows, [E * n, D] in expert order
            rows = x.new_zeros(experts.num_experts, *x.shape)
            rows[expert] = x
            return experts(rows.view(-1, x.shape[-1])).view(experts.num_experts, *x.shape)[expert]
        # Two slots on the expert, weights 1 and 0: longcat_flash's experts squeeze a lone slot axis away.
        index = torch.full((x.shape[0], 2), expert, dtype=torch.long, device=x.device)
        weights = torch.tensor([1.0, 0.0], dtype=x.dtype, device=x.device).expand(x.shape[0], 2)
        return experts(x, index, weights).reshape(x.shape)


def expert_output_by_hand(params, experts: torch.nn.Module, family, block, x: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert ``expert``'s output from its served views: ``down @ gate_fn(gate @ x, up @ x)``, written out per kind,
    then the experts' norm where they have one."""
    up = F.linear(x, params.up, params.up_bias)
    act = getattr(experts, "act_fn", None)
    if act is None and hasattr(experts, "mlp"):  # dbrx keeps it on its expert GLU
        act = experts.mlp.activation_fn
    if params.gate is None:
        hidden = act(up)
    else:
        gate = F.linear(x, params.gate, params.gate_bias)
        described = family.expert_gate
        kind = described.kind if described is not None else "glu"
        if kind == "glu":
            hidden = act(gate) * up
        elif kind == "softcapped_glu":
            hidden = act(gate, up)
        else:
            limit = float(family.resolve(described.limit, block))
            if kind == "glu_clamped":  # step3p7: the activation clamped after it is applied
                return F.linear(act(gate).clamp(max=limit) * up.clamp(-limit, limit), params.down, params.down_bias)
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            if kind == "clamped_glu":
                hidden = (act or F.silu)(gate) * up
            else:  # clamped_swiglu (gpt-oss)
                hidden = (up + 1) * gate * torch.sigmoid(float(family.resolve(described.alpha, block)) * gate)
    out = F.linear(hidden, params.down, params.down_bias)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    elif hasattr(experts, "post_expert_norm"):  # ergo: a norm per expert, applied by its own forward
        out = experts.post_expert_norm(out, torch.full(out.shape[:1], expert))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_views_compute_what_the_experts_module_computes_and_edits_land(family):
    hf, model = wrapped(family)
    moe = model.moes[0]
    block = moe._module
    experts = block.get_submodule(moe.family.experts)
    before = {name: param.detach().clone() for name, param in hf.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    for expert in (0, with_weights(moe) - 1):
        params = moe.params(expert)
        x = torch.randn(5, params.up.shape[-1], generator=generator).to(params.up.device)
        with torch.no_grad():
            expected = expert_output_by_module(experts, moe.family, x, expert)
            torch.testing.assert_close(expert_output_by_hand(params, experts, moe.family, block, x, expert), expected)
            for name, view in params.items():  # new weights through the views: the module must compute with them
                view.copy_(torch.randn(view.shape, generator=generator).to(view.device) * 0.5)
            edited = expert_output_by_module(experts, moe.family, x, expert)
            torch.testing.assert_close(expert_output_by_hand(moe.params(expert), experts, moe.family, block, x, expert), edited)
        assert not torch.allclose(edited, expected)
    in_block = {id(param) for param in block.parameters()}
    changed = [param for name, param in hf.named_parameters() if not torch.equal(param, before[name])]
    assert changed and all(id(param) in in_block for param in changed)  # the block's own weights, nothing else


@pytest.mark.parametrize("dense", ["llama", "bert", "gpt2", "llama-attention"])
def test_expert_views_of_compressed_models(dense):
    """moelens.compress output (gated SwiGLU experts, plain GELU experts, biases everywhere, and split
    linear layers whose down projection is a fixed placement buffer: tomoe_linear) as any family."""
    from test_compress_helpers import MODELS, convert, ids

    name, _, part = dense.partition("-")
    converted = convert(MODELS[name](), num_experts=4, top_k=2, calibration=ids(4, 16, 1),
                        target_attention_only=part == "attention")[0]
    model = moelens.wrap(converted)
    assert model.moes and all(moe.family.name == "tomoe_linear" for moe in model.moes) == (part == "attention")
    generator = torch.Generator().manual_seed(0)
    for moe in model.moes:
        experts = moe._module.get_submodule(moe.family.experts)
        last = moe.num_experts - 1
        params = moe.params(last)
        x = torch.randn(5, params.up.shape[-1], generator=generator).to(params.up.device)
        with torch.no_grad():
            expected = expert_output_by_module(experts, moe.family, x, last)
            torch.testing.assert_close(expert_output_by_hand(params, experts, moe.family, moe._module, x, last), expected)
            params.down.mul_(2.0)
            torch.testing.assert_close(expert_output_by_module(experts, moe.family, x, last) - params.down_bias,
                                       2 * (expected - params.down_bias))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_expert_view_stacks_the_single_expert_views(family):
    _, model = wrapped(family)
    moe = model.moes[0]
    stacked = dict(moe.params().items())
    assert stacked["up"].shape[0] == with_weights(moe)
    for expert in range(with_weights(moe)):
        for name, view in moe.params(expert).items():
            assert torch.equal(view, stacked[name][expert]), name
            assert view.data_ptr() == stacked[name][expert].data_ptr(), name  # the same memory, no copy


@pytest.mark.parametrize("family", FAMILIES)
def test_the_views_have_the_shapes_their_annotations_name(family):
    """MoeParams' jaxtyping annotations hold on the stacked views and on one expert's (longcat_flash's router has rows
    for its zero-compute experts, which have no weights: the router's axis is not the experts'; nemotron_h's router
    reads the model's width where its experts run in a latent one)."""
    hints = typing.get_type_hints(MoeParams)
    models = [wrapped(family)[1]] + ([moelens.wrap(tiny_model(family, moe_latent_size=16))] if family == "nemotron_h" else [])
    for model in models:  # nemotron_h's router reads the model's width, its experts a latent one
        for params in (model.moes[0].params(), model.moes[0].params(0)):
            assert_annotations_hold([(name, view, hints[name]) for name, view in vars(params).items()])


@pytest.mark.parametrize("family", FAMILIES)
def test_router_row_is_the_experts_logit_weight(family):
    hf, model = wrapped(family)
    moe = model.moes[0]
    params = moe.params()
    if family in LOGITS_NOT_ONE_LINEAR:
        assert params.router is None
        pytest.skip(f"{family}: the logits are not one linear layer's [E, D] output")
    inputs = tiny_inputs(hf)
    block_name = next(name for name, module in hf.named_modules() if module is moe._module)
    target, source = with_weights(moe) - 1, 0
    before = raw_values(copy.deepcopy(hf), inputs, [block_name], moe.family)[block_name].logits
    with torch.no_grad():
        moe.params(target).router.copy_(params.router[source])
        if params.router_bias is not None:
            params.router_bias[target] = params.router_bias[source]
    after = raw_values(copy.deepcopy(hf), inputs, [block_name], moe.family)[block_name].logits
    after, before = after.reshape(-1, after.shape[-1]), before.reshape(-1, before.shape[-1])
    torch.testing.assert_close(after[:, target], after[:, source])  # expert `target` now scores as `source`
    assert not torch.allclose(before[:, target], before[:, source])
    torch.testing.assert_close(after[:, :target], before[:, :target])  # no other expert's logit moved
    assert family in ROUTER_LOGITS or after.shape[-1] == moe.num_experts


@pytest.mark.parametrize("expert", [-1, 8, 2.0, True, "3", torch.tensor(1.0), torch.tensor([1, 2]), torch.tensor([True]),
                                    torch.tensor(True), torch.empty((), dtype=torch.long, device="meta")],
                         ids=lambda value: repr(value)[:24])
def test_params_refuses_what_is_not_an_expert_index(expert):
    """An argument mistake, a ValueError: not a ValueUnavailable, which code catches to skip what a block does not
    serve (a typo'd id would be skipped silently)."""
    _, model = wrapped("mixtral")
    with pytest.raises(moelens.ArgumentError, match=r"expected an int in \[0, 8\)") as refused:
        model.moes[0].params(expert)
    assert isinstance(refused.value, ValueError) and not isinstance(refused.value, ValueUnavailable)


def test_params_takes_numpy_and_tensor_indexes_and_works_in_a_trace():
    import numpy as np

    hf, model = wrapped("mixtral")
    moe = model.moes[0]
    down = moe.params(3).down
    assert torch.equal(moe.params(np.int64(3)).down, down) and torch.equal(moe.params(torch.tensor(3)).down, down)
    # one-element tensors and arrays, as the interventions take expert ids (they were refused here): views of expert
    # 3's own parameter (mixtral stores down_proj as [E, D, H], each expert's [out, in])
    raw = hf.model.layers[0].mlp.experts.down_proj[3]
    for given in (torch.tensor([3]), np.array([3])):
        view = moe.params(given).down
        assert torch.equal(view, raw) and view.data_ptr() == raw.data_ptr()
    with model.trace(tiny_inputs(hf)["input_ids"]):
        inside = nnsight.save(moe.params(3).down)
    assert inside.data_ptr() == down.data_ptr()


def test_params_refuses_experts_with_compress_lora_adapters():
    from moelens.compress import tomoe
    from test_compress_helpers import ids, llama

    model = moelens.wrap(tomoe(llama(), num_experts=4, top_k=2, calibration=ids(8, 16, 1), max_error=10.0, lora_r=2))
    with pytest.raises(ValueUnavailable, match=r"LoRA adapters.*merge_lora"):
        model.moes[0].params(0)


def test_a_layout_that_does_not_match_the_experts_is_named():
    from dataclasses import replace

    from moelens.families import ExpertLayout, get, register, unregister

    _, model = wrapped("llama4")
    register(replace(get("llama4"), expert_layout=ExpertLayout(gate_up="w13", transposed=True)), replace=True)
    try:
        with pytest.raises(ValueUnavailable, match=r"no parameter 'w13'.*expert_layout does not match"):
            moelens.wrap(tiny_model("llama4")).moes[0].params()
    finally:
        unregister("llama4")
    assert model.moes[0].params().down.shape[0] == model.moes[0].num_experts  # the built-in entry again


@pytest.mark.parametrize("layout", [dict(), dict(gate="w1"), dict(gate_up="w13", up="w3")])
def test_register_refuses_a_layout_naming_no_input_projection(layout):
    from dataclasses import replace

    from moelens.errors import FamilyError
    from moelens.families import ExpertLayout, get, register

    with pytest.raises(FamilyError, match="either the fused gate_up parameter alone or a separate up"):
        register(replace(get("llama4"), expert_layout=ExpertLayout(**layout)), replace=True)


def test_params_refuses_weights_that_are_not_loaded():
    from transformers import AutoModelForCausalLM

    from moelens.testing import tiny_config

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(tiny_config("mixtral"))
    with pytest.raises(ValueUnavailable, match=r"^model.model.layers.0.mlp.params: mixtral: MixtralExperts.gate_up_proj "
                       "is on the meta device.*load the model onto a real device"):
        moelens.wrap(hf).moes[0].params(0)


def test_views_are_edited_in_place_and_other_assignments_refused():
    from moelens.errors import WriteError

    _, model = wrapped("mixtral")
    params = model.moes[0].params(2)
    direction = torch.nn.functional.normalize(torch.randn(params.down.shape[0], device=params.down.device), dim=0)
    params.down -= direction[:, None] * (direction @ params.down)  # in place, then assigned back to itself
    assert float((direction @ model.moes[0].params(2).down).abs().max()) < 1e-5
    with pytest.raises(WriteError, match=r"edit the view in place instead \(params\.down\.copy_"):
        params.down = torch.zeros_like(params.down)
    before = params.down.clone()
    with pytest.raises(WriteError, match=r"no field 'down_proj'.*'down'"):  # a misspelt field is no silent no-op
        params.down_proj = torch.zeros_like(params.down)
    assert torch.equal(model.moes[0].params(2).down, before)


def test_assigning_a_weight_the_block_lacks_says_so():
    from moelens.errors import WriteError

    _, model = wrapped("nemotron_h")  # ungated experts
    params = model.moes[0].params(0)
    assert params.gate is None
    with pytest.raises(WriteError, match="gate is None: this block has no gate weights"):
        params.gate = torch.zeros_like(params.up)


@pytest.mark.parametrize("storage", ["float8", "scale"])
def test_quantized_expert_weights_are_refused(storage):
    hf, model = wrapped("mixtral")
    experts = model.moes[0].experts._module
    if storage == "float8":
        experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().to(torch.float8_e4m3fn), requires_grad=False)
        match = "float8_e4m3fn"
    else:  # transformers' FP8 experts keep the inverse scales beside the weights
        experts.register_buffer("down_proj_scale_inv", torch.ones(experts.down_proj.shape[0], 1, 1))
        match = "down_proj is quantized"
    with pytest.raises(ValueUnavailable, match=match):
        model.moes[0].params()


def test_a_quantized_router_is_refused_not_left_out():
    """dbrx's router Linear quantized by torch (quantize_dynamic) gave params().router None, which the docs keep
    for routers whose logits are not one linear layer's output."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of its eager quantization
        quantized = torch.ao.quantization.quantize_dynamic(tiny_model("dbrx"), {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.raises(ValueUnavailable, match=r"dbrx: the router's linear layer router.layer is a Linear \(quantized\)"):
        moelens.wrap(quantized).moes[0].params()

ROUTER_MAKEOVERS = {
    "parametrize": lambda linear: torch.nn.utils.parametrize.register_parametrization(linear, "weight", Doubled()),
    "weight_norm": lambda linear: torch.nn.utils.parametrizations.weight_norm(linear),
    "prune": lambda linear: torch.nn.utils.prune.l1_unstructured(linear, "weight", amount=0.25),
}


class Doubled(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


@pytest.mark.parametrize("makeover", sorted(ROUTER_MAKEOVERS))
def test_a_weight_computed_on_access_is_refused_not_served_as_a_copy(makeover):
    """A parametrized, weight-normed or pruned weight is computed from other tensors on each access: params() served
    that copy, and an edit of it changed nothing (the next trace's logits were the old ones)."""
    import torch.nn.utils.parametrize  # noqa: F401
    import torch.nn.utils.prune  # noqa: F401

    _, model = wrapped("mixtral")
    ROUTER_MAKEOVERS[makeover](model.moes[0].router._module)
    with pytest.raises(ValueUnavailable, match=r"layers.0.mlp.params: the router's weight is computed from other "
                                               r"tensors each time it is used .* not stored, so a view of it is a copy.*"
                                               r"prune.remove\(module, 'weight'\)"):
        model.moes[0].params()
    model.moes[1].params(0).down.mul_(1.0)  # the other blocks keep their views
    experts = model.moes[1].experts._module
    torch.nn.utils.parametrize.register_parametrization(experts, "down_proj", Doubled())
    with pytest.raises(ValueUnavailable, match=r"MixtralExperts.down_proj is computed from other tensors.*"
                                               r"remove_parametrizations\(module, 'down_proj'\)"):  # it said 'weight'
        model.moes[1].params()


def test_params_of_a_model_sharded_by_fsdp_are_refused():
    """FSDP2 with reshard_after_forward=False leaves gathered copies of the shards in the modules after a forward:
    params() served them and the next gather dropped the edit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        hf = tiny_model("mixtral", experts_implementation="grouped_mm")
        for layer in hf.model.layers:
            fully_shard(layer, reshard_after_forward=False)
        fully_shard(hf, reshard_after_forward=False)
        with torch.no_grad():
            hf(**tiny_inputs(hf))
        assert not hasattr(hf.model.layers[1].mlp.experts.down_proj, "placements")  # gathered: no DTensor to refuse
        with pytest.raises(ValueUnavailable, match=r"layers.1.mlp.params: the block sits in FSDPMixtralForCausalLM, "
                                                   r"which FSDP shards over the ranks"):
            model = moelens.wrap(hf)
            model.moes[1].params()
    finally:
        dist.destroy_process_group()


def test_stacked_biases_are_cut_per_expert():
    _, model = wrapped("dbrx")
    moe = model.moes[0]
    glu = moe.experts._module.mlp
    glu.w1_bias = torch.nn.Parameter(torch.randn(glu.w1.shape[0]))  # [E*H], stacked as the weights
    params = moe.params()
    assert params.gate_bias.shape == (moe.num_experts, glu.w1.shape[0] // moe.num_experts)
    assert params.gate_bias.data_ptr() == glu.w1_bias.data_ptr()
    assert torch.equal(moe.params(3).gate_bias, glu.w1_bias.detach().view(moe.num_experts, -1)[3])


def test_a_router_bias_outside_the_logits_call_is_not_served_as_theirs():
    """A router keeping a `bias` its F.linear does not pass (a selection bias): it was served as router_bias."""
    hf = tiny_model("mixtral")
    for layer in hf.model.layers:  # MixtralTopKRouter: F.linear(hidden_states, self.weight), no bias
        layer.mlp.gate.bias = torch.nn.Parameter(torch.randn(8))
    model = moelens.wrap(hf)
    moe = model.moes[1]
    params = moe.params()
    assert params.router.data_ptr() == moe.router._module.weight.data_ptr() and params.router_bias is None
    inputs = tiny_inputs(hf)
    with torch.no_grad(), model.trace(**inputs):
        hidden = moe.router.input.save()
        logits = moe.router_logits.save()
    torch.testing.assert_close(logits.reshape(-1, 8), hidden.reshape(-1, hidden.shape[-1]) @ params.router.T)
    privacy = moelens.wrap(tiny_model("openai_privacy_filter")).moes[0]  # F.linear(x, w.float(), self.bias.float())
    assert privacy.params().router_bias.data_ptr() == privacy.router._module.bias.data_ptr()


class RouterCallingItselfS(MixtralTopKRouter):
    """MixtralTopKRouter's forward with its first argument named ``s`` instead of ``self``."""

    def forward(s, hidden_states):
        hidden_states = hidden_states.reshape(-1, s.hidden_dim)
        router_logits = F.linear(hidden_states, s.weight)
        router_top_value, router_indices = torch.topk(router_logits.float().softmax(-1), s.top_k, dim=-1)
        return router_logits, router_top_value / router_top_value.sum(dim=-1, keepdim=True), router_indices


def test_the_router_weight_is_found_whatever_its_forward_calls_itself():
    """The logits call's operands were read only as `self.<name>`: a router writing `s.weight` had no router row."""
    hf = tiny_model("mixtral")
    for layer in hf.model.layers:
        gate = layer.mlp.gate
        gate.__class__ = RouterCallingItselfS
    moe = moelens.wrap(hf).moes[0]
    assert moe.params().router.data_ptr() == moe.router._module.weight.data_ptr()


class LoopExperts(torch.nn.Module):
    """Experts as a plain user writes them: one module per expert, run in a loop."""

    def __init__(self, experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(hidden, inner), torch.nn.SiLU(), torch.nn.Linear(inner, hidden))
            for _ in range(experts)
        )

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for number, expert in enumerate(self.experts):
            token, slot = torch.where(top_k_index == number)
            out.index_add_(0, token, expert(hidden[token]) * top_k_weights[token, slot, None])
        return out


def test_experts_kept_as_one_module_each_say_params_cannot_serve_them():
    """params() told the user to describe such experts with an ExpertLayout, which cannot."""
    from custom_models import custom_family, custom_model

    model = custom_model()
    for layer in model.layers:
        layer["ffn"].pool = LoopExperts(4, 16, 8)
    moelens.families.register(custom_family())
    try:
        moe = moelens.wrap(model).moes[0]
        with pytest.raises(ValueUnavailable, match=r"custom: LoopExperts keeps its weights in modules of its own "
                                                   r"\(one per expert\).*read each expert module's weights directly"):
            moe.params()
    finally:
        moelens.families.unregister("custom")


@pytest.mark.parametrize("bias", ["gate_up_proj_bias", "down_proj_bias"])
@pytest.mark.parametrize("makeover", ["parametrize", "prune"])
def test_an_expert_bias_computed_on_access_is_refused_not_served_as_none(bias, makeover):
    """gpt_oss' expert biases parametrized or pruned are no longer stored under their names: params() served them as
    None (a bias-free expert), though the module still adds them."""
    import torch.nn.utils.parametrize  # noqa: F401
    import torch.nn.utils.prune  # noqa: F401

    _, model = wrapped("gpt_oss")
    experts = model.moes[0].experts._module
    assert model.moes[0].params(0).down_bias is not None
    if makeover == "parametrize":
        torch.nn.utils.parametrize.register_parametrization(experts, bias, Doubled())
    else:
        torch.nn.utils.prune.identity(experts, bias)
    assert isinstance(getattr(experts, bias), torch.Tensor)  # the module still adds it
    with pytest.raises(ValueUnavailable, match=rf"GptOssExperts.{bias} is computed from other tensors"):
        model.moes[0].params()


class AliasLinearRouter(LinearRouter):
    """A router calling ``F.linear`` under another alias (``fn.linear``: nnsight names the op ``fn_linear_0``)."""

    def forward(self, x):
        logits = fn.linear(x, self.weight)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top, index


class NoisyTopKRouter(AliasLinearRouter):
    """Shazeer's noisy top-k gating: the noise scale is a linear call too, so the logits are the second linear call
    (``F_linear_1``)."""

    def __init__(self, hidden: int, experts: int, k: int) -> None:
        super().__init__(hidden, experts, k)
        self.w_noise = torch.nn.Parameter(torch.randn(experts, hidden) * 0.1)

    def forward(self, x):
        noise_std = F.softplus(F.linear(x, self.w_noise))
        logits = F.linear(x, self.weight)
        if self.training:
            logits = logits + torch.randn_like(logits) * noise_std
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top, index


def scaled_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Twice ``F.linear``: a function named like a linear call that is not one."""
    return F.linear(x, weight) * 2.0


class ScaledLinearRouter(AliasLinearRouter):
    """A router whose logits op ``scaled_linear_0`` is named like a linear call but doubles one."""

    def forward(self, x):
        logits = scaled_linear(x, self.weight)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top, index


def _custom_block_with(router: type, op: str, body) -> None:
    """Run ``body(wrapped, moe)`` on the custom model whose routers are ``router``s, its entry's logits op ``op``."""
    from custom_models import custom_family, custom_model

    model = custom_model()
    config = model.config
    for layer in model.layers:
        layer["ffn"].chooser = router(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
    moelens.families.register(custom_family(logits_op=op))
    try:
        wrapped = moelens.wrap(model)
        body(wrapped, wrapped.moes[1])
    finally:
        moelens.families.unregister("custom")


def _logits_and_input(wrapped, moe) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's router logits and the router's input, flat over the tokens, from one trace."""
    ids = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), wrapped.trace(ids):
        hidden = moe.router.input.save()
        logits = moe.router_logits.save()
    return logits.reshape(-1, logits.shape[-1]), hidden.reshape(-1, hidden.shape[-1])


@pytest.mark.parametrize("router, op", [(AliasLinearRouter, "fn_linear_0"), (NoisyTopKRouter, "F_linear_1")])
def test_the_router_weight_is_found_whatever_the_linear_call_is_named(router, op):
    """Only four op names (F_linear_0, ...) counted as an F.linear call: a router calling it under another alias, or
    whose logits are its second linear call, got params().router None and export refused it as no linear layer."""
    from moelens.export.spec import read_spec

    def body(wrapped, moe):
        weight = moe.router._module.weight
        params = moe.params()
        assert params.router is not None and params.router.data_ptr() == weight.data_ptr()
        assert params.router_bias is None
        logits, hidden = _logits_and_input(wrapped, moe)
        torch.testing.assert_close(logits, hidden @ weight.detach().T)  # the logits are that weight's linear layer
        assert torch.equal(read_spec(moe.family, moe._module, 1).wg, weight.detach().float())  # export reads it too

    _custom_block_with(router, op, body)


def test_a_call_named_like_linear_that_is_not_torchs_serves_no_router_weight():
    """Accepting any ``*linear_<n>`` op must not serve the weight a function merely named so is called with."""

    def body(wrapped, moe):
        weight = moe.router._module.weight
        logits, hidden = _logits_and_input(wrapped, moe)
        torch.testing.assert_close(logits, 2.0 * hidden @ weight.detach().T)  # not that weight's linear layer
        assert moe.params().router is None

    _custom_block_with(ScaledLinearRouter, "scaled_linear_0", body)
