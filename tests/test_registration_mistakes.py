"""Mistakes a user makes describing a hand-written MoE with `moelens.families.register`, each refused with what to fix
(they served silently wrong values, or failed far from the cause).

The model is plain torch (no transformers class): a router returning ``(logits, weights, indices)``, experts with
stacked weights ``gate_up [E, 2I, D]`` / ``down [E, D, I]`` (I != D, so sides cannot be confused by their sizes), a
shared MLP after the experts, and a block returning ``(hidden, aux_loss)``. Ground truth: the module's own tensors and
its forward.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moelens
from moelens import Family, FamilyError, OrderError, Scoring, SharedExpert, ValueUnavailable, families
from moelens.families import Combine, ExpertLayout
from moelens.testing import FAMILIES as TINY_FAMILIES, tiny_inputs, tiny_model

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 16, 12, 6, 2


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN) * 0.5)
        self.top_k = TOP_K

    def forward(self, x):
        logits = F.linear(x, self.weight)
        weights, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), index


class ExpertBank(nn.Module):
    """Stacked SwiGLU experts, called ``(x, index, weights)``; the class name does not end in "Experts"."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.3)

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            token, slot = torch.where(index == expert)
            out.index_add_(0, token, self.expert_output(expert, x[token]) * weights[token, slot, None])
        return out

    def expert_output(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """What expert ``expert`` computes for the tokens ``x`` routed to it (before its routing weight)."""
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])


class SwappedBank(ExpertBank):
    """Experts taking the weights before the indices: a common hand-written order."""

    def forward(self, x, weights, index):
        return super().forward(x, index, weights)


class Block(nn.Module):
    def __init__(self, swapped: bool = False) -> None:
        super().__init__()
        self.router = Router()
        self.swapped = swapped
        self.experts = SwappedBank() if swapped else ExpertBank()
        self.shared = nn.Sequential(nn.Linear(HIDDEN, INTERMEDIATE), nn.GELU(), nn.Linear(INTERMEDIATE, HIDDEN))

    def forward(self, hidden):
        b, s, d = hidden.shape
        x = hidden.reshape(-1, d)
        logits, weights, index = self.router(x)
        routed = self.experts(x, weights, index) if self.swapped else self.experts(x, index, weights)
        aux = (logits.softmax(-1).mean(0) ** 2).sum() * EXPERTS
        return (routed + self.shared(x)).reshape(b, s, d), aux


class Model(nn.Module):
    def __init__(self, swapped: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, HIDDEN)
        self.layers = nn.ModuleList([nn.ModuleDict({"moe": Block(swapped)}) for _ in range(2)])

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = hidden + layer["moe"](hidden)[0]
        return hidden


def model(swapped: bool = False) -> Model:
    torch.manual_seed(0)
    return Model(swapped).eval()


IDS = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))


def first_routing(hand: Model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first block's input on ``IDS`` (flat ``[T, D]``), and its router's weights and indices: ground truth."""
    x = hand.embed(IDS).reshape(-1, HIDDEN)
    _, weights, index = hand.layers[0]["moe"].router(x)
    return x, weights, index

ENTRY = Family("hand", ("hand",), ("Block",), block_attr="moe", router="router", experts="experts",
               logits_op="F_linear_0", scoring=Scoring("softmax", "score_topk", normalize=True),
               shared=SharedExpert("shared", when="after_experts"), combine=Combine(output_index=0),
               expert_layout=ExpertLayout(gate_up="gate_up_proj", down="down_proj"))


@pytest.fixture
def registered():
    """Registers ``ENTRY`` with the given changes for one test (taken back after it)."""
    names = []

    def register(**changes) -> Family:
        entry = families.register(dataclasses.replace(ENTRY, **changes), replace=True)
        names.append(entry.name)
        return entry

    yield register
    for name in reversed(names):
        families.unregister(name)


def test_the_right_entry_serves_the_models_own_values(registered):
    """The reference for the mistakes below: experts of any class name at the named path are served (a class name
    not ending in 'Experts' left the model with no Moe and a warning about a missing experts module)."""
    registered()
    hand = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped = moelens.wrap(hand)
    assert [moe.path for moe in wrapped.moes] == ["model.layers.0.moe", "model.layers.1.moe"]
    block = hand.layers[0]["moe"]
    x = hand.embed(IDS).reshape(-1, HIDDEN)
    logits, weights, index = block.router(x)
    with torch.no_grad(), wrapped.trace(IDS):
        values = wrapped.moes[0].save_all()
    assert torch.equal(values["router_logits"], logits.reshape(2, 5, EXPERTS))
    assert torch.equal(values["expert_indices"], index.reshape(2, 5, TOP_K))
    assert torch.allclose(values["expert_weights"], weights.reshape(2, 5, TOP_K))
    params = wrapped.moes[0].params()
    assert torch.equal(params.down, block.experts.down_proj) and torch.equal(params.up, block.experts.gate_up_proj[:, 12:])


def test_experts_that_take_the_weights_before_the_indices_are_refused_at_the_read(registered):
    """They were served swapped: expert_weights an int64 tensor, expert_indices floats, and ablate failed with a
    write error about a value the user never wrote."""
    registered()
    wrapped = moelens.wrap(model(swapped=True))
    for name, dtype in (("expert_weights", "torch.int64"), ("expert_indices", "torch.float32")):
        with pytest.raises(FamilyError, match=rf"layers\.0\.moe\.{name} is a {dtype} tensor: moelens reads the experts "
                                              r"call as experts\(hidden, top_k_index, top_k_weights\), and SwappedBank"):
            with wrapped.trace(IDS):
                getattr(wrapped.moes[0], name).save()


@pytest.mark.parametrize("index, message", [
    # a bare IndexError inside the token view (the scalar loss has no token axis)
    (1, r"mlp_output: model\.layers\.0\.moe\.output serves a 0-d tensor \(one number, such as an auxiliary loss\), not "
        r"values per token.*Combine\(output_index="),
    # a bare IndexError (tuple index out of range)
    (2, r"layers\.0\.moe\.mlp_output: the module returned a tuple of 2 elements, but its family entry reads element 2 "
        r"of its output \(Combine\(output_index=2\)\)"),
], ids=["auxiliary-loss", "past-the-tuple"])
def test_an_output_index_off_the_hidden_states_is_refused_with_the_setting(registered, index, message):
    registered(combine=Combine(output_index=index))
    wrapped = moelens.wrap(model())
    with pytest.raises(FamilyError, match=message):
        with wrapped.trace(IDS):
            wrapped.moes[0].mlp_output.save()


def model_of(block_class: type, experts_class: type | None = None) -> Model:
    """`model` with its blocks made ``block_class`` (a subclass of `Block` with another forward), and their experts
    ``experts_class`` (of `ExpertBank`) where given."""
    hand = model()
    for layer in hand.layers:
        layer["moe"].__class__ = block_class
        if experts_class is not None:
            layer["moe"].experts.__class__ = experts_class
    return hand


def test_a_read_error_names_the_value_and_keeps_its_reason_without_the_path(registered):
    """Experts called by keywords of their own: the error of the read names the value; its `why` (what describe and a
    block's repr list) stays the reason alone, as other refusals' do."""

    class KeywordsBlock(Block):
        def forward(self, hidden):
            b, s, d = hidden.shape
            x = hidden.reshape(-1, d)
            logits, weights, index = self.router(x)
            return (self.experts(x, index=index, weights=weights) + self.shared(x)).reshape(b, s, d), logits.sum()

    registered(block_classes=("KeywordsBlock",))
    wrapped = moelens.wrap(model_of(KeywordsBlock))
    with pytest.raises(ValueUnavailable) as refused:
        with wrapped.trace(IDS):
            wrapped.moes[0].expert_weights.save()
    assert str(refused.value).startswith("model.layers.0.moe.expert_weights: the call passed 1 positional arguments")
    assert refused.value.why.startswith("the call passed 1 positional arguments and ['index', 'weights']")


class LogitsBlock(Block):
    """Returns ``(hidden, router logits per token)``: an output index at the logits serves them as mlp_output."""

    def forward(self, hidden):
        out, _ = super().forward(hidden)
        return out, self.router(hidden.reshape(-1, hidden.shape[-1]))[0].view(*hidden.shape[:2], -1)


def test_check_names_an_output_index_at_another_per_token_tensor(registered):
    """check() failed with a raw RuntimeError (the sizes of tensor a (16) and b (6) do not match)."""
    registered(block_classes=("LogitsBlock",), combine=Combine(output_index=1))
    with pytest.raises(FamilyError, match=r"moe: mlp_output, as the entry of family 'hand' picks it \(Combine\(output_index="
                                          r"1\)\), is \[2, 5, 6\], where the entry's combination of routed_output is "
                                          r"\[2, 5, 16\]: name the element of the block's output that holds its hidden"):
        families.check(moelens.wrap(model_of(LogitsBlock)), IDS)


@pytest.mark.parametrize("argument, message", [
    (1, r"torch_topk_0\.input serves an int, not values per token, so the family entry of .* names the wrong op or "
        r"output there: fix Scoring\(selection_op='torch_topk_0', selection_arg=1\)"),
    (3, r"the call passed 2 positional arguments and \['dim'\], but moelens reads its argument 3: the family entry "
        r"names it \(Scoring\(selection_op='torch_topk_0', selection_arg=3\)\): name the argument that holds"),
])
def test_a_wrong_selection_argument_names_the_scoring_setting(registered, argument, message):
    """selection_arg at topk's k (an int) blamed Combine and logits_op; one past its arguments told the user to call the
    experts with transformers' signature, naming no value."""
    hf = tiny_model("kolibri1")
    entry = families.get("kolibri1")
    scoring = dataclasses.replace(entry.scoring, selection_arg=argument)
    registered(**{field.name: getattr(entry, field.name) for field in dataclasses.fields(entry)}
               | {"name": "my_kolibri", "scoring": scoring})
    wrapped = moelens.wrap(hf)
    moe = next(moe for moe in wrapped.moes if moe.ranks_selection_scores)
    with pytest.raises(FamilyError, match=rf"{moe.path}\.selection_scores: .*{message}"):
        with wrapped.trace(**tiny_inputs(hf)):
            moe.selection_scores.save()


def test_an_experts_path_naming_the_shared_mlp_is_not_served_as_the_routed_output(registered):
    """experts="shared" names a module the block calls as shared(x): wrap served its output as routed_output, silently
    (up to 6 off the experts' output on a user's model), and model.moes[0] then said the entry was registered after
    the wrap."""
    registered(experts="shared")
    hand = model()
    with pytest.warns(UserWarning, match=r"blocks of family 'hand' hold a Sequential at 'shared' \(e\.g\. layers\.0\.moe "
                                         r"\(Block; children \['router', 'experts', 'shared'\]\)\), whose "
                                         r"forward\(self, input\) cannot be called as experts\(hidden_states, "
                                         r"top_k_index, top_k_weights\), so none is served as a Moe.*Name that module "
                                         r"in the entry's experts\."):
        wrapped = moelens.wrap(hand)
    with pytest.raises(moelens.LayerIndexError, match=r"the family 'hand' you registered describes its Block blocks, "
                                                      r"but they hold no experts module moelens serves at its "
                                                      r"experts 'shared': fix the entry"):
        wrapped.moes[0]
    registered()  # the experts named: served, the bank's output
    wrapped = moelens.wrap(hand)
    with torch.no_grad(), wrapped.trace(IDS):
        routed = wrapped.moes[0].routed_output.save()
    with torch.no_grad():
        x, weights, index = first_routing(hand)
        torch.testing.assert_close(routed.reshape(-1, HIDDEN), hand.layers[0]["moe"].experts(x, index, weights))


def test_a_router_path_naming_another_module_says_the_path_may_be_wrong(registered):
    """router="shared" (a Sequential): the refusal blamed logits_op alone."""
    registered(router="shared")
    with pytest.raises(FamilyError, match=r"logits_op='F_linear_0' is not an operation of Sequential\.forward; .* If "
                                          r"Sequential is not the router, fix the entry's router='shared' instead \(the "
                                          r"block's children: router, experts, shared\)\.$"):
        moelens.wrap(model())


class ExtraArgumentBank(ExpertBank):
    """Experts taking an argument of their own after the routing (a capacity the block passes)."""

    def forward(self, x, index, weights, capacity, *, scale=1.0):
        return ExpertBank.forward(self, x, index, weights) * scale


class ExtraArgumentBlock(Block):
    def forward(self, hidden):
        b, s, d = hidden.shape
        x = hidden.reshape(-1, d)
        logits, weights, index = self.router(x)
        return (self.experts(x, index, weights, 4) + self.shared(x)).reshape(b, s, d), logits.sum()


def test_experts_taking_arguments_of_their_own_after_the_routing_are_served(registered):
    """forward(x, index, weights, capacity): the experts check at wrap took it for another module."""
    registered(block_classes=("ExtraArgumentBlock",))
    hand = model_of(ExtraArgumentBlock, ExtraArgumentBank)
    wrapped = moelens.wrap(hand)
    with torch.no_grad(), wrapped.trace(IDS):
        routed = wrapped.moes[0].routed_output.save()
    with torch.no_grad():
        x, weights, index = first_routing(hand)
        torch.testing.assert_close(routed.reshape(-1, HIDDEN), hand.layers[0]["moe"].experts(x, index, weights, 4))


def test_experts_taking_the_routing_by_transformers_keywords_are_served(registered):
    """An experts forward(x, *, top_k_index, top_k_weights) takes the call by those keywords: served."""
    class KeywordBank(ExpertBank):
        def forward(self, x, *, top_k_index, top_k_weights):
            return super().forward(x, top_k_index, top_k_weights)

    class KeywordBlock(Block):
        def forward(self, hidden):
            b, s, d = hidden.shape
            x = hidden.reshape(-1, d)
            logits, weights, index = self.router(x)
            routed = self.experts(x, top_k_index=index, top_k_weights=weights)
            return (routed + self.shared(x)).reshape(b, s, d), logits.sum()

    registered(block_classes=("KeywordBlock",))
    hand = model_of(KeywordBlock, KeywordBank)
    wrapped = moelens.wrap(hand)
    with torch.no_grad(), wrapped.trace(IDS):
        indices = wrapped.moes[0].expert_indices.save()
        routed = wrapped.moes[0].routed_output.save()
    with torch.no_grad():
        x, weights, index = first_routing(hand)
        torch.testing.assert_close(routed.reshape(-1, HIDDEN), hand.layers[0]["moe"].experts.forward(
            x, top_k_index=index, top_k_weights=weights))
        assert torch.equal(indices.reshape(-1, TOP_K), index)


def test_blocks_of_a_sequential_wrap_without_claiming_the_modules_under_them(registered):
    """Blocks named "0" and "1" (an nn.Sequential of them): nnsight matched those names against the end of every
    module's path, so the shared MLP's first Linear ("0.shared.0") was made a Moe too and wrap failed naming it."""
    class Stack(nn.Sequential):
        def forward(self, hidden):
            for block in self:
                hidden = hidden + block(hidden)[0]
            return hidden

    registered()
    torch.manual_seed(0)
    stack = Stack(Block(), Block()).eval()
    wrapped = moelens.wrap(stack)
    assert len(wrapped.moes) == 2 and type(wrapped.get("0.shared.0")) is not type(wrapped.moes[0])
    hidden = torch.randn(2, 5, HIDDEN)
    with torch.no_grad(), wrapped.trace(hidden):
        routed = wrapped.moes[1].routed_output.save()
    with torch.no_grad():
        x = (hidden + stack[0](hidden)[0]).reshape(-1, HIDDEN)
        _, weights, index = stack[1].router(x)
        torch.testing.assert_close(routed.reshape(-1, HIDDEN), stack[1].experts(x, index, weights))


def test_a_wrong_shared_expert_time_names_the_entry_in_the_order_error(registered):
    """save_all() raised an order error telling the user to use save_all(); the registration was the cause."""
    registered(shared=SharedExpert("shared", when="before_router"))
    wrapped = moelens.wrap(model())
    with pytest.raises(OrderError, match=r"Family 'hand' is a registered entry: .* \(shared\.when\) is not the one the "
                                         r"block's forward runs; fix the entry"):
        with wrapped.trace(IDS):
            wrapped.moes[0].save_all()


@pytest.mark.parametrize("extra", [None, "n_shared", -1, True])
def test_extra_logits_take_a_count_or_a_reference(extra):
    """None failed at the first read as int(None); a plain word as int('n_shared'); -1 and True later still."""
    with pytest.raises(FamilyError, match=rf"extra_logits must be an int >= 0 or an attribute reference .*got {extra!r}"):
        families.register(dataclasses.replace(ENTRY, name="hand_extra", extra_logits=extra))


def test_an_order_error_of_a_registered_entry_without_a_shared_expert_blames_the_read(registered):
    """The hint names shared.when, which an entry without a shared expert has no say in."""
    registered(shared=None)
    wrapped = moelens.wrap(model())
    with pytest.raises(OrderError) as caught:
        with wrapped.trace(IDS):
            wrapped.moes[0].expert_indices.save()
            wrapped.moes[0].router_logits.save()
    assert "registered entry" not in str(caught.value)


def test_moelens_own_order_error_does_not_blame_the_entry():
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    with pytest.raises(OrderError) as caught:
        with wrapped.trace(**tiny_inputs(hf)):
            wrapped.moes[0].expert_indices.save()
            wrapped.moes[0].router_logits.save()
    assert "registered entry" not in str(caught.value)


@pytest.mark.parametrize(("layout", "shapes"), [
    (ExpertLayout(gate_up="gate_up_proj", down="down_proj", transposed=True),
     r"gate \(6, 8, 24\), up \(6, 8, 24\), down \(6, 16, 12\)"),
    (ExpertLayout(gate="gate_up_proj", up="gate_up_proj", down="down_proj"),
     r"gate \(6, 24, 16\), up \(6, 24, 16\), down \(6, 16, 12\)"),
])
def test_params_through_a_wrong_expert_layout_are_refused(registered, layout, shapes):
    """Views of [E, I, D] sides swapped were served as the experts' weights (an edit landed on the wrong entries)."""
    registered(expert_layout=layout)
    wrapped = moelens.wrap(model())
    with pytest.raises(ValueUnavailable, match=rf"hand: ExpertBank: the weights read as {shapes}, which do not chain as "
                                               r"an expert's .*ExpertLayout"):
        wrapped.moes[0].params()


def test_a_count_left_at_its_default_names_the_setting(registered):
    """The error named 'router.top_k', a reference the user never wrote."""
    registered(top_k="block.k_per_token")
    wrapped = moelens.wrap(model())
    with pytest.raises(FamilyError, match=r"cannot read 'block\.k_per_token' .*; it is the entry's top_k; set that"):
        wrapped.moes[0].top_k
    registered(name="hand_default_k", router="router", top_k=Family.__dataclass_fields__["top_k"].default,
               num_experts="experts.num_experts")
    wrapped = moelens.wrap(model())
    assert wrapped.moes[0].top_k == TOP_K  # the default reference fits this router
    registered(name="hand_no_count", num_experts=Family.__dataclass_fields__["num_experts"].default,
               experts="experts")
    delattr(wrapped.moes[0]._module.experts, "num_experts")
    with pytest.raises(FamilyError, match=r"cannot read 'experts\.num_experts' .*; it is the entry's num_experts "
                                          r"\(left at its default\); set that to a value"):
        wrapped.moes[0].num_experts


def test_unregister_takes_back_only_the_users_own_registrations():
    """A re-run notebook cell calling unregister("mixtral") twice removed moelens' own entry for the process."""
    builtin = families.get("mixtral")
    families.register(dataclasses.replace(builtin, notes="mine"), replace=True)
    families.unregister("mixtral")
    with pytest.raises(FamilyError, match=r"cannot unregister 'mixtral': the entry in force is moelens' own, and "
                                          r"unregister undoes only your own register calls \(none is left"):
        families.unregister("mixtral")
    assert families.get("mixtral") is builtin
    assert moelens.wrap(tiny_model("mixtral")).moes[0].family is builtin


def test_get_takes_a_name_and_says_so_for_an_entry():
    """An entry from supported() (which prints as names) passed to get raised TypeError: unhashable type."""
    entry = next(iter(families.supported()))
    with pytest.raises(FamilyError, match=rf"get takes a family's name, got a Family entry \('{entry.name}'\): give "
                                          rf"its name, get\('{entry.name}'\)"):
        families.get(entry)
    with pytest.raises(FamilyError, match=r"get takes a family's name, got int 3"):
        families.get(3)
    assert families.get(entry.name) is entry


def test_a_model_type_taken_by_another_family_needs_replace():
    """A user entry naming model type 'mixtral' was accepted, and the built-in kept answering for it."""
    mine = dataclasses.replace(ENTRY, name="mine", model_types=("mixtral",))
    with pytest.raises(FamilyError, match=r"model type 'mixtral' already belongs to family 'mixtral'; 'mixtral' is "
                                          r"one of moelens' own families: .* or pass replace=True to take it over .*, "
                                          r"which changes how every mixtral model is served until "
                                          r"moelens\.families\.unregister\('mine'\)"):
        families.register(mine)
    families.register(mine, replace=True)
    try:
        assert families.for_model_type("mixtral") is mine
    finally:
        families.unregister("mine")
    assert families.for_model_type("mixtral") is families.get("mixtral")


# -- families.check: what no read refuses --------------------------------------------------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_check_passes_moelens_own_entries(family):
    """No false alarm: every built-in entry (each checked against transformers' own values elsewhere) describes
    its tiny model's weights and block output."""
    hf = tiny_model(family)
    wrapped = moelens.wrap(hf)
    if not wrapped.moes:
        pytest.skip(f"{family}: its tiny model serves no Moe block")
    assert families.check(wrapped, **tiny_inputs(hf)) == [moe.path for moe in wrapped.moes if not moe.runs_only_on]


@pytest.mark.parametrize("family", ["ergo", "deepseek_v3", "glm4_moe", "kimi_linear", "gpt_oss", "mixtral"])
def test_check_passes_moelens_own_entries_in_bfloat16(family):
    """ergo's router rounds its float32 weights to the hidden states' bfloat16 and back: the check compared them
    with its float32 recomputation at float32's tolerance and refused moelens' own entry on a bfloat16 model (the
    weights are that recomputation rounded to bfloat16 exactly)."""
    if family not in TINY_FAMILIES:
        pytest.skip(f"{family} is not in this transformers version")
    hf = tiny_model(family, dtype=torch.bfloat16)
    wrapped = moelens.wrap(hf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert families.check(wrapped, **tiny_inputs(hf)) == [moe.path for moe in wrapped.moes]
    assert not [warning for warning in caught if "gives too" in str(warning.message)]  # the score was checked


def _check_refuses(entry: Family, hf: torch.nn.Module, inputs: dict, message: str) -> None:
    """With ``entry`` registered (for the time of the check), families.check of ``hf`` raises ``message``."""
    families.register(entry, replace=True)
    try:
        with pytest.raises(FamilyError, match=message):
            families.check(moelens.wrap(hf), **inputs)
    finally:
        families.unregister(entry.name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_check_passes_mistral4_whose_groups_tie_in_half_precision(dtype):
    """mistral4 scores its groups in the model's dtype: groups within a float16/bfloat16 step of each other tie
    there, and torch keeps either. check re-ranked them in float32, called a tie only within 1e-5, and refused
    moelens' own entry for 1 to 6 of 96 tokens (the truth: the served routing is the experts call's, and the entry
    passes in float32 on the same inputs)."""
    hf = tiny_model("mistral4", dtype=dtype)
    inputs = tiny_inputs(hf, batch=4, seq=24)
    wrapped = moelens.wrap(hf)
    assert families.check(wrapped, **inputs) == [moe.path for moe in wrapped.moes]
    full = tiny_model("mistral4")
    assert families.check(moelens.wrap(full), **tiny_inputs(full, batch=4, seq=24))


@pytest.mark.parametrize("top_k", [2, 1])
@pytest.mark.parametrize("off", [1.02, 1.005])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_check_refuses_a_scale_slightly_off_on_a_bfloat16_model(family, off, top_k):
    """Their routers weigh in float32 on a bfloat16 model: a weights check at bfloat16's tolerance (1e-2) let an
    entry whose routed scale was 2% off pass, and at one bfloat16 step (0.8%) one 0.5% off; so did one whose weights
    lie on bfloat16's grid by chance (top-1, renormalised: every weight is the scale)."""
    entry = families.get(family)
    hf = tiny_model(family, dtype=torch.bfloat16, num_experts_per_tok=top_k, norm_topk_prob=True)
    scale = entry.scale_of(moelens.wrap(hf).moes[0]._module)
    off_scale = dataclasses.replace(entry, name="off_scale", scoring=dataclasses.replace(entry.scoring, scale=scale * off))
    _check_refuses(off_scale, hf, tiny_inputs(hf), r"the weights its experts got are not what the scoring of family "
                                                   r"'off_scale' gives")


def test_check_names_the_scoring_that_gives_the_weights(registered):
    """The hand model (softmax over every expert, top-2, renormalised) registered as sigmoid: every read is served,
    router_probs is sigmoid(logits) (rows summing to ~3), and nothing said so."""
    registered(scoring=Scoring("sigmoid", "score_topk"))
    wrapped = moelens.wrap(model())
    with pytest.raises(FamilyError, match=r"layers\.0\.moe: the weights its experts got are not what the scoring of "
                                          r"family 'hand' gives \(score='sigmoid', select='score_topk', normalize=False, "
                                          r"scale=None; largest difference .*\): with score='softmax', normalize=True "
                                          r"\(the entry's other settings as they are\) it gives them"):
        families.check(wrapped, IDS)
    registered(name="hand_scaled", scoring=Scoring("softmax", "score_topk", normalize=True, scale=2.0))
    with pytest.raises(FamilyError, match=r"largest difference .*: with scale=None \(the entry's other settings"):
        families.check(moelens.wrap(model()), IDS)
    deepseek = tiny_model("deepseek_v3")  # only the scale wrong: the groups and the selection bias stay
    entry = families.get("deepseek_v3")
    registered(**{field.name: getattr(entry, field.name) for field in dataclasses.fields(entry)}
               | {"name": "my_deepseek", "scoring": dataclasses.replace(entry.scoring, scale=None)})
    with pytest.raises(FamilyError, match=r"with scale=2\.5 \(the entry's other settings as they are\)"):
        families.check(moelens.wrap(deepseek), **tiny_inputs(deepseek))


def test_check_refuses_a_scale_five_percent_off(registered):
    """Near misses count: an entry scaling the weights by 1.05 on a router that scales nothing is wrong (router_probs
    and the export gate would follow it)."""
    registered(scoring=Scoring("softmax", "score_topk", normalize=True, scale=1.05))
    with pytest.raises(FamilyError, match=r"with scale=None \(the entry's other settings"):
        families.check(moelens.wrap(model()), IDS)


def test_check_finds_a_block_output_the_entry_does_not_make(registered):
    """An entry without the shared expert: the block output is routed + shared, the entry says routed alone."""
    registered(shared=None)
    wrapped = moelens.wrap(model())
    with pytest.raises(FamilyError, match=r"layers\.0\.moe: the Combine of family 'hand' .* of routed_output, without a "
                                          r"shared expert .*, is not the block's output.* The block may add a module "
                                          r"the entry names no shared expert for \(SharedExpert\(module=\.\.\.\), the "
                                          r"block's children: router, experts, shared\)\.\n"):
        families.check(wrapped, IDS)
    registered(name="hand_right")
    assert families.check(moelens.wrap(model()), IDS) == ["model.layers.0.moe", "model.layers.1.moe"]


def test_check_says_when_the_block_does_not_add_the_shared_expert_named(registered):
    """The block runs its shared MLP and leaves its output out: check said the factor was "from 0 to 0: a gate", and
    to name the gate."""
    class Unshared(Block):
        def forward(self, hidden):
            b, s, d = hidden.shape
            x = hidden.reshape(-1, d)
            logits, weights, index = self.router(x)
            routed = self.experts(x, index, weights)
            self.shared(x)  # run, not added
            return routed.reshape(b, s, d), logits.sum()

    registered(block_classes=("Unshared",))
    hand = model_of(Unshared)
    with pytest.raises(FamilyError, match=r"The block's output is routed_output alone: it does not add the shared "
                                          r"expert the entry names \(SharedExpert 'shared'\); set shared=None, or name "
                                          r"the module the block adds\.\n"):
        families.check(moelens.wrap(hand), IDS)


def test_check_says_when_it_cannot_run():
    """Inside an open trace it failed with nnsight's AttributeError; with no input or a misspelt keyword it told the
    user to call save_all inside a trace."""
    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    with pytest.raises(FamilyError, match=r"check runs the model itself, .* call it after the with-block"):
        with wrapped.trace(**tiny_inputs(hf)):
            families.check(wrapped, **tiny_inputs(hf))
    with pytest.raises(FamilyError, match=r"check runs the model once on inputs: check\(model, \"some text\"\)"):
        families.check(wrapped)
    with pytest.raises(FamilyError, match=r"the model did not run on the inputs given \(keywords \['input_idz'\]\)"):
        families.check(wrapped, input_idz=tiny_inputs(hf)["input_ids"])


def test_check_warns_of_blocks_whose_weights_it_cannot_recompute():
    """zaya's skip class: the block output is checked, the weights are not, and the user is told (they were listed
    as checked without a word)."""
    hf = tiny_model("zaya")
    wrapped = moelens.wrap(hf)
    with pytest.warns(UserWarning, match=r"check: .*: its block output is checked, its expert weights are not \(a slot "
                                         r"that chose the skip class"):
        families.check(wrapped, **tiny_inputs(hf))


def test_check_passes_a_converted_linear_narrower_out_than_in():
    """A compressed k_proj (32 -> 16, GQA) pads its experts square and cuts the routed output: check crashed adding
    the 32-wide routed output to the 16-wide shared one."""
    from moelens.compress import tomoe
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    converted = tomoe(dense, num_experts=2, top_k=1, target_modules=["k_proj"], max_error=None, progress=False)
    wrapped = moelens.wrap(converted)
    assert families.check(wrapped, torch.randint(0, 64, (2, 6))) == ["model.model.layers.0.self_attn.k_proj"]


def test_check_names_a_shared_gate_that_does_not_gate_the_shared_expert():
    """A gate path naming the router passed check, and moe.shared_gate served the router's output. Ground truth:
    qwen2_moe's block, sigmoid(shared_expert_gate(x)) * shared_expert(x)."""
    entry = families.get("qwen2_moe")
    wrong = dataclasses.replace(entry, shared=dataclasses.replace(entry.shared, gate="gate"))
    hf = tiny_model("qwen2_moe")
    _check_refuses(wrong, hf, tiny_inputs(hf), r"SharedExpert gate='gate' returns a tuple, and the sigmoid of it times "
                                               r"the output of 'shared_expert' is not the gated shared output read at "
                                               r"gated_op='shared_expert_output_1': name the module whose one output "
                                               r"per token gates the shared expert \(the block's children: gate, experts, "
                                               r"shared_expert, shared_expert_gate\)")


def test_a_shared_gate_and_its_op_go_together():
    """An entry with the gate and no gated_op (or the reverse) passed check and was exported with another gate."""
    for shared in (SharedExpert("shared", gate="gate"), SharedExpert("shared", gated_op="mul_0")):
        with pytest.raises(FamilyError, match=r"SharedExpert gate=.* and gated_op=.* go together"):
            families.register(dataclasses.replace(ENTRY, name="hand_gate", shared=shared))


@pytest.mark.parametrize(("combine", "fix"), [
    (Combine(output_index=0, mode="average"), r"with Combine mode='sum' \(the rest as it is\) it is"),
    (Combine(output_index=0, routed_scale=0.5), r"with Combine routed_scale=None \(the rest as it is\) it is"),
])
def test_check_names_the_combine_that_makes_the_block_output(registered, combine, fix):
    """...and no more: the shared expert's part fits once the Combine is fixed, so no gate is suggested (the hint
    read the rest as a gate of factor 1 where the entry's Combine was wrong)."""
    registered(combine=combine)
    with pytest.raises(FamilyError, match=rf"the Combine of family 'hand' .* is not the block's output .*: {fix}") as caught:
        families.check(moelens.wrap(model()), IDS)
    assert "a gate" not in str(caught.value)


def test_check_finds_a_router_that_ranks_with_a_bias_the_entry_leaves_out(registered):
    """kolibri1 picks the top-k of logits + e_score_correction_bias; an entry without the selection bias passed
    check(), and route_around then left the ablated expert chosen (it ranks what the entry says)."""
    hf = tiny_model("kolibri1")
    with torch.no_grad():
        for layer in hf.model.layers:
            router = getattr(layer.mlp, "gate", None)
            if router is not None:
                router.e_score_correction_bias.copy_(torch.linspace(2.0, 0.0, router.e_score_correction_bias.numel()))
    entry = families.get("kolibri1")
    assert families.check(moelens.wrap(hf), **tiny_inputs(hf))  # the right entry passes on the biased router
    scoring = dataclasses.replace(entry.scoring, selection_bias=None, selection_op=None, selection_arg=None)
    registered(**{field.name: getattr(entry, field.name) for field in dataclasses.fields(entry)}
               | {"name": "my_kolibri", "scoring": scoring})
    with pytest.raises(FamilyError, match=r"mlp: the experts chosen for \d+ of \d+ tokens are not the top 2 of what "
                                          r"the scoring of family 'my_kolibri' ranks \(its logits; .*name it "
                                          r"\(Scoring\.selection_bias\)"):
        families.check(moelens.wrap(hf), **tiny_inputs(hf))


def test_a_scale_or_score_reference_to_no_number_or_name_is_refused_by_field(registered):
    """Scoring.scale naming a weight gave check() torch's "only one element tensors can be converted"; Scoring.score
    naming the router's top_k gave "unknown score function 2" naming neither the field nor the reference."""
    registered(scoring=Scoring("softmax", "score_topk", normalize=True, scale="router.weight"))
    with pytest.raises(FamilyError, match=r"family 'hand': Scoring\.scale='router\.weight' gives a Parameter of shape "
                                          r"\(6, 16\) on Block, not a number"):
        families.check(moelens.wrap(model()), IDS)
    registered(scoring=Scoring("router.top_k", "score_topk", normalize=True))
    wrapped = moelens.wrap(model())
    with pytest.raises(FamilyError, match=r"family 'hand': Scoring\.score='router\.top_k' gives 2 on Block, not a score "
                                          r"function: expected one of \['sigmoid', 'softmax', 'sqrtsoftplus'\]"):
        with wrapped.trace(IDS):
            wrapped.moes[0].router_probs.save()
    registered(scoring=Scoring("softmax", "score_topk", normalize=True, scale="router.top_k"))
    assert families.get("hand").scale_of(model().layers[0]["moe"]) == 2.0  # an attribute holding a number is taken


def test_check_says_to_wrap_again_and_the_fixed_entry_then_passes(registered):
    """A wrapped model keeps the entry it was wrapped with: check told the user to "fix it and register it again",
    and after doing so the same wrapped model failed check with the same message."""
    registered(scoring=Scoring("softmax", "score_topk", normalize=False))
    wrapped = moelens.wrap(model())
    with pytest.raises(FamilyError, match=r"normalize=True .*\nFix the entry, register it again \(moelens\.families"
                                          r"\.register\(Family\(\.\.\.\), replace=True\)\) and wrap the model again "
                                          r"\(moelens\.wrap\(model\._module\)\)"):
        families.check(wrapped, IDS)
    registered()  # the fix, registered as the message says
    assert wrapped.moes[0].SCORING.normalize is False  # the wrapped model keeps its entry...
    assert families.check(moelens.wrap(wrapped._module), IDS) == ["model.layers.0.moe", "model.layers.1.moe"]


@pytest.mark.parametrize("score_name", ["softmax", "sigmoid"])
def test_check_warns_that_one_renormalised_expert_cannot_tell_the_score(registered, score_name):
    """One expert per token, renormalised, weighs 1 under any score function: an entry saying sigmoid for this
    softmax router passed check without a word, and router_probs was sigmoid(logits) (rows summing to ~3)."""
    registered(scoring=Scoring(score_name, "score_topk", normalize=True))
    hand = model()
    for layer in hand.layers:
        layer["moe"].router.top_k = 1
    others = " or ".join(repr(name) for name in ("softmax", "sigmoid", "sqrtsoftplus") if name != score_name)
    # one warning for both blocks (it was one a block)
    with pytest.warns(UserWarning, match=rf"check: model\.layers\.0\.moe, model\.layers\.1\.moe: its expert weights "
                                         rf"and output are checked, its score "
                                         rf"function is not \(the weights its experts got are what {others} scoring "
                                         rf"gives too \(1 expert\(s\) per token.*router_probs follows the entry's "
                                         rf"'{score_name}'"):
        assert families.check(moelens.wrap(hand), IDS) == ["model.layers.0.moe", "model.layers.1.moe"]
    with warnings.catch_warnings():  # two experts per token tell softmax from the others
        warnings.simplefilter("error")
        if score_name == "softmax":
            assert families.check(moelens.wrap(model()), IDS)
        else:
            with pytest.raises(FamilyError, match=r"with score='softmax'"):
                families.check(moelens.wrap(model()), IDS)


def _dbrx_with_p(p: float) -> tuple:
    """A tiny dbrx whose router divides its k weights by their p-norm, the weights its first block's experts call got,
    and the softmax scores of the experts chosen there (hooks on the unwrapped model: the truth)."""
    from moelens.testing import tiny_config

    ffn = tiny_config("dbrx").ffn_config.to_dict() | {"moe_normalize_expert_weights": p}
    hf = tiny_model("dbrx", ffn_config=ffn)
    block, seen = hf.transformer.blocks[0].ffn, {}
    block.router.register_forward_hook(lambda module, args, out: seen.update(logits=out))
    block.experts.register_forward_hook(lambda module, args, out: seen.update(indices=args[1], weights=args[2]))
    with torch.no_grad():
        hf(**tiny_inputs(hf))
    return hf, seen["weights"], seen["logits"].softmax(-1).gather(-1, seen["indices"])


def test_dbrx_weights_divided_by_their_0_norm_are_refused_with_the_reason():
    """p = 0 divides dbrx's k weights by their count (transformers skips the division only at None): moelens read 0
    as no renormalisation, and check refused moelens' own entry, advising scale=0.5 (the truth: the experts call's
    weights are the chosen softmax scores over k)."""
    hf, weights, chosen = _dbrx_with_p(0.0)
    assert torch.allclose(weights, chosen / chosen.shape[-1])
    with pytest.raises(FamilyError, match=r"divides its k weights by their 0-norm \(p = 0, the count of non-zero "
                                          r"weights.*set it to None"):
        families.check(moelens.wrap(hf), **tiny_inputs(hf))


def test_check_divides_dbrx_weights_by_their_p_norm():
    """dbrx divides its k weights by their p-norm, p = moe_normalize_expert_weights (1 by default): check took
    every normalisation for a sum and refused moelens' own entry at p = 2, telling the user to fix it."""
    hf, weights, chosen = _dbrx_with_p(2.0)
    assert torch.allclose(weights, chosen / chosen.norm(p=2, dim=-1, keepdim=True))  # the model's own p-norm
    assert not torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True))  # which is no sum
    wrapped = moelens.wrap(hf)
    assert families.check(wrapped, **tiny_inputs(hf)) == [moe.path for moe in wrapped.moes]
    summed = dataclasses.replace(families.get("dbrx"), name="dbrx_summed",
                                 scoring=dataclasses.replace(families.get("dbrx").scoring, normalize=True))
    _check_refuses(summed, hf, tiny_inputs(hf), r"the weights its experts got are not what the scoring of family "
                                                r"'dbrx_summed' gives")


@pytest.mark.parametrize(("changes", "message"), [
    ({"derived_routing": "yes"}, r"derived_routing must be a bool, got 'yes'"),
    ({"experts_call": 0}, r"experts_call must be a bool, got 0"),
    ({"notes": ["x"]}, r"notes must be a string, got \['x'\]"),
    ({"final_norm": None}, r"final_norm must be a string, got None"),
    ({"combine": Combine(routed_post=3)}, r"Combine\.routed_post must be a string or None, got 3"),
    ({"shared": SharedExpert(None)}, r"SharedExpert\.module must be a string, got None"),
    ({"expert_layout": ExpertLayout(gate_up="gate_up_proj", transposed="yes")},
     r"ExpertLayout\.transposed must be a bool, got 'yes'"),
    ({"scoring": Scoring("softmax", selection_arg=True, selection_op="topk_0")},
     r"Scoring\.selection_arg must be an int or None, got True"),
    ({"scoring": Scoring("softmax", normalize=True, scale="2.0")},
     r"Scoring\.scale must be None, a positive number or an attribute reference .*got '2\.0'; a number is written "
     r"without quotes \(2\.0\)"),
    # a scale that is not a positive finite number passed register; only check said the entry did not fit the model
    ({"scoring": Scoring("softmax", normalize=True, scale=float("nan"))}, r"Scoring\.scale must be None, a positive "
                                                                          r"number or an attribute reference .*got nan"),
    ({"scoring": Scoring("softmax", normalize=True, scale=0.0)}, r"Scoring\.scale must be None, a positive number"),
    # what the router adds to the sum it renormalises by decides whether all -inf logits are NaN (router_logits writes)
    ({"scoring": Scoring("sigmoid", normalize=True, normalize_eps=-1e-20)},
     r"Scoring\.normalize_eps must be a number >= 0 .*got -1e-20"),
    ({"scoring": Scoring("sigmoid", normalize=True, normalize_eps=float("nan"))}, r"Scoring\.normalize_eps must be a"),
    ({"scoring": Scoring("sigmoid", normalize=True, normalize_eps="1e-20")}, r"Scoring\.normalize_eps must be a number"),
    ({"combine": Combine(routed_scale=-1.0)}, r"Combine\.routed_scale must be None, a positive number .*got -1\.0"),
    ({"combine": Combine(routed_scale=float("inf"))}, r"Combine\.routed_scale must be None, a positive number"),
])
def test_plain_fields_of_the_wrong_kind_are_refused_when_registered(changes, message):
    """Fields holding a bool or a string took anything: derived_routing="yes" switched derived weights on by
    truthiness, and scale="2.0" (a dot, so taken for a reference) failed at check with "has no attribute '2'"."""
    with pytest.raises(FamilyError, match=rf"family 'hand_kinds': {message}"):
        families.register(dataclasses.replace(ENTRY, name="hand_kinds", **changes))
    assert "hand_kinds" not in {family.name for family in families.supported()}


def test_routing_read_at_the_router_serves_and_edits_the_routers_choice(registered):
    """routing_from_router=(1, 2): expert_weights / expert_indices are read at the router's output tuple (where
    longcat_flash's block changes them before its experts call); a write there reaches the experts."""
    registered(routing_from_router=(1, 2))
    hand = model()
    wrapped = moelens.wrap(hand)
    block = hand.layers[0]["moe"]
    x = hand.embed(IDS).reshape(-1, HIDDEN)
    logits, weights, index = block.router(x)
    with torch.no_grad(), wrapped.trace(IDS):
        moe = wrapped.moes[0]
        served = moe.save_all(("expert_weights", "expert_indices"))
        moe.expert_indices = torch.zeros_like(moe.expert_indices)  # every slot to expert 0, at the router
        hidden = moe.experts.inputs[0][1].save()
    assert torch.equal(served["expert_indices"], index.reshape(2, 5, TOP_K))
    assert torch.allclose(served["expert_weights"], weights.reshape(2, 5, TOP_K))
    assert torch.equal(hidden, torch.zeros_like(index))  # what the experts got


@pytest.mark.parametrize(("positions", "name", "message"), [
    ((2, 1), "expert_weights", r"expert_weights is a torch\.int64 tensor: family 'hand' reads the weights and indices at "
                               r"positions \(2, 1\) of the router's output"),
    # these named Combine(output_index), and top_k alone
    ((1, 3), "expert_indices", r"tuple of 3 elements, but its family entry reads element 3 of its output "
                               r"\(routing_from_router=\(1, 3\)\); name the positions of the router's"),
    ((0, 2), "expert_weights", r"holds 6 entries per token.*read at the router's output with "
                               r"routing_from_router=\(0, 2\)"),
])
def test_routing_positions_that_do_not_hold_the_weights_and_indices_are_refused_at_the_read(
        registered, positions, name, message):
    registered(routing_from_router=positions)
    wrapped = moelens.wrap(model())
    with pytest.raises(FamilyError, match=message):
        with wrapped.trace(IDS):
            getattr(wrapped.moes[0], name).save()


@pytest.mark.parametrize(("changes", "message"), [
    ({"routing_from_router": (1,)}, r"routing_from_router must be None or the two positions"),
    ({"routing_from_router": (1, 1)}, r"routing_from_router must be None or the two positions"),
    ({"routing_from_router": [1, 2]}, r"routing_from_router must be None or the two positions"),
    ({"routed_from_block": True}, r"routed_from_block must be True or False, and True only for a block with no "
                                  r"shared expert"),
    ({"routed_from_block": "yes", "shared": None}, r"routed_from_block must be True or False"),
])
def test_router_and_block_locations_are_checked_when_registered(changes, message):
    with pytest.raises(FamilyError, match=message):
        families.register(dataclasses.replace(ENTRY, name="hand_wrong", model_types=("hand_wrong",), **changes))


def test_the_routed_output_read_at_the_block_is_its_output(registered):
    """routed_from_block: routed_output is the block's output (longcat_flash from transformers 5.25 adds its
    zero-compute experts' share after the experts call); a write to it is the block's output."""
    registered(shared=None, routed_from_block=True, combine=Combine(output_index=0))
    hand = model()
    wrapped = moelens.wrap(hand)
    with torch.no_grad(), wrapped.trace(IDS):
        moe = wrapped.moes[0]
        routed = moe.routed_output.save()
        moe.routed_output = routed * 2
        block_output = moe.output[0].save()
    with torch.no_grad():
        expected = hand.layers[0]["moe"](hand.embed(IDS))[0]
    assert torch.equal(routed, expected)
    assert torch.equal(block_output, expected * 2)


@pytest.mark.parametrize(("family", "message"), [
    ("llama4", r"its block output is not checked \(the block serves no routed_output\), nor are its expert weights"),
    ("gemma4", r"its block output is not checked \(the block serves no mlp_output\), so the entry's Combine and "
               r"shared expert are taken as they are"),
])
def test_check_says_what_it_could_not_check(family, message):
    """llama4's check said "its block output is checked" where nothing was (the block serves no routed_output), and
    gemma4's skipped its Combine without a word: a wrong score or Combine passed. Said once for all the blocks
    (it was said once a block: 48 warnings on a 48-layer model)."""
    hf = tiny_model(family)
    with pytest.warns(UserWarning, match=message) as seen:
        checked = families.check(moelens.wrap(hf), **tiny_inputs(hf))
    told = [str(w.message) for w in seen if "families.check" in str(w.message)]
    assert len(checked) > 1 and len(told) == 1 and all(path in told[0] for path in checked[:1] + checked[-1:])


def test_check_ranks_a_group_topk_entry_without_groups_as_a_score_topk_one():
    """minimax_m2's entry without its selection bias was refused as score_topk but passed as group_topk (with no
    groups read off the block, a top-k of the scores): the selection was not checked."""
    entry = families.get("minimax_m2")
    wrong = dataclasses.replace(entry, name="minimax_m2_group", scoring=dataclasses.replace(
        entry.scoring, select="group_topk", selection_bias=None, selection_op=None, selection_arg=None))
    families.register(wrong, replace=True)
    try:
        hf = tiny_model("minimax_m2")
        with pytest.raises(FamilyError, match=r"the experts chosen for \d+ of \d+ tokens are not the top 2"):
            families.check(moelens.wrap(hf), **tiny_inputs(hf))
    finally:
        families.unregister("minimax_m2_group")


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("groups", [("router.num_group", "router.num_group"), ("router.num_group", "config.n_shared_experts"),
                                    ("router.top_k", "router.topk_group")],
                         ids=["groups-ignored", "topk_group-read-as-1", "n_group-read-as-2"])
def test_check_finds_groups_the_router_does_not_keep(family, groups):
    """check skipped the selection of every group-limited entry: one keeping all 4 groups, or reading topk_group or
    n_group from the wrong attribute, passed without a word (force then refused routings the router makes).
    Ground truth: the tiny router keeps 2 of its 4 groups, so a plain top-k of score + bias differs for some
    tokens (recomputed here from the router module itself)."""
    hf = tiny_model(family)
    inputs = tiny_inputs(hf, batch=4, seq=16)
    router = hf.model.layers[1].mlp.gate
    seen = {}
    handle = hf.model.layers[1].mlp.register_forward_pre_hook(lambda module, args: seen.update(hidden=args[0]))
    with torch.no_grad():
        hf(**inputs)
        handle.remove()
        logits, _, indices = router(seen["hidden"])
        ungrouped = (logits.sigmoid() + router.e_score_correction_bias).topk(router.top_k, dim=-1).indices
    assert (router.num_group, router.topk_group, router.top_k, hf.config.n_shared_experts) == (4, 2, 2, 1)
    assert (ungrouped.sort(-1).values != indices.sort(-1).values).any()
    entry = families.get(family)
    wrong = dataclasses.replace(entry, name=f"{family}_groups", scoring=dataclasses.replace(entry.scoring, groups=groups))
    families.register(wrong, replace=True)
    try:
        with pytest.raises(FamilyError, match=r"the experts chosen for \d+ of \d+ tokens are not the top 2 .* inside the "
                                              r"best \d of \d groups .* check groups"):
            families.check(moelens.wrap(hf), **inputs)
    finally:
        families.unregister(f"{family}_groups")


@pytest.mark.parametrize("groups", [("router.num_group", "router.num_group"), ("router.top_k", "router.topk_group")],
                         ids=["groups-ignored", "n_group-read-as-2"])
def test_check_finds_groups_a_bfloat16_router_does_not_keep(groups):
    """mistral4 ranks in bfloat16: the selection was checked at a fixed 1e-2 (some 10% of its softmax scores), and
    entries keeping all groups, or reading n_group from top_k, passed (the truth: the right entry passes on the same
    run, and the router keeps 2 of its 4 groups)."""
    hf = tiny_model("mistral4", dtype=torch.bfloat16)
    inputs = tiny_inputs(hf, batch=4, seq=24, seed=1)
    wrapped = moelens.wrap(hf)
    assert families.check(wrapped, **inputs) == [moe.path for moe in wrapped.moes]
    router = wrapped.moes[0].router._module
    assert (router.num_group, router.topk_group, router.top_k) == (4, 2, 2)
    entry = families.get("mistral4")
    wrong = dataclasses.replace(entry, name="mistral4_groups", scoring=dataclasses.replace(entry.scoring, groups=groups))
    _check_refuses(wrong, hf, inputs, r"the experts chosen for \d+ of \d+ tokens are not the top 2 .* check groups")


def test_check_tells_a_group_s_best_two_from_its_best_one():
    """DeepSeek-V2's group-limited greedy keeps the groups of the best expert (not the best two) and sets the
    others' scores to 0.0; an entry scoring groups by their best two is refused, the right one passes."""
    hf = tiny_model("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    entry = families.get("deepseek_v2")
    assert entry.scoring.group_score == "max"
    wrapped = moelens.wrap(hf)
    assert families.check(wrapped, **tiny_inputs(hf)) == [moe.path for moe in wrapped.moes]
    wrong = dataclasses.replace(entry, name="ds2_best_two",
                                scoring=dataclasses.replace(entry.scoring, group_score="top2_sum"))
    families.register(wrong, replace=True)
    try:
        with pytest.raises(FamilyError, match=r"a group scored by the sum of its best two"):
            families.check(moelens.wrap(hf), **tiny_inputs(hf))
    finally:
        families.unregister("ds2_best_two")


def test_a_group_score_must_be_one_moelens_knows():
    entry = families.get("deepseek_v3")
    with pytest.raises(FamilyError, match=r"Scoring.group_score 'mean' is not one of \('top2_sum', 'max'\)"):
        families.register(dataclasses.replace(entry, name="mean_groups",
                                              scoring=dataclasses.replace(entry.scoring, group_score="mean")))


@pytest.mark.parametrize(("family", "overrides", "described"), [
    ("lfm2_moe", {"use_expert_bias": False}, "sigmoid scores, score topk, renormalised (SGB)"),
    ("laguna", {"moe_router_logit_softcapping": 2.0},
     "logits softcapped at 2, sigmoid scores, score topk, selection bias, renormalised (SGB)"),
])
def test_a_block_is_described_as_its_router_scores(family, overrides, described):
    """described_on named a selection bias the block has none of (lfm2_moe without expert_bias) and no softcap."""
    moe = moelens.wrap(tiny_model(family, **overrides)).moes[0]
    assert moe.family.described_on(moe._module) == described


class SquareBank(ExpertBank):
    """Experts whose down projection is square (I == D), so a transposed reading of it keeps every shape."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN, HIDDEN) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) * 0.3)


def square_model() -> Model:
    hand = model()
    for layer in hand.layers:
        layer["moe"].experts = SquareBank()
    return hand


@pytest.mark.parametrize(("make", "layout", "fits"), [
    (model, ExpertLayout(gate_up="gate_up_proj", down="down_proj", concatenated=False), "concatenated=True"),
    (square_model, ExpertLayout(gate_up="gate_up_proj", down="down_proj", down_transposed=True),
     "down_transposed=False"),
])
def test_check_finds_an_expert_layout_that_keeps_the_shapes(registered, make, layout, fits):
    """Gate and up read interleaved from a concatenated gate_up, or a square down read transposed: params() served
    other numbers as the weights (an edit through it landed on other rows), and check passed."""
    hand = make()
    registered()  # the right layout: no alarm
    right = moelens.wrap(hand)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert families.check(right, IDS) == [moe.path for moe in right.moes]
    registered(expert_layout=layout)
    wrong = moelens.wrap(hand)
    served, true = dict(wrong.moes[0].params().items()), dict(right.moes[0].params().items())
    assert not all(torch.equal(served[name], true[name]) for name in ("gate", "up", "down"))
    with pytest.raises(FamilyError, match=rf"expert_layout .*recomputes none of the experts' outputs; with {fits} "
                                          r"\(the rest as it is\) they are recomputed"):
        families.check(wrong, IDS)


class InOutBank(ExpertBank):
    """Experts stored ``[E, in, out]`` and used as ``x @ W`` (gate and up ``[E, D, I]``, down ``[E, I, D]``): read
    as ``[E, out, in]`` they chain too, with D and I swapped."""

    def __init__(self) -> None:
        super().__init__()
        del self.gate_up_proj
        self.gate_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.3)
        self.up_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, INTERMEDIATE, HIDDEN) * 0.3)

    def expert_output(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.gate_proj[expert]) * (x @ self.up_proj[expert])) @ self.down_proj[expert]


class StackedBank(ExpertBank):
    """Experts stacked in 2-D parameters: gate_up ``[E*2I, D]``, down ``[E*I, D]`` (read transposed)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS * 2 * INTERMEDIATE, HIDDEN) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS * INTERMEDIATE, HIDDEN) * 0.3)

    def expert_output(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj.view(EXPERTS, -1, HIDDEN)[expert]).chunk(2, -1)
        return (F.silu(gate) * up) @ self.down_proj.view(EXPERTS, INTERMEDIATE, HIDDEN)[expert]


@pytest.mark.parametrize(("bank", "wrong", "right", "message"), [
    # the wrong layout chains with D and I swapped; the probe took its width (I) and the experts refused it: check
    # passed with a warning blaming the user's module, and params() served the [E, D, I] tensors as [E, out, in]
    (InOutBank, ExpertLayout(gate="gate_proj", up="up_proj", down="down_proj"),
     ExpertLayout(gate="gate_proj", up="up_proj", down="down_proj", transposed=True, down_transposed=True),
     r"recomputes none of the experts' outputs; with transposed=True, down_transposed=True \(the rest as it is\) they "
     r"are recomputed, so params\(\) would serve other numbers"),
    # params() refused the wrong layout: check passed with a warning
    (StackedBank, ExpertLayout(gate_up="gate_up_proj", down="down_proj"),
     ExpertLayout(gate_up="gate_up_proj", down="down_proj", down_transposed=True, stacked=True),
     r"params\(\) cannot read the experts' weights with the entry's expert_layout .*gate_up_proj has shape \(144, 16\), "
     r"not \[E=6, \.\.\.\].*; with down_transposed=True, stacked=True \(the rest as it is\) they are recomputed: fix"),
], ids=["in-out-not-square", "stacked"])
def test_check_finds_an_expert_layout_whose_shapes_differ(registered, bank, wrong, right, message):
    hand = model()
    for layer in hand.layers:
        layer["moe"].experts = bank()
    registered(expert_layout=right)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped = moelens.wrap(hand)
        assert families.check(wrapped, IDS) == [moe.path for moe in wrapped.moes]
    experts, x = hand.layers[0]["moe"].experts, torch.randn(3, HIDDEN)
    params = wrapped.moes[0].params()
    by_hand = F.linear(F.silu(F.linear(x, params.gate[1])) * F.linear(x, params.up[1]), params.down[1])
    assert torch.allclose(by_hand, experts.expert_output(1, x), atol=1e-6)
    registered(expert_layout=wrong)
    with pytest.raises(FamilyError, match=message):
        families.check(moelens.wrap(hand), IDS)


def test_check_of_experts_called_with_keywords_of_their_own_says_what_it_cannot_read(registered):
    """check raised a bare KeyError('expert_indices'): the values it reads leniently were left out."""
    class KeywordBlock(Block):
        def forward(self, hidden):
            b, s, d = hidden.shape
            x = hidden.reshape(-1, d)
            logits, weights, index = self.router(x)
            routed = self.experts.forward(x, weights=weights, index=index)
            return (routed + self.shared(x)).reshape(b, s, d), logits.sum()

    hand = model_of(KeywordBlock)
    registered(block_classes=("KeywordBlock",))
    with pytest.raises(FamilyError, match=r"layers\.0\.moe: its expert_weights cannot be read, so the entry's selection "
                                          r"and scoring cannot be checked: .*call it with that argument"):
        families.check(moelens.wrap(hand), IDS)


@pytest.mark.parametrize("when", ["before_experts", "after_block"])
def test_check_of_a_shared_expert_at_the_wrong_time_blames_the_entry(registered, when):
    """check raised save_all's OrderError, whose advice (read before an earlier read or intervention) does not apply
    to a trace that reads nothing else; it names the value the model ran past and the times to choose from, not
    save_all's advice."""
    registered(shared=SharedExpert("shared", when=when))
    with pytest.raises(FamilyError, match=r"^the family entry does not describe what the model computes: check reads "
                                          r"the values of model\.layers\.0\.moe once, in the order the entry gives "
                                          rf"\(.* -> .*: SharedExpert\(when='{when}'\)\), and the model had already run "
                                          r"past model\.layers\.0\.moe\.\w+ when check asked for it, .*set "
                                          r"SharedExpert\.when to where the block calls it, one of \('before_router'") as caught:
        families.check(moelens.wrap(model()), IDS)
    assert "save_all" not in str(caught.value)


@pytest.mark.parametrize("selection", [False, True])
def test_check_of_a_model_running_its_blocks_out_of_layer_order_passes_the_right_entry(registered, selection):
    """Its one run reading every block in layer order was refused, and the entry blamed for the order (its
    SharedExpert.when; with a selection bias, its selection_op)."""
    class Reversed(Model):
        def forward(self, input_ids):
            hidden = self.embed(input_ids)
            for layer in reversed(self.layers):
                hidden = hidden + layer["moe"](hidden)[0]
            return hidden

    if selection:
        registered(scoring=Scoring("sigmoid", "score_topk", normalize=True, selection_bias="router.sel_bias",
                                   selection_op="choice_0"))
    else:
        registered()
    torch.manual_seed(0)
    hand = Reversed().eval()
    for layer in hand.layers if selection else ():
        layer["moe"].router = BiasRouter()
    wrapped = moelens.wrap(hand)
    assert families.check(wrapped, IDS) == ["model.layers.0.moe", "model.layers.1.moe"]


def test_an_entry_naming_the_block_as_its_experts_is_refused():
    """experts='' was registered, and check then failed with an OrderError."""
    with pytest.raises(FamilyError, match=r"experts='' names the block itself"):
        families.register(dataclasses.replace(ENTRY, name="hand_no_experts", experts=""))
    assert "hand_no_experts" not in [family.name for family in families.supported()]
    inline = families.register(dataclasses.replace(ENTRY, name="hand_inline", experts="", experts_call=False,
                                                   derived_routing=True))
    families.unregister(inline.name)  # a block computing its experts itself has no experts module to name


def test_a_token_id_past_a_plain_models_embedding_is_named(registered):
    """A plain torch model (no get_input_embeddings) raised torch's bare IndexError; its one nn.Embedding says how
    many ids it embeds."""
    registered()
    hand = model()
    with pytest.raises(IndexError):
        hand(torch.tensor([[1, 2, 55]]))  # the ground truth: the id is past the 50 rows
    with pytest.raises(moelens.MoelensError, match=r"token id 55 is outside the model's one nn\.Embedding \(taken for "
                                                   r"its token embedding\) \(50 rows"):
        with moelens.wrap(hand).trace(torch.tensor([[1, 2, 55]])):
            pass


def test_a_qualified_block_class_matches_that_class_alone(registered):
    """A bare class name matched every model's class of that name (another lab's sigmoid-scored Block was served
    with this entry's softmax); a qualified name names one class, and is matched before bare names."""
    other = type("Block", (Block,), {"__module__": "elsewhere.models", "__qualname__": "Block"})
    assert (other.__name__, Block.__name__) == ("Block", "Block")
    qualified = f"{Block.__module__}.{Block.__qualname__}"
    registered(block_classes=(qualified,))
    hand = model()
    assert families.for_block(hand.layers[0]["moe"]).name == "hand"
    assert families.for_block(other) is None
    registered(name="bare", block_classes=("Block",), model_types=("bare",))
    assert families.for_block(Block).name == "hand" and families.for_block(other).name == "bare"


def test_check_says_an_expert_layout_it_cannot_recompute_is_not_checked(registered):
    """Experts of an activation of their own: their layout is neither passed nor blamed, and the warning says so."""
    class TanhBank(ExpertBank):
        def expert_output(self, expert, x):
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, -1)
            return F.linear(torch.tanh(gate) * up, self.down_proj[expert])

    registered()
    hand = model()
    for layer in hand.layers:
        layer["moe"].experts = TanhBank()
    with pytest.warns(UserWarning, match=r"its expert_layout is not checked: no expert output is recomputed"):
        families.check(moelens.wrap(hand), IDS)


def test_unregister_given_the_entry_says_to_give_its_name(registered):
    """unregister(MY_FAMILY), the entry register returned, said no family of that name was registered."""
    entry = registered()
    with pytest.raises(FamilyError, match=r"unregister takes a family's name, got a Family entry \('hand'\): give "
                                          r"its name, unregister\('hand'\)"):
        families.unregister(entry)
    assert families.get("hand") is entry


def test_a_block_returning_a_dict_is_told_to_return_a_tuple(registered):
    """Each of the two errors sent the user to the other setting (output_index=None, then output_index=<index>)."""
    class DictBlock(Block):
        def forward(self, hidden):
            output, aux = super().forward(hidden)
            return {"hidden": output, "aux": aux}

    class DictModel(Model):
        def forward(self, input_ids):
            hidden = self.embed(input_ids)
            for layer in self.layers:
                hidden = hidden + layer["moe"](hidden)["hidden"]
            return hidden

    torch.manual_seed(0)
    hand = DictModel().eval()
    for layer in hand.layers:
        layer["moe"] = DictBlock()
    for combine in (Combine(output_index=0), Combine()):
        registered(block_classes=("DictBlock",), combine=combine)
        wrapped = moelens.wrap(hand)
        with pytest.raises(FamilyError, match=r"mlp_output: the module returned a dict \(keys \['hidden', 'aux'\]\), "
                                              r"and moelens reads .* not by key: make the block's forward return"):
            with wrapped.trace(IDS):
                wrapped.moes[0].mlp_output.save()


def test_a_quoted_flag_is_told_to_lose_its_quotes():
    with pytest.raises(FamilyError, match=r"Scoring.normalize must be True, False or an attribute reference .*got "
                                          r"'True'; True is written without quotes"):
        families.register(dataclasses.replace(ENTRY, name="quoted", scoring=Scoring("softmax", "score_topk",
                                                                                      normalize="True")))


def test_a_model_running_its_layers_sequence_first_is_refused_where_a_value_shows_it(registered):
    """A model that runs its layers on [seq, batch, hidden] (nn.Transformer's default layout) was served its block
    output as [seq, batch, ...], and its flat routing values as if batch-major: each token got another's values."""
    class SequenceFirst(Model):
        def forward(self, input_ids):
            hidden = self.embed(input_ids).transpose(0, 1)
            for layer in self.layers:
                hidden = hidden + layer["moe"](hidden)[0]
            return hidden.transpose(0, 1)

    registered()
    torch.manual_seed(0)
    wrapped = moelens.wrap(SequenceFirst().eval())
    with pytest.raises(FamilyError, match=r"mlp_output: the block's tensors are \[5, 2, 16\], whose first dim is "
                                               r"not the batch of 2 \(they are sequence-first, \[seq, batch, \.\.\.\]\)"
                                               r".*must run them batch-first"):
        with wrapped.trace(IDS):
            wrapped.moes[0].mlp_output.save()
    with pytest.raises(FamilyError, match=r"sequence-first"):
        families.check(wrapped, IDS)


def test_experts_in_a_module_list_are_told_to_be_called_as_one_module(registered):
    class ListBlock(Block):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))

    registered(block_classes=("ListBlock",))
    hand = model()
    for layer in hand.layers:
        layer["moe"] = ListBlock()
    with pytest.warns(UserWarning, match=r"blocks of family 'hand' hold a ModuleList at 'experts' .*Move the block's "
                                         r"loop over its experts into such a module's forward"):
        moelens.wrap(hand)


def test_a_misspelt_block_class_is_shown_beside_the_model_s_classes(registered):
    registered(block_classes=("BLock",))
    with pytest.warns(UserWarning, match=r"The block classes of the families you registered \('hand': BLock\) name no "
                                         r"module of this model, whose classes are Model, Block, Router, ExpertBank"):
        moelens.wrap(model())


def test_a_misspelt_block_class_is_shown_where_moelens_finds_blocks_of_no_family(registered):
    """Blocks calling transformers' experts are found without a family: that warning said to register one, which the
    user had done, under a misspelt class name."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    own = type("MyMoeBlock", (MixtralSparseMoeBlock,), {})
    hf = tiny_model("mixtral")
    for layer in hf.model.layers:
        layer.mlp.__class__ = own
    registered(block_classes=("MyMoeBlok",))
    with pytest.warns(UserWarning, match=r"moelens found MoE blocks of no registered family: model\.layers\.0\.mlp "
                                         r"\(MyMoeBlock\).* to serve their routing\. The block classes of the families "
                                         r"you registered \('hand': MyMoeBlok\) name no module of this model"):
        moelens.wrap(hf)


def test_a_router_without_readable_source_is_named_with_the_fix(registered):
    """A router class defined at the interactive prompt (or by exec, python -c): wrap raised nnsight's bare
    'callable source is unavailable'."""
    namespace = {"nn": nn, "F": F, "torch": torch, "Router": Router}
    exec("class PromptRouter(Router):\n    def forward(self, x):\n        logits = F.linear(x, self.weight)\n"
         "        weights, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)\n"
         "        return logits, weights / weights.sum(-1, keepdim=True), index\n", namespace)
    registered()
    hand = model()
    for layer in hand.layers:
        layer["moe"].router = namespace["PromptRouter"]()
    with pytest.raises(FamilyError, match=r"family 'hand': logits_op='F_linear_0' names an operation of "
                                          r"PromptRouter.forward, whose Python source cannot be read .*define the "
                                          r"class in a file or module"):
        moelens.wrap(hand)


class BiasRouter(Router):
    """Picks the top-k of sigmoid scores plus a selection bias (``choice``); weighs them by the scores alone."""

    def __init__(self) -> None:
        super().__init__()
        self.sel_bias = nn.Parameter(torch.linspace(0.6, -0.6, EXPERTS))

    def forward(self, x):
        logits = F.linear(x, self.weight)
        scores = logits.sigmoid()
        choice = scores + self.sel_bias
        _, index = torch.topk(choice, self.top_k, dim=-1)
        weights = scores.gather(-1, index)
        return logits, weights / weights.sum(-1, keepdim=True), index


class CastingBiasRouter(BiasRouter):
    """`BiasRouter` that casts its input first: an op before the logits op."""

    def forward(self, x):
        x = x.float()
        logits = F.linear(x, self.weight)
        scores = logits.sigmoid()
        _, index = torch.topk(scores + self.sel_bias, self.top_k, dim=-1)
        weights = scores.gather(-1, index)
        return logits, weights / weights.sum(-1, keepdim=True), index


def bias_model(router: type[Router] = BiasRouter) -> Model:
    hand = model()
    for layer in hand.layers:
        layer["moe"].router = router()
    return hand


@pytest.mark.parametrize(("selection_op", "selection_arg", "message"), [
    ("scores_0", None, r"its selection_scores, read where Scoring\(selection_op='scores_0', selection_arg=None\) names, "
                       r"are not what the router ranks by the entry \(its sigmoid scores plus router\.sel_bias; .*Name "
                       r"in Scoring\.selection_op .* The router's ops in its forward: .*choice_0"),
    ("torch_topk_0", None, r"its selection_scores cannot be read \(.*torch_topk_0\.output serves a topk.*\)\. Name in "
                           r"Scoring\.selection_op .*with Scoring\.selection_arg"),
], ids=["scores-without-the-bias", "topk-output"])
def test_check_finds_a_selection_op_that_reads_other_than_what_the_router_ranks(registered, selection_op,
                                                                                 selection_arg, message):
    """selection_op at the scores without the bias (scores_0, not choice_0) passed check: selection_scores served
    the scores, and force wrote +inf there, so the weights became NaN; at the top-k call without selection_arg it
    passed too and failed at the first force. check never read selection_scores."""
    hand = bias_model()
    sigmoid_bias = dict(score="sigmoid", select="score_topk", normalize=True, selection_bias="router.sel_bias")
    registered(scoring=Scoring(**sigmoid_bias, selection_op="choice_0"))
    right = moelens.wrap(hand)
    assert families.check(right, IDS) == [moe.path for moe in right.moes]
    block = hand.layers[0]["moe"]
    with torch.no_grad():
        ranked = torch.sigmoid(F.linear(hand.embed(IDS), block.router.weight)) + block.router.sel_bias
        with right.trace(IDS):
            served = right.moes[0].selection_scores.save()
    assert torch.allclose(served, ranked)  # the op the right entry names holds what the router ranks
    registered(scoring=Scoring(**sigmoid_bias, selection_op=selection_op, selection_arg=selection_arg))
    with pytest.raises(FamilyError, match=message):
        families.check(moelens.wrap(hand), IDS)
    registered(scoring=Scoring(**sigmoid_bias, selection_op="torch_topk_0", selection_arg=0))
    assert families.check(moelens.wrap(hand), IDS)


def test_check_names_a_selection_op_that_runs_before_the_logits_op(registered):
    """selection_op at an op before logits_op: check's own second run raised an OrderError about the order values
    are read in and shared.when, never naming selection_op."""
    hand = bias_model(CastingBiasRouter)
    sigmoid_bias = dict(score="sigmoid", select="score_topk", normalize=True, selection_bias="router.sel_bias")
    registered(scoring=Scoring(**sigmoid_bias, selection_op="x_float_0"))
    with pytest.raises(FamilyError, match=r"its selection_scores cannot be read \(the op Scoring\(selection_op="
                                          r"'x_float_0', selection_arg=None\) names runs before logits_op='F_linear_0' "
                                          r"in the router's forward.*\)\. Name in Scoring\.selection_op"):
        families.check(moelens.wrap(hand), IDS)


class CapacityBlock(Block):
    """Drops each expert's slots past its first 3 tokens (weight 0) before the experts call, as Switch's capacity."""

    def forward(self, hidden):
        b, s, d = hidden.shape
        x = hidden.reshape(-1, d)
        logits, weights, index = self.router(x)
        flat = index.reshape(-1)
        rank = (F.one_hot(flat, EXPERTS).cumsum(0) * F.one_hot(flat, EXPERTS)).sum(-1)  # each slot's place at its expert
        kept = weights * (rank <= 3).reshape(weights.shape)
        return (self.experts(x, index, kept) + self.shared(x)).reshape(b, s, d), logits.sum()


def test_check_of_a_block_that_changes_the_routers_weights_names_routing_from_router(registered):
    """No scoring fits the weights a capacity drop leaves: the error named Scoring and logits_op alone, never the
    setting that reads the weights at the router (with which check passes and the router's weights are served)."""
    hand = model_of(CapacityBlock)
    registered(block_classes=("CapacityBlock",))
    with pytest.raises(FamilyError, match=r"Or the block changes the router's weights before its experts call .* "
                                          r"routing_from_router=\(weights, indices\)"):
        families.check(moelens.wrap(hand), IDS)
    registered(block_classes=("CapacityBlock",), routing_from_router=(1, 2))
    fixed = moelens.wrap(hand)
    assert families.check(fixed, IDS)
    block = hand.layers[0]["moe"]
    _, weights, _ = block.router(hand.embed(IDS).reshape(-1, HIDDEN))
    with torch.no_grad(), fixed.trace(IDS):
        served = fixed.moes[0].expert_weights.save()
    torch.testing.assert_close(served.reshape(-1, TOP_K), weights.detach())


class TemperatureRouter(Router):
    """Scores its logits divided by a temperature: the linear op's output is not what it scores."""

    def forward(self, x):
        logits = F.linear(x, self.weight) / 0.5
        weights, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), index


def test_check_says_logits_op_may_name_another_tensor_than_the_router_scores(registered):
    """logits_op at the linear op of a router that scores it divided by a temperature: check said only that no
    softmax / sigmoid scoring gives the weights, never that logits_op may name the wrong tensor, nor which ops follow."""
    hand = model()
    for layer in hand.layers:
        layer["moe"].router = TemperatureRouter()
    registered()
    with pytest.raises(FamilyError, match=r"no softmax / sigmoid scoring .* gives them; or the Scoring is right and "
                                          r"logits_op is wrong: logits_op='F_linear_0' may name another tensor than "
                                          r"the one the router scores .* The router's ops in its forward: F_linear_0 "
                                          r"\(logits_op now\), logits_0, logits_softmax_0"):
        families.check(moelens.wrap(hand), IDS)
    registered(logits_op="logits_softmax_0")  # the scores: the ops before it are listed, and the values told scores
    with pytest.raises(FamilyError, match=r"The values served as router_logits all lie in \[0, 1\], summing to 1 in "
                                          r"each token: a softmax's scores, not logits; name the op before the score "
                                          r"function as logits_op\. The router's ops in its "
                                          r"forward: F_linear_0, logits_0, logits_softmax_0 \(logits_op now\)"):
        families.check(moelens.wrap(hand), IDS)
    registered(logits_op="logits_0")  # the op the router scores: the same check passes
    fixed = moelens.wrap(hand)
    assert families.check(fixed, IDS)
    block = hand.layers[0]["moe"]
    with torch.no_grad(), fixed.trace(IDS):
        logits = fixed.moes[0].router_logits.save()
    assert torch.allclose(logits, F.linear(hand.embed(IDS), block.router.weight) / 0.5)


class SeparateBank(ExpertBank):
    """SwiGLU experts with separate ``w_gate`` / ``w_up`` / ``w_down`` parameters."""

    def __init__(self) -> None:
        super().__init__()
        del self.gate_up_proj, self.down_proj
        self.w_gate = nn.Parameter(torch.randn(EXPERTS, INTERMEDIATE, HIDDEN) * 0.3)
        self.w_up = nn.Parameter(torch.randn(EXPERTS, INTERMEDIATE, HIDDEN) * 0.3)
        self.w_down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.3)

    def expert_output(self, expert, x):
        return F.linear(F.silu(F.linear(x, self.w_gate[expert])) * F.linear(x, self.w_up[expert]), self.w_down[expert])


class UpFirstBank(ExpertBank):
    """Experts whose fused ``gate_up_proj`` holds the up rows first, then the gate rows."""

    def expert_output(self, expert, x):
        up, gate = F.linear(x, self.gate_up_proj[expert]).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])


@pytest.mark.parametrize(("bank", "layout", "gate", "message"), [
    (SeparateBank, ExpertLayout(gate="w_up", up="w_gate", down="w_down"), lambda bank: bank.w_gate,
     r"with gate='w_gate', up='w_up' \(the rest as it is\) they are recomputed.*fix the ExpertLayout"),
    (UpFirstBank, ExpertLayout(gate_up="gate_up_proj", down="down_proj"), lambda bank: bank.gate_up_proj[:, INTERMEDIATE:],
     r"with the up rows of 'gate_up_proj' taken before its gate rows, they are recomputed.*No ExpertLayout field says "
     r"that a fused gate_up holds the up rows first.*leave expert_layout out of the entry"),
], ids=["separate-names-swapped", "fused-up-rows-first"])
def test_check_finds_gate_and_up_swapped_in_the_expert_layout(registered, bank, layout, gate, message):
    """An ExpertLayout naming w_up as the gate and w_gate as the up (or a fused parameter holding the up rows first):
    check only warned that the layout was not checked, and params() served the up weights as the gate."""
    hand = model()
    for block in hand.layers:
        block["moe"].experts = bank()
    registered(expert_layout=layout)
    wrapped = moelens.wrap(hand)
    experts = hand.layers[0]["moe"].experts
    assert not torch.equal(wrapped.moes[0].params().gate, gate(experts))  # what the wrong layout serves as the gate
    with pytest.raises(FamilyError, match=message):
        families.check(wrapped, IDS)


class ModeBlock(Block):
    """A block that sums its routed and shared output, and carries a word for it no Combine mode knows."""

    combination = "mean"


def test_a_combine_mode_reference_reading_an_unknown_word_is_refused(registered):
    """Combine(mode="block.combination") reading "mean" was taken for "sum" with no word: only the exact "average"
    halved the sum, so a misspelt or unknown mode read from the block passed check and served a sum."""
    registered(block_classes=("ModeBlock",), combine=Combine(output_index=0, mode="block.combination"))
    hand = model_of(ModeBlock)
    with pytest.raises(FamilyError, match=r"family 'hand': Combine\.mode='block\.combination' reads 'mean' from "
                                          r"ModeBlock, which is not one of \('sum', 'average'\)"):
        families.check(moelens.wrap(hand), IDS)
    for layer in hand.layers:
        layer["moe"].combination = "sum"  # what the block computes: the same reference then passes
    assert families.check(moelens.wrap(hand), IDS)


def test_a_misspelt_selection_bias_without_a_selection_op_warns_and_route_around_refuses(registered):
    """selection_bias="router.sel_bias_typo" with no selection_op: wrap said nothing (it warned only with a
    selection_op), and route_around wrote a -inf logit the router's own bias still outranked, leaving the expert
    chosen without a word. Ground truth: the router module itself, at a -inf logit for expert 0, still picks it."""
    hand = bias_model()
    block = hand.layers[0]["moe"]
    with torch.no_grad():
        logits = F.linear(hand.embed(IDS), block.router.weight)
        logits[..., 0] = float("-inf")
        picked = (logits.sigmoid() + block.router.sel_bias).topk(TOP_K, dim=-1).indices
    assert (picked == 0).any()  # the bias alone picks expert 0: a silent route_around would leave it chosen
    registered(scoring=Scoring("sigmoid", "score_topk", normalize=True, selection_bias="router.sel_bias_typo"))
    with pytest.warns(UserWarning, match=r"family 'hand': selection_bias 'router\.sel_bias_typo' names nothing on "
                                         r"block layers\.0\.moe .*route_around refuses.*wrap the model again"):
        wrapped = moelens.wrap(hand)
    with pytest.raises(moelens.WriteError, match=r"route_around'\): model\.layers\.0\.moe \(hand\): Scoring\."
                                                 r"selection_bias='router\.sel_bias_typo' names nothing on the block"):
        with wrapped.trace(IDS):
            moelens.ablate(wrapped.moes[0], 0, "route_around")


@pytest.mark.parametrize(("groups", "read"), [
    (("router.topk_group", "router.num_group"), r"n_group=2, topk_group=4"),
    (("router.three", "router.topk_group"), r"n_group=3, topk_group=2 on DeepseekV3MoE \(E=8 experts\)"),
], ids=["topk_group-above-n_group", "n_group-not-dividing-E"])
def test_groups_no_router_can_keep_are_refused_naming_the_setting(groups, read):
    """Scoring.groups reading (n_group, topk_group) swapped, or an n_group that does not divide E: check failed with
    torch's "selected index k out of range" or an einops shape error, naming neither the setting nor the values."""
    hf = tiny_model("deepseek_v3")
    for layer in hf.model.layers:
        router = getattr(layer.mlp, "gate", None)
        if router is not None:
            router.three = 3
            assert (router.num_group, router.topk_group, hf.config.n_routed_experts) == (4, 2, 8)
    entry = families.get("deepseek_v3")
    families.register(dataclasses.replace(entry, name="ds3_groups",
                                          scoring=dataclasses.replace(entry.scoring, groups=groups)), replace=True)
    try:
        with pytest.raises(FamilyError, match=rf"family 'ds3_groups': Scoring\.groups=.* reads {read}.*expected whole "
                                              r"numbers with 1 <= topk_group <= n_group and n_group dividing E"):
            families.check(moelens.wrap(hf), **tiny_inputs(hf))
    finally:
        families.unregister("ds3_groups")


@pytest.mark.parametrize(("bias", "given"), [
    ("router.weight", r"a Parameter of shape \(6, 16\)"), ("router.top_k", r"int 2")], ids=["matrix", "int"])
def test_a_selection_bias_naming_no_bias_per_expert_is_refused_naming_the_setting(registered, bias, given):
    """Scoring.selection_bias naming the router's [E, D] weight or its top_k: check and route_around failed with
    torch's "size of tensor a must match" or "'int' object has no attribute 'detach'"."""
    registered(scoring=Scoring("sigmoid", "score_topk", normalize=True, selection_bias=bias))
    message = rf"family 'hand': Scoring\.selection_bias='{bias}' gives {given} on Block, not a bias per expert: " \
              r"expected a tensor of shape \(6,\)"
    with pytest.raises(FamilyError, match=message):
        families.check(moelens.wrap(bias_model()), IDS)
    wrapped = moelens.wrap(bias_model())
    with pytest.raises(FamilyError, match=message):
        with wrapped.trace(IDS):
            moelens.ablate(wrapped.moes[0], 0, "route_around")


def test_a_routed_scale_naming_a_tensor_is_refused_naming_the_setting(registered):
    """Combine.routed_scale naming a [6] tensor: check failed with torch's "size of tensor a must match"."""
    registered(combine=Combine(output_index=0, routed_scale="router.sel_bias"))
    with pytest.raises(FamilyError, match=r"family 'hand': Combine\.routed_scale='router\.sel_bias' gives a Parameter "
                                          r"of shape \(6,\) on Block, not a number"):
        families.check(moelens.wrap(bias_model()), IDS)


@pytest.mark.parametrize(("changes", "message"), [
    ({"scoring": Scoring("softmax", normalize=True, normalize_min=-1.0)},
     r"Scoring\.normalize_min must be None, a finite number >= 0 or an attribute reference .*got -1\.0"),
    ({"scoring": Scoring("softmax", normalize=True, normalize_min=float("nan"))}, r"Scoring\.normalize_min must be "
                                                                                  r"None, a finite number >= 0 .*got nan"),
    ({"scoring": Scoring("softmax", normalize=True, normalize_min="norm_min")},
     r"Scoring\.normalize_min must be .*got 'norm_min'; a plain word is no reference"),
    ({"expert_gate": moelens.families.ExpertGate("swiglu")}, r"ExpertGate kind 'swiglu' is not one of \('glu',"),
    ({"shared": SharedExpert("")}, r"SharedExpert\(module=''\) names no module"),
])
def test_settings_the_docs_say_register_refuses_are_refused(changes, message):
    """normalize_min=-1, nan or a plain word, ExpertGate("swiglu") and SharedExpert(module="") were registered
    (the docs say register refuses them); they failed later, or served nothing, far from the cause."""
    with pytest.raises(FamilyError, match=rf"family 'hand_kinds': {message}"):
        families.register(dataclasses.replace(ENTRY, name="hand_kinds", **changes))
    assert "hand_kinds" not in {family.name for family in families.supported()}


def test_check_of_a_model_wrapped_before_its_family_was_registered_says_to_wrap_again(registered):
    """A model wrapped before register: check said "no MoE block that runs on every input", as if its blocks ran on
    some inputs only; it has no Moe at all, and wrapping it again serves them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wrap warns that it finds no MoE block
        wrapped = moelens.wrap(model())
    registered()
    assert wrapped.moes == []
    with pytest.raises(FamilyError, match=r"no block of this model is served as a Moe .*if its family was registered "
                                          r"after wrapping, wrap it again \(moelens\.wrap\(model\._module\)\)"):
        families.check(wrapped, IDS)
    assert families.check(moelens.wrap(wrapped._module), IDS) == ["model.layers.0.moe", "model.layers.1.moe"]


def test_check_names_a_normalisation_floor_the_router_does_not_apply(registered):
    """Scoring.normalize_min=5.0 on a router that renormalises by the plain sum: check tried every candidate scoring
    with the entry's floor and never named normalize_min, saying no scoring gives the weights."""
    registered(scoring=Scoring("softmax", "score_topk", normalize=True, normalize_min=5.0))
    with pytest.raises(FamilyError, match=r"the weights its experts got are not what the scoring of family 'hand' "
                                          r"gives .*: with normalize_min=None \(the entry's other settings as they are\)"):
        families.check(moelens.wrap(model()), IDS)
    hand = model()
    for layer in hand.layers:
        layer["moe"].router = TemperatureRouter()  # no scoring of the linear op's output fits
    with pytest.raises(FamilyError, match=r"no softmax / sigmoid scoring .* gives them; check normalize_min too"):
        families.check(moelens.wrap(hand), IDS)
    registered()  # the router's own scoring, without a floor, passes
    assert families.check(moelens.wrap(model()), IDS)


class LoopBlock(nn.Module):
    """A block that loops over its experts inline (no experts call): top-1 of a softmax, the weight the chosen
    probability (not renormalised), as Switch Transformers route."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS)])

    def forward(self, hidden):
        b, s, d = hidden.shape
        x = hidden.reshape(-1, d)
        weight, index = self.router(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for expert, module in enumerate(self.experts):
            chosen = index == expert
            out[chosen] = module(x[chosen]) * weight[chosen, None]
        return out.reshape(b, s, d)


class LoopModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, HIDDEN)
        self.layers = nn.ModuleList([nn.ModuleDict({"moe": LoopBlock()})])

    def forward(self, input_ids):
        return self.layers[0]["moe"](self.embed(input_ids))


def test_derived_routing_follows_the_entrys_scoring_and_refuses_what_it_cannot_rank(registered):
    """derived_routing served the score of the top-k logits alone (llama4's routing) whatever the entry said: a
    Switch router's weights (the softmax over every expert, top-1, not renormalised) came back 1.0 for every token.
    Ground truth: the block's router run on the block's input, softmax and max by hand. An entry whose router
    ranks more than its logits (a selection bias, groups) is refused at register."""
    torch.manual_seed(0)
    net = LoopModel().eval()
    registered(block_classes=("LoopBlock",), experts="", experts_call=False, derived_routing=True,
               scoring=Scoring("softmax", "score_topk", normalize=False), top_k=1, num_experts=EXPERTS, shared=None,
               combine=Combine(), expert_layout=None)
    wrapped = moelens.wrap(net)
    with wrapped.trace(IDS):
        weights = wrapped.moes[0].expert_weights.save()
        indices = wrapped.moes[0].expert_indices.save()
    with torch.no_grad():  # the router the block runs, on the block's input
        expected, chosen = net.layers[0]["moe"].router(net.embed(IDS).reshape(-1, HIDDEN)).softmax(-1).max(-1)
    torch.testing.assert_close(weights.reshape(-1), expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(indices.reshape(-1), chosen)
    assert (weights < 0.99).all()  # not the score of the chosen logit alone (1.0 for a softmax over one)
    for changes, named in (({"selection_bias": "router.bias"}, "selection_bias='router.bias'"),
                           ({"groups": ("router.n_group", "router.topk_group"), "select": "group_topk"},
                            "select='group_topk'")):
        with pytest.raises(FamilyError, match=rf"derived_routing=True recomputes the weights and indices as the top-k "
                                              rf"of the logits.*ranks more than its logits \({named}"):
            families.register(dataclasses.replace(ENTRY, name="derived_bias", derived_routing=True, experts="",
                                                  experts_call=False,
                                                  scoring=dataclasses.replace(ENTRY.scoring, **changes)))


class LoopSharedBlock(LoopBlock):
    """`LoopBlock` plus a shared expert, added to its inline experts' sum."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden):
        return super().forward(hidden) + self.shared(hidden)


def test_an_inline_block_with_a_shared_expert_refuses_routed_output(registered):
    """An inline block (experts='') with a shared expert served its whole output (routed plus shared) as
    routed_output, and a write of it replaced the shared part too. routed_output is refused there, and so are the
    per-slot values, each saying the block computes its experts inline; mlp_output, shared_expert_output and the
    routing are served and check passes. Ground truth: the block's shared expert and forward called on its input."""
    torch.manual_seed(0)
    net = LoopModel().eval()
    net.layers[0]["moe"] = LoopSharedBlock().eval()
    registered(block_classes=("LoopSharedBlock",), experts="", experts_call=False, derived_routing=True,
               scoring=Scoring("softmax", "score_topk", normalize=False), top_k=1, num_experts=EXPERTS,
               shared=SharedExpert("shared", when="after_experts"), combine=Combine(), expert_layout=None)
    wrapped = moelens.wrap(net)
    for name in ("routed_output", "expert_outputs"):
        with pytest.raises(ValueUnavailable, match=rf"{name} cannot be served: the block computes its experts "
                                                   r"inline.*Read mlp_output and shared_expert_output"):
            with wrapped.trace(IDS):
                getattr(wrapped.moes[0], name).save()
    with torch.no_grad(), wrapped.trace(IDS):
        moe = wrapped.moes[0]
        shared = moe.shared_expert_output.save()
        output = moe.mlp_output.save()
    block, hidden = net.layers[0]["moe"], net.embed(IDS)
    with torch.no_grad():
        torch.testing.assert_close(shared, block.shared(hidden), atol=0, rtol=0)
        torch.testing.assert_close(output, block(hidden), atol=0, rtol=0)
    assert families.check(wrapped, IDS) == ["model.layers.0.moe"]
    with pytest.raises(FamilyError, match=r"experts='' with experts_call=False is a block that computes its experts "
                                          r"inline.*set derived_routing=True .* or routing_from_router"):
        families.register(dataclasses.replace(ENTRY, name="inline_underived", experts="", experts_call=False))


class LoopLayer(nn.Module):
    """A decoder layer holding an inline `LoopBlock` and, beside it, a shared expert added after the block (granite's
    on_layer shared MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = LoopBlock()
        self.shared = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden):
        return self.moe(hidden) + self.shared(hidden)


def test_an_inline_block_with_a_shared_expert_on_its_layer_serves_routed_output(registered):
    """The refusal of routed_output on an inline block with a shared expert also hit a shared expert on the decoder
    layer (on_layer=True), which the block's output does not hold. Ground truth: the block called on its input."""
    torch.manual_seed(0)
    net = LoopModel().eval()
    net.layers = nn.ModuleList([LoopLayer().eval()])
    net.forward = lambda input_ids: net.layers[0](net.embed(input_ids))
    registered(block_classes=("LoopBlock",), block_attr="moe", experts="", experts_call=False, derived_routing=True,
               scoring=Scoring("softmax", "score_topk", normalize=False), top_k=1, num_experts=EXPERTS,
               shared=SharedExpert("shared", on_layer=True, when="after_block"), combine=Combine(), expert_layout=None)
    wrapped = moelens.wrap(net)
    with torch.no_grad(), wrapped.trace(IDS):
        routed = wrapped.moes[0].routed_output.save()
    with torch.no_grad():
        torch.testing.assert_close(routed, net.layers[0].moe(net.embed(IDS)), atol=0, rtol=0)


def test_a_plain_torch_model_wrapped_with_a_tokenizer_is_refused_saying_to_trace_token_ids():
    """wrap(plain_model, tokenizer=...) failed deep inside transformers' pipeline ('Model' object has no attribute
    'device', then 'can_generate'); it is refused naming what the pipeline reads, and the model wraps without it."""
    from groundtruth import ascii_tokenizer

    with pytest.raises(moelens.MoelensError, match=r"wrap\(tokenizer=\.\.\.\) needs a transformers model .* got Model, "
                                                   r"which has no device or can_generate: wrap it without "
                                                   r"the tokenizer and trace token ids"):
        moelens.wrap(model(), tokenizer=ascii_tokenizer())
    wrapped = moelens.wrap(model())
    with wrapped.trace(IDS):
        output = wrapped.output.save()
    assert output.shape == (*IDS.shape, HIDDEN)


@pytest.mark.parametrize("gated_op", [None, "shared_expert_output_0"])
def test_check_of_an_entry_that_misses_the_shared_experts_gate_says_so_with_the_blocks_ops(gated_op):
    """An entry leaving out qwen2_moe's sigmoid gate on the shared expert (or reading the shared output before it) got
    only "check Combine ... and SharedExpert (the module, gate, gated_op)". Now check finds the per-token factor
    between the served shared output and what the block adds (ground truth: the block's own gate,
    sigmoid(shared_expert_gate(x)), by hand) and lists the block's ops to name gated_op from."""
    qwen = families.get("qwen2_moe")
    spec = SharedExpert("shared_expert", when="before_router", gate="shared_expert_gate" if gated_op else None,
                        gated_op=gated_op)  # the block calls its shared expert first, gates it after the experts
    families.register(dataclasses.replace(qwen, name="qwen_ungated", shared=spec), replace=True)
    try:
        hf = tiny_model("qwen2_moe")
        truth = copy.deepcopy(hf)
        wrapped = moelens.wrap(hf)
        ids = tiny_inputs(hf)["input_ids"]
        block = truth.get_submodule(wrapped.moes[0].path.removeprefix("model."))
        inputs = []
        block.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
        with torch.no_grad():  # the factor is the block's own gate on its input
            truth(input_ids=ids)
            gate = torch.sigmoid(block.shared_expert_gate(inputs[0]))
        read_at = f"gated_op='{gated_op}' reads it before that factor" if gated_op else "the entry names no gate"
        with pytest.raises(FamilyError, match=rf"is not the block's output .* The block's output is routed_output plus "
                                              rf"shared_expert_output times a factor per token \(from "
                                              rf"{float(gate.min()):.3g} to {float(gate.max()):.3g}: a gate\), and "
                                              rf"{read_at}: name the gate module .* The block's ops: "
                                              r".*shared_expert_output_1"):
            families.check(wrapped, ids)
    finally:
        families.unregister("qwen_ungated")


def test_generate_on_a_plain_torch_model_says_it_is_no_transformers_model(registered):
    """model.generate on a plain torch MoE model said it "has no language-model head" (load it with its head),
    whatever its head: it is no transformers model, which generate drives; a transformers base model keeps that
    advice."""
    registered()
    with pytest.raises(moelens.MoelensError, match=r"model\.generate: Model is no transformers model \(no generate "
                                                   r"method to drive\), so model\.generate cannot run it: trace it a "
                                                   r"token at a time"):
        moelens.wrap(model()).generate(IDS, max_new_tokens=2)
