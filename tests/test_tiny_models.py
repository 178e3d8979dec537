"""Every tiny MoE family builds, runs a forward, and gives the same output under every experts implementation."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from moelens import families
from moelens.errors import FamilyError
from moelens.testing import (
    CALLED_SEVERAL_TIMES,
    EXPERTS_IMPLEMENTATIONS,
    FAMILIES,
    MOE_EVERY_LAYER,
    NOT_DECORATED,
    TINY_OVERRIDES,
    UNBUILDABLE,
    tiny_config,
    tiny_inputs,
    tiny_model,
)

# Config fields that switch an optional shared expert on (the tiny configs turn them on).
_SHARED_FIELDS = (
    "n_shared_experts",
    "num_shared_experts",
    "moe_num_shared_experts",
    "shared_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_experts_intermediate_size",
    "moe_shared_expert_intermediate_size",
)
_UNDECORATED_EXPERTS = ("Llama4TextExperts", "DbrxExperts", "LongcatFlashExperts", "Step3p7Experts")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread (and far faster when the machine is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def _model(family: str, impl: str | None = None):
    return tiny_model(family, experts_implementation=impl)


def _forward(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(**tiny_inputs(model))
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _experts_modules(model) -> list[torch.nn.Module]:
    return [
        m
        for m in model.modules()
        if (hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate")) or type(m).__name__ in _UNDECORATED_EXPERTS
    ]


def test_family_tables_are_consistent():
    assert set(FAMILIES) == set(TINY_OVERRIDES) - set(UNBUILDABLE) - set(CALLED_SEVERAL_TIMES)
    assert set(EXPERTS_IMPLEMENTATIONS) == set(FAMILIES)
    assert set(MOE_EVERY_LAYER) <= set(TINY_OVERRIDES)
    # 64 decorated folders + 4 undecorated (llama4, dbrx, longcat_flash, step3p7) in transformers 5.23;
    # 5.24 adds hy_v4_vl, lara_mini and inkling2_loop (tested on its own, tests/test_looped_blocks.py);
    # 5.25 adds ergo, kolibri1_1 and minicpm5_moe (and decorates longcat_flash's and step3p7's experts)
    new = {"hy_v4_vl", "lara_mini", "inkling2_loop", "ergo", "kolibri1_1", "minicpm5_moe"}
    assert set(TINY_OVERRIDES) == set(FAMILIES) | set(UNBUILDABLE) | set(CALLED_SEVERAL_TIMES)
    assert len(TINY_OVERRIDES) == 74 and set(UNBUILDABLE) <= new
    for family, impls in EXPERTS_IMPLEMENTATIONS.items():
        want = ("eager",) if family in NOT_DECORATED else ("eager", "batched_mm", "grouped_mm")
        assert impls == want, family


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_all_experts_implementations(family: str):
    model = _model(family)
    assert not model.training
    reference = _forward(model)
    assert reference.shape[:2] == (2, 5)
    assert torch.isfinite(reference).all(), family
    for impl in EXPERTS_IMPLEMENTATIONS[family]:
        other = _model(family, impl)
        if family not in NOT_DECORATED:
            assert other.config._experts_implementation == impl
        out = _forward(other)
        assert torch.isfinite(out).all(), (family, impl)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5, msg=f"{family}: {impl} vs default")


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_sizes_and_layout(family: str):
    model = _model(family)
    experts = _experts_modules(model)
    assert experts, family
    for module in experts:  # longcat_flash: 8 experts with weights (and 2 zero-compute ones)
        assert getattr(module, "num_experts", getattr(module, "num_routed_experts", None)) == 8, family
    # counted from the modules: longcat_flash's config counts 2 attention sublayers per layer
    n_layers = 1 + max(_layer_index(name) for name, _ in model.named_modules() if re.search(r"(layers|blocks)\.\d", name))
    assert n_layers == 4
    moe_layers = {_layer_index(name) for name, m in model.named_modules() if m in experts}
    if family in MOE_EVERY_LAYER:
        assert moe_layers == {0, 1, 2, 3}, family
    else:
        assert len(moe_layers) >= 2 and len(moe_layers) < 4, (family, moe_layers)


def _layer_index(name: str) -> int:
    parts = name.split(".")
    for prev, part in zip(parts, parts[1:]):
        if prev in ("layers", "blocks") and part.isdigit():
            return int(part)
    raise AssertionError(name)


@pytest.mark.parametrize("family", FAMILIES)
def test_optional_shared_expert_is_on(family: str):
    cfg = tiny_config(family)
    if not any(getattr(cfg, f, None) for f in _SHARED_FIELDS if _has_field(cfg, f)):
        pytest.skip("no optional shared expert in this family")
    names = [n for n, _ in _model(family).named_modules() if "shared" in n.rsplit(".", 1)[-1]]
    assert names, family


def _has_field(cfg, name: str) -> bool:
    try:
        return hasattr(cfg, name)
    except Exception:  # noqa: BLE001 - heterogeneous configs refuse some global reads
        return False


@pytest.mark.parametrize("family", FAMILIES)
def test_no_all_zero_weights_and_biased_selection(family: str):
    model = _model(family)
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0].rsplit(".", 1)[-1].lower()
        if p.is_floating_point() and p.numel() and not any(h in owner for h in ("norm", "ln_", "layernorm")):
            assert p.any(), f"{family}: {name} is all zeros"
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in tensors.items():
        if name.rsplit(".", 1)[-1] in ("e_score_correction_bias", "expert_bias", "balancing_biases"):
            assert t.any() and t.abs().max() < 0.1, f"{family}: {name}"


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_is_not_degenerate(family: str):
    model = _model(family)
    seen: list[torch.Tensor] = []
    if family == "longcat_flash":  # from transformers 5.25 the block hands zero-compute slots on: the router's choice
        handles = [m.register_forward_hook(lambda mod, args, output: seen.append(output[2]))
                   for m in model.modules() if type(m).__name__ == "LongcatFlashTopkRouter"]
    else:
        handles = [
            m.register_forward_pre_hook(lambda mod, args: seen.append(args[1]) if len(args) >= 3 else None)
            for m in _experts_modules(model)
        ]
    try:
        _forward(model)
    finally:
        for h in handles:
            h.remove()
    if family == "llama4":  # experts(hidden.repeat(E) * scores): no indices argument
        assert not seen
        return
    assert seen, family
    for idx in seen:
        assert idx.dtype == torch.int64 and idx.dim() == 2
        # the k experts of a token are distinct (a zero hash table would send every slot to expert 0)
        assert all(len(set(row.tolist())) == idx.shape[1] for row in idx), family
    assert max(int(idx.unique().numel()) for idx in seen) >= 3, family


def test_seeding_is_deterministic():
    a = tiny_model("mixtral", seed=1).state_dict()
    b = tiny_model("mixtral", seed=1).state_dict()
    c = tiny_model("mixtral", seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert torch.equal(tiny_inputs(_model("mixtral"))["input_ids"], tiny_inputs(_model("mixtral"))["input_ids"])


def test_overrides_and_errors():
    cfg = tiny_config("qwen3_moe", num_experts=4, mlp_only_layers=[])
    assert cfg.num_experts == 4 and cfg.hidden_size == 32
    model = tiny_model("qwen3_moe", num_experts=4, mlp_only_layers=[], dtype=torch.float32)
    assert all(m.num_experts == 4 for m in _experts_modules(model))
    with pytest.raises(KeyError):
        tiny_config("not_a_family")
    mixtral = families.get("mixtral")  # supported() lists Family entries: one failed as an unhashable key
    listed = families.supported()
    assert mixtral in listed and repr(listed).startswith(f"[{len(listed)} families: ")  # it printed 85,000 characters
    assert "mixtral" in repr(listed) and len(repr(listed)) < 40 * len(listed)
    first = listed[:3]  # a slice printed each entry's page of settings
    assert repr(first) == f"[3 families: {', '.join(family.name for family in listed[0:3:1])}]" and first == listed[0:3]
    assert listed[0] is families.get(listed[0].name)
    assert listed["mixtral"] is mixtral and first[listed[1].name] is listed[1]  # by name, as it prints and `in` asks
    with pytest.raises(FamilyError, match=r"no family named 'mixtral' in this list of 3; print the list"):
        first["mixtral"]
    for given in (mixtral, tiny_config("mixtral")):
        with pytest.raises(TypeError, match=rf"tiny models are built by family name \(a str such as 'mixtral'\), got "
                                            rf"{type(given).__name__}: pass its name"):
            tiny_model(given)


def test_a_misspelt_override_is_refused_not_left_as_a_stray_attribute():
    """A config keeps any keyword as an attribute: ``num_local_expert=4`` built 8 experts without a word."""
    assert tiny_config("mixtral").num_local_experts == 8
    with pytest.raises(TypeError, match=r"MixtralConfig has no field 'num_local_expert' "
                                        r"\(did you mean 'num_local_experts'\?\)"):
        tiny_model("mixtral", num_local_expert=4)
    # what every transformers config takes besides its fields stays accepted
    assert tiny_config("mixtral", attn_implementation="eager", output_attentions=True)._attn_implementation == "eager"


@pytest.mark.parametrize("size", [{"batch": 0}, {"seq": 0}, {"seq": -1}, {"batch": 2.0}, {"seq": True}])
def test_tiny_inputs_refuse_sizes_that_are_no_positive_int(size):
    """An empty batch reached the model as a shape error deep in its forward; -1 as torch's negative dimension."""
    (name, value), = size.items()
    with pytest.raises(ValueError, match=rf"tiny_inputs: {name} must be a positive int .* got {value!r}"):
        tiny_inputs(_model("mixtral"), **size)


def test_tiny_inputs_take_numpy_and_tensor_integers():
    assert tiny_inputs(_model("mixtral"), batch=np.int64(3), seq=torch.tensor(4))["input_ids"].shape == (3, 4)


@pytest.mark.parametrize("seed", [1.5, True, "1"])
def test_a_seed_that_is_no_int_is_refused(seed):
    """torch took 1.5 and True as seed 1, and the seeded re-draws of zero weights read the seed as text: a model
    equal to no seed's (the truth: tiny_model('afmoe', seed=1)), built without a word."""
    with pytest.raises(TypeError, match=rf"tiny_model: seed must be an int, got {type(seed).__name__}"):
        tiny_model("afmoe", seed=seed)
    with pytest.raises(TypeError, match=rf"tiny_inputs: seed must be an int, got {type(seed).__name__}"):
        tiny_inputs(_model("mixtral"), seed=seed)
    same = tiny_model("afmoe", seed=np.int64(1)).state_dict()
    assert all(torch.equal(same[name], value) for name, value in tiny_model("afmoe", seed=1).state_dict().items())


def test_tiny_inputs_refuse_what_is_no_model():
    with pytest.raises(TypeError, match=r"tiny_inputs: model must be a transformers model \(tiny_model\(family\)\), "
                                        r"got str 'mixtral'"):
        tiny_inputs("mixtral")
