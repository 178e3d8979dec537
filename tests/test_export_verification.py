"""to_nnef's verification refuses an archive whose tract output is off.

Ground truth: tract's real output on the archive, perturbed on the way back from tract
(``moelens.export.verification.run`` wrapped) by an amount chosen against tract's
"approximate" tolerance, taken relative to the output's size s (``|a - b| <= 1e-4 s + 5e-4 |b|``):
far beyond it the export must fail, well within it the export must pass; and archives edited on disk,
run in tract against the unwrapped model in torch. Needs the ``export`` extra.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("torch_to_nnef", reason="the export extra is not installed (pip install 'moelens[export]')")
pytest.importorskip("tract", reason="the export extra is not installed (pip install 'moelens[export]')")

import moelens  # noqa: E402
from moelens.export import Edits, ExportError, ExportRefused, run, to_nnef  # noqa: E402
from moelens.export import verification  # noqa: E402
from moelens.testing import TINY_OVERRIDES, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def block():
    """A tiny mixtral's first MoE block (expert size 32, so Q4_0 takes it)."""
    extra = {"num_hidden_layers": 2, "intermediate_size": 32}
    for key, value in TINY_OVERRIDES["mixtral"].items():
        if isinstance(value, list) and len(value) == 4 and key != "moe_layers":
            extra[key] = value[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return moelens.wrap(tiny_model("mixtral", **extra)).moes[0]


def perturb_tract(monkeypatch, shift: float) -> list[np.ndarray]:
    """Make tract's output (as to_nnef's check reads it) off by ``shift`` times the output's size (its largest
    magnitude) at its first element; returns what tract really gave, call by call."""
    real = verification.run
    seen = []

    def shifted(path, inputs):
        output = np.array(real(path, inputs), copy=True)
        seen.append(output.copy())
        output.flat[0] += shift * np.abs(output).max()
        return output

    monkeypatch.setattr(verification, "run", shifted)
    return seen


@pytest.mark.parametrize("quantize", [None, "q4_0"], ids=["float32", "q4_0"])
def test_export_fails_when_tract_differs_from_torch(block, quantize, tmp_path, monkeypatch):
    """tract off by 0.05 of the output's size (far beyond 'approximate') fails the export, naming the mismatch; the
    archive is kept.

    Guards against the float32 check, or the Q4_0 check against the export's own dequantized
    weights, passing whatever tract outputs.
    """
    seen = perturb_tract(monkeypatch, 0.05)
    path = tmp_path / "off.nnef.tgz"
    with pytest.raises(ExportError, match="tract's output differs from torch") as caught:
        to_nnef(block, path, quantize_experts=quantize)
    assert seen, "tract was not run"
    assert "The archive was written; please report this model." in str(caught.value)
    assert ("Q4_0" in str(caught.value)) == (quantize == "q4_0")
    assert path.exists()


def test_a_router_row_copied_onto_an_expert_with_other_weights_is_refused_before_anything_is_written(tmp_path):
    """A router row copied onto another expert with moe.params() (a use interventions.md names) makes the two tie on
    every token, and tract's top-k breaks the ties otherwise than torch's. The check after writing only failed where
    the example inputs put the tied pair across the top-k boundary: with the default inputs the export passed and the
    archive was silently wrong on other inputs (moelens-tiny: by up to 1.7). Such a tie is now refused up front,
    naming the layer and the experts, and nothing is written; a copy scaled by 1.01 exports."""
    model = moelens.wrap(tiny_model("mixtral"))
    moe = model.moes[2]
    with torch.no_grad():
        moe.params(3).router.copy_(moe.params(5).router)
    weights = moe.params()  # ground truth from the weights: the rows tie, the experts compute differently
    assert torch.equal(weights.router[3], weights.router[5]) and not torch.equal(weights.down[3], weights.down[5])
    assert moe.top_k < moe.num_experts
    path = tmp_path / "tied.nnef.tgz"
    with pytest.raises(ExportRefused, match=r"a router gives two experts the same row but not the same weights, so "
                                            r"their logits tie on every token \(layer 2: experts 3 and 5\), and tract's "
                                            r"top-k breaks ties otherwise than torch's: .* Make the rows differ \(e\.g\. "
                                            r"scale a copied row by 1\.01\) or route around one of the experts"):
        to_nnef(model, path)
    assert not path.exists()
    with pytest.raises(ExportRefused, match=r"\(layer 2: experts 3 and 5\)"):  # the block on its own, too
        to_nnef(moe, tmp_path / "tied-block.nnef.tgz")
    assert not (tmp_path / "tied-block.nnef.tgz").exists()
    with torch.no_grad():
        moe.params(3).router.mul_(1.01)
    assert to_nnef(model, tmp_path / "apart.nnef.tgz").verification.tolerance is not None


def test_an_expert_duplicated_whole_exports_and_matches_tract_on_other_inputs(tmp_path):
    """An expert copied whole (router row and weights) ties too, but either pick computes the same, so the tie changes
    nothing: the export goes on, and the archive run in tract matches the unwrapped model in torch on inputs other
    than the ones it was checked on."""
    hf = tiny_model("mixtral")
    model = moelens.wrap(hf)
    moe = model.moes[2]
    with torch.no_grad():
        source, copied = moe.params(5), moe.params(3)
        for name in ("router", "gate", "up", "down"):
            getattr(copied, name).copy_(getattr(source, name))
    path = tmp_path / "duplicated.nnef.tgz"
    assert to_nnef(model, path).verification.tolerance is not None
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(3, hf.config.vocab_size, (1, 8), generator=generator)
        with torch.no_grad():
            expected = hf(input_ids=ids, use_cache=False).logits.numpy()
        error = np.abs(run(path, ids) - expected).max()
        assert error <= 1e-3 * np.abs(expected).max(), error


def test_only_ties_between_experts_that_compute_differently_and_that_top_k_can_split_matter(block):
    """The refusal's rule, on the spec read from the weights: a copied router row ties the two experts; the tie matters
    unless the experts' weights are equal too, or k covers every expert not routed around. Past three blocks the
    refusal names the first three."""
    from dataclasses import replace

    from moelens.export.spec import read_spec, refuse_ties

    spec = read_spec(block.family, block._module, block.layer)
    wg = spec.wg.clone()
    wg[1] = wg[3]
    tied = spec.with_weights(wg=wg)
    assert tied.ties_that_matter() == [(1, 3)]
    whole = tied.clone()
    for name in ("w1", "w2", "w3"):
        getattr(whole, name)[1] = getattr(whole, name)[3]
    assert whole.ties_that_matter() == []  # the same expert twice: either pick computes the same
    ablated = tied.clone()
    ablated.w2[[1, 3]] = 0.0
    assert ablated.ties_that_matter() == []  # both ablated (zero output): either pick adds nothing
    ablated.w2[3, 0, 0] = 1.0
    assert ablated.ties_that_matter() == [(1, 3)]
    bias = torch.full((wg.shape[0],), float("-inf"))
    bias[[1, 3]] = 0.0
    assert tied.with_weights(wg_bias=bias).ties_that_matter() == []  # k=2 of the 2 selectable: both always chosen
    with pytest.raises(ExportRefused, match=r"\(layer 0: experts 1 and 3; layer 1: experts 1 and 3; layer 2: experts "
                                            r"1 and 3 \.\.\.\)"):
        refuse_ties([whole] + [replace(tied, layer=layer) for layer in range(4)])
    refuse_ties([whole, spec])  # nothing that matters: no refusal


def test_tied_experts_are_selectable_experts_with_the_same_router_row_and_bias(block):
    from moelens.export.spec import read_spec

    spec = read_spec(block.family, block._module, block.layer)
    wg = spec.wg.clone()
    wg[1] = wg[3]
    assert spec.with_weights(wg=wg).tied_experts() == [(1, 3)]
    near = wg.clone()
    near[1] = wg[3] * (1 + 1e-7)
    assert spec.with_weights(wg=near).tied_experts() == [(1, 3)]
    apart = wg.clone()
    apart[1] = wg[3] * 1.01
    assert spec.with_weights(wg=apart).tied_experts() == []
    bias = torch.zeros(wg.shape[0])
    assert spec.with_weights(wg=wg, wg_bias=bias + torch.eye(wg.shape[0])[1]).tied_experts() == []  # a steer apart
    routed_around = bias.clone()
    routed_around[[1, 3]] = float("-inf")
    assert spec.with_weights(wg=wg, wg_bias=routed_around).tied_experts() == []  # never chosen: no tie to break


@pytest.mark.parametrize("quantize", [None, "q4_0"], ids=["float32", "q4_0"])
def test_export_passes_when_tract_is_within_tolerance(block, quantize, tmp_path, monkeypatch):
    """tract off by 1e-6 of the output's size (well within 'approximate') still passes: the failure above is the
    check, not noise."""
    seen = perturb_tract(monkeypatch, 1e-6)
    report = to_nnef(block, tmp_path / "close.nnef.tgz", quantize_experts=quantize)
    assert seen and report.verification is not None


@pytest.mark.parametrize(("times", "fails"), [(3.0, True), (0.5, False)], ids=["3x-bound", "half-bound"])
def test_the_check_is_tracts_approximate_bound_itself(block, times, fails, tmp_path, monkeypatch):
    """tract's first output element moved by a multiple of the bound 1e-4 s + 5e-4 |b| (s: the output's largest
    magnitude): three times fails, half passes (a check loosened a hundredfold passed the 0.05 shift above's
    neighbours unseen)."""
    real = verification.run

    def moved(path, inputs):
        output = np.array(real(path, inputs), copy=True)
        size = float(np.abs(output).max())
        output.flat[0] += times * (1e-4 * size + 5e-4 * abs(float(output.flat[0])))
        return output

    monkeypatch.setattr(verification, "run", moved)
    if fails:
        with pytest.raises(ExportError, match="beyond tract's 'approximate' tolerance"):
            to_nnef(block, tmp_path / "off.nnef.tgz")
    else:
        assert to_nnef(block, tmp_path / "close.nnef.tgz").verification is not None


def _scale_tensor_file(path, factor: float) -> None:
    """Multiply the float32 values of an NNEF tensor file (a 128-byte header, then the data) by ``factor``."""
    raw = path.read_bytes()
    data = np.frombuffer(raw[128:], dtype=np.float32) * np.float32(factor)
    path.write_bytes(raw[:128] + data.astype(np.float32).tobytes())


def test_verify_refuses_a_wrong_archive_of_a_block_with_small_outputs(tmp_path):
    """olmoe's tiny block outputs at most about 3e-4, below tract's absolute 1e-4 at 'approximate': an archive
    whose experts' down projections were scaled by 0.8 on disk (tract 20% off the unwrapped block in torch) was
    reported as meeting it. The levels now count relative to the output's size."""
    hf = tiny_model("olmoe")
    reference = copy.deepcopy(hf).eval()
    block = moelens.wrap(hf).moes[0]
    path = tmp_path / "olmoe"
    to_nnef(block, path)
    _scale_tensor_file(path / "mlp_output_w2.dat", 0.8)
    hidden = torch.randn(1, 8, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference.get_submodule(block.path.removeprefix("model."))(hidden)
    expected = (expected[0] if isinstance(expected, tuple) else expected).numpy()
    tract_output = run(path, hidden)
    size = np.abs(expected).max()
    assert size < 1e-3 and np.abs(tract_output - expected).max() > 0.1 * size  # small outputs, 10%+ off
    checked = verification.verify(path, block, hidden)
    assert not checked.meets("approximate") and checked.scale == pytest.approx(size, rel=1e-3)


def test_an_archive_of_large_outputs_passes_at_float32_rounding(tmp_path):
    """A block whose outputs reach about 3e5 (expert weights x10, inputs x300) was refused ('please report this
    model'), though tract matches the unwrapped block in torch to float32 rounding of the output's size: outputs
    that cancel to near 0 got only the absolute 1e-4."""
    hf = tiny_model("mixtral")
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "experts" in name:
                param.mul_(10)
    reference = copy.deepcopy(hf).eval()
    block = moelens.wrap(hf).moes[0]
    hidden = torch.randn(1, 64, hf.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 300
    report = to_nnef(block, tmp_path / "large", example_inputs=hidden)
    with torch.no_grad():
        expected = reference.get_submodule(block.path.removeprefix("model."))(hidden)
    expected = (expected[0] if isinstance(expected, tuple) else expected).numpy()
    size = np.abs(expected).max()
    assert size > 1e4 and np.abs(run(tmp_path / "large", hidden) - expected).max() < 1e-5 * size
    assert report.verification.meets("approximate")


# -- baked edits, the block self-check and group refusals, against independent ground truth ----------


def _gpt_oss_block():
    """A tiny gpt_oss (2 layers) and 16 tokens of hidden states for its first MoE block (layer 0)."""
    from test_export import small

    hf = small("gpt_oss")
    hidden = torch.randn(2, 8, hf.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(hf.device)
    return hf, hidden


def _block_output(module, hidden) -> torch.Tensor:
    with torch.no_grad():
        output = module(hidden)
    return output[0] if isinstance(output, tuple) else output


def test_a_baked_steer_adds_to_a_large_router_bias(tmp_path):
    """Steering adds to the router's own bias (here large: -2 on the steered expert, up to +-2 elsewhere).

    Ground truth: a copy of the block with the bias raised by hand, run in torch; the archive in tract must
    match it. Guards against the bake overwriting the router bias with the steer (expert 4 would then get
    +2.5 instead of +0.5 and be picked by most tokens); the tiny model's own router bias (~0.01) cannot.
    """
    from test_export import close

    hf, hidden = _gpt_oss_block()
    mlp = hf.model.layers[0].mlp
    with torch.no_grad():
        mlp.router.weight.mul_(20.0)  # logits of a few units: the selection depends on the token
        mlp.router.bias.copy_(torch.tensor([2.0, -2.0, 1.0, -1.0, -2.0, 0.5, -1.5, 0.0]))
    moe = moelens.wrap(hf).moes[0]
    raised, overwritten = copy.deepcopy(mlp), copy.deepcopy(mlp)
    with torch.no_grad():
        raised.router.bias[4] += 2.5
        overwritten.router.bias[4] = 2.5
    expected = _block_output(raised, hidden)
    assert (expected - _block_output(mlp, hidden)).abs().max() > 1e-2  # the steer changes the block
    assert (expected - _block_output(overwritten, hidden)).abs().max() > 1e-2  # and adding is not overwriting
    edits = Edits(steer={moe.layer: {4: 2.5}})
    report = to_nnef(moe, tmp_path / "steered.nnef.tgz", example_inputs=hidden, edits=edits)
    close(run(report.path, hidden), expected)


def test_a_baked_swap_exchanges_the_experts_biases_too(tmp_path):
    """Swapping two gpt_oss experts exchanges their gate_up/down weights and their biases.

    Ground truth: a copy of the block with gate_up_proj, gate_up_proj_bias, down_proj and down_proj_bias
    exchanged by hand between experts 1 and 2, run in torch; the archive in tract must match it.
    """
    from test_export import close

    hf, hidden = _gpt_oss_block()
    experts = hf.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for bias in (experts.gate_up_proj_bias, experts.down_proj_bias):
            bias.copy_(0.5 * torch.randn(bias.shape, generator=generator))
    moe = moelens.wrap(hf).moes[0]
    exchanged, weights_only = copy.deepcopy(hf.model.layers[0].mlp), copy.deepcopy(hf.model.layers[0].mlp)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            for mlp in (exchanged, weights_only) if not name.endswith("bias") else (exchanged,):
                tensor = getattr(mlp.experts, name)
                tensor[[1, 2]] = tensor[[2, 1]].clone()
    expected = _block_output(exchanged, hidden)
    assert (expected - _block_output(hf.model.layers[0].mlp, hidden)).abs().max() > 1e-2  # the swap changes the block
    assert (expected - _block_output(weights_only, hidden)).abs().max() > 1e-2  # and the biases matter
    edits = Edits(swap={moe.layer: {1: 2, 2: 1}})
    report = to_nnef(moe, tmp_path / "swapped.nnef.tgz", example_inputs=hidden, edits=edits)
    close(run(report.path, hidden), expected)


def test_the_block_self_check_refuses_a_block_off_by_a_tenth_of_a_percent(block):
    """check_block refuses a block whose output is 1.001 times what its family entry computes (an error of 1e-3
    relative to the output, far above its 1e-5 bound), naming the factor; the same block unscaled passes."""
    from moelens.export.block import check_block
    from moelens.export.spec import read_spec

    family = block.family
    module = copy.deepcopy(block._module).float().eval().cpu()  # check_block runs on the CPU
    with torch.no_grad():
        module.experts.down_proj.mul_(1000.0)  # an output scale of a few units (the tiny block's is ~0.004)
    spec = read_spec(family, module, block.layer)
    x = torch.randn(2, 32, spec.wg.shape[1], generator=torch.Generator().manual_seed(0))  # check_block's inputs
    scale = float(_block_output(module, x).abs().max())
    assert 1e-3 * scale > 1e-5 * max(1.0, scale)  # the scaling is beyond the bound on these inputs
    assert check_block(family, module, spec) <= 1e-5 * max(1.0, scale)  # the real block passes
    real = module.experts.forward
    module.experts.forward = lambda *args, **kwargs: 1.001 * real(*args, **kwargs)
    with pytest.raises(ExportRefused, match=r"1\.001 times what tract_moe_ffn computes"):
        check_block(family, module, spec)


def test_group_limited_selection_of_3_of_4_groups_is_refused(tmp_path):
    """deepseek_v3 picking experts inside its best 3 of 4 groups (not all groups) is refused, naming it; with all
    4 groups the refusal names only the correction bias."""
    from test_export import small

    moe = moelens.wrap(small("deepseek_v3", n_group=4, topk_group=3)).moes[0]
    path = tmp_path / "groups.nnef.tgz"
    with pytest.raises(ExportRefused, match=r"group-limited expert selection \(the best 3 of 4 groups\)"):
        to_nnef(moe, path)
    assert not path.exists()
    every = moelens.wrap(small("deepseek_v3", n_group=4, topk_group=4)).moes[0]
    with pytest.raises(ExportRefused, match="correction bias") as caught:
        to_nnef(every, tmp_path / "all-groups.nnef.tgz")
    assert "group-limited" not in str(caught.value)


def _drop_output_property(folder) -> None:
    """Make a folder export look like one written before archives recorded their output (no moelens_output)."""
    graph = folder / "graph.nnef"
    text = graph.read_text()
    kept = "\n".join(line for line in text.splitlines() if '"moelens_output"' not in line)
    graph.write_text(kept.replace('"),\n  ];', '")\n  ];') + "\n")


def test_verify_names_a_base_model_archive_checked_against_its_causal_lm_and_the_reverse(tmp_path):
    """An archive of the base model (moelens.wrap(causal_lm.model): last_hidden_state) verified against the causal LM
    (wrapped or raw), or a causal LM's archive against its base model, agree on kind, family, layers and vocabulary,
    so verify ran both and failed with a bare "tract's output has shape (1, 8, 32), torch's (1, 8, 128)". The archive
    now records its output (moelens_output) and verify names both outputs and what to pass; an archive without the
    property (written before) is still accepted."""
    from moelens.export.runner import properties
    from moelens.testing import tiny_inputs
    from test_export import small

    hf = small("qwen3_moe")
    ids = tiny_inputs(hf, batch=1, seq=8)["input_ids"]
    base = tmp_path / "base.nnef.tgz"
    to_nnef(moelens.wrap(copy.deepcopy(hf).model), base, example_inputs=ids, verify=False)
    lm = tmp_path / "lm"
    to_nnef(moelens.wrap(hf), lm, example_inputs=ids, verify=False)
    with torch.no_grad():  # ground truth: the unwrapped models' own outputs, and tract's on each archive
        hidden = copy.deepcopy(hf).model(input_ids=ids).last_hidden_state.numpy()
        logits = copy.deepcopy(hf)(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(run(base, ids), hidden, atol=1e-4, rtol=1e-3)
    np.testing.assert_allclose(run(lm, ids), logits, atol=1e-4, rtol=1e-3)
    assert hidden.shape != logits.shape

    for given in (moelens.wrap(hf), hf):
        with pytest.raises(ExportError, match=r"base\.nnef\.tgz computes last_hidden_state but the model given computes "
                                              r"logits.*against the base model .*moelens\.wrap\(causal_lm\.model\)"):
            verification.verify(base, given, ids)
    with pytest.raises(ExportError, match=r"computes logits but the model given computes last_hidden_state.*"
                                          r"the causal LM: moelens\.wrap\(causal_lm\)"):
        verification.verify(lm, moelens.wrap(copy.deepcopy(hf).model), ids)
    assert properties(base)["moelens_output"] == "last_hidden_state" and properties(lm)["moelens_output"] == "logits"
    assert verification.verify(base, moelens.wrap(copy.deepcopy(hf).model), ids).meets("approximate")
    assert verification.verify(lm, hf, ids).meets("approximate")

    _drop_output_property(lm)  # an archive written before outputs were recorded: accepted, not checked
    assert "moelens_output" not in properties(lm)
    assert verification.verify(lm, moelens.wrap(hf), ids).meets("approximate")
    with pytest.raises(ExportError, match=r"tract's output has shape \(1, 8, 128\), torch's \(1, 8, 32\)"):
        verification.verify(lm, hf.model, ids)


def test_zeroed_router_rows_are_refused_with_advice_that_removes_the_experts(tmp_path):
    """Two router rows zeroed with moe.params() tie at 0 on every token. Scaling a zero row (the copied-row advice)
    keeps the tie, so the refusal names the zero rows and points to route-around or zeroed down projections; both
    export, and the archive run in tract matches the unwrapped model in torch."""
    hf = tiny_model("mixtral")
    model = moelens.wrap(hf)
    moe = model.moes[2]
    with torch.no_grad():
        moe.params(1).router.zero_()
        moe.params(4).router.zero_()
    path = tmp_path / "zeroed.nnef.tgz"
    with pytest.raises(ExportRefused, match=r"\(layer 2: experts 1 and 4\).* The router rows of layer 2's experts 1, 4 "
                                            r"are all zero: a zero row does not remove an expert .* Route around those "
                                            r"experts instead .* or zero their down projections too"):
        to_nnef(model, path)
    assert not path.exists()
    routed_around = to_nnef(model, path, edits=Edits(route_around={2: [1, 4]}))
    assert routed_around.verification.tolerance is not None
    with torch.no_grad():
        moe.params(1).down.zero_()
        moe.params(4).down.zero_()
    assert to_nnef(model, tmp_path / "zero-down.nnef.tgz").verification.tolerance is not None
    ids = torch.randint(3, hf.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids=ids, use_cache=False).logits.numpy()
    error = np.abs(run(tmp_path / "zero-down.nnef.tgz", ids) - expected).max()
    assert error <= 1e-3 * np.abs(expected).max(), error


def test_steered_saturated_sigmoid_scores_of_flint_name_the_tie_tract_breaks_otherwise(tmp_path):
    """flint selects on sigmoid scores, which float32 rounds to 1.0 above a logit of about 16.6; three experts
    steered by 30 (k = 2) tie there, and torch.topk takes them by index where tract ranks the logits. The export
    failed with "please report this model"; it names the cause. Ground truth: the real tract runtime, which differs."""
    make = lambda: tiny_model("flint", num_hidden_layers=2, norm_topk_prob=False)  # noqa: E731 - the exportable config
    wrapped = moelens.wrap(make())
    layer = wrapped.moes[-1].layer
    ids = torch.randint(0, wrapped._module.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ExportError, match=r"The archive was written; flint select experts on sigmoid scores, which "
                                          r"float32 rounds to exactly 1\.0 above a logit of about 16\.6"):
        to_nnef(wrapped, tmp_path / "steered.nnef.tgz", edits=Edits(steer={layer: {1: 30.0, 4: 30.0, 6: 30.0}}),
                example_inputs=ids)
    to_nnef(moelens.wrap(make()), tmp_path / "mild.nnef.tgz", edits=Edits(steer={layer: {1: 3.0, 4: 3.0, 6: 3.0}}),
            example_inputs=ids)  # below saturation tract agrees
