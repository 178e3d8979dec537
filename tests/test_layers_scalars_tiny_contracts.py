"""Contracts of ``model.layers[i]``, the scalar/flag helpers, the tiny model builders and ``moelens demo``.

The truths are independent of the code under test: the Hugging Face model's own decoder layers (by module
identity), Python/numpy facts about a value (True/False vs text or numbers), the transformers classes' own
attributes (the ``use_experts_implementation`` decorator's forward, ``_keep_in_fp32_modules_strict``), the
tiny config's own pad/bos/eos ids, and moelens-tiny's held-out file on disk (rows found by their contents).
"""

from __future__ import annotations

import copy
import importlib
import os
import json

import numpy as np
import pytest
import torch

import moelens
from moelens.analysis import cli as analysis_cli
from moelens.errors import FamilyError, MoelensError
from moelens.scalars import as_int, as_lone_int, as_real, check_flag, scalar
from moelens.testing import (
    FAMILIES,
    NOT_DECORATED,
    TINY_OVERRIDES,
    model_class,
    tiny_config,
    tiny_inputs,
    tiny_model,
)


@pytest.fixture(scope="module")
def mixtral():
    hf = tiny_model("mixtral")
    return hf, moelens.wrap(hf)


# -- model.layers[i] -------------------------------------------------------------------------------


def test_every_negative_layer_down_to_minus_count_is_the_hf_layer(mixtral):
    hf, wrapped = mixtral
    layers = hf.model.layers
    count = len(layers)
    for i in range(-count, count):
        assert wrapped.layers[i]._module is layers[i], i
    assert wrapped.layers[-count]._module is layers[0]


def test_a_zero_d_numpy_or_tensor_layer_is_taken_and_a_one_element_list_like_is_refused(mixtral):
    hf, wrapped = mixtral
    layers = hf.model.layers
    assert wrapped.layers[np.array(2)]._module is layers[2]
    assert wrapped.layers[torch.tensor(-1)]._module is layers[-1]
    assert wrapped.layers[np.int32(-2)]._module is layers[-2]
    # a one-element tensor/array with an axis is a list of layers elsewhere in moelens, never one layer here
    for key in (torch.tensor([1]), np.array([1]), torch.tensor(1.0), np.float64(1.0), np.bool_(True), None):
        with pytest.raises(moelens.LayerIndexError, match=r"expected an integer layer"):
            wrapped.layers[key]


def test_a_slice_of_other_than_integers_is_refused_by_name(mixtral):
    """model.moes[0.5:2] and model.layers[0.5:2] raised a list's bare TypeError."""
    _, wrapped = mixtral
    for name, counted in (("moes", "MoE blocks"), ("layers", "decoder layers")):
        for key in (slice(0.5, 2), slice("a", None), slice(None, None, 1.0)):
            with pytest.raises(moelens.LayerIndexError, match=rf"model.{name}\[slice\(.*\)\]: a slice takes integer "
                                                              rf"bounds \(or None\), as a list's does; there are 4 {counted}"):
                getattr(wrapped, name)[key]
        assert len(getattr(wrapped, name)[np.int64(1):torch.tensor(3)]) == 2  # integers of numpy and torch slice


def test_slices_of_layers_are_the_hf_slices(mixtral):
    hf, wrapped = mixtral
    layers = list(hf.model.layers)
    for key in (slice(None, None, -1), slice(-2, None), slice(1, 100), slice(0, 0)):
        assert [layer._module for layer in wrapped.layers[key]] == layers[key], key


# -- flags and scalars -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, want", [(True, True), (False, False), (np.bool_(True), True), (np.bool_(False), False)],
                         ids=["True", "False", "np-True", "np-False"])
def test_a_flag_is_true_or_false_as_a_python_bool(value, want):
    got = check_flag("flag", value)
    assert type(got) is bool and got is want


@pytest.mark.parametrize("value", ["False", "True", "", 0, 1, None, 0.0, 1.0, torch.tensor(True), np.array([True])],
                         ids=repr)
def test_anything_but_true_or_false_is_refused_as_a_flag(value):
    with pytest.raises(MoelensError, match=r"^flag must be True or False, got "):
        check_flag("flag", value)


def test_a_flag_is_refused_with_the_callers_error_class():
    with pytest.raises(FamilyError, match="replace must be True or False"):
        check_flag("replace", "no", FamilyError)


def test_flags_of_the_public_api_take_numpy_bools_and_refuse_text(mixtral):
    _, wrapped = mixtral
    ids = torch.tensor([[3, 4, 5, 6]])
    cache = moelens.analysis.collect_routing(wrapped, ids, progress=np.bool_(False), logits=np.bool_(False))
    assert cache is not None
    with pytest.raises(MoelensError, match=r"progress must be True or False, got 'False'"):
        moelens.analysis.collect_routing(wrapped, ids, progress="False")


def test_scalar_gives_numpy_scalars_and_one_element_arrays_as_python_numbers():
    for value, want in ((np.int64(3), 3), (np.float32(0.5), 0.5), (np.array([7]), 7), (torch.tensor([[2.5]]), 2.5)):
        got = scalar(value)
        assert type(got) is type(want) and got == want, value
    several = np.array([1, 2])
    assert scalar(several) is several
    meta = torch.empty((), dtype=torch.long, device="meta")
    assert scalar(meta) is meta  # no value to give: returned as it is, not an error


def test_ints_are_integers_never_bools_floats_or_several_values():
    for value, want in ((3, 3), (np.int64(-2), -2), (torch.tensor(4), 4), (torch.tensor([5]), 5), (np.array(6), 6)):
        got = as_int(value)
        assert type(got) is int and got == want, value
    for value in (True, np.bool_(False), torch.tensor(True), 3.0, np.float64(2.0), torch.tensor(2.0), "3",
                  np.array([3, 4]), torch.tensor([3, 4]), None):
        assert as_int(value) is None, value


def test_a_lone_int_has_no_axes():
    assert as_lone_int(3) == 3 and as_lone_int(np.array(3)) == 3 and as_lone_int(torch.tensor(-1)) == -1
    for value in (torch.tensor([3]), np.array([3]), torch.tensor([[3]]), [3]):
        assert as_lone_int(value) is None, value


def test_reals_are_numbers_never_bools():
    for value, want in ((1, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5), (np.int64(2), 2.0), (torch.tensor(3), 3.0),
                        (torch.tensor([1.5]), 1.5)):
        got = as_real(value)
        assert type(got) is float and got == want, value
    for value in (True, False, np.bool_(True), torch.tensor(True), "1.0", None, np.array([1.0, 2.0])):
        assert as_real(value) is None, value


# -- tiny builders ---------------------------------------------------------------------------------


def test_not_decorated_lists_exactly_the_families_without_a_decorated_experts_class():
    """A class decorated with transformers' ``use_experts_implementation`` runs its forward from
    transformers/integrations/moe.py; NOT_DECORATED must be exactly the families with none."""
    without = set()
    for family in FAMILIES:
        module = importlib.import_module(model_class(family).__module__)
        classes = [value for value in vars(module).values() if isinstance(value, type)
                   and issubclass(value, torch.nn.Module) and value.__module__ == module.__name__]
        assert any(cls.__name__.endswith("Experts") for cls in classes), family
        # ergo decorates ErgoExpertProjections, which its ErgoExperts calls through super().forward
        if not any(cls.forward.__code__.co_filename.endswith("integrations/moe.py") for cls in classes):
            without.add(family)
    assert without == set(NOT_DECORATED)


def test_tiny_config_never_changes_the_shared_overrides():
    """A config that fills in its rope_parameters in place (mistral4) changed TINY_OVERRIDES for the next build."""
    before = copy.deepcopy(TINY_OVERRIDES)
    for family in ("mistral4", "gpt_oss", "ernie4_5_vl_moe", "axk1", "glm4v_moe"):
        tiny_config(family)
        tiny_config(family)
    assert TINY_OVERRIDES == before


def test_reinitialised_tensors_are_seeded_per_name():
    """afmoe's zero-initialised routers are re-drawn seeded by the seed *and* the name: layers differ."""
    hf = tiny_model("afmoe", seed=3)
    state = hf.state_dict()
    routers = [name for name in hf._tiny_reinitialised if name.endswith("router.gate.weight")]
    assert len(routers) >= 2
    assert not torch.equal(state[routers[0]], state[routers[1]])
    again = tiny_model("afmoe", seed=3).state_dict()
    assert all(torch.equal(state[name], again[name]) for name in state)


def test_norm_weights_keep_the_init_transformers_gives_them():
    """qwen3_next's zero-centred norms (scale 1 + w) start at w = 0: re-drawing them would make every norm random.
    Truth: the same class built by transformers under the same seed, without moelens' re-initialisation."""
    family = "qwen3_next"
    torch.manual_seed(0)
    raw = model_class(family)._from_config(tiny_config(family), dtype=torch.float32)
    built = tiny_model(family, seed=0)
    norms = [name for name, module in raw.named_modules() if "norm" in type(module).__name__.lower()]
    checked = 0
    for name in norms:
        for leaf, value in raw.get_submodule(name).named_parameters(recurse=False):
            assert torch.equal(built.get_parameter(f"{name}.{leaf}").cpu(), value), f"{name}.{leaf}"
            checked += not value.any()
    assert checked >= 4  # the zero-initialised ones are among them


def test_zaya_balancing_biases_are_far_smaller_than_other_selection_biases():
    """zaya's router probabilities differ by ~1e-4: its balancing biases are drawn at std 1e-5 (others 0.01)."""
    zaya = [b for n, b in tiny_model("zaya").named_buffers() if n.endswith("balancing_biases")]
    assert zaya and all(b.any() and b.abs().max() < 1e-3 for b in zaya)
    afmoe = [b for n, b in tiny_model("afmoe").named_buffers() if n.endswith("expert_bias")]
    afmoe += [p for n, p in tiny_model("afmoe").named_parameters() if n.endswith("expert_bias")]
    assert afmoe and all(1e-3 < b.std() < 0.1 for b in afmoe)


def test_the_hash_routing_table_holds_k_distinct_experts_per_token():
    """deepseek_v4's hash-routed layer reads tid2eid[token]: k distinct experts in 0..E-1 for every token id."""
    hf = tiny_model("deepseek_v4")
    cfg = hf.config
    tables = [buffer for name, buffer in hf.named_buffers() if name.endswith("tid2eid")]
    assert tables
    for table in tables:
        assert table.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
        assert int(table.min()) >= 0 and int(table.max()) < cfg.n_routed_experts
        assert all(len(set(row)) == cfg.num_experts_per_tok for row in table.tolist())


def test_a_half_precision_tiny_model_keeps_the_strict_fp32_tensors_in_fp32():
    """from_config leaves flint's router and attention sinks in bf16; from_pretrained keeps them in fp32."""
    hf = tiny_model("flint", dtype=torch.bfloat16)
    strict = type(hf)._keep_in_fp32_modules_strict
    assert strict
    kept = [name for name, p in hf.named_parameters() if any(part in name for part in strict)]
    assert kept and all(dict(hf.named_parameters())[name].dtype == torch.float32 for name in kept)
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not hf.training


def test_tiny_inputs_hold_no_special_tokens_and_follow_the_seed():
    hf = tiny_model("olmoe")
    cfg = hf.config
    special = {cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id} - {None}
    assert special
    inputs = tiny_inputs(hf, batch=4, seq=64)
    ids = inputs["input_ids"]
    assert ids.shape == (4, 64) and int(ids.max()) < cfg.vocab_size
    assert not any(bool((ids == token).any()) for token in special)
    assert torch.equal(inputs["attention_mask"], torch.ones_like(ids))
    assert not torch.equal(tiny_inputs(hf, seed=1)["input_ids"], tiny_inputs(hf, seed=2)["input_ids"])
    assert torch.equal(tiny_inputs(hf, seed=2)["input_ids"], tiny_inputs(hf, seed=2)["input_ids"])


# -- moelens demo ----------------------------------------------------------------------------------


KEPT = 6  # tokens of each held-out window the spied demo routes (the whole windows take long on a busy machine)


@pytest.fixture
def demo_spies(monkeypatch):
    """Run ``moelens demo`` with its plots and its logit lens not drawn (the path of each is recorded), and record what it routes:
    the token-id corpora, the torch threads at the first routing, and the labels given to specialisation."""
    import sys

    from moelens.cli import main

    collect = sys.modules["moelens.analysis.collect"]
    special = sys.modules["moelens.analysis.specialisation"]
    plots = importlib.import_module("moelens.analysis.plots")
    seen = {"ids": [], "saved": []}
    real_collect, real_spec = collect.collect_routing, special.specialisation

    def spy_collect(model, corpus, **kwargs):
        seen.setdefault("threads", torch.get_num_threads())
        if isinstance(corpus, torch.Tensor):  # held-out windows: recorded whole, routed on their first tokens only
            seen["ids"].append(corpus.clone())
            corpus = corpus[:, :KEPT]
        return real_collect(model, corpus, **kwargs)

    def spy_spec(cache, labels, *args, **kwargs):
        seen["labels"] = labels.clone()
        windows = len(seen["ids"][-1])
        return real_spec(cache, labels.reshape(windows, -1)[:, :KEPT].flatten(), *args, **kwargs)

    def no_plot(figure, path, **kwargs):
        import matplotlib.pyplot as plt

        if figure is not None:
            plt.close(figure)
        seen["saved"].append(path.name)
        return path

    monkeypatch.setattr(collect, "collect_routing", spy_collect)
    monkeypatch.setattr(special, "specialisation", spy_spec)

    def no_lens(model, corpus, **kwargs):  # a stand-in lens over every decoder layer of the model
        from types import SimpleNamespace

        return SimpleNamespace(layers=list(range(model._module.config.num_hidden_layers)))

    def lens_plot(lens, layer, *args, **kwargs):
        seen["lens_layer"] = layer
        return None

    monkeypatch.setattr(plots, "save", no_plot)
    monkeypatch.setattr(plots, "plot_logit_lens", lens_plot)
    monkeypatch.setattr(sys.modules["moelens.analysis.logit_lens"], "expert_logit_lens", no_lens)
    threads = torch.get_num_threads()

    def run(*argv):
        try:
            return main(["demo", *map(str, argv)]), seen
        finally:
            torch.set_num_threads(threads)

    return run


def test_the_demo_routes_spread_held_out_windows_with_their_own_labels(tmp_path, demo_spies, capsys):
    """With --windows 3 the demo must route 3 windows spread over both streams (192 code, then 64 prose), label
    each token with its own window's classes, and run on --threads threads."""
    from safetensors.torch import load_file

    from moelens.data import HELDOUT_PATH, TINY_MODEL_PATH

    held = load_file(str(HELDOUT_PATH))
    rows = {tuple(row.tolist()): index for index, row in enumerate(held["input_ids"].long())}
    status, seen = demo_spies("--out", tmp_path / "demo", "--windows", 3, "--threads", 2)
    assert status == 0, capsys.readouterr().err
    assert seen["threads"] == 2
    (ids,) = seen["ids"]
    picked = [rows[tuple(row.tolist())] for row in ids.long()]
    assert len(set(picked)) == 3 and min(picked) == 0 and max(picked) == len(rows) - 1
    assert any(index >= 192 for index in picked) and any(index < 192 for index in picked)
    assert torch.equal(seen["labels"].long(), held["token_class"][picked].long().flatten())
    assert "heldout_specialisation.png" in seen["saved"]
    last = json.loads((TINY_MODEL_PATH / "config.json").read_text())["num_hidden_layers"] - 1
    assert seen["lens_layer"] == last and "logit_lens.png" in seen["saved"]  # docs/cli.md: the last layer's experts


def test_the_demo_with_no_windows_routes_no_held_out_windows(tmp_path, demo_spies, capsys):
    status, seen = demo_spies("--out", tmp_path / "demo", "--windows", 0)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert not seen["ids"] and "labels" not in seen
    assert "token_routing.png" in seen["saved"] and not [name for name in seen["saved"] if name.startswith("heldout_")]


@pytest.mark.parametrize("threads", ["0", "-2", "100000"])
def test_the_demo_refuses_a_thread_count_below_one_or_above_the_cores_in_one_line(tmp_path, monkeypatch, capsys,
                                                                                   threads):
    """torch.set_num_threads(0) raises a RuntimeError, and 100000 threads ran the machine out of memory (a hang, or a
    traceback): the demo must refuse them first, as a one-line error (status 2)."""
    from moelens.cli import main

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before --threads was checked")

    monkeypatch.setattr(analysis_cli, "load_model", no_work)
    before = torch.get_num_threads()
    status = main(["demo", "--out", str(tmp_path / "demo"), "--windows", "0", "--threads", threads])
    err = capsys.readouterr().err
    bound = "at least 1" if int(threads) < 1 else f"at most this machine's {os.cpu_count()} cores"
    assert status == 2 and err.strip() == f"moelens demo: error: --threads must be {bound}, got {threads}."
    assert torch.get_num_threads() == before
